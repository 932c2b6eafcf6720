"""Beam search for decoders (``GenerationConfig.num_beams``): transformers' beam search, the one
encoder-decoders run (:func:`~slimml.runtime.tasks.seq2seq_search.beam_search`), over a decode
loop of ``num_beams`` cache rows a prompt, whose rows follow the surviving beams each step. Each
prompt is prefilled once, its cache copied to its beams' rows.

The prompts are left-padded to the longest, as transformers pads a batch for a decoder: the
length penalty counts the new tokens, and the repetition penalty and no-repeat n-grams read the
padded rows, as its processors do."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from slimml.errors import FeedError
from slimml.runtime.engine.kv_cache import rope_reprefill, rope_switch
from slimml.runtime.tasks.generation.config import GenerationConfig
from slimml.runtime.tasks.generation.loop import decode_loop
from slimml.runtime.tasks.generation.prompts import Prompts
from slimml.runtime.tasks.seq2seq_search import Search, beam_search


class _Cancelled(Exception):
    """``cancel`` was set between two passes."""


class _Steps:
    """A decode loop as beam search's decoder: ``step`` feeds the beams' newest tokens and returns
    the next logits (on the first call, the prompts' logits, computed once a prompt and given to each
    of its beams); ``reorder`` keeps the survivors' rows."""

    def __init__(self, loop: Any, first: np.ndarray, cancel: threading.Event | None):
        self.loop, self.first, self.cancel = loop, first, cancel

    def step(self, tokens: np.ndarray) -> np.ndarray:
        if self.cancel is not None and self.cancel.is_set():
            raise _Cancelled
        if self.first is not None:
            first, self.first = self.first, None
            return first
        self.loop.append(tokens[:, -1])
        return self.loop.next_logits()

    def reorder(self, rows: np.ndarray) -> None:
        self.loop.reorder(rows)


def search_beams(engine: Any, job: Prompts, config: GenerationConfig,
                 cancel: threading.Event | None = None) -> tuple[list[list[int]] | None, int]:
    """Each prompt's best hypothesis (its new tokens, the end token included where it ended), or
    None where ``cancel`` was set before the search ended (no hypothesis is chosen yet), and the
    passes run."""
    if job.row_steps is not None:
        raise FeedError("beam search takes one max_new_tokens for every prompt; with truncate=True these prompts "
                        "leave different room before the context ends: send them one at a time, or drop num_beams.")
    nb, width = config.num_beams, max(map(len, job.ids))
    switch = rope_switch(engine)
    if switch and rope_reprefill(engine) and width <= switch < width + job.steps - 1:
        raise FeedError(f"this model (LongRoPE, as Phi-3) runs a text again whole when it grows past {switch} positions, "
                        f"as its generate does, and its beam search does not: ask for at most {switch - width + 1} new "
                        f"tokens, send a prompt longer than {switch} tokens, or drop num_beams.")
    start = np.full((len(job.ids), width), job.pad_id, dtype=np.int64)
    for i, p in enumerate(job.ids):
        start[i, width - len(p):] = p
    search = Search(max_length=width + job.steps, prompt=width, num_beams=nb, length_penalty=config.length_penalty,
                    early_stopping=config.early_stopping, no_repeat_ngram_size=config.no_repeat_ngram_size,
                    min_length=width + config.min_new_tokens if config.min_new_tokens else 0,
                    repetition_penalty=config.repetition_penalty, eos=tuple(sorted(job.end_ids)))
    if cancel is not None and cancel.is_set():
        return None, 0
    small = decode_loop(engine, job.ids, job.pad_id, job.steps)  # each prompt prefilled once, not once a beam
    first = np.repeat(small.next_logits(), nb, axis=0)
    loop = decode_loop(engine, [p for p in job.ids for _ in range(nb)], job.pad_id, job.steps)
    loop.take_prefill(small, nb)
    del small
    steps = _Steps(loop, first, cancel)
    try:
        return beam_search(steps, start, search)
    except _Cancelled:
        return None, steps.loop.passes
