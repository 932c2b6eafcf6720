"""Choosing how many shards stay resident (K) and how far the loader reads ahead (P).

A streamed model keeps at most K shards loaded at once: the pinned ones (kept for the model's
lifetime, say the embeddings and the head) plus K - len(pin) slots that the streamed shards pass
through. While one shard computes, a background loader brings in up to P shards after it. Given
only a memory budget, :func:`plan_stream` picks the largest K whose worst case fits and says why.
"""

from __future__ import annotations

import math

import re
import dataclasses
from dataclasses import dataclass, field

from slimml.errors import ConfigError
from slimml.runtime.artifact.manifest import Manifest

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9}
STREAM_SLOTS = 2  # a budget that pins shards keeps this many slots to stream the rest (one computing, one loading)
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, what: str = "memory budget") -> int:
    """``"4GB"``, ``"512MiB"``, ``"1.5G"`` or a number of bytes -> bytes; ``what`` names the value in a refusal.

    Raises:
        ConfigError: the text is not a size or is not positive.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, scale = float(value), 1
    else:
        m = _SIZE_RE.match(str(value))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(
                f"{what} {value!r} is not a size; write it like '4GB', '512MB', '1.5GiB' or a number of bytes."
            )
        number, scale = float(m.group(1)), _UNITS[unit]
    if not math.isfinite(number * scale) or number * scale > 2 ** 62:  # nan, inf, or 400 digits
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:36] + "...'"
        raise ConfigError(f"{what} {shown} is not a size a machine has; write it like '4GB' or '512MB'.")
    n = int(value) if isinstance(value, int) and not isinstance(value, bool) else int(number * scale)
    if n <= 0:
        raise ConfigError(f"{what} {value!r} must be positive; write a size like '4GB' or '512MB'.")
    return n


def parse_bytes_or_off(value: int | float | str, what: str = "prefix cache") -> int:
    """:func:`parse_bytes` for a budget that a zero size (``0``, ``"0"``, ``"0B"``) or an empty
    text turns off: 0 then.

    Raises:
        ConfigError: the text is not a size, or is negative.
    """
    text = str(value).strip()
    m = _SIZE_RE.match(text)
    if text == "" or (m and float(m.group(1)) == 0 and m.group(2).lower() in _UNITS):
        return 0
    try:
        return parse_bytes(value, what)
    except ConfigError as e:
        raise ConfigError(f"{str(e).rstrip('.')}, or 0 to turn it off.") from None


def available_memory() -> int:
    """Bytes this process may still use: MemAvailable, or less under a memory cgroup's limit."""
    import os

    avail = None
    try:
        for line in _read("/proc/meminfo").splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit, usage in _cgroup_files():
        try:
            cap = _read(limit).strip()
            used = int(_read(usage).strip())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:
            free = int(cap) - used + _reclaimable(usage)  # page cache the kernel drops under pressure
            avail = free if avail is None else min(avail, free)
    if avail is None:
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # macOS has no SC_AVPHYS_PAGES, Windows no sysconf
            return UNKNOWN_MEMORY
    return max(0, avail)


UNKNOWN_MEMORY = 1 << 62  # available_memory() where the system cannot tell: as much as asked


def bigger_than_memory(nbytes: int) -> bool:
    """Whether a model of ``nbytes`` takes more than a third of :func:`available_memory`: too big to
    trace whole, to load whole in torch, or to run resident beside either."""
    return nbytes * 3 > available_memory()


def _reclaimable(usage_file: str) -> int:
    """Clean page cache of the cgroup whose usage file is ``usage_file``: counted in its usage, but the
    kernel drops it when a process of the group needs the memory."""
    import os

    try:
        stat = _read(os.path.join(os.path.dirname(usage_file), "memory.stat")).split("\n")
    except OSError:
        return 0
    values = dict(line.split() for line in stat if len(line.split()) == 2)
    if "total_cache" in values:  # cgroup v1
        keys = ("total_cache", "total_dirty", "total_writeback", "total_mapped_file")
    else:  # cgroup v2
        keys = ("file", "file_dirty", "file_writeback", "file_mapped")
    cache, dirty, writeback, mapped = (int(values.get(k, 0)) for k in keys)
    return max(0, cache - dirty - writeback - mapped)  # mapped pages are in use (memory-mapped weights)


def _read(path: str) -> str:
    """A small kernel file's text (closed at once: an embedding app's tests run with warnings as errors)."""
    with open(path) as f:
        return f.read()


def _cgroup_files() -> list[tuple[str, str]]:
    """(limit, usage) files of this process's memory cgroup, v1 or v2."""
    out = []
    try:
        lines = _read("/proc/self/cgroup").splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            out.append((f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current"))
        elif "memory" in controllers.split(","):
            base = f"/sys/fs/cgroup/memory{path}"
            out.append((f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes"))
    return out


def fmt_bytes(n: int | float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def shard_bytes(manifest: Manifest) -> list[int]:
    """Bytes on disk of each shard (its .onnx plus its external data): what it costs when loaded."""
    sizes = {f.path: f.bytes for f in manifest.files}
    return [sizes.get(s.file, 0) + (sizes.get(s.data, 0) if s.data else 0) for s in manifest.shards]


def model_bytes(manifest: Manifest) -> int:
    """Bytes on disk of all the shards' files, each file once (a last shard may read its tied
    embedding from shard 0's data file)."""
    sizes = {f.path: f.bytes for f in manifest.files}
    return sum(sizes.get(p, 0) for p in {p for s in manifest.shards for p in (s.file, s.data) if p})


RESIDENT_4BIT = 1.6  # a 4-bit model loaded whole: ONNX Runtime packs its weights for this CPU, up to this x its files
AUTO_SHARE = 0.6  # an automatic stream's loaded shards may take this share of the memory available; the rest
# holds every shard's session, the KV cache and the activations
AUTO_WHOLE = 0.9  # a model loads whole while it needs at most this share of the memory available
AUTO_MIN = 32 * 10**6  # smaller models always load whole: their sessions' overhead is of their size


def _quantized_bits(manifest: Manifest) -> set:
    """The bits of the artifact's quantize steps (its steps as read: a hostile manifest's may be anything)."""
    return {st.get("bits") for st in manifest.steps if isinstance(st, dict) and st.get("step") == "quantize"}


def resident_need(parts: dict[str | None, Manifest]) -> int:
    """About the bytes an artifact's shards take loaded whole on the host: their files, or up to
    1.6x for 4-bit weights that ONNX Runtime packs."""
    need = 0
    for m in parts.values():
        four = 4 in _quantized_bits(m)
        need += int(model_bytes(m) * (RESIDENT_4BIT if four else 1.0))
    return need


def auto_budget(parts: dict[str | None, Manifest], available: int | None) -> int | None:
    """A memory budget for an artifact loaded with no streaming option: None where it fits in the
    ``available`` bytes loaded whole, with a tenth of them to spare (or they cannot be told, or it
    is under 32 MB), else 60% of them, which streams it: a model that does not fit should run
    rather than be killed by the kernel as it loads.

    Raises:
        ConfigError: not even the largest shard of each component fits with room to run it; naming
            the sizes and the fixes.
    """
    need = resident_need(parts)
    if available is None or need <= available * AUTO_WHOLE or need < AUTO_MIN:
        return None
    files = sum(model_bytes(m) for m in parts.values())
    # each component's largest shard loaded at once (split_budget's least), packed for 4-bit weights
    least = int(sum(max(shard_bytes(m)) for m in parts.values()) * need / max(files, 1))
    budget = max(int(available * AUTO_SHARE), least)
    if budget > available * AUTO_WHOLE:
        whole = max(len(m.shards) for m in parts.values())
        raise ConfigError(
            f"this model takes about {fmt_bytes(need)} loaded whole, and only {fmt_bytes(available)} of memory is free "
            f"(MemAvailable, or what this process's memory cgroup leaves); streaming it needs its largest shard"
            f"{'s' if len(parts) > 1 else ''} ({fmt_bytes(least)}) loaded at once with room to run. Free memory or raise "
            "the limit"
            + ("" if all(_uncut(m, _largest(m)) for m in parts.values())
               else ", re-convert with smaller shards (--shard-size)")
            + ", or choose: memory_budget= (--memory-budget) "
            f"streams within a budget of your own, resident={whole} (--resident {whole}) loads it whole anyway.")
    return budget


def _apart(budget: int, need: int) -> tuple[str, str]:
    """``budget`` and ``need`` as text that shows them different (exact bytes where rounding would not)."""
    a, b = fmt_bytes(budget), fmt_bytes(need)
    return (f"{budget:,} bytes", f"{need:,} bytes") if a == b else (a, b)


def split_budget(parts: dict[str | None, Manifest], memory_budget: int | float | str | None) -> dict[str | None, int | None]:
    """One ``memory_budget`` for an artifact of several components (CLIP's towers, an
    encoder-decoder's graphs), shared out so that their loaded shards together stay within it:
    each component gets its largest shard, then the rest in proportion to what it still needs;
    a component whose share holds it whole is resident. A lone chain keeps the whole budget.

    Raises:
        ConfigError: the budget cannot hold the largest shard of every component at once.
    """
    if memory_budget is None or len(parts) < 2:
        return {name: memory_budget for name in parts}
    budget = parse_bytes(memory_budget)
    sizes = {name: shard_bytes(m) for name, m in parts.items()}
    total = {name: sum(s) for name, s in sizes.items()}
    if sum(total.values()) <= budget:
        return {name: max(total[name], 1) for name in parts}
    least = {name: max(s) for name, s in sizes.items()}
    if sum(least.values()) > budget:
        named = ", ".join(f"{name} {fmt_bytes(b)}" for name, b in least.items())
        raise ConfigError(
            f"memory budget {fmt_bytes(budget)} cannot hold the largest shard of each component at once ({named}: "
            f"{fmt_bytes(sum(least.values()))}); give at least {_round_up_mb(sum(least.values()))}MB (memory_budget=, "
            "--memory-budget), or re-convert with smaller shards (--shard-size).")
    rest, need = budget - sum(least.values()), {name: total[name] - least[name] for name in parts}
    wanted = sum(need.values()) or 1
    return {name: min(total[name], least[name] + rest * need[name] // wanted) for name in parts}


@dataclass
class StreamPlan:
    """What a loaded model keeps in memory.

    Attributes:
        resident: K, the most shards loaded at once (pinned ones included).
        prefetch: P, how many shards the loader brings in ahead of the one computing.
        pinned: shard indices loaded once and kept.
        streamed: shard indices that pass through the K - len(pinned) slots, in run order;
            empty when everything fits (the model is then fully resident).
        peak_bytes: the worst-case bytes of loaded shards (pinned plus the largest streamed ones).
        model_bytes: all shards' bytes.
        reason: how K and P were chosen, in words.
        budget: the memory budget the caller gave, in bytes (None: none given).
    """

    resident: int
    prefetch: int
    pinned: list[int]
    streamed: list[int]
    peak_bytes: int
    model_bytes: int
    reason: str = ""
    sizes: list[int] = field(default_factory=list, repr=False)
    budget: int | None = None

    @property
    def streaming(self) -> bool:
        return bool(self.streamed)

    def describe(self) -> str:
        if not self.streaming:
            return f"fully resident: all {len(self.sizes)} shards loaded once ({fmt_bytes(self.model_bytes)}). {self.reason}".strip()
        pin = f", pinned shards {self.pinned}" if self.pinned else ""
        return (
            f"streaming {len(self.streamed)} of {len(self.sizes)} shards with K={self.resident} resident, "
            f"P={self.prefetch} prefetched{pin}; at most {fmt_bytes(self.peak_bytes)} loaded at once, of a model of "
            f"{fmt_bytes(self.model_bytes)} on disk. {self.reason}".strip()
        )


def plan_stream(
    manifest: Manifest,
    resident: int | None = None,
    prefetch: int | None = None,
    memory_budget: int | float | str | None = None,
    pin: list[int] | tuple[int, ...] | None = None,
) -> StreamPlan:
    """Decide K, P and the pinned set from the user's options and the shards' sizes.

    With none of ``resident``, ``prefetch``, ``memory_budget`` or ``pin`` the model is fully
    resident (today's behaviour). A budget alone picks the largest K that fits it.

    Raises:
        ConfigError: a budget below the largest shard (named, with its size) or below what the
            pinned shards need; K or P out of range; pin indices out of range or repeated.
    """
    sizes = shard_bytes(manifest)
    n = len(sizes)
    total = model_bytes(manifest)
    pinned = _check_pin(pin, n)
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    if budget is not None:
        big = _largest(manifest)
        if budget < sizes[big]:
            have, need = _apart(budget, sizes[big])
            raise ConfigError(
                f"memory budget {have} is smaller than shard {big} "
                f"({manifest.shards[big].file}, {need}), the largest shard; a shard must fit "
                f"whole. Give at least {_round_up_mb(sizes[big])}MB (memory_budget=, --memory-budget"
                + ("; 4- or 8-bit weights pre-packed for this CPU can need more, which a load then names"
                   if {4, 8} & _quantized_bits(manifest) else "")
                + ")" + ("; it is the token embedding or the head, one weight no smaller --shard-size cuts."
                         if _uncut(manifest, big) else ", or re-convert with smaller shards (--shard-size).")
            )
        pin_bytes = sum(sizes[i] for i in pinned)
        rest = [sizes[i] for i in range(n) if i not in pinned]
        if rest and pin_bytes + max(rest) > budget:
            biggest = max((i for i in range(n) if i not in pinned), key=lambda i: sizes[i])
            have, need = _apart(budget, pin_bytes + sizes[biggest])
            raise ConfigError(
                f"memory budget {have} cannot hold the pinned shards {pinned} ({fmt_bytes(pin_bytes)}) plus the "
                f"largest streamed one, shard {biggest} ({manifest.shards[biggest].file}, {fmt_bytes(sizes[biggest])}): "
                f"{need} together; pin fewer shards or raise the budget."
            )
    if resident is None and prefetch is None and budget is None and not pinned:
        return StreamPlan(n, 0, list(range(n)), [], total, total, "", sizes)
    if resident is not None and (not isinstance(resident, int) or resident < 1):
        raise ConfigError(f"resident={resident!r} must be a whole number >= 1 (shards loaded at once).")
    if prefetch is not None and (not isinstance(prefetch, int) or prefetch < 0):
        raise ConfigError(f"prefetch={prefetch!r} must be a whole number >= 0 (shards loaded ahead).")
    reason = ""
    if budget is not None and resident is None and prefetch is None and not pinned and total > budget:
        pinned, reason = _auto_pin(sizes, budget)
        if pinned:
            resident = len(pinned) + STREAM_SLOTS
    stream = [i for i in range(n) if i not in pinned]
    if pinned and resident is None and prefetch is None and budget is None:  # it was ignored: all loaded once
        raise ConfigError(f"pin={pinned} keeps shards loaded while the others stream, and nothing streams without "
                          "resident= or memory_budget= (--resident K, --memory-budget); give one, or drop pin.")
    if resident is None:
        if budget is None:
            resident = n if prefetch is None else len(pinned) + 1 + prefetch
        else:
            resident = _fit(sizes, pinned, stream, budget)
            reason = f"K={resident} is the most that fits the {fmt_bytes(budget)} budget."
    if resident < len(pinned) + (1 if stream else 0):
        raise ConfigError(
            f"resident={resident} leaves no slot for streaming: {len(pinned)} shard(s) are pinned ({pinned}). "
            f"Use resident >= {len(pinned) + 1}, or pin fewer shards."
        )
    slots = resident - len(pinned)
    if slots >= len(stream):  # everything fits: load once, never stream
        peak = total
        if budget is not None and peak > budget:
            raise ConfigError(f"resident={resident} needs {fmt_bytes(peak)}, over the {fmt_bytes(budget)} budget; "
                              "give fewer resident shards, a larger budget, or only the budget (it picks resident).")
        return StreamPlan(n, 0, list(range(n)), [], peak, total, reason, sizes, budget)
    if prefetch is None:
        # every slot but the computing one reads ahead: slots beyond P + 1 could never be used,
        # since in a pass over more shards than slots no loaded shard is needed twice
        prefetch = slots - 1
        reason += f" P={prefetch}: the loader fills the other slots ahead." if prefetch else " P=0: no room to load ahead."
    elif prefetch > slots - 1:
        raise ConfigError(
            f"prefetch={prefetch} needs {prefetch + 1} streaming slots (the shard computing plus those "
            f"loading), but resident={resident} with {len(pinned)} pinned leaves {slots}. Use prefetch <= "
            f"{slots - 1} or raise resident."
        )
    largest = sorted(stream, key=lambda i: -sizes[i])[:slots]
    peak = sum(sizes[i] for i in pinned) + sum(sizes[i] for i in largest)
    if budget is not None and peak > budget:
        named = ", ".join(f"shard {i} ({manifest.shards[i].file}, {fmt_bytes(sizes[i])})" for i in largest[:3])
        more = f" and {len(largest) - 3} more" if len(largest) > 3 else ""
        fits = _fit(sizes, pinned, stream, budget)
        raise ConfigError(
            f"resident={resident} can need {fmt_bytes(peak)}, over the {fmt_bytes(budget)} budget: {slots} streamed "
            f"shards at once, the largest being {named}{more}"
            + (f", plus the pinned {pinned}" if pinned else "")
            + f". Use resident={fits} or fewer, or raise the budget."
        )
    return StreamPlan(resident, prefetch, pinned, stream, peak, total, reason.strip(), sizes, budget)


PACK_SLACK = 1 / 32  # loaded sizes this close to the files' (page rounding, fp32 packing) keep the plan as made


def refit(plan: StreamPlan, loaded: dict[int, int], manifest: Manifest, resident_asked: int | None,
          kept: dict[int, int] | None = None, unpacked: dict[int, int] | None = None,
          packing_failed: str | None = None) -> StreamPlan:
    """``plan`` held to its budget once the streamed shards' loaded sizes are known (``loaded``:
    shard -> bytes a slot holds; on CPU the pre-packed weights, up to 1.6x a 4-bit shard's file;
    ``kept``: shard -> bytes of its weights its session holds for the model's life, outside the
    slots: fed 4-bit weights, which ONNX Runtime's Python API cannot take as inputs; ``unpacked``:
    shard -> bytes a fed 4-bit matmul weight is unpacked into as the shard runs, one shard at a time,
    the largest kept by the arena). Without a budget only the plan's peak changes; K drops where the
    budget chose it; an explicit ``resident`` that no longer fits, or a streamed shard alone over
    what the pinned shards and the kept weights leave, is refused.

    Raises:
        ConfigError: naming the shard, its size on disk and loaded, and the fix.
    """
    grown = {i: loaded[i] for i in plan.streamed if loaded.get(i, 0) > plan.sizes[i] * (1 + PACK_SLACK)}
    kept = {i: n for i, n in (kept or {}).items() if n and i in plan.streamed}
    unpacked = {i: n for i, n in (unpacked or {}).items() if n and i in plan.streamed}
    if not plan.streaming or not (grown or kept or unpacked):
        return plan
    sizes = list(plan.sizes)
    for i, n in grown.items():
        sizes[i] = n
    held = sum(kept.values()) + max(unpacked.values(), default=0)  # beside the slots (which map whole data files)
    pin_bytes = sum(sizes[i] for i in plan.pinned) + held
    beside = ([f"the pinned {plan.pinned} ({fmt_bytes(pin_bytes - held)})"] if plan.pinned else []) + (
        [f"the 4- or 8-bit weights the streamed shards' sessions keep ({fmt_bytes(sum(kept.values()))})"] if kept else []) + (
        [f"the largest fed 4- or 8-bit matmul weight unpacked to float as its shard runs ({fmt_bytes(max(unpacked.values()))}: "
         f"shard {max(unpacked, key=unpacked.get)}; pin it to keep it packed)"] if unpacked else [])
    how = ("with the weights pre-packed for this CPU" if grown else
           "with the 4- or 8-bit weights the sessions " + " or ".join(w for w, x in (("keep", kept), ("unpack", unpacked)) if x))
    other = ("load with pack=False (--no-pack: weights fed as inputs: their size on disk, slower decoding)" if grown else
             f"let packing work ({packing_failed}): set SLIMML_CACHE_DIR (--cache-dir, load(cache_dir=...)) to a "
             "writable folder; pre-packed 4- or 8-bit weights are paged in and out with their shards" if packing_failed else
             "load with pack=True (--pack, the default: 4- or 8-bit weights pre-packed, paged in and out with their shards)")
    slots = plan.resident - len(plan.pinned)
    peak = pin_bytes + sum(sorted((sizes[i] for i in plan.streamed), reverse=True)[:slots])
    if plan.budget is None:  # K as asked: the plan says what it holds
        return dataclasses.replace(plan, peak_bytes=peak)
    big = max(plan.streamed, key=lambda i: sizes[i])
    if pin_bytes + sizes[big] > plan.budget:
        raise ConfigError(
            f"memory budget {fmt_bytes(plan.budget)} cannot hold shard {big} ({manifest.shards[big].file}) as it runs: "
            f"{fmt_bytes(plan.sizes[big])} on disk"
            + (f", {fmt_bytes(sizes[big])} with its weights pre-packed for this CPU" if big in grown else "")
            + (f", beside {' and '.join(beside)}" if beside else "")
            + f". Give at least {_round_up_mb(pin_bytes + sizes[big])}MB, or {other}."
        )
    if peak <= plan.budget:
        return dataclasses.replace(plan, peak_bytes=peak, sizes=sizes)
    fits = _fit(sizes, plan.pinned, plan.streamed, plan.budget - held)
    if resident_asked is not None:
        raise ConfigError(
            f"resident={resident_asked} can need {fmt_bytes(peak)} {how}, over the {fmt_bytes(plan.budget)} budget. "
            f"Use resident={fits} or fewer, raise the budget, or {other}."
        )
    slots = fits - len(plan.pinned)
    peak = pin_bytes + sum(sizes[i] for i in sorted(plan.streamed, key=lambda i: -sizes[i])[:slots])
    return dataclasses.replace(
        plan, resident=fits, prefetch=min(plan.prefetch, slots - 1), peak_bytes=peak, sizes=sizes,
        reason=f"K={fits} is the most that fits the {fmt_bytes(plan.budget)} budget {how}"
               + (" (larger than on disk)" if grown else f" ({fmt_bytes(held)})") + f". P={min(plan.prefetch, slots - 1)}.")


def _auto_pin(sizes: list[int], budget: int, slots: int = STREAM_SLOTS) -> tuple[list[int], str]:
    """The shards to keep loaded under ``budget`` when the model does not fit: as many as fit beside
    ``slots`` streaming slots (the largest of the rest), the first and last shards first (the
    embeddings and the head), then in order. A pass over more shards than slots reuses none of them,
    so memory beyond the slots the loader needs is better spent on shards never read again: every
    shard pinned is a shard less to read per pass (per generated token)."""
    n = len(sizes)
    pinned: list[int] = []
    for c in dict.fromkeys([0, n - 1, *range(1, n - 1)]):
        trial = pinned + [c]
        rest = sorted((sizes[i] for i in range(n) if i not in trial), reverse=True)
        if len(rest) < slots or sum(sizes[i] for i in trial) + sum(rest[:slots]) > budget:
            continue
        pinned = trial
    if not pinned:
        return [], ""
    return sorted(pinned), (f"pinned {len(pinned)} shard(s), the most that fit the {fmt_bytes(budget)} budget beside "
                            f"{slots} streaming slots: a pass reads only the others.")


def _fit(sizes: list[int], pinned: list[int], stream: list[int], budget: int) -> int:
    used = sum(sizes[i] for i in pinned)
    k = len(pinned)
    for size in sorted((sizes[i] for i in stream), reverse=True):
        if used + size > budget:
            break
        used += size
        k += 1
    return k


def _check_pin(pin, n: int) -> list[int]:
    if not pin:
        return []
    out = []
    for p in pin:
        if not isinstance(p, int) or not -n <= p < n:
            raise ConfigError(f"pin={list(pin)} names shard {p!r}, but the model has shards 0..{n - 1} (or -1..-{n}); "
                              "pin shards in that range.")
        out.append(p % n)
    if len(set(out)) != len(out):
        twice = next(i for i in out if out.count(i) > 1)
        raise ConfigError(f"pin={list(pin)} names shard {twice} twice (a negative index counts from the end, -1 the "
                          f"last of {n}); give each shard once.")
    return sorted(out)


def _largest(manifest: Manifest) -> int:
    """The index of the artifact's largest shard."""
    sizes = shard_bytes(manifest)
    return sizes.index(max(sizes))


def _uncut(manifest: Manifest, index: int) -> bool:
    """Whether shard ``index`` is a piece a smaller ``--shard-size`` would not cut: no layer in a
    model whose other shards hold them, which is its token embedding or its head, one big weight
    each (a layer's shard is cut between its matrices)."""
    return not manifest.shards[index].layers and any(s.layers for s in manifest.shards)


def _round_up_mb(n: int) -> int:
    return -(-n // 10**6)
