"""Recordings longer than a speech model's window (Whisper's 30 s), cut and put back together as
transformers' speech-recognition pipeline does with ``chunk_length_s=30``.

A recording is cut into windows of the model's length that overlap by a third (a stride of a sixth
of the window on each side: 30 s windows starting every 20 s); each window is transcribed on its
own, and consecutive windows' text tokens are joined where they agree best: the alignment with the
largest share of equal tokens (at least two), cut in the middle of the overlap
(``_find_longest_common_sequence`` in transformers' Whisper tokenizer). Windows are joined
whatever language each was detected in, as transformers 4.57's pipeline joins them (its
``generate`` returns no language tokens for ``_decode_asr`` to split on).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def windows(wave: np.ndarray, size: int) -> list[np.ndarray]:
    """``wave`` cut into windows of at most ``size`` samples, consecutive ones overlapping by a third
    of ``size`` (transformers' ``chunk_iter`` with a stride of ``size / 6`` each side); one window
    for a recording that fits."""
    stride = size // 6
    step = size - 2 * stride
    out = []
    for start in range(0, len(wave), step):
        piece = wave[start:start + size]
        if start == 0 or piece.size > stride:  # a last piece inside the previous window's right stride adds nothing
            out.append(piece)
        if start + size >= len(wave):
            break
    return out


def merge_overlaps(sequences: Sequence[Sequence[int]]) -> list[int]:
    """The token sequences of consecutive overlapping windows joined into one: each next sequence
    aligned with the end of what came before where the largest share of their overlapping tokens
    agree (at least two tokens; a longer alignment wins a tie), and cut at the middle of that
    overlap. Without such an alignment the two are simply concatenated."""
    if not sequences:
        return []
    left = list(sequences[0])
    total: list[int] = []
    for right in sequences[1:]:
        right = list(right)
        best, cut = 0.0, (len(left), len(left), 0, 0)
        a, b = np.asarray(left, dtype=np.int64), np.asarray(right, dtype=np.int64)
        for i in range(1, len(left) + len(right)):
            left_start, left_stop = max(0, len(left) - i), min(len(left), len(left) + len(right) - i)
            right_start, right_stop = max(0, i - len(left)), min(len(right), i)
            matches = int(np.count_nonzero(a[left_start:left_stop] == b[right_start:right_stop]))
            share = matches / i + i / 10000.0  # the epsilon favours longer perfect matches
            if matches > 1 and share > best:
                best, cut = share, (left_start, left_stop, right_start, right_stop)
        left_start, left_stop, right_start, right_stop = cut
        total.extend(left[:(left_start + left_stop) // 2])
        left = right[(right_start + right_stop) // 2:]
    total.extend(left)
    return total
