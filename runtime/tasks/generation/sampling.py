"""The next token from the last position's logits, with numpy.

The processors run in the order transformers runs them (``_get_logits_processor``), after
OpenAI's ``logit_bias`` (added to the logits first, as OpenAI and llama.cpp add it): repetition
penalty, no-repeat n-grams (then OpenAI's presence and frequency penalties, over the answer's own tokens), then
temperature, top-k, top-p, min-p, typical-p and the epsilon and eta cutoffs, each keeping the tokens transformers keeps, so that a
transformers user's settings mean the same here. Sampling draws one uniform number per prompt per
step from its own ``numpy.random.Generator`` seeded by ``seed``, as a served request draws from
its own: the same seed, prompt and model give the same draws, alone or in a batch of any size (the
same tokens where the batch leaves the logits as they are: fp32 and 8-bit artifacts; so
the same prompt twice in one batch with one seed gives the same tokens twice; ``seed=None`` draws
a fresh seed per prompt).

Per step this must cost little beside a model pass (a 49k vocabulary, every token): top-k and
top-p work on candidates picked by ``np.partition`` (O(vocab)) and sort only those, never the
whole vocabulary, unless the nucleus really spans most of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slimml.runtime.tasks.generation.config import GenerationConfig

FMAX = np.float32(np.finfo(np.float32).max)  # scores are held below it: an overflow to +inf would make NaN weights
NUCLEUS_CANDIDATES = 256  # top-p looks among this many most likely tokens first (x4 until they hold p)


@dataclass(frozen=True)
class TokenLogprob:
    """One chosen token's log-probability under the model, and the most likely alternatives.

    Attributes:
        id: the token chosen.
        logprob: its natural log-probability: the log-softmax of the model's logits at that step,
            before any processor (temperature, top-k/p, penalties), as OpenAI reports it.
        top: ``(id, logprob)`` of the most likely tokens at that step, most likely first
            (``GenerationConfig.logprobs`` of them).
    """

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: np.ndarray, chosen: np.ndarray, k: int) -> list[TokenLogprob]:
    """(B, vocab) logits of one step and the (B,) tokens chosen from them -> each row's
    :class:`TokenLogprob` with its ``k`` most likely alternatives."""
    out = []
    for row, token in zip(logits, chosen):
        v = row.astype(np.float32, copy=False)
        m = float(v.max())
        lse = m + float(np.log(np.exp(v - m, dtype=np.float32).sum(dtype=np.float64)))
        top: tuple[tuple[int, float], ...] = ()
        if k:
            kk = min(k, len(v))
            ids = np.argpartition(v, len(v) - kk)[len(v) - kk:]
            ids = ids[np.argsort(-v[ids], kind="stable")]
            top = tuple((int(i), float(v[i]) - lse) for i in ids)
        out.append(TokenLogprob(int(token), float(v[int(token)]) - lse, top))
    return out


class Sampler:
    """Picks each prompt's next token; remembers the tokens seen for the repetition penalty, the
    n-grams seen for ``no_repeat_ngram_size``, and the answer's token counts for the presence and
    frequency penalties.

    Args:
        config: the checked generation settings.
        prompts: each prompt's token ids (they count as seen, as in transformers).
        vocab: the logits' last dimension.
        ends: the ids that end a prompt, kept from being chosen for ``config.min_new_tokens`` steps.
        constraints: one :class:`~slimml.runtime.tasks.generation.structured.Constraint` per prompt
            (``config.response_format``, built by ``prepare``), or None.
    """

    def __init__(self, config: GenerationConfig, prompts: list[list[int]], vocab: int, ends: frozenset[int] = frozenset(),
                 constraints: list | None = None):
        self.config = config
        self.constraints = constraints
        self.ends = np.array(sorted(i for i in ends if 0 <= i < vocab), dtype=np.int64)
        self.made = 0  # tokens chosen so far (add() counts them)
        seeds = config.seed if isinstance(config.seed, tuple) else [config.seed] * len(prompts)  # a list: prepare() checked it
        self.rngs = [np.random.Generator(np.random.PCG64(None if s is None else int(s))) for s in seeds]  # one a prompt
        self.seen: np.ndarray | None = None  # (B, vocab) bool, only with a repetition penalty
        if config.repetition_penalty != 1.0:
            self.seen = np.zeros((len(prompts), vocab), dtype=bool)
            for row, ids in enumerate(prompts):
                self.seen[row, [i for i in ids if 0 <= i < vocab]] = True
        self.ngrams: list[NGrams] | None = None  # one a prompt, with a no-repeat n-gram size
        if config.no_repeat_ngram_size:
            self.ngrams = [NGrams(config.no_repeat_ngram_size, ids) for ids in prompts]
        self.counts: np.ndarray | None = None  # (B, vocab) int32: each token's count in the answer so far
        if config.presence_penalty or config.frequency_penalty:
            self.counts = np.zeros((len(prompts), vocab), dtype=np.int32)
        self.bias = None  # (ids, biases) of config.logit_bias, within the vocabulary (prepare() refused the others)
        kept = [(t, b) for t, b in config.logit_bias or () if t < vocab]
        if kept:
            self.bias = (np.array([t for t, _ in kept], dtype=np.int64), np.array([b for _, b in kept], dtype=np.float32))

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """(B, vocab) logits of the last position -> (B,) int64 token ids."""
        scores = self._penalised(logits)
        if self.config.greedy:
            return scores.argmax(axis=-1).astype(np.int64)
        out = np.empty(len(scores), dtype=np.int64)
        for row in range(len(scores)):
            u = self.rngs[row].random()  # one draw a row, every step: the draws never depend on the logits or the batch
            ids, kept = self._keep(scores[row])
            k = draw(np.exp(kept - kept.max()), u)  # float32: float64 temporaries of a vocabulary cost page faults
            out[row] = k if ids is None else ids[k]
        return out

    def scores(self, logits: np.ndarray) -> np.ndarray:
        """(B, vocab) logits -> the scores sampled from, after every processor (-inf: excluded),
        as transformers' processors leave them."""
        scores = self._penalised(logits)
        if self.config.greedy:
            return scores
        out = np.full(scores.shape, -np.inf, dtype=np.float32)
        for row in range(len(scores)):
            ids, kept = self._keep(scores[row])
            out[row, slice(None) if ids is None else ids] = kept
        return out

    def add(self, ids: np.ndarray) -> None:
        """Count the tokens just chosen, (B,), as seen."""
        self.made += 1
        if self.seen is not None:
            self.seen[np.arange(len(ids)), ids] = True
        if self.ngrams is not None:
            for grams, token in zip(self.ngrams, ids):
                grams.add(int(token))
        if self.counts is not None:
            np.add.at(self.counts, (np.arange(len(ids)), ids), 1)
        if self.constraints is not None:
            for c, token in zip(self.constraints, ids):
                c.consume(token)

    def _penalised(self, logits: np.ndarray) -> np.ndarray:
        """OpenAI's ``logit_bias`` added; repetition penalty (transformers' ``RepetitionPenaltyLogitsProcessor``): a seen token's
        logit is divided by the penalty where positive, multiplied where negative; end ids at -inf
        before ``min_new_tokens`` (``MinNewTokensLengthLogitsProcessor``); a token that would
        repeat an n-gram at -inf (``NoRepeatNGramLogitsProcessor``); then OpenAI's penalties:
        ``logit - count * frequency_penalty - (count > 0) * presence_penalty`` over the answer's tokens."""
        early = self.made < self.config.min_new_tokens and len(self.ends)
        if (self.seen is None and self.counts is None and self.constraints is None and self.bias is None
                and self.ngrams is None and not early):
            return logits.astype(np.float32, copy=False)
        scores = logits.astype(np.float32, copy=True)
        if self.bias is not None:
            scores[:, self.bias[0]] += self.bias[1]
        if early:
            scores[:, self.ends] = -np.inf
        if self.seen is not None:
            rows, cols = np.nonzero(self.seen)
            v = scores[rows, cols]
            p = np.float32(self.config.repetition_penalty)
            with np.errstate(over="ignore"):  # a tiny penalty: a seen token's score at FMAX, the most likely
                scores[rows, cols] = np.minimum(np.where(v < 0, v * p, v / p), FMAX)
        if self.ngrams is not None:
            for row, grams in zip(scores, self.ngrams):
                banned = grams.banned()
                if banned:
                    row[[t for t in banned if 0 <= t < len(row)]] = -np.inf
        if self.counts is not None:
            rows, cols = np.nonzero(self.counts)
            n = self.counts[rows, cols].astype(np.float32)
            scores[rows, cols] -= n * np.float32(self.config.frequency_penalty) + np.float32(self.config.presence_penalty)
        if self.constraints is not None:  # last: what the format allows, whatever the penalties did
            for row, raw, c in zip(scores, logits, self.constraints):
                c.mask(row, raw)
        return scores

    def _keep(self, s: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """One row's (vocab,) scores -> (ids kept, or None for all; their scores after temperature)."""
        c = self.config
        with np.errstate(over="ignore"):
            s = np.minimum(s / np.float32(c.temperature), FMAX)  # scores near FMAX (a tiny penalty) tie there
        ids = None
        if c.top_k and c.top_k < len(s):
            ids = top_k(s, c.top_k)
        if c.top_p < 1.0:
            ids = top_p(s, c.top_p, ids)
        if c.min_p > 0.0:  # transformers' MinPLogitsWarper: a probability under min_p x the top one's, on the kept tokens
            pool = np.arange(len(s)) if ids is None else ids
            v = s[pool]
            ids = pool[v >= v.max() + np.float32(np.log(c.min_p))]
        if c.typical_p < 1.0:
            ids = typical(s, c.typical_p, ids)
        for cut, eta in ((c.epsilon_cutoff, False), (c.eta_cutoff, True)):
            if cut > 0.0:
                ids = cutoff(s, cut, ids, eta)
        return ids, (s if ids is None else s[ids])


class NGrams:
    """One prompt's tokens so far (the prompt's, then the answer's) as an index of their n-grams,
    for transformers' ``no_repeat_ngram_size``: the tokens that would complete an n-gram the text
    already holds. Each token costs one dictionary step, whatever the length of the text."""

    def __init__(self, n: int, prompt: list[int]):
        self.n = n
        self.tail: list[int] = []  # the last n - 1 tokens
        self.after: dict[tuple[int, ...], set[int]] = {}  # (n - 1)-gram -> the tokens that followed it
        for token in prompt:
            self.add(int(token))

    def add(self, token: int) -> None:
        """The next token of the text."""
        if len(self.tail) == self.n - 1:
            self.after.setdefault(tuple(self.tail), set()).add(token)
        if self.n > 1:
            self.tail.append(token)
            if len(self.tail) > self.n - 1:
                del self.tail[0]

    def banned(self) -> set[int]:
        """The tokens that, next, would repeat an n-gram of the text."""
        if len(self.tail) < self.n - 1:
            return set()
        return self.after.get(tuple(self.tail), set())


def top_k(s: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` highest of the (vocab,) scores ``s``; ties with the k-th are kept, as
    transformers' ``TopKLogitsWarper`` keeps them."""
    kth = np.partition(s, len(s) - k)[len(s) - k]
    return np.flatnonzero(s >= kth)


def top_p(s: np.ndarray, p: float, ids: np.ndarray | None = None) -> np.ndarray:
    """Ids of the nucleus of the (vocab,) scores ``s`` (among ``ids`` when given), as transformers'
    ``TopPLogitsWarper`` keeps it: the most likely tokens while the probability of those more likely
    than a token is below ``p`` (so the most likely one always)."""
    pool = np.arange(len(s)) if ids is None else ids
    v = s if ids is None else s[ids]
    w = np.exp(v - v.max())  # float32 (vocab,)
    total = w.sum(dtype=np.float64)
    m = min(NUCLEUS_CANDIDATES, len(pool))
    while True:
        # the m most likely (and their ties) by a partition of the values: argpartition is slower
        top = np.flatnonzero(v >= np.partition(v, len(v) - m)[len(v) - m]) if m < len(pool) else np.arange(len(pool))
        if m == len(pool) or w[top].sum() >= p * total:  # the nucleus lies inside these candidates
            break
        m = min(m * 4, len(pool))
    order = top[np.argsort(-v[top], kind="stable")]  # most likely first
    wo = w[order].astype(np.float64)
    above = np.cumsum(wo) - wo  # probability of the tokens before each one (times total)
    return np.sort(pool[order[above < p * total]])


def _logp(v: np.ndarray) -> np.ndarray:
    """Log-probabilities (float64) of the scores ``v`` (-inf: excluded)."""
    v = v.astype(np.float64)
    m = v.max()
    return v - (m + np.log(np.exp(v - m).sum()))


def typical(s: np.ndarray, mass: float, ids: np.ndarray | None = None) -> np.ndarray:
    """Ids (among ``ids`` when given) of the locally typical set of the (vocab,) scores ``s``, as
    transformers' ``TypicalLogitsWarper`` keeps it: tokens ordered by how far their information
    (-log p) lies from the entropy, kept until their probabilities add up to ``mass``; the
    closest one always. Sorts the whole pool: rarely used, and it cannot be done on candidates."""
    pool = np.arange(len(s)) if ids is None else ids
    lp = _logp(s[pool])
    p = np.exp(lp)
    finite = np.isfinite(lp)
    entropy = -(lp[finite] * p[finite]).sum()
    shifted = np.where(finite, np.abs(-lp - entropy), np.inf)
    order = np.argsort(shifted, kind="stable")
    cum = np.cumsum(p[order])
    last = min(int((cum < mass).sum()), len(order) - 1)
    keep = shifted <= shifted[order[last]]
    keep[order[0]] = True
    return pool[keep]


def cutoff(s: np.ndarray, epsilon: float, ids: np.ndarray | None = None, eta: bool = False) -> np.ndarray:
    """Ids (among ``ids`` when given) of the (vocab,) scores ``s`` at least ``epsilon`` likely, as
    transformers' ``EpsilonLogitsWarper``; ``eta``: at least min(epsilon, sqrt(epsilon) x
    exp(-entropy)) likely, as its ``EtaLogitsWarper``. The most likely token (and its ties) always."""
    pool = np.arange(len(s)) if ids is None else ids
    lp = _logp(s[pool])
    p = np.exp(lp)
    floor = epsilon
    if eta:
        finite = np.isfinite(lp)
        floor = min(epsilon, np.sqrt(epsilon) * np.exp((lp[finite] * p[finite]).sum()))
    keep = (p >= floor) | (lp >= lp.max())  # the most likely, and its ties, as transformers keeps them
    return pool[keep]


def draw(w: np.ndarray, u: float, block: int = 256) -> int:
    """The index at which the running sum of the weights ``w`` first passes ``u`` of their total
    (inverse CDF). By block sums, then a running sum inside one block: ``np.cumsum`` over a whole
    49k vocabulary costs more than the rest of a sampling step. Sums are float64."""
    n = len(w)
    if n <= 4 * block:
        cdf = np.cumsum(w, dtype=np.float64)
        return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), n - 1)
    full = n - n % block
    sums = w[:full].reshape(-1, block).sum(axis=1, dtype=np.float64)  # (n // block,)
    if full < n:
        sums = np.append(sums, w[full:].sum(dtype=np.float64))
    cum = np.cumsum(sums)
    target = u * cum[-1]
    b = min(int(np.searchsorted(cum, target, side="right")), len(cum) - 1)
    inside = np.cumsum(w[b * block : (b + 1) * block], dtype=np.float64)
    k = int(np.searchsorted(inside, target - (cum[b - 1] if b else 0.0), side="right"))
    return min(b * block + k, n - 1)
