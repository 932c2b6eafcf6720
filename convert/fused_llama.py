"""The ``fused`` exporter: a Llama-family decoder written straight from its safetensors as the graph
ONNX Runtime decodes fastest on CPU (docs/llm_decode.md). Llama, Mistral and Qwen2 (q/k/v biases,
sliding windows as GroupQueryAttention's ``local_window_size``), Qwen3 (an RMSNorm over each q and
k head) and Phi-3 (q/k/v and gate/up stored packed).

Per layer: ``SimplifiedLayerNormalization`` (RMSNorm), one MatMul for q, k and v packed,
``GroupQueryAttention`` with the rotary embedding inside it (``do_rotary``; the cos/sin
tables for the positions in use computed once, before the first layer), one MatMul for gate and up packed, SiLU, the down MatMul. Fewer, larger MatMuls than a
traced graph (4 per layer instead of 7), and attention in one kernel that reads the cache in place
when past and present share a buffer (:mod:`slimml.runtime.engine.kv_cache`).

Inputs and outputs keep the names of optimum's with-past graph: ``input_ids``, ``attention_mask``
(B, past + S), ``past_key_values.N.key/value`` (B, kv_heads, past, head_dim) in; ``logits`` and
``present.N.key/value`` out. The positions come from the mask (``seqlens_k``): prompts of one
batch are the same length, or right-padded. One input more, ``logits_index`` (B, n): the positions
of the pass whose logits are computed, ``logits`` being (B, n, vocab). A decode loop asks for each
row's last real position, so a 512-token prompt pass computes one row of logits instead of 512
(on SmolLM2 the head is a fifth of the model's multiply-adds); perplexity asks for every position.

No torch graph is traced and no transformers model is built: the weights are read one tensor at
a time (bf16/fp16 files become fp32) and appended to one external data file, so exporting needs
about one tensor of memory, and the config is read as it is written (``rope_theta`` at the top
or under transformers 5's ``rope_parameters``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from slimml.errors import ExportError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")
OPSET = 21  # what ORT's MatMulNBits quantizer writes: every shard of the artifact the same, so they merge
_MS = "com.microsoft"


def can_export_fused(folder: Path) -> str | None:
    """None when ``folder`` is a decoder this exporter writes; else why not (one line)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return f"{folder} has no readable config.json"
    archs = config.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        return f"the fused exporter writes {', '.join(ARCHITECTURES)}; {folder.name} is {archs or 'of no named architecture'}"
    if not list(folder.glob("*.safetensors")):
        return f"the fused exporter reads safetensors weights; {folder} has none"
    hidden, heads = config.get("hidden_size", 0), config.get("num_attention_heads", 1)
    head_dim = config.get("head_dim") or hidden // heads
    if head_dim % 16:
        return f"ONNX Runtime's GroupQueryAttention needs a head size that is a multiple of 16, not {head_dim}"
    rope = _rope(config)
    if isinstance(rope, str):
        return rope
    if float(config.get("partial_rotary_factor") or 1.0) != 1.0:
        return f"a partial rotary embedding (factor {config['partial_rotary_factor']}) is not written by the fused exporter yet"
    if config.get("hidden_act", "silu") != "silu":
        return f"the fused exporter writes SiLU MLPs; {folder.name} uses {config.get('hidden_act')!r}"
    if config.get("attention_bias") or config.get("mlp_bias"):  # Qwen2's q/k/v biases are written; o_proj's and the MLP's not
        return "output-projection and MLP biases are not written by the fused exporter yet"
    return None


def _rope(config: dict[str, Any]) -> dict[str, Any] | str:
    """theta and scaling, wherever the config keeps them; a string says why they cannot be honoured."""
    params = dict(config.get("rope_parameters") or {})  # transformers 5
    params.update({k: v for k, v in (config.get("rope_scaling") or {}).items()})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        return f"RoPE scaling {kind!r} is not written by the fused exporter yet"
    return {"theta": float(theta), "type": kind, **{k: v for k, v in params.items() if k not in ("rope_type", "type")}}


def _windows(config: dict[str, Any]) -> list[int]:
    """Per layer, GroupQueryAttention's ``local_window_size``: -1 for full attention, else the sliding
    window (the same number of positions as transformers' mask: measured equal logits, 14 tokens
    through a window of 8). Mistral slides in every layer when ``sliding_window`` is set; Qwen2
    only with ``use_sliding_window``, in the layers ``layer_types`` names (by default those from
    ``max_window_layers`` on), as transformers 4.57 reads the config."""
    layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    if config.get("model_type") in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        window = None
    if not window:
        return [-1] * layers
    types = config.get("layer_types")
    if types is None and config.get("model_type") in ("qwen2", "qwen3"):
        first = int(config.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return [int(window) if (types is None or types[i] == "sliding_attention") else -1 for i in range(layers)]


def _inv_freq(rope: dict[str, Any], dim: int) -> np.ndarray:
    inv = 1.0 / (rope["theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if rope["type"] == "linear":
        inv = inv / float(rope["factor"])
    elif rope["type"] == "llama3":  # transformers' _compute_llama3_parameters
        factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv


class _Weights:
    """The safetensors tensors of a folder by name, read one at a time as float32 (plain reads, no mmap)."""

    def __init__(self, folder: Path):
        from slimml.convert.weights import PlainSafetensors

        self._tensors = PlainSafetensors(folder)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._tensors:
            raise ExportError(f"the weights have no tensor {name!r}; the folder is not a complete {ARCHITECTURES[0]} checkpoint.")
        return self._tensors[name]

    def transposed(self, names: list[str]) -> np.ndarray:
        """The tensors ``names`` (each (out_i, in)) stacked along out and transposed: (in, sum out_i),
        filled one tensor at a time (memory: the result and one of them)."""
        for n in names:
            if n not in self._tensors:
                self[n]  # the missing tensor's error
        rows = [self._tensors.shape(n)[0] for n in names]
        out = np.empty((self._tensors.shape(names[0])[1], sum(rows)), np.float32)
        at = 0
        for n, r in zip(names, rows):
            out[:, at:at + r] = self[n].T
            at += r
        return out


class _Writer:
    """Initializers appended to external data files as they are made (one tensor in memory).

    Each group of weights (the embeddings, each layer, the head) gets a file of its own,
    ``model.<group>.data``: the sharder then links a shard's file into the artifact instead of
    copying it (:func:`slimml.convert.shard.shard`). Written pages are flushed to disk and
    dropped from the page cache every ``SYNC_BYTES``: a memory cgroup charges dirty pages to the
    writer, and a model bigger than the cgroup would fill it with them.
    """

    SYNC_BYTES = 256 << 20
    ALIGN = 4096  # a page: ONNX Runtime maps external data whose offsets are page-aligned

    def __init__(self, out_dir: Path):
        self.dir = out_dir
        self.file = None
        self.location = ""
        self.unsynced = 0
        self.initializers: list[TensorProto] = []
        self.names: set[str] = set()

    def group(self, name: str) -> None:
        """Start ``model.<name>.data``: the weights added from now on go there."""
        self.close()
        self.location = f"model.{name}.data"
        self.file = open(self.dir / self.location, "wb")

    def add(self, name: str, array: np.ndarray) -> str:
        if name in self.names:  # a constant several layers share
            return name
        self.names.add(name)
        array = np.ascontiguousarray(array)
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
        if array.nbytes < 1024:  # small constants stay inside the graph
            t.raw_data = array.tobytes()
        else:
            if self.file is None:
                self.group("weights")
            offset = self.file.tell()
            pad = (-offset) % self.ALIGN
            self.file.write(b"\0" * pad)
            offset += pad
            self.file.write(memoryview(array.reshape(-1)).cast("B"))  # no bytes copy of a 100 MB tensor
            self.unsynced += array.nbytes
            if self.unsynced >= self.SYNC_BYTES:
                self._drop()
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", self.location), ("offset", str(offset)), ("length", str(array.nbytes))):
                t.external_data.add(key=k, value=v)
        self.initializers.append(t)
        return name

    def _drop(self) -> None:
        """Write the file's pages to disk and drop them from the page cache."""
        self.file.flush()
        os.fdatasync(self.file.fileno())
        os.posix_fadvise(self.file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        self.unsynced = 0

    def close(self) -> None:
        if self.file is not None:
            self._drop()
            self.file.close()
            self.file = None


def export_fused(folder: Path, out_dir: Path) -> Path:
    """Write ``out_dir/model.onnx`` (+ ``model.<group>.data`` files, one for the embeddings, one per
    layer, one for the head) for the decoder in ``folder``; memory holds about one packed weight.

    Returns:
        The graph's path.

    Raises:
        ExportError: the folder is not a decoder this exporter writes (the message says why and
            to use ``--exporter optimum``).
    """
    why = can_export_fused(folder)
    if why:
        raise ExportError(f"--exporter fused cannot export {folder}: {why}. Use --exporter optimum.")
    c = json.loads((folder / "config.json").read_text())
    hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    eps = float(c.get("rms_norm_eps", 1e-6))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    w = _Weights(folder)
    data = _Writer(out_dir)
    nodes: list[onnx.NodeProto] = []

    def node(op: str, ins: list[str], outs: list[str], name: str, domain: str = "", **attrs) -> list[str]:
        nodes.append(helper.make_node(op, ins, outs, name=name, domain=domain, **attrs))
        return outs

    def linear(x: str, names: list[str], prefix: str, out: str, bias: bool = False) -> str:
        """x @ W^T with the weights of ``names`` packed along the output (one MatMul), plus bias."""
        weight = w.transposed([f"{n}.weight" for n in names])  # (in, out)
        node("MatMul", [x, data.add(f"{prefix}.weight", weight)], [out + ("_mm" if bias else "")], f"{out}/MatMul")
        if bias:
            b = np.concatenate([w[f"{n}.bias"] for n in names])
            node("Add", [out + "_mm", data.add(f"{prefix}.bias", b)], [out], f"{out}/Add")
        return out

    # positions from the mask: seqlens_k = tokens seen - 1 per row, total = the mask's width
    node("ReduceSum", ["attention_mask", data.add("one_axis", np.array([1], np.int64))], ["mask_sum"],
         "/model/attn_mask/ReduceSum", keepdims=0)
    node("Sub", ["mask_sum", data.add("one_i64", np.array(1, np.int64))], ["seqlens_k_i64"], "/model/attn_mask/Sub")
    node("Cast", ["seqlens_k_i64"], ["seqlens_k"], "/model/attn_mask/Cast", to=TensorProto.INT32)
    node("Shape", ["attention_mask"], ["mask_shape"], "/model/attn_mask/Shape")
    node("Gather", ["mask_shape", data.add("one_idx", np.array(1, np.int64))], ["total_i64"], "/model/attn_mask/Gather", axis=0)
    node("Cast", ["total_i64"], ["total_seq_len"], "/model/attn_mask/Cast_1", to=TensorProto.INT32)
    # the rotary tables for positions 0..total-1, computed once before the first layer as transformers
    # computes them (fp32 positions x inv_freq, cos, sin): no table stored, and what crosses into each
    # layer's shard is (total, head_dim / 2), not a copy of a max_position_embeddings table per shard
    inv = _inv_freq(_rope(c), head_dim).astype(np.float32)
    node("Cast", ["total_i64"], ["total_f"], "/model/rotary/Cast", to=TensorProto.FLOAT)
    node("Range", [data.add("zero_f", np.array(0.0, np.float32)), "total_f", data.add("one_f", np.array(1.0, np.float32))],
         ["positions_f"], "/model/rotary/Range")
    node("Unsqueeze", ["positions_f", data.add("one_axis", np.array([1], np.int64))], ["positions_col"], "/model/rotary/Unsqueeze")
    node("Mul", ["positions_col", data.add("inv_freq", inv)], ["angles"], "/model/rotary/Mul")  # (total, head_dim / 2)
    cos = node("Cos", ["angles"], ["cos_cache"], "/model/rotary/Cos")[0]
    sin = node("Sin", ["angles"], ["sin_cache"], "/model/rotary/Sin")[0]

    data.group("embed")
    node("Gather", [data.add("model.embed_tokens.weight", w["model.embed_tokens.weight"]), "input_ids"],
         ["/model/embed_tokens/output"], "/model/embed_tokens/Gather")
    x = "/model/embed_tokens/output"
    qkv_bias = f"model.layers.0.self_attn.q_proj.bias" in w
    packed = "model.layers.0.self_attn.qkv_proj.weight" in w  # Phi-3 stores q/k/v and gate/up packed already
    qk_norm = "model.layers.0.self_attn.q_norm.weight" in w

    def head_norm(x: str, weight: str, name: str, n: int) -> str:
        """RMSNorm over each head_dim slice of (B, S, n * head_dim): reshaped to (B, S * n, head_dim) and back."""
        flat = node("Reshape", [x, data.add(f"heads_shape_{head_dim}", np.array([0, -1, head_dim], np.int64))],
                    [f"{name}/heads"], f"{name}/Reshape")[0]
        normed = node("SimplifiedLayerNormalization", [flat, data.add(weight, w[weight])], [f"{name}/normed"],
                      f"{name}/LayerNorm", axis=-1, epsilon=eps, stash_type=1)[0]
        return node("Reshape", [normed, data.add(f"rows_shape_{n * head_dim}", np.array([0, -1, n * head_dim], np.int64))],
                    [f"{name}/rows"], f"{name}/Reshape_1")[0]
    windows = _windows(c)
    inputs, outputs = [], []
    for i in range(layers):
        p, hf = f"/model/layers.{i}", f"model.layers.{i}"
        data.group(f"layers.{i}")
        h = node("SimplifiedLayerNormalization", [x, data.add(f"{hf}.input_layernorm.weight", w[f"{hf}.input_layernorm.weight"])],
                 [f"{p}/input_layernorm/output"], f"{p}/input_layernorm/LayerNorm", axis=-1, epsilon=eps, stash_type=1)[0]
        qkv = linear(h, [f"{hf}.self_attn.qkv_proj"] if packed else [f"{hf}.self_attn.{n}_proj" for n in "qkv"],
                     f"{hf}.self_attn.qkv_proj", f"{p}/attn/qkv", qkv_bias)
        qkv_in = [qkv, "", ""]
        if qk_norm:  # Qwen3: an RMSNorm over each head of q and of k, before the rotary embedding (inside GQA)
            q, k, v = node("Split", [qkv, data.add("split_qkv", np.array([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], np.int64))],
                           [f"{p}/attn/q", f"{p}/attn/k", f"{p}/attn/v"], f"{p}/attn/Split", axis=-1)
            qkv_in = [head_norm(q, f"{hf}.self_attn.q_norm.weight", f"{p}/attn/q_norm", heads), head_norm(k, f"{hf}.self_attn.k_norm.weight", f"{p}/attn/k_norm", kv_heads), v]
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        pres_k, pres_v = f"present.{i}.key", f"present.{i}.value"
        node("GroupQueryAttention", [*qkv_in, past_k, past_v, "seqlens_k", "total_seq_len", cos, sin],
             [f"{p}/attn/output", pres_k, pres_v], f"{p}/attn/GroupQueryAttention", domain=_MS,
             num_heads=heads, kv_num_heads=kv_heads, scale=1.0 / math.sqrt(head_dim), do_rotary=1,
             rotary_interleaved=0, local_window_size=windows[i])
        o = linear(f"{p}/attn/output", [f"{hf}.self_attn.o_proj"], f"{hf}.self_attn.o_proj", f"{p}/attn/o_proj")
        x1 = node("Add", [x, o], [f"{p}/attn/residual"], f"{p}/attn/residual/Add")[0]
        h2 = node("SimplifiedLayerNormalization",
                  [x1, data.add(f"{hf}.post_attention_layernorm.weight", w[f"{hf}.post_attention_layernorm.weight"])],
                  [f"{p}/post_attention_layernorm/output"], f"{p}/post_attention_layernorm/LayerNorm", axis=-1,
                  epsilon=eps, stash_type=1)[0]
        gu = linear(h2, [f"{hf}.mlp.gate_up_proj"] if packed else [f"{hf}.mlp.gate_proj", f"{hf}.mlp.up_proj"],
                    f"{hf}.mlp.gate_up_proj", f"{p}/mlp/gate_up")
        inter = int(c["intermediate_size"])
        node("Split", [gu, data.add(f"split_{inter}", np.array([inter, inter], np.int64))],
             [f"{p}/mlp/gate", f"{p}/mlp/up"], f"{p}/mlp/Split", axis=-1)
        node("Sigmoid", [f"{p}/mlp/gate"], [f"{p}/mlp/sigmoid"], f"{p}/mlp/Sigmoid")
        node("Mul", [f"{p}/mlp/gate", f"{p}/mlp/sigmoid"], [f"{p}/mlp/silu"], f"{p}/mlp/Mul")
        node("Mul", [f"{p}/mlp/silu", f"{p}/mlp/up"], [f"{p}/mlp/act"], f"{p}/mlp/Mul_1")
        d = linear(f"{p}/mlp/act", [f"{hf}.mlp.down_proj"], f"{hf}.mlp.down_proj", f"{p}/mlp/down")
        x = node("Add", [x1, d], [f"{p}/mlp/residual"], f"{p}/mlp/residual/Add")[0]
        for n in (past_k, past_v):
            inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch_size", kv_heads, "past_sequence_length", head_dim]))
        for n in (pres_k, pres_v):
            outputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch_size", kv_heads, "total_sequence_length", head_dim]))
    data.group("head")
    # logits only where they are read: the positions ``logits_index`` (B, n) names in each row (the
    # last real one while generating, every one for perplexity), gathered before the norm and lm_head
    node("Unsqueeze", ["logits_index", data.add("two_axis", np.array([2], np.int64))], ["logits_index_col"],
         "/model/logits_index/Unsqueeze")
    node("Expand", ["logits_index_col", data.add("hidden_shape", np.array([1, 1, hidden], np.int64))], ["logits_index_wide"],
         "/model/logits_index/Expand")
    x = node("GatherElements", [x, "logits_index_wide"], ["/model/logits_index/output"], "/model/logits_index/GatherElements",
             axis=1)[0]
    h = node("SimplifiedLayerNormalization", [x, data.add("model.norm.weight", w["model.norm.weight"])],
             ["/model/norm/output"], "/model/norm/LayerNorm", axis=-1, epsilon=eps, stash_type=1)[0]
    head = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"  # tied embeddings
    node("MatMul", [h, data.add("lm_head.weight", w.transposed([head]))], ["logits"], "/lm_head/MatMul")
    data.close()
    # contrib ops defeat ONNX's shape inference: type what may cross a shard boundary
    seq = ["batch_size", "sequence_length"]
    typed = {"seqlens_k": (TensorProto.INT32, ["batch_size"]), "total_seq_len": (TensorProto.INT32, None),
             "mask_sum": (TensorProto.INT64, ["batch_size"]), "seqlens_k_i64": (TensorProto.INT64, ["batch_size"]),
             "mask_shape": (TensorProto.INT64, [2]), "total_i64": (TensorProto.INT64, None),
             "total_f": (TensorProto.FLOAT, None), "positions_f": (TensorProto.FLOAT, ["total_sequence_length"]),
             "positions_col": (TensorProto.FLOAT, ["total_sequence_length", 1]),
             "angles": (TensorProto.FLOAT, ["total_sequence_length", head_dim // 2]),
             cos: (TensorProto.FLOAT, ["total_sequence_length", head_dim // 2]),
             sin: (TensorProto.FLOAT, ["total_sequence_length", head_dim // 2]),
             "logits_index_col": (TensorProto.INT64, ["batch_size", "logits_length", 1]),
             "logits_index_wide": (TensorProto.INT64, ["batch_size", "logits_length", hidden]),
             "/model/logits_index/output": (TensorProto.FLOAT, ["batch_size", "logits_length", hidden]),
             "/model/norm/output": (TensorProto.FLOAT, ["batch_size", "logits_length", hidden])}
    known = {"logits", *(o.name for o in outputs)}
    value_info = [helper.make_tensor_value_info(n.output[0], *typed.get(n.output[0], (TensorProto.FLOAT, None)))
                  for n in nodes if n.output[0] not in known]
    for vi in value_info:
        if vi.name.endswith(("residual", "output")) and vi.name not in typed and vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.CopyFrom(helper.make_tensor_value_info(vi.name, TensorProto.FLOAT, [*seq, hidden]))
    graph = helper.make_graph(
        nodes, "slimml-fused-decoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "past_sequence_length + sequence_length"]),
         *inputs, helper.make_tensor_value_info("logits_index", TensorProto.INT64, ["batch_size", "logits_length"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "logits_length", int(c["vocab_size"])]),
         *outputs],
        initializer=data.initializers, value_info=value_info,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(_MS, 1)],
                              producer_name="slimml-fused")
    model.ir_version = 8
    onnx.save(model, str(path))
    return path
