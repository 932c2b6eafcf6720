"""Error feedback over the input channels (GPTQ) for the fitted 4-bit grid.

Rounding each weight on its own (even with searched scales) ignores that the layer's input channels
are correlated: the error of one column can be partly cancelled by the columns not yet rounded.
GPTQ rounds the input channels of ``W^T`` (N, K) in order and spreads each column's error over the
rest through the inverse of ``H = X^T X`` (the calibration activations' second moments), the exact
least-squares update for the layer's output. Each block's scale and zero point are searched
(:func:`~slimml.quantize.grids.fit_blocks`) on the updated weights when the block is reached.
"""

from __future__ import annotations

import numpy as np

from slimml.quantize.grids import fit_blocks

DAMP = 0.01  # of the mean diagonal, added to H: keeps its inverse stable where channels are (nearly) dead


def gptq_blocks(wt: np.ndarray, hessian: np.ndarray, block: int, zero_points: bool = True):
    """4-bit codes (N, K / block, block), float16 scales and uint8 zero points for ``wt`` (N, K),
    each block fitted where GPTQ's updated weights stand when it is reached; as :func:`fit_blocks` returns."""
    n, k = wt.shape
    w = wt.astype(np.float64).copy()
    h = hessian.astype(np.float64).copy()
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h[np.diag_indices(k)] += DAMP * np.mean(np.diag(h))
    try:
        hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: row i holds what column i's error moves
    except np.linalg.LinAlgError:
        return fit_blocks(wt.reshape(n, k // block, block), zero_points, np.diag(hessian))
    q_all = np.zeros((n, k), np.uint8)
    s_all = np.zeros((n, k // block), np.float16)
    z_all = np.zeros((n, k // block), np.uint8)
    imp = np.maximum(np.diag(hessian), 1e-12).astype(np.float32)
    for b0 in range(0, k, block):
        b1 = b0 + block
        _, s, z = fit_blocks(w[:, None, b0:b1].astype(np.float32), zero_points, imp[b0:b1])
        s_all[:, b0 // block], z_all[:, b0 // block] = s[:, 0], z[:, 0]
        scale, zero = s[:, 0].astype(np.float64), z[:, 0].astype(np.float64)
        err = np.zeros((n, block))
        for i in range(b0, b1):
            col = w[:, i]
            q = np.clip(np.rint(col / scale) + zero, 0, 15)
            q_all[:, i] = q
            e = (col - scale * (q - zero)) / hinv[i, i]
            w[:, i:b1] -= np.outer(e, hinv[i, i:b1])
            err[:, i - b0] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    return q_all.reshape(n, k // block, block), s_all, z_all
