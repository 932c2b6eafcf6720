"""The ``fused`` exporter: a decoder written straight from its safetensors as the graph ONNX Runtime
decodes fastest on CPU (docs/llm_decode.md). Llama, Mistral and Qwen2 (q/k/v biases, sliding
windows as GroupQueryAttention's ``local_window_size``), Qwen3 (an RMSNorm over each q and k head),
Phi-3 (q/k/v and gate/up stored packed; Phi-3.5 and Phi-4-mini's LongRoPE over part of each head),
SmolLM3 (layers without RoPE), Granite (multipliers), OLMo 2 and 3 (norms after each block only), Gemma, Gemma 2 and Gemma 3 text (scaled embeddings, ``1 + w`` norms,
GELU, four norms per layer, soft-capping, a local and a global RoPE): what each family changes is
read from its config by :mod:`slimml.convert.fused_family`.

Per layer: ``SimplifiedLayerNormalization`` (RMSNorm), one MatMul for q, k and v packed,
``GroupQueryAttention`` with the rotary embedding inside it (``do_rotary``; the cos/sin
tables for the positions in use computed once, before the first layer), one MatMul for gate and up
packed, SiLU (Gemma: ``FastGelu``), the down MatMul; Gemma 2/3 add a norm after attention and one
after the MLP. Fewer, larger MatMuls than a traced graph (4 per layer instead of 7), and attention in one kernel that reads the cache in place
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
or under transformers 5's ``rope_parameters``, one entry per layer type for Gemma 3).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from slimml.convert.fused_experts import Graph, routed_experts
from slimml.convert.fused_family import ARCHITECTURES, NAMES, Family, Rotary, read_family, rotary
from slimml.errors import ExportError

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
        return f"the fused exporter writes {NAMES} decoders; {folder.name} is {archs or 'of no named architecture'}"
    if not list(folder.glob("*.safetensors")):
        return f"the fused exporter reads safetensors weights; {folder} has none"
    family = read_family(config, _transformers_major())
    return family if isinstance(family, str) else None


# transformers' Phi3ForCausalLM.prepare_inputs_for_generation (and PhiMoE's) drops the cache and runs the
# whole sequence again when it first grows past LongRoPE's original context, so every key is rotated
# with the long factors; other models keep their cache
REPREFILL_TYPES = ("phi3", "phimoe")


def rope_facts(folder: Path) -> dict[str, Any]:
    """What the runtime must know of a LongRoPE graph (for the manifest's source): ``rope_switch``, the
    sequence length past which its passes take the long factors, and ``rope_reprefill`` where the
    model's generate runs the whole sequence again at that point. Empty for any other RoPE."""
    c = json.loads((folder / "config.json").read_text())
    fam = read_family(c, _transformers_major())
    switches = {rotary(rope, c, fam.head_dim).switch for rope in fam.ropes if rope and rope["type"] == "longrope"}
    if not switches:
        return {}
    return {"rope_switch": min(switches), "rope_reprefill": c.get("model_type") in REPREFILL_TYPES}


def _transformers_major() -> int:
    """The installed transformers' major version (5 when none is installed: the current reading)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 5


class _Weights:
    """The safetensors tensors of a folder by name, read one at a time as float32 (plain reads, no mmap)."""

    def __init__(self, folder: Path):
        from slimml.convert.weights import PlainSafetensors

        self._tensors = PlainSafetensors(folder)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._tensors:
            raise ExportError(f"the weights have no tensor {name!r}; the folder is not a complete checkpoint of its architecture "
                              "(its safetensors files do not match config.json): re-save or re-download it.")
        return self._tensors[name]

    def part(self, name: str, index: int) -> np.ndarray:
        """The ``index``-th slice of ``name`` along its first axis (one expert), float32."""
        return self._tensors.part(self._known(name), index)

    def codes(self, name: str, index: int) -> np.ndarray:
        """The ``index``-th slice of the byte tensor ``name`` (MXFP4 blocks or scales)."""
        return self._tensors.codes(self._known(name), index)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors.shape(self._known(name)))

    def _known(self, name: str) -> str:
        if name not in self._tensors:
            self[name]  # the missing tensor's error
        return name

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
        array = np.ascontiguousarray(array)
        if array.nbytes < 1024:  # small constants stay inside the graph
            self.names.add(name)
            self.initializers.append(TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                                                 dims=array.shape, raw_data=array.tobytes()))
            return name
        return self.add_parts(name, array.shape, [array], array.dtype)

    def add_parts(self, name: str, dims: tuple[int, ...], parts: Iterable[np.ndarray], dtype: Any = np.float32) -> str:
        """An initializer of shape ``dims`` written from ``parts`` in order (an expert's weights at a
        time: memory holds one of them, not the mixture's)."""
        self.names.add(name)
        if self.file is None:
            self.group("weights")
        offset = self.file.tell()
        pad = (-offset) % self.ALIGN
        self.file.write(b"\0" * pad)
        offset += pad
        length = 0
        for part in parts:
            part = np.ascontiguousarray(part, dtype)
            self.file.write(memoryview(part.reshape(-1)).cast("B"))  # no bytes copy of a 100 MB tensor
            length += part.nbytes
            self.unsynced += part.nbytes
            if self.unsynced >= self.SYNC_BYTES:
                self._drop()
        if length != int(np.prod(dims)) * np.dtype(dtype).itemsize:
            raise ExportError(f"the weights of {name} are not {tuple(dims)}: the checkpoint does not match its config.json; "
                              "re-save or re-download it.")
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=dims)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.location), ("offset", str(offset)), ("length", str(length))):
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


def _longrope_angles(node: Any, data: _Writer, r: Rotary, short: str, k: str) -> str:
    """LongRoPE's angles: the long factors' at every position of a pass over more than one position
    (a prompt, from an empty cache) whose sequence is longer than ``r.switch``, as transformers
    computes such a pass; in a one-position pass (decoding), at the positions from the switch on,
    each row by its own position (rows of a batch stay independent). Either way the keys already in
    the cache keep the rotation they were written with."""
    node("Mul", ["positions_col", data.add(f"inv_freq_long{k}", r.inv_long)], [f"angles_long{k}"], f"/model/rotary/MulLong{k}")
    switch = data.add(f"rope_switch{k}", np.array(r.switch, np.int64))
    node("Shape", ["input_ids"], [f"rope_ids_shape{k}"], f"/model/rotary/Shape{k}")
    node("Gather", [f"rope_ids_shape{k}", data.add("one_idx", np.array(1, np.int64))], [f"rope_pass_len{k}"],
         f"/model/rotary/Gather{k}", axis=0)
    node("Greater", [f"rope_pass_len{k}", data.add("one_i64", np.array(1, np.int64))], [f"rope_prompt{k}"], f"/model/rotary/Prompt{k}")
    node("Greater", ["total_i64", switch], [f"rope_past_switch{k}"], f"/model/rotary/PastSwitch{k}")
    node("And", [f"rope_prompt{k}", f"rope_past_switch{k}"], [f"rope_pass_long{k}"], f"/model/rotary/And{k}")
    node("GreaterOrEqual", ["positions_col", data.add(f"rope_switch_f{k}", np.array(r.switch, np.float32))],
         [f"rope_position_long{k}"], f"/model/rotary/PositionLong{k}")
    node("Or", [f"rope_position_long{k}", f"rope_pass_long{k}"], [f"rope_long{k}"], f"/model/rotary/Or{k}")
    return node("Where", [f"rope_long{k}", f"angles_long{k}", short], [f"angles_chosen{k}"],
                f"/model/rotary/Where{k}")[0]


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
    fam: Family = read_family(c, _transformers_major())
    hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = fam.head_dim
    eps = float(c.get("rms_norm_eps", 1e-6))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    w = _Weights(folder)
    data = _Writer(out_dir)
    nodes: list[onnx.NodeProto] = []

    def node(op: str, ins: list[str], outs: list[str], name: str, domain: str = "", **attrs) -> list[str]:
        nodes.append(helper.make_node(op, ins, outs, name=name, domain=domain, **attrs))
        return outs

    def linear(x: str, names: list[str], prefix: str, out: str) -> str:
        """x @ W^T with the weights of ``names`` packed along the output (one MatMul), plus their biases
        where the checkpoint has them (Qwen2's q/k/v, gpt-oss's attention and router, ``attention_bias``
        and ``mlp_bias`` Llamas)."""
        bias = all(f"{n}.bias" in w for n in names)
        weight = w.transposed([f"{n}.weight" for n in names])  # (in, out)
        node("MatMul", [x, data.add(f"{prefix}.weight", weight)], [out + ("_mm" if bias else "")], f"{out}/MatMul")
        if bias:
            b = np.concatenate([w[f"{n}.bias"] for n in names])
            node("Add", [out + "_mm", data.add(f"{prefix}.bias", b)], [out], f"{out}/Add")
        return out

    def rms_norm(x: str, weight: str, name: str, out: str = "output") -> str:
        """RMSNorm in float32 (``stash_type``); Gemma's ``x * (1 + w)`` as the stored weight ``1 + w``."""
        scale = w[weight] + np.float32(fam.norm_offset) if fam.norm_offset else w[weight]
        return node("SimplifiedLayerNormalization", [x, data.add(weight, scale)], [f"{name}/{out}"], f"{name}/LayerNorm",
                    axis=-1, epsilon=eps, stash_type=1)[0]

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
    # layer's shard is (total, rotary_dim / 2), not a copy of a max_position_embeddings table per shard.
    # One pair per distinct RoPE (Gemma 3: the local layers' and the global layers')
    node("Cast", ["total_i64"], ["total_f"], "/model/rotary/Cast", to=TensorProto.FLOAT)
    node("Range", [data.add("zero_f", np.array(0.0, np.float32)), "total_f", data.add("one_f", np.array(1.0, np.float32))],
         ["positions_f"], "/model/rotary/Range")
    node("Unsqueeze", ["positions_f", data.add("one_axis", np.array([1], np.int64))], ["positions_col"], "/model/rotary/Unsqueeze")
    tables: dict[bytes, tuple[str, str]] = {}
    rope_typed: dict[str, tuple[int, list]] = {}  # the tables' value infos: rotary_dim / 2 wide
    layer_tables = []
    made = {id(rope): rotary(rope, c, head_dim) for rope in fam.ropes if rope}  # fam.ropes repeats one dict per RoPE
    for rope in fam.ropes:
        if rope is None:  # a layer without a position embedding (SmolLM3's NoPE layers)
            layer_tables.append(None)
            continue
        r = made[id(rope)]
        if r.key() not in tables:
            k = f"_{len(tables)}" if tables else ""  # the first pair keeps the names of a one-RoPE graph
            angles = node("Mul", ["positions_col", data.add(f"inv_freq{k}", r.inv)], [f"angles{k}"],
                          f"/model/rotary/Mul{k}")[0]  # (total, rotary_dim / 2)
            if r.inv_long is not None:
                angles = _longrope_angles(node, data, r, angles, k)
            pair = []
            for f in ("Cos", "Sin"):
                t = node(f, [angles], [f"{f.lower()}_cache{k}" + ("_unscaled" if r.scale != 1.0 else "")], f"/model/rotary/{f}{k}")[0]
                if r.scale != 1.0:  # YaRN's / LongRoPE's attention factor, on cos and sin as transformers applies it
                    t = node("Mul", [t, data.add(f"rope_scale{k}", np.array(r.scale, np.float32))], [f"{f.lower()}_cache{k}"],
                             f"/model/rotary/{f}Scale{k}")[0]
                pair.append(t)
            tables[r.key()] = (pair[0], pair[1])
            for n in (angles, *pair, *(f"{f}_cache{k}_unscaled" for f in ("cos", "sin") if r.scale != 1.0)):
                rope_typed[n] = (TensorProto.FLOAT, ["total_sequence_length", len(r.inv)])
            if r.inv_long is not None:
                rope_typed.update({f"angles{k}": rope_typed[angles], f"angles_long{k}": rope_typed[angles],
                                   f"rope_pass_long{k}": (TensorProto.BOOL, []), f"rope_ids_shape{k}": (TensorProto.INT64, [2]),
                                   f"rope_pass_len{k}": (TensorProto.INT64, []), f"rope_prompt{k}": (TensorProto.BOOL, []),
                                   f"rope_past_switch{k}": (TensorProto.BOOL, []),
                                   f"rope_position_long{k}": (TensorProto.BOOL, ["total_sequence_length", 1]),
                                   f"rope_long{k}": (TensorProto.BOOL, ["total_sequence_length", 1])})
        layer_tables.append(tables[r.key()])

    data.group("embed")
    x = node("Gather", [data.add("model.embed_tokens.weight", w["model.embed_tokens.weight"]), "input_ids"],
             ["/model/embed_tokens/output"], "/model/embed_tokens/Gather")[0]
    if fam.embed_scale:  # Gemma: sqrt(hidden) in float32, as transformers casts it to the hidden dtype
        x = node("Mul", [x, data.add("embed_scale", np.array(fam.embed_scale, np.float32))], ["/model/embed_tokens/scaled"],
                 "/model/embed_tokens/Mul")[0]
    packed = "model.layers.0.self_attn.qkv_proj.weight" in w  # Phi-3 stores q/k/v and gate/up packed already
    qk_norm = "model.layers.0.self_attn.q_norm.weight" in w

    def head_norm(x: str, weight: str, name: str, n: int) -> str:
        """RMSNorm over each head_dim slice of (B, S, n * head_dim): reshaped to (B, S * n, head_dim) and back."""
        flat = node("Reshape", [x, data.add(f"heads_shape_{head_dim}", np.array([0, -1, head_dim], np.int64))],
                    [f"{name}/heads"], f"{name}/Reshape")[0]
        normed = rms_norm(flat, weight, name, "normed")
        return node("Reshape", [normed, data.add(f"rows_shape_{n * head_dim}", np.array([0, -1, n * head_dim], np.int64))],
                    [f"{name}/rows"], f"{name}/Reshape_1")[0]

    def qk_normed(x: str, weight: str, name: str, n: int) -> str:
        """Qwen3, Gemma 3: RMSNorm over each head; OLMo 2: over all n heads at once (its weight is n heads wide)."""
        if w[weight].shape[0] == n * head_dim and n > 1:
            return rms_norm(x, weight, name, "normed")
        return head_norm(x, weight, name, n)

    def gated(h: str, ups: list[str], packed_name: str, down: str, inter: int, p: str) -> str:
        """down(act(gate) * up), gate and up in one MatMul: act SiLU, or GELU (tanh: FastGelu) for Gemma."""
        gu = linear(h, ups, packed_name, f"{p}/gate_up")
        gate, up = node("Split", [gu, data.add(f"split_{inter}", np.array([inter, inter], np.int64))],
                        [f"{p}/gate", f"{p}/up"], f"{p}/Split", axis=-1)
        if fam.activation == "silu":
            node("Sigmoid", [gate], [f"{p}/sigmoid"], f"{p}/Sigmoid")
            act = node("Mul", [gate, f"{p}/sigmoid"], [f"{p}/silu"], f"{p}/Mul")[0]
        elif fam.activation == "gelu_tanh":
            act = node("FastGelu", [gate], [f"{p}/gelu"], f"{p}/FastGelu", domain=_MS)[0]
        else:  # exact GELU (erf): transformers 4.x's reading of Gemma 1's legacy "gelu"
            act = node("Gelu", [gate], [f"{p}/gelu"], f"{p}/Gelu", domain=_MS)[0]
        node("Mul", [act, up], [f"{p}/act"], f"{p}/Mul_1")
        return linear(f"{p}/act", [down], down, f"{p}/down")

    def mlp(h: str, hf: str, p: str) -> str:
        return gated(h, [f"{hf}.mlp.gate_up_proj"] if packed else [f"{hf}.mlp.gate_proj", f"{hf}.mlp.up_proj"],
                     f"{hf}.mlp.gate_up_proj", f"{hf}.mlp.down_proj", int(c["intermediate_size"]), f"{p}/mlp")

    def ffn(h: str, hf: str, p: str, i: int) -> str:
        """The layer's MLP, or its routed experts (a mixture of experts)."""
        if fam.experts is None or not fam.experts.sparse[i]:
            return mlp(h, hf, p)
        return routed_experts(h, hf, p, fam.experts, Graph(w, data, node, linear, gated))

    def residual_scaled(y: str, p: str) -> str:
        """Granite: a block's output times residual_multiplier before its residual add."""
        if fam.residual_scale == 1.0:
            return y
        return node("Mul", [y, data.add("residual_scale", np.array(fam.residual_scale, np.float32))], [f"{p}/residual_scaled"],
                    f"{p}/residual/Mul")[0]

    inputs, outputs = [], []
    attn_out = {}  # GQA's output: heads * head_dim wide, which need not be hidden (Qwen3, Gemma)
    for i in range(layers):
        p, hf = f"/model/layers.{i}", f"model.layers.{i}"
        data.group(f"layers.{i}")
        h = rms_norm(x, f"{hf}.input_layernorm.weight", f"{p}/input_layernorm") if fam.pre_norms else x
        qkv = linear(h, [f"{hf}.self_attn.qkv_proj"] if packed else [f"{hf}.self_attn.{n}_proj" for n in "qkv"],
                     f"{hf}.self_attn.qkv_proj", f"{p}/attn/qkv")
        qkv_in = [qkv, "", ""]
        if qk_norm:  # Qwen3, Gemma 3: an RMSNorm over each head of q and of k, before the rotary embedding (inside GQA)
            q, k, v = node("Split", [qkv, data.add("split_qkv", np.array([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], np.int64))],
                           [f"{p}/attn/q", f"{p}/attn/k", f"{p}/attn/v"], f"{p}/attn/Split", axis=-1)
            qkv_in = [qk_normed(q, f"{hf}.self_attn.q_norm.weight", f"{p}/attn/q_norm", heads),
                      qk_normed(k, f"{hf}.self_attn.k_norm.weight", f"{p}/attn/k_norm", kv_heads), v]
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        pres_k, pres_v = f"present.{i}.key", f"present.{i}.value"
        cos_sin = list(layer_tables[i] or ())  # none for a NoPE layer
        sink = f"{hf}.self_attn.sinks"  # gpt-oss: a logit per head that takes part in the softmax and attends to nothing
        sinks = [*(cos_sin or ["", ""]), "", "", data.add(sink, w[sink])] if sink in w else []
        node("GroupQueryAttention", [*qkv_in, past_k, past_v, "seqlens_k", "total_seq_len", *(sinks or cos_sin)],
             [f"{p}/attn/output", pres_k, pres_v], f"{p}/attn/GroupQueryAttention", domain=_MS,
             num_heads=heads, kv_num_heads=kv_heads, scale=fam.scale, do_rotary=int(bool(cos_sin)),
             rotary_interleaved=0, local_window_size=fam.windows[i], **({"softcap": fam.softcap} if fam.softcap else {}))
        attn_out[f"{p}/attn/output"] = (TensorProto.FLOAT, ["batch_size", "sequence_length", heads * head_dim])
        o = linear(f"{p}/attn/output", [f"{hf}.self_attn.o_proj"], f"{hf}.self_attn.o_proj", f"{p}/attn/o_proj")
        if fam.sandwich:  # Gemma 2/3: the attention's output normed before the residual, the MLP's input and output too
            o = rms_norm(o, f"{hf}.post_attention_layernorm.weight", f"{p}/post_attention_layernorm")
        o = residual_scaled(o, f"{p}/attn")
        x1 = node("Add", [x, o], [f"{p}/attn/residual"], f"{p}/attn/residual/Add")[0]
        pre_mlp = "pre_feedforward_layernorm" if fam.sandwich else "post_attention_layernorm"
        d = ffn(rms_norm(x1, f"{hf}.{pre_mlp}.weight", f"{p}/{pre_mlp}") if fam.pre_norms else x1, hf, p, i)
        if fam.sandwich:
            d = rms_norm(d, f"{hf}.post_feedforward_layernorm.weight", f"{p}/post_feedforward_layernorm")
        d = residual_scaled(d, f"{p}/mlp")
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
    h = rms_norm(x, "model.norm.weight", "/model/norm")
    head = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"  # tied embeddings
    if fam.final_softcap:  # Gemma 2: logits tanh(x / c) * c
        cap = data.add("final_softcap", np.array(fam.final_softcap, np.float32))
        node("MatMul", [h, data.add("lm_head.weight", w.transposed([head]))], ["/lm_head/output"], "/lm_head/MatMul")
        node("Div", ["/lm_head/output", cap], ["/lm_head/softcap/Div_output"], "/lm_head/softcap/Div")
        node("Tanh", ["/lm_head/softcap/Div_output"], ["/lm_head/softcap/Tanh_output"], "/lm_head/softcap/Tanh")
        node("Mul", ["/lm_head/softcap/Tanh_output", cap], ["logits"], "/lm_head/softcap/Mul")
    elif fam.logits_divisor != 1.0:  # Granite: logits / logits_scaling
        node("MatMul", [h, data.add("lm_head.weight", w.transposed([head]))], ["/lm_head/output"], "/lm_head/MatMul")
        node("Div", ["/lm_head/output", data.add("logits_divisor", np.array(fam.logits_divisor, np.float32))], ["logits"],
             "/lm_head/Div")
    else:
        node("MatMul", [h, data.add("lm_head.weight", w.transposed([head]))], ["logits"], "/lm_head/MatMul")
    data.close()
    # contrib ops defeat ONNX's shape inference: type what may cross a shard boundary
    seq = ["batch_size", "sequence_length"]
    vocab = int(c["vocab_size"])
    typed = {"seqlens_k": (TensorProto.INT32, ["batch_size"]), "total_seq_len": (TensorProto.INT32, None),
             "mask_sum": (TensorProto.INT64, ["batch_size"]), "seqlens_k_i64": (TensorProto.INT64, ["batch_size"]),
             "mask_shape": (TensorProto.INT64, [2]), "total_i64": (TensorProto.INT64, None),
             "total_f": (TensorProto.FLOAT, None), "positions_f": (TensorProto.FLOAT, ["total_sequence_length"]),
             "positions_col": (TensorProto.FLOAT, ["total_sequence_length", 1]),
             "logits_index_col": (TensorProto.INT64, ["batch_size", "logits_length", 1]),
             "logits_index_wide": (TensorProto.INT64, ["batch_size", "logits_length", hidden]),
             "/model/logits_index/output": (TensorProto.FLOAT, ["batch_size", "logits_length", hidden]),
             "/model/norm/output": (TensorProto.FLOAT, ["batch_size", "logits_length", hidden]),
             **{n: (TensorProto.FLOAT, ["batch_size", "logits_length", vocab])
                for n in ("/lm_head/output", "/lm_head/softcap/Div_output", "/lm_head/softcap/Tanh_output")}, **attn_out}
    typed.update(rope_typed)
    known = {"logits", *(o.name for o in outputs)}
    value_info = [helper.make_tensor_value_info(n.output[0], *typed.get(n.output[0], (TensorProto.FLOAT, None)))
                  for n in nodes if n.output[0] not in known]
    for vi in value_info:
        if vi.name.endswith(("residual", "output", "scaled")) and vi.name not in typed and vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.CopyFrom(helper.make_tensor_value_info(vi.name, TensorProto.FLOAT, [*seq, hidden]))
    graph = helper.make_graph(
        nodes, "slimml-fused-decoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "past_sequence_length + sequence_length"]),
         *inputs, helper.make_tensor_value_info("logits_index", TensorProto.INT64, ["batch_size", "logits_length"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "logits_length", vocab]),
         *outputs],
        initializer=data.initializers, value_info=value_info,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(_MS, 1)],
                              producer_name="slimml-fused")
    model.ir_version = 8
    onnx.save(model, str(path))
    return path
