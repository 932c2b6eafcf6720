"""Attention heads removed from a BERT-like encoder, and a pruned encoder read back: one way under
transformers 4.57 and 5.

transformers 4.57 pruned heads itself (``PreTrainedModel.prune_heads`` sliced the query, key, value
and attention-output Linears; the config's ``pruned_heads`` made ``from_pretrained`` slice them
again before loading the weights); transformers 5 removed both. slimml slices the Linears itself
(:func:`remove_heads`) and records the removed heads in ``pruned_heads`` as 4.57 did, so 4.57
(and optimum-onnx, which loads with it) still reads a pruned folder by itself, and slimml's own
loads (the torch exporter, the check's reference) go through :func:`from_pretrained`, which removes
the recorded heads after ``from_pretrained`` under either version.

A head is ``attention_head_size`` consecutive rows of the query, key and value weights and the same
columns of the attention output's; both versions' attention reads ``num_attention_heads`` (4.57),
``attention_head_size`` and ``all_head_size`` from the module, never the config, so the module's
own numbers are all that change.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slimml.errors import SourceError

BERT_LIKE = ("bert", "roberta", "xlm-roberta", "electra", "camembert")


def remove_heads(model: Any, keep: dict[int, list[int]]) -> None:
    """Keep only the attention heads ``keep[layer]`` (numbered as the layer has them now) of a BERT-like
    encoder, in place; the config's ``pruned_heads`` records every removed head in the original numbering.

    Example:
        >>> remove_heads(model, {0: [0, 2], 1: [1, 3]})  # 4 heads -> 2 in layers 0 and 1
    """
    import torch

    config = model.config
    record = recorded_heads(config)
    for i, layer in enumerate(model.base_model.encoder.layer):
        heads = sorted(set(keep.get(i, ())))
        att = layer.attention.self
        if i not in keep or len(heads) == att.num_attention_heads:
            continue
        d = att.attention_head_size
        rows = torch.tensor([h * d + r for h in heads for r in range(d)], dtype=torch.long)
        att.query = slice_linear(att.query, rows, dim=0)
        att.key = slice_linear(att.key, rows, dim=0)
        att.value = slice_linear(att.value, rows, dim=0)
        layer.attention.output.dense = slice_linear(layer.attention.output.dense, rows, dim=1)
        att.num_attention_heads, att.all_head_size = len(heads), len(heads) * d
        present = [h for h in range(config.num_attention_heads) if h not in record.get(i, ())]  # now -> original
        record[i] = sorted(set(range(config.num_attention_heads)) - {present[h] for h in heads})
        if hasattr(layer.attention, "pruned_heads"):  # transformers 4.57's own record, kept consistent
            layer.attention.pruned_heads = set(record[i])
    config.pruned_heads = {i: h for i, h in sorted(record.items()) if h}


def recorded_heads(config: Any) -> dict[int, list[int]]:
    """The heads a config records as removed, ``{layer: [head, ...]}`` in the original numbering
    (transformers 5 keeps the JSON's string keys; 4.57 made them ints)."""
    return {int(k): sorted(int(h) for h in v) for k, v in (getattr(config, "pruned_heads", None) or {}).items() if v}


def from_pretrained(load: Callable[..., Any], folder: str | os.PathLike, **kwargs: Any) -> Any:
    """``load(folder, **kwargs)`` (a ``from_pretrained``), with the heads the folder's config records as
    pruned (``pruned_heads``) removed by slimml, the same under transformers 4.57 and 5; a folder
    without them is loaded as ``load`` loads it.

    The recorded heads' weights do not fit the unpruned layers the config describes: they are loaded
    as ``ignore_mismatched_sizes`` leaves them, the heads removed, and the folder's own tensors
    copied into the sliced Linears.

    Example:
        >>> model = from_pretrained(lambda f, **kw: AutoModel.from_pretrained(f, **kw), "student/")

    Raises:
        SourceError: the folder's attention weights do not have the shapes its ``pruned_heads`` gives.
    """
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    try:  # the plain JSON first: a folder without a record is loaded exactly as before
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    if not (isinstance(raw, dict) and raw.get("pruned_heads") and raw.get("model_type") in BERT_LIKE):
        return load(folder, **kwargs)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    removed = recorded_heads(config)
    config.pruned_heads = {}  # 4.57 would remove them before loading (5 ignores the key): slimml does it after
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its report of the mismatched (recorded) heads is expected: not shown
    try:
        model = load(folder, config=config, ignore_mismatched_sizes=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    every = range(config.num_attention_heads)
    remove_heads(model, {i: [h for h in every if h not in heads] for i, heads in removed.items()})
    _copy_attention(model, Path(folder), list(removed))
    return model


def _copy_attention(model: Any, folder: Path, layers: list[int]) -> None:
    """The folder's attention tensors of ``layers`` into the model's (sliced) ones, by name below
    ``encoder.layer.`` (a classifier's checkpoint prefixes them with ``bert.``, a base model not);
    any other tensor whose shape differs from the model's is refused (it was loaded as random)."""
    import torch

    from slimml.convert.weights import open_weights

    weights = open_weights(folder)
    names = set(weights.names())
    stored = {n[n.index("encoder.layer."):]: n for n in names if "encoder.layer." in n}
    attention = tuple(f"encoder.layer.{i}.attention." for i in layers)
    prefix = getattr(model, "base_model_prefix", "") or ""
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = name[name.find("encoder.layer."):] if "encoder.layer." in name else ""
            if not key.startswith(attention):  # ignore_mismatched_sizes would have left any other mismatch random
                same = next((n for n in (name, name.removeprefix(f"{prefix}."), f"{prefix}.{name}") if n in names), None)
                if same is not None and list(weights.shape(same)) != list(param.shape):
                    raise SourceError(
                        f"{folder}: the weight {same} has shape {list(weights.shape(same))}, not the {list(param.shape)} "
                        "its config gives; save the pruned model again with save_pretrained.")
                continue
            tensor = weights.torch(stored[key]) if key in stored else None
            if tensor is None or tuple(tensor.shape) != tuple(param.shape):
                raise SourceError(
                    f"{folder}: the weight {key} has shape {None if tensor is None else list(tensor.shape)}, not the "
                    f"{list(param.shape)} its config's pruned_heads gives; save the pruned model again with "
                    "save_pretrained.")
            param.copy_(tensor.to(param.dtype))


def slice_linear(lin: Any, idx: Any, dim: int) -> Any:
    """A new Linear keeping output rows (dim 0) or input columns (dim 1) ``idx``."""
    import torch

    weight = lin.weight.detach().index_select(dim, idx).clone()
    out_f, in_f = weight.shape
    new = torch.nn.Linear(in_f, out_f, bias=lin.bias is not None, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        new.weight.copy_(weight)
        if lin.bias is not None:
            new.bias.copy_(lin.bias.detach()[idx] if dim == 0 else lin.bias.detach())
    return new
