"""Encoder-decoder models (T5) and speech (Whisper) the whole way: convert from a Hugging Face
folder into three components, generate the same tokens as Hugging Face's greedy generate,
stream, quantize, and transcribe WAV files from the command line.

Tiny random-weight models built here; no downloads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import run_without_torch, save_tiny_whisper, speech, write_wav

from slimml.errors import ConfigError, FeedError, SlimmlError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["translate English to German: the house is wonderful", "summarize: a b c", "one"]


def slimml(*args):
    return subprocess.run([sys.executable, "-m", "slimml", *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("t5")
    model = T5ForConditionalGeneration(T5Config(
        vocab_size=30522, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()
    model.save_pretrained(root / "src")
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    tokenizer.save_pretrained(root / "src")
    report = convert(root / "src", root / "art", ConvertConfig())
    return {"root": root, "torch": model, "tokenizer": tokenizer, "report": report}


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from slimml.convert import ConvertConfig, convert

    root = tmp_path_factory.mktemp("whisper")
    model, extractor = save_tiny_whisper(root / "src")
    report = convert(root / "src", root / "art", ConvertConfig())
    write_wav(root / "speech.wav", speech(2.0))
    return {"root": root, "torch": model, "extractor": extractor, "report": report}


def _hf_generate(model, **inputs):
    from transformers.generation.utils import GenerationMixin

    with torch.no_grad():  # the plain greedy loop (Whisper's own generate adds language and task handling)
        out = GenerationMixin.generate(model, **inputs, max_new_tokens=8, do_sample=False)
    return [[t for t in row[1:]] for row in out.tolist()]  # without the start token


def _strip(tokens: list[list[int]], eos: int, pad: int) -> list[list[int]]:
    """HF pads finished rows with pad ids after eos; slimml stops a row at its eos."""
    out = []
    for row in tokens:
        row = list(row)
        out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


# -- T5 ------------------------------------------------------------------------------------------

def test_t5_converts_into_encoder_decoder_and_decoder_with_past(t5):
    from slimml.runtime import read_manifest

    checks = t5["report"].checks
    assert checks["max_abs_diff"] <= 1e-5 and checks["max_abs_diff_vs_torch"] <= 1e-4 and checks["same_tokens_as_graph"]
    manifest = read_manifest(t5["root"] / "art")
    assert manifest.format_version == 2 and manifest.task == "text2text-generation"
    assert list(manifest.components) == ["encoder", "decoder", "decoder_with_past"]
    past = manifest.components["decoder_with_past"]
    for i in range(2):  # each layer's caches enter and leave the shard that holds the layer
        shard = next(s for s in past.shards if f"present.{i}.decoder.key" in {t.name for t in s.outputs})
        assert {f"past_key_values.{i}.decoder.key", f"past_key_values.{i}.encoder.key"} <= {t.name for t in shard.inputs}
        assert any(f"block.{i}" in layer for layer in shard.layers)
    # the decoder with past reads the decoder's weights from the decoder's own data files: stored once
    shared = {s.data for s in past.shards if s.data}
    assert shared and shared <= {s.data for s in manifest.components["decoder"].shards}
    assert not list((t5["root"] / "art" / "decoder").glob("past_*.data"))


def test_t5_generates_the_tokens_hugging_face_generates(t5):
    from slimml.runtime import load

    model = load(t5["root"] / "art")
    enc = t5["tokenizer"](PROMPTS, padding=True, return_tensors="pt")
    enc.pop("token_type_ids", None)
    want = _strip(_hf_generate(t5["torch"], **enc), eos=1, pad=0)
    result = model.generate(PROMPTS, max_new_tokens=8)
    assert result.tokens == want
    assert len(result.texts) == 3 and result.passes <= 8
    ids = [t5["tokenizer"](p)["input_ids"] for p in PROMPTS]
    assert model.generate(ids, max_new_tokens=8).tokens == want  # token ids in, the same tokens out


def test_t5_prompts_are_held_to_the_call_s_token_budget(t5):
    """An encoder-decoder's generate had no token budget: 64 prompts of 500 words went to the encoder
    in one pass (a server's memory 359 -> 1,324 MB on one request); its ids prompts had no length bound."""
    from slimml.runtime import load

    model = load(t5["root"] / "art")
    model.limits.max_batch_tokens = 64
    with pytest.raises(FeedError, match=r"^4 prompt\(s\) x 3 beams x 10 tokens = 120 is more than the limit of 64 tokens"):
        model.generate([[5] * 10] * 4, max_new_tokens=2, num_beams=3)
    assert len(model.generate([[5] * 10] * 6, max_new_tokens=2).tokens) == 6  # 60 tokens: within it
    model.limits.max_batch_tokens = None  # the default: 8,192 prompt tokens a call (beams counted)
    with pytest.raises(FeedError, match=r"^2 prompt\(s\) x 5000 tokens = 10000 is more than the limit of 8192 tokens"):
        model.generate([[5] * 5000] * 2, max_new_tokens=2)


def test_t5_refuses_what_it_would_cut_or_misread_and_says_why_it_stopped(t5):
    """A prompt past the tokenizer's length was cut there in silence (a long article summarised up to
    that point); ids that are not whole numbers were raw Python errors, or floats cut to ints; the
    finish reasons were empty (README: "stop" or "length"); a decoder's options were Python's TypeError."""
    from slimml.errors import FeedError
    from slimml.runtime import load

    model = load(t5["root"] / "art")
    limit = model.text.max_length
    with pytest.raises(FeedError, match=rf"prompt 1 is \d+ tokens, more than the {limit} this model reads; shorten it"):
        model.generate(["short", "word " * (limit + 10)], max_new_tokens=2)
    for bad, words in (([["a", 5]], "prompt 0 has a token id that is not a whole number"),
                       ([[1.7, 2.2]], "prompt 0 has a token id that is not a whole number"),
                       ([[5, 6], None], "prompt 1 is NoneType; give every prompt as a text")):
        with pytest.raises(FeedError, match=words):
            model.generate(bad, max_new_tokens=2)
    from slimml.errors import ConfigError
    from slimml.runtime.tasks.generation import GenerationConfig

    for options in ({"repetition_penalty": 1.2}, {"config": GenerationConfig(), "stop": ["."]}):  # a raw TypeError
        with pytest.raises(ConfigError, match=rf"takes no {sorted(options)[0]}.*its options are max_new_tokens"):
            model.generate(PROMPTS, **options)
    g = model.generate(PROMPTS, max_new_tokens=3)
    assert g.finish_reasons == ["stop" if t and t[-1] == 1 else "length" for t in g.tokens] and len(g.finish_reasons) == 3


@pytest.mark.parametrize("family", ["t5", "whisper", "bart", "marian"])
def test_encoder_decoders_through_the_torch_exporter_generate_as_optimum_s_graphs(request, tmp_path, family):
    """The torch exporter writes optimum's three graphs with any transformers (optimum-onnx needs
    4.57): the same tokens as the optimum-onnx artifact (BART: as transformers generates)."""
    from slimml.convert import ConvertConfig, convert
    from slimml.convert.config import ExportConfig
    from slimml.runtime import load

    torch_export = ConvertConfig(measure_latency=False, export=ExportConfig(exporter="torch"))
    if family in ("bart", "marian"):  # 3 decoder layers: each its own shard in both decoder graphs
        from transformers import AutoTokenizer, BartConfig, BartForConditionalGeneration, MarianConfig, MarianMTModel

        from slimml.convert.sources import default_model_dir

        torch.manual_seed(0)
        shape = dict(vocab_size=30522, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
                     forced_bos_token_id=None, forced_eos_token_id=None)
        model = (BartForConditionalGeneration(BartConfig(**shape)) if family == "bart" else
                 MarianMTModel(MarianConfig(**shape, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))).eval()
        model.save_pretrained(tmp_path / "src")
        tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
        tokenizer.save_pretrained(tmp_path / "src")
        report = convert(tmp_path / "src", tmp_path / "art", torch_export)
        enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
        enc.pop("token_type_ids", None)
        want = _strip(_hf_generate(model, **enc), eos=model.config.eos_token_id, pad=model.config.pad_token_id)
        assert load(tmp_path / "art").generate(PROMPTS, max_new_tokens=8).tokens == want
        from slimml.runtime import read_manifest

        manifest = read_manifest(tmp_path / "art")
        for part in ("decoder", "decoder_with_past"):
            assert [len(s.layers) for s in manifest.components[part].shards if s.layers] == [1, 1, 1]
    else:
        fixture = request.getfixturevalue(family)
        report = convert(fixture["root"] / "src", tmp_path / "art", torch_export)
        inputs = PROMPTS if family == "t5" else [speech(2.0)]
        assert (load(tmp_path / "art").generate(inputs, max_new_tokens=8).tokens
                == load(fixture["root"] / "art").generate(inputs, max_new_tokens=8).tokens)
    assert report.steps[0]["exporter"] == "torch.onnx" and report.checks["same_tokens_as_graph"]
    assert report.checks["max_abs_diff_vs_torch"] <= 1e-4


def test_forced_first_and_last_tokens_are_made_as_transformers_makes_them(tmp_path):
    """BART-large-cnn and mBART-50 force their first token (``forced_bos_token_id``: ``<s>``, the target
    language), and BART and Marian their end token where the length runs out (``forced_eos_token_id``);
    the artifact's tokens are transformers' ``generate``'s."""
    from transformers import AutoTokenizer, BartConfig, BartForConditionalGeneration

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.sources import default_model_dir
    from slimml.runtime import load

    torch.manual_seed(1)
    model = BartForConditionalGeneration(BartConfig(
        vocab_size=30522, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
        forced_bos_token_id=None, forced_eos_token_id=None)).eval()
    model.generation_config.forced_bos_token_id = 7  # where transformers 5 keeps it (4.57 reads it there too)
    model.generation_config.forced_eos_token_id = 11  # not the end id: the 8th token is 11, then nothing
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    enc.pop("token_type_ids", None)
    free = _hf_generate(model, **enc)
    # Marian's bad_words_ids ([[pad]]): a token never made, and a pair never completed
    model.generation_config.bad_words_ids = [[free[0][1]], [free[1][1], free[1][2]]]
    model.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "art", ConvertConfig(measure_latency=False))
    want = _strip(_hf_generate(model, **enc), eos=model.config.eos_token_id, pad=model.config.pad_token_id)
    got = load(tmp_path / "art").generate(PROMPTS, max_new_tokens=8).tokens
    assert got == want and all(row[0] == 7 and (len(row) < 8 or row[7] == 11) for row in got)
    assert any(len(row) == 8 for row in got)  # the forced end token was reached
    assert got[0][1] != free[0][1] and got[1][1:3] != free[1][1:3]
    encoder = load(tmp_path / "art").part("encoder")  # 130 rows, 2 before the first position: 128 tokens
    assert encoder.max_sequence_length == 128
    ids = np.full((1, 129), 5, dtype=np.int64)  # its axis is encoder_sequence_length: it went unchecked, to ORT's Gather
    with pytest.raises(FeedError, match="encoder_sequence_length=129 at dim=1, but this model takes at most 128 tokens"):
        encoder.run({"input_ids": ids, "attention_mask": np.ones_like(ids)})


def test_beam_search_makes_the_tokens_transformers_makes(tmp_path):
    """A BART whose generation config asks for beams (BART-large-cnn's settings: 4 beams, length
    penalty 2, no repeated 3-grams, a minimum length, early stopping) generates what transformers'
    ``generate`` does, under its own settings and each override; a small vocabulary so that
    hypotheses end early and are scored by their length. Token-id prompts: no tokenizer."""
    from transformers import BartConfig, BartForConditionalGeneration

    from slimml.convert import ConvertConfig, convert
    from slimml.runtime import load
    from slimml.runtime.tasks.seq2seq import generate_seq2seq
    from slimml.runtime.tasks.seq2seq_search import Search

    torch.manual_seed(3)
    vocab = 40
    model = BartForConditionalGeneration(BartConfig(
        vocab_size=vocab, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=512, init_std=0.5,
        forced_bos_token_id=None, forced_eos_token_id=None)).eval()
    g = model.generation_config
    g.num_beams, g.length_penalty, g.no_repeat_ngram_size, g.min_length, g.early_stopping, g.max_length = 4, 2.0, 3, 4, True, 16
    g.forced_bos_token_id, g.forced_eos_token_id, g.bad_words_ids = 7, 2, [[9], [31, 14]]
    model.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "art", ConvertConfig(measure_latency=False))
    art = load(tmp_path / "art")
    assert art.spec["search"] == {"max_length": 16, "min_length": 4, "num_beams": 4, "length_penalty": 2.0,
                                  "early_stopping": True, "no_repeat_ngram_size": 3}
    # format 4: a slimml that would skip the search (decode greedily) refuses the artifact instead
    raw = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert raw["format_version"] == 4 and raw["requires"] == ["seq2seq.search", "seq2seq.bad_words_ids",
                                                                 "seq2seq.forced_eos_token_id"]
    prompts = [[int(t) for t in np.random.default_rng(0).integers(3, vocab, size=n)] for n in (5, 9, 7, 3)]
    ids = torch.full((len(prompts), 9), 1)
    mask = torch.zeros((len(prompts), 9), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)], mask[i, :len(p)] = torch.tensor(p), 1

    def theirs(**kw):
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **kw).tolist()
        return _strip([row[1:] for row in out], eos=2, pad=1)

    ended = 0
    for kw in ({}, {"early_stopping": False}, {"early_stopping": "never"}, {"length_penalty": -1.0},
               {"num_beams": 3, "no_repeat_ngram_size": 0}, {"num_beams": 1}, {"max_new_tokens": 6},
               {"repetition_penalty": 1.5, "num_beams": 2}, {"renormalize_logits": True, "min_length": 8}):
        want = theirs(**kw)
        n = kw.pop("max_new_tokens", None)
        assert generate_seq2seq(art, prompts, Search.of(art.spec, n, **kw)).tokens == want, kw
        ended += sum(len(row) < 15 for row in want)
    assert ended >= 4  # hypotheses that ended before the length ran out were compared
    for beams in (1, 3):  # not emitted first: the first free position, after the forced one; a word longer than the text
        want = theirs(num_beams=beams, begin_suppress_tokens=[7, 22], bad_words_ids=[[2, 22], [9]])
        assert generate_seq2seq(art, prompts, Search.of(art.spec, num_beams=beams, begin_suppress=(7, 22),
                                                        bad_words=((2, 22), (9,)))).tokens == want
    assert art.generate(prompts).tokens == theirs()  # the public call takes the model's settings
    assert art.generate(prompts, num_beams=1, max_new_tokens=6).tokens == theirs(num_beams=1, max_new_tokens=6)
    with pytest.raises(FeedError, match="num_beams must be a whole number >= 1"):
        art.generate(prompts, num_beams=0)
    with pytest.raises(FeedError, match="max_new_tokens must be a whole number >= 1"):
        art.generate(prompts, max_new_tokens=0)
    with pytest.raises(FeedError, match="num_beams must be at most 64"):  # before, numpy ran out of memory
        art.generate(prompts, num_beams=10 ** 9)
    assert art.spec["max_positions"] == 512
    with pytest.raises(FeedError, match="runs past the decoder's 512 positions .* at most 511"):  # before, ONNX Runtime's Gather
        art.generate(prompts, max_new_tokens=600)
    assert (art.generate(prompts, num_beams=np.int64(2), length_penalty=np.float32(0.5), max_new_tokens=np.int64(5)).tokens
            == theirs(num_beams=2, length_penalty=0.5, max_new_tokens=5))  # numpy's numbers are numbers
    for kw in ({"num_beams": 4}, {"num_beams": 2, "min_length": 6}, {"num_beams": 1}):  # each of a list of end ids ends
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, eos_token_id=[2, 5], **kw).tolist()
        want = [row[1:] for row in out]
        want = [row[: min([row.index(e) + 1 for e in (2, 5) if e in row] or [len(row)])] for row in want]
        own = {**art.spec, "eos_token_id": [2, 5]}
        assert generate_seq2seq(art, prompts, Search.of(own, **kw)).tokens == want, kw


def test_generation_settings_are_read_as_transformers_reads_them(tmp_path):
    """The start token falls back to bos (then pad); a list of end ids stays a list; forced
    decoder ids mean nothing outside Whisper (transformers 4.57 ignores them there); Whisper's
    forced ids, task and ``<|notimestamps|>`` become the decoder's prompt, its language detected
    among the language ids where the config leaves it open."""
    import json

    from slimml.convert.folder_facts import seq2seq_spec

    def spec(config, gen):
        (tmp_path / "config.json").write_text(json.dumps(config))
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
        return seq2seq_spec(tmp_path)

    got = spec({"bos_token_id": 0, "pad_token_id": 1, "max_position_embeddings": 64, "model_type": "bart"},
               {"eos_token_id": [2, 5], "forced_decoder_ids": [[1, 7]]})
    assert (got["decoder_start_token_id"], got["eos_token_id"], got["forced_ids"], got["max_positions"]) == (0, [2, 5], [], 64)
    assert "max_positions" not in spec({"model_type": "t5", "n_positions": 512, "decoder_start_token_id": 0}, {})
    whisper = {"no_timestamps_token_id": 9, "lang_to_id": {"<|en|>": 5, "<|de|>": 6}, "task_to_id": {"transcribe": 7, "translate": 8},
               "decoder_start_token_id": 4, "eos_token_id": 3, "forced_decoder_ids": [[1, None], [2, 7]]}
    got = spec({"model_type": "whisper", "max_target_positions": 448}, whisper)
    assert (got["prompt_ids"], got["language_ids"], got["forced_ids"]) == ([None, 7, 9], [5, 6], [])
    # a task (or a language) named: transformers ignores the forced ids, and detects the language
    assert spec({}, {**whisper, "forced_decoder_ids": [[1, 6], [2, 7]], "task": "translate"})["prompt_ids"] == [None, 8, 9]
    assert spec({}, {**whisper, "forced_decoder_ids": None})["prompt_ids"] == [None, 9]  # no language given: detected
    # a fine-tune's config names its language and task (forced ids null): transformers reads those, not the forced ids
    got = spec({}, {**whisper, "forced_decoder_ids": [[1, 5], [2, 8]], "language": "german", "task": "transcribe"})
    assert (got["prompt_ids"], got["language_id"], got["language_ids"]) == ([None, 7, 9], 6, [5, 6])
    assert spec({}, {**whisper, "language": "<|de|>"})["language_id"] == spec({}, {**whisper, "language": "DE"})["language_id"] == 6
    got = spec({}, {**whisper, "forced_decoder_ids": None})  # no task: a named language gets transcribe, a detected one none
    assert (got["prompt_ids"], got["language_task_id"]) == ([None, 9], 7) and "language_id" not in got
    with pytest.raises(ConfigError, match=r"language 'klingon' is not one of this model's languages"):
        spec({}, {**whisper, "language": "klingon"})
    english = {**whisper, "forced_decoder_ids": [[1, 9]]}
    english.pop("lang_to_id")
    assert spec({}, english)["prompt_ids"] == [9] and "language_ids" not in spec({}, english)  # whisper-*.en
    english.pop("task_to_id")  # a task named with no task ids: nothing to put in the prompt, converted as before
    assert spec({}, {**english, "task": "transcribe", "forced_decoder_ids": None})["prompt_ids"] == [9]


def test_a_forced_token_is_made_even_where_it_is_suppressed():
    """Whisper's task token is forced and in its suppressed ids (whisper-large-v3: 50360): it is
    made (transformers puts it in the prompt); ids not emitted first are held back at the first
    position not forced."""
    from slimml.runtime.tasks.seq2seq_search import Search

    search = Search(forced={1: 5, 2: 6}, suppress=(6,), begin_suppress=(3,), eos=9, max_length=8)
    rows, scores = [[0]], np.zeros((1, 10), dtype=np.float32)
    assert search.begin == 3
    assert search.process(rows, scores, 2).argmax() == 6
    assert search.process(rows, scores, 3)[0, 3] == -np.inf and search.process(rows, scores, 4)[0, 3] == 0
    assert search.process(rows, scores, 1).argmax() == 5 and search.process(rows, scores, 1)[0, 3] == -np.inf  # forced


def test_sampling_draws_from_the_processed_scores_reproducibly(t5):
    """A temperature above 0 samples: the first token's frequencies over 400 seeds follow the
    model's softmax over its top 3 (top_k=3); a seed gives a prompt the same tokens alone or in a
    batch; temperature 0 is greedy; a model whose config samples samples by default; beams and
    sampling together are refused."""
    import dataclasses

    from slimml.runtime import load
    from slimml.runtime.tasks.seq2seq import generate_seq2seq
    from slimml.runtime.tasks.seq2seq_search import Search

    art = load(t5["root"] / "art")
    enc = t5["tokenizer"](PROMPTS[:1], return_tensors="pt")
    with torch.no_grad():
        logits = t5["torch"](input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                             decoder_input_ids=torch.zeros((1, 1), dtype=torch.long)).logits[0, -1].double()
    top = torch.topk(logits / 1.5, 3)
    want = dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))
    got = art.generate(PROMPTS[:1] * 400, max_new_tokens=1, temperature=1.5, top_k=3, seed=list(range(400))).tokens
    firsts = [row[0] for row in got]
    assert set(firsts) <= set(want)
    assert sum(abs(firsts.count(t) / 400 - p) for t, p in want.items()) / 2 < 0.08, (want, firsts)
    alone = [art.generate([p], max_new_tokens=6, temperature=0.9, seed=5).tokens[0] for p in PROMPTS]
    assert art.generate(PROMPTS, max_new_tokens=6, temperature=0.9, seed=5).tokens == alone
    assert art.generate(PROMPTS, max_new_tokens=6, temperature=0).tokens == art.generate(PROMPTS, max_new_tokens=6).tokens
    sampling = {**art.spec, "search": {"do_sample": True, "temperature": 1.3}}
    runs = {tuple(map(tuple, generate_seq2seq(art, PROMPTS, Search.of(sampling, 6, seed=s)).tokens)) for s in range(4)}
    assert len(runs) > 1  # the model's own do_sample
    assert Search.of(sampling, 6, temperature=0).sample is None and Search.of({**sampling, "search": {
        "do_sample": True, "num_beams": 4}}, 6).sample is None  # greedy asked; the model's beams keep their search
    assert dataclasses.replace(Search.of(sampling, 6), sample=None).num_beams == 1
    with pytest.raises(FeedError, match="beam sampling"):
        art.generate(PROMPTS, num_beams=2, temperature=0.7)
    with pytest.raises(FeedError, match="seed has 2 values for 3 prompts"):
        art.generate(PROMPTS, temperature=0.7, seed=[1, 2])


def test_t5_streamed_with_two_shards_resident_generates_the_same(t5):
    from slimml.runtime import load

    whole = load(t5["root"] / "art").generate(PROMPTS, max_new_tokens=6).tokens
    streamed = load(t5["root"] / "art", resident=2)
    assert all(streamed.plan[n].streaming for n in ("encoder", "decoder", "decoder_with_past"))
    assert streamed.generate(PROMPTS, max_new_tokens=6).tokens == whole


def test_one_memory_budget_is_shared_by_the_components(t5):
    """Each component got the whole budget: the encoder resident beside a slot of each decoder held
    2.2x the budget. The budget is shared out, the loaded shards together within it."""
    from slimml.errors import ConfigError
    from slimml.runtime import load
    from slimml.runtime.engine.budget import shard_bytes

    parts = load(t5["root"] / "art").manifest.components
    largest = {n: max(shard_bytes(m)) for n, m in parts.items()}
    budget = int(sum(largest.values()) * 1.3)
    model = load(t5["root"] / "art", memory_budget=budget)
    assert sum(model.plan[n].peak_bytes for n in parts) <= budget
    assert model.generate(PROMPTS, max_new_tokens=6).tokens == load(t5["root"] / "art").generate(PROMPTS, max_new_tokens=6).tokens
    with pytest.raises(ConfigError, match=r"cannot hold the largest shard of each component at once \(encoder "):
        load(t5["root"] / "art", memory_budget=max(largest.values()) + 1)


def test_a_tiny_int8_bart_generates_in_merged_sessions(tmp_path):
    """Its decoder's merged shards failed on the first step ("Shape mismatch attempting to re-use
    buffer"): each shard's shape inference names unknown dims unk__0, unk__1... afresh, and the
    merged graph read two different dims as one."""
    from transformers import AutoTokenizer, BartConfig, BartForConditionalGeneration

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.sources import default_model_dir
    from slimml.quantize import Int8Config
    from slimml.runtime import load

    torch.manual_seed(0)
    BartForConditionalGeneration(BartConfig(
        vocab_size=30522, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128, pad_token_id=0,
        bos_token_id=101, eos_token_id=102, decoder_start_token_id=102, forced_eos_token_id=102)).eval().save_pretrained(tmp_path / "src")
    AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "int8", ConvertConfig(quantize=Int8Config("cpu"), measure_latency=False))
    got = load(tmp_path / "int8").generate(["The capital", "of a country far away"], max_new_tokens=6)
    assert [len(t) for t in got.tokens] == [6, 6]


def test_t5_takes_nncf_s_int4_weights(t5):
    """NNCF wrote MatMulNBits into T5's shards without importing com.microsoft, then failed its own
    shape inference ("No opset import for domain com.microsoft")."""
    pytest.importorskip("nncf")
    from slimml.quantize import WeightOnlyConfig, quantize
    from slimml.runtime import load

    quantize(t5["root"] / "art", t5["root"] / "nncf4", WeightOnlyConfig(bits=4, backend="nncf"))
    assert [len(t) for t in load(t5["root"] / "nncf4").generate(PROMPTS[:2], max_new_tokens=4).tokens] == [4, 4]


def test_a_bart_without_a_tokenizer_quantizes_and_nncf_adds_its_logits_bias_once(tmp_path):
    """A BART folder without its tokenizer: int8 asked for a speech model's feature extractor
    ("no feature extractor config") where it had no tokenizer for calibration texts; NNCF's int4
    folded ``final_logits_bias`` into the lm_head's MatMulNBits and kept the Add (the bias twice, in
    a shape ONNX Runtime refused to load)."""
    pytest.importorskip("nncf")
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    from slimml.convert import ConvertConfig, convert
    from slimml.quantize import Int8Config, WeightOnlyConfig, quantize
    from slimml.runtime import load

    torch.manual_seed(0)
    model = BartForConditionalGeneration(BartConfig(
        vocab_size=1000, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)).eval()
    model.final_logits_bias.normal_(0, 0.2)  # as large as the logits: added twice, their cosine falls to ~0.95
    model.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "fp32", ConvertConfig(measure_latency=False))
    report = quantize(tmp_path / "fp32", tmp_path / "int8", Int8Config("cpu"))
    assert min(report.checks[f"{n}_agreement_cosine"] for n in report.components) >= 0.99
    report = quantize(tmp_path / "fp32", tmp_path / "nncf4", WeightOnlyConfig(bits=4, backend="nncf"))
    # the bias twice: 0.989 and 0.985 for the decoders; added once 0.997 and 0.999
    assert min(report.checks[f"{n}_agreement_cosine"] for n in report.components) >= 0.994, report.checks
    assert len(load(tmp_path / "nncf4").generate([[5, 6, 7]], max_new_tokens=3).tokens) == 1  # it loads and runs


def test_t5_quantizes_each_component_with_real_decoder_inputs(t5):
    from slimml.quantize import Int8Config, quantize
    from slimml.runtime import load

    report = quantize(t5["root"] / "art", t5["root"] / "int8", Int8Config("cpu"))
    assert set(report.components) == {"encoder", "decoder", "decoder_with_past"}
    assert min(report.checks[f"{n}_agreement_cosine"] for n in report.components) >= 0.99
    assert report.size_mb < report.float_size_mb / 2
    from slimml.runtime import read_manifest

    manifest = read_manifest(t5["root"] / "int8")  # the two decoders' int8 weights are stored once too
    assert {s.data for s in manifest.components["decoder_with_past"].shards if s.data} <= {
        s.data for s in manifest.components["decoder"].shards}
    fp32 = load(t5["root"] / "art").generate(PROMPTS, max_new_tokens=4).tokens
    int8 = load(t5["root"] / "int8").generate(PROMPTS, max_new_tokens=4).tokens
    agree = sum(a == b for x, y in zip(fp32, int8) for a, b in zip(x, y)) / sum(map(len, fp32))
    assert agree >= 0.75  # greedy tokens of a random tiny model under int8: most agree
    # each component is guarded on its own inputs; the whole model's generation is measured too (a random tiny
    # model's flat logits flip easily: a floor, not a claim about a real T5)
    same, _, of = report.checks["generation_same"].partition(" of ")
    assert int(of) == 8 and 0 <= int(same) <= 8 and report.checks["generation_token_agreement"] >= 0.5, report.checks
    assert manifest.checks["quantize_generation_token_agreement"] == report.checks["generation_token_agreement"]
    # calibration texts past the model's context (long documents): the measure reads their start, and the
    # quantize does not fail at its end on "prompt 0 is 702 tokens"
    long = t5["root"] / "long.txt"
    long.write_text("\n".join(f"document {i} " + "the man plays a guitar in the park " * 90 for i in range(48)))
    report = quantize(t5["root"] / "art", t5["root"] / "int8-long", Int8Config("cpu", calibration=long))
    assert " of 8" in report.checks["generation_same"], report.checks


def test_slimml_generate_and_info_on_t5(t5):
    from slimml.runtime import load

    art = t5["root"] / "art"
    result = slimml("generate", art, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", "4", "--json")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["tokens"]) == 2
    beams = slimml("generate", art, PROMPTS[0], "--num-beams", "3", "--max-new-tokens", "4", "--json")
    assert beams.returncode == 0, beams.stderr
    assert json.loads(beams.stdout)["tokens"] == load(art).generate(PROMPTS[:1], max_new_tokens=4, num_beams=3).tokens
    sampled = slimml("generate", art, PROMPTS[0], "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--max-new-tokens",
                     "4", "--json")
    assert sampled.returncode == 0, sampled.stderr
    assert json.loads(sampled.stdout)["tokens"] == load(art).generate(PROMPTS[:1], max_new_tokens=4, temperature=0.8, top_p=0.9,
                                                                        seed=3).tokens
    off = slimml("generate", art, PROMPTS[0], "--temperature", "0.8", "--top-k", "0", "--seed", "3", "--max-new-tokens", "4",
                 "--json")  # 0 turns the model's own top-k off (it kept the model's 50)
    assert off.returncode == 0 and json.loads(off.stdout)["tokens"] == load(art).generate(
        PROMPTS[:1], max_new_tokens=4, temperature=0.8, top_k=0, seed=3).tokens, off.stderr
    refused = slimml("generate", art, PROMPTS[0], "--stop", "x")
    assert refused.returncode == 1 and "drop --repetition-penalty" in refused.stderr
    for flag in (["--truncate"], ["--prompt-lookup", "4"]):  # a decoder's: they were taken and did nothing
        refused = slimml("generate", art, PROMPTS[0], *flag)
        assert refused.returncode == 1 and flag[0] in refused.stderr.split("drop ")[-1], refused.stderr
    info = slimml("info", art)
    assert "components: encoder (" in info.stdout and "decoder_with_past (" in info.stdout
    bad = slimml("run", art, "--audio", t5["root"] / "nothing.wav")
    assert bad.returncode == 1 and "is not a speech model" in bad.stderr
    bench = slimml("bench", art, "--runs", "2", "--seq", "8", "--json")  # each component timed on its own inputs
    assert bench.returncode == 0, bench.stderr
    assert set(json.loads(bench.stdout)) == {"encoder", "decoder", "decoder_with_past"}
    one = slimml("bench", art, "--runs", "2", "--seq", "8", "--component", "decoder_with_past", "--json")
    assert one.returncode == 0 and json.loads(one.stdout)["latency_ms"]["p50"] > 0


# -- Whisper -------------------------------------------------------------------------------------

@pytest.mark.parametrize("seconds", [0.3, 2.0, 30.0, 31.5])
def test_log_mel_features_match_the_whisper_feature_extractor(seconds):
    from transformers import WhisperFeatureExtractor

    from slimml.runtime.tasks.inputs.audio import LogMel

    hf = WhisperFeatureExtractor(feature_size=80)
    ours = LogMel(hf.to_dict())
    audio = speech(seconds, seed=int(seconds * 10))
    want = hf(audio, sampling_rate=16000, return_tensors="np")["input_features"][0]
    np.testing.assert_allclose(ours(audio), want, atol=1e-4, rtol=0)


def test_whisper_transcribes_a_wav_file_as_hugging_face_generates(whisper):
    from slimml.runtime import load
    from slimml.runtime.tasks.inputs.audio import read_wav

    checks = whisper["report"].checks
    assert checks["max_abs_diff"] <= 1e-5 and checks["max_abs_diff_vs_torch"] <= 1e-4
    model = load(whisper["root"] / "art")
    assert model.manifest.task == "automatic-speech-recognition" and model.manifest.preprocessor["kind"] == "audio"
    wav = whisper["root"] / "speech.wav"
    features = whisper["extractor"](read_wav(wav), sampling_rate=16000, return_tensors="pt").input_features
    want = _strip(_hf_generate(whisper["torch"], input_features=features), eos=102, pad=0)
    result = model.generate([str(wav)], max_new_tokens=8)
    assert result.tokens == want and isinstance(result.texts[0], str)
    streamed = load(whisper["root"] / "art", resident=2)
    assert streamed.generate([str(wav)], max_new_tokens=8).tokens == want


WHISPER_LANGUAGES = {"<|en|>": 1000, "<|de|>": 1004, "<|fr|>": 1005}


def _multilingual_whisper(whisper, tmp_path, settings: dict, language_tokens: bool = False):
    """The tiny Whisper made multilingual (language ids, tasks, ``<|notimestamps|>``, then
    ``settings``), as torch and as a converted artifact, with the test recording's features; with
    ``language_tokens``, its tokenizer names the language ids ``<|en|>``, ``<|de|>``, ``<|fr|>``."""
    from transformers import WhisperForConditionalGeneration

    from slimml.convert import ConvertConfig, convert
    from slimml.runtime import load
    from slimml.runtime.tasks.inputs.audio import read_wav

    src = tmp_path / "src"
    shutil.copytree(whisper["root"] / "src", src)
    gen = json.loads((src / "generation_config.json").read_text())
    gen.update({"no_timestamps_token_id": 1003, "lang_to_id": WHISPER_LANGUAGES,
                "task_to_id": {"transcribe": 1001, "translate": 1002}, "is_multilingual": True,
                "_from_model_config": False, **settings})  # else transformers reads the model config's instead
    (src / "generation_config.json").write_text(json.dumps(gen))
    if language_tokens:
        tok = json.loads((src / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        for token, i in WHISPER_LANGUAGES.items():
            vocab.pop(next(k for k, v in vocab.items() if v == i))
            vocab[token] = i
        (src / "tokenizer.json").write_text(json.dumps(tok))
    model = WhisperForConditionalGeneration.from_pretrained(src).eval()
    convert(src, tmp_path / "art", ConvertConfig(measure_latency=False))
    wav = whisper["root"] / "speech.wav"
    features = whisper["extractor"](read_wav(wav), sampling_rate=16000, return_tensors="pt").input_features
    return model, load(tmp_path / "art"), features, wav


@pytest.mark.parametrize("forced", [[[1, None], [2, 1001]], [[1, 1000], [2, 1001]]], ids=["detected", "fixed"])
def test_whisper_with_its_prompt_transcribes_as_whisper_s_generate(whisper, tmp_path, forced):
    """A multilingual Whisper's generation config (language ids, tasks, ``<|notimestamps|>``, ids
    not emitted first): the artifact makes the text tokens Whisper's own ``generate`` makes, its
    prompt (start, language, task, no-timestamps) not counted in ``max_new_tokens``, the language
    detected as Whisper detects it where the config leaves it open."""
    model, art, features, wav = _multilingual_whisper(whisper, tmp_path, {"begin_suppress_tokens": [2000, 102],
                                                                         "suppress_tokens": [2001, 2002],
                                                                         "forced_decoder_ids": forced})
    with torch.no_grad():
        want = model.generate(features, max_new_tokens=6).tolist()
    got = art.generate([str(wav)], max_new_tokens=6).tokens
    assert got == _strip(want, eos=102, pad=0) and len(got[0]) == 6


@pytest.mark.parametrize("settings", [{"forced_decoder_ids": None, "language": "french", "task": "transcribe"},
                                      {"forced_decoder_ids": None, "language": "de"},
                                      {"forced_decoder_ids": [[1, None], [2, 1002]]}], ids=["language-and-task", "language",
                                                                                           "forced-translate"])
def test_whisper_fine_tuned_in_a_language_transcribes_in_it_as_whisper_s_generate(whisper, tmp_path, settings):
    """A fine-tune saved by transformers' recipe names its language in generation_config.json
    (``language="german"``, forced ids null): slimml detected the language instead (a German model
    transcribing as English); a language named with no task gets transcribe, as transformers gives it."""
    model, art, features, wav = _multilingual_whisper(whisper, tmp_path, settings, language_tokens=True)
    with torch.no_grad():
        want = model.generate(features, max_new_tokens=6).tolist()
    assert art.generate([str(wav)], max_new_tokens=6).tokens == _strip(want, eos=102, pad=0)
    with torch.no_grad():  # the caller's language over the config's, as transformers takes it
        want = model.generate(features, max_new_tokens=6, language="fr").tolist()
    assert art.generate([str(wav)], max_new_tokens=6, language="fr").tokens == _strip(want, eos=102, pad=0)
    from slimml.runtime.tasks.seq2seq import record_feeds  # quantize's calibration: the decoders fed the same prompt

    if "language" in settings:  # (forced translate, no language named: detected, then translate)
        first = record_feeds(art, [{"input_features": features.numpy()}])["decoder"][0]["input_ids"]
        assert first.tolist()[0][1:] == [WHISPER_LANGUAGES[f"<|{settings['language'][:2]}|>"], 1001, 1003]


def test_whisper_transcribes_in_the_language_asked_as_whisper_s_generate(whisper, tmp_path):
    """``generate(language="de")`` puts ``<|de|>`` where the config leaves the language open, as
    Whisper's ``generate(language="de")`` does; a code the model does not know, or a language asked
    of a model that has none to choose, is one line."""
    from slimml.runtime import load

    model, art, features, wav = _multilingual_whisper(whisper, tmp_path, {"forced_decoder_ids": [[1, None], [2, 1001]]},
                                                      language_tokens=True)
    _, no_task, _, _ = _multilingual_whisper(whisper, tmp_path / "no-task", {"forced_decoder_ids": None}, language_tokens=True)
    for language in ("de", "fr"):
        with torch.no_grad():  # a config without a task: the language named gets transcribe, as transformers gives it
            assert no_task.generate([str(wav)], max_new_tokens=6, language=language).tokens == _strip(
                model.generate(features, max_new_tokens=6, language=language).tolist(), eos=102, pad=0)
        with torch.no_grad():
            want = model.generate(features, max_new_tokens=6, language=language).tolist()
        assert art.generate([str(wav)], max_new_tokens=6, language=language).tokens == _strip(want, eos=102, pad=0)
    with pytest.raises(FeedError, match='language "xx" is not one this model knows; give an ISO 639-1 code'):
        art.generate([str(wav)], language="xx")
    with pytest.raises(FeedError, match="language is not chosen at run time"):
        load(whisper["root"] / "art").generate([str(wav)], language="de")
    result = slimml("run", tmp_path / "art", "--audio", wav, "--language", "de", "--max-new-tokens", "6", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[0]["tokens"] == art.generate([str(wav)], max_new_tokens=6, language="de").tokens[0]
    result = slimml("run", tmp_path / "art", "hello", "--language", "de")
    assert result.returncode != 0 and "--language is the language of --audio recordings" in result.stderr
    for given in (["hello"], ["--image", wav]):  # it said "has no tokenizer" and "it takes arrays: give --input FILE.npz"
        result = slimml("run", tmp_path / "art", *given)
        assert result.returncode == 1 and "is a speech model: it transcribes recordings; give --audio FILE.wav" in result.stderr
    np.savez(tmp_path / "features.npz", input_features=features.numpy())  # arrays still run (the encoder's outputs)
    result = slimml("run", tmp_path / "art", "--input", tmp_path / "features.npz")
    assert result.returncode == 0 and "last_hidden_state" in result.stdout, result.stderr


def test_a_recording_longer_than_the_window_is_transcribed_in_overlapping_windows(whisper):
    """Audio past Whisper's 30 s window was cut there, silently; then refused. Now it is read as
    transformers' pipeline reads it with chunk_length_s=30: windows that overlap by 10 s, their
    transcripts joined where they agree."""
    from transformers.models.whisper.tokenization_whisper import _find_longest_common_sequence
    from transformers.pipelines.automatic_speech_recognition import chunk_iter

    from slimml.runtime import load
    from slimml.runtime.tasks.inputs.audio import read_wav, wav_from_bytes
    from slimml.runtime.tasks.long_form import merge_overlaps, windows

    class Sizes:  # chunk_iter's feature extractor, reduced to what the cut needs
        sampling_rate = 16000

        def __call__(self, chunk, **_):
            return {}

    for n in (1, 480_000, 480_001, 800_000, 800_001, 1_040_000, 1_123_456):
        want = [item["stride"][0] for item in chunk_iter(np.zeros(n), Sizes(), 480_000, 80_000, 80_000)]
        assert [w.size for w in windows(np.zeros(n), 480_000)] == want, n
    rng = np.random.default_rng(0)
    for trial in range(200):  # overlapping pieces of one sequence, some tokens changed: joined as transformers joins them
        text, pieces, at = rng.integers(0, 12 if trial % 2 else 500, size=int(rng.integers(0, 60))).tolist(), [], 0
        while at < len(text) or not pieces:
            n = int(rng.integers(1, 25))
            pieces.append([t if rng.random() > 0.1 else int(rng.integers(0, 500)) for t in text[at:at + n]])
            at += max(1, n - int(rng.integers(0, 8)))
        assert merge_overlaps(pieces) == list(_find_longest_common_sequence(pieces)), pieces

    model = load(whisper["root"] / "art")
    long = speech(65.0, seed=3)
    got = model.generate([speech(1.0), long], max_new_tokens=8)
    assert got.tokens[0] == model.generate([speech(1.0)], max_new_tokens=8).tokens[0]  # within the window: as before
    each = model.generate(windows(long, 480_000), max_new_tokens=8)  # the three windows alone
    special = {0, 100, 101, 102, 103}  # MiniLM's [PAD], [UNK], [CLS], [SEP], [MASK]
    assert len(each.tokens) == 3 and got.tokens[1] == merge_overlaps([[t for t in w if t not in special] for w in each.tokens])
    assert got.texts[1] == model.detokenizer.decode(got.tokens[1])
    assert got.finish_reasons == each.finish_reasons[:1] + ["length" if "length" in each.finish_reasons else "stop"]
    model.limits.max_batch_tokens = 1_500  # one window's encoder positions: the windows decoded one at a time
    try:
        assert model.generate([speech(1.0), long], max_new_tokens=8).tokens == got.tokens
    finally:
        model.limits.max_batch_tokens = None
    stop = threading.Event()
    stop.set()  # a client gone: nothing more is decoded (the server sets it at a timeout or a disconnect)
    assert model.generate([long], max_new_tokens=8, cancel=stop).finish_reasons == ["cancelled"]
    with pytest.raises(FeedError, match=r"audio 1 is 31.500 s, longer than the 30 s this model reads in one window"):
        model.features([speech(1.0), speech(31.5)])  # the encoder's features alone: one window each
    wav = whisper["root"] / "speech.wav"
    np.testing.assert_array_equal(wav_from_bytes(wav.read_bytes(), "speech.wav"), read_wav(wav))
    with pytest.raises(FeedError, match=r"^up.wav is not a PCM WAV file slimml can read .*ffmpeg -i up.wav"):
        wav_from_bytes(b"RIFF1234WAVEjunk", "up.wav")
    wide = bytearray(wav.read_bytes())  # its header says 64-bit samples: they were read as 32-bit ones
    wide[32:36] = (8).to_bytes(2, "little") + (64).to_bytes(2, "little")  # block align, bits per sample
    with pytest.raises(FeedError, match=r"has 64-bit PCM samples, which slimml does not read \(8, 16, 24 or 32-bit PCM, or "
                                        r"32 or 64-bit float\)"):
        wav_from_bytes(bytes(wide), "wide.wav")
    # WAVE_FORMAT_EXTENSIBLE (ffmpeg's header for 24-bit and multichannel PCM) and 32-bit float: were refused
    # ("unknown format: 65534"); read as the plain PCM they hold
    audio = speech(0.5)
    pcm = np.round(audio * 32767).astype("<i2")
    fmt = (0xFFFE).to_bytes(2, "little") + (1).to_bytes(2, "little") + (16000).to_bytes(4, "little") + \
        (32000).to_bytes(4, "little") + (2).to_bytes(2, "little") + (16).to_bytes(2, "little") + (22).to_bytes(2, "little") + \
        (16).to_bytes(2, "little") + (4).to_bytes(4, "little") + bytes.fromhex("0100000000001000800000aa00389b71")
    body = b"WAVE" + b"fmt " + len(fmt).to_bytes(4, "little") + fmt + b"data" + (pcm.nbytes).to_bytes(4, "little") + pcm.tobytes()
    np.testing.assert_allclose(wav_from_bytes(b"RIFF" + len(body).to_bytes(4, "little") + body, "ext.wav"), audio, atol=1e-4)
    fmt = (3).to_bytes(2, "little") + (1).to_bytes(2, "little") + (16000).to_bytes(4, "little") + (64000).to_bytes(4, "little") + \
        (4).to_bytes(2, "little") + (32).to_bytes(2, "little")
    floats = audio.astype("<f4")
    body = b"WAVE" + b"fmt " + len(fmt).to_bytes(4, "little") + fmt + b"LIST" + (3).to_bytes(4, "little") + b"abc\0" + \
        b"data" + (floats.nbytes).to_bytes(4, "little") + floats.tobytes()  # an odd chunk before the data: padded
    np.testing.assert_array_equal(wav_from_bytes(b"RIFF" + len(body).to_bytes(4, "little") + body, "f32.wav"), floats)
    unpadded = body.replace(b"abc\0", b"abc")  # an odd chunk its writer did not pad: the next id starts at once
    np.testing.assert_array_equal(wav_from_bytes(b"RIFF" + len(unpadded).to_bytes(4, "little") + unpadded, "odd.wav"), floats)
    streamed = body.replace(b"data" + (floats.nbytes).to_bytes(4, "little"), b"data" + bytes(4))  # size left 0: to the end
    np.testing.assert_array_equal(wav_from_bytes(b"RIFF" + bytes(4) + streamed, "stream.wav"), floats)
    aligned = bytearray(wav.read_bytes())  # 16-bit mono whose header says 8-byte frames: read as it says, it was noise
    aligned[32:34] = (8).to_bytes(2, "little")
    with pytest.raises(FeedError, match=r"header says frames of 8 bytes, but 1 channel\(s\) of 16-bit samples make 2"):
        wav_from_bytes(bytes(aligned), "aligned.wav")
    with pytest.raises(FeedError, match=r"^the upload is not a PCM WAV file"):  # a client's long name is not quoted back
        wav_from_bytes(b"junk", "x" * 1000)


def test_whisper_quantizes_within_tolerance(whisper):
    from slimml.quantize import Int8Config, quantize

    report = quantize(whisper["root"] / "art", whisper["root"] / "int8", Int8Config("cpu"))
    assert min(report.checks[f"{n}_agreement_cosine"] for n in report.components) >= 0.99
    assert "generation_same" not in report.checks  # no held-out audio to generate from
    # a folder of the user's recordings: calibrated on them, and transcripts compared on the held-out fifth
    # (--calibration took text files only; the guard compared components on generated features)
    folder = whisper["root"] / "recordings"
    folder.mkdir(exist_ok=True)
    for i in range(10):
        write_wav(folder / f"{i}.wav", speech(0.5 + 0.25 * i, seed=i))
    report = quantize(whisper["root"] / "art", whisper["root"] / "int8-rec", Int8Config("cpu", calibration=folder))
    assert report.checks["generation_same"] == "2 of 2" and report.checks["generation_token_agreement"] >= 0.5
    from slimml.runtime import read_manifest

    assert read_manifest(whisper["root"] / "int8-rec").steps[-1]["calibration"] == f"{folder} (10 recordings)"
    from slimml.quantize.api import _recording_batches
    from slimml.runtime import load
    from slimml.runtime.tasks.seq2seq import record_feeds

    model = load(whisper["root"] / "art")
    wav = str(folder / "0.wav")  # only the batches kept are read (a folder of long recordings was read whole)
    batches = _recording_batches(model, [wav, wav] + [str(folder / "missing.wav")] * 10, batch_size=2, limit=1)
    assert len(batches) == 1
    first = record_feeds(model, batches)["decoder"][0]["input_ids"]  # the decoders see generate's prompt, not the start alone
    assert first.shape[1] == 1 + len(model.spec.get("prompt_ids") or ())
    result = slimml("run", whisper["root"] / "int8", "--audio", whisper["root"] / "speech.wav", "--max-new-tokens", "4", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[0]["input"].endswith("speech.wav")


def test_wav_files_are_read_or_refused_with_the_fix(whisper, tmp_path):
    from slimml.runtime import load
    from slimml.runtime.tasks.inputs.audio import read_wav

    audio = speech(0.5)
    for width in (1, 2, 3):
        write_wav(tmp_path / f"w{width}.wav", audio, width=width)
        np.testing.assert_allclose(read_wav(tmp_path / f"w{width}.wav"), audio, atol=2.0 / 2 ** (8 * width - 1) + 1e-4)
    write_wav(tmp_path / "stereo.wav", audio, channels=2)
    np.testing.assert_allclose(read_wav(tmp_path / "stereo.wav"), audio, atol=1e-4)
    write_wav(tmp_path / "44k.wav", audio, rate=44100)
    good = (tmp_path / "w2.wav").read_bytes()
    (tmp_path / "cut.wav").write_bytes(good[: len(good) // 2])
    (tmp_path / "text.wav").write_text("not audio")
    model = load(whisper["root"] / "art")
    cases = [("44k.wav", "sampled at 44100 Hz but the model takes 16000 Hz; resample it first"),
             ("cut.wav", "is truncated"), ("text.wav", "is not a PCM WAV file"), ("missing.wav", "does not exist")]
    for name, message in cases:
        with pytest.raises(FeedError, match=message):
            model.generate([str(tmp_path / name)])
        result = slimml("run", whisper["root"] / "art", "--audio", tmp_path / name)
        assert result.returncode == 1 and message.split(";")[0][:20] in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    with pytest.raises(FeedError, match="1-D float waveform"):
        model.generate([np.zeros((2, 2), np.float32)])


def test_a_whisper_artifact_without_its_feature_extractor_says_so(whisper, tmp_path):
    from slimml.runtime import load

    shutil.copytree(whisper["root"] / "art", tmp_path / "art")
    path = tmp_path / "art" / "manifest.json"
    raw = json.loads(path.read_text())
    raw.pop("preprocessor")
    path.write_text(json.dumps(raw))
    with pytest.raises(FeedError, match="has no feature extractor config"):
        load(tmp_path / "art").generate([str(whisper["root"] / "speech.wav")])


def test_a_non_seq2seq_artifact_of_components_does_not_generate(tmp_path):
    from slimml.runtime.tasks.generic import Components
    from slimml.runtime.artifact.manifest import Manifest

    manifest = Manifest(name="x", task="feature-extraction", source={}, steps=[], inputs=[], outputs=[], shards=[], files=[])
    with pytest.raises(SlimmlError, match="cannot generate"):
        Components(tmp_path, manifest, {"a": type("P", (), {"device": "cpu"})()}).generate(["hi"])


def test_encoder_decoders_generate_without_torch_or_transformers(t5, whisper):
    counts = run_without_torch([
        f"print(len(load({str(t5['root'] / 'art')!r}).generate(['hello there'], max_new_tokens=3).tokens[0]))",
        f"print(len(load({str(whisper['root'] / 'art')!r}).generate([{str(whisper['root'] / 'speech.wav')!r}], max_new_tokens=3).tokens[0]))",
    ])
    assert len(counts) == 2 and all(1 <= int(n) <= 3 for n in counts)


def test_serving_an_encoder_decoder_under_a_budget_too_small_is_refused_before_ray_starts(t5):
    """A components artifact's --memory-budget was checked only in each replica, after Ray and Serve had
    started (the server then failed in Serve's words)."""
    pytest.importorskip("ray")
    import ray

    from slimml.errors import ConfigError
    from slimml.serve import ServeConfig, serve

    with pytest.raises(ConfigError, match=r"^the encoder component: memory budget 100.00 KB is smaller than shard 0"):
        serve(ServeConfig(str(t5["root"] / "art"), memory_budget="100KB"))
    assert not ray.is_initialized()
