"""Token classification (``...ForTokenClassification``: named entities, parts of speech): texts in,
labelled spans of them out, as transformers' ``pipeline("token-classification")`` makes them.

Each token's scores are the softmax of its logits; special tokens are left out; a token is a piece
of the word before it where the tokenizer says so (a WordPiece ``##`` or a BPE continuing prefix;
for other tokenizers, no space before it). The aggregation strategies are the pipeline's:

- ``none``: every token with its best label (``entity``, ``index``);
- ``simple``: neighbouring tokens of one entity type grouped into an ``entity_group`` (a ``B-``
  label starts a new group), its score the mean of theirs;
- ``first``, ``average``, ``max``: each word first gets one label (its first token's, the average
  of its tokens' scores, or its best-scoring token's), then words are grouped as ``simple`` does.

Labels in ``ignore_labels`` (``O``, outside any entity) are dropped. With ``stride``, a text longer
than the model reads is read in overlapping windows and their entities merged (the longer, then
the more confident, of two overlapping ones is kept).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers import Tokenizer

from slimml.errors import FeedError
from slimml.runtime.tasks.base import Task, check_batch, check_unicode, register_task
from slimml.runtime.tasks.inputs.text import listed, window_outputs
from slimml.runtime.tasks.limits import shown

AGGREGATIONS = ("none", "simple", "first", "average", "max")


@register_task("token-classification")
class TokenClassifier(Task):
    """A token classifier: ``entities(texts)`` with the source config's labels.

    Example:
        >>> load("artifacts/bert-base-NER").entities(["Angela Merkel visited Paris."])
        [[{'entity_group': 'PER', 'score': 0.998, 'word': 'Angela Merkel', 'start': 0, 'end': 13},
          {'entity_group': 'LOC', 'score': 0.999, 'word': 'Paris', 'start': 22, 'end': 27}]]
    """

    methods = frozenset({"entities"})
    suggest = ("entities",)

    @property
    def capabilities(self) -> frozenset[str]:
        return super().capabilities if self.text is not None else super().capabilities - {"entities"}

    def entities(self, texts: list[str], aggregation: str = "simple", ignore_labels: Any = ("O",),
                 stride: int | None = None, batch_size: int = 32) -> list[list[dict[str, Any]]]:
        """Per text, its labelled spans: ``{"entity_group", "score", "word", "start", "end"}`` (or,
        with ``aggregation="none"``, one ``{"entity", "score", "index", "word", "start", "end"}`` a
        token), ``start``/``end`` character offsets into the text; as transformers' token
        classification pipeline gives them with the same ``aggregation_strategy``, ``ignore_labels``
        and ``stride``.

        Args:
            texts: the texts (a list; wrap one as ``[text]``).
            aggregation: ``none``, ``simple`` (the default), ``first``, ``average`` or ``max``.
            ignore_labels: labels left out (``O``: outside any entity).
            stride: read a text longer than the model's length in windows that overlap by this many
                tokens, instead of cutting it (not with ``aggregation="none"``); a text longer than
                ``model.limits.max_text_chars`` is then refused, not cut.
            batch_size: windows a model call.

        Returns:
            One list of entity dicts a text; ``score`` a float, ``start``/``end`` ints, ``word`` the
            span as the tokenizer decodes it (lower-cased by an uncased one).

        Raises:
            TaskError: the artifact ships no tokenizer.
            FeedError: not a non-empty list of texts, an unknown ``aggregation``,
                ``ignore_labels`` that is not a list of labels, or ``stride`` out of range or
                with ``aggregation="none"``.
        """
        if not self.supports("entities"):
            raise self.unsupported("entities")
        texts = listed(texts)
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)) or not texts:
            raise FeedError("entities() takes a non-empty list of texts; wrap a single text as [text].")
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise FeedError(f"texts[{bad}] must be a text, got {type(texts[bad]).__name__}.")
        check_unicode(texts)
        if aggregation not in AGGREGATIONS:
            raise FeedError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {shown(aggregation)}.")
        if ignore_labels is None:  # the pipeline's default
            ignore_labels = ("O",)
        if isinstance(ignore_labels, str) or not isinstance(ignore_labels, (list, tuple, set, frozenset)) or not all(
                isinstance(x, str) for x in ignore_labels):
            raise FeedError(f'ignore_labels must be a list of labels, e.g. ["O"], got {shown(ignore_labels)}.')
        size = check_batch(batch_size)
        windows = self._windows(texts, aggregation, stride)
        scores = self._scores([enc for _, enc in windows], size)
        words = _Words(self.text.tokenizer, self.manifest.labels, self.manifest.tokenizer.get("unk_token"))
        found: list[list[list[dict[str, Any]]]] = [[] for _ in texts]
        for (i, enc), s in zip(windows, scores):  # offsets index into the text (the tokenizer read a prefix of it)
            found[i].append(words.entities(texts[i], enc, s, aggregation, set(ignore_labels)))
        return [_merge_windows(parts) if len(parts) > 1 else parts[0] for parts in found]

    def _windows(self, texts: list[str], aggregation: str, stride: int | None) -> list[tuple[int, Any]]:
        """(text index, encoding) per window: one a text, or with ``stride`` as many as it takes."""
        if stride is None:
            return list(enumerate(self.text.encodings(list(texts))))
        if aggregation == "none":
            raise FeedError("stride reads a long text in overlapping windows, whose tokens only an aggregation can merge; "
                            "give aggregation='simple' (or first, average, max), or leave stride out.")
        limit = self.text.max_length
        room = limit - self.text.special_tokens(False)  # a window's tokens besides its special ones
        if isinstance(stride, bool) or not isinstance(stride, int) or not 0 <= stride < room:
            raise FeedError(f"stride must be a whole number from 0 to {room - 1} (windows of {limit} tokens, {room} of "
                            f"them text), got {shown(stride)}.")
        self.limits.check_whole(list(texts), "text")  # windows promise the whole text: nothing is cut silently
        counts = self.text.token_counts(list(texts))
        self.limits.check_windows(counts, [room] * len(counts), stride, limit)  # before the windows are made
        return self.text.windows(list(texts), limit, stride)

    def _scores(self, encs: list, size: int) -> list[np.ndarray]:
        """Each window's (tokens, labels) softmax scores, float32 as the pipeline computes them."""
        labels = len(self.manifest.labels)
        out = []
        for got in window_outputs(self.engine.run, self.text, encs, size, ("logits",)):
            x = got["logits"]
            if x.ndim != 2 or x.shape[1] != labels:
                raise FeedError(f"the artifact's logits have {x.shape[1:] or 'no'} values a token, not {labels} labels; "
                                "convert the model again.")
            e = np.exp(x - x.max(axis=-1, keepdims=True))
            out.append(e / e.sum(axis=-1, keepdims=True))
        return out


class _Words:
    """Tokens into labelled words and spans, as transformers' pipeline makes them."""

    def __init__(self, tokenizer: Tokenizer, labels: list[str], unk_token: str | None):
        self.labels = labels
        self.decoder = tokenizer.decoder
        self.word_aware = bool(getattr(tokenizer.model, "continuing_subword_prefix", None))
        self.unk_id = tokenizer.token_to_id(unk_token) if unk_token else None

    def entities(self, text: str, enc: Any, scores: np.ndarray, aggregation: str, ignore: set[str]) -> list[dict[str, Any]]:
        tokens = self._tokens(text, enc, scores)
        if aggregation in ("none", "simple"):
            found = [{"entity": self.labels[int(t["scores"].argmax())], "score": float(t["scores"].max()), "index": t["index"],
                      "word": t["word"], "start": t["start"], "end": t["end"]} for t in tokens]
        else:
            found = [self._word(group, aggregation) for group in _word_groups(tokens)]
        if aggregation != "none":
            found = self._groups(found)
        return [e for e in found if e.get("entity", e.get("entity_group")) not in ignore]

    def _tokens(self, text: str, enc: Any, scores: np.ndarray) -> list[dict[str, Any]]:
        out = []
        for idx, (token, (start, end)) in enumerate(zip(enc.tokens, enc.offsets)):
            if enc.special_tokens_mask[idx]:
                continue
            ref = text[start:end]
            if self.word_aware:  # a word-aware tokenizer: a piece is longer or shorter than its text (##ing)
                subword = len(token) != len(ref)
            else:  # the pipeline's heuristic: no space before it
                subword = start > 0 and " " not in text[start - 1:start + 1]
            if self.unk_id is not None and enc.ids[idx] == self.unk_id:
                token, subword = ref, False
            out.append({"word": token, "scores": scores[idx], "start": start, "end": end, "index": idx, "is_subword": subword})
        return out

    def _text(self, tokens: list[str]) -> str:
        return self.decoder.decode(tokens) if self.decoder is not None else " ".join(tokens)

    def _word(self, group: list[dict[str, Any]], aggregation: str) -> dict[str, Any]:
        if aggregation == "first":
            scores = group[0]["scores"]
        elif aggregation == "max":
            scores = max(group, key=lambda t: t["scores"].max())["scores"]
        else:  # average
            scores = np.nanmean(np.stack([t["scores"] for t in group]), axis=0)
        best = int(scores.argmax())
        return {"entity": self.labels[best], "score": float(scores[best]), "word": self._text([t["word"] for t in group]),
                "start": group[0]["start"], "end": group[-1]["end"]}

    def _groups(self, entities: list[dict[str, Any]]) -> list[dict[str, Any]]:
        groups: list[list[dict[str, Any]]] = []
        for e in entities:
            bi, tag = _tag(e["entity"])
            if groups and tag == _tag(groups[-1][-1]["entity"])[1] and bi != "B":
                groups[-1].append(e)
            else:
                groups.append([e])
        return [{"entity_group": g[0]["entity"].split("-", 1)[-1], "score": float(np.nanmean([e["score"] for e in g])),
                 "word": self._text([e["word"] for e in g]), "start": g[0]["start"], "end": g[-1]["end"]} for g in groups]


def _word_groups(tokens: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    groups: list[list[dict[str, Any]]] = []
    for t in tokens:
        if groups and t["is_subword"]:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups


def _tag(label: str) -> tuple[str, str]:
    """``("B", "PER")`` for ``B-PER``; a label without a B-/I- prefix continues (``I``)."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def _merge_windows(parts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The entities of a text's overlapping windows, overlaps resolved: the longer span, then the
    more confident, is kept."""
    entities = sorted((e for p in parts for e in p), key=lambda e: e["start"])
    if not entities:
        return []
    kept, last = [], entities[0]
    for e in entities:
        if last["start"] <= e["start"] < last["end"]:
            n, m = e["end"] - e["start"], last["end"] - last["start"]
            if n > m or (n == m and e["score"] > last["score"]):
                last = e
        else:
            kept.append(last)
            last = e
    kept.append(last)
    return kept
