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
"""

from __future__ import annotations

from typing import Any

import numpy as np

from slimml.runtime.tasks.classify import scores
from slimml.runtime.tools.evaluate import spearman

QUERY_WORDS = 6  # a query made of a text's first words, as short as searches are


def is_classifier(manifest: Any) -> bool:
    """A classifier of whole inputs: labels, and logits out, one row an input (a token classifier's
    logits, one row a token, are compared by their cosine on the real tokens)."""
    return manifest.labels is not None and any(t.name == "logits" and len(t.shape) == 2 for t in manifest.outputs)


def reads_pairs(manifest: Any) -> bool:
    """A cross-encoder: it scores a pair of texts (a query and a passage) with one output, or its
    sentence-transformers config says it is one."""
    return is_classifier(manifest) and (len(manifest.labels) == 1 or "cross_encoder_activation" in manifest.source)


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
