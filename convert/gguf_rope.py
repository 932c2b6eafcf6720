"""The rotary embedding a GGUF file means, where transformers' GGUF reader drops it.

transformers (4.57 and 5) reads a decoder's ``rope.freq_base`` and nothing else of its RoPE, so a
scaled RoPE would convert as plain RoPE, and the check against transformers' reading of the same
file would not see it. llama.cpp keeps the scaling in three ways, each read back here as the
``rope_scaling`` transformers computes from a config:

- **Llama 3.x** (``rope_type: "llama3"``): its converter bakes the scaling into a ``rope_freqs``
  tensor, one divisor per rotated pair, and keeps none of the parameters. They are solved back from
  the divisors (the factor is the largest; the pairs in between fix the two wavelength bounds) and
  kept only if transformers' formula on them gives the file's divisors again; otherwise the file is
  refused rather than converted with another RoPE.
- ``rope.scaling.type`` ``linear`` or ``yarn`` with its factor, original context and YaRN's betas
  and attention factor (Gemma 3's linear scaling, of the global layers only, is ``gguf._gemma_config``'s).
- **Phi-3's LongRoPE** (Phi-3.5-mini, Phi-4-mini, the 128k models): the ``rope_factors_short`` and
  ``rope_factors_long`` tensors and ``rope.scaling.original_context_length``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from slimml.errors import SourceError


def rope_config(reader: Any, arch: str, config: Any, field: Any) -> dict[str, Any]:
    """Config values (``rope_scaling`` and ``original_max_position_embeddings``) for the RoPE the file
    holds and ``config`` (transformers' reading) lacks; empty when they agree.

    ``field(reader, key)`` reads one metadata value (``gguf._field``).

    Raises:
        SourceError: a ``rope_freqs`` tensor that no Llama 3 scaling reproduces.
    """
    tensors = {t.name: t for t in reader.tensors}
    if arch == "phi3":
        return _longrope(reader, tensors, arch, config, field)
    have = _have(config)
    if "rope_freqs.weight" in tensors:
        scaling = _llama3(np.asarray(tensors["rope_freqs.weight"].data, np.float32).ravel(), config, arch)
    else:
        scaling = _scaling_fields(reader, arch, field) if arch != "gemma3" else None
    if scaling is None or {k: have.get(k) for k in scaling} == scaling:
        return {}
    return {"rope_scaling": scaling}


def _have(config: Any) -> dict[str, Any]:
    """The RoPE values of ``config`` as transformers 5 (``rope_parameters``) or 4.57 (``rope_scaling``) keeps them."""
    nested = getattr(config, "rope_parameters", None)
    if isinstance(nested, dict):
        return nested
    return dict(getattr(config, "rope_scaling", None) or {})


def _scaling_fields(reader: Any, arch: str, field: Any) -> dict[str, Any] | None:
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    if kind not in ("linear", "yarn") or not factor or float(factor) == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    if kind == "yarn":
        original = field(reader, f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"), ("yarn_attn_factor", "attention_factor")):
            value = field(reader, f"{arch}.rope.scaling.{key}")
            if value is not None:
                scaling[name] = float(value)
    return scaling


def _llama3(divisors: np.ndarray, config: Any, arch: str) -> dict[str, Any] | None:
    """transformers' ``llama3`` parameters whose per-pair divisors are llama.cpp's ``rope_freqs``."""
    from slimml.convert.fused_family import inv_freq

    if np.allclose(divisors, 1.0):
        return None
    theta = float(getattr(config, "rope_theta", None) or _have(config).get("rope_theta") or 10000.0)
    dim = 2 * len(divisors)
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = float(divisors.max())
    for low, high, old in [(1.0, 4.0, 8192.0), *_solved(divisors, inv, factor)]:  # Llama 3.1-3.3's, then the file's own
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": int(round(old))}
        mine = inv_freq({"theta": theta, "type": "llama3", **scaling}, dim)
        if np.allclose(mine, inv / divisors, rtol=1e-4, atol=0):
            return scaling
    raise SourceError(f"the {arch} GGUF file's rope_freqs tensor (llama.cpp's baked RoPE scaling) matches no Llama 3 "
                      "scaling slimml can rebuild, and converting it with plain RoPE would change the model; "
                      "convert the original Hugging Face folder of this model instead.")


def _solved(divisors: np.ndarray, inv: np.ndarray, factor: float) -> list[tuple[float, float, float]]:
    """(low_freq_factor, high_freq_factor, original context) that give ``divisors``.

    transformers' ``llama3`` depends on them only through two wavelength bounds, H = old / high
    (shorter: divisor 1) and L = old / low (longer: divisor ``factor``), and between them
    ``1 / divisor = (1 - s) / factor + s`` with ``s = (1 / w - 1 / L) / (1 / H - 1 / L)``. Two or
    more pairs between the bounds fix H and L (``s`` is linear in ``1 / w``); one fixes L once H is
    placed between its neighbours; none leaves both anywhere between the last pair of divisor 1 and
    the first of ``factor``. The original context is then any value (8192 kept): only its ratios count.
    """
    w = 2 * math.pi / inv
    ones, fulls = np.isclose(divisors, 1.0, rtol=1e-5), np.isclose(divisors, factor, rtol=1e-5)
    middle = ~ones & ~fulls
    shortest = float(w[ones].max()) if ones.any() else float(w.min()) / 2  # the bounds' room
    longest = float(w[fulls].min()) if fulls.any() else float(w.max()) * 2
    s = (1.0 / divisors - 1.0 / factor) / (1.0 - 1.0 / factor)
    if middle.sum() >= 2:
        slope, intercept = np.polyfit(1.0 / w[middle], s[middle], 1)  # s = slope / w + intercept
        if slope <= 0 or intercept >= 0:
            return []
        inv_h, inv_l = (1.0 - intercept) / slope, -intercept / slope
        high_w, low_w = 1.0 / inv_h, 1.0 / inv_l
    elif middle.sum() == 1:
        w1, s1 = float(w[middle][0]), float(s[middle][0])
        high_w = math.sqrt(shortest * w1)
        low_w = (1.0 - s1) / (1.0 / w1 - s1 / high_w)
    else:
        high_w, low_w = shortest * (longest / shortest) ** (1 / 3), shortest * (longest / shortest) ** (2 / 3)
    if not 0 < high_w < low_w:
        return []
    old = 8192.0
    return [(old / low_w, old / high_w, old)]


def _longrope(reader: Any, tensors: dict[str, Any], arch: str, config: Any, field: Any) -> dict[str, Any]:
    """Phi-3's LongRoPE from its factor tensors and original context. The attention factor is left
    to transformers' default, the value llama.cpp's converter writes (``rope.scaling.attn_factor``)."""
    short, long = tensors.get("rope_factors_short.weight"), tensors.get("rope_factors_long.weight")
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if short is None or long is None or not original:
        return {}
    scaling = {"short_factor": [float(v) for v in np.asarray(short.data, np.float32).ravel()],
               "long_factor": [float(v) for v in np.asarray(long.data, np.float32).ravel()]}
    nested = getattr(config, "rope_parameters", None)  # transformers 5 (rope_type); 4.57's Phi3Config takes exactly type + factors
    scaling["rope_type" if isinstance(nested, dict) else "type"] = "longrope"
    have = _have(config)
    fixes: dict[str, Any] = {}
    if {k: have.get(k) for k in ("short_factor", "long_factor")} != {k: scaling[k] for k in ("short_factor", "long_factor")}:
        fixes["rope_scaling"] = scaling
    if getattr(config, "original_max_position_embeddings", None) != int(original):
        fixes["original_max_position_embeddings"] = int(original)
    return fixes
