"""The quantize command line and the convert --quantize step, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slimml.runtime import load
from slimml.runtime.artifact.manifest import read_manifest
from conftest import STS_DEV, STS_TRAIN


def _slimml(*args, cwd=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "slimml", *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd)


def test_unknown_quantize_value(tmp_path, tiny_bert_artifact):
    r = _slimml("quantize", tiny_bert_artifact, "-o", tmp_path / "q", "--quantize", "int2")
    assert r.returncode == 1
    assert "unknown --quantize value 'int2'; use one of: none, int8, int8-dynamic" in r.stderr
    assert not (tmp_path / "q").exists()


def test_quantize_command(tmp_path, tiny_bert_artifact):
    from typer.testing import CliRunner

    from slimml.cli import app

    args = ["quantize", str(tiny_bert_artifact), "-o", str(tmp_path / "q"), "--quantize", "int8", "--calibration", str(STS_TRAIN), "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["size_mb"] < report["float_size_mb"] and report["checks"]["agreement_cosine"] > 0.98
    assert read_manifest(tmp_path / "q").steps[-1]["calibration"] == str(STS_TRAIN)


def test_convert_with_quantize(tmp_path, tiny_bert_dir):
    out = tmp_path / "art"
    r = _slimml("convert", tiny_bert_dir, "-o", out, "--quantize", "int8-dynamic", "--json")
    assert r.returncode == 0, r.stderr
    m = read_manifest(out)
    assert [s["step"] for s in m.steps] == ["export", "shard", "quantize"]
    # the float artifact's figures named so: they read as the quantized model's (its perplexity, its latency)
    assert "float_max_abs_diff" in m.checks and "max_abs_diff" not in m.checks and "quantize_agreement_cosine" in m.checks
    assert load(out).encode(["hello there"]).shape == (1, 32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no temporary folders left


def test_convert_bad_calibration_leaves_nothing(tmp_path, tiny_bert_dir):
    from slimml.convert import ConvertConfig, convert
    from slimml.errors import DataError
    from slimml.quantize import Int8StaticConfig

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="holds no text"):
        convert(tiny_bert_dir, tmp_path / "art", ConvertConfig(quantize=Int8StaticConfig(calibration=empty), measure_latency=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


@pytest.mark.slow
def test_default_model_int8(default_artifact, tmp_path):
    """The headline: all-MiniLM-L6-v2 int8 keeps STSb dev within 0.3 of fp32 at about a quarter of the size."""
    from slimml.quantize import Int8Config, quantize
    from slimml.runtime.tools.evaluate import evaluate_sts

    report = quantize(default_artifact, tmp_path / "q", Int8Config("cpu", calibration=STS_TRAIN))
    assert report.size_mb < 24.5
    f, q = evaluate_sts(load(default_artifact), STS_DEV).score, evaluate_sts(load(tmp_path / "q"), STS_DEV).score
    assert f - q < 0.3, (f, q)
