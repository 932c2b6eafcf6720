"""The accuracy guard's measure for a language model: perplexity on held-out text.

The cosine of logits between a quantized and a float decoder stays near 1 while its perplexity
rises by 35-70% (SmolLM2-135M); what matters is how well it still predicts text. The drop is
``100 * (perplexity_quantized / perplexity_float - 1)`` on the same token windows, with the top-1
agreement of the two beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from slimml.convert.llm_check import (DEFAULT_WINDOW, artifact_context, compare, decoder_feeds, past_shapes,
                                      read_eval_text, score_run, token_windows)

GUARD_BUDGET = 2048  # tokens scored (the built-in sample has ~400): on 512, int8's +0.2% read as +1.4-2%


class LanguageModelScore:
    """Score chains of a decoder's shards on held-out text against the float chain.

    Args:
        manifest: the float artifact's manifest (tokenizer, inputs).
        folder: the float artifact's folder (its tokenizer file).
        guard: the guard config (its ``max_drop`` is then in perplexity percent).
        float_chain: the float shards as a :class:`~slimml.quantize.chain.Chain`.
        eval_text: the held-out text file (the quantize config's ``eval_text``), else the built-in sample.
    """

    def __init__(self, manifest: Any, folder: Path, guard: Any, float_chain: Any, eval_text: Any = None):
        text, self.origin = read_eval_text(eval_text)
        context = artifact_context(folder, manifest)  # a window never passes the model's positions
        window = min(DEFAULT_WINDOW, context) if context else DEFAULT_WINDOW
        self.window = window  # recorded: `slimml eval ART --data TEXT --window W --max-tokens 2048` scores the same tokens
        self.windows = token_windows(folder / manifest.tokenizer["file"], text, window, GUARD_BUDGET)
        names, past = [t.name for t in manifest.inputs], past_shapes(manifest.inputs)
        self.feeds_for = lambda ids: decoder_feeds(names, ids, past)
        self.reference = score_run(float_chain.run, self.feeds_for, self.windows)
        self.reference_ppl = compare(self.reference, self.reference)["perplexity_source"]

    def perplexity(self, chain: Any) -> float:
        return compare(score_run(chain.run, self.feeds_for, self.windows), self.reference)["perplexity_artifact"]

    def drop(self, chain: Any, checks: dict[str, Any]) -> float:
        scores = score_run(chain.run, self.feeds_for, self.windows)
        got = compare(scores, self.reference, ("quantized", "float"))
        d = 100.0 * got["perplexity_rel_diff"]
        checks.update({k: v for k, v in got.items() if k != "perplexity_rel_diff"})
        checks.update({"eval_text": self.origin, "eval_window": self.window, "eval_max_tokens": GUARD_BUDGET,
                       "drop": round(d, 6), "drop_metric": "perplexity_increase_pct",
                       "drop_noise": round(noise(scores[0] - self.reference[0]), 4)})
        return d


NOISE_RUN = 32  # tokens a run of the paired differences holds (neighbouring tokens' losses move together)


def noise(diff: np.ndarray) -> float:
    """How far the perplexity increase measured from the per-token loss differences ``diff``
    (quantized - float) may be from the model's on text like it: the 95% half-width, in percent,
    from the spread of the means of runs of :data:`NOISE_RUN` tokens (inf with fewer than 2 runs).
    On SmolLM2's built-in sample (404 tokens) int8 measured +2.05% where 2,044 tokens of news read
    +0.20%: a guard must not act on differences below this."""
    run = max(1, min(NOISE_RUN, diff.size // 4))  # a short text: shorter runs, at least 4 of them
    runs = diff.ravel()[: diff.size // run * run].reshape(-1, run).mean(axis=1)
    if len(runs) < 2:
        return float("inf")
    t = T_975[len(runs) - 2] if len(runs) - 1 <= len(T_975) else 1.96 + 2.4 / (len(runs) - 1)  # Student's t, 95%
    return 100.0 * float(np.expm1(t * runs.std(ddof=1) / np.sqrt(len(runs))))


T_975 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26)  # Student's t at 97.5% for 1..9 degrees of freedom
