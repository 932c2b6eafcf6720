"""Decoders the fused exporter does not write, traced with their KV cache by the torch exporter
(``convert/export_torch_decoder.py``), with the installed transformers (4.57 or 5).

Each tiny random model is converted and must generate what transformers' own ``generate`` gives,
for a batch of two prompts of different lengths (the left padding, the cache fed back every token).
What sets each family apart: GPT-2 (learned positions, Conv1D), GPT-NeoX (partial rotary, parallel
residual), Phi (LayerNorm, partial rotary, biases), Falcon (grouped KV heads), Cohere (interleaved
rotary through ``repeat_interleave``), BLOOM (ALiBi, no positions), StarCoder2 (optimum-onnx 0.1.0
does not know it: ``--exporter auto`` falls back to this exporter under 4.57 too), DiffLlama
(``torch.rms_norm``, which has no ONNX form at opset 17), RoBERTa as a decoder (positions as transformers' ``generate`` feeds them, 0-based). Mixtures of
experts (transformers 5) through ONNX Runtime's MoE op (``convert/trace_experts.py``).
"""

from __future__ import annotations

import json

import pytest

from slimml.errors import ExportError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 300
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=128, initializer_range=0.3)
FAMILIES = {
    "gpt2": dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.3),
    "gpt_neox": dict(SMALL, rotary_pct=0.25),
    "phi": dict(SMALL, partial_rotary_factor=0.5),
    "falcon": dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
                   num_kv_heads=2, initializer_range=0.3),
    "cohere": dict(SMALL, num_key_value_heads=2),
    "bloom": dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, initializer_range=0.3),
    "starcoder2": dict(SMALL, num_key_value_heads=2),
    "diffllama": dict(SMALL, num_key_value_heads=2),
    "roberta": dict(SMALL, is_decoder=True),
}
PROMPTS = [[5, 9, 13, 2, 7, 30, 41], [11, 4]]


def _save(name: str, folder, **extra) -> object:
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in transformers.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {name}")
    torch.manual_seed(0)
    config = AutoConfig.for_model(name, **{**FAMILIES.get(name, SMALL), **extra})
    model = AutoModelForCausalLM.from_config(config).eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    return model


def _expected(model, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _generates_as(model, art_dir, new: int = 8) -> None:
    """The artifact's greedy tokens for :data:`PROMPTS` (one batch) equal ``model.generate``'s, prompt by prompt."""
    from slimml.runtime import load

    art = load(art_dir)
    try:
        got = art.generate(PROMPTS, max_new_tokens=new, eos_token_id=()).tokens
    finally:
        art.close()
    assert got == [_expected(model, p, new) for p in PROMPTS]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_decoder_fused_does_not_write_generates_as_transformers(name, tmp_path):
    from slimml.convert import ConvertConfig, convert
    from slimml.convert.export import ExportConfig

    model = _save(name, tmp_path / "hf")
    exporter = "auto" if name == "starcoder2" else "torch"
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(export=ExportConfig(exporter=exporter),
                                                                      measure_latency=False))
    assert report.task == "text-generation-with-past"
    assert report.checks["max_abs_diff_vs_torch"] < 1e-4
    steps = json.loads((tmp_path / "art" / "manifest.json").read_text())["steps"]
    assert next(s for s in steps if s["step"] == "export")["exporter"] == "torch.onnx"
    _generates_as(model, tmp_path / "art")


def test_without_the_cache_too(tmp_path):
    """``--task text-generation --exporter torch``: the cache-free graph, each token over the whole sequence."""
    from slimml.convert import ConvertConfig, convert
    from slimml.convert.export import ExportConfig
    from slimml.runtime import load

    model = _save("gpt_neox", tmp_path / "hf")
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(
        export=ExportConfig(exporter="torch", task="text-generation"), measure_latency=False))
    assert report.task == "text-generation"
    art = load(tmp_path / "art")
    try:
        assert not [i for i in art.engine.inputs if i.name.startswith("past_key_values.")]
        assert art.generate(PROMPTS, max_new_tokens=6, eos_token_id=()).tokens == [_expected(model, p, 6) for p in PROMPTS]
    finally:
        art.close()


MOE = {
    "mixtral": dict(SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(SMALL, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "qwen3_moe": dict(SMALL, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      head_dim=16),
    "deepseek_v3": dict(SMALL, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        first_k_dense_replace=1, n_group=1, topk_group=1),
}
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.x keeps experts in loops a trace cannot follow")
@pytest.mark.parametrize("name", list(MOE))
def test_a_mixture_of_experts_routes_every_token_at_run_time(name, tmp_path):
    """Mixtral (renormalised top-k), Qwen2-MoE (raw weights, a shared expert), Qwen3-MoE, DeepSeek-V3
    (grouped sigmoid routing, a dense first layer): the experts are ONNX Runtime's MoE op, fed the
    model's own routing; greedy tokens for two prompts equal transformers' own."""
    from slimml.convert import ConvertConfig, convert
    from slimml.convert.export import ExportConfig

    model = _save(name, tmp_path / "hf", **MOE[name])  # the torch exporter: Mixtral and Qwen's go fused by default
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(export=ExportConfig(exporter="torch"), measure_latency=False))
    assert report.checks["max_abs_diff_vs_torch"] < 1e-4
    _generates_as(model, tmp_path / "art")


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.x keeps experts in loops a trace cannot follow")
def test_gpt_oss_experts_and_attention_sinks(tmp_path):
    """gpt-oss: experts stored transposed and interleaved, with biases, SwiGLU clamped at 7 (``up + 1``,
    alpha 1.702: the MoE op's own attributes), attention sinks, a 4-token window on alternate layers;
    greedy tokens past the window and the clamp equal transformers'."""
    from slimml.convert import ConvertConfig, convert
    from slimml.convert.export import ExportConfig

    model = _save("gpt_oss", tmp_path / "hf", **MOE["mixtral"], head_dim=16, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("_bias", "sinks")):
                param.normal_(0.0, 0.5)
            elif name.endswith("gate_up_proj"):
                param.normal_(0.0, 2.0)  # gate values well past the clamp at 7
    model.save_pretrained(tmp_path / "hf")  # the torch exporter: gpt-oss goes fused by default (tests/test_decoder_archs.py)
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(export=ExportConfig(exporter="torch"), measure_latency=False))
    assert report.checks["max_abs_diff_vs_torch"] < 1e-4
    _generates_as(model, tmp_path / "art")


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.x keeps experts in loops a trace cannot follow")
@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_a_mixture_of_experts_quantizes_its_experts(bits, tmp_path):
    """``int4-weights`` / ``int8-weights`` (ONNX Runtime's quantizer, no accuracy level): the MoE nodes
    become QMoE (4-bit blocks of 32, 8-bit rows),
    the artifact shrinks, and its logits stay those of the float artifact (cosine over a prompt)."""
    import glob

    import numpy as np
    import onnx

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.export import ExportConfig
    from slimml.quantize import WeightOnlyConfig, quantize
    from slimml.runtime import load
    from slimml.runtime.tasks.generation.loop import DecodeLoop

    _save("qwen3_moe", tmp_path / "hf", **{**MOE["qwen3_moe"], "initializer_range": 0.02, "hidden_size": 128,
                                           "moe_intermediate_size": 64})
    convert(tmp_path / "hf", tmp_path / "fp32", ConvertConfig(export=ExportConfig(exporter="torch"), measure_latency=False))
    quantize(tmp_path / "fp32", tmp_path / "q", WeightOnlyConfig(bits=bits))
    ops = {n.op_type for f in glob.glob(str(tmp_path / "q" / "**" / "*.onnx"), recursive=True)
           for n in onnx.load(f, load_external_data=False).graph.node}
    assert "QMoE" in ops and "MoE" not in ops

    def size(folder):
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    assert size(tmp_path / "q") < 0.6 * size(tmp_path / "fp32")
    prompts = [[(13 * i + 7 * j) % VOCAB for j in range(6 + i)] for i in range(4)]
    logits = []
    for folder in ("fp32", "q"):
        art = load(tmp_path / folder)
        try:  # each prompt's next-token logits, the prompts as one batch
            logits.append(DecodeLoop(art.engine, prompts, pad_id=0, steps=1).next_logits().reshape(-1))
        finally:
            art.close()
    a, b = logits
    # random weights: all matrices' noise (8-bit rows: 0.99986 under transformers 5.24's initialisation)
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > (0.95 if bits == 4 else 0.9995)


@pytest.mark.parametrize("bits, width, clamped", [(4, 64, False), (4, 48, False), (8, 64, False), (4, 64, True), (8, 64, True)])
def test_qmoe_computes_the_moe_of_its_dequantized_weights(bits, width, clamped):
    """ONNX Runtime's QMoE kernel on ``quantize_experts``' codes and scales (4-bit blocks of 32, or rows
    where the input is not a multiple of 32; 8-bit rows), float activations (no accuracy level), equals
    its float MoE on the dequantized weights;
    also with gpt-oss's experts (biases, SwiGLU clamped at 7 with alpha 1.702 and ``up + 1``)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from slimml.quantize.experts import _block, _symmetric, quantize_experts

    rng = np.random.default_rng(0)
    experts, inner = 4, 32
    w1 = rng.standard_normal((experts, 2 * inner, width)).astype(np.float32) * (2.0 if clamped else 0.1)  # past the clamp
    w2 = rng.standard_normal((experts, width, inner)).astype(np.float32) * 0.1
    b1, b2 = (rng.standard_normal(shape).astype(np.float32) * clamped for shape in ((experts, 2 * inner), (experts, width)))
    attrs = dict(k=2, activation_type="swiglu", normalize_routing_weights=1, swiglu_fusion=1,
                 activation_alpha=1.702 if clamped else 1.0, activation_beta=float(clamped),
                 swiglu_limit=7.0 if clamped else float("inf"))

    def moe(a, b):
        node = helper.make_node("MoE", ["x", "router", "w1", "b1", "w2", "b2"], ["y"], domain="com.microsoft", **attrs)
        inits = [numpy_helper.from_array(t, n) for t, n in ((a, "w1"), (b1, "b1"), (b, "w2"), (b2, "b2"))]
        graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, width]),
                                                  helper.make_tensor_value_info("router", TensorProto.FLOAT, [None, experts])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, width])], inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])

    def dequantized(w):
        block = _block(w, bits) if _block(w1, bits) == _block(w2, bits) else 0
        codes, scales = _symmetric(w, bits, block)
        if bits == 4:
            codes = np.stack([codes & 15, codes >> 4], axis=-1).reshape(w.shape)
        values = codes.astype(np.float32) - 2 ** (bits - 1)
        groups = values.reshape(*w.shape[:2], -1, block or w.shape[2])
        return (groups * (scales if block else scales[..., None])[..., None]).reshape(w.shape)

    quantized = moe(w1, w2)
    assert quantize_experts(quantized, bits)["moe_nodes"] == 1
    assert [n.op_type for n in quantized.graph.node] == ["QMoE"]
    feeds = {"x": rng.standard_normal((7, width)).astype(np.float32), "router": rng.standard_normal((7, experts)).astype(np.float32)}
    got = ort.InferenceSession(quantized.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    want = ort.InferenceSession(moe(dequantized(w1), dequantized(w2)).SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    onnx.checker.check_model(quantized)
    assert np.abs(got - want).max() < 1e-5


def test_8_bit_experts_keep_mxfp4_blocks_exactly():
    """gpt-oss's experts come as MXFP4 (e2m1 codes times a power of two a block of 32): at 8 bits each
    such block is stored on max / 120, which holds every e2m1 value whatever the block's largest, so
    the codes give the source back to float32 rounding; other blocks keep max / 127."""
    import numpy as np

    from slimml.quantize.experts import _symmetric

    rng = np.random.default_rng(0)
    fp4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    w = (fp4[rng.integers(0, 8, (2, 4, 128))] * rng.choice([-1, 1], (2, 4, 128))).reshape(2, 4, 4, 32)
    w *= np.exp2(rng.integers(-9, -3, (2, 4, 4, 1)))
    w[0, 0, 0] = rng.normal(size=32) * 0.01  # one block on no lattice
    w = w.reshape(2, 4, 128).astype(np.float32)
    codes, scales = _symmetric(w, 8, 32)
    back = ((codes.astype(np.float32) - 128).reshape(2, 4, 4, 32) * scales[..., None]).reshape(w.shape)
    err = np.abs(back - w).reshape(2, 4, 4, 32).max(-1) / np.abs(w).reshape(2, 4, 4, 32).max(-1)
    assert err[0, 0, 0] > 1e-4 and np.isclose(scales[0, 0, 0], np.abs(w[0, 0, :32]).max() / 127)
    err[0, 0, 0] = 0
    assert err.max() < 1e-6


@pytest.mark.parametrize("bits", [4, 8])
def test_qmoe_at_accuracy_level_4_rounds_each_expert_input_to_int8_blocks(bits):
    """The decoder recipes' experts (``accuracy_level`` 4, blocks of 32 at 4 and 8 bits) run on
    MatMulNBits' kernels: the MoE of the dequantized weights with each expert's input and SwiGLU output
    rounded to int8 in blocks of 32 (scale max / 127), as the dense layers are at level 4."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from slimml.quantize.experts import _symmetric, quantize_experts

    rng = np.random.default_rng(1)
    experts, hidden, inner, k = 4, 128, 64, 2
    w1 = rng.standard_normal((experts, 2 * inner, hidden)).astype(np.float32) * 0.1
    w2 = rng.standard_normal((experts, hidden, inner)).astype(np.float32) * 0.1
    node = helper.make_node("MoE", ["x", "router", "w1", "", "w2", ""], ["y"], domain="com.microsoft", k=k,
                            activation_type="swiglu", normalize_routing_weights=1, swiglu_fusion=1, activation_alpha=1.0,
                            activation_beta=0.0)
    graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, hidden]),
                                              helper.make_tensor_value_info("router", TensorProto.FLOAT, [None, experts])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, hidden])],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    assert quantize_experts(model, bits, 4) == {"moe_nodes": 1, "bits": bits, "grid": "symmetric", "block": 32, "accuracy_level": 4}

    def dequantized(w):
        codes, scales = _symmetric(w, bits, 32)
        if bits == 4:
            codes = np.stack([codes & 15, codes >> 4], axis=-1).reshape(w.shape)
        values = (codes.astype(np.float32) - 2 ** (bits - 1)).reshape(*w.shape[:2], -1, 32)
        return (values * scales[..., None]).reshape(w.shape)

    def int8_blocks(a):
        blocks = a.reshape(-1, 32)
        scale = np.abs(blocks).max(axis=1, keepdims=True) / 127
        return (np.rint(blocks / np.where(scale == 0, 1, scale)) * scale).reshape(a.shape)

    x, router = rng.standard_normal((5, hidden)).astype(np.float32), rng.standard_normal((5, experts)).astype(np.float32)
    d1, d2 = dequantized(w1), dequantized(w2)
    want = np.zeros_like(x)
    for t in range(len(x)):
        top = np.argsort(-router[t])[:k]
        weights = np.exp(router[t, top] - router[t, top].max())
        for e, weight in zip(top, weights / weights.sum()):
            h = d1[e] @ int8_blocks(x[t])
            gate, up = h[0::2], h[1::2]
            want[t] += weight * (d2[e] @ int8_blocks(gate / (1 + np.exp(-gate)) * up))
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x, "router": router})[0]
    assert np.abs(got - want).max() < 1e-5


def test_fitted_experts_carry_zero_points_and_round_closer_than_symmetric_blocks():
    """The decoder recipe's 4-bit experts (``fitted``, with the calibration tokens' inputs and router
    logits): asymmetric blocks with zero points in the layout ONNX Runtime's kernel reads (its output
    equals the numpy MoE of the dequantized, equalized weights at int8 activations), the same function
    as the float experts, and closer to it than round-to-nearest symmetric blocks."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from slimml.quantize.experts import quantize_experts

    rng = np.random.default_rng(2)
    experts, hidden, inner, k = 4, 128, 96, 2
    outliers = np.exp(rng.standard_normal(hidden))  # input channels of unequal size, as real activations have
    w1 = rng.standard_normal((experts, 2 * inner, hidden)).astype(np.float32) * 0.1
    w2 = rng.standard_normal((experts, hidden, inner)).astype(np.float32) * 0.1
    x = (rng.standard_normal((512, hidden)) * outliers).astype(np.float32)
    router = rng.standard_normal((512, experts)).astype(np.float32)

    def model():
        node = helper.make_node("MoE", ["x", "router", "w1", "", "w2", ""], ["y"], domain="com.microsoft", k=k,
                                activation_type="swiglu", normalize_routing_weights=1, swiglu_fusion=1,
                                activation_alpha=1.0, activation_beta=0.0)
        graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, hidden]),
                                                  helper.make_tensor_value_info("router", TensorProto.FLOAT, [None, experts])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, hidden])],
                                  [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])

    def run(m, feeds):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    def nibbles(a):
        return np.stack([a & 15, a >> 4], axis=-1).reshape(*a.shape[:-1], -1)

    fitted, plain, reference = model(), model(), model()
    assert quantize_experts(fitted, 4, 4, fitted=True, samples={"x": x, "router": router})["grid"] == "fitted, GPTQ"
    quantize_experts(plain, 4, 4)
    node = fitted.graph.node[0]
    assert node.op_type == "QMoE" and node.input[11] and node.input[12]  # fc1 and fc2 zero points
    t = {i.name: numpy_helper.to_array(i) for i in fitted.graph.initializer}
    dequantized = []
    for codes, scales, zeros in ((node.input[2], node.input[3], node.input[11]), (node.input[5], node.input[6], node.input[12])):
        q = nibbles(t[codes]).astype(np.float32)
        z = nibbles(t[zeros])[..., :t[scales].shape[-1]].astype(np.float32)
        blocks = q.reshape(*q.shape[:2], -1, 32) - z[..., None]
        dequantized.append((blocks * t[scales][..., None]).reshape(q.shape))

    def int8_blocks(a):
        b = a.reshape(-1, 32)
        scale = np.abs(b).max(axis=1, keepdims=True) / 127
        return (np.rint(b / np.where(scale == 0, 1, scale)) * scale).reshape(a.shape)

    feeds = {"x": x[:6], "router": router[:6]}
    want = np.zeros((6, hidden), np.float32)
    for i in range(6):
        top = np.argsort(-router[i])[:k]
        weights = np.exp(router[i, top] - router[i, top].max())
        for e, weight in zip(top, weights / weights.sum()):
            h = dequantized[0][e] @ int8_blocks(x[i])
            want[i] += weight * (dequantized[1][e] @ int8_blocks(h[0::2] / (1 + np.exp(-h[0::2])) * h[1::2]))
    assert np.abs(run(fitted, feeds) - want).max() < 1e-4 * np.abs(want).max()
    feeds = {"x": x, "router": router}
    exact = run(reference, feeds)
    err_fitted, err_plain = (np.sqrt(((run(m, feeds) - exact) ** 2).mean()) for m in (fitted, plain))
    assert err_fitted < 0.8 * err_plain, (err_fitted, err_plain)  # 0.61 measured


@pytest.mark.skipif(TRANSFORMERS_5, reason="transformers 5 converts it")
def test_a_mixture_of_experts_under_transformers_4_is_refused_in_one_line(tmp_path):
    """Under 4.x a trace would record the experts the example routes to: a mixture the fused graph does
    not write (DeepSeek-V3's attention) is refused by name, nothing written."""
    from slimml.convert import ConvertConfig, convert

    _save("deepseek_v3", tmp_path / "hf", **MOE["deepseek_v3"])
    with pytest.raises(ExportError, match=r"^mixture-of-experts decoders \(n_routed_experts: 4\) convert with "
                                          r"transformers 5 \(pip install 'transformers>=5'\), not 4\..*; convert a "
                                          r"model slimml's exporters write, or export this one to ONNX yourself"):
        convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert not (tmp_path / "art").exists()


def test_gemma4_layers_that_share_another_layers_cache(tmp_path):
    """Gemma 4: its last layers keep no cache and read an earlier layer's keys and values
    (``num_kv_shared_layers``), keys serve as values (``attention_k_eq_v``), per-layer input embeddings,
    a 4-token window on alternate layers: the graph has past and present only for the layers that keep
    them, and greedy tokens past the window equal transformers'."""
    from slimml.convert import ConvertConfig, convert

    model = _save("gemma4_text", tmp_path / "hf", **{**SMALL, "initializer_range": 0.05, "num_hidden_layers": 4},
                  num_key_value_heads=2, head_dim=16, sliding_window=4, vocab_size_per_layer_input=VOCAB,
                  hidden_size_per_layer_input=16, num_kv_shared_layers=2, attention_k_eq_v=True,
                  layer_types=["sliding_attention", "full_attention"] * 2)
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.checks["max_abs_diff_vs_torch"] < 1e-4
    from slimml.runtime import load

    art = load(tmp_path / "art")
    try:
        assert sorted(i.name for i in art.engine.inputs if i.name.startswith("past_key_values.")) == [
            f"past_key_values.{layer}.{kind}" for layer in (0, 1) for kind in ("key", "value")]
    finally:
        art.close()
    _generates_as(model, tmp_path / "art")


def test_a_state_space_decoder_is_refused_in_one_line(tmp_path):
    """Falcon-Mamba keeps a recurrent state, not keys and values per layer (transformers 4.57's
    ``cache_params``, 5's linear-attention cache layers): refused by name, nothing written, where a
    cache-free trace used to be tried and failed obscurely."""
    from slimml.convert import ConvertConfig, convert
    from slimml.errors import SourceError

    _save("falcon_mamba", tmp_path / "hf", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8)
    with pytest.raises(SourceError, match=r"^FalconMambaForCausalLM keeps a recurrent state \(\w+\), where slimml's decode "
                                          r"loop needs one key and one value tensor per layer: .*convert a transformer decoder\.$"):
        convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_continuous_batching_shares_passes_and_keeps_each_answer(tmp_path):
    """The server's batch (rows joining and leaving a running batch, the cache fed back per row) on a
    traced decoder: every answer equals the one it gets alone, greedy and seeded-sampled."""
    from collections import deque

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.export import ExportConfig
    from slimml.runtime import load
    from slimml.runtime.tasks.generation.config import GenerationConfig
    from slimml.runtime.tasks.generation.continuous import ContinuousBatch

    _save("phi", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(export=ExportConfig(exporter="torch"), measure_latency=False,
                                                             verify=False))
    model = load(tmp_path / "art")
    try:
        prompts = [[(7 * i + j) % VOCAB for j in range(3 + 2 * i)] for i in range(5)]
        configs = [GenerationConfig(max_new_tokens=4 + i, temperature=0.8 if i % 2 else 0.0, seed=i, eos_token_id=())
                   for i in range(5)]
        alone = [model.generate([p], config=c).tokens[0] for p, c in zip(prompts, configs)]
        batch = ContinuousBatch(model, max_batch=2)
        waiting = deque(batch.prepare(p, c) for p, c in zip(prompts, configs))
        seqs = list(waiting)
        while waiting or batch.rows:
            batch.admit(batch.take(waiting))
            batch.step()
        assert [s.tokens for s in seqs] == alone
        assert batch.passes < sum(map(len, alone))
    finally:
        model.close()
