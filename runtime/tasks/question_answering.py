"""Extractive question answering (``...ForQuestionAnswering``: SQuAD models): a question and a
context in, the span of the context that answers it out, as transformers'
``pipeline("question-answering")`` finds it.

The question and the context are read together (question first; context first where the tokenizer
pads on the left, as XLNet's does, and then the whole input may hold the answer, as the pipeline
reads it); a context longer than the model
reads is cut into windows of ``max_seq_len`` tokens overlapping by ``doc_stride``. In each window
the start and end scores are softmaxes over the context's tokens (and the first token, which
models trained on SQuAD 2.0 point at for "no answer"); a span's score is its start's times its
end's, its end at most ``max_answer_len`` tokens after its start. The best spans of every window
are turned into character offsets (widened to whole words), the same text found in several
windows adds up its scores, and the ``top_k`` best are returned.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers import Tokenizer

from slimml.errors import FeedError
from slimml.runtime.tasks.base import Task, check_batch, check_unicode, register_task
from slimml.runtime.tasks.inputs.text import listed, window_outputs
from slimml.runtime.tasks.limits import shown


@register_task("question-answering")
class QuestionAnswerer(Task):
    """An extractive question answerer: ``answer(question, context)``.

    Example:
        >>> load("artifacts/distilbert-base-cased-distilled-squad").answer("Where do I live?", "My name is Wolfgang and I live in Berlin.")
        {'score': 0.98, 'start': 34, 'end': 40, 'answer': 'Berlin'}
    """

    methods = frozenset({"answer"})
    suggest = ("answer",)

    @property
    def capabilities(self) -> frozenset[str]:
        return super().capabilities if self.text is not None else super().capabilities - {"answer"}

    def answer(self, question: str | list[str], context: str | list[str] | None = None, top_k: int = 1, doc_stride: int | None = None,
               max_answer_len: int = 15, max_seq_len: int | None = None, handle_impossible_answer: bool = False,
               align_to_words: bool = True, batch_size: int = 32) -> Any:
        """The span of ``context`` that answers ``question``: ``{"score", "start", "end", "answer"}``
        (``start``/``end`` character offsets into the context), or a list of the ``top_k`` best; for
        lists of questions and contexts (one context a question), one such result each. As
        transformers' question-answering pipeline gives them, with the same arguments.

        Args:
            question, context: texts, or lists of texts of one length (a single text goes with
                each text of the other list).
            top_k: answers a question.
            doc_stride: tokens two windows of a long context share (default: half a window, at most 128).
            max_answer_len: tokens an answer has at most.
            max_seq_len: tokens a window holds, question included (default: the model's, at most 384).
            handle_impossible_answer: also offer the empty answer ("no answer in the context").
            align_to_words: widen an answer to the whole words it touches.
            batch_size: windows a model call.

        Returns:
            For one question and one context, ``{"score": float, "start": int, "end": int, "answer": str}``,
            or, where ``top_k`` > 1 finds several, a list of up to ``top_k`` of them, best first; for
            lists, one such result a question, in order.

        Raises:
            TaskError: the artifact ships no tokenizer.
            FeedError: an empty question or context, lists of different lengths, an argument out
                of range (``doc_stride`` not below ``max_seq_len``, ``max_seq_len`` past the
                model's), or a question that leaves no room for the context in a window.
        """
        if not self.supports("answer"):
            raise self.unsupported("answer")
        single = isinstance(question, str) and isinstance(context, str)
        questions, contexts = _texts("question", listed(question)), _texts("context", listed(context))
        if isinstance(question, str) and len(contexts) > 1:  # one question asked of each context
            questions *= len(contexts)
        elif isinstance(context, str) and len(questions) > 1:  # each question of one context
            contexts *= len(questions)
        if len(questions) != len(contexts):
            raise FeedError(f"give one context a question: got {len(questions)} questions and {len(contexts)} contexts.")
        _whole("top_k", top_k, 1)
        _whole("max_answer_len", max_answer_len, 1)
        for name, value in (("handle_impossible_answer", handle_impossible_answer), ("align_to_words", align_to_words)):
            if not isinstance(value, (bool, np.bool_)):  # "no" read as True before
                raise FeedError(f"{name} must be True or False, got {shown(value)}.")
        size = check_batch(batch_size)
        seq = min(self.text.max_length, 384) if max_seq_len is None else _whole("max_seq_len", max_seq_len, 2)
        if seq > self.text.max_length:
            raise FeedError(f"max_seq_len must be at most {self.text.max_length}, the tokens this model reads; got {seq}.")
        max_answer_len = min(max_answer_len, seq)  # no span is longer than a window (and numpy's offsets stay ints)
        stride = min(seq // 2, 128) if doc_stride is None else _whole("doc_stride", doc_stride, 0)
        if stride >= seq:
            raise FeedError(f"doc_stride ({stride}) must be smaller than max_seq_len ({seq}).")
        self.limits.check_whole(questions, "question")  # a context is read whole, in windows: never cut silently
        self.limits.check_whole(contexts, "context")
        first = self.manifest.tokenizer.get("padding_side") != "left"  # the question first, as nearly every model reads it
        windows = self._windows(questions, contexts, seq, stride, first)
        logits = window_outputs(self.engine.run, self.text, [enc for _, enc in windows], size, ("start_logits", "end_logits"))
        spans = _Spans(self.manifest.tokenizer.get("cls_token"), self.text.tokenizer, first)
        found: list[dict[str, dict[str, Any]]] = [{} for _ in questions]  # lower-case text -> answer, first found first
        null = [1e6] * len(questions)
        for (i, enc), got in zip(windows, logits):
            null[i] = spans.add(found[i], contexts[i], enc, got["start_logits"], got["end_logits"], top_k, max_answer_len, handle_impossible_answer,
                                align_to_words, null[i])
        results = []
        for by_text, none in zip(found, null):
            answers = list(by_text.values())
            if handle_impossible_answer:
                answers.append({"score": none, "start": 0, "end": 0, "answer": ""})
            best = sorted(answers, key=lambda a: a["score"], reverse=True)[:top_k]
            results.append(best[0] if len(best) == 1 else best)
        return results[0] if single else results

    def _windows(self, questions: list[str], contexts: list[str], seq: int, stride: int,
                 question_first: bool) -> list[tuple[int, Any]]:
        q, c = self.text.token_counts(questions), self.text.token_counts(contexts)
        specials = self.text.special_tokens(True)
        for i, (nq, nc) in enumerate(zip(q, c)):  # the tokenizer cannot cut a context into windows that leave it no room
            room = seq - specials - nq
            if nq + nc + specials > seq and room <= stride:
                raise FeedError(f"question {i} ({nq} tokens) leaves {max(room, 0)} tokens of each {seq}-token window for "
                                f"the context, not more than doc_stride {stride}; shorten the question, or give a larger "
                                "max_seq_len or a smaller doc_stride.")
        pairs = zip(questions, contexts) if question_first else zip(contexts, questions)
        self.limits.check_windows(c, [seq - specials - nq for nq in q], stride, seq)  # before the windows are made
        return self.text.windows(list(pairs), seq, stride, "only_second" if question_first else "only_first")


class _Spans:
    """One window's best spans, as the pipeline finds them (``select_starts_ends``, ``decode_spans``)."""

    def __init__(self, cls_token: Any, tokenizer: Tokenizer, question_first: bool):
        self.cls_id = tokenizer.token_to_id(cls_token) if isinstance(cls_token, str) else None
        self.question_first = question_first
        self.context = 1 if question_first else 0  # the context's sequence index in a window

    def add(self, answers: dict[str, dict[str, Any]], context: str, enc: Any, start: np.ndarray, end: np.ndarray, top_k: int,
            max_answer_len: int, impossible: bool, align: bool, null: float) -> float:
        """Add the window's best spans to ``answers`` (by lower-case text: the same text's scores
        summed); return the smallest no-answer score so far."""
        ids = np.asarray(enc.ids)
        # 1: not context (question, specials); context first: nothing is masked, as the pipeline reads it
        p_mask = np.array([s != 1 and self.question_first for s in enc.sequence_ids], dtype=np.int64)
        if self.cls_id is not None:
            p_mask[ids == self.cls_id] = 0
        elif enc.special_tokens_mask[0]:  # an artifact that did not record its CLS token: the first special one
            p_mask[0] = 0
        wanted = (1 - p_mask)[None]  # (1, tokens): 1 where an answer may be
        masked = wanted == 0
        start = np.where(masked, -10000.0, start[None])
        end = np.where(masked, -10000.0, end[None])
        start = np.exp(start - start.max(axis=-1, keepdims=True))
        start = start / start.sum()
        end = np.exp(end - end.max(axis=-1, keepdims=True))
        end = end / end.sum()
        if impossible:
            null = min(null, float(start[0, 0] * end[0, 0]))
        start[0, 0] = end[0, 0] = 0.0
        for s, e, score in zip(*_decode(start, end, top_k * 2 + 10 if align else top_k, max_answer_len, wanted)):
            lo, hi = _chars(enc, int(s), int(e), align, self.context)
            text = context[lo:hi]
            same = answers.get(text.lower())  # the pipeline's case-blind match, without its search of every answer
            if same is not None:
                same["score"] += float(score)
            else:
                answers[text.lower()] = {"score": float(score), "start": lo, "end": hi, "answer": text}
        return null


def _decode(start: np.ndarray, end: np.ndarray, topk: int, max_answer_len: int, wanted: np.ndarray):
    """The ``topk`` best (start, end, score) of the spans of at most ``max_answer_len`` tokens."""
    candidates = np.tril(np.triu(np.matmul(start[..., None], end[:, None])), max_answer_len - 1)
    flat = candidates.flatten()
    if topk == 1:
        order = np.array([np.argmax(flat)])
    elif len(flat) < topk:
        order = np.argsort(-flat)
    else:
        best = np.argpartition(-flat, topk)[0:topk]
        order = best[np.argsort(-flat[best])]
    starts, ends = np.unravel_index(order, candidates.shape)[1:]
    allowed = wanted.nonzero()  # (rows, columns), both taken as positions, as the pipeline does (row 0: the first token)
    keep = np.isin(starts, allowed) & np.isin(ends, allowed)
    starts, ends = starts[keep], ends[keep]
    return starts, ends, candidates[0, starts, ends]


def _chars(enc: Any, s: int, e: int, align: bool, context: int) -> tuple[int, int]:
    """Character offsets in the context (sequence ``context`` of the window) of tokens ``s`` to
    ``e``, widened to whole words with ``align``."""
    if align:
        try:
            return (enc.word_to_chars(enc.token_to_word(s), sequence_index=context)[0],
                    enc.word_to_chars(enc.token_to_word(e), sequence_index=context)[1])
        except Exception:  # a token without a word (the tokenizer's words do not cover it): its own offsets
            pass
    return enc.offsets[s][0], enc.offsets[e][1]


def _texts(name: str, value: Any) -> list[str]:
    """``value`` as a list of non-empty texts, or FeedError naming ``name``."""
    texts = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) and value else None
    if texts is None:
        raise FeedError(f"{name} must be a non-empty text, or a list of them (as many questions as contexts).")
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()), None)
    if bad is not None:
        raise FeedError(f"{name} {bad} must be a non-empty text, got {texts[bad]!r:.40}.")
    check_unicode(texts)
    return texts


def _whole(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise FeedError(f"{name} must be a whole number >= {least}, got {shown(value)}.")
    return value
