"""Export a decoder language model bigger than memory, one layer at a time.

optimum exports a model by tracing it whole, so the model must fit in memory. A Llama-family decoder
is a stack of identical layers, so its graph is too: this exporter traces a *template* of three
layers (the first, one middle and the last) whose weights are distinct random numbers, splits it per
layer, and then writes the real artifact shard by shard. The middle layer's shard is written once per
middle layer of the real model, with its tensor names renamed. Every weight of every shard is found
by value in the template (as stored, or transposed, as the exporter folded it) and replaced by the
real tensor, read from safetensors one at a time. Memory stays near one layer plus the embeddings,
whatever the depth.

The artifact is the same chain of shards the ordinary export and split give (tests check the two
against each other and against torch).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from slimml.convert.weights import SafetensorsReader, has_safetensors
from slimml.errors import ConfigError, ExportError

LAYERWISE_TYPES = ("llama",)  # identical layers, no per-layer attention types
TEMPLATE_LAYERS = 3
WEIGHT_FILES = (".safetensors", ".bin", ".h5", ".msgpack", ".onnx", ".pt")


def can_export_layerwise(folder: Path) -> bool:
    """A Llama-family causal LM with safetensors weights and at least three layers."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = config.get("architectures") or []
    return (config.get("model_type") in LAYERWISE_TYPES and any(a.endswith("ForCausalLM") for a in archs)
            and int(config.get("num_hidden_layers") or 0) >= TEMPLATE_LAYERS and has_safetensors(folder))


def make_template(folder: Path, out: Path) -> int:
    """A three-layer copy of the model in ``folder`` with distinct random weights; returns the real depth."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    depth = config.num_hidden_layers
    config.num_hidden_layers = TEMPLATE_LAYERS
    config.torch_dtype = "float32"
    out.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():  # tokenizer and generation files, not weights
        if item.is_file() and item.suffix not in WEIGHT_FILES and not item.name.endswith(".index.json"):
            shutil.copy2(item, out / item.name)
    generator = torch.Generator().manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # distinct values, so each exported weight names its parameter
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    model.eval().save_pretrained(str(out), safe_serialization=True)
    return depth


def layer_map(depth: int, middle: int) -> dict[int, int]:
    """Template layer -> real layer, for the copy of the middle layer that stands for real layer ``middle``."""
    return {0: 0, 1: middle, 2: depth - 1}


_PARAM_LAYER = re.compile(r"(?<=\.layers\.)(\d+)(?=\.)")


def _real_name(name: str, mapping: dict[int, int]) -> str:
    return _PARAM_LAYER.sub(lambda m: str(mapping[int(m.group(1))]), name)


def _digest(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a, dtype=np.float32).tobytes() + str(a.shape).encode()).hexdigest()


def _by_value(template_dir: Path) -> dict[str, tuple[str, bool]]:
    """Digest of every template weight, as stored and transposed -> (parameter name, transposed)."""
    reader = SafetensorsReader(template_dir)
    index: dict[str, tuple[str, bool]] = {}
    for name in reader.names():
        a = reader.numpy32(name)
        index.setdefault(_digest(a), (name, False))
        if a.ndim == 2:
            index.setdefault(_digest(a.T), (name, True))
    return index


def write_layerwise(template_onnx: Path, template_dir: Path, real_dir: Path, depth: int, work: Path,
                    out_dir: Path, prefix: str = "shard") -> list:
    """Write the real model's shards into ``out_dir``; return their specs (as ``shard()`` does)."""
    import onnx
    from onnx import numpy_helper

    from slimml.convert.shard import ShardConfig, shard
    from slimml.runtime.artifact.manifest import ShardSpec, TensorSpec

    parts = work / "template-shards"
    parts.mkdir(parents=True, exist_ok=True)
    specs = shard(template_onnx, parts, ShardConfig())
    middle = [i for i, s in enumerate(specs) if any(_layer_no(x) == 1 for x in s.layers)]
    if len(middle) != 1 or [_layer_no(x) for x in specs[middle[0]].layers] != [1]:
        raise ExportError("cannot export this model layer by layer: its middle layer does not split into a shard of its "
                          "own. Convert it with --exporter optimum (the whole model must then fit in memory).")
    m = middle[0]
    mid, after = specs[m], specs[m + 1:]
    side = {t.name for t in mid.inputs} & {t.name for s in after for t in s.inputs}
    hidden_in = [t.name for t in mid.inputs if t.name not in side]
    hidden_out = [t.name for t in mid.outputs]
    if len(hidden_in) != 1 or len(hidden_out) != 1:
        raise ExportError(f"cannot export this model layer by layer: its middle layer takes {hidden_in} and gives "
                          f"{hidden_out}, not one hidden state. Convert it with --exporter optimum.")
    index = _by_value(template_dir)
    reader = SafetensorsReader(real_dir)
    copies = depth - 2  # real layers 1 .. depth-2 are the middle shard's copies
    shift = copies - 1

    def out_name(j: int) -> str:
        return _rename_layer(hidden_out[0], 1, j)

    plan: list[tuple[Any, int, dict[int, int], dict[str, str], int]] = []  # spec, template index, layers, renames, copy
    for i in range(m):
        plan.append((specs[i], i, layer_map(depth, 1), {}, 0))
    for j in range(1, depth - 1):
        renames = {hidden_in[0]: out_name(j - 1)} if j > 1 else {}
        plan.append((mid, m, layer_map(depth, j), renames, j))
    for i in range(m + 1, len(specs)):
        plan.append((specs[i], i, layer_map(depth, 1), {hidden_out[0]: out_name(depth - 2)}, 0))

    written = []
    for new_index, (spec, t_index, mapping, renames, j) in enumerate(plan):
        model = onnx.load(str(parts / spec.file), load_external_data=True)
        last_layer = {1: j} if j else {2: depth - 1}

        def name(x: str) -> str:
            if x in renames:
                return renames[x]
            if x in side or not x:
                return x
            for t_layer, real in last_layer.items():
                x = _rename_layer(x, t_layer, real)
            return x

        graph = model.graph
        for node in graph.node:
            node.name = name(node.name)
            node.input[:] = [name(x) for x in node.input]
            node.output[:] = [name(x) for x in node.output]
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            vi.name = name(vi.name)
        weight_bytes = 0
        for init in graph.initializer:
            arr = numpy_helper.to_array(init)
            found = index.get(_digest(arr)) if arr.dtype == np.float32 and arr.size > 1 else None
            if found is not None:
                param, transposed = found
                real_name = _real_name(param, mapping)
                real = reader.numpy32(real_name)
                real = real.T if transposed else real
                if real.shape != arr.shape:
                    raise ExportError(f"layer-by-layer export: {param} has shape {real.shape} in {real_dir}, "
                                      f"{arr.shape} in its config; the weights do not match config.json: re-save or re-download the model.")
                # named after the parameter, so the copies' weights never share a name (merging needs that)
                new_name = real_name + (".T" if transposed else "")
                renamed = {init.name: new_name}
                for node in graph.node:
                    node.input[:] = [renamed.get(x, x) for x in node.input]
                init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(real), new_name))
            else:
                init.name = name(init.name)
            weight_bytes += int(arr.nbytes)
        file = f"{prefix}_{new_index:03d}.onnx"
        onnx.save_model(model, str(out_dir / file), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{file}.data", size_threshold=1024)
        del model

        def source(t: TensorSpec, new_index: int = new_index, t_index: int = t_index, j: int = j) -> Any:
            if t.source in (None, "input"):
                return t.source
            if t_index == m and j > 1 and t.name == hidden_in[0]:
                return new_index - 1  # the previous copy
            return t.source if t.source < m else t.source + shift

        written.append(ShardSpec(
            index=new_index, file=file, data=f"{file}.data" if (out_dir / f"{file}.data").is_file() else None,
            weight_bytes=weight_bytes,
            inputs=[TensorSpec(name(t.name), t.dtype, t.shape, source(t)) for t in spec.inputs],
            outputs=[TensorSpec(name(t.name), t.dtype, t.shape) for t in spec.outputs],
            layers=[_rename_layer(x, 1, j) if j else _rename_layer(x, 2, depth - 1) for x in spec.layers],
        ))
    shutil.rmtree(parts, ignore_errors=True)
    return written


_LAYER_IN_NAME = r"(?<=layers\.){n}(?=[/._]|$)"


def _layer_no(layer: str) -> int | None:
    found = re.search(r"layers\.(\d+)", layer)
    return int(found.group(1)) if found else None


def _rename_layer(x: str, template_layer: int, real: int) -> str:
    return re.sub(_LAYER_IN_NAME.format(n=template_layer), str(real), x)


def check_layerwise_request(folder: Path, task: str) -> None:
    if not can_export_layerwise(folder):
        raise ConfigError(
            f"--exporter layerwise exports Llama-family causal LMs with safetensors weights and 3 layers or more; "
            f"{folder} is not one. Use --exporter optimum."
        )
    if task not in ("auto", "text-generation"):
        raise ConfigError(f"--exporter layerwise writes the cache-free text-generation graph; --task {task} needs "
                          "--exporter optimum.")


def streamed_reference(folder: Path) -> Any:
    """The torch model of ``folder`` with its layers read from safetensors one at a time as it runs.

    The check of a layer-by-layer export: a callable taking int64 numpy feeds and returning
    ``{"logits": ...}``, holding one layer (and the embeddings and head) in memory.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from slimml.convert.weights import PlainSafetensors

    plain = PlainSafetensors(folder)  # plain reads, dropped from the page cache: nothing mapped stays charged
    reader = plain if plain.index else SafetensorsReader(folder)

    def tensor(name: str) -> Any:
        if name not in reader and f"{name}_blocks" in plain:  # gpt-oss's MXFP4 experts (experts, out, in): the float (experts, in, out)
            from slimml.convert.fused_experts import mxfp4_values

            values = mxfp4_values(plain.codes(f"{name}_blocks"), plain.codes(f"{name}_scales"))
            return torch.from_numpy(np.ascontiguousarray(values.swapaxes(-1, -2)))
        return torch.from_numpy(plain[name]) if reader is plain else reader.torch(name).to(torch.float32)

    from slimml.convert.fused_family import reference_kwargs

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    depth = config.num_hidden_layers
    types = list(config.layer_types) if isinstance(getattr(config, "layer_types", None), list) else None
    nope = list(config.no_rope_layers) if isinstance(getattr(config, "no_rope_layers", None), list) else None
    keys = [(types[i] if types else None, nope[i] if nope else None) for i in range(depth)]
    kinds = list(dict.fromkeys(keys))  # one shared layer per kind of layer (Gemma 2/3 alternate, SmolLM3 drops RoPE)
    config.num_hidden_layers = len(kinds)
    if types:
        config.layer_types = [t for t, _ in kinds]
    if nope:
        config.no_rope_layers = [n for _, n in kinds]
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32, **reference_kwargs(folder)).eval()
    shared_by_kind = dict(zip(kinds, model.model.layers))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." not in name:
                source = name if name in reader else "model.embed_tokens.weight"  # tied heads
                p.copy_(tensor(source))

    class Streamed(torch.nn.Module):
        def __init__(self, index: int):
            super().__init__()
            self.index = index
            self.shared = [shared_by_kind[keys[index]]]  # a list: not a submodule of each
            self.attention_type = getattr(self.shared[0], "attention_type", None)

        def __getattr__(self, name: str):  # what the model reads of a layer (OLMo 3: self_attn.attention_type)
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.__dict__["shared"][0], name)

        def forward(self, *args, **kwargs):
            shared = self.shared[0]
            with torch.no_grad():
                for name, p in shared.named_parameters():
                    p.copy_(tensor(f"model.layers.{self.index}.{name}"))
            return shared(*args, **kwargs)

    model.model.layers = torch.nn.ModuleList([Streamed(i) for i in range(depth)])
    model.config.num_hidden_layers = depth
    if types:
        model.config.layer_types = types
    if nope:
        model.config.no_rope_layers = nope

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            out = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}, use_cache=False)
        return {"logits": out.logits.numpy()}

    return run


def check_load_options(manifest: Any) -> dict[str, Any]:
    """How a check loads an artifact: resident when it fits, else streamed (``memory_budget`` a third of
    the memory available, at least two of its largest shards; no pre-packed cache on disk)."""
    from slimml.runtime.engine.budget import available_memory, bigger_than_memory, shard_bytes

    sizes = shard_bytes(manifest)
    if not bigger_than_memory(sum(sizes)):
        return {}
    return {"memory_budget": max(available_memory() // 3, 2 * max(sizes)), "pack": False}
