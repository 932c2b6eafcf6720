"""The accuracy guard's measure for a language model: perplexity on held-out text.

The cosine of logits between a quantized and a float decoder stays near 1 while its perplexity
rises by 35-70% (SmolLM2-135M); what matters is how well it still predicts text. The drop is
``100 * (perplexity_quantized / perplexity_float - 1)`` on the same token windows, with the top-1
agreement of the two beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slimml.convert.llm_check import compare, decoder_feeds, past_shapes, read_eval_text, score_run, token_windows

GUARD_BUDGET = 512  # tokens: enough to separate +1% from +10%, and the guard re-measures per shard


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
        self.windows = token_windows(folder / manifest.tokenizer["file"], text, budget=GUARD_BUDGET)
        names, past = [t.name for t in manifest.inputs], past_shapes(manifest.inputs)
        self.feeds_for = lambda ids: decoder_feeds(names, ids, past)
        self.reference = score_run(float_chain.run, self.feeds_for, self.windows)
        self.reference_ppl = compare(self.reference, self.reference)["perplexity_source"]

    def perplexity(self, chain: Any) -> float:
        return compare(score_run(chain.run, self.feeds_for, self.windows), self.reference)["perplexity_artifact"]

    def drop(self, chain: Any, checks: dict[str, Any]) -> float:
        got = compare(score_run(chain.run, self.feeds_for, self.windows), self.reference, ("quantized", "float"))
        d = 100.0 * got["perplexity_rel_diff"]
        checks.update({k: v for k, v in got.items() if k != "perplexity_rel_diff"})
        checks.update({"eval_text": self.origin, "drop": round(d, 6), "drop_metric": "perplexity_increase_pct"})
        return d
