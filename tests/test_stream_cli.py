"""``slimml bench --resident/--prefetch/--memory-budget/--sweep`` and ``slimml generate``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from slimml.cli import app
from slimml.errors import ConfigError, SlimmlError
from slimml.runtime.artifact.manifest import read_manifest
from test_stream import mlp_artifact, tiny_llama_artifact  # noqa: F401  (module fixtures)

runner = CliRunner()


def test_bench_streamed_reports_bytes_and_waits(mlp_artifact):  # noqa: F811
    r = runner.invoke(app, ["bench", str(mlp_artifact), "--resident", "2", "--prefetch", "1", "--batch", "2",
                            "--seq", "4", "--runs", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    st = out["stream"]
    assert st["resident"] == 2 and st["prefetch"] == 1
    assert st["bytes_per_run"] > 0 and st["peak_streamed_shards"] <= 2
    assert st["wait_s_per_run"] >= 0 and st["compute_s_per_run"] > 0
    assert out["run_peak_rss_mb"] > 0


def test_bench_and_generate_take_the_cache_folder_and_fed_weights_as_flags(mlp_artifact, tmp_path):  # noqa: F811
    """--cache-dir and --no-pack: what the messages about the cache tell a CLI user to pass."""
    r = runner.invoke(app, ["bench", str(mlp_artifact), "--resident", "2", "--runs", "1", "--cache-dir", str(tmp_path / "c"),
                            "--json"])
    assert r.exit_code == 0, r.output
    assert "pre-packed" in json.loads(r.output)["stream"]["plan"] and list((tmp_path / "c" / "packed").iterdir())
    r = runner.invoke(app, ["bench", str(mlp_artifact), "--resident", "2", "--runs", "1", "--no-pack", "--json"])
    assert r.exit_code == 0, r.output
    assert "weights fed" in json.loads(r.output)["stream"]["plan"]


def test_bench_sweep_writes_table_csv_and_plot(mlp_artifact, tmp_path):  # noqa: F811
    r = runner.invoke(app, ["bench", str(mlp_artifact), "--sweep", "1,2,3:0,1", "--runs", "2", "--batch", "2",
                            "--sweep-out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["rows"]
    assert [(x["resident"], x["prefetch"]) for x in rows] == [(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (6, "-")]
    assert (tmp_path / "sweep.md").read_text().count("\n|") == len(rows) + 2  # header, rule, rows
    assert (tmp_path / "sweep.csv").is_file()
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_budget_too_small(mlp_artifact):  # noqa: F811
    r = runner.invoke(app, ["bench", str(mlp_artifact), "--memory-budget", "1KB"])
    assert isinstance(r.exception, ConfigError)
    assert "is smaller than shard" in str(r.exception)


def test_generate_needs_a_tokenizer_for_text(tiny_llama_artifact):  # noqa: F811
    r = runner.invoke(app, ["generate", str(tiny_llama_artifact), "--prompt", "Hello", "--resident", "2"])
    assert isinstance(r.exception, SlimmlError)
    assert str(r.exception).endswith("has no tokenizer, so it cannot read text: pass token ids instead (model.generate(["
                                     "[1, 2, 3]]) in Python), or re-convert it from a folder that has its tokenizer "
                                     "(tokenizer.json) to give it text.")
    assert read_manifest(tiny_llama_artifact).checks["tokenizer_note"].startswith("the source has no tokenizer")


def test_bench_sweep_says_which_points_it_skips_and_refuses_when_none_streams(mlp_artifact, tmp_path):  # noqa: F811
    """``--sweep 2:5`` wrote a table of the resident row alone, and ``--sweep ''`` was ignored."""
    r = runner.invoke(app, ["bench", str(mlp_artifact), "--sweep", "2:5", "--sweep-out", str(tmp_path)])
    assert isinstance(r.exception, ConfigError) and "no point of the sweep streams" in str(r.exception)
    assert "K=2 P=5 (P=5 needs K >= 6)" in str(r.exception)
    r = runner.invoke(app, ["bench", str(mlp_artifact), "--sweep", "", "--sweep-out", str(tmp_path)])
    assert isinstance(r.exception, ConfigError) and "--sweep needs resident values" in str(r.exception)
    r = runner.invoke(app, ["bench", str(mlp_artifact), "--sweep", "2:0,5", "--runs", "1", "--sweep-out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["skipped"] == ["K=2 P=5 (P=5 needs K >= 6)"]
    # a point load() refuses was dropped without a word; --resident beside --sweep was ignored
    r = runner.invoke(app, ["bench", str(mlp_artifact), "--sweep", "2:0,-1", "--runs", "1", "--sweep-out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["skipped"] == ["K=2 P=-1 (prefetch=-1 must be a whole number >= 0 (shards loaded ahead))"]
    r = runner.invoke(app, ["bench", str(mlp_artifact), "--sweep", "2", "--resident", "3", "--sweep-out", str(tmp_path)])
    assert isinstance(r.exception, ConfigError) and "--resident picks one: drop one of them" in str(r.exception)


@pytest.mark.parametrize("bad", ["a,b", "2:x"])
def test_bench_sweep_bad_spec(mlp_artifact, bad):  # noqa: F811
    r = runner.invoke(app, ["bench", str(mlp_artifact), "--sweep", bad])
    assert isinstance(r.exception, SlimmlError) and "is not 'K,K,...' or 'K,K,...:P,P,...'" in str(r.exception)
