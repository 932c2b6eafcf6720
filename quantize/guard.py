"""The accuracy guard: measure the quantized model against the float one; keep sensitive shards float.

The drop is measured on held-out calibration texts (never used for calibration) as
``100 * (1 - mean cosine)`` between quantized and float outputs, or, with an evaluation file
(STS CSV) and a sentence-embedding model, as the loss in Spearman x100 points. When it exceeds
``max_drop``, each quantized shard's sensitivity (the output error when it alone is quantized)
is measured, and the most sensitive shards are put back to float one at a time until the drop
fits. The manifest records which shards stayed float and why. A language model's drop is its
perplexity increase in percent on held-out text (``quantize.lm_guard``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimml.errors import ConfigError
from slimml.quantize.chain import Chain, outputs_agreement
from slimml.quantize.classifier_guard import ClassifierScore, is_scored, scored_rows
from slimml.runtime.tasks.inputs.pooling import Pooler
from slimml.convert.llm_check import is_language_model
from slimml.quantize.config import GuardConfig
from slimml.quantize.lm_guard import LanguageModelScore


@dataclass
class GuardResult:
    kept_float: dict[int, str] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)


class _Measure:
    def __init__(self, manifest, text, float_files, quant_files, held_feeds, guard: GuardConfig | None, device: str = "cpu",
                 eval_text=None, pooler: Pooler | None = None):
        self.manifest, self.text, self.device, self.pooler = manifest, text, device, pooler
        self.float_files, self.quant_files = float_files, quant_files
        self.feeds = held_feeds
        self.classifier: ClassifierScore | None = None
        float_chain = Chain(manifest, float_files, text, pooler=pooler)  # the float reference runs on the CPU
        self.lm = LanguageModelScore(manifest, float_files[0].parent, guard, float_chain, eval_text) if is_language_model(manifest) else None
        if self.lm is not None:  # a language model is judged by perplexity on held-out text, not output cosine
            self.reference = []
            self.eval_file = None
            return
        self.reference = [float_chain.run(f) for f in held_feeds]
        # a classifier (of inputs or tokens, or a question answerer's spans) is judged by its scores
        # (a cross-encoder's ranking), not its logits' cosine
        self.width = max((r["start_logits"].shape[1] for r in self.reference if "start_logits" in r), default=0)
        self.classifier = (ClassifierScore(manifest, [self._rows(r, f) for r, f in zip(self.reference, held_feeds)])
                           if is_scored(manifest) and self.reference else None)
        # an artifact without pooling (or of components) was refused --eval before any shard was quantized
        self.eval_file = guard.eval_file if guard is not None else None
        self.float_score = self._score(float_chain) if self.eval_file is not None else None

    def chain(self, float_set: set[int], only: int | None = None) -> Chain:
        files = []
        for i, f in enumerate(self.float_files):
            quantized = i in self.quant_files and i not in float_set and (only is None or i == only)
            files.append(self.quant_files[i] if quantized else f)
        return Chain(self.manifest, files, self.text, self.device, self.pooler)

    def agreement(self, chain: Chain) -> float:
        return self._agreement(chain)["agreement"]

    def _agreement(self, chain: Chain) -> dict[str, float]:
        if self.lm is not None:  # 1 / perplexity ratio: 1 when the quantized model predicts as the float one
            return {"agreement": self.lm.reference_ppl / self.lm.perplexity(chain)}
        if self.classifier is not None:
            return self.classifier.measure([self._rows(chain.run(f), f) for f in self.feeds])
        scores = [outputs_agreement(ref, chain.run(f), f.get("attention_mask"), self.pooler)
                  for ref, f in zip(self.reference, self.feeds)]
        return {"agreement": sum(scores) / len(scores)}

    def _rows(self, outputs: dict[str, Any], feeds: dict[str, Any]):
        return scored_rows(self.manifest, outputs, feeds, self.width)

    @property
    def metric(self) -> str:
        """What ``agreement`` measures (its check's name)."""
        return "perplexity" if self.lm is not None else self.classifier.metric if self.classifier is not None else "cosine"

    def _score(self, chain: Chain) -> float:
        from slimml.runtime.tools.evaluate import evaluate_sts

        return evaluate_sts(chain, self.eval_file).score

    def drop(self, chain: Chain, checks: dict[str, Any]) -> float:
        if self.lm is not None:
            return self.lm.drop(chain, checks)
        measured = self._agreement(chain)
        agree = measured["agreement"]
        checks[f"agreement_{self.metric}"] = round(agree, 6)
        if "top1" in measured:
            checks["agreement_top1"] = round(measured["top1"], 6)
        if self.eval_file is None:
            d = 100.0 * (1.0 - agree)
        else:
            score = self._score(chain)
            checks["eval_file"] = str(Path(self.eval_file).name)
            checks["eval_float"] = round(self.float_score, 4)
            checks["eval_quantized"] = round(score, 4)
            d = self.float_score - score
        checks["drop"] = round(d, 6)
        checks["drop_metric"] = "spearman_x100" if self.eval_file is not None else f"100*(1-{self.metric})"
        return d


LARGE_DROP = 10.0  # a drop (perplexity increase in %, or 100 x (1 - agreement)) reported as a warning without a guard


def apply_guard(manifest, text, float_files: list[Path], quant_files: dict[int, Path], held_feeds,
                guard: GuardConfig | None, step=lambda _m: None, device: str = "cpu", eval_text=None,
                pooler: Pooler | None = None) -> GuardResult:
    """Measure the drop; with a guard, return the shards to keep float so that it is at most ``max_drop``.

    Raises:
        ConfigError: ``max_drop`` cannot be met with at most ``max_float_shards`` float shards and
            ``keep_best`` is off.
    """
    m = _Measure(manifest, text, float_files, quant_files, held_feeds, guard, device, eval_text, pooler)
    checks: dict[str, Any] = {}
    drop = m.drop(m.chain(set()), checks)
    if guard is None or drop <= guard.max_drop:
        if guard is not None:
            checks["max_drop"] = guard.max_drop
        elif not drop <= LARGE_DROP:  # written, as asked, but not in silence (NaN too)
            lost = (f"the perplexity rose {drop:.1f}% against the float model" if m.metric == "perplexity" else
                    f"the outputs' {m.metric} agreement with the float model is {1 - drop / 100:.3f} (a drop of {drop:.1f})")
            checks["warning"] = (f"{lost}; check it on your data (slimml eval), or quantize with --max-drop to keep the most "
                                 "sensitive shards float")
            logging.getLogger("slimml").warning("slimml: %s", checks["warning"])
        return GuardResult({}, checks)
    spread = checks.get("drop_noise", 0.0)
    if drop - spread <= guard.max_drop and not guard.keep_best:  # a language model on too little text: no search on noise
        raise ConfigError(
            f"--max-drop {guard.max_drop} cannot be judged on this text: the perplexity rose {drop:.2f}% +- {spread:.2f}% "
            f"(95%) on its {checks.get('eval_tokens')} tokens ({checks.get('eval_text')}). "
            + (f"Give a longer text of your model's domain with --eval-text (up to {checks['eval_max_tokens']:,} of its "
               "tokens are scored), or a" if checks.get("eval_tokens", 0) < 0.9 * checks.get("eval_max_tokens", 0) else
               f"The {checks.get('eval_max_tokens', 0):,} tokens scored at most cannot tell it closer: give a")
            + f" --max-drop above {drop + spread:.1f} (--keep-best searches anyway and writes the best it measures). "
            "Nothing was written."
        )
    step("finding the shards most sensitive to quantization")
    sensitivity = {i: 1.0 - m.agreement(m.chain(set(), only=i)) for i in quant_files}
    order = sorted(sensitivity, key=sensitivity.get, reverse=True)
    # at most half of them stay float (past that, quantizing no longer pays): none of a one-shard model
    limit = guard.max_float_shards if guard.max_float_shards is not None else len(quant_files) // 2
    kept: dict[int, str] = {}
    best = (drop, {}, dict(checks))
    for i in order[:limit]:
        alone = (f"raised perplexity {1 / max(1 - sensitivity[i], 1e-12) - 1:.2%}" if m.metric == "perplexity"
                 else f"lowered the {m.metric} by {sensitivity[i]:.2e}")
        kept[i] = f"kept float by the accuracy guard: most sensitive left (quantized alone, it {alone})"
        step(f"re-measuring with {len(kept)} shard(s) float")
        trial: dict[str, Any] = {}
        drop = m.drop(m.chain(set(kept)), trial)
        if drop < best[0]:
            best = (drop, dict(kept), trial)
        if drop <= guard.max_drop:
            return GuardResult(dict(kept), {**trial, "max_drop": guard.max_drop, "max_drop_met": True})
    if guard.keep_best:
        return GuardResult(best[1], {**best[2], "max_drop": guard.max_drop, "max_drop_met": False})
    raise ConfigError(
        f"--max-drop {guard.max_drop} cannot be met: with the {len(kept)} most sensitive of {len(quant_files)} "
        f"quantized shards kept float the drop is still {best[0]:.4f} ({checks['drop_metric']}); with none "
        f"kept it is {checks['drop']:.4f}. Raise --max-drop, or add --keep-best to write the best model found. "
        "Nothing was written."
    )
