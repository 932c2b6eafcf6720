"""Export a Hugging Face folder through ``torch.onnx.export``, without optimum-onnx.

optimum-onnx 0.1.0, the traced exporter, needs transformers < 4.58; this one works with the
installed transformers, 4.57 or 5. It writes the single-graph models (encoders and
sentence-transformers, classifiers, masked LMs, extractive QA, ViT) with optimum's input and output
names and dynamic axes, so the splitter, the runtime's tasks and the quantizers see the same graph.
Decoders go through the fused exporter (``convert.fused_llama``) where it writes them, else with
their cache through ``convert.export_torch_decoder``; CLIP as optimum writes it (both towers in one
graph, split by ``convert.towers``); encoder-decoders and other two-tower models still need optimum-onnx.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slimml.errors import ExportError

# task -> the model's outputs as optimum names them, and whether they have a sequence axis
TORCH_TASKS = {
    "feature-extraction": (("last_hidden_state",), True),
    "text-classification": (("logits",), False),
    "token-classification": (("logits",), True),
    "fill-mask": (("logits",), True),
    "question-answering": (("start_logits", "end_logits"), True),
    "image-classification": (("logits",), False),
}
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# a CLIP model's one graph as optimum writes it: both towers and their similarities (convert.towers splits it)
TOWER_INPUTS = ("input_ids", "pixel_values", "attention_mask")
TOWER_OUTPUTS = ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds")
TWO_TOWERS = ("clip", "siglip")  # model types written as TOWER_OUTPUTS (CLIP: zero-shot by softmax over exp(logit_scale) *
# cosine; SigLIP: each label's sigmoid, with its logit bias; its text tower takes no attention mask, as optimum writes it)
DEFAULT_OPSET = 17


def encoder_only(config: dict[str, Any], task: str) -> str | None:
    """The class of an encoder-decoder's encoder saved alone (``T5EncoderModel``: GTR, sentence-T5,
    saved by sentence-transformers), asked for its token states; else None. (Its config is T5's,
    which transformers' feature-extraction and optimum would read as the whole encoder-decoder.)"""
    names = config.get("architectures") or []
    cls = names[0] if len(names) == 1 and isinstance(names[0], str) else ""
    return cls if task == "feature-extraction" and cls.endswith("EncoderModel") else None


def torch_export_reason(folder: Path, task: str, config: dict[str, Any]) -> str | None:
    """Why ``export_torch`` cannot write ``folder`` as ``task`` (one line), or None when it can."""
    if encoder_only(config, task) or config.get("model_type") in TWO_TOWERS and task == "feature-extraction":
        return None
    if config.get("is_encoder_decoder") or "text_config" in config or "vision_config" in config:
        return "the torch exporter writes single-graph models, CLIP and SigLIP, not encoder-decoders or other two-tower models"
    if task not in TORCH_TASKS:
        return f"the torch exporter writes {', '.join(TORCH_TASKS)} and causal LMs, not {task!r}"
    return None


def export_torch(folder: Path, onnx_path: Path, task: str, opset: int | None = None) -> None:
    """Write ``folder``'s model for ``task`` to ``onnx_path`` (weights as external data beside it
    when over 2 GB), inputs and outputs named as optimum names them, batch (and sequence) dynamic
    (a causal LM: ``convert.export_torch_decoder``; an encoder saved alone, :func:`encoder_only`,
    as its own class)."""
    import json

    import torch
    import transformers
    from optimum.exporters.tasks import TasksManager  # optimum's task -> model class map (base optimum, any transformers)

    from slimml.convert.distill.prune_heads import from_pretrained  # a pruned encoder's folder reads the same way

    encoder = encoder_only(json.loads((folder / "config.json").read_text()), task)
    load = (getattr(transformers, encoder).from_pretrained if encoder and hasattr(transformers, encoder)
            else lambda f, **kw: TasksManager.get_model_from_task(task, f, library_name="transformers", **kw))
    try:
        model = from_pretrained(lambda f, **kw: load(str(f), local_files_only=True, attn_implementation="eager",
                                                     torch_dtype=torch.float32, **kw), folder).float()
        # a float32 graph: transformers 5 loads bf16 files as bf16
    except Exception as e:
        raise ExportError(f"transformers could not load {folder} as {task!r} ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0]}); pass --task with the model's task.") from None
    model.eval()
    if model.config.model_type in TWO_TOWERS:  # texts and images in one graph, as optimum writes CLIP
        names, example, dynamic = _tower_inputs(model)
        trace(_outputs_module(model, names, TOWER_OUTPUTS).eval(), example, onnx_path, names, TOWER_OUTPUTS, dynamic, opset,
              failed=lambda why: f"torch.onnx.export could not write {folder}'s two towers ({why}); install optimum-onnx "
                                 "with transformers 4.57 (pip install 'transformers==4.57.6' 'optimum-onnx==0.1.0').")
        return
    names, example, dynamic = _inputs(folder, model, task)
    outputs, per_position = TORCH_TASKS[task]
    wrapper = _outputs_module(model, names, outputs, _takes_additive_mask(model, names, example, outputs)).eval()
    per_position = per_position and names[0] != "pixel_values"  # a ViT's hidden states: its patch count is fixed
    dynamic.update({o: {0: "batch_size", **({1: "sequence_length"} if per_position else {})} for o in outputs})
    trace(wrapper, example, onnx_path, names, outputs, dynamic, opset,
          failed=lambda why: f"torch.onnx.export could not write {folder} as {task!r} ({why}); install optimum-onnx "
                             "with transformers 4.57 (pip install 'transformers==4.57.6' 'optimum-onnx==0.1.0') and "
                             "pass --exporter optimum.")


def trace(wrapper: Any, example: tuple[Any, ...], onnx_path: Path, names: tuple[str, ...], outputs: tuple[str, ...],
          dynamic: dict[str, dict[int, str]], opset: int | None, failed: Callable[[str], str],
          patches: Any = None, custom_opsets: dict[str, int] | None = None) -> None:
    """``torch.onnx.export`` of ``wrapper`` (TorchScript tracing, constants folded) to ``onnx_path``,
    then named as optimum names its graphs (:func:`_as_optimum_writes`). ``patches``: a context
    manager held while tracing; ``custom_opsets``: the domains of ops a patch writes (ONNX Runtime's
    ``com.microsoft``); ``failed(why)``: the one-line message when the trace fails."""
    import torch

    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with torch.no_grad(), warnings.catch_warnings(), patches or contextlib.nullcontext():
            warnings.simplefilter("ignore")
            torch.onnx.export(wrapper, example, str(onnx_path), input_names=list(names), output_names=list(outputs),
                              dynamic_axes=dynamic, opset_version=opset or DEFAULT_OPSET, dynamo=False,
                              do_constant_folding=True, custom_opsets=custom_opsets)
    except Exception as e:
        raise ExportError(failed(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")) from None
    _as_optimum_writes(onnx_path)


def _as_optimum_writes(onnx_path: Path) -> None:
    """The exported graph named and shaped as optimum's (4.57) is: the wrapper's scope dropped from
    the names (:func:`_drop_wrapper_scope`) and the head counts spelled out (:func:`_spell_out_heads`),
    so the splitter cuts the same layers and ONNX Runtime's attention fusion matches as it does there."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)  # names and shapes only: weights stay where they are
    _drop_wrapper_scope(model.graph)
    _spell_out_heads(model)
    _scale_as_division(model.graph)
    onnx.save(model, str(onnx_path))


def _takes_additive_mask(model: Any, names: tuple[str, ...], example: tuple[Any, ...], outputs: tuple[str, ...]) -> bool:
    """Whether ``model`` computes the same with the additive mask ``(1 - mask) * min`` of shape
    (batch, 1, 1, seq) as with its 2-D ``attention_mask``: the mask transformers 4.57 built, four
    small ops ONNX Runtime's attention fusion traces back to the input. transformers 5 builds a
    boolean mask through ~50 ops (``Range``, ``GreaterOrEqual``, ``Where``) that it does not, so a
    quantized encoder kept unfused attention (measured: batch-1 latency 1.06-1.16x on all-MiniLM-L6-v2).
    Only the encoders whose attention ONNX Runtime fuses (``quantize.fuse.FUSABLE_MODEL_TYPES``: full
    attention in every layer) are asked: a model with sliding-window layers (ModernBERT) would take
    the one mask for all of them, which the short example cannot show."""
    import torch

    from slimml.quantize.fuse import FUSABLE_MODEL_TYPES

    config = model.config
    windowed = any(getattr(config, k, None) for k in ("sliding_window", "local_attention", "layer_types"))
    if "attention_mask" not in names or config.model_type not in FUSABLE_MODEL_TYPES or windowed:
        return False
    feeds = dict(zip(names, example))
    try:
        with torch.no_grad():
            want = model(**feeds, return_dict=True)
            got = model(**{**feeds, "attention_mask": _additive(feeds["attention_mask"])}, return_dict=True)
        return all(torch.allclose(got[o], want[o], atol=1e-5, rtol=1e-4) for o in outputs)
    except Exception:  # a model that refuses a 4-D mask keeps its own
        return False


def _additive(mask: Any) -> Any:
    import torch

    return (1.0 - mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min


def _spell_out_heads(model: Any) -> int:
    """Reshapes to ``(batch, seq, -1, head_size)`` and back to ``(batch, seq, -1)`` with the ``-1``
    replaced by the head count and the width (transformers 5 writes ``-1``; ONNX Runtime's attention
    fusion reads the heads from a 4-part shape ``Concat``), from the graph's static hidden sizes.
    Returns the reshapes changed."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    try:
        shapes = onnx.shape_inference.infer_shapes(model, data_prop=False).graph.value_info
    except Exception:
        return 0
    dims = {v.name: [d.dim_value or d.dim_param or None for d in v.type.tensor_type.shape.dim] for v in shapes}
    dims.update({v.name: [d.dim_value or d.dim_param or None for d in v.type.tensor_type.shape.dim] for v in graph.input})
    producers = {o: n for n in graph.node for o in n.output}
    consts = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}

    def dim_of(part: str) -> tuple[str, int] | None:  # Unsqueeze(Gather(Shape(x), k)): (x, k)
        unsq = producers.get(part)
        gather = producers.get(unsq.input[0]) if unsq is not None and unsq.op_type == "Unsqueeze" else None
        shape = producers.get(gather.input[0]) if gather is not None and gather.op_type == "Gather" else None
        if shape is None or shape.op_type != "Shape" or gather.input[1] not in consts:
            return None
        return shape.input[0], int(numpy_helper.to_array(consts[gather.input[1]].attribute[0].t).reshape(-1)[0])

    changed = 0
    for node in graph.node:
        concat = producers.get(node.input[1]) if node.op_type == "Reshape" else None
        if concat is None or concat.op_type != "Concat":
            continue
        values = [numpy_helper.to_array(consts[x].attribute[0].t) if x in consts else None for x in concat.input]
        start = next((k for k, v in enumerate(values) if v is not None and -1 in v.reshape(-1).tolist()), None)
        if start != 2 or any(v is None for v in values[start:]):
            continue
        lead = [dim_of(x) for x in concat.input[:2]]  # the data's own batch and sequence dims, 0 and 1, kept
        data = dims.get(node.input[0]) or []
        if None in lead or [k for _, k in lead] != [0, 1] or not data[:2] or None in data[:2] or any(
                (dims.get(x) or [])[:2] != data[:2] for x, _ in lead):
            continue
        tail = np.concatenate([v.reshape(-1) for v in values[start:]])  # (-1, head_size) or (-1,), in one or two Constants
        static = [d if isinstance(d, int) and d > 0 else None for d in data[2:]]  # the hidden dims, fixed by the weights
        if len(tail) == 2 and tail[0] == -1 and tail[1] > 0 and len(static) == 1 and static[0] and static[0] % tail[1] == 0:
            parts = [np.array([static[0] // tail[1]]), np.array([tail[1]])]  # (b, s, -1, hs) -> (b, s, heads, hs)
        elif len(tail) == 1 and len(static) == 2 and all(static):
            parts = [np.array([static[0] * static[1]])]  # (b, s, h, hs) -> (b, s, h * hs)
        else:
            continue
        names = []
        for k, part in enumerate(parts):
            name = f"{concat.output[0]}_spelled_{k}"
            graph.node.append(onnx.helper.make_node("Constant", [], [name], value=numpy_helper.from_array(part.astype(tail.dtype), name)))
            names.append(name)
        concat.input[:] = [*concat.input[:start], *names]
        changed += 1
    if changed:
        _constants_first(graph)
    return changed


def _scale_as_division(graph: Any) -> int:
    """Attention scores scaled by ``Mul(QK, 1/sqrt(d))`` before the mask's ``Add`` and the ``Softmax``
    (transformers 5) written as ``Div(QK, sqrt(d))`` (4.57): with the additive mask also a ``Mul``,
    ONNX Runtime's fusion takes the scores' ``Mul`` for the mask's and matches neither. Returns the
    nodes changed."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    changed = 0
    for node in graph.node:
        if node.op_type != "Mul" or len(node.input) != 2:
            continue
        qk, scale = producers.get(node.input[0]), producers.get(node.input[1])
        users = consumers.get(node.output[0], [])
        if qk is None or qk.op_type != "MatMul" or scale is None or scale.op_type != "Constant" or len(users) != 1:
            continue
        add = users[0]
        if add.op_type != "Add" or not any(u.op_type == "Softmax" for u in consumers.get(add.output[0], [])):
            continue
        value = numpy_helper.to_array(scale.attribute[0].t)
        c = float(value.reshape(-1)[0]) if value.size == 1 else 0.0
        if c <= 0.0 or abs(1.0 / (c * c) - round(1.0 / (c * c))) > 1e-3 * (1.0 / (c * c)):
            continue  # not 1/sqrt(head size), the only scale ONNX Runtime's fused Attention computes
        name = f"{node.output[0]}_divisor"  # a Constant of its own: the scale's may be read elsewhere too
        graph.node.append(onnx.helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
            (np.float32(1.0) / value).astype(value.dtype), name)))
        node.op_type, node.input[1] = "Div", name
        changed += 1
    if changed:
        _constants_first(graph)
    return changed


def _constants_first(graph: Any) -> None:
    """The graph's ``Constant`` nodes (they read nothing) moved before the others, which keep their
    order: the Constants the rewrites append then come before the nodes that read them. Constants
    nothing reads any more (what the rewrites replaced) are dropped."""
    nodes = list(graph.node)
    read = {i for n in nodes for i in n.input} | {o.name for o in graph.output}
    order = [n for n in nodes if n.op_type == "Constant" and not n.input and n.output[0] in read] + [
        n for n in nodes if n.op_type != "Constant" or n.input]
    del graph.node[:]
    graph.node.extend(order)


def _drop_wrapper_scope(graph: Any) -> None:
    """Names as optimum writes them: ``/encoder/layer.3/...`` for the wrapper's ``/model/encoder/layer.3/...``
    (the manifest records each shard's layers by these names), ``encoder.layer.3...`` for its weights."""

    graphs = list(_graphs(graph))  # with the branches of If nodes (DeBERTa's scripted helpers), which read outer names
    taken = {x for g in graphs for node in g.node for x in [*node.input, *node.output]} | {
        v.name for g in graphs for v in g.initializer}

    def bare(name: str) -> str:  # a name the wrapper's own ops already hold (its constants) keeps its scope
        short = "/" + name[len("/model/"):] if name.startswith("/model/") else name[len("model."):] if name.startswith("model.") else name
        return short if short == name or short not in taken else name

    for g in graphs:
        for node in g.node:
            node.name = bare(node.name)
            node.input[:] = [bare(x) for x in node.input]
            node.output[:] = [bare(x) for x in node.output]
        for value in [*g.initializer, *g.value_info, *(g.input if g is not graph else ()), *(g.output if g is not graph else ())]:
            value.name = bare(value.name)


def _graphs(graph: Any):
    """``graph`` and every subgraph inside it (the branches of If, the bodies of Loop and Scan)."""
    yield graph
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("g"):
                yield from _graphs(a.g)
            for sub in a.graphs:
                yield from _graphs(sub)


def _outputs_module(model: Any, names: tuple[str, ...], outputs: tuple[str, ...], additive_mask: bool = False) -> Any:
    import torch

    class Outputs(torch.nn.Module):
        """The model called by keyword, its named outputs returned as a tuple (what the exporter traces),
        the attention mask made additive first where ``additive_mask`` (:func:`_takes_additive_mask`).
        The model sits under ``model``, so node names read ``/model/encoder/layer.3/...``."""

        def __init__(self, model, names, outputs):
            super().__init__()
            self.model, self.names, self.outputs = model, tuple(names), tuple(outputs)
            self.slimml_mask = _additive_mask_module() if additive_mask else None  # its nodes: /slimml_mask/..., apart from the model's

        def forward(self, *args):
            feeds = dict(zip(self.names, args))
            if self.slimml_mask is not None:
                feeds["attention_mask"] = self.slimml_mask(feeds["attention_mask"])
            out = self.model(**feeds, return_dict=True)
            return tuple(out[o] for o in self.outputs)

    return Outputs(model, names, outputs)


def _additive_mask_module() -> Any:
    import torch

    class AdditiveMask(torch.nn.Module):
        """``attention_mask`` (batch, seq) as 4.57's additive mask (:func:`_additive`), in a module of
        its own so that its nodes are named apart from the model's."""

        def forward(self, mask):
            return _additive(mask)

    return AdditiveMask()


def _tower_inputs(model: Any) -> tuple[tuple[str, ...], tuple[Any, ...], dict[str, dict[int, str]]]:
    """A CLIP (or SigLIP) model's example texts and images (three texts, two images: the batches
    differ) and its dynamic axes, as optimum names them (SigLIP's text tower takes no mask)."""
    import torch

    vision = model.config.vision_config
    size = vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0]
    ids = torch.tensor([[49406, 320, 1929, 49407], [49406, 320, 49407, 0], [49406, 49407, 0, 0]]) % model.config.text_config.vocab_size
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    pixels = torch.randn(2, getattr(vision, "num_channels", 3), size, size, generator=torch.Generator().manual_seed(0))
    text, image = {0: "text_batch_size", 1: "sequence_length"}, {0: "image_batch_size"}
    axes = {"input_ids": text, "attention_mask": text, "pixel_values": image, "text_embeds": {0: "text_batch_size"},
            "image_embeds": image, "logits_per_image": {0: "image_batch_size", 1: "text_batch_size"},
            "logits_per_text": {0: "text_batch_size", 1: "image_batch_size"}}
    if model.config.model_type == "siglip":
        return TOWER_INPUTS[:2], (ids, pixels), axes
    return TOWER_INPUTS, (ids, pixels, mask), axes


def _inputs(folder: Path, model: Any, task: str) -> tuple[tuple[str, ...], tuple[Any, ...], dict[str, dict[int, str]]]:
    """The graph's input names, example tensors and dynamic axes: pixels for an image model, else the
    text inputs its forward takes."""
    import torch

    accepted = set(inspect.signature(model.forward).parameters)
    config = model.config
    if "pixel_values" in accepted and "input_ids" not in accepted:
        from slimml.convert.folder_facts import processed_size

        size = getattr(config, "image_size", None) or processed_size(folder) or 224  # ResNet's config names none
        size = (size, size) if isinstance(size, int) else tuple(size)
        pixels = torch.zeros(2, getattr(config, "num_channels", 3), *size)
        return ("pixel_values",), (pixels,), {"pixel_values": {0: "batch_size"}}
    names = tuple(n for n in TEXT_INPUTS if n in accepted)
    if "input_ids" not in names:
        raise ExportError(f"the torch exporter found no text or image input on {type(model).__name__}.forward; "
                          "export it to ONNX yourself and convert the .onnx file.")
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102], [101, 2460, 102, 0, 0, 0]]) % config.vocab_size
    tensors = {"input_ids": ids, "attention_mask": (ids != 0).long(), "token_type_ids": torch.zeros_like(ids)}
    tensors["attention_mask"][:, 0] = 1
    axes = {n: {0: "batch_size", 1: "sequence_length"} for n in names}
    return names, tuple(tensors[n] for n in names), axes
