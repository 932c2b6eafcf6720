"""Mixed precision for the student's training: what the device can do, and what is faster on it.

``auto`` measures: a few forward and backward passes of the real first batch in fp32 and in the
low precision the device computes natively (bf16 on CPUs with AMX or AVX512-BF16 and on recent
GPUs, fp16 with a gradient scaler on older GPUs), and keeps the faster. On CPUs without native bf16
autocast only adds conversions, so ``auto`` stays in fp32 there without measuring. The choice is
kept in the checkpoint (a resumed run keeps it) and in the report; since it is measured, two runs
on a busy machine may choose differently: name the precision for bit-for-bit repeatable students.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from slimml.errors import ConfigError

CHOICES = ("auto", "off", "bf16", "fp16")
MARGIN = 0.9  # low precision must be at least 10% faster to be chosen


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def check(requested: str, device: str) -> None:
    """Refuse a precision the device cannot compute, with the fix."""
    import torch

    if requested not in CHOICES:
        raise ConfigError(f"--mixed-precision {requested!r} is not one of {', '.join(CHOICES)}.")
    if requested == "fp16" and device != "cuda":
        raise ConfigError("--mixed-precision fp16 trains with a gradient scaler on a CUDA GPU, and this run trains on "
                          "the CPU; use --mixed-precision bf16 (CPUs with AMX or AVX512-BF16), off, or auto.")
    if requested == "bf16" and device == "cpu" and not cpu_has_native_bf16():
        raise ConfigError("--mixed-precision bf16: this CPU has no native bf16 (AMX or AVX512-BF16), so bf16 would be "
                          "emulated and slower than fp32; use --mixed-precision off (or auto).")
    if requested == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("--mixed-precision bf16: this GPU has no native bf16; use --mixed-precision fp16 (or auto).")


def candidates(device: str) -> list[str]:
    import torch

    if device == "cuda":
        return ["off", "bf16" if torch.cuda.is_bf16_supported() else "fp16"]
    return ["off", "bf16"] if cpu_has_native_bf16() else ["off"]


def autocast(precision: str, device: str) -> Any:
    import torch

    if precision == "off":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def measure(step: Callable[[str], None], device: str, repeats: int = 3) -> tuple[str, dict[str, float]]:
    """Time ``step(precision)`` (one forward and backward) for each candidate; the faster one wins.

    Candidates alternate, and each gets the median of ``repeats`` timings after a warm-up.
    """
    import torch

    options = candidates(device)
    if len(options) == 1:
        return options[0], {}
    times: dict[str, list[float]] = {o: [] for o in options}
    for o in options:
        step(o)  # warm-up: first-call allocations and kernel selection
    for _ in range(repeats):
        for o in options:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(o)
            if device == "cuda":
                torch.cuda.synchronize()
            times[o].append(time.perf_counter() - t0)
    median = {o: sorted(t)[len(t) // 2] * 1000 for o, t in times.items()}
    low = options[1]
    return (low if median[low] < MARGIN * median["off"] else "off"), {k: round(v, 1) for k, v in median.items()}
