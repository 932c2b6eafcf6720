"""The values a block of decoder weights may take: the ``grid`` of the language-model backend.

One concept, two grids (:class:`Recipe`'s ``grid``):

* ``"gguf"``: the source was a llama.cpp 4-bit GGUF file, so its 4-bit tensors already sit on a
  grid of 32-value blocks ``w = d * q + m`` (Q4_1; Q4_K's sub-blocks, whose ``d`` and ``m`` are a
  6-bit multiple of a float16 per 256 values). :func:`gguf_blocks` finds each block's grid from
  the weights themselves (no second reading of the file) and keeps it, up to the float16 rounding
  of ``d`` and ``m`` (exact for Q4_1, whose blocks hold codes 0 and 15), or, for a copy of such a
  model at 5 bits or more (F16 to Q5_0, e.g. Q4_K_M's Q5_0 and Q6_K tensors), the grid it was
  copied from; ``quantize/decoder.py`` applies ``m`` through a block-sum MatMul. A tensor on no
  such grid (an 8-bit output, IQ4_NL's non-uniform levels) had more bits in the source and stays at 8.
* ``"fitted"`` (any other weights: fp32/fp16/bf16 sources; Q4_0 in blocks of 32, whose integer
  zero point 8 it finds exactly): ONNX Runtime's own 4-bit format,
  ``w = s * (q - z)`` with an integer zero point ``z`` (uint4) per block, in blocks of 128 along the
  input dimension (the fastest at batch-1 decode, ``benchmarks/profile_llm_decode.py matmul``).
  Each block's ``(s, z)`` is searched to minimise a weighted squared error (llama.cpp's
  ``make_qkx2_quants``): weights ``sqrt(mean(w^2)) + |w|`` per value, times each input channel's
  mean squared activation when calibration text ran (llama.cpp's importance matrix).

8-bit blocks are symmetric (Q8_0: ``w = d * (q - 128)``, ``d = max|w| / 127``) in both grids.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

GRIDS = ("gguf", "fitted")
SEARCH_STEPS = 7  # candidate scales per block: (max - min) / c for c in 14..16


@dataclass(frozen=True)
class Recipe:
    """How the language-model backend stores one decoder's weight matrices.

    Args:
        bits: 4 or 8, for the layers' MatMuls (the output projection and embedding are always 8-bit).
        block_size: values per scale along the input dimension (a smaller power of two where it
            does not divide a matrix's input size).
        accuracy_level: MatMulNBits' compute type (4: int8 activations, the fast one at M=1).
        grid: ``"gguf"`` (keep a GGUF source's 4-bit grid; blocks of 32) or ``"fitted"``.
        zero_points: fitted 4-bit blocks carry an integer zero point (asymmetric).
        sensitive_layers: layers whose FFN down, attention output and a separate V projection stay
            at 8 bits in a 4-bit model, as llama.cpp's Q4_K_M keeps V and down at 6 bits.
        embedding_bits: the token embedding's table: 8, or 4 for an untied embedding (on the fitted
            grid, or kept on a GGUF source's grid; 8 where it is off that grid).
    """

    bits: int = 4
    block_size: int = 128
    accuracy_level: int | None = 4
    grid: str = "fitted"
    zero_points: bool = True
    sensitive_layers: tuple[int, ...] = ()
    embedding_bits: int = 8

    def describe(self) -> str:
        """``"fitted int4 (asymmetric, blocks of 128, accuracy_level 4)"``: for the report and manifest."""
        level = self.accuracy_level if self.accuracy_level is not None else "unset"
        if self.bits == 8:
            return f"int8 (symmetric, blocks of {self.block_size}, accuracy_level {level})"
        kind = "the source's GGUF grid kept" if self.grid == "gguf" else "asymmetric" if self.zero_points else "symmetric"
        extra = f", FFN down, V and O of {len(self.sensitive_layers)} layers at 8 bits" if self.sensitive_layers else ""
        extra += ", 4-bit embedding" if self.embedding_bits == 4 else ""
        return f"{self.grid} int4 ({kind}, blocks of {self.block_size}, accuracy_level {level}{extra})"


def more_bits_layers(n_layers: int) -> tuple[int, ...]:
    """The layers llama.cpp's Q4_K_M gives more bits (``use_more_bits``): the first and last eighth, every third between."""
    e = n_layers // 8
    return tuple(i for i in range(n_layers) if i < e or i >= 7 * n_layers // 8 or (i - e) % 3 == 2)


LM_HEAD_MIN_COLUMNS = 16384  # a MatMul this wide (N = vocabulary) is the output projection
_LAYER = re.compile(r"layers?[._/](\d+)[._/]")
SENSITIVE = re.compile(r"down|(^|[^a-z])v_proj|o_proj|attn_v|attn_output")  # the roles kept at 8 bits (not a fused qkv_proj)


def layer_of(name: str) -> int | None:
    """The layer index in a node name such as ``/model/layers.4/mlp/down_proj/MatMul``."""
    found = _LAYER.search(name)
    return int(found.group(1)) if found else None


def is_sensitive(name: str, recipe: Recipe) -> bool:
    """A weight that stays 8-bit in a 4-bit recipe: FFN down, attention output or a separate V projection of a sensitive layer."""
    return layer_of(name) in recipe.sensitive_layers and bool(SENSITIVE.search(name))


def block_for(k: int, block: int) -> int:
    """The largest power of two <= ``block`` (and >= 16) dividing ``k``; ``block`` itself when none does."""
    b = block
    while b >= 16:
        if k % b == 0:
            return b
        b //= 2
    return block


def q8_blocks(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 8-bit blocks (Q8_0) of ``b`` (rows, blocks, block): codes uint8 (zero 128), float16 scales."""
    d = (np.abs(b).max(axis=-1) / 127.0).astype(np.float16)
    d = np.where(d == 0, np.float16(1), d)
    q = np.clip(np.rint(b / d.astype(np.float32)[..., None]), -127, 127) + 128
    return q.astype(np.uint8), d


SNAP_MEAN = 0.2  # steps: a >= 5-bit copy of Q4_1 blocks lies 0.00-0.15 from its grid on average, weights off any grid ~0.25
SNAP_FAR, SNAP_FAR_SHARE = 0.35, 0.02  # and few of its values far from it (Q5_0 0.5%; off any grid ~30%, IQ4_NL 13%)
SNAP_FITS = 3  # rounds of "codes, then d and m by least squares"
Q5_IMAGES = np.rint(np.arange(16) * 31 / 15)  # where Q5_1 puts Q4_1's codes when both ends are 0 and 15
SNAP_TELLING = 8  # distinct values a block needs for its distance to the grid to count (a Q4_1 block of 32 has up to 16)


def gguf_blocks(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The 4-bit grid of ``b`` (:func:`exact_gguf_blocks`), else the Q4_1 grid (code 0 at a block's
    minimum, 15 at its maximum) that ``b`` is a copy of: the values of a float16, bfloat16, Q8_0,
    Q6_K, Q5_K, Q5_1 or Q5_0 copy of a Q4_1 model, snapped back onto it.

    Each block's ``d`` and ``m`` start from its minimum and maximum and are refitted by least squares
    over its 32 values (``SNAP_FITS`` rounds), so the copy's rounding averages out of them; a Q5_1
    copy keeps both ends exactly and rounds every block alike (codes 1-7 down, 8-14 up), so its
    blocks take ``d`` and ``m`` from the ends. ``b`` is a
    copy when its values lie on average within ``SNAP_MEAN`` of a step of their grid and at most
    ``SNAP_FAR_SHARE`` of them further than ``SNAP_FAR``: a copy at 5 bits or more lands 0.00-0.15
    away on average and almost none further than 0.35 (``benchmarks/sweep_gguf_types.py``'s files;
    Q5_0, which keeps neither the minimum nor the maximum, misplaces 0.3% of codes by one). Weights
    off any grid are ~0.25 away on average, ~30% of them further than 0.35 (uniformly between
    levels); a 5- or 6-bit grid of such weights puts a quarter to a half of its levels between
    the 4-bit ones, and IQ4_NL's non-uniform copy 13%: those are None. Only blocks of at least
    ``SNAP_TELLING`` distinct values count (zero or sparse blocks fit any grid), and they must be at
    least half of the blocks; non-finite weights are None."""
    if b.size == 0 or not np.isfinite(b).all():
        return None
    found = exact_gguf_blocks(b)
    if found is not None:
        return found
    b = b.astype(np.float32)
    lo, hi = b.min(axis=-1), b.max(axis=-1)
    distinct = (np.diff(np.sort(b, axis=-1), axis=-1) > 0).sum(axis=-1) + 1
    telling = distinct >= SNAP_TELLING  # blocks of a few distinct values (zeros, sparse rows) fit any grid
    if telling.mean() < 0.5:
        return None  # too few blocks to tell a copy of a grid from weights off it
    d = np.where(hi > lo, (hi - lo) / 15, 1.0)
    m = lo
    for _ in range(SNAP_FITS):
        q = np.clip(np.rint((b - m[..., None]) / d[..., None]), 0, 15)
        qc = q - q.mean(axis=-1, keepdims=True)
        var = (qc * qc).sum(axis=-1)
        fit = np.where(var > 0, (qc * b).sum(axis=-1) / np.where(var > 0, var, 1), d)
        d = np.where(fit > 0, fit, d)
        m = b.mean(axis=-1) - d * q.mean(axis=-1)
    five = (hi - lo) / 31  # a Q5_1 copy (31 steps from its minimum to its maximum) keeps both ends exactly,
    k = (b - lo[..., None]) / np.where(five > 0, five, 1)[..., None]  # and its rounding, the same for every
    ends = (five > 0) & (np.abs(k - np.rint(k)).max(axis=-1) <= 0.01)  # block, would bias least squares;
    ends &= np.isin(np.rint(k), Q5_IMAGES).all(axis=-1)  # its codes are Q4_1's 0..15 rounded onto 31 steps
    d16 = np.where(ends, (hi - lo) / 15, d).astype(np.float16)
    d16 = np.where(d16 == 0, np.float16(1), d16)
    m16 = np.where(ends, lo, b.mean(axis=-1) - d16.astype(np.float32) * q.mean(axis=-1)).astype(np.float16)  # m after d's rounding
    q = np.clip(np.rint((b - m16.astype(np.float32)[..., None]) / d16.astype(np.float32)[..., None]), 0, 15)
    miss = np.abs(b - (d16.astype(np.float32)[..., None] * q + m16.astype(np.float32)[..., None])) / d16.astype(np.float32)[..., None]
    miss = miss[telling]
    if miss.mean() > SNAP_MEAN or (miss > SNAP_FAR).mean() > SNAP_FAR_SHARE:
        return None
    return q.astype(np.uint8), d16, m16


def exact_gguf_blocks(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The 4-bit grid ``b`` (rows, blocks, block) already sits on, as codes 0..15 and float16 ``d`` and
    ``m`` (``w = d q + m``), or None when some block is not on one (the tensor had more bits).

    The smallest gap between a block's distinct values is a whole number ``j`` of its step (``j``
    is 1 unless no two neighbouring codes occur), so the step is the first of ``gap / j``
    (``j`` = 1..15) that puts every value within 1% of a step of ``min + k * step`` with an integer
    ``k <= 15``. ``d`` and ``m`` are then rounded to float16 (as llama.cpp stores them) before the
    codes are chosen: Q4_1 blocks come back exactly, Q4_K's (``d`` a float16 times a 6-bit scale)
    within float16 rounding (at most ~1% of a step).
    """
    b = b.astype(np.float32)
    lo, hi = b.min(axis=-1), b.max(axis=-1)
    gaps = np.diff(np.sort(b, axis=-1), axis=-1)
    real = gaps > (hi - lo)[..., None] * 2.0 ** -12  # equal codes give equal floats: smaller gaps are not steps
    gap = np.where(real, gaps, np.inf).min(axis=-1)
    gap = np.where(np.isfinite(gap), gap, 1.0)  # a constant block: any step
    levels = (hi - lo) / gap  # gap / j as the step puts the block's max at code j * levels
    if levels.max(initial=0.0) > 15.5:
        return None  # some block spans more than 16 levels of its smallest gap: off any 4-bit grid
    step = np.full_like(gap, np.nan)
    for j in range(1, 16):  # the first divisor of the smallest gap that puts each block on a grid
        todo = np.isnan(step) & (j * levels <= 15.5)
        if not todo.any():
            break
        s = gap[todo] / j
        k = (b[todo] - lo[todo][..., None]) / s[..., None]
        fits = (np.abs(k - np.rint(k)).max(axis=-1) <= 0.01) & (np.rint(k).max(axis=-1) <= 15)
        step[todo] = np.where(fits, s, np.nan)
    if np.isnan(step).any():
        return None
    m = lo.astype(np.float16)
    d = step.astype(np.float16)
    d = np.where(d == 0, np.float16(1), d)
    q = np.clip(np.rint((b - m.astype(np.float32)[..., None]) / d.astype(np.float32)[..., None]), 0, 15)
    return q.astype(np.uint8), d, m


def fit_blocks(b: np.ndarray, zero_points: bool = True, importance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """4-bit blocks of ``b`` (rows, blocks, block): codes 0..15, float16 scales ``s`` and uint8 zero points
    ``z`` (``w ~ s * (q - z)``; all 8 when ``zero_points`` is off), searched per block.

    Candidates: ``s = (max - min) / c`` for ``c`` in 14..16 and ``s = max|w| / 8`` (Q4_0's scale,
    so a Q4_0 source is found exactly), each with the nearest integer zero point and then the
    least-squares ``s`` for its codes; the candidate with the smallest weighted squared error wins.

    Args:
        b: the weights, transposed and blocked: (N, K / block, block) float32.
        zero_points: asymmetric blocks (integer zero point 0..15) instead of a fixed 8.
        importance: (K,) mean squared input activation per input channel, or None; for a stack
            ``b`` (E, N, 1, block) of one block of each expert's rows, (E, block).
    """
    b = b.astype(np.float32)
    wts = np.sqrt((b * b).mean(axis=-1, keepdims=True)) + np.abs(b)  # make_qkx2_quants' weights
    if importance is not None:
        wts = wts * importance.astype(np.float32).reshape(*b.shape[:-3], 1, *b.shape[-2:])
    amax_signed = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    lo, hi = np.minimum(b.min(axis=-1), 0), np.maximum(b.max(axis=-1), 0)
    cands = []
    if zero_points:
        cands += [((hi - lo) / c, None) for c in np.linspace(14.0, 16.0, SEARCH_STEPS)]
        cands.append((np.abs(amax_signed) / 8, np.where(amax_signed < 0, 8, 7)))  # Q4_0: the extreme at code 0 or 15
    else:
        cands += [(np.abs(amax_signed) / c, np.full(lo.shape, 8)) for c in np.linspace(7.0, 8.5, SEARCH_STEPS)]
    best_err = best_s = best_z = None
    for s0, z0 in cands:
        s0 = np.where(s0 > 0, s0, 1.0).astype(np.float32)
        z = np.clip(np.rint(-lo / s0), 0, 15) if z0 is None else z0
        z = z.astype(np.float32)[..., None]
        q = np.clip(np.rint(b / s0[..., None]) + z, 0, 15) - z
        num, den = (wts * b * q).sum(axis=-1), (wts * q * q).sum(axis=-1)
        s = np.where(den > 0, num / np.where(den > 0, den, 1), s0)  # least squares for these codes
        s = np.where(s > 0, s, s0).astype(np.float16).astype(np.float32)
        for scale in (s, s0.astype(np.float16).astype(np.float32)):
            q = np.clip(np.rint(b / scale[..., None]) + z, 0, 15) - z
            err = (wts * (scale[..., None] * q - b) ** 2).sum(axis=-1)
            if best_err is None:
                best_err, best_s, best_z = err, scale, z[..., 0]
            else:
                better = err < best_err
                best_err = np.where(better, err, best_err)
                best_s, best_z = np.where(better, scale, best_s), np.where(better, z[..., 0], best_z)
    q = np.clip(np.rint(b / best_s[..., None]) + best_z[..., None], 0, 15)
    return q.astype(np.uint8), best_s.astype(np.float16), best_z.astype(np.uint8)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Two 4-bit values a byte along the last axis, the first in the low nibble (an odd count is padded)."""
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.zeros((*q.shape[:-1], 1), q.dtype)], axis=-1)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def dequantize(q: np.ndarray, s: np.ndarray, z: np.ndarray | float) -> np.ndarray:
    """``s * (q - z)`` per block: (rows, blocks, block) float32, for tests and error bounds."""
    z = np.asarray(z, np.float32)
    return s.astype(np.float32)[..., None] * (q.astype(np.float32) - (z[..., None] if z.ndim else z))
