"""Accuracy of an artifact: on sentence-similarity data (STS style) for an embedding model, as
perplexity on a text for a language model."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slimml.errors import ArtifactError, DataError
from slimml.runtime.tasks.generation.scoring import EVAL_TOKENS

STS_COLUMNS = ("sentence1", "sentence2", "score")


def read_sts(path: str | os.PathLike) -> tuple[list[str], list[str], np.ndarray]:
    """Read a CSV with a header and the columns ``sentence1,sentence2,score``.

    Raises:
        DataError: the file is missing, empty, lacks a column or holds a non-numeric score.
    """
    path = Path(path)
    check_data_file(path, "data file", f"give a CSV with columns {','.join(STS_COLUMNS)}")
    try:
        return _read_sts(path)
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start}); save the CSV as UTF-8, or convert it "
                        "(iconv -t UTF-8).") from None
    except csv.Error as e:
        raise DataError(f"{path} is not a CSV of sentence pairs ({e}); give a CSV with columns "
                        f"{','.join(STS_COLUMNS)} (a language model is scored on a plain text file instead).") from None


def allow_long_csv_fields() -> None:
    """Let the csv module read fields past its default limit of 128 KB (a long document is a text
    too: it was refused as "field larger than field limit"). The limit is the process's: raised, not put
    back (putting it back races with another thread reading), and never lowered."""
    if csv.field_size_limit() < (1 << 31) - 1:
        csv.field_size_limit((1 << 31) - 1)


def check_data_file(path: Path, kind: str, fix: str) -> None:
    """Refuse, naming ``kind`` and ``fix``, a ``path`` that is not a regular file: a folder, a pipe
    or device (``/dev/stdin``: read once, it cannot be read again), or nothing.

    Raises:
        DataError: saying which.
    """
    if path.is_dir():
        raise DataError(f"{kind} {path} is a folder, not a file; {fix}.")
    if os.path.exists(path) and not path.is_file():
        raise DataError(f"{kind} {path} is a pipe or device, not a file (it is read more than once); save it to a file "
                        f"first; {fix}.")
    if not path.is_file():
        raise DataError(f"{kind} {path} does not exist; {fix}.")


def _read_sts(path: Path) -> tuple[list[str], list[str], np.ndarray]:
    s1: list[str] = []
    s2: list[str] = []
    scores: list[float] = []
    allow_long_csv_fields()
    with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's byte-order mark is not a column name
        reader = csv.DictReader(f)
        missing = [c for c in STS_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            header = repr(reader.fieldnames)
            header = header if len(header) <= 120 else header[:117] + "..."
            raise DataError(
                f"{path} lacks the column(s) {missing} (header: {header}); the first line must be "
                f"{','.join(STS_COLUMNS)} (a language model is scored on a plain text file instead)."
            )
        for line, row in enumerate(reader, start=2):
            if any(row.get(c) is None for c in STS_COLUMNS):  # csv fills a short row's missing fields with None
                raise DataError(f"{path}:{line}: the row has fewer fields than the header; give each of "
                                f"{','.join(STS_COLUMNS)} (quote a sentence that holds a comma).")
            try:
                score = float(row["score"])
            except (TypeError, ValueError):
                raise DataError(f"{path}:{line}: score {row['score']!r} is not a number; give the pair's gold score as "
                                "a number (e.g. 3.8).") from None
            if not np.isfinite(score):
                raise DataError(f"{path}:{line}: score {row['score']!r} is not a finite number; give the pair's gold score.")
            scores.append(score)
            s1.append(row["sentence1"] or "")
            s2.append(row["sentence2"] or "")
    if not scores:
        raise DataError(f"{path} has a header but no rows; give at least two sentence pairs.")
    if not any(s.strip() for s in s1 + s2):
        raise DataError(f"every sentence in {path} is empty; give pairs of sentences to compare.")
    if len(scores) > 1 and min(scores) == max(scores):
        raise DataError(f"every score in {path} is {scores[0]:g}; a rank correlation needs gold scores that differ: give "
                        "pairs of different similarity.")
    return s1, s2, np.asarray(scores, dtype=np.float64)


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties get their average rank (as scipy.stats.rankdata)."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(len(x), dtype=np.float64)
    bounds = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1], True])
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        ranks[order[lo:hi]] = (lo + hi + 1) / 2.0
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = rankdata(np.asarray(a, dtype=np.float64)), rankdata(np.asarray(b, dtype=np.float64))
    ra -= ra.mean()
    rb -= rb.mean()
    return float((ra * rb).sum() / np.sqrt((ra * ra).sum() * (rb * rb).sum()))


@dataclass
class EvalResult:
    metric: str
    score: float
    count: int  # how many ``unit`` were scored
    unit: str = "pairs"  # sentence pairs (spearman) or tokens (perplexity)
    settings: dict = field(default_factory=dict)  # what else a baseline must match (window, max_tokens; batch_size)

    def to_json(self) -> dict:
        return {"metric": self.metric, "score": round(self.score, 4), self.unit: self.count, **self.settings}


def evaluate_sts(model, path: str | os.PathLike, batch_size: int = 32, show_progress: bool = False) -> EvalResult:
    """Spearman x100 between the cosine similarity of the two sentences' embeddings and the gold score."""
    s1, s2, gold = read_sts(path)
    if len(gold) < 2:
        raise DataError(f"{path} has fewer than two pairs; a rank correlation needs at least two: give more pairs.")
    both = model.encode(list(s1) + list(s2), batch_size=batch_size, show_progress=show_progress)  # one length sort
    e1, e2 = both[: len(s1)], both[len(s1):]
    cos = (e1 * e2).sum(axis=1) / np.clip(np.linalg.norm(e1, axis=1) * np.linalg.norm(e2, axis=1), 1e-12, None)
    broken = np.flatnonzero(~np.isfinite(cos))
    if broken.size:  # NaN would take arbitrary ranks and a score that means nothing
        raise ArtifactError(f"the model gave NaN or infinite embeddings for {broken.size} of {len(cos)} pairs (the first: "
                            f"pair {broken[0] + 1} of {path}); the artifact computes wrongly: convert it again, or "
                            "quantize it with another recipe.")
    # the batch size is a setting: dynamic int8 quantizes a batch's activations with one scale, so a
    # sentence's company moves an int8 model's score by ~0.1 (fp32 scores the same at any size)
    settings = {"batch_size": batch_size}
    if np.ptp(cos) == 0:  # a model that ranks nothing (a collapsed student or quantized chain) correlates with nothing
        return EvalResult(metric="spearman", score=0.0, count=len(gold), settings=settings)
    return EvalResult(metric="spearman", score=100.0 * spearman(cos, gold), count=len(gold), settings=settings)


def read_text(path: str | os.PathLike) -> str:
    """A UTF-8 text file to score a language model on.

    Raises:
        DataError: the file is missing, not UTF-8 text, or empty.
    """
    path = Path(path)
    check_data_file(path, "text file", "give a UTF-8 text file to measure perplexity on")
    try:
        text = path.read_text(encoding="utf-8-sig")  # an editor's byte-order mark is no text to score
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start}); give a UTF-8 text file, or convert it "
                        "(iconv -t UTF-8).") from None
    if not text.strip():
        raise DataError(f"{path} is empty; give a text to measure perplexity on.")
    return text


def evaluate_perplexity(model, path: str | os.PathLike, window: int | None = None, max_tokens: int | None = None) -> EvalResult:
    """The perplexity of a language model over a text file (lower is better); see ``model.perplexity``."""
    got = model.perplexity(read_text(path), window=window, max_tokens=max_tokens)
    if not np.isfinite(got.perplexity):  # NaN is no score, and no valid JSON either; a baseline of it gates nothing
        raise ArtifactError(f"the model gave NaN or infinite log-probabilities on {path} (perplexity {got.perplexity}); "
                            "the artifact computes wrongly: convert it again, or quantize it with another recipe.")
    return EvalResult(metric="perplexity", score=got.perplexity, count=got.tokens, unit="tokens",
                      settings={"window": got.window_limit, "windows": got.windows,  # the window asked: what a rerun asks
                                "max_tokens": EVAL_TOKENS if max_tokens is None else max_tokens})
