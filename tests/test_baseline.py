"""Regression baselines: save, compare, the readable diff, exit codes; and the default model's own check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from slimml.cli import app
from slimml.errors import ConfigError, DataError
from slimml.runtime.tools.baseline import REGRESSION_EXIT_CODE, Baseline, Tolerances, compare
from conftest import STS_DEV

BASELINES = Path(__file__).parent / "baselines"
runner = CliRunner()


def sts_subset(folder: Path, pairs: int) -> Path:
    """The first ``pairs`` rows of STS dev, byte for byte (the baseline records the data's sha256)."""
    path = folder / f"sts-dev-{pairs}.csv"
    lines = STS_DEV.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_text("".join(lines[: pairs + 1]), encoding="utf-8")
    return path


def bench_baseline(p50: float = 10.0, mb: float = 90.0, **settings) -> Baseline:
    s = {"batch": 1, "seq": 128, "device": "cpu"} | settings
    return Baseline("bench", "m", s, {"p50_ms": p50, "p90_ms": p50 * 1.2, "model_mb": mb})


def test_latency_within_and_beyond_tolerance():
    old = bench_baseline(10.0)
    assert compare(old, bench_baseline(14.9), Tolerances(latency_increase_pct=50)).ok
    report = compare(old, bench_baseline(15.1), Tolerances(latency_increase_pct=50))
    assert not report.ok and [c.metric for c in report.regressions] == ["p50_ms"]
    text = report.format("base.json")
    assert "REGRESSION" in text and "FAIL: 1 regression(s): p50_ms rose +51% (allowed +50%)." in text
    # p90 is shown, never gated: it is too noisy on shared machines
    assert compare(old, Baseline("bench", "m", old.settings, {"p50_ms": 10.0, "p90_ms": 99.0, "model_mb": 90.0})).ok


def test_size_growth_is_gated():
    report = compare(bench_baseline(mb=90.0), bench_baseline(mb=95.0))
    assert [c.metric for c in report.regressions] == ["model_mb"]


def test_accuracy_drop_is_tight():
    s = {"metric": "spearman", "data": "d.csv", "data_sha256": "0" * 64, "pairs": 10}
    old = Baseline("eval", "m", s, {"score": 82.0})
    assert compare(old, Baseline("eval", "m2", s, {"score": 81.95})).ok  # another artifact may be compared
    report = compare(old, Baseline("eval", "m2", s, {"score": 81.8}))
    assert "FAIL: 1 regression(s): spearman x100 fell by 0.2 points (allowed 0.1)." in report.format()
    assert not compare(old, Baseline("eval", "m", s, {"score": float("nan")})).ok


def test_settings_and_kinds_must_match():
    with pytest.raises(ConfigError, match=r"other settings \(seq: baseline 128, now 64 \[--seq\]\)"):
        compare(bench_baseline(), bench_baseline(seq=64))
    s = {"metric": "spearman", "data": "d.csv", "data_sha256": "0" * 64, "pairs": 10}
    with pytest.raises(ConfigError, match="use it with `slimml bench`, not `eval`"):
        compare(bench_baseline(), Baseline("eval", "m", s, {"score": 1.0}))
    with pytest.raises(ConfigError, match=r"--max-latency-increase \(tolerance latency_increase_pct\) must be a finite number >= 0, got -1"):
        Tolerances(latency_increase_pct=-1)


def test_baseline_file_round_trip_and_bad_files(tmp_path):
    b = bench_baseline()
    b.save(tmp_path / "b.json")
    assert Baseline.load(tmp_path / "b.json") == b
    assert not list(tmp_path.glob(".*tmp*"))  # atomic write leaves no temp file
    with pytest.raises(DataError, match="does not exist; write one first with --save-baseline"):
        Baseline.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="is not valid JSON"):
        Baseline.load(tmp_path / "bad.json")
    raw = b.to_json()
    raw["metrics"]["p50_ms"] = float("-inf")  # Python's json writes and reads it: a gate nothing could fail
    (tmp_path / "inf.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match="metrics that are missing or not finite numbers"):
        Baseline.load(tmp_path / "inf.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "slimml.baseline", "format_version": 99}))
    with pytest.raises(DataError, match="has format version 99; this slimml reads 1"):
        Baseline.load(tmp_path / "other.json")


def test_perplexity_counts_tokens_and_old_baselines_still_match(tmp_path):
    """A perplexity baseline names its count ``tokens``; one saved when it was called ``pairs`` reads the same."""
    from slimml.runtime.tools.evaluate import EvalResult

    data = tmp_path / "text.txt"
    data.write_text("some text\n")
    now = Baseline.from_eval(EvalResult("perplexity", 12.5, 299, "tokens", {"window": 300, "windows": 1}), "m", data)
    assert now.settings["tokens"] == 299 and "pairs" not in now.settings
    old = json.loads(json.dumps(now.to_json()))
    old["settings"]["pairs"] = old["settings"].pop("tokens")
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert compare(Baseline.load(tmp_path / "old.json"), now).ok
    later = Baseline.from_eval(EvalResult("perplexity", 12.5, 299, "tokens", {"window": 300, "windows": 1, "max_tokens": 300}),
                               "m", data)
    assert compare(Baseline.load(tmp_path / "old.json"), later).ok  # a setting the old one did not record holds nothing


def test_cli_bench_save_then_check(tiny_bert_artifact, tmp_path):
    base = tmp_path / "bench.json"
    args = ["bench", str(tiny_bert_artifact), "--runs", "5", "--seq", "16"]
    r = runner.invoke(app, [*args, "--save-baseline", str(base)])
    assert r.exit_code == 0, r.output
    from slimml.runtime.engine.backends.base import env_threads

    assert "baseline saved to" in r.output and Baseline.load(base).settings == {
        "batch": 1, "seq": 16, "device": "cpu", "plan": "resident", "threads": env_threads(),
        "component": None, "weights": "resident", "task": "sentence-embedding",
        "inputs": ["input_ids", "attention_mask", "token_type_ids"]}
    r = runner.invoke(app, [*args, "--baseline", str(base), "--max-latency-increase", "1000"])
    assert r.exit_code == 0, r.output
    assert "ok: no regression beyond the tolerances." in r.output
    raw = json.loads(base.read_text())
    raw["metrics"]["p50_ms"] /= 100  # a baseline 100x faster than anything this machine can do
    base.write_text(json.dumps(raw))
    r = runner.invoke(app, [*args, "--baseline", str(base), "--json"])
    assert r.exit_code == REGRESSION_EXIT_CODE
    assert "FAIL: 1 regression(s): p50_ms rose" in r.output
    r = runner.invoke(app, [*args, "--baseline", str(base), "--save-baseline", str(base)])  # a regressed run is not saved
    assert r.exit_code == REGRESSION_EXIT_CODE and f"baseline not saved to {base}: this run regressed" in r.output
    assert json.loads(base.read_text()) == raw
    r = runner.invoke(app, ["bench", str(tiny_bert_artifact), "--runs", "5", "--seq", "32", "--baseline", str(base)])
    assert isinstance(r.exception, ConfigError) and "seq: baseline 16, now 32" in str(r.exception)


def test_cli_bench_records_what_decides_latency_and_refuses_gates_that_cannot_mean_anything(tiny_bert_artifact, tmp_path,
                                                                                           monkeypatch):
    """A review's findings: a baseline saved with --device auto was refused against itself; a
    streamed run, another thread count or another component was compared with a resident one in
    silence; --sweep dropped --baseline without a word; a hand-edited baseline without a latency
    gated nothing."""
    base = tmp_path / "bench.json"
    args = ["bench", str(tiny_bert_artifact), "--runs", "3", "--seq", "16"]
    assert runner.invoke(app, [*args, "--device", "auto", "--save-baseline", str(base)]).exit_code == 0
    r = runner.invoke(app, [*args, "--device", "auto", "--baseline", str(base), "--max-latency-increase", "1000"])
    assert r.exit_code == 0, r.output
    for extra, said in ((["--resident", "2"], "plan: baseline 'resident', now 'K=2 P=1' [--resident/--prefetch"),
                        (["--sweep", "2"], "--sweep times many K,P plans and a gate one")):
        r = runner.invoke(app, [*args, *extra, "--baseline", str(base)])
        assert r.exit_code == 1 and said in str(r.exception), r.output
    monkeypatch.setenv("SLIMML_THREADS", "2" if Baseline.load(base).settings["threads"] != 2 else "1")
    r = runner.invoke(app, [*args, "--baseline", str(base)])
    assert r.exit_code == 1 and "threads: baseline" in str(r.exception) and "[SLIMML_THREADS]" in str(r.exception)
    raw = json.loads(base.read_text())
    for metrics in ({}, {"p50_ms": 0.0, "model_mb": 1.0}, {"p50_ms": -3.0, "model_mb": 1.0}):
        (tmp_path / "edited.json").write_text(json.dumps(raw | {"metrics": metrics}))
        with pytest.raises(DataError, match="malformed .* a latency or size that is not positive"):
            Baseline.load(tmp_path / "edited.json")
    r = runner.invoke(app, [*args, "--save-baseline", str(tmp_path / "no" / "b.json")])
    assert r.exit_code == 1 and "its folder" in str(r.exception) and "does not exist" in str(r.exception)
    # a baseline an older slimml saved (batch, seq and device only) passed a run under any plan or thread count
    old = {**raw, "settings": {k: raw["settings"][k] for k in ("batch", "seq", "device")}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    r = runner.invoke(app, [*args, "--resident", "2", "--baseline", str(tmp_path / "old.json")])
    assert r.exit_code == 1 and str(r.exception) == (
        "the baseline does not record its plan, weights, threads (a slimml before these were recorded saved it), so a "
        "run under another streaming plan or thread count would pass against it; save a new baseline with --save-baseline.")


def test_a_gate_refuses_another_models_baseline_and_a_save_over_the_other_commands(tiny_bert_artifact,
                                                                                      tiny_llama_past_artifact, tmp_path,
                                                                                      caplog):
    """An audit's findings: a bench baseline saved from a language model gated an embedder (p50 -90%: ok); eval
    --save-baseline replaced a bench baseline in silence; --against with --save-baseline named --baseline; a gate on
    one timed run or two STS pairs passed without a word."""
    bench = tmp_path / "bench.json"
    r = runner.invoke(app, ["bench", str(tiny_llama_past_artifact), "--seq", "16", "--save-baseline", str(bench)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["bench", str(tiny_bert_artifact), "--seq", "16", "--baseline", str(bench)])
    assert r.exit_code == 1 and str(r.exception) == (
        f"the baseline was saved from {tiny_llama_past_artifact}, a text-generation-with-past model taking input_ids, "
        "attention_mask, position_ids, past_key_values.{0..2}.key, past_key_values.{0..2}.value, and this artifact is "
        "a sentence-embedding model taking input_ids, attention_mask, token_type_ids, so their latencies do not compare; "
        "gate with a baseline of the same model (its float or an earlier build), or save one with --save-baseline."), \
        str(r.exception)
    raw = json.loads(bench.read_text())  # saved before the model was recorded: it cannot tell another model
    for key in ("task", "inputs"):
        del raw["settings"][key]
    (tmp_path / "older.json").write_text(json.dumps(raw))
    r = runner.invoke(app, ["bench", str(tiny_llama_past_artifact), "--seq", "16", "--baseline", str(tmp_path / "older.json")])
    assert r.exit_code == 1 and str(r.exception).startswith("the baseline does not record the model it timed"), r.output
    data = sts_subset(tmp_path, 20)
    r = runner.invoke(app, ["eval", str(tiny_bert_artifact), "--data", str(data), "--save-baseline", str(bench)])
    assert r.exit_code == 1 and str(r.exception) == (
        f"{bench} holds a `slimml bench` baseline, and this run is `slimml eval`; refusing to replace it (a bench gate "
        "reads it). Give --save-baseline a path of its own.")
    assert Baseline.load(bench).kind == "bench"
    scored = tmp_path / "eval.json"
    r = runner.invoke(app, ["eval", str(tiny_bert_artifact), "--data", str(data), "--save-baseline", str(scored)])
    assert r.exit_code == 0 and "on 20 pairs" in r.output and "a gate scored on only 20 pairs" in caplog.text, r.output
    r = runner.invoke(app, ["bench", str(tiny_bert_artifact), "--seq", "16", "--save-baseline", str(scored)])
    assert r.exit_code == 1 and "holds a `slimml eval` baseline, and this run is `slimml bench`" in str(r.exception)
    r = runner.invoke(app, ["bench", str(tiny_bert_artifact), "--against", str(tiny_bert_artifact), "--save-baseline",
                            str(tmp_path / "new.json")])
    assert r.exit_code == 1 and str(r.exception).startswith("--save-baseline saves this run to gate later ones"), r.output
    r = runner.invoke(app, ["bench", str(tiny_bert_artifact), "--seq", "16", "--runs", "1", "--against",
                            str(tiny_bert_artifact), "--max-latency-increase", "1000"])
    assert r.exit_code == 0 and "a latency gate on 1 timed run is noise on a shared machine" in caplog.text, r.output


def test_cli_bench_against_times_both_alternately(tiny_bert_artifact, tiny_llama_past_artifact, tmp_path):
    """``--against REF``: the reference timed in the same run, alternately, instead of a baseline
    saved under other load; its p50 and size gate this artifact's."""
    from slimml.quantize import Int8Config, quantize

    quantize(tiny_bert_artifact, tmp_path / "int8", Int8Config("cpu"))
    args = ["--runs", "10", "--seq", "16", "--max-latency-increase", "1000"]
    r = runner.invoke(app, ["bench", str(tmp_path / "int8"), "--against", str(tiny_bert_artifact), *args, "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["runs"] == got["reference"]["runs"] == 10 and got["baseline"]["ok"]
    assert got["model_mb"] < got["reference"]["model_mb"]
    # one process held both: its peak memory is the two's together, not either's (it was given as each's)
    assert got["peak_rss_mb"] is None and got["reference"]["peak_rss_mb"] is None and got["process_peak_rss_mb"] > 0
    assert "peak_rss_mb" not in {c["metric"] for c in got["baseline"]["checks"]}
    r = runner.invoke(app, ["bench", str(tiny_bert_artifact), "--against", str(tmp_path / "int8"), *args])
    assert r.exit_code == REGRESSION_EXIT_CODE and "timed alternately in this run" in r.output
    assert "FAIL: 1 regression(s): model_mb rose" in r.output  # the float model is larger than the int8 one
    for other, said in (([str(tiny_bert_artifact), "--against", str(tiny_llama_past_artifact)], "takes other inputs"),
                        ([str(tiny_bert_artifact), "--against", str(tmp_path / "int8"), "--baseline", str(tmp_path / "b.json")],
                         "give one of them"),
                        ([str(tiny_bert_artifact), "--against", str(tmp_path / "gone")],  # which of the two is meant
                         f"the reference {tmp_path / 'gone'}: {tmp_path / 'gone'} is not an artifact folder")):
        r = runner.invoke(app, ["bench", *other, *args])
        assert r.exit_code == 1 and said in str(r.exception), r.output


def test_cli_eval_save_then_check(tiny_bert_artifact, tmp_path):
    data = sts_subset(tmp_path, 20)
    base = tmp_path / "eval.json"
    args = ["eval", str(tiny_bert_artifact), "--data", str(data)]
    assert runner.invoke(app, [*args, "--save-baseline", str(base)]).exit_code == 0
    r = runner.invoke(app, [*args, "--baseline", str(base), "--max-accuracy-drop", "0"])
    assert r.exit_code == 0, r.output  # the same artifact on the same data scores the same
    raw = json.loads(base.read_text())
    raw["metrics"]["score"] += 1.0
    base.write_text(json.dumps(raw))
    r = runner.invoke(app, [*args, "--baseline", str(base)])
    assert r.exit_code == REGRESSION_EXIT_CODE
    assert "fell by 1 points (allowed 0.1)" in r.output
    other = sts_subset(tmp_path, 10)
    other.rename(tmp_path / "sts-dev-20.csv.other")
    r = runner.invoke(app, ["eval", str(tiny_bert_artifact), "--data", str(tmp_path / "sts-dev-20.csv.other"),
                            "--baseline", str(base)])
    assert isinstance(r.exception, ConfigError) and "other settings" in str(r.exception)
    assert "spearman x100 =" not in r.output  # refused before the model runs, not after scoring it


@pytest.mark.slow
def test_default_model_regression(default_artifact, tmp_path):
    """slimml's own regression check: tight on accuracy, generous on latency (noise)."""
    data = sts_subset(tmp_path, 200)
    r = runner.invoke(app, ["eval", str(default_artifact), "--data", str(data), "--max-accuracy-drop", "0.05",
                            "--baseline", str(BASELINES / "minilm-sts-dev-200.json")])
    assert r.exit_code == 0, r.output
    assert "ok: no regression" in r.output
    base = tmp_path / "bench.json"
    args = ["bench", str(default_artifact), "--runs", "10", "--seq", "64"]
    assert runner.invoke(app, [*args, "--save-baseline", str(base)]).exit_code == 0
    r = runner.invoke(app, [*args, "--baseline", str(base), "--max-latency-increase", "200"])
    assert r.exit_code == 0, r.output


def test_nan_embeddings_are_refused_not_ranked(tmp_path):
    """A model whose embeddings hold NaN gets an error, not a Spearman score of arbitrary ranks."""
    from slimml.errors import ArtifactError
    from slimml.runtime.tools.evaluate import evaluate_sts

    class Broken:
        def encode(self, texts, batch_size=32, show_progress=False):
            out = np.ones((len(texts), 4), dtype=np.float32) * np.arange(len(texts))[:, None]
            out[3] = np.nan
            return out

    data = tmp_path / "sts.csv"
    data.write_text("sentence1,sentence2,score\n" + "".join(f"a {i},b {i},{i % 5}\n" for i in range(10)))
    with pytest.raises(ArtifactError, match=r"NaN or infinite embeddings for 1 of 10 pairs \(the first: pair 4 of"):
        evaluate_sts(Broken(), data)


def test_a_gate_without_what_it_compares_with_and_a_baseline_over_a_users_file_are_refused(tiny_bert_artifact, tmp_path):
    """A gate step that forgot --baseline exited 0 forever; --save-baseline replaced whatever file
    was there (the --data CSV, an artifact's manifest); --baseline naming a folder said it did not
    exist; a 400-digit metric in a baseline was an OverflowError; a huge --runs a numpy traceback."""
    data = sts_subset(tmp_path, 10)
    manifest = tmp_path / "manifest.json"
    manifest.write_text('{"format_version": 1}')
    eval_args = ["eval", str(tiny_bert_artifact), "--data", str(data)]
    bench_args = ["bench", str(tiny_bert_artifact), "--runs", "2", "--seq", "8"]
    for args, said in (
            ([*eval_args, "--max-accuracy-drop", "0"], "--max-accuracy-drop gates this run against a baseline; give --baseline"),
            ([*bench_args, "--max-size-increase", "0"], "--max-size-increase gates this run against a baseline or a reference"),
            ([*eval_args, "--save-baseline", str(data)], "is the --data file; give the baseline a path of its own"),
            ([*bench_args, "--save-baseline", str(manifest)], "exists and is not a slimml baseline; refusing to replace it"),
            ([*eval_args, "--baseline", str(tmp_path)], "is a folder; give the baseline file"),
            ([*bench_args, "--runs", str(10 ** 24)], "--runs must be a whole number from 1 to 1,048,576")):
        r = runner.invoke(app, args)
        assert r.exit_code == 1 and said in str(r.exception), (args, r.output, r.exception)
    assert manifest.read_text() == '{"format_version": 1}' and data.read_text().startswith("sentence1")
    base = tmp_path / "b.json"
    assert runner.invoke(app, [*eval_args, "--save-baseline", str(base)]).exit_code == 0
    assert runner.invoke(app, [*eval_args, "--save-baseline", str(base)]).exit_code == 0  # a baseline is replaced
    empty = tmp_path / "mktemp.json"
    empty.touch()  # B=$(mktemp); ... --save-baseline $B
    assert runner.invoke(app, [*eval_args, "--save-baseline", str(empty)]).exit_code == 0 and json.loads(empty.read_text())
    raw = json.loads(base.read_text())
    raw["metrics"]["score"] = 10 ** 400
    base.write_text(json.dumps(raw))
    r = runner.invoke(app, [*eval_args, "--baseline", str(base)])
    assert r.exit_code == 1 and "is malformed" in str(r.exception), r.output


def test_a_bench_baseline_records_how_streamed_weights_are_read(tiny_llama_past_artifact, tmp_path):
    """--no-pack (weights fed from the data files) against the default pre-packed weights: 20x apart on
    a 4-bit model, yet the baseline's plan read "K=2 P=1" for both and the gate compared them."""
    base = tmp_path / "fed.json"
    args = ["bench", str(tiny_llama_past_artifact), "--runs", "2", "--seq", "8", "--resident", "2"]
    r = runner.invoke(app, [*args, "--no-pack", "--save-baseline", str(base)])
    assert r.exit_code == 0, r.output
    assert json.loads(base.read_text())["settings"]["weights"] == "fed"
    assert json.loads(base.read_text())["settings"]["component"] is None
    r = runner.invoke(app, [*args, "--baseline", str(base)])
    assert r.exit_code == 1 and "weights: baseline 'fed', now 'pre-packed'" in \
        str(r.exception) and "[--pack/--no-pack, --cache-dir]" in str(r.exception), r.output


def test_bench_against_a_reference_of_fewer_tokens_or_another_task_is_refused_first(tiny_bert_dir, tiny_bert_artifact,
                                                                                      tmp_path):
    """A reference taking fewer tokens failed mid-run on a feed error that blamed "this model"; one of
    another task with the same inputs (a classifier) was timed and gated as if comparable."""
    import shutil

    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    from slimml.convert import ConvertConfig, convert

    torch.manual_seed(0)
    shape = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    for name, model in (("short", BertModel(BertConfig(**shape, max_position_embeddings=64))),
                        ("classifier", BertForSequenceClassification(BertConfig(**shape, max_position_embeddings=128)))):
        shutil.copytree(tiny_bert_dir, tmp_path / name)
        model.eval().save_pretrained(tmp_path / name)
        if name == "classifier":
            for extra in ("modules.json", "sentence_bert_config.json", "1_Pooling"):
                shutil.rmtree(tmp_path / name / extra) if extra == "1_Pooling" else (tmp_path / name / extra).unlink()
        convert(tmp_path / name, tmp_path / f"{name}-art", ConvertConfig(measure_latency=False, verify=False))
    args = ["bench", str(tiny_bert_artifact), "--runs", "2"]
    r = runner.invoke(app, [*args, "--seq", "100", "--against", str(tmp_path / "short-art")])
    assert r.exit_code == 1 and str(r.exception) == (f"--seq 100 is past the 64 tokens the reference {tmp_path / 'short-art'} "
                                                     "takes; give --seq 64 or less."), r.output
    r = runner.invoke(app, [*args, "--seq", "16", "--against", str(tmp_path / "classifier-art")])
    assert r.exit_code == 1 and "is a text-classification model and this artifact a sentence-embedding one" in \
        str(r.exception), r.output
