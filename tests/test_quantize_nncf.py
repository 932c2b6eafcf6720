"""The NNCF backends (``backend="nncf"``) on tiny real models: QDQ static int8, weight compression."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

pytest.importorskip("nncf")

from slimml.errors import ConfigError  # noqa: E402
from slimml.quantize import Int8StaticConfig, WeightOnlyConfig, quantize, scheme_config  # noqa: E402
from slimml.runtime import load  # noqa: E402
from slimml.runtime.tools.bench import sample_feeds  # noqa: E402
from slimml.runtime.artifact.manifest import read_manifest  # noqa: E402
from conftest import STS_TRAIN  # noqa: E402


def _ops(folder, shard):
    m = onnx.load(str(folder / shard.file), load_external_data=False)
    return {n.op_type for n in m.graph.node}


def _cos(a, b):
    a, b = a.reshape(a.shape[0], -1).astype(np.float64), b.reshape(b.shape[0], -1).astype(np.float64)
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def test_backend_choice_messages():
    with pytest.raises(ConfigError) as e:
        scheme_config("int8-static", backend="tflite")
    assert str(e.value) == "unknown --backend 'tflite'; use one of: ort, nncf."
    with pytest.raises(ConfigError) as e:
        WeightOnlyConfig(backend="openvino")
    assert str(e.value) == "unknown --backend 'openvino'; use one of: ort, nncf."
    with pytest.raises(ConfigError) as e:
        scheme_config("int8-dynamic", backend="nncf")
    assert str(e.value) == (
        "--backend nncf serves --quantize int8-static, int8-weights and int4-weights, not 'int8-dynamic'; "
        "choose one of those or leave --backend out."
    )
    assert scheme_config("int8-static", backend="nncf").backend == "nncf"
    assert scheme_config("int4-weights", backend="nncf").backend == "nncf"
    assert scheme_config("int8-static").backend == "ort"


def test_nncf_static_int8_on_tiny_bert(tiny_bert_artifact, tmp_path):
    out = tmp_path / "q"
    report = quantize(tiny_bert_artifact, out, Int8StaticConfig(backend="nncf", calibration=STS_TRAIN, calibration_size=32))
    m = read_manifest(out)
    assert m.steps[-1]["backend"] == "nncf" and report.quantized_shards
    for i in report.quantized_shards:
        assert {"QuantizeLinear", "DequantizeLinear"} <= _ops(out, m.shards[i])
        shard = onnx.load(str(out / m.shards[i].file), load_external_data=False)
        assert any(t.data_type == onnx.TensorProto.INT8 for t in shard.graph.initializer)  # weights stored int8
    f, q = load(tiny_bert_artifact), load(out)  # load() checks every hash
    texts = ["A man plays the guitar.", "Quantized models run on small machines, fast.", "Two dogs run in a field."]
    # measured: min cosine 0.99+ on these texts with the tiny random-weight BERT
    assert _cos(f.encode(texts), q.encode(texts)) >= 0.98
    assert m.checks["quantize_agreement_cosine"] >= 0.98


@pytest.fixture(scope="module")
def tiny_llama_artifact(tiny_llama_dir, tmp_path_factory):
    from slimml.convert import ConvertConfig, ExportConfig, convert

    art = tmp_path_factory.mktemp("nncf-llama") / "llama"
    convert(tiny_llama_dir, art, ConvertConfig(export=ExportConfig(task="text-generation"), measure_latency=False, verify=False))
    return art


# measured (random-weight tiny Llama, block 16): int8 3.48x smaller, logits cosine 0.99995;
# int4 (+ int8 embeddings) 4.47x smaller, logits cosine 0.992
@pytest.mark.parametrize("bits,min_ratio,min_cos", [(8, 3.3, 0.999), (4, 4.0, 0.97)])
def test_nncf_weight_compression_on_a_decoder(tiny_llama_artifact, tmp_path, bits, min_ratio, min_cos):
    art, out = tiny_llama_artifact, tmp_path / f"q{bits}"
    report = quantize(art, out, WeightOnlyConfig(bits=bits, block_size=16, backend="nncf", calibration_size=16))
    f, q = read_manifest(art), read_manifest(out)
    ratio = sum(s.weight_bytes for s in f.shards) / sum(s.weight_bytes for s in q.shards)
    assert ratio >= min_ratio, ratio
    a, b = load(art), load(out)
    feeds = sample_feeds(a.inputs, batch=2, seq=16)
    feeds["input_ids"] = np.random.default_rng(0).integers(0, 512, size=feeds["input_ids"].shape)  # tiny vocabulary
    la, lb = a.run(feeds)["logits"], b.run(feeds)["logits"]
    assert _cos(la.reshape(-1, la.shape[-1]), lb.reshape(-1, lb.shape[-1])) >= min_cos
    assert report.quantized_shards
    ops = set().union(*[_ops(out, s) for s in q.shards])
    assert "DequantizeLinear" in ops and (bits == 8 or "MatMulNBits" in ops)


def test_cli_backend(tmp_path, tiny_bert_artifact):
    from typer.testing import CliRunner

    from slimml.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["quantize", str(tiny_bert_artifact), "-o", str(tmp_path / "bad"), "--quantize", "int8-static",
                            "--backend", "tflite"])
    assert r.exit_code == 1 and "unknown --backend 'tflite'; use one of: ort, nncf." in r.output.replace("\n", " ") + str(r.exception)
    assert not (tmp_path / "bad").exists()
    r = runner.invoke(app, ["quantize", str(tiny_bert_artifact), "-o", str(tmp_path / "q"), "--quantize", "int8-static",
                            "--backend", "nncf", "--calibration", str(STS_TRAIN), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["checks"]["agreement_cosine"] > 0.98
    assert read_manifest(tmp_path / "q").steps[-1]["backend"] == "nncf"


def test_nncf_takes_a_swin_whose_shards_pass_an_int64_cast_on(tmp_path):
    """NNCF 3.4 removes a Cast to the type it already has and failed (KeyError) where that Cast's
    result leaves the shard: every Swin and ModernBERT shard. Now it is an Identity first; a weight
    of 16 input channels (a small Swin stage) gets a block that fits or stays float under int4."""
    import torch
    from transformers import SwinConfig, SwinForImageClassification, ViTImageProcessor

    from slimml.convert import ConvertConfig, convert

    torch.manual_seed(0)
    SwinForImageClassification(SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                          window_size=4, num_labels=3)).eval().save_pretrained(tmp_path / "src")
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "fp32", ConvertConfig(measure_latency=False))
    feeds = sample_feeds(read_manifest(tmp_path / "fp32").inputs, batch=2, source=read_manifest(tmp_path / "fp32").source)
    want = load(tmp_path / "fp32").run(feeds)["logits"]
    for name, config in (("int8s", Int8StaticConfig(backend="nncf")), ("int4", WeightOnlyConfig(bits=4, backend="nncf"))):
        quantize(tmp_path / "fp32", tmp_path / name, config)
        assert _cos(load(tmp_path / name).run(feeds)["logits"], want) > 0.99, name
