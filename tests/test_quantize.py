"""Quantization on tiny real models: structure, numerics against float, exact error messages."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from slimml.errors import ConfigError, DataError
from slimml.quantize import (
    Fp16Config,
    GuardConfig,
    Int8DynamicConfig,
    Int8StaticConfig,
    WeightOnlyConfig,
    quantize,
    scheme_config,
)
from slimml.quantize.calibration import calibration_texts, default_corpus, read_texts
from slimml.runtime import load
from slimml.runtime.tools.bench import sample_feeds
from slimml.runtime.artifact.manifest import read_manifest
from conftest import STS_TRAIN


def _ops(folder, index):
    m = onnx.load(str(folder / f"shard_{index:03d}.onnx"), load_external_data=False)
    return {n.op_type for n in m.graph.node}


def _cos(a, b):
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


# --- configs ----------------------------------------------------------------------------------

def test_unknown_scheme_message():
    with pytest.raises(ConfigError) as e:
        scheme_config("int3")
    assert str(e.value) == (
        "unknown --quantize value 'int3'; use one of: none, int8, int8-dynamic, int8-static, "
        "int8-weights, int4-weights, fp16."
    )

    with pytest.raises(ConfigError, match=r"^--keep-best writes the best model the accuracy guard finds; give --max-drop"):
        scheme_config("int8", keep_best=True)  # it was accepted and did nothing


def test_scheme_words_map_to_configs():
    assert scheme_config("none") is None
    assert isinstance(scheme_config("int8"), Int8DynamicConfig)
    assert isinstance(scheme_config("int8", target="cuda"), WeightOnlyConfig)
    assert scheme_config("int4-weights").bits == 4
    assert isinstance(scheme_config("int8-static"), Int8StaticConfig)
    assert isinstance(scheme_config("fp16", target="cuda"), Fp16Config)
    with pytest.raises(ConfigError, match="add --target cuda"):
        scheme_config("fp16")
    with pytest.raises(ConfigError, match="give --max-drop X with it"):
        scheme_config("int8", eval_file="x.csv")
    with pytest.raises(ConfigError, match="bits must be 4 or 8"):
        WeightOnlyConfig(bits=3)
    for bad in (-1, float("nan"), float("inf")):  # nan passed before, and failed after the whole search
        with pytest.raises(ConfigError, match="--max-drop must be a number >= 0"):
            GuardConfig(max_drop=bad)


# --- calibration data -------------------------------------------------------------------------

def test_calibration_files(tmp_path):
    lines = tmp_path / "c.txt"
    lines.write_text("first sentence\n\n  second one \n")
    assert read_texts(lines) == ["first sentence", "second one"]
    texts = read_texts(STS_TRAIN)
    assert len(texts) > 10000 and all(isinstance(t, str) and t for t in texts[:10])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(DataError) as e:
        read_texts(empty)
    assert str(e.value) == (
        f"calibration file {empty} holds no text; give at least a few sentences, one per line "
        "(or an STS CSV with sentence1,sentence2 columns)."
    )
    with pytest.raises(DataError, match="does not exist"):
        read_texts(tmp_path / "missing.txt")
    with pytest.raises(DataError, match=f"calibration file {tmp_path} is a folder, not a file; give a text file"):
        read_texts(tmp_path)  # it said the folder did not exist
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="is a pipe or device, not a file .*save it to a file first"):
        read_texts(fifo)  # `--calibration /dev/stdin`: it said it did not exist
    odd = tmp_path / "odd.csv"
    odd.write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match="CSV without a sentence1, sentence2, sentence or text column"):
        read_texts(odd)
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\x00\x01\x02" * 10)
    with pytest.raises(DataError, match="is binary"):
        read_texts(blob)


def test_default_corpus_needs_no_download():
    texts = default_corpus()
    assert len(texts) >= 200 and texts == default_corpus()
    calib, held, origin = calibration_texts(None, 64)
    assert len(calib) == 64 and held and not set(held) & set(calib) and "built-in" in origin


# --- int8 on a sharded artifact ---------------------------------------------------------------

def test_int8_dynamic_on_tiny_bert(tiny_bert_artifact, tmp_path):
    out = tmp_path / "q"
    report = quantize(tiny_bert_artifact, out, Int8DynamicConfig(calibration_size=16))  # fused by default
    m = read_manifest(out)
    assert [s["step"] for s in m.steps] == ["export", "shard", "quantize"]
    assert m.steps[-1]["quantized_shards"] == report.quantized_shards
    assert "Attention" in json.dumps(m.steps[-1]["fused"])  # attention fused per shard
    assert any("QAttention" in _ops(out, s.index) for s in m.shards)
    # layer norms stay Add + LayerNormalization: ORT's CPU SkipLayerNormalization is the slow kernel
    assert not any("SkipLayerNormalization" in _ops(out, s.index) for s in m.shards)
    # the FFN bias stays an Add, which ORT folds into the quantized MatMul; Gelu alone is the cheaper kernel
    assert not any("BiasGelu" in _ops(out, s.index) for s in m.shards)
    assert any("Gelu" in _ops(out, s.index) for s in m.shards)
    from slimml.runtime.engine.session import disabled_optimizers

    assert disabled_optimizers("cpu") == ["SkipLayerNormFusion"] and disabled_optimizers("cuda") is None
    assert report.size_mb < report.float_size_mb
    f, q = load(tiny_bert_artifact), load(out)  # load() checks every hash
    texts = ["A man plays the guitar.", "Quantized models run on small machines, fast."]
    assert _cos(f.encode(texts), q.encode(texts)) > 0.98
    assert m.checks["quantize_agreement_cosine"] > 0.98


def test_a_backend_failure_is_one_line_naming_the_step(tiny_bert_artifact, tmp_path):
    """A quantizer's own exception (NNCF's, ONNX Runtime's) ended `slimml quantize` in its traceback;
    now one QuantizeError names the step, and nothing is left at the output."""
    from dataclasses import dataclass

    from slimml.errors import QuantizeError
    from slimml.quantize.registry import register

    @dataclass
    class Failing(Int8DynamicConfig):  # a backend that fails as a dependency does
        pass

    @register(Failing)
    def failing(model, config, ctx):
        raise ValueError("scale must be 1D tensor\nmore")

    with pytest.raises(QuantizeError, match=r"^quantizing .*tiny-bert failed while quantizing shard 1/\d+ \(ValueError: "
                                            r"scale must be 1D tensor\)\. Quantize it with another scheme"):
        quantize(tiny_bert_artifact, tmp_path / "q", Failing(calibration_size=16))
    assert not (tmp_path / "q").exists() and list(tmp_path.iterdir()) == []


def test_int8_fuses_shards_cut_inside_layers(tiny_bert_dir, tmp_path):
    """With more shards than layers, a shard's mask comes from a constant in an earlier shard's data
    file: the fused int8 copied it as a reference to that file and onnx refused the shard ("should be
    stored in /tmp/.../shard_000.onnx.data, but it is not regular file")."""
    from slimml.convert import ConvertConfig, ShardConfig, convert

    convert(tiny_bert_dir, tmp_path / "art", ConvertConfig(shard=ShardConfig(mode="count", count=6), measure_latency=False,
                                                           verify=False))
    quantize(tmp_path / "art", tmp_path / "q", Int8DynamicConfig(calibration_size=16))
    texts = ["A man plays the guitar.", "Quantized models run on small machines, fast."]
    assert _cos(load(tmp_path / "art").encode(texts), load(tmp_path / "q").encode(texts)) > 0.98


@pytest.mark.parametrize("family", ["distilbert", "roberta"])
def test_other_encoder_families_fuse_and_quantize(family, tmp_path):
    """The default int8 fuses attention per shard in other BERT-family graphs too, and stays close."""
    import shutil

    import torch
    import transformers as T
    from transformers import AutoTokenizer

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    if family == "distilbert":
        model = T.DistilBertModel(T.DistilBertConfig(vocab_size=30522, dim=32, n_heads=2, hidden_dim=64, n_layers=2,
                                                     max_position_embeddings=130))
    else:
        model = T.RobertaModel(T.RobertaConfig(vocab_size=30522, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                               num_hidden_layers=2, max_position_embeddings=130, pad_token_id=1))
    src, folder = default_model_dir(), tmp_path / family
    model.eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(folder)
    for name in ("modules.json", "sentence_bert_config.json"):
        shutil.copy2(src / name, folder / name)
    (folder / "1_Pooling").mkdir()
    shutil.copy2(src / "1_Pooling" / "config.json", folder / "1_Pooling" / "config.json")
    convert(folder, tmp_path / "art", ConvertConfig(measure_latency=False, verify=False))
    quantize(tmp_path / "art", tmp_path / "q", Int8DynamicConfig(calibration_size=16))
    q = load(tmp_path / "q")
    assert "Attention" in json.dumps(q.manifest.steps[-1]["fused"])
    texts = ["A man plays the guitar.", "short", "Quantized models run on small machines, fast."]
    assert _cos(load(tmp_path / "art").encode(texts), q.encode(texts)) > 0.999


@pytest.fixture(scope="module")
def tiny_bert_whole(tiny_bert_dir, tmp_path_factory):
    """The tiny BERT as one shard: the whole graph, to compare per-shard quantization with."""
    from slimml.convert import ConvertConfig, ShardConfig, convert

    out = tmp_path_factory.mktemp("whole") / "tiny-bert-whole"
    convert(tiny_bert_dir, out, ConvertConfig(shard=ShardConfig(mode="count", count=1), measure_latency=False, verify=False))
    return out


@pytest.mark.parametrize("config", [Int8DynamicConfig(fuse=False), Int8DynamicConfig(), Int8StaticConfig(calibration_size=16)],
                         ids=["dynamic", "dynamic-fused", "static"])
def test_sharded_quantizes_like_the_whole_graph(tiny_bert_whole, tiny_bert_artifact, tmp_path, config):
    """Per-shard quantization, calibrated on earlier shards' activations, equals whole-graph quantization."""
    whole, sharded = tiny_bert_whole, tiny_bert_artifact
    assert len(read_manifest(sharded).shards) > 2 and len(read_manifest(whole).shards) == 1
    config.calibration = STS_TRAIN
    quantize(whole, tmp_path / "qw", config)
    quantize(sharded, tmp_path / "qs", config)
    a, b = load(tmp_path / "qw"), load(tmp_path / "qs")
    feeds = a.tokenize(["A man is playing a guitar.", "Two dogs run across a field of grass."])
    ya, yb = a.run(feeds)["last_hidden_state"], b.run(feeds)["last_hidden_state"]
    mask = feeds["attention_mask"].astype(bool)
    assert np.abs(ya[mask] - yb[mask]).max() < 1e-4


def test_static_int8_without_tokenizer(mlp_onnx, tmp_path):
    from slimml.convert import ConvertConfig, convert

    art = tmp_path / "mlp"
    convert(mlp_onnx, art, ConvertConfig(measure_latency=False))
    quantize(art, tmp_path / "q", Int8StaticConfig(calibration_size=16))
    f, q = load(art), load(tmp_path / "q")
    feeds = sample_feeds(f.inputs, batch=4, seq=8)
    # 8-wide layers with per-tensor uint8 activations: coarse, but clearly the same function
    assert _cos(f.run(feeds)["y"], q.run(feeds)["y"]) > 0.9
    assert "DequantizeLinear" in _ops(tmp_path / "q", 0)


# --- bad input --------------------------------------------------------------------------------

def _no_weights_onnx(path):
    nodes = [helper.make_node("Relu", ["x"], ["/layers.0/r"], name="/layers.0/Relu"),
             helper.make_node("Add", ["/layers.0/r", "x"], ["y"], name="/layers.1/Add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def test_nothing_to_quantize(tmp_path):
    from slimml.convert import ConvertConfig, convert

    art = tmp_path / "art"
    convert(_no_weights_onnx(tmp_path / "relu.onnx"), art, ConvertConfig(measure_latency=False))
    with pytest.raises(ConfigError) as e:
        quantize(art, tmp_path / "q", Int8DynamicConfig())
    assert str(e.value) == (
        f"the artifact {art} has no op that Int8DynamicConfig quantizes (MatMul/Gather with float weights, "
        "or Attention); it would come out unchanged. Keep it float (--quantize none)."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "relu.onnx"]  # nothing half-written


def test_missing_calibration_leaves_nothing(tiny_bert_artifact, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        quantize(tiny_bert_artifact, tmp_path / "q", Int8StaticConfig(calibration=tmp_path / "nope.txt"))
    assert list(tmp_path.iterdir()) == []


def test_max_drop_that_cannot_be_met(tiny_bert_artifact, tmp_path):
    guard = GuardConfig(max_drop=0.0, max_float_shards=1)
    with pytest.raises(ConfigError, match=r"^--max-drop 0.0 cannot be met: with the 1 most sensitive of \d+ quantized shards"):
        quantize(tiny_bert_artifact, tmp_path / "q", Int8DynamicConfig(guard=guard, calibration_size=16))
    assert list(tmp_path.iterdir()) == []
    guard = GuardConfig(max_drop=0.0, max_float_shards=1, keep_best=True)
    report = quantize(tiny_bert_artifact, tmp_path / "q", Int8DynamicConfig(guard=guard, calibration_size=16))
    by_guard = [i for i, why in report.float_shards.items() if "accuracy guard" in why]
    assert len(by_guard) == 1 and report.checks["max_drop_met"] is False
    step = read_manifest(tmp_path / "q").steps[-1]
    assert any("accuracy guard" in why for why in step["float_shards"].values())


def test_guard_keeps_sensitive_shards_float(tiny_bert_artifact, tmp_path):
    base = quantize(tiny_bert_artifact, tmp_path / "a", Int8DynamicConfig(calibration_size=16))
    limit = base.checks["drop"] * 0.7  # forces at least one shard back to float
    report = quantize(tiny_bert_artifact, tmp_path / "b",
                      Int8DynamicConfig(calibration_size=16, guard=GuardConfig(max_drop=limit, max_float_shards=10)))
    assert report.float_shards and report.checks["drop"] <= limit and report.checks["max_drop_met"]


def test_already_quantized_is_refused(tiny_bert_artifact, tmp_path):
    quantize(tiny_bert_artifact, tmp_path / "q", Int8DynamicConfig(calibration_size=16))
    with pytest.raises(ConfigError, match="is already quantized"):
        quantize(tmp_path / "q", tmp_path / "q2", Int8DynamicConfig())


def test_a_graph_quantized_before_convert_is_refused(mlp_onnx, tmp_path):
    """fp16 of an int8 ONNX file wrote shards ONNX Runtime refuses, and exited 0: the manifest's steps
    did not say it was quantized, its graph does."""
    from onnxruntime.quantization import quantize_dynamic

    from slimml.convert import ConvertConfig, convert

    quantize_dynamic(str(mlp_onnx), str(tmp_path / "int8.onnx"))
    convert(tmp_path / "int8.onnx", tmp_path / "art", ConvertConfig(measure_latency=False))
    for config in (scheme_config("fp16", target="cuda"), Int8DynamicConfig(), WeightOnlyConfig(bits=4)):
        with pytest.raises(ConfigError, match=r"is already quantized \(its graph holds DynamicQuantizeLinear"):
            quantize(tmp_path / "art", tmp_path / "q", config)
    assert not (tmp_path / "q").exists()


def test_a_guard_that_keeps_every_shard_float_writes_nothing(tiny_bert_dir, tmp_path):
    """A one-shard model came out as a float copy reported as quantized ("max_drop_met": true): at most
    half the shards stay float, none of one, and a guard that would keep all refuses."""
    from slimml.convert import ConvertConfig, ShardConfig, convert

    convert(tiny_bert_dir, tmp_path / "one", ConvertConfig(measure_latency=False, shard=ShardConfig(mode="count", count=1)))
    with pytest.raises(ConfigError, match=r"^--max-drop 0.0 cannot be met"):
        quantize(tmp_path / "one", tmp_path / "q", Int8DynamicConfig(guard=GuardConfig(max_drop=0.0), calibration_size=16))
    with pytest.raises(ConfigError, match=r"is met only with every shard float, so nothing would be quantized"):
        quantize(tmp_path / "one", tmp_path / "q", Int8DynamicConfig(
            guard=GuardConfig(max_drop=0.0, max_float_shards=1, keep_best=True), calibration_size=16))
    assert not (tmp_path / "q").exists()


def test_a_shard_its_quantizer_left_as_it_was_is_reported_float(tiny_bert_artifact, tmp_path):
    """int8-weights reported the embedding shard quantized (ONNX Runtime takes a Gather at 4 bits
    only), and op types that match nothing reported every shard quantized."""
    report = quantize(tiny_bert_artifact, tmp_path / "w8", WeightOnlyConfig(bits=8))
    assert 0 not in report.quantized_shards and "Gather at 4 bits only" in report.float_shards[0]
    assert report.quantized_shards
    with pytest.raises(ConfigError, match="has no op that Int8DynamicConfig quantizes"):
        quantize(tiny_bert_artifact, tmp_path / "q", Int8DynamicConfig(op_types=("Foo",)))


@pytest.mark.parametrize("make", [
    lambda: Int8DynamicConfig(guard=1.0), lambda: GuardConfig(max_drop=0, max_float_shards=1.5),
    lambda: WeightOnlyConfig(bits=4.0), lambda: WeightOnlyConfig(block_size="32"),
    lambda: Int8DynamicConfig(exclude_shards=("a",)), lambda: Int8DynamicConfig(exclude_shards=(-1,)),
    lambda: GuardConfig(max_drop=1, eval_file=123), lambda: GuardConfig(max_drop=1, keep_best="no"),
    lambda: WeightOnlyConfig(accuracy_level=True), lambda: Int8DynamicConfig(op_types="MatMul"),
    lambda: Int8StaticConfig(op_types=()),
])
def test_config_values_are_checked_when_made(make):
    """Each was accepted and failed later with a TypeError or AttributeError (or quantized nothing)."""
    with pytest.raises(ConfigError):
        make()


def test_exclude_shards_past_the_last_and_the_lm_recipe_on_an_encoder_are_refused(tiny_bert_artifact, tmp_path):
    with pytest.raises(ConfigError, match=r"exclude_shards \[99\] names a shard past the artifact's last"):
        quantize(tiny_bert_artifact, tmp_path / "q", Int8DynamicConfig(exclude_shards=(99,)))
    with pytest.raises(ConfigError, match=r'backend="lm" is the language-model recipe'):
        quantize(tiny_bert_artifact, tmp_path / "q", WeightOnlyConfig(backend="lm"))
    assert not (tmp_path / "q").exists()


# --- weight-only and fp16 ---------------------------------------------------------------------

def test_int4_weights_on_a_decoder(tiny_llama_dir, tmp_path):
    """int4 MatMulNBits + GatherBlockQuantized: weight bytes shrink >= 3.5x; logits stay close."""
    from slimml.convert import ConvertConfig, ExportConfig, convert

    art = tmp_path / "llama"
    # verify=False: the spine's check feeds use token ids 1000..2000, beyond this 512-word vocabulary
    convert(tiny_llama_dir, art, ConvertConfig(export=ExportConfig(task="text-generation"), measure_latency=False, verify=False))
    report = quantize(art, tmp_path / "q4", WeightOnlyConfig(bits=4, block_size=16, calibration_size=16))
    f, q = read_manifest(art), read_manifest(tmp_path / "q4")
    ratio = sum(s.weight_bytes for s in f.shards) / sum(s.weight_bytes for s in q.shards)
    assert ratio >= 3.5, ratio
    a, b = load(art), load(tmp_path / "q4")
    assert a.vocab_size == b.vocab_size == 512  # the table a GatherBlockQuantized reads still bounds the ids
    feeds = sample_feeds(a.inputs, batch=2, seq=16)
    feeds["input_ids"] = np.random.default_rng(0).integers(0, 512, size=feeds["input_ids"].shape)  # tiny vocabulary
    la, lb = a.run(feeds)["logits"], b.run(feeds)["logits"]
    # stated tolerance (random weights, block 16, symmetric int4): every position's logits have
    # cosine >= 0.97 with fp32, and no logit moves by more than 10% of the logits' range
    assert _cos(la.reshape(-1, la.shape[-1]), lb.reshape(-1, lb.shape[-1])) >= 0.97
    assert np.abs(la - lb).max() <= 0.10 * (la.max() - la.min())
    assert "MatMulNBits" in json.dumps([sorted(_ops(tmp_path / "q4", s.index)) for s in q.shards])
    assert report.quantized_shards


def test_fp16_converts_weights(tiny_bert_artifact, tmp_path):
    report = quantize(tiny_bert_artifact, tmp_path / "h", Fp16Config(calibration_size=16))
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():  # measured on this CPU, and said so (was "not measured")
        assert report.checks["agreement_device"].startswith("cpu") and report.checks["agreement_cosine"] >= 0.999
    m = read_manifest(tmp_path / "h")
    shard = onnx.load(str(tmp_path / "h" / m.shards[-1].file))  # a layer: float hidden state in and out
    assert any(t.data_type == TensorProto.FLOAT16 for t in shard.graph.initializer)
    kinds = {i.type.tensor_type.elem_type for i in shard.graph.input}
    assert TensorProto.FLOAT in kinds and TensorProto.FLOAT16 not in kinds  # io stays float32
    # a valid graph: the ops kept in fp32 (LayerNormalization) get casts, and the shards merge into one
    # graph although each names its casts alike. ONNX Runtime's CPU provider runs fp16 too (slowly).
    model = load(tmp_path / "h")
    assert model.plan.segments[0].merged
    texts = ["a cat sits on the mat", "stocks fell sharply"]
    assert _cos(model.encode(texts), load(tiny_bert_artifact).encode(texts)) >= 0.999


def test_an_fp16_decoder_is_measured_with_its_float16_cache(tiny_llama_past_artifact, tmp_path):
    """The guard fed the float model's float32 cache to the fp16 graph, whose cache is float16: ONNX
    Runtime refused it ("expected: (tensor(float16))"), on CUDA as on this CPU."""
    import onnxruntime as ort

    from slimml.quantize.config import scheme_config

    report = quantize(tiny_llama_past_artifact, tmp_path / "h", scheme_config("fp16", target="cuda"))
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert report.checks["agreement_device"].startswith("cpu") and report.checks["agreement_cosine"] >= 0.999
    assert load(tmp_path / "h").generate([[5, 6, 7]], max_new_tokens=4).tokens == \
        load(tiny_llama_past_artifact).generate([[5, 6, 7]], max_new_tokens=4).tokens


def test_guard_on_an_eval_file(tiny_bert_artifact, tmp_path):
    from conftest import STS_DEV

    rows = STS_DEV.read_text(encoding="utf-8").splitlines()[:41]
    small = tmp_path / "sts-small.csv"
    small.write_text("\n".join(rows) + "\n", encoding="utf-8")
    guard = GuardConfig(max_drop=100.0, eval_file=small)
    report = quantize(tiny_bert_artifact, tmp_path / "q", Int8DynamicConfig(calibration_size=16, guard=guard))
    c = report.checks
    assert c["drop_metric"] == "spearman_x100" and c["eval_file"] == "sts-small.csv"
    assert c["drop"] == pytest.approx(c["eval_float"] - c["eval_quantized"], abs=1e-3)
    assert read_manifest(tmp_path / "q").checks["quantize_eval_quantized"] == c["eval_quantized"]


def test_a_decoder_refuses_static_int8_in_one_line(tiny_llama_past_artifact, tmp_path):
    """Static int8 calibrates on recorded inputs, which a KV cache's are not (before: KeyError
    'past_key_values.0.key' from the recorder); nothing is written."""
    from slimml.quantize import quantize

    with pytest.raises(ConfigError, match="int8-static calibrates activations on recorded inputs"):
        quantize(tiny_llama_past_artifact, tmp_path / "q", scheme_config("int8-static"))
    assert not (tmp_path / "q").exists()


def test_inputs_a_model_does_not_read_are_refused_or_recorded_as_unused(mlp_onnx, tiny_bert_artifact, tmp_path):
    """--eval-text on a model that is no language model was ignored and recorded as used; --eval on a
    model without pooling was refused only after every shard was quantized; a calibration file given
    for a model that reads no text was recorded as its calibration, though it was calibrated on
    generated inputs."""
    from slimml.convert import ConvertConfig, convert
    from slimml.quantize import scheme_config

    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"Sentence number {i} about nothing in particular." for i in range(40)), encoding="utf-8")
    config = scheme_config("int8")
    config.eval_text = text
    steps: list[str] = []
    with pytest.raises(ConfigError, match=r"--eval-text .*text\.txt is a language model's held-out text; this artifact is "
                                          r"a 'sentence-embedding' model"):
        quantize(tiny_bert_artifact, tmp_path / "q", config, on_step=steps.append)
    convert(mlp_onnx, tmp_path / "mlp", ConvertConfig(measure_latency=False))
    with pytest.raises(ConfigError, match=r"--eval .* needs a sentence-embedding artifact"):
        quantize(tmp_path / "mlp", tmp_path / "q", scheme_config("int8", max_drop=1.0, eval_file=STS_TRAIN),
                 on_step=steps.append)
    assert not [s for s in steps if s.startswith("quantizing shard")] and not (tmp_path / "q").exists()
    quantize(tmp_path / "mlp", tmp_path / "static", scheme_config("int8-static", calibration=text))
    step = read_manifest(tmp_path / "static").steps[-1]
    assert step["calibration"] == "generated inputs (the model reads no text)", step
    assert step["calibration_unused"] == f"{text}: this model reads no text", step


def test_a_csv_with_a_text_past_128_kb_reads(tmp_path):
    """csv's default field limit (128 KB) refused a long document as "field larger than field limit"
    in an STS file and in calibration data."""
    import csv

    from slimml.runtime.tools.evaluate import read_sts

    long = "word " * 40_000  # 200 KB
    data = tmp_path / "sts.csv"
    data.write_text(f"sentence1,sentence2,score\n{long},short,1.0\na,b,2\n", encoding="utf-8")
    s1, _, scores = read_sts(data)
    assert len(s1[0]) == len(long) and list(scores) == [1.0, 2.0]
    calib = tmp_path / "calib.csv"
    calib.write_text(f"text\n{long}\nshort\n", encoding="utf-8")
    assert [len(t) for t in read_texts(calib)] == [len(long.strip()), 5]
    assert csv.field_size_limit() >= 1 << 30  # raised for the process, never lowered


def test_a_model_of_gemm_layers_is_quantized(tmp_path):
    """An MLP exported from nn.Linear on 2-d inputs is all Gemm: int8 left it whole ("nothing to
    quantize") until Gemms became MatMul + Add first (a classifier's pooler and output stay float: test_rerank)."""
    from slimml.convert import ConvertConfig, convert

    rng = np.random.default_rng(0)
    nodes, inits, h = [], [], "x"
    for i in range(4):
        inits += [onnx.numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32) * 0.2, f"w{i}"),
                  onnx.numpy_helper.from_array(rng.standard_normal(64).astype(np.float32) * 0.1, f"b{i}")]
        nodes += [helper.make_node("Gemm", [h, f"w{i}", f"b{i}"], [f"g{i}"], transB=1, name=f"/l{i}/Gemm"),
                  helper.make_node("Relu", [f"g{i}"], [f"r{i}"], name=f"/l{i}/Relu")]
        h = f"r{i}"
    nodes.append(helper.make_node("Identity", [h], ["y"], name="/head/Identity"))
    graph = helper.make_graph(nodes, "gemm_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "mlp.onnx")
    convert(tmp_path / "mlp.onnx", tmp_path / "art", ConvertConfig(measure_latency=False))
    report = quantize(tmp_path / "art", tmp_path / "q", Int8DynamicConfig())
    assert report.quantized_shards and not report.float_shards and report.size_mb < report.float_size_mb / 2
    feeds = {"x": rng.standard_normal((4, 64)).astype(np.float32)}
    assert _cos(load(tmp_path / "art").run(feeds)["y"], load(tmp_path / "q").run(feeds)["y"]) > 0.99
