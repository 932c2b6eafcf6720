"""How an encoder-decoder picks its tokens: the model's generation settings, the score processors
transformers' ``generate`` applies, and beam search.

:class:`Search` holds what the source's ``generation_config.json`` (else ``config.json``) says and
the caller may override: beams, length penalty, early stopping, no-repeat n-grams, the minimum
and maximum length, a repetition penalty, and the forced, suppressed and banned tokens.
:meth:`Search.process` applies them to a step's scores in transformers' order (its
``_get_logits_processor``); :func:`beam_search` is transformers' beam search (4.57's vectorised
one: ``2 * num_beams`` candidates a step, finished hypotheses scored by
``sum log p / length ** length_penalty``, its early-stopping rules), in numpy on the artifact's
components.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slimml.errors import FeedError
from slimml.runtime.tasks.generation.config import MAX_BEAMS, GenerationConfig
from slimml.runtime.tasks.generation.sampling import Sampler
from slimml.runtime.tasks.limits import shown

ENCODER, DECODER, WITH_PAST = "encoder", "decoder", "decoder_with_past"
Run = Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]  # (component, feeds) -> outputs
_BIG = np.float32(-1.0e9)  # transformers' "never": added to a score, not -inf (kept finite for its comparisons)


@dataclass
class Search:
    """How tokens are chosen; lengths count the decoder's whole sequence, start token included (as
    transformers' ``max_length`` and ``min_length`` do).

    Example:
        >>> Search(num_beams=4, length_penalty=2.0, no_repeat_ngram_size=3).num_beams
        4
    """

    max_length: int = 33  # the start token and 32 new ones
    prompt: int = 1  # the decoder's start tokens: 1, or Whisper's start, language, task and no-timestamps tokens
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as transformers reads it
    no_repeat_ngram_size: int = 0
    min_length: int = 0
    repetition_penalty: float = 1.0
    renormalize_logits: bool = False  # log-softmax again after the processors (Marian's configs)
    eos: tuple[int, ...] = ()  # each ends the answer
    forced: dict[int, int] = field(default_factory=dict)  # decoder position -> token made there
    forced_eos: int | None = None  # made at the last position the length allows
    suppress: tuple[int, ...] = ()
    begin_suppress: tuple[int, ...] = ()  # not made first
    bad_words: tuple[tuple[int, ...], ...] = ()
    sample: GenerationConfig | None = None  # temperature, top-k, top-p and seed where tokens are sampled; None: greedy

    def __post_init__(self):
        for name, low in (("max_length", 2), ("num_beams", 1), ("no_repeat_ngram_size", 0), ("min_length", 0), ("prompt", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise FeedError(f"{name} must be a whole number >= {low}, got {shown(value)}"
                                + (" (it counts the start token: max_new_tokens + 1)." if name == "max_length" else "."))
            setattr(self, name, int(value))
        if self.num_beams > MAX_BEAMS:
            raise FeedError(f"num_beams must be at most {MAX_BEAMS} (each beam holds a decoder cache of its own), got "
                            f"{self.num_beams}; summarization and translation models use 4 to 8.")
        for name in ("length_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) or not np.isfinite(value):
                raise FeedError(f"{name} must be a finite number, got {shown(value)}.")
            setattr(self, name, float(value))
        if isinstance(self.eos, (int, np.integer)):
            self.eos = (int(self.eos),)
        self.eos = tuple(int(e) for e in self.eos or ())
        if self.sample is not None and self.num_beams > 1:
            raise FeedError(f"sampling with num_beams={self.num_beams} (beam sampling) is not supported; pass num_beams=1 "
                            "to sample, or temperature=0 for beam search.")
        if self.repetition_penalty <= 0:
            raise FeedError(f"repetition_penalty must be > 0 (1: off), got {shown(self.repetition_penalty)}.")
        if self.early_stopping not in (True, False, "never"):
            raise FeedError(f'early_stopping must be true, false or "never", got {shown(self.early_stopping)}.')

    @classmethod
    def of(cls, spec: Mapping[str, Any], max_new_tokens: int | None = None, temperature: float | None = None,
           top_k: int | None = None, top_p: float | None = None, seed: Any = None, do_sample: bool | None = None,
           **overrides: Any) -> Search:
        """The model's settings (its manifest's ``seq2seq`` record), then the caller's (None: the model's).
        Without ``max_new_tokens`` the model's own ``max_length`` applies (after Whisper's prompt, as
        its generate counts it), else 32 new tokens; never past the decoder's positions. Tokens are
        sampled where the model's config says ``do_sample`` (at its temperature, top-k and top-p;
        transformers' defaults 1.0, 50 and 1.0) or the caller gives a temperature above 0; a
        temperature of 0 (or ``do_sample=False``) is greedy. Beam search does not sample: the
        model's own beams keep their search, a caller's request for both is refused."""
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer))
                                           or max_new_tokens < 1):
            raise FeedError(f"max_new_tokens must be a whole number >= 1, got {shown(max_new_tokens)}.")
        own = spec.get("search") or {}
        prompt = 1 + len(spec.get("prompt_ids") or ())
        limit = spec.get("max_positions")
        max_new_tokens = max_new_tokens if max_new_tokens is not None else own.get("max_new_tokens")
        if max_new_tokens is not None:
            length = prompt + int(max_new_tokens)
            if limit and length > limit:
                raise FeedError(f"max_new_tokens={max_new_tokens} runs past the decoder's {limit} positions "
                                f"({prompt} start token{'s' if prompt > 1 else ''} included); ask for at most {limit - prompt}.")
        else:
            length = int(own.get("max_length") or 33) + prompt - 1
            length = min(length, limit) if limit else length
        minimum = max(int(own.get("min_length") or 0), prompt + int(own.get("min_new_tokens") or 0))
        eos = spec.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        settings = dict(
            max_length=length, prompt=prompt, num_beams=int(own.get("num_beams") or 1), length_penalty=own.get("length_penalty", 1.0),
            early_stopping=own.get("early_stopping", False), no_repeat_ngram_size=int(own.get("no_repeat_ngram_size") or 0),
            min_length=minimum if minimum > prompt else 0, repetition_penalty=own.get("repetition_penalty", 1.0),
            renormalize_logits=bool(own.get("renormalize_logits", False)),
            eos=eos, forced={int(p): int(t) for p, t in spec.get("forced_ids") or []},
            forced_eos=spec.get("forced_eos_token_id"), suppress=tuple(spec.get("suppress_ids") or ()),
            begin_suppress=tuple(spec.get("begin_suppress_ids") or ()),
            bad_words=tuple(tuple(w) for w in spec.get("bad_words_ids") or () if not (len(w) == 1 and w[0] in eos)))
        settings.update({k: v for k, v in overrides.items() if v is not None})
        for key in ("length_penalty", "repetition_penalty"):
            settings[key] = 1.0 if settings[key] is None else settings[key]
        settings["early_stopping"] = False if settings["early_stopping"] is None else settings["early_stopping"]
        asked = do_sample is True or (do_sample is None and temperature is not None and temperature != 0)
        sample = GenerationConfig(
            temperature=temperature if temperature is not None else own.get("temperature", 1.0),
            do_sample=do_sample if do_sample is not None else (None if temperature is not None else bool(own.get("do_sample"))),
            top_k=top_k if top_k is not None else own.get("top_k", 50), top_p=top_p if top_p is not None else own.get("top_p", 1.0),
            seed=seed)
        if not sample.greedy and (asked or int(settings["num_beams"]) == 1):  # the model's own beams keep their search
            settings["sample"] = sample
        return cls(**settings)

    def replace(self, **changes: Any) -> Search:
        return dataclasses.replace(self, **changes)

    def process(self, rows: list[list[int]], scores: np.ndarray, length: int) -> np.ndarray:
        """``scores`` (N, vocab) of the next token after ``rows`` (each ``length`` tokens, the start
        token included), as transformers' processors leave them, in their order. Not in place."""
        scores = scores.copy()
        vocab = scores.shape[1]
        if self.repetition_penalty != 1.0:
            for r, row in enumerate(rows):
                seen = np.unique(np.asarray(row, dtype=np.int64))
                seen = seen[(seen >= 0) & (seen < vocab)]
                got = scores[r, seen]
                scores[r, seen] = np.where(got < 0, got * self.repetition_penalty, got / self.repetition_penalty)
        n = self.no_repeat_ngram_size
        if n and length + 1 >= n:
            for r, row in enumerate(rows):
                head = tuple(row[length - n + 1:length]) if n > 1 else ()
                banned = [row[i + n - 1] for i in range(length - n + 1) if tuple(row[i:i + n - 1]) == head]
                scores[r, [t for t in banned if 0 <= t < vocab]] = -np.inf
        for word in self.bad_words:
            for r, row in enumerate(rows):  # a word longer than the sequence so far is skipped, as transformers skips it
                if len(word) <= length and (len(word) == 1 or list(row[length - len(word) + 1:length]) == list(word[:-1])):
                    if 0 <= word[-1] < vocab:
                        scores[r, word[-1]] = -np.inf
        if length < self.min_length:
            scores[:, [e for e in self.eos if 0 <= e < vocab]] = -np.inf
        banned = [*self.suppress, *(self.begin_suppress if length == self.begin else ())]
        if banned:
            scores[:, [i for i in banned if 0 <= i < vocab]] = -np.inf
        forced = self.forced.get(length)  # after the suppressed ids: a forced token is made whatever they say (Whisper's
        if self.forced_eos is not None and length == self.max_length - 1:  # task token, which transformers puts in the prompt)
            forced = self.forced_eos  # after a forced first token, as transformers orders them
        if forced is not None and 0 <= forced < vocab:
            scores[:] = -np.inf
            scores[:, forced] = 0
        return _log_softmax(scores) if self.renormalize_logits else scores

    @property
    def begin(self) -> int:
        """The first position not forced after the start tokens, where ``begin_suppress`` applies: 2
        after a forced first token; Whisper's first text token, after its prompt."""
        position = self.prompt
        while position in self.forced:
            position += 1
        return position


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """The indices of each row's ``k`` largest scores, largest first (ties: the lower index first)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def _take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    while idx.ndim < a.ndim:
        idx = idx[..., None]
    return np.take_along_axis(a, idx, axis=1)


class Decoder:
    """The decoder components as one step function: the first step from the start tokens (the
    cross-attention cache made once), then one token a row with the self-attention cache."""

    def __init__(self, run: Run, inputs: Mapping[str, set[str]], encoder_feeds: dict[str, np.ndarray],
                 on_step: Callable[[dict], None] | None = None, repeat: int = 1):
        self.run, self.inputs, self.on_step = run, inputs, on_step
        hidden = run(ENCODER, encoder_feeds)["last_hidden_state"]
        mask = encoder_feeds.get("attention_mask")
        self.shared = {"encoder_hidden_states": np.repeat(hidden, repeat, axis=0) if repeat > 1 else hidden}
        if mask is not None:
            self.shared["encoder_attention_mask"] = np.repeat(mask, repeat, axis=0) if repeat > 1 else mask
        self.past: dict[str, np.ndarray] | None = None

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """``tokens``: (N, k) the start tokens on the first call, then (N, 1); the last position's logits."""
        first = self.past is None
        feeds = {"input_ids": tokens, **self.shared, **(self.past or {})}
        name = DECODER if first else WITH_PAST
        out = self.run(name, {k: v for k, v in feeds.items() if k in self.inputs[name]})
        if self.on_step:
            self.on_step(out)
        if first:
            self.past = {k.replace("present.", "past_key_values.", 1): v for k, v in out.items() if k.startswith("present.")}
        else:  # the self-attention cache grows; the cross-attention cache stays
            for k, v in out.items():
                if k.startswith("present.") and ".decoder." in k:
                    self.past[k.replace("present.", "past_key_values.", 1)] = v
        return out["logits"][:, -1, :]

    def restart(self) -> None:
        """Forget the tokens stepped so far (the encoder's output stays): the next step starts again."""
        self.past = None

    def reorder(self, rows: np.ndarray) -> None:
        """Keep the self-attention cache of ``rows`` (beam search's survivors), in that order."""
        if self.past is not None and not np.array_equal(rows, np.arange(len(rows))):
            for k, v in self.past.items():
                if ".decoder." in k:  # the cross-attention cache is the same for every beam of a prompt
                    self.past[k] = np.take(v, rows, axis=0)


def greedy(decoder: Decoder, start: np.ndarray, search: Search, pad: int = 0) -> Iterator[np.ndarray]:
    """Up to ``max_length - start`` steps, each token the most likely, or drawn where
    ``search.sample`` says (after the processors, as transformers' warpers follow them); yields
    each step's new tokens (B,). Tokens after a row's end token are ``pad``."""
    rows = start.tolist()
    done = np.zeros(start.shape[0], dtype=bool)
    logits = decoder.step(start)
    sampler = Sampler(search.sample, rows, logits.shape[-1]) if search.sample is not None else None
    for length in range(start.shape[1], search.max_length):
        scores = search.process(rows, logits, length)
        nxt = sampler(scores) if sampler is not None else scores.argmax(axis=-1).astype(np.int64)
        nxt = np.where(done, pad, nxt)
        for row, token in zip(rows, nxt.tolist()):
            row.append(token)
        yield nxt
        done |= np.isin(nxt, search.eos)
        if done.all() or length == search.max_length - 1:
            return
        logits = decoder.step(nxt[:, None])


def beam_search(decoder: Decoder, start: np.ndarray, search: Search) -> tuple[list[list[int]], int]:
    """Each prompt's best hypothesis (new tokens, its end token included) and the passes run.
    ``decoder`` was made with ``repeat=num_beams``; ``start`` is (B, 1)."""
    nb, eos = search.num_beams, search.eos
    batch, prompt = start.shape
    max_length = search.max_length
    keep = max(2, 1 + len(eos)) * nb  # as transformers keeps
    top_mask = np.arange(keep) < nb
    running = np.zeros((batch, nb, max_length), dtype=np.int64)
    running[:, :, :prompt] = start[:, None, :]
    running_scores = np.zeros((batch, nb), dtype=np.float32)
    running_scores[:, 1:] = _BIG
    sequences, lengths = running.copy(), np.zeros((batch, nb), dtype=np.int64)
    scores = np.full((batch, nb), _BIG, dtype=np.float32)
    finished = np.zeros((batch, nb), dtype=bool)
    unsatisfied = np.ones((batch, 1), dtype=bool)
    offset = (np.arange(batch) * nb)[:, None]
    length, passes = prompt, 0
    logits = decoder.step(np.repeat(start, nb, axis=0))
    while True:
        passes += 1
        flat = running[:, :, :length].reshape(batch * nb, length)
        logp = search.process(flat.tolist(), _log_softmax(logits), length)
        vocab = logp.shape[1]
        logp = (logp.reshape(batch, nb, vocab) + running_scores[:, :, None]).reshape(batch, nb * vocab)
        top = _top(logp, keep)
        top_scores = np.take_along_axis(logp, top, axis=1)
        parent, token = top // vocab, top % vocab
        top_seqs = _take(running, parent).copy()
        top_seqs[:, :, length] = token
        hits = np.isin(token, eos) | (length + 1 >= max_length)
        # the live beams: the best candidates that did not just finish
        live_scores = top_scores + hits.astype(np.float32) * _BIG
        chosen = _top(live_scores, nb)
        running = _take(top_seqs, chosen)
        running_scores = np.take_along_axis(live_scores, chosen, axis=1)
        rows = (np.take_along_axis(parent, chosen, axis=1) + offset).reshape(-1)
        # the finished hypotheses: the best nb of those kept and those that just finished among the top nb
        just = hits & top_mask[None, :]
        final = top_scores / np.float32((length + 1 - prompt) ** search.length_penalty)
        full = finished.all(axis=-1, keepdims=True) & (search.early_stopping is True)
        final = final + full.astype(np.float32) * _BIG + (~unsatisfied).astype(np.float32) * _BIG + (~just).astype(np.float32) * _BIG
        merged_scores = np.concatenate([scores, final], axis=1)
        best = _top(merged_scores, nb)
        sequences = _take(np.concatenate([sequences, top_seqs], axis=1), best)
        lengths = np.take_along_axis(np.concatenate([lengths, np.full((batch, keep), length + 1 - prompt)], axis=1), best, axis=1)
        scores = np.take_along_axis(merged_scores, best, axis=1)
        finished = np.take_along_axis(np.concatenate([finished, just], axis=1), best, axis=1)
        length += 1
        # can a live beam still beat the worst finished hypothesis?
        hypothetical = (max_length if search.early_stopping == "never" and search.length_penalty > 0 else length) - prompt
        best_live = running_scores[:, :1] / np.float32(hypothetical ** search.length_penalty)
        worst = np.where(finished, scores.min(axis=1, keepdims=True), _BIG)
        unsatisfied = unsatisfied & (best_live > worst).any(axis=-1, keepdims=True)
        if not (unsatisfied.any() and not (finished.all() and search.early_stopping is True) and not hits.all()):
            break
        decoder.reorder(rows)
        logits = decoder.step(running[:, :, length - 1].reshape(-1, 1))
    return [sequences[b, 0, prompt:prompt + lengths[b, 0]].tolist() for b in range(batch)], passes
