"""The accuracy guard's measure for a classifier: what its users read from it, not its logits' cosine.

The cosine of two rows of logits says little about a classifier, and nothing about a cross-encoder:
its one logit per input makes each row's cosine 1 whenever the two signs agree, so a reranker whose
quantized scores put the passages in another order passed with "agreement 1". The guard compares
the scores the task gives (:func:`slimml.runtime.tasks.classify.scores`), on held-out inputs made
as the model reads them:

- one output (a cross-encoder: a reranker, an STS scorer) or a regression: the Spearman rank
  correlation of the float and quantized scores over every held-out input (a ranking is what they
  are used for); the inputs are query-passage pairs (:func:`query_passage_pairs`);
- a softmax over labels: the probability mass that stays where it was, 1 - the mean total
  variation distance between the two distributions (with the top-1 agreement beside it);
- multi-label (a sigmoid a label): 1 - the mean absolute difference of the labels' probabilities.

A token classifier (named entities) is a classifier of each real token: its rows are the tokens'
logits, padding left out. An extractive question answerer is two classifiers over positions, the
answer's start and its end: its rows are each pair's start and end logits over its real tokens
(padding can never be chosen), read from question-passage pairs; its ``top1`` is how often the most
likely start and end stay where they were.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from slimml.runtime.tasks.classify import scores
from slimml.runtime.tools.evaluate import spearman

QUERY_WORDS = 6  # a query made of a text's first words, as short as searches are


def is_classifier(manifest: Any) -> bool:
    """A classifier of whole inputs: labels, and logits out, one row an input."""
    return manifest.labels is not None and any(t.name == "logits" and len(t.shape) == 2 for t in manifest.outputs)


def is_scored(manifest: Any) -> bool:
    """A model the guard judges by the scores its task reads (:func:`scored_rows`): a classifier of
    inputs or of tokens, or an extractive question answerer."""
    return is_classifier(manifest) or _tokens_classified(manifest) or _answers(manifest)


def _tokens_classified(manifest: Any) -> bool:
    return manifest.labels is not None and any(t.name == "logits" and len(t.shape) == 3 for t in manifest.outputs)


def _answers(manifest: Any) -> bool:
    return {"start_logits", "end_logits"} <= {t.name for t in manifest.outputs}


def scored_rows(manifest: Any, outputs: dict[str, np.ndarray], feeds: dict[str, np.ndarray], width: int) -> np.ndarray:
    """The rows of logits whose scores the task reads, from a chain's ``outputs`` on ``feeds``: an
    input's (a classifier), each real token's (a token classifier), or each input's start and end
    over its real tokens, padded to ``width`` positions that no softmax chooses (a question answerer)."""
    if is_classifier(manifest):
        return outputs["logits"]
    positions = outputs["start_logits" if _answers(manifest) else "logits"].shape[:2]
    mask = feeds["attention_mask"].astype(bool) if "attention_mask" in feeds else np.ones(positions, dtype=bool)
    if not _answers(manifest):
        return outputs["logits"][mask]
    rows = np.full((2 * len(mask), width), -1e4, dtype=np.float64)  # finite: a softmax gives it ~0, never NaN
    for k, name in enumerate(("start_logits", "end_logits")):
        block = rows[k * len(mask):(k + 1) * len(mask), : mask.shape[1]]
        block[mask] = outputs[name][mask]
    return rows


def reads_pairs(manifest: Any) -> bool:
    """A model of pairs of texts: a cross-encoder (it scores a query and a passage with one output,
    or its sentence-transformers config says it is one), or a question answerer (a question and a
    passage)."""
    cross = is_classifier(manifest) and (len(manifest.labels) == 1 or "cross_encoder_activation" in manifest.source)
    return cross or _answers(manifest)


def query_passage_pairs(texts: list[str]) -> list[tuple[str, str]]:
    """Pairs as a reranker meets them, from plain texts: each text's first words as the query, with
    its own text (a passage that answers it) and with the next text (one that does not; a single
    text's own words backwards)."""
    pairs = []
    for i, text in enumerate(texts):
        words = text.split()
        query = " ".join(words[:QUERY_WORDS]) or text
        other = texts[(i + 1) % len(texts)] if len(texts) > 1 else " ".join(words[::-1]) + " ."
        pairs += [(query, text), (query, other)]
    return pairs


class ClassifierScore:
    """Compare a chain's held-out logits with the float chain's, as the task's scores.

    Args:
        manifest: the float artifact's manifest (its labels and ``problem_type``).
        reference: the float chain's logits, one array per held-out batch.
    """

    def __init__(self, manifest: Any, reference: list[np.ndarray]):
        self.problem_type = manifest.source.get("problem_type")
        width = reference[0].shape[-1]
        self.metric = ("spearman" if width == 1 or self.problem_type == "regression"
                       else "label_probability" if self.problem_type == "multi_label_classification" else "probability")
        self.reference = scores(np.concatenate(reference), self.problem_type)

    def measure(self, logits: list[np.ndarray]) -> dict[str, float]:
        """``agreement`` (1 when the scores are the float model's) and, for a softmax, ``top1``."""
        got = scores(np.concatenate(logits), self.problem_type)
        if not np.isfinite(got).all():  # NaN or inf out: nothing agrees (ranks would place them anywhere)
            return {"agreement": 0.0, **({"top1": 0.0} if self.metric == "probability" else {})}
        if self.metric == "spearman":  # each output's ranking (a regression may have several, on scales of their own)
            return {"agreement": float(np.mean([_ranked(self.reference[:, k], got[:, k]) for k in range(got.shape[1])]))}
        if self.metric == "label_probability":
            return {"agreement": float(1.0 - np.abs(self.reference - got).mean())}
        return {"agreement": float(1.0 - 0.5 * np.abs(self.reference - got).sum(axis=1).mean()),
                "top1": float((self.reference.argmax(axis=1) == got.argmax(axis=1)).mean())}


def _ranked(want: np.ndarray, got: np.ndarray) -> float:
    """The Spearman correlation of ``got`` with ``want``; an output constant over the held-out
    inputs has no ranking, and agrees where the values are equal."""
    rho = spearman(want, got)
    return rho if np.isfinite(rho) else float(np.allclose(want, got, rtol=1e-3, atol=1e-3))
