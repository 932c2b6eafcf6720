"""The language-model backend's recipes (quantize/grids.py, quantize/decoder.py) on tiny real graphs.

The fitted 4-bit grid (integer zero points, searched scales, blocks of 128, accuracy_level 4), the
GGUF grids kept exactly, the 8-bit blocks, and which recipe ``for_language_model`` picks. SmolLM2's
perplexity under the defaults is in tests/test_llm.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from slimml.quantize.config import Int8DynamicConfig, WeightOnlyConfig
from slimml.quantize.decoder import for_language_model, matmul_nbits_node
from slimml.quantize.grids import Recipe, block_for, dequantize, fit_blocks, more_bits_layers


def _run_matmul(w: np.ndarray, recipe: Recipe, bits: int, x: np.ndarray, importance=None):
    k, n = w.shape
    nodes, tensors = matmul_nbits_node(helper.make_node("MatMul", ["x", "W"], ["y"]), w, recipe, bits, {}, importance)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return got, {n.op_type: n for n in nodes}, {t.name: t for t in tensors}


def test_fitted_blocks_beat_min_max_and_find_q4_0_exactly():
    rng = np.random.default_rng(0)
    b = (rng.standard_normal((64, 8, 128)) * 0.02).astype(np.float32)
    q, s, z = fit_blocks(b)
    assert q.dtype == np.uint8 and q.max() <= 15 and z.max() <= 15 and s.dtype == np.float16
    fitted = np.sqrt(((dequantize(q, s, z) - b) ** 2).mean())
    lo, hi = np.minimum(b.min(-1), 0), np.maximum(b.max(-1), 0)
    sm = (hi - lo) / 15
    zm = np.clip(np.rint(-lo / sm), 0, 15)
    minmax = np.sqrt(((dequantize(np.clip(np.rint(b / sm[..., None]) + zm[..., None], 0, 15), sm, zm) - b) ** 2).mean())
    assert fitted < 0.98 * minmax, (fitted, minmax)
    # llama.cpp's Q4_0 (w = d (q - 8), fp16 d, either sign) is an integer-zero-point grid: found exactly
    d = (rng.random((16, 4)) * 0.01 * rng.choice([-1, 1], (16, 4))).astype(np.float16).astype(np.float32)
    codes = rng.integers(0, 16, (16, 4, 32))
    codes[..., 0] = 0
    w = (d[..., None] * (codes - 8)).astype(np.float32)
    q, s, z = fit_blocks(w)
    assert np.array_equal(dequantize(q, s, z), w)


def test_importance_moves_the_error_off_busy_channels():
    rng = np.random.default_rng(1)
    b = (rng.standard_normal((256, 1, 128)) * 0.02).astype(np.float32)
    imp = np.ones(128, np.float32)
    imp[:8] = 100.0  # channels whose activations are 10x larger
    plain = dequantize(*fit_blocks(b)) - b
    aware = dequantize(*fit_blocks(b, importance=imp)) - b
    assert (aware[..., :8] ** 2).mean() < 0.8 * (plain[..., :8] ** 2).mean()


@pytest.mark.parametrize("zero_points", [True, False])
def test_fitted_matmul_nbits_round_trip(zero_points):
    """One MatMul on the fitted grid: MatMulNBits' attributes and zero points, and ONNX Runtime
    computing exactly ``x @ dequantized`` (accuracy_level unset) within a 4-bit error bound of ``x @ w``."""
    rng = np.random.default_rng(2)
    k, n = 384, 48  # 384 = 3 x 128
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    recipe = Recipe(bits=4, block_size=128, accuracy_level=None, grid="fitted", zero_points=zero_points)
    got, nodes, tensors = _run_matmul(w, recipe, 4, x)
    mm = nodes["MatMulNBits"]
    attrs = {a.name: helper.get_attribute_value(a) for a in mm.attribute}
    assert attrs == {"K": k, "N": n, "bits": 4, "block_size": 128}
    assert len(mm.input) == (4 if zero_points else 3) and "MatMul" not in nodes  # no correction MatMul
    b = w.T.reshape(n, 3, 128)
    q, s, z = fit_blocks(b, zero_points)
    if zero_points:
        zp = onnx.numpy_helper.to_array(tensors[mm.input[3]])
        assert zp.dtype == np.uint8 and zp.shape == (n * 2,)  # 3 blocks -> 2 bytes a column
        assert np.array_equal(zp.reshape(n, 2)[:, 0] & 15, z[:, 0])
    want_exact = x @ dequantize(q, s, z).reshape(n, k).T
    assert np.abs(got - want_exact).max() < 1e-4 * np.abs(want_exact).max()
    ref = x @ w
    assert np.sqrt(((got - ref) ** 2).mean()) < 0.12 * np.sqrt((ref ** 2).mean())
    level4, _, _ = _run_matmul(w, Recipe(bits=4, block_size=128, accuracy_level=4, zero_points=zero_points), 4, x)
    assert np.sqrt(((level4 - ref) ** 2).mean()) < 0.13 * np.sqrt((ref ** 2).mean())


def test_eight_bit_blocks_and_small_inputs():
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((96, 40)) * 0.05).astype(np.float32)  # K = 96: blocks of 32 where 128 does not divide
    x = rng.standard_normal((1, 2, 96)).astype(np.float32)
    got, nodes, _ = _run_matmul(w, Recipe(bits=8, block_size=128, accuracy_level=4), 8, x)
    attrs = {a.name: helper.get_attribute_value(a) for a in nodes["MatMulNBits"].attribute}
    assert attrs["bits"] == 8 and attrs["block_size"] == 32 and attrs["accuracy_level"] == 4
    ref = x @ w
    assert np.sqrt(((got - ref) ** 2).mean()) < 0.01 * np.sqrt((ref ** 2).mean())
    assert block_for(576, 128) == 64 and block_for(1536, 128) == 128 and block_for(100, 128) == 128


def test_fitted_recipe_on_a_tiny_llama(tiny_llama_dir, tmp_path):
    """The whole backend on a converted 3-layer Llama: every layer MatMul is 4-bit with zero points
    (the sensitive layer's FFN down and V 8-bit), logits close to float, the recipe recorded."""
    from slimml.convert import ConvertConfig, convert
    from slimml.quantize import quantize
    from slimml.runtime.loader import load

    art = tmp_path / "fp32"
    convert(tiny_llama_dir, art, ConvertConfig(verify=False, measure_latency=False))
    config = WeightOnlyConfig(bits=4, block_size=128, accuracy_level=4, backend="lm", grid="fitted", symmetric=False,
                              sensitive_layers=(1,), calibration_size=8)
    quantize(art, tmp_path / "q4", config)
    step = json.loads((tmp_path / "q4" / "manifest.json").read_text())["steps"][-1]
    assert step["recipe"].startswith("fitted int4 (asymmetric, blocks of 128, accuracy_level 4, FFN down, V and O of 1 layers at 8 bits")
    seen = []
    for f in sorted((tmp_path / "q4").glob("shard_*.onnx")):
        for node in onnx.load(str(f), load_external_data=False).graph.node:
            if node.op_type == "MatMulNBits":
                a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
                seen.append((node.name, a["bits"], a["block_size"], a["accuracy_level"], len(node.input)))
            assert node.op_type != "MatMul" or "lm_head" not in node.name
    assert len(seen) == 3 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
    for name, bits, block, level, inputs in seen:
        eight = "layers.1" in name and ("down" in name or "v_proj" in name or "o_proj" in name)  # (lm_head: 512 columns, 4-bit here)
        want_block = 64 if "down" in name else 32  # K = 64 (intermediate) or 32 (hidden): the largest block dividing it
        assert (bits, block, level, inputs) == ((8, want_block, 4, 3) if eight else (4, want_block, 4, 4)), name
    from slimml.convert.llm_check import decoder_feeds, past_shapes

    from slimml.quantize.budget import q4_k_m_plan
    from slimml.runtime.artifact.manifest import read_manifest

    plan = q4_k_m_plan(art, read_manifest(art))  # llama.cpp's Q4_K_M size of this model, filled our way
    assert plan.embedding_bits == 4 and 0 < plan.planned_mb <= plan.budget_mb and plan.sensitive_layers
    ids = np.random.default_rng(0).integers(0, 512, (1, 12))
    fp, q4 = load(art), load(tmp_path / "q4")
    a, b = (m.run(decoder_feeds([t.name for t in m.manifest.inputs], ids, past_shapes(m.manifest.inputs)))["logits"]
            for m in (fp, q4))  # the default export has its (empty) cache
    fp.close(), q4.close()
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert cos.min() > 0.97, cos.min()


def _lm_manifest(source_quantization=None, layers=8):
    checks = {"source_quantization": source_quantization} if source_quantization else {}
    return SimpleNamespace(task="text-generation", tokenizer={"file": "tokenizer.json"}, checks=checks,
                           outputs=[SimpleNamespace(name="logits")], inputs=[SimpleNamespace(name="input_ids")],
                           source={"num_hidden_layers": layers})


def test_for_language_model_picks_the_recipe():
    from slimml.quantize.config import Int8Config, scheme_config

    int4 = WeightOnlyConfig(bits=4, preset="int4-weights")  # what scheme_config("int4-weights") makes
    off_grid = for_language_model(int4, _lm_manifest())
    assert (off_grid.backend, off_grid.grid, off_grid.block_size, off_grid.accuracy_level, off_grid.symmetric) == \
        ("lm", "fitted", 128, 4, False)
    assert off_grid.sensitive_layers == more_bits_layers(8) == (0, 3, 6, 7)  # llama.cpp use_more_bits
    q4_1 = for_language_model(scheme_config("int4-weights"), _lm_manifest("Q4_1 (Q4_1 x210, F32 x61, Q8_0 x1)"))
    assert (q4_1.grid, q4_1.block_size) == ("gguf", 32)
    q4_0 = for_language_model(int4, _lm_manifest("Q4_0 (Q4_0 x210)"))
    assert (q4_0.grid, q4_0.block_size, q4_0.symmetric) == ("fitted", 32, False)
    for word in (Int8Config("cpu"), scheme_config("int8"), scheme_config("int8-weights")):
        q8 = for_language_model(word, _lm_manifest())
        assert (q8.bits, q8.backend) == (8, "lm")
    # a config written in Python is honoured as written (each was swapped for the recipe, silently)
    for explicit in (WeightOnlyConfig(bits=4), WeightOnlyConfig(bits=4, block_size=32, symmetric=True),
                     WeightOnlyConfig(bits=4, block_size=128, accuracy_level=4), scheme_config("int8-dynamic"),
                     Int8DynamicConfig(fuse=False, per_channel=False, reduce_range=False, op_types=("MatMul",)),
                     WeightOnlyConfig(bits=4, block_size=64, backend="lm", grid="fitted"),
                     scheme_config("int4-weights", backend="nncf")):
        assert for_language_model(explicit, _lm_manifest()) is explicit
    bare = _lm_manifest()  # a decoder with no tokenizer: the CLI's blocks, computed at int8 (accuracy_level 4)
    bare.tokenizer = None
    q = for_language_model(int4, bare)
    assert (q.backend, q.block_size, q.accuracy_level) == ("ort", 32, 4)
    encoder = SimpleNamespace(**{**vars(bare), "task": "feature-extraction"})  # not a decoder: as written
    assert for_language_model(int4, encoder).accuracy_level is None
    with pytest.raises(Exception, match="preset must be one of"):
        WeightOnlyConfig(bits=4, preset="int3")
    with pytest.raises(Exception, match=r"preset='int8' does not describe this WeightOnlyConfig\(bits=4\)"):
        WeightOnlyConfig(bits=4, preset="int8")  # the 4-bit recipe would have come of it


def test_the_guards_spread_on_a_short_text_is_finite():
    """Under 64 tokens it was "+- inf%" (fewer than two runs of 32): shorter runs, Student's t."""
    from slimml.quantize.lm_guard import noise

    diff = np.random.default_rng(0).normal(0.01, 0.1, (1, 63))
    assert 0 < noise(diff) < 10 and noise(np.zeros((1, 1))) == float("inf")


def test_a_bad_grid_is_refused():
    from slimml.errors import ConfigError

    with pytest.raises(ConfigError, match="grid must be 'gguf' or 'fitted'"):
        WeightOnlyConfig(grid="q4_k")


@pytest.mark.parametrize("fused", [False, True])
def test_ffn_scaling_keeps_the_function(fused):
    """quantize/equalize.py: down's input channels scaled, up's columns unscaled alike (plain and a
    fused gate/up Split): the same outputs, and down's rows no longer 20x apart."""
    from onnx import numpy_helper

    from slimml.quantize.equalize import equalize_ffn

    rng = np.random.default_rng(4)
    h, f = 32, 256
    gate, up = rng.standard_normal((h, f)).astype(np.float32) * 0.1, rng.standard_normal((h, f)).astype(np.float32) * 0.1
    s = np.exp(rng.standard_normal(f) * 1.0).astype(np.float32)
    up, down = up * s, (rng.standard_normal((f, h)) * 0.1 / s[:, None]).astype(np.float32)
    if fused:
        inits = [numpy_helper.from_array(np.concatenate([gate, up], 1), "Wgu"), numpy_helper.from_array(np.array([f, f]), "sp"),
                 numpy_helper.from_array(down, "Wd")]
        nodes = [helper.make_node("MatMul", ["x", "Wgu"], ["gu"]), helper.make_node("Split", ["gu", "sp"], ["g", "u"], axis=-1)]
    else:
        inits = [numpy_helper.from_array(gate, "Wg"), numpy_helper.from_array(up, "Wu"), numpy_helper.from_array(down, "Wd")]
        nodes = [helper.make_node("MatMul", ["x", "Wg"], ["g"]), helper.make_node("MatMul", ["x", "Wu"], ["u"])]
    nodes += [helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", ["g", "sg"], ["a"]),
              helper.make_node("Mul", ["a", "u"], ["m"]), helper.make_node("MatMul", ["m", "Wd"], ["y"])]
    graph = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, h])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = rng.standard_normal((4, h)).astype(np.float32)

    def run():
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    before = run()
    init_map = {t.name: t for t in model.graph.initializer}
    importance = {"m": np.eye(f)}
    assert equalize_ffn(model, init_map, importance, lambda k: 128) == 1
    np.testing.assert_allclose(run(), before, rtol=1e-4, atol=1e-6)
    rows = np.abs(numpy_helper.to_array(init_map["Wd"])).max(axis=1)
    assert rows.max() / rows.min() < 0.5 * (np.abs(down).max(axis=1).max() / np.abs(down).max(axis=1).min())


def test_four_bit_embedding_rows_come_back():
    """An untied embedding on the fitted 4-bit grid: the looked-up rows are the table's dequantized rows."""
    from onnx import numpy_helper

    from slimml.quantize.decoder import _gather_int4

    rng = np.random.default_rng(5)
    table = (rng.standard_normal((50, 192)) * 0.1).astype(np.float32)
    made, tensors = _gather_int4(helper.make_node("Gather", ["E", "ids"], ["h"]), table, 64)
    graph = helper.make_graph(made, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "s"])],
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, None)], tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    ids = np.array([[3, 0, 49, 3]], np.int64)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    q, s, z = fit_blocks(table.reshape(50, 3, 64))
    want = dequantize(q, s, z).reshape(50, 192)[ids]
    assert got.shape == (1, 4, 192) and np.array_equal(got, want)
    assert sum(t.raw_data.__len__() for t in tensors if t.name.endswith("_q4")) == 50 * 96  # two codes a byte
    assert numpy_helper.to_array(next(t for t in tensors if t.name.endswith("_z"))).max() <= 15


def test_gptq_lowers_the_output_error_on_correlated_inputs():
    """quantize/gptq.py: with correlated input channels, spreading each column's rounding error over the
    columns not yet rounded gives a smaller ``|X W - X W_q|`` than rounding each block on its own."""
    from slimml.quantize.gptq import gptq_blocks

    rng = np.random.default_rng(6)
    k, n = 256, 64
    x = rng.standard_normal((2048, 16)) @ rng.standard_normal((16, k)) + 0.1 * rng.standard_normal((2048, k))
    w = rng.standard_normal((n, k)) * 0.05
    h = x.T @ x / len(x)
    plain = dequantize(*fit_blocks(w.reshape(n, 2, 128).astype(np.float32), True, np.diag(h))).reshape(n, k)
    q, s, z = gptq_blocks(w, h, 128)
    assert q.max() <= 15 and z.max() <= 15
    fed = dequantize(q, s, z).reshape(n, k)
    err = lambda wq: np.linalg.norm(x @ (w - wq).T)  # noqa: E731
    assert err(fed) < 0.7 * err(plain), (err(fed), err(plain))


def test_float_weights_already_on_a_4bit_grid_keep_it(tmp_path):
    """A model saved in fp32 after being dequantized from Q4_1 (SmolLM2's fp32 weights, many published
    fp16 checkpoints of 4-bit models): its blocks of 32 are found in the float weights and kept, so
    int4 is the float model; weights off any grid still get the fitted recipe."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimml.convert import ConvertConfig, convert
    from slimml.quantize import quantize
    from slimml.quantize.decoder import decoder_config, floats_on_grid
    from slimml.runtime.artifact.manifest import read_manifest
    from slimml.runtime.loader import load

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)).eval()
    model.save_pretrained(tmp_path / "off")  # the random weights, off any grid
    with torch.no_grad():  # Q4_1: w = d * q + m per 32 inputs, d and m float16
        for name, p in model.named_parameters():
            if "layers." in name and name.endswith("proj.weight"):
                b = p.reshape(p.shape[0], -1, 32)
                lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
                d = ((hi - lo) / 15).half().float()
                m = lo.half().float()
                p.copy_((torch.clamp(torch.round((b - m) / d), 0, 15) * d + m).reshape(p.shape))
    model.save_pretrained(tmp_path / "on")
    for kind in ("on", "off"):
        convert(tmp_path / kind, tmp_path / f"{kind}-fp32", ConvertConfig(verify=False, measure_latency=False))
    on, off = read_manifest(tmp_path / "on-fp32"), read_manifest(tmp_path / "off-fp32")
    assert floats_on_grid(tmp_path / "on-fp32", on) and not floats_on_grid(tmp_path / "off-fp32", off)
    assert decoder_config(4, off, tmp_path / "off-fp32").grid == "fitted"
    config = decoder_config(4, on, tmp_path / "on-fp32")
    assert (config.grid, config.block_size) == ("gguf", 32)
    quantize(tmp_path / "on-fp32", tmp_path / "on-q4", config)
    step = json.loads((tmp_path / "on-q4" / "manifest.json").read_text())["steps"][-1]
    assert step["recipe"].startswith("gguf int4"), step
    ids = np.random.default_rng(0).integers(3, 512, (1, 12)).tolist()
    fp, q4 = load(tmp_path / "on-fp32"), load(tmp_path / "on-q4")
    try:
        assert q4.generate(ids, max_new_tokens=8, eos_token_id=()).tokens == fp.generate(ids, max_new_tokens=8, eos_token_id=()).tokens
    finally:
        fp.close(), q4.close()


def test_a_float16_bfloat16_q8_0_or_5_bit_copy_of_q4_1_blocks_snaps_back_onto_its_grid():
    import torch
    from gguf import GGMLQuantizationType, quants

    from slimml.quantize.grids import gguf_blocks, q8_blocks

    rng = np.random.default_rng(3)
    d = (rng.random((64, 6)) * 0.01 + 1e-3).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(5, 10, (64, 6))).astype(np.float16).astype(np.float32)  # blocks around zero, as weights are
    codes = rng.integers(0, 16, (64, 6, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1: a block's minimum and maximum are codes 0 and 15
    w = (d[..., None] * codes + m[..., None]).astype(np.float32)
    q8, s8 = q8_blocks(w)
    copies = {"float16": w.astype(np.float16).astype(np.float32),
              "bfloat16": torch.from_numpy(w).bfloat16().float().numpy(),
              "Q8_0": (s8.astype(np.float32)[..., None] * (q8.astype(np.float32) - 128))}
    for kind in ("Q5_1", "Q5_0"):  # llama.cpp's own 5-bit rounding (gguf-py's port of it)
        t = GGMLQuantizationType[kind]
        copies[kind] = quants.dequantize(quants.quantize(w.reshape(64, -1), t), t).reshape(w.shape)
    for name, copy in copies.items():
        found = gguf_blocks(copy)
        assert found is not None, name
        q, dd, mm = found
        # the original codes, so the original values (Q5_0 keeps neither minimum nor maximum: a few codes move by one)
        assert (q == codes).mean() >= (0.99 if name == "Q5_0" else 1.0), name
        assert np.abs(q.astype(int) - codes).max() <= 1, name
        back = dd.astype(np.float32)[..., None] * q + mm.astype(np.float32)[..., None]
        assert np.abs(back - w).mean() <= np.abs(copy - w).mean() * 1.01, name  # no further from the original than the copy
    normal = rng.standard_normal((64, 6, 32)).astype(np.float32)
    assert gguf_blocks(normal) is None  # off any grid
    for kind in ("Q5_1", "Q5_0"):  # a 5-bit model of weights that were never on a 4-bit grid stays off it
        t = GGMLQuantizationType[kind]
        assert gguf_blocks(quants.dequantize(quants.quantize(normal.reshape(64, -1), t), t).reshape(normal.shape)) is None, kind
    six_bit = rng.integers(0, 64, (64, 6, 32)).astype(np.float32) * 0.001  # Q6_K-like: more levels stay off it
    assert gguf_blocks(six_bit) is None
    sparse = normal * (rng.random(normal.shape) < 0.04)  # zero or near-empty blocks fit any grid: they do not vote
    assert gguf_blocks(sparse) is None
    rows = normal.copy()
    rows[3:] = 0.0  # 95% zero rows
    assert gguf_blocks(rows) is None
    broken = w.copy()
    broken[0, 0, 5] = np.nan
    assert gguf_blocks(broken) is None


@pytest.mark.parametrize("bits", [8, 4])
def test_a_gather_along_another_axis_stays_float_and_the_table_lookup_is_packed(bits):
    """Only a Gather of rows (axis 0) is an embedding lookup; one along axis 1 of a 2-D weight stayed a
    builtin ValueError out of the quantizer. It is left in float, the lookup beside it packed."""
    from slimml.quantize.decoder import lm_weights
    from slimml.quantize.registry import ShardContext

    rng = np.random.default_rng(0)
    table, cols = rng.normal(size=(64, 64)).astype(np.float32), rng.normal(size=(8, 64)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),
         helper.make_node("Gather", ["cols", "pick"], ["picked"], axis=1)], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3]),
         helper.make_tensor_value_info("pick", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("picked", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(table, "table"), onnx.numpy_helper.from_array(cols, "cols")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    config = WeightOnlyConfig(bits=bits, backend="lm", block_size=32, embedding_bits=bits)
    out = lm_weights(model, config, ShardContext(index=0))
    kept = [n for n in out.graph.node if n.op_type == "Gather" and "cols" in n.input]
    assert len(kept) == 1 and kept[0].attribute[0].i == 1
    assert "table" not in {t.name for t in out.graph.initializer}  # the lookup's table was packed
    feeds = {"ids": np.array([[0, 5, 63]], np.int64), "pick": np.array([1, 7], np.int64)}
    rows, picked = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(picked, cols[:, [1, 7]])
    np.testing.assert_allclose(rows[0], table[[0, 5, 63]], atol=0.25 if bits == 4 else 0.02)  # half a step of its grid
