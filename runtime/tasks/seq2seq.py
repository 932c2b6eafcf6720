"""Generation for encoder-decoder artifacts (T5, BART, Marian, Whisper): three components.

- ``encoder`` runs once over the prompt (token ids, or Whisper's log-mel features);
- ``decoder`` runs the first step: from the start token, it computes the logits, the decoder's
  self-attention keys/values and, once for the whole generation, the cross-attention
  keys/values over the encoder's output (``present.N.encoder.*``);
- ``decoder_with_past`` runs every later step on one new token, with the self-attention cache
  (``past_key_values.N.decoder.*``, growing) and the cross-attention cache (fixed) fed back.

Each is a chain of layer shards, so the caches enter and leave beside the layer that owns them,
and a streamed decoder loads each of its shards once per token.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from slimml.errors import ConfigError, FeedError
from slimml.runtime.artifact.files import safe_path
from slimml.runtime.artifact.manifest import Manifest
from slimml.runtime.tasks.base import Task, register_task, text_encoder
from slimml.runtime.tasks.generate import Generation
from slimml.runtime.tasks.inputs.audio import LogMel, features_for, read_audio
from slimml.runtime.tasks.inputs.text import listed
from slimml.runtime.tasks.limits import shown
from slimml.runtime.tasks.long_form import merge_overlaps, windows
from slimml.runtime.tasks.seq2seq_search import DECODER, ENCODER, Decoder, Search, beam_search, greedy

if TYPE_CHECKING:
    from slimml.runtime.engine.engine import Engine


@register_task("text2text-generation")
class Seq2Seq(Task):
    """An encoder-decoder artifact (T5, BART; Whisper from audio): :meth:`generate`.

    ``parts`` holds the ``encoder``, ``decoder`` and ``decoder_with_past`` engines; ``text`` is the
    encoder's tokenizer (None for a speech model), ``detokenizer`` what turns new ids into text.
    """

    methods = frozenset({"generate"})
    suggest = ("generate",)

    def __init__(self, folder: Path, manifest: Manifest, engines: Mapping[str | None, Engine]):
        super().__init__(folder, manifest, engines)
        self.spec: dict[str, Any] = dict(manifest.seq2seq or {})
        self.text = text_encoder(self.folder, manifest.component(ENCODER), self.limits)
        out = self.text or text_encoder(self.folder, manifest.component(DECODER), self.limits)
        self.detokenizer = out.tokenizer if out is not None else None
        self.speech = "input_features" in {t.name for t in self.parts[ENCODER].inputs}
        pre = manifest.preprocessor
        # read here, with the files load just hashed: one read later could take a file swapped since
        self._log_mel: LogMel | None = (LogMel.from_file(safe_path(self.folder, pre["file"]))
                                        if self.speech and pre else None)

    @property
    def sampling_rate(self) -> int | None:
        """The audio rate a speech model takes (Hz), from its feature extractor; None for a text model."""
        return self._log_mel.sampling_rate if self._log_mel is not None else None

    @property
    def window_samples(self) -> int | None:
        """The samples one window of a speech model reads (Whisper: 30 s); None for a text model."""
        return self._log_mel.n_samples if self._log_mel is not None else None

    @property
    def accepts(self) -> frozenset[str]:
        return frozenset({"audio"}) if self.speech else super().accepts

    def generate(self, prompts: Any, max_new_tokens: int | None = None, num_beams: int | None = None,
                 length_penalty: float | None = None, no_repeat_ngram_size: int | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: Any = None, do_sample: bool | None = None, language: str | None = None,
                 cancel: threading.Event | None = None, **unknown: Any):
        """Generation from texts (T5, BART, Marian) or, for a speech model, WAV paths or 16 kHz
        waveforms of any length (past the model's 30 s window, read in overlapping windows whose
        transcripts are joined, as transformers' pipeline with ``chunk_length_s=30``; its tokens are
        then the joined text tokens, and ``max_new_tokens`` counts per window), as the model's
        generation config says (greedy, sampling, or beam search with its
        length penalty and no-repeat n-grams; a None argument keeps the model's own). A multilingual
        speech model detects each recording's language unless ``language`` (an ISO 639-1 code: "en",
        "fr") names it, as Whisper's ``generate(language=...)`` does. Without
        ``max_new_tokens`` the model's ``max_length`` applies, else 32 new tokens. A temperature
        above 0 samples (with the model's top-k and top-p, else transformers' 50 and 1.0), 0 is
        greedy; ``seed`` (an int, or one per prompt) gives each prompt the same tokens again.
        ``cancel`` (a ``threading.Event``, set from another thread) stops decoding before the next
        pass; what was made so far comes back with the finish reason ``"cancelled"``.

        Args:
            prompts: a non-empty list of texts or token id lists; for a speech model, WAV paths or
                16 kHz float waveforms.
            max_new_tokens: new tokens a prompt (a window, for long audio) at most.
            num_beams: beams of a beam search (1: greedy or sampled).
            length_penalty, no_repeat_ngram_size: the beam search's, as transformers reads them.
            temperature: above 0 samples, 0 is greedy.
            top_k, top_p: the sampler's cut-offs.
            seed: an int, or one per prompt; None draws fresh seeds.
            do_sample: as transformers reads it (False: greedy whatever the temperature).
            language: a speech model's language, an ISO 639-1 code ("en"); None detects it.
            cancel: a ``threading.Event``; set, it stops decoding before the next pass.

        Returns:
            A :class:`~slimml.runtime.tasks.generate.Generation`: per prompt, ``tokens``,
            ``texts`` (None for id prompts) and ``finish_reasons``.

        Raises:
            ConfigError: an option only a decoder takes (``stop``, ``config``, penalties), a
                sampling setting out of range (``temperature``, ``top_k``, ``top_p``), or
                ``language`` for a text model.
            FeedError: not a non-empty list of prompts, ``max_new_tokens`` below 1 or past the
                decoder's positions, seeds that do not match the prompts, or a language the model
                does not know.

        Example:
            >>> load("artifacts/t5-small").generate(["translate English to German: Hello"]).texts
            >>> load("artifacts/bart-large-cnn").generate([article], num_beams=1)  # greedy, not its 4 beams
            >>> load("artifacts/t5-small").generate(prompts, temperature=0.7, top_p=0.9, seed=0)
        """
        if unknown:  # a decoder's options (penalties, stop strings, config=): one line, not Python's TypeError
            raise ConfigError(
                f"an encoder-decoder's generate() takes no {', '.join(sorted(unknown))}; its options are max_new_tokens, "
                "num_beams, length_penalty, no_repeat_ngram_size, temperature, top_k, top_p, seed, do_sample and, for "
                "a speech model, language (penalties, stop strings, logit bias and a GenerationConfig are a decoder's)."
            )
        language = None if language is None else self.language_id(language)
        search = Search.of(with_language(self.spec, language), max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=seed, do_sample=do_sample, num_beams=num_beams, length_penalty=length_penalty,
                           no_repeat_ngram_size=no_repeat_ngram_size)  # its lengths count the prompt a named language makes
        return generate_seq2seq(self, prompts, search, language, cancel)

    def language_id(self, language: str) -> int:
        """The token id of a multilingual speech model's ``<|xx|>`` for the ISO 639-1 code ``language``.

        Raises:
            ConfigError: not a speech model.
            FeedError: a model whose language is not chosen at run time, or a code it does not know.
        """
        if not self.speech:
            raise ConfigError("language is for speech models (Whisper); a text model's prompt says what language it "
                              "wants: leave language out.")
        ids = set(self.spec.get("language_ids") or ())
        if not ids:
            raise FeedError("this speech model's language is not chosen at run time (an English-only model, or one "
                            "converted with its language fixed); leave language out.")
        code = language.strip().lower() if isinstance(language, str) else None
        found = self.detokenizer.token_to_id(f"<|{code}|>") if code and self.detokenizer is not None else None
        if found is None or found not in ids:
            raise FeedError(f'language {shown(language)} is not one this model knows; give an ISO 639-1 code such as "en", '
                            '"fr" or "de".')
        return found

    def features(self, audio: Any) -> dict[str, np.ndarray]:
        """The encoder's log-mel feeds for WAV paths or 16 kHz float waveforms (speech models)."""
        if self._log_mel is None:  # no preprocessor_config.json (or not a speech model)
            raise FeedError(
                f"the artifact {self.folder} has no feature extractor config (preprocessor_config.json); convert from a "
                "folder that has one, or call run() with input_features."
            )
        name = next((t.name for t in self.parts[ENCODER].inputs), "input_features")
        return features_for(self._log_mel, name, audio)


WINDOWS_A_PASS = 8  # windows of recordings decoded together at most (each row holds its own cross-attention cache)


def generate_seq2seq(model: Seq2Seq, prompts: Any, search: Search, language: int | None = None,
                     cancel: threading.Event | None = None) -> Generation:
    """Generation from texts (T5, BART) or, for speech models, audio (in ``language``, a language
    token id, where given); ``cancel``, once set, stops it before the next pass."""
    t0 = time.perf_counter()
    if model.speech:
        return _transcribe(model, prompts, search, language, t0, cancel)
    prompts = listed(prompts)
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise FeedError("generate() takes a non-empty list of prompts; wrap a single prompt as [prompt].")
    texts = all(isinstance(p, str) for p in prompts)
    if texts:
        feeds = _uncut_feeds(model, list(prompts))
    else:
        ids = [_token_ids(p, i) for i, p in enumerate(prompts)]
        if any(not p for p in ids):
            raise FeedError("generate() needs non-empty prompts.")
        width = max(map(len, ids))
        feeds = {"input_ids": np.full((len(ids), width), int(model.spec.get("pad_token_id") or 0), np.int64),
                 "attention_mask": np.zeros((len(ids), width), np.int64)}
        for i, p in enumerate(ids):
            feeds["input_ids"][i, :len(p)], feeds["attention_mask"][i, :len(p)] = p, 1
    feeds = {k: v for k, v in feeds.items() if k in {t.name for t in model.parts[ENCODER].inputs}}
    rows, width = next(iter(feeds.values())).shape[:2]  # padded to the longest: what the passes hold
    model.limits.check_encoded(rows, width, search.num_beams, context=model.text.max_length if model.text else None)
    _check_seeds(search, rows, "prompts")
    new, passes, prefill, cut = _decode(model, feeds, search, language, t0, cancel)
    tok = model.detokenizer
    out_texts = [tok.decode(t, skip_special_tokens=True) for t in new] if texts and tok is not None else None
    return Generation(tokens=new, texts=out_texts, seconds=time.perf_counter() - t0, passes=passes,
                      prompt_tokens=int(feeds["attention_mask"].sum()) if "attention_mask" in feeds else 0,
                      prefill_s=prefill, finish_reasons=[_finish(t, search, cut) for t in new])


def _check_seeds(search: Search, rows: int, what: str) -> None:
    seeds = search.sample.seed if search.sample is not None else None
    if isinstance(seeds, tuple) and len(seeds) != rows:
        raise FeedError(f"seed has {len(seeds)} values for {rows} {what}; give one seed per prompt, or one int for all.")


def _finish(tokens: list[int], search: Search, cut: bool = False) -> str:
    """``stop`` for an answer that made an end id, else ``cancelled`` where ``cut`` short, else ``length``."""
    if tokens and tokens[-1] in set(search.eos):
        return "stop"
    return "cancelled" if cut else "length"


class _Cancelled(Exception):
    """``cancel`` was set: the decoding loop stops before its next pass."""


def _decode(model: Seq2Seq, feeds: dict[str, np.ndarray], search: Search, language: int | None,
            t0: float, cancel: threading.Event | None = None) -> tuple[list[list[int]], int, float, bool]:
    """The new tokens of each row of the encoder's ``feeds``, the decoder passes run, the time to
    the first one's end, and whether ``cancel`` cut it short."""
    batch = next(iter(feeds.values())).shape[0]
    inputs = {name: {t.name for t in p.inputs} for name, p in model.parts.items()}
    passes, prefill = 0, 0.0

    def counted(name, f):
        nonlocal passes, prefill
        if cancel is not None and cancel.is_set():
            raise _Cancelled
        if name == ENCODER:  # the caller's ids or features: checked
            return model.parts[name].run(f)
        out = model.parts[name].run_trusted(f)  # feeds this loop built: the engine's own outputs and chosen ids
        passes += 1
        prefill = prefill or time.perf_counter() - t0
        return out

    new: list[list[int]] = [[] for _ in range(batch)]
    cut = False
    try:
        decoder = Decoder(counted, inputs, feeds, repeat=search.num_beams)
        start = start_tokens(decoder, model.spec, batch, search.num_beams, language)
        if search.num_beams > 1:
            new, _ = beam_search(decoder, start, search)
        else:
            done = np.zeros(batch, dtype=bool)
            for nxt in greedy(decoder, start, search, pad=int(model.spec.get("pad_token_id") or 0)):
                for i in np.flatnonzero(~done):
                    new[i].append(int(nxt[i]))
                done |= np.isin(nxt, search.eos)
    except _Cancelled:  # greedy's tokens so far are kept; beam search's best are not known before its end
        cut = True
    return new, passes, prefill, cut


def _transcribe(model: Seq2Seq, audio: Any, search: Search, language: int | None, t0: float,
                cancel: threading.Event | None = None) -> Generation:
    """Transcripts of recordings of any length: a recording within the model's window is read whole;
    a longer one in overlapping windows whose text tokens are joined where they agree
    (``runtime/tasks/long_form.py``, as transformers' pipeline with ``chunk_length_s=30``). Its
    tokens are then the joined text tokens, and its finish reason ``length`` where any window ran
    out of ``max_new_tokens``. Windows are decoded a few at a time: as many as
    ``model.limits.max_batch_tokens`` encoder positions (times beams) allow, at least one."""
    if model._log_mel is None:
        model.features(audio)  # the one-line refusal of an artifact without its feature extractor
    log_mel = model._log_mel
    waves = read_audio(log_mel, audio)
    _check_seeds(search, len(waves), "recordings")
    rows = [(i, piece) for i, wave in enumerate(waves) for piece in windows(wave, log_mel.n_samples)]
    name = next((t.name for t in model.parts[ENCODER].inputs), "input_features")
    positions = max(1, log_mel.n_samples // log_mel.hop_length // 2)  # Whisper's encoder halves the frames: 1,500
    budget = model.limits.batch_tokens(None, True, None)  # what check_encoded holds a text call's prompts to
    group_size = max(1, min(WINDOWS_A_PASS, budget // (positions * search.num_beams)))
    seeds = search.sample.seed if search.sample is not None else None
    new: list[list[int]] = []
    cut: list[bool] = []  # per window: cut short by cancel (or never decoded)
    passes, prefill = 0, 0.0
    for at in range(0, len(rows), group_size):
        if cancel is not None and cancel.is_set():
            new += [[] for _ in rows[at:]]
            cut += [True] * len(rows[at:])
            break
        group = rows[at:at + group_size]
        part = search
        if isinstance(seeds, tuple):  # each recording's seed for each of its windows
            part = search.replace(sample=dataclasses.replace(search.sample, seed=tuple(seeds[i] for i, _ in group)))
        feeds = {name: np.stack([log_mel(piece) for _, piece in group])}
        got, n, first, stopped = _decode(model, feeds, part, language, t0, cancel)
        new += got
        cut += [stopped] * len(got)
        passes, prefill = passes + n, prefill or first
    tok = model.detokenizer
    special = _not_text(tok, search)
    tokens, texts, reasons = [], [], []
    for i in range(len(waves)):
        mine = [r for r, (j, _) in enumerate(rows) if j == i]
        if len(mine) == 1:
            tokens.append(new[mine[0]])
        else:  # the windows' text tokens, joined (a window without text takes no part, as in transformers)
            tokens.append(merge_overlaps([kept for r in mine if (kept := [t for t in new[r] if t not in special])]))
        texts.append(tok.decode(tokens[-1], skip_special_tokens=True) if tok is not None else "")
        ends = [_finish(new[r], search, cut[r]) for r in mine]
        reasons.append("cancelled" if "cancelled" in ends else "length" if "length" in ends else "stop")
    return Generation(tokens=tokens, texts=texts if tok is not None else None, seconds=time.perf_counter() - t0,
                      passes=passes, prefill_s=prefill, finish_reasons=reasons)


def _not_text(tok: Any, search: Search) -> set[int]:
    """Token ids that are not text in a window's transcript: the tokenizer's special tokens, the end
    ids and, for Whisper, its timestamp tokens (every id after ``<|notimestamps|>``)."""
    special = set(search.eos)
    if tok is None:
        return special
    special |= {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    stamps = tok.token_to_id("<|notimestamps|>")
    if stamps is not None:
        special |= set(range(stamps + 1, tok.get_vocab_size(with_added_tokens=True)))
    return special


def _token_ids(prompt: Any, i: int) -> list[int]:
    """Prompt ``i`` given as token ids: a list of whole numbers (a float or a text among them was cut
    or a raw ValueError)."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (list, tuple, np.ndarray)):
        raise FeedError(f"prompt {i} is {type(prompt).__name__}; give every prompt as a text, or every prompt as a list "
                        "of token ids.")
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
        raise FeedError(f"prompt {i} has a token id that is not a whole number; pass whole numbers, or texts.")
    return [int(t) for t in prompt]


def _uncut_feeds(model: Seq2Seq, prompts: list[str]) -> dict[str, np.ndarray]:
    """The encoder's feeds for text prompts, a prompt the tokenizer had to cut refused (it was cut
    there, silently: a long article was summarised or translated up to that point only)."""
    from slimml.runtime.tasks.base import check_unicode

    text = model.text
    if text is None:
        return model.tokenize(prompts)  # the one-line refusal of a model without a tokenizer
    check_unicode(prompts)
    encodings = text.encodings(prompts)
    for i, e in enumerate(encodings):
        if e.overflowing:
            n = text.token_counts([prompts[i]])[0] + text.special_tokens(False)
            raise FeedError(f"prompt {i} is {n} tokens, more than the {text.max_length} this model reads; shorten it or "
                            "split it into parts of at most that many tokens (the model would answer for its start only).")
    return text.batch(encodings)


def with_language(spec: Mapping[str, Any], language: int | None) -> dict[str, Any]:
    """``spec`` with Whisper's prompt for a named language: ``language`` (else the one the source's
    generation config names) in the prompt's language slot or, where the record says the task a named
    language gets (``language_task_id``: the config's task, else transcribe), the language, that
    task and ``<|notimestamps|>``, as transformers' generate puts them (it drops the forced ids once
    a language is named); as it is where no language is named (it is detected) or the prompt has no slot."""
    prompt = list(spec.get("prompt_ids") or ())
    language = language if language is not None else spec.get("language_id")
    if None not in prompt or language is None:
        return dict(spec)
    if spec.get("language_task_id") is not None:
        prompt = [int(language), int(spec["language_task_id"]), prompt[-1]]  # the last: <|notimestamps|>
    else:
        prompt[prompt.index(None)] = int(language)
    return {**spec, "prompt_ids": prompt}


def start_tokens(decoder: Decoder, spec: Mapping[str, Any], batch: int, beams: int = 1,
                 language: int | None = None) -> np.ndarray:
    """The decoder's first tokens, (batch, k): the start token, then Whisper's prompt (its language,
    where the model does not fix one, ``language``, else the one its generation config names, else
    detected as transformers detects it: the first step's most likely language id, a prompt each;
    a named language gets the task transcribe where the prompt has no task, as transformers gives it)."""
    first = np.full((batch, 1), int(spec["decoder_start_token_id"]), dtype=np.int64)
    prompt = list(with_language(spec, language).get("prompt_ids") or ())
    if not prompt:
        return first
    start = np.repeat(first, len(prompt) + 1, axis=1)
    if None in prompt:
        languages = np.asarray(spec.get("language_ids") or (), dtype=np.int64)
        if not languages.size:
            raise FeedError("the artifact's Whisper prompt leaves the language open but records no language ids "
                            "(language_ids); re-convert it with this slimml.")
        logits = decoder.step(np.repeat(first, beams, axis=0))[::beams]
        decoder.restart()
        start[:, 1 + prompt.index(None)] = languages[logits[:, languages].argmax(axis=-1)]
    for j, token in enumerate(prompt, start=1):
        if token is not None:
            start[:, j] = token
    return start


def record_feeds(model: Seq2Seq, encoder_batches: list[dict[str, np.ndarray]], steps: int = 4) -> dict[str, list]:
    """What each component is fed while generating ``steps`` tokens from each encoder batch, after
    the decoder's prompt as ``generate`` starts it (Whisper's language, task and no-timestamps
    tokens): calibration and guard data for quantizing the components one by one."""
    spec = model.spec
    inputs = {name: {t.name for t in p.inputs} for name, p in model.parts.items()}
    record: dict[str, list] = {name: [] for name in model.parts}

    def run(name, feeds):
        record[name].append(dict(feeds))
        return model.parts[name].run(feeds)

    for feeds in encoder_batches:
        decoder = Decoder(run, inputs, feeds)
        start = start_tokens(decoder, spec, next(iter(feeds.values())).shape[0])
        for _ in greedy(decoder, start, Search(max_length=start.shape[1] + steps)):
            pass
    return record


def sample_encoder_batches(model: Seq2Seq, texts: list[str], batch_size: int = 8, limit: int = 16) -> list[dict]:
    """Encoder inputs for ``texts`` (tokenized; without a tokenizer, token ids from the bottom of the
    vocabulary, as for any model without one), or for a speech model log-mel features of noise."""
    encoder = model.parts[ENCODER]
    names = {t.name for t in encoder.inputs}
    rng = np.random.default_rng(0)
    count = max(1, min(limit, len(texts) // batch_size))
    if "input_ids" in names and model.text is not None:
        chunks = [texts[i:i + batch_size] for i in range(0, len(texts), batch_size)][:limit]
        return [{k: v for k, v in model.tokenize(c).items() if k in names} for c in chunks if c]
    if "input_ids" in names:
        top = min(100, int(getattr(model, "vocab_size", None) or 100))  # ids from the bottom of the vocabulary
        ids = [rng.integers(0, top, (2, 16)) for _ in range(count)]
        return [{k: v for k, v in {"input_ids": i, "attention_mask": np.ones_like(i)}.items() if k in names} for i in ids]
    return [model.features([rng.standard_normal(16000 * (1 + i % 3)).astype(np.float32) * 0.1 for i in range(2)])
            for _ in range(count)]
