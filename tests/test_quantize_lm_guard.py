"""Quantizing language models, as the hostile review of stop 58 found it: the guard's windows within
the model's context, its text read before any work, decisions it cannot measure refused, configs
written in Python honoured, an unused calibration not recorded as used; perplexity's windows and
tokens; the bench's pass as generation runs it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from slimml.errors import ConfigError, DataError

POSITIONS = 64


def _lee() -> str:
    src = Path(importlib.util.find_spec("gensim").submodule_search_locations[0]) / "test" / "test_data"
    return (src / "lee_background.cor").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def short_gpt2(tmp_path_factory) -> dict:
    """A random GPT-2 of 64 learned positions with a BPE tokenizer trained on real text, converted:
    its position table refuses an index past 63 (ONNX Runtime's Gather)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from slimml.convert import ConvertConfig, convert

    root = tmp_path_factory.mktemp("short_gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=2)).eval() \
        .save_pretrained(root / "src")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = _lee()
    tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"],
                                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>") \
        .save_pretrained(root / "src")
    convert(root / "src", root / "art", ConvertConfig(verify=False, measure_latency=False))
    (root / "lee.txt").write_text(text[:60_000], encoding="utf-8")
    return {"root": root, "art": root / "art", "text": root / "lee.txt"}


def test_the_guard_scores_within_the_models_context(short_gpt2, tmp_path):
    """It scored windows of 256 tokens: past the table of 64 positions, a raw ONNX Runtime traceback
    after every shard was quantized."""
    from slimml.quantize import quantize, scheme_config

    config = scheme_config("int8")
    config.eval_text = short_gpt2["text"]
    checks = quantize(short_gpt2["art"], tmp_path / "q", config).checks
    assert checks["drop_metric"] == "perplexity_increase_pct" and checks["eval_tokens"] > 1000, checks
    assert np.isfinite(checks["drop"]) and checks["drop_noise"] > 0


def test_the_evaluation_inputs_are_checked_before_any_work(short_gpt2, tmp_path):
    from slimml.quantize import GuardConfig, quantize, scheme_config

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8 " * 100)
    sts = tmp_path / "sts.csv"
    sts.write_text("sentence1,sentence2,score\na,b,1\n", encoding="utf-8")
    for config, error, words in ((scheme_config("int4-weights"), DataError, "UTF-8"),
                                 (scheme_config("int8", max_drop=1.0, eval_file=sts), ConfigError, "an STS CSV")):
        if error is DataError:
            config.eval_text = bad
        steps: list[str] = []
        with pytest.raises(error, match=words):
            quantize(short_gpt2["art"], tmp_path / "q", config, on_step=steps.append)
        assert steps == [] and not (tmp_path / "q").exists(), steps  # refused before reading or quantizing anything
    assert GuardConfig  # imported as users import it


def test_a_max_drop_the_text_cannot_measure_is_refused(short_gpt2, tmp_path):
    """A drop within the measurement's own spread (the built-in sample: ~400 tokens) sent the guard
    searching shards on noise; now it is refused, saying how to measure it."""
    from slimml.quantize import quantize, scheme_config

    plain = scheme_config("int4-weights")
    checks = quantize(short_gpt2["art"], tmp_path / "plain", plain).checks
    assert checks["eval_text"] == "built-in sample" and checks["drop_noise"] > 0
    asked = checks["drop"] - checks["drop_noise"] / 2
    if asked <= 0:
        pytest.skip(f"this model's drop {checks['drop']} is within its noise at 0")
    config = scheme_config("int4-weights", max_drop=asked)
    with pytest.raises(ConfigError, match=r"cannot be judged on this text: the perplexity rose .*% \+- .*% \(95%\) on its "
                                          r"\d+ tokens \(built-in sample\)\. Give a longer text"):
        quantize(short_gpt2["art"], tmp_path / "guarded", config)
    assert not (tmp_path / "guarded").exists()


def test_at_the_scored_tokens_cap_the_refusal_asks_for_no_longer_text(short_gpt2, lee_slice, tmp_path):
    """On a text past the 2,048 tokens the guard scores, the refusal still asked for a longer text, which
    changes nothing; the window and cap are recorded, for `slimml eval` to score the same tokens."""
    from slimml.quantize import quantize, scheme_config

    long = tmp_path / "long.txt"
    long.write_text(lee_slice.read_text(encoding="utf-8") * 4, encoding="utf-8")
    plain = scheme_config("int4-weights")
    plain.eval_text = long
    checks = quantize(short_gpt2["art"], tmp_path / "plain", plain).checks
    assert checks["eval_tokens"] > 2000 and (checks["eval_max_tokens"], checks["eval_window"]) == (2048, POSITIONS), checks
    asked = checks["drop"] * 0.99  # under the drop, within its noise
    if not 0 < asked and checks["drop"] - checks["drop_noise"] <= asked:
        pytest.skip(f"this model's drop {checks['drop']} +- {checks['drop_noise']} leaves no max_drop to refuse")
    config = scheme_config("int4-weights", max_drop=asked)
    config.eval_text = long
    with pytest.raises(ConfigError, match=r"\(long.txt\)\. The 2,048 tokens scored at most cannot tell it closer: give a "
                                          r"--max-drop above"):
        quantize(short_gpt2["art"], tmp_path / "guarded", config)


def test_a_config_written_in_python_is_honoured_and_an_unused_calibration_not_recorded(short_gpt2, tmp_path):
    from slimml.quantize import WeightOnlyConfig, quantize, scheme_config

    quantize(short_gpt2["art"], tmp_path / "ort", WeightOnlyConfig(bits=4, block_size=32, symmetric=True))
    step = json.loads((tmp_path / "ort" / "manifest.json").read_text())["steps"][-1]
    assert (step["backend"], step["block_size"], step["symmetric"]) == ("ort", 32, True), step
    calibration = tmp_path / "junk.txt"
    calibration.write_text("\n".join(f"line {i} of nothing much" for i in range(64)), encoding="utf-8")
    quantize(short_gpt2["art"], tmp_path / "lm", scheme_config("int8", calibration=calibration))
    step = json.loads((tmp_path / "lm" / "manifest.json").read_text())["steps"][-1]
    assert step["backend"] == "lm" and step["calibration"] is None, step  # the 8-bit recipe reads no data
    assert step["calibration_unused"].endswith("junk.txt: this recipe reads no calibration data"), step


def test_perplexity_windows_and_tokens(short_gpt2):
    """A window of 2 over an odd count was a numpy traceback; a window asked past the context is refused
    (512 was clipped, 65 refused); a long file is tokenized only as far as max_tokens needs."""
    from slimml.errors import FeedError
    from slimml.runtime import load

    model = load(short_gpt2["art"])
    text = short_gpt2["text"].read_text(encoding="utf-8")
    got = model.perplexity("the cat sat on the mat today", window=2)
    assert got.window == 2 and got.tokens >= 1
    for window in (POSITIONS + 1, 512):
        with pytest.raises(FeedError, match=f"window={window} is more than the model's context of {POSITIONS}"):
            model.perplexity(text, window=window)
    assert model.perplexity(text, max_tokens=300).window <= POSITIONS  # the default fits the context
    small = model.perplexity(text, max_tokens=300)
    big = model.perplexity(text * 40, max_tokens=300)  # 2.4 MB: its first 300 tokens are the same
    assert (big.perplexity, big.tokens, big.windows) == (small.perplexity, small.tokens, small.windows)
    model.close()


def test_bench_feeds_read_the_last_positions_logits():
    """Every position's logits cost a pass 1.3-1.8x what generation's prefill pays (it reads the last)."""
    from slimml.runtime.artifact.manifest import TensorSpec
    from slimml.runtime.tools.bench import sample_feeds

    specs = [TensorSpec("input_ids", "int64", ["batch_size", "sequence_length"]),
             TensorSpec("logits_index", "int64", ["batch_size", "logits_length"])]
    feeds = sample_feeds(specs, batch=2, seq=128)
    assert feeds["input_ids"].shape == (2, 128) and feeds["logits_index"].tolist() == [[127], [127]]


def test_eval_refuses_options_a_language_model_does_not_take(short_gpt2):
    """--batch-size (even 0) and --progress were accepted and ignored on a language model."""
    import subprocess
    import sys

    for extra, words in ((["--batch-size", "0"], "--batch-size must be at least 1"),
                         (["--batch-size", "8"], "--batch-size is for embedding models"),
                         (["--progress"], "--progress is for embedding models")):
        out = subprocess.run([sys.executable, "-m", "slimml", "eval", str(short_gpt2["art"]), "--data",
                              str(short_gpt2["text"]), *extra], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and words in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_bench_on_a_language_model_says_prompt_tokens(short_gpt2):
    """It said "items/s" for a language model: neither prefill nor decode tokens/s, the figures users compare."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "slimml", "bench", str(short_gpt2["art"]), "--seq", "32", "--runs", "3"],
                         capture_output=True, text=True, timeout=120)
    said = " ".join(out.stdout.split())  # the console wraps at its width, which the figures' digits move
    assert out.returncode == 0 and "prompts/s (" in said and "prompt tokens/s prefilled)" in said, out.stdout + out.stderr


def test_truncated_rows_of_a_traced_decoder_each_get_their_own_room(short_gpt2):
    """truncate=True gave every prompt of a batch the room of its longest; a traced graph runs a row
    that reached its end of context on with the batch, so its (ignored) positions stay in the table."""
    from slimml.runtime import load

    model = load(short_gpt2["art"])
    rows = [[5 + i % 100 for i in range(POSITIONS - 4)], [5, 6, 7]]
    both = model.generate(rows, max_new_tokens=20, truncate=True, eos_token_id=())
    assert [len(t) for t in both.tokens] == [4, 20]
    assert both.tokens == [model.generate([p], max_new_tokens=20, truncate=True, eos_token_id=()).tokens[0] for p in rows]


def test_gpt2s_gemm_layers_are_quantized(short_gpt2, tmp_path):
    """GPT-2's Conv1D layers export as Gemm, which neither ONNX Runtime quantizer takes: int8 and
    int4 left every layer float ("nothing to quantize"). Now they are MatMul + Add first."""
    import onnx

    from slimml.quantize import quantize, scheme_config
    from slimml.quantize.registry import weight_matmuls

    for scheme in ("int8", "int4-weights"):
        report = quantize(short_gpt2["art"], tmp_path / scheme, scheme_config(scheme))
        assert not report.float_shards, report.float_shards
        for f in (tmp_path / scheme).glob("*.onnx"):  # every product with a weight quantized
            assert not weight_matmuls(onnx.load(str(f)), ("MatMul", "Gemm")), (scheme, f.name)


def test_a_gemm_is_rewritten_exactly_and_only_where_it_can_be():
    """transB, a weight two Gemms share (transposed once), a Gemm without bias: the same outputs;
    alpha != 1 stays a Gemm."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from slimml.quantize.gemm import gemms_as_matmuls

    rng = np.random.default_rng(0)
    w, v, c = (rng.standard_normal(s).astype(np.float32) for s in ((6, 4), (4, 6), (6,)))
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["a"], transB=1),  # w (6, 4) read as (4, 6)^T
             helper.make_node("Gemm", ["x", "w", "c"], ["b"], transB=1),  # the same weight again
             helper.make_node("Gemm", ["x", "v"], ["d"]),  # (4, 6), no bias
             helper.make_node("Gemm", ["x", "v"], ["e"], alpha=0.5)]  # left as it is
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "abde"],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(v, "v"), numpy_helper.from_array(c, "c")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((3, 4)).astype(np.float32)

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})

    want = run(model)
    assert gemms_as_matmuls(model) == 3
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Add", "MatMul", "Add", "MatMul", "Gemm"]
    assert sorted(t.name for t in model.graph.initializer) == ["c", "v", "w_transposed"]  # w transposed once, then dropped
    for got, ref in zip(run(model), want):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_perplexity_that_is_nan_is_refused_and_a_byte_order_mark_is_not_text(short_gpt2, tmp_path):
    """A model computing NaN (an fp16 overflow) scored perplexity NaN: `slimml eval` exited 0, printed
    JSON no strict parser reads, and saved a baseline it then refused as malformed. A text saved with
    a byte-order mark scored differently from the same text without."""
    import shutil

    from slimml.errors import ArtifactError
    from slimml.runtime import load
    from slimml.runtime.artifact.files import sha256_file
    from slimml.runtime.tools.evaluate import evaluate_perplexity

    text = tmp_path / "text.txt"
    text.write_text(_lee()[:4000], encoding="utf-8")
    marked = tmp_path / "marked.txt"
    marked.write_bytes(b"\xef\xbb\xbf" + text.read_bytes())
    model = load(short_gpt2["art"])
    assert evaluate_perplexity(model, marked, max_tokens=256).score == evaluate_perplexity(model, text, max_tokens=256).score
    broken = tmp_path / "broken"
    shutil.copytree(short_gpt2["art"], broken)
    data = broken / "shard_001.onnx.data"
    np.full(data.stat().st_size // 4, np.nan, np.float32).tofile(data)  # a layer's weights gone NaN, the manifest made to match
    manifest = json.loads((broken / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == data.name:
            entry["sha256"] = sha256_file(data)
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"the model gave NaN or infinite log-probabilities on .*text\.txt \(perplexity "
                                            r"nan\); the artifact computes wrongly"):
        evaluate_perplexity(load(broken), text, max_tokens=256)
