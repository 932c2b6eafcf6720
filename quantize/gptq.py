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
    each block fitted where GPTQ's updated weights stand when it is reached; as :func:`fit_blocks` returns.

    A stack ``wt`` (E, N, K) with ``hessian`` (E, K, K) (a mixture's experts, each with its own
    moments) runs one column loop for all of them, each result with the leading E.
    """
    single = wt.ndim == 2
    if single:
        wt, hessian = wt[None], hessian[None]
    experts, n, k = wt.shape
    w = wt.astype(np.float64).copy()
    h = hessian.astype(np.float64).copy()
    on = np.arange(k)
    diag = h[:, on, on]
    dead = diag <= 0
    diag = np.where(dead, 1.0, diag)
    w = np.where(dead[:, None, :], 0.0, w)
    h[:, on, on] = diag + DAMP * diag.mean(axis=1, keepdims=True)
    try:
        hinv = np.linalg.cholesky(np.linalg.inv(h)).transpose(0, 2, 1)  # upper: row i holds what column i's error moves
    except np.linalg.LinAlgError:
        if single:
            return fit_blocks(wt[0].reshape(n, k // block, block), zero_points, np.diag(hessian[0]))
        parts = [gptq_blocks(wt[e], hessian[e], block, zero_points) for e in range(experts)]
        return tuple(np.stack(p) for p in zip(*parts))
    q_all = np.zeros((experts, n, k), np.uint8)
    s_all = np.zeros((experts, n, k // block), np.float16)
    z_all = np.zeros((experts, n, k // block), np.uint8)
    imp = np.maximum(hessian[:, on, on], 1e-12).astype(np.float32)
    for b0 in range(0, k, block):
        b1 = b0 + block
        _, s, z = fit_blocks(w[:, :, None, b0:b1].astype(np.float32), zero_points, imp[:, b0:b1])
        s_all[:, :, b0 // block], z_all[:, :, b0 // block] = s[..., 0], z[..., 0]
        scale, zero = s[..., 0].astype(np.float64), z[..., 0].astype(np.float64)
        err = np.zeros((experts, n, block))
        for i in range(b0, b1):
            col = w[:, :, i]
            q = np.clip(np.rint(col / scale) + zero, 0, 15)
            q_all[:, :, i] = q
            e = (col - scale * (q - zero)) / hinv[:, i, i][:, None]
            w[:, :, i:b1] -= e[:, :, None] * hinv[:, None, i, i:b1]
            err[:, :, i - b0] = e
        w[:, :, b1:] -= err @ hinv[:, b0:b1, b1:]
    out = q_all.reshape(experts, n, k // block, block), s_all, z_all
    return tuple(a[0] for a in out) if single else out
