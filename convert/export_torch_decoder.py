"""Export a causal LM through ``torch.onnx.export``, with its KV cache, with any transformers.

The fused exporter (``convert.fused_llama``) writes the Llama-like and Gemma decoders as ONNX
Runtime's fast decoder graph. Every other decoder transformers runs (GPT-2, GPT-J, GPT-NeoX,
Phi-1/2, StableLM, Falcon, StarCoder2, OPT, BLOOM, ...) went through optimum-onnx, which needs
transformers < 4.58 and does not know every architecture. This exporter traces the model itself
in the layout optimum writes, so the splitter, the decode loop and the quantizers take it as they
take optimum's graph:

- inputs ``input_ids`` (batch, seq), ``attention_mask`` (batch, past + seq), ``position_ids``
  (batch, seq) where the model takes positions, and ``past_key_values.N.key/value``
  (batch, kv_heads, past, head_dim);
- outputs ``logits`` (batch, seq, vocab) and ``present.N.key/value`` (batch, kv_heads, past + seq,
  head_dim); without the cache (task ``text-generation``) ``logits`` alone.

The cache the traced model reads is a plain ``DynamicCache`` (every layer keeps every position:
a sliding window is applied by the mask, as transformers computes it), so the present is always
the past plus the new positions, the shape the decode loop feeds back. ``N`` runs over the layers
that keep a cache: Gemma 4's last layers read an earlier layer's keys and values and keep none, so
they have no past or present. A model whose cache keeps a recurrent state (Mamba, linear attention,
LFM2's convolutions: state-space and hybrid decoders) is refused by name.

A mixture-of-experts decoder's experts are written as ONNX Runtime's ``MoE`` op, routed at run time
(``convert.trace_experts``; transformers 5). Under 4.x they are refused: there each family loops over
the experts its example routes to, which a trace would keep.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slimml.errors import ExportError, SourceError

DECODER_TASKS = ("text-generation-with-past", "text-generation")
# config keys that mark a mixture-of-experts decoder (Mixtral, Qwen2/3-MoE, DeepSeek, OLMoE, Phi-3.5-MoE, ...)
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_EXAMPLE_PAST, _EXAMPLE_NEW = 3, 2  # positions in the traced example's cache, and new ones (any lengths run)


def decoder_export_reason(config: dict[str, Any]) -> str | None:
    """Why :func:`export_torch_decoder` cannot write a model of ``config`` (one line), or None."""
    if config.get("is_encoder_decoder") or "vision_config" in config or "audio_config" in config:
        return "the torch exporter writes text decoders with a cache, not encoder-decoders or multimodal models"
    return experts_reason(config)


def experts_reason(config: dict[str, Any]) -> str | None:
    """Why no slimml exporter writes a mixture-of-experts decoder with the installed transformers
    (one line), or None: under transformers 5 its experts are traced as ONNX Runtime's MoE op
    (``convert.trace_experts``); 4.x keeps them in per-family Python loops a trace cannot follow."""
    import transformers

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    experts = next((k for k in MOE_KEYS if isinstance(text.get(k), int) and text[k] > 1), None)
    if experts and int(transformers.__version__.split(".")[0]) < 5:
        return (f"mixture-of-experts decoders ({experts}: {text[experts]}) convert with transformers 5 (pip install "
                f"'transformers>=5'), not {transformers.__version__} (a trace would keep only the experts its example "
                "routes to)")
    return None


def export_torch_decoder(folder: Path, onnx_path: Path, task: str, opset: int | None = None) -> None:
    """Write ``folder``'s causal LM to ``onnx_path`` as ``task`` (with or without its cache), in
    optimum's with-past layout (module docstring); weights as external data beside it when over 2 GB.

    Raises:
        ExportError: transformers could not load the model, or the trace failed (the first line says why).
    """
    from slimml.convert.export_torch import trace
    from slimml.convert.trace_experts import DOMAIN, experts_modules, unsupported

    model = _load(folder)
    if why := unsupported(model):
        raise ExportError(f"{why}; convert a model slimml's exporters write, or export this one to ONNX yourself and "
                          "convert the .onnx file.")
    with_past = task == "text-generation-with-past"
    names, example, dynamic, outputs = _example(model, with_past)
    wrapper = _decoder_module()(model, names).eval()
    trace(wrapper, example, onnx_path, names, outputs, dynamic, opset, patches=_traceable(model),
          custom_opsets={DOMAIN: 1} if experts_modules(model) else None,
          failed=lambda why: f"torch.onnx.export could not write {folder.name} ({type(model).__name__}) as {task!r} "
                             f"({why}); export it to ONNX yourself and convert the .onnx file.")


def _load(folder: Path) -> Any:
    """The model in float32 with eager attention (what traces to plain ops), as the check loads it."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, attn_implementation="eager",
                                                     dtype=torch.float32).float()  # MXFP4 experts: bf16 on a CPU
    except Exception as e:
        if "auto_map" in _config(folder):  # trust_remote_code: slimml does not run a folder's own Python
            raise custom_code_error(folder) from None
        raise ExportError(f"transformers could not load {folder.name} as a causal LM ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]}); pass --task with the model's task.") from None
    return model.eval()


@contextlib.contextmanager
def _traceable(model: Any) -> Iterator[None]:
    """What ``torch.onnx.export``'s tracer cannot record, replaced by plain ops that compute the same
    while tracing (optimum-onnx patches the first four the same way):

    - transformers 4.57 builds attention masks through ``torch.vmap``, which fails the tracer
      (``unordered_map::at``): the same mask functions broadcast over index tensors instead (5 has no vmap);
    - 4.57's cache layers start as an empty tensor and concatenate the first keys onto it, which the
      trace keeps as a fixed shape: the first keys taken as they are;
    - ``repeat_interleave`` by a number (Cohere's interleaved rotary) is traced with the example's
      length: an ``expand`` and ``flatten`` instead;
    - ``rms_norm`` and ``expm1`` (DiffLlama's norm, Apertus' xIELU activation) have no ONNX form at
      opset 17: the same arithmetic in plain ops;

    and a mixture of experts computes through ONNX Runtime's MoE op (``convert.trace_experts``).
    """
    import torch
    from transformers import cache_utils, masking_utils

    from slimml.convert.trace_experts import experts_as_moe_op

    saved = []

    def swap(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if hasattr(masking_utils, "sdpa_mask_older_torch"):  # transformers 4.x
        swap(masking_utils, "sdpa_mask", _broadcast_mask)
        if hasattr(getattr(cache_utils, "DynamicLayer", None), "lazy_initialization"):
            swap(cache_utils.DynamicLayer, "update", _first_keys_as_they_are(cache_utils.DynamicLayer.update))
    swap(torch, "repeat_interleave", _repeat_by_expanding(torch.repeat_interleave))
    swap(torch.Tensor, "repeat_interleave", _repeat_by_expanding(torch.Tensor.repeat_interleave))
    for owner, name, value in ((torch, "rms_norm", _rms_norm), (torch.nn.functional, "rms_norm", _rms_norm),
                               (torch, "expm1", _expm1), (torch.Tensor, "expm1", _expm1)):
        if hasattr(owner, name):
            swap(owner, name, value)
    try:
        with experts_as_moe_op(model):
            yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _broadcast_mask(batch_size: int, cache_position: Any, kv_length: int, kv_offset: int = 0, mask_function: Any = None,
                    attention_mask: Any = None, local_size: int | None = None, allow_is_causal_skip: bool = True,
                    **kwargs: Any) -> Any:
    """transformers 4.57's ``sdpa_mask`` (a boolean mask, batch x 1 x query x key) with its mask
    functions called once on broadcast index tensors instead of through ``torch.vmap``."""
    import torch
    from transformers import masking_utils as mu

    mask_function = mask_function or mu.causal_mask_function
    q_length = cache_position.shape[0]
    padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset, _slice=False)
    if allow_is_causal_skip and mu._ignore_causal_mask_sdpa(padding, q_length, kv_length, kv_offset, local_size):
        return None
    if padding is not None:
        mask_function = mu.and_masks(mask_function, mu.padding_mask_function(padding))
    batch = torch.arange(batch_size, device=cache_position.device)[:, None, None, None]
    head = torch.zeros(1, dtype=torch.long, device=cache_position.device)[None, :, None, None]
    keys = torch.arange(kv_length, device=cache_position.device)[None, None, None, :] + kv_offset
    return mask_function(batch, head, cache_position[None, None, :, None], keys).expand(batch_size, -1, q_length, kv_length)


def _first_keys_as_they_are(update: Any) -> Any:
    def first_update(self, key_states, value_states, *args, **kwargs):
        if getattr(self, "keys", None) is None or not getattr(self, "is_initialized", True):
            try:
                self.lazy_initialization(key_states, value_states)  # transformers 5
            except TypeError:
                self.lazy_initialization(key_states)  # 4.57
            self.keys, self.values = key_states, value_states
            return self.keys, self.values
        return update(self, key_states, value_states, *args, **kwargs)

    return first_update


def _rms_norm(x: Any, normalized_shape: Any, weight: Any = None, eps: float | None = None) -> Any:
    import torch

    dims = tuple(range(-len(normalized_shape), 0))
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    out = x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)
    return out if weight is None else out * weight


def _expm1(x: Any) -> Any:
    import torch

    return torch.exp(x) - 1.0


def _repeat_by_expanding(repeat: Any) -> Any:
    def repeat_interleave(x, repeats=None, dim=None, **kwargs):
        if isinstance(repeats, int) and dim is not None and not kwargs:
            d = dim % x.dim()
            return x.unsqueeze(d + 1).expand(*x.shape[: d + 1], repeats, *x.shape[d + 1:]).flatten(d, d + 1)
        return repeat(x, repeats, dim, **kwargs) if dim is not None or kwargs else repeat(x, repeats)

    return repeat_interleave


def custom_code_error(folder: Path) -> ExportError:
    """The one line for a folder whose model is its own Python code (``auto_map``), which slimml does not run."""
    return ExportError(f"{folder.name} needs its own modeling code (auto_map in its config), which slimml does not run; "
                       "export it to ONNX yourself (with trust_remote_code=True) and convert the .onnx file.")


def _config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _layers(model: Any) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def _example(model: Any, with_past: bool) -> tuple[tuple[str, ...], tuple[Any, ...], dict[str, dict[int, str]], tuple[str, ...]]:
    """Input names, example tensors, dynamic axes and output names: a batch of 2 with a 3-position
    cache (the model's own, from a first pass) and 2 new positions, so no length is traced as fixed."""
    import torch

    accepted = set(inspect.signature(model.forward).parameters)
    vocab = int(model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size)
    total = _EXAMPLE_PAST + _EXAMPLE_NEW if with_past else _EXAMPLE_NEW + 3
    ids = (torch.arange(2 * total).reshape(2, total) * 7 + 3) % vocab
    start = _EXAMPLE_PAST if with_past else 0
    tensors = {"input_ids": ids[:, start:], "attention_mask": torch.ones(2, total, dtype=torch.long),
               "position_ids": torch.arange(start, total).repeat(2, 1)}
    names = tuple(n for n in ("input_ids", "attention_mask", "position_ids") if n in accepted)
    dynamic = {"input_ids": {0: "batch_size", 1: "sequence_length"},
               "attention_mask": {0: "batch_size", 1: "past_sequence_length + sequence_length" if with_past else "sequence_length"},
               "position_ids": {0: "batch_size", 1: "sequence_length"},
               "logits": {0: "batch_size", 1: "sequence_length"}}
    dynamic = {k: v for k, v in dynamic.items() if k in names or k == "logits"}
    example = [tensors[n] for n in names]
    outputs: tuple[str, ...] = ("logits",)
    if with_past:
        why = recurrent_layers(model)  # transformers 5: such a first pass may itself fail
        if not why:
            with torch.no_grad():
                first = model(input_ids=ids[:, :start], use_cache=True)
            why = recurrent_state(first, _layers(model), start)
        if why == NO_CACHE:  # --exporter auto then traces it without one
            raise ExportError(f"{type(model).__name__} returns no cache from a pass that asks for one (use_cache=True); "
                              "convert it with --task text-generation (each token then runs the whole sequence).")
        if why:
            raise SourceError(f"{type(model).__name__} {why}, where slimml's decode loop needs one key and one value "
                              "tensor per layer: state-space, hybrid and other cache layouts are not supported yet; "
                              "convert a transformer decoder.")
        for i, (key, value) in cache_tensors(returned_cache(first)).items():
            for kind, t in (("key", key), ("value", value)):
                names += (f"past_key_values.{i}.{kind}",)
                example.append(t)
                dynamic[f"past_key_values.{i}.{kind}"] = {0: "batch_size", 2: "past_sequence_length"}
                outputs += (f"present.{i}.{kind}",)
                dynamic[f"present.{i}.{kind}"] = {0: "batch_size", 2: "past_sequence_length + sequence_length"}
    return names, tuple(example), dynamic, outputs


NO_CACHE = "returns no cache"


def recurrent_layers(model: Any) -> str | None:
    """transformers 5's cache for ``model``, read from its config: "keeps a recurrent state (...)" where
    some layers keep one (Mamba, linear attention, a convolution), else None (and None under 4.x)."""
    try:
        from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

        layers = DynamicCache(config=model.config).layers
    except Exception:  # 4.x, or a config the cache cannot read: the first pass tells
        return None
    kinds = sorted({type(layer).__name__ for layer in layers if isinstance(layer, LinearAttentionCacheLayerMixin)})
    return f"keeps a recurrent state ({', '.join(kinds)})" if kinds else None


def recurrent_state(output: Any, layers: int, length: int) -> str | None:
    """What a first pass's cache (its ``cache`` or ``past_key_values``, over ``length`` positions) is, in words,
    where it is not one key and one value tensor ``(batch, heads, positions, head)`` for each of at
    most ``layers`` layers (a window may keep fewer positions; a layer reading another's cache keeps
    none): "keeps a recurrent state (...)" (Mamba's, RWKV's), "keeps its cache in a layout of its own
    (...)", or :data:`NO_CACHE`; else None."""
    cache = returned_cache(output)
    if cache is None:  # transformers 4.x's Mamba outputs: cache_params; RWKV's: state
        state = next((v for v in (getattr(output, "cache_params", None), getattr(output, "state", None)) if v is not None), None)
        kind = "state tensors" if isinstance(state, (list, tuple)) else type(state).__name__
        return f"keeps a recurrent state ({kind})" if state is not None else NO_CACHE
    try:
        pairs = cache_tensors(cache)
    except Exception:
        return f"keeps a recurrent state ({type(cache).__name__})"
    if not pairs or len(pairs) > layers or any(getattr(t, "ndim", 0) != 4 or not 0 < t.shape[2] <= length
                                               for pair in pairs.values() for t in pair):
        shapes = sorted({tuple(getattr(t, "shape", ())) for pair in pairs.values() for t in pair})[:2]
        return f"keeps its cache in a layout of its own ({type(cache).__name__}, {len(pairs)} layers, shapes {shapes})"
    return None


def cache_tensors(cache: Any) -> dict[int, tuple[Any, Any]]:
    """(key, value) by layer index of a transformers cache (4.57's and 5's ``layers``, or the legacy
    tuples; an encoder-decoder cache's self-attention part: a BERT-style decoder under 4.57); a layer
    that reads another's cache and keeps none (Gemma 4's shared layers) has no entry."""
    cache = getattr(cache, "self_attention_cache", cache)
    if hasattr(cache, "layers"):
        return {i: (layer.keys, layer.values) for i, layer in enumerate(cache.layers)
                if getattr(layer, "keys", None) is not None}
    return {i: (k, v) for i, (k, v) in enumerate(cache)}


def cache_keyword(model: Any) -> str:
    """The argument ``model``'s forward takes its cache as: ``cache`` from transformers 5.24 on
    (``past_key_values`` there is deprecated, to go in 5.40), else ``past_key_values``."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The cache a forward returned: ``output.cache`` from transformers 5.24 on, ``past_key_values``
    before (None where it returned none)."""
    cache = output.get("cache") if hasattr(output, "get") else None
    return cache if cache is not None else getattr(output, "past_key_values", None)


def dynamic_cache(layers: dict[int, tuple[Any, Any]]) -> Any:
    """A transformers ``DynamicCache`` holding ``(key, value)`` at each layer index, every position in
    every layer (4.57 and 5 build it the same way; 5 has no ``from_legacy_cache``)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (key, value) in sorted(layers.items()):
        cache.update(key, value, i)
    return cache


def past_layers(names: Any) -> list[int]:
    """The layer indices of the ``past_key_values.N.key`` names among ``names``, in order."""
    return sorted(int(n.split(".")[1]) for n in names if n.startswith("past_key_values.") and n.endswith(".key"))


@contextlib.contextmanager
def traceable_seq2seq(model: Any) -> Iterator[None]:
    """:func:`_traceable`, and under any transformers a cache layer's first keys taken as they are: an
    encoder-decoder's caches are built from the graph's inputs, and transformers 5's concatenation onto
    an empty tensor left one-input ``Concat`` nodes whose type ONNX shape inference does not give."""
    from transformers import cache_utils

    layer = getattr(cache_utils, "DynamicLayer", None)
    saved = getattr(layer, "update", None)
    patch = layer is not None and hasattr(layer, "lazy_initialization") and getattr(saved, "__name__", "") != "first_update"
    if patch:
        layer.update = _first_keys_as_they_are(saved)
    try:
        with _traceable(model):
            yield
    finally:
        if patch:
            layer.update = saved


def _decoder_module() -> type:
    """The wrapper module the exporter traces (a function, so that importing this file needs no torch)."""
    import torch

    class Decoder(torch.nn.Module):
        """The model called with its inputs by name and, with a cache, a ``DynamicCache`` built from the
        ``past_key_values.N.*`` tensors; returns ``logits`` and each layer's present key and value.
        The model sits under ``model``, so node names read as optimum's once the scope is dropped."""

        def __init__(self, model, names):
            super().__init__()
            self.model, self.names, self.layers = model, tuple(names), past_layers(names)
            self.keyword = cache_keyword(model)
            self.inputs = tuple(n for n in self.names if not n.startswith("past_key_values."))

        def forward(self, *args):
            feeds = dict(zip(self.inputs, args[: len(self.inputs)]))
            if not self.layers:
                return self.model(**feeds, use_cache=False, return_dict=True).logits
            past = args[len(self.inputs):]
            cache = dynamic_cache({layer: (past[2 * i], past[2 * i + 1]) for i, layer in enumerate(self.layers)})  # the mask applies any window
            out = self.model(**feeds, **{self.keyword: cache}, use_cache=True, return_dict=True)
            present = cache_tensors(returned_cache(out))
            return (out.logits, *[t for layer in self.layers for t in present[layer]])

    return Decoder
