"""Regression baselines: save what ``eval`` or ``bench`` measured, and fail a later run that is worse.

A baseline is a small JSON file. ``slimml eval ... --save-baseline base.json`` writes one;
``slimml eval ... --baseline base.json`` measures again and compares, metric by metric, within
tolerances: tight for accuracy (deterministic on one machine), generous for latency (noise). A
run outside them prints a table of what changed and exits with code 3, so a CI job fails.

Example:
    >>> from slimml.runtime.tools.baseline import Baseline, Tolerances, compare
    >>> old = Baseline.load("base.json")
    >>> report = compare(old, Baseline.from_eval(result, "all-MiniLM-L6-v2", "sts-dev.csv"), Tolerances())
    >>> report.ok, print(report.format())
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimml.errors import ConfigError, DataError
from slimml.runtime.tasks.limits import a_or_an

FORMAT = "slimml.baseline"
FORMAT_VERSION = 1
REGRESSION_EXIT_CODE = 3  # 0 ok, 1 slimml error, 2 usage error (Typer), 3 regression


@dataclass
class Tolerances:
    """How much worse a run may be than its baseline before it counts as a regression.

    Args:
        accuracy_drop: points of the metric (Spearman x100) the score may fall. Eval on one
            machine at one batch size is deterministic to ~1e-4, so 0.1 catches any real change
            in the model (the batch size is a recorded setting: an int8 model's score moves ~0.1
            with it).
        latency_increase_pct: percent the p50 latency may rise. Shared CI runners vary by
            tens of percent from run to run; 50 only catches real slowdowns.
        size_increase_pct: percent the artifact may grow (deterministic; 1 allows metadata).
        perplexity_increase_pct: percent a language model's perplexity may rise (deterministic on
            one machine; 0.1 catches any real change, as for accuracy).
    """

    accuracy_drop: float = 0.1
    latency_increase_pct: float = 50.0
    size_increase_pct: float = 1.0
    perplexity_increase_pct: float = 0.1

    def __post_init__(self):
        for name, flag in _FLAGS.items():
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{flag} (tolerance {name}) must be a finite number >= 0, got {value!r}.")


_FLAGS = {"accuracy_drop": "--max-accuracy-drop", "latency_increase_pct": "--max-latency-increase",
          "size_increase_pct": "--max-size-increase", "perplexity_increase_pct": "--max-perplexity-increase"}
# how a run sets each setting a baseline records (named in the refusal of another)
LATENCY_SETTINGS = ("plan", "weights", "threads")  # what a bench baseline must record to hold a timing to it
_SET_BY = {"batch": "--batch", "seq": "--seq", "device": "--device", "component": "--component",
           "plan": "--resident/--prefetch/--pin/--memory-budget", "weights": "--pack/--no-pack, --cache-dir",
           "threads": "SLIMML_THREADS", "data": "--data",
           "data_sha256": "--data", "window": "--window", "max_tokens": "--max-tokens", "batch_size": "--batch-size"}


@dataclass
class Baseline:
    """What one ``eval`` or ``bench`` run measured, and under which settings."""

    kind: str  # "eval" or "bench"
    artifact: str  # the artifact's name, shown in the diff (a baseline may be another artifact's)
    settings: dict[str, Any]  # must match for a comparison to mean anything
    metrics: dict[str, float]
    slimml_version: str = ""
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    @classmethod
    def from_eval(cls, result, artifact: str, data: str | os.PathLike) -> Baseline:
        from slimml.runtime.artifact.files import sha256_file

        data = Path(data)
        return cls(
            kind="eval", artifact=artifact,
            settings={"metric": result.metric, "data": data.name, "data_sha256": sha256_file(data), result.unit: result.count,
                      **getattr(result, "settings", {})},
            metrics={"score": float(result.score)}, slimml_version=_version(),
        )

    @classmethod
    def from_bench(cls, result, artifact: str, **settings: Any) -> Baseline:
        """``settings``: what else decides the latency (the component timed, the streaming plan, the threads)."""
        return cls(
            kind="bench", artifact=artifact,
            settings={"batch": result.batch, "seq": result.seq, "device": result.device, **settings},
            metrics={"p50_ms": result.p50_ms, "p90_ms": result.p90_ms, "throughput_per_s": result.throughput_per_s,
                     "model_mb": result.model_mb,
                     **({"peak_rss_mb": result.peak_rss_mb} if result.peak_rss_mb is not None else {})},
            slimml_version=_version(),
        )

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": self.kind, "artifact": self.artifact,
                "settings": self.settings, "metrics": self.metrics, "slimml_version": self.slimml_version,
                "created": self.created}

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (temp file, then rename): a killed run never leaves half a baseline."""
        from slimml.runtime.artifact.replace import replace_file

        path = Path(path)
        try:
            replace_file(path, json.dumps(self.to_json(), indent=2) + "\n")
        except OSError as e:
            raise ConfigError(f"cannot write the baseline {path} ({e.strerror}); choose a writable path.") from None
        return path

    @staticmethod
    def check_writable(path: str | os.PathLike, data: str | os.PathLike | None = None, kind: str | None = None) -> None:
        """Refuse, before anything is measured, a path :meth:`save` could not write, or should not:
        a file there that is not a slimml baseline (the data file, an artifact's manifest) is the
        user's, and is not replaced; nor is a baseline of the other command (``kind``: "eval" or
        "bench", what this run saves), which another gate reads.

        Raises:
            ConfigError: the path is a folder, the data file, another file than a baseline, a
                baseline of the other command, or its folder is missing or not writable.
        """
        path = Path(path).absolute()
        folder = path.parent
        why = ("it is a folder" if path.is_dir() else f"its folder {folder} does not exist" if not folder.is_dir()
               else f"its folder {folder} is not writable" if not os.access(folder, os.W_OK | os.X_OK) else None)
        if why:
            raise ConfigError(f"cannot write the baseline {path} ({why}); give a file path in a writable folder.")
        if data is not None and path.exists() and Path(data).exists() and path.samefile(data):
            raise ConfigError(f"--save-baseline {path} is the --data file; give the baseline a path of its own.")
        held = _baseline_kind(path)
        if os.path.lexists(path) and held is None and not (path.is_file() and path.stat().st_size == 0):  # mktemp's
            raise ConfigError(f"{path} exists and is not a slimml baseline; refusing to replace it. Give --save-baseline "
                              "a new path (or one that holds a baseline).")
        if kind is not None and held not in (None, "", kind):
            raise ConfigError(f"{path} holds a `slimml {held}` baseline, and this run is `slimml {kind}`; refusing to "
                              f"replace it (a {held} gate reads it). Give --save-baseline a path of its own.")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Baseline:
        """Read a baseline file.

        Raises:
            DataError: the file is missing, not JSON, or not a slimml baseline of this version.
        """
        path = Path(path)
        if path.is_dir():
            raise DataError(f"baseline {path} is a folder; give the baseline file written by --save-baseline.")
        if not path.is_file():
            raise DataError(f"baseline {path} does not exist; write one first with --save-baseline {path}.")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise DataError(f"baseline {path} is not valid JSON ({type(e).__name__}); write it again with --save-baseline.") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise DataError(f"{path} is not a slimml baseline (expected \"format\": \"{FORMAT}\"); give a file "
                            "written by --save-baseline.")
        if raw.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"baseline {path} has format version {raw.get('format_version')!r}; this slimml reads "
                f"{FORMAT_VERSION}. Save it again with --save-baseline."
            )
        metrics, settings = raw.get("metrics"), raw.get("settings")
        ok = raw.get("kind") in ("eval", "bench") and isinstance(settings, dict) and isinstance(metrics, dict)
        ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v) for v in metrics.values())
        ok = ok and (raw["kind"] != "eval" or "score" in metrics)  # what an eval is compared on
        ok = ok and (raw["kind"] != "bench" or all(metrics.get(k, 0) > 0 for k in _GATED))  # what a bench is gated on
        if not ok:
            raise DataError(f"baseline {path} is malformed (kind, settings, or metrics that are missing or not finite "
                            "numbers, or a latency or size that is not positive); save it again with --save-baseline.")
        if settings.get("metric") == "perplexity" and "pairs" in settings and "tokens" not in settings:
            settings["tokens"] = settings.pop("pairs")  # baselines written before the count was named by its unit
        return cls(kind=raw["kind"], artifact=str(raw.get("artifact", "")), settings=settings,
                   metrics={k: float(v) for k, v in metrics.items()},
                   slimml_version=str(raw.get("slimml_version", "")), created=str(raw.get("created", "")))


def _finite(v: int | float) -> bool:
    """A finite number that is a float too (an integer of 400 digits is not)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _baseline_kind(path: Path) -> str | None:
    """The command ("eval", "bench"; "" where it does not say) of the slimml baseline (of any version)
    ``path`` holds, read without trusting it; None where it holds none."""
    try:
        if not path.is_file() or path.stat().st_size > 1 << 20:
            return None
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return None
    return raw.get("kind") if raw.get("kind") in ("eval", "bench") else ""


@dataclass
class Check:
    metric: str
    baseline: float
    current: float
    limit: float | None  # the worst allowed value; None for a row shown for information only
    ok: bool
    unit: str = ""

    @property
    def change(self) -> float:
        return self.current - self.baseline


@dataclass
class Comparison:
    """The outcome of comparing a run with its baseline; ``ok`` is False on any regression."""

    kind: str
    baseline: Baseline
    current: Baseline
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def regressions(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def format(self, source: str = "the baseline") -> str:
        """A plain-text table: one row per metric, baseline, current, change, limit, verdict."""
        b, c = self.baseline, self.current
        where = ", ".join(f"{k}={v}" for k, v in c.settings.items() if k not in _UNSHOWN and v is not None)
        head = f"slimml {self.kind}: {c.artifact} against {source} ({b.artifact}, {b.created or 'undated'}); {where}"
        rows = [("metric", "baseline", "current", "change", "limit", "verdict")]
        for ch in self.checks:
            pct = f" ({100 * ch.change / ch.baseline:+.1f}%)" if ch.baseline and ch.unit != "points" else ""
            limit = "-" if ch.limit is None else (f">= {ch.limit:.4g}" if ch.unit == "points" else f"<= {ch.limit:.4g}")
            verdict = "info" if ch.limit is None else ("ok" if ch.ok else "REGRESSION")
            rows.append((ch.metric, f"{ch.baseline:.4g}", f"{ch.current:.4g}", f"{ch.change:+.4g}{pct}", limit, verdict))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        bad = self.regressions
        if bad:
            lines.append(f"FAIL: {len(bad)} regression(s): " + "; ".join(_why(ch) for ch in bad) + ".")
        else:
            lines.append("ok: no regression beyond the tolerances.")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "baseline_artifact": self.baseline.artifact,
                "checks": [{"metric": c.metric, "baseline": c.baseline, "current": c.current,
                            "limit": c.limit, "ok": c.ok} for c in self.checks]}


_GATED = ("p50_ms", "model_mb")  # a bench baseline's metrics that gate a run
MODEL_SETTINGS = ("task", "inputs")  # what a bench baseline records of the model it timed
_UNSHOWN = ("data_sha256", *MODEL_SETTINGS)  # settings a comparison's header leaves out (a hash; the artifact is named)


def compare(baseline: Baseline, current: Baseline, tolerances: Tolerances | None = None) -> Comparison:
    """Compare ``current`` with ``baseline`` metric by metric.

    Raises:
        ConfigError: the two are of different kinds or were measured under different settings
            (data, batch, sequence length, device), so comparing them would mean nothing.
    """
    tol = tolerances or Tolerances()
    check_settings(baseline, current.kind, current.settings)
    checks: list[Check] = []
    m0, m1 = baseline.metrics, current.metrics
    if current.kind == "eval" and current.settings.get("metric") == "perplexity":  # lower is better
        limit = m0["score"] * (1 + tol.perplexity_increase_pct / 100)
        checks.append(Check("perplexity", m0["score"], m1["score"], limit, m1["score"] <= limit + 1e-9, "ppl"))
    elif current.kind == "eval":
        limit = m0["score"] - tol.accuracy_drop
        checks.append(Check(f"{current.settings.get('metric', 'score')} x100", m0["score"], m1["score"], limit,
                            m1["score"] >= limit - 1e-9, "points"))
    else:
        rules = [("p50_ms", 1 + tol.latency_increase_pct / 100, "ms"), ("model_mb", 1 + tol.size_increase_pct / 100, "MB")]
        for key, factor, unit in rules:  # both in every bench baseline (Baseline.load refuses one without them)
            if key in m0 and key in m1:
                limit = m0[key] * factor
                checks.append(Check(key, m0[key], m1[key], limit, m1[key] <= limit + 1e-12, unit))
        for key, unit in (("p90_ms", "ms"), ("throughput_per_s", "/s"), ("peak_rss_mb", "MB")):
            if key in m0 and key in m1:  # noisy on shared machines: shown, not gated
                checks.append(Check(key, m0[key], m1[key], None, True, unit))
    return Comparison(kind=current.kind, baseline=baseline, current=current, checks=checks)


def check_settings(baseline: Baseline, kind: str, settings: dict[str, Any]) -> None:
    """Refuse early a comparison that would mean nothing: another command or other settings.

    Raises:
        ConfigError: naming each setting that differs.
    """
    if baseline.kind != kind:
        raise ConfigError(f"the baseline is from `slimml {baseline.kind}`; use it with `slimml {baseline.kind}`, not `{kind}`.")
    unrecorded = [k for k in LATENCY_SETTINGS if k in settings and k not in baseline.settings]
    if unrecorded:  # a timing from an older slimml: it cannot say whether this run streams, packs or threads alike
        raise ConfigError(f"the baseline does not record its {', '.join(unrecorded)} (a slimml before "
                          f"{'these were' if len(unrecorded) > 1 else 'it was'} recorded saved it), so a run under another "
                          "streaming plan or thread count would pass against it; save a new baseline with --save-baseline.")
    if any(k in settings and k not in baseline.settings for k in MODEL_SETTINGS):
        raise ConfigError("the baseline does not record the model it timed (its task and inputs; a slimml before they "
                          "were recorded saved it), so another model's timing would pass against it; save a new baseline "
                          "with --save-baseline.")
    differ = {k: (baseline.settings[k], v) for k, v in settings.items()  # what an older baseline did not record, it
              if k in baseline.settings and baseline.settings[k] != v}  # does not hold a run to
    if any(k in differ for k in MODEL_SETTINGS):  # another model: no setting of this run makes them compare
        b = baseline.settings
        raise ConfigError(
            f"the baseline was saved from {baseline.artifact or 'another artifact'}, {a_or_an(str(b.get('task')))} model taking "
            f"{_names(b.get('inputs'))}, and this artifact is {a_or_an(str(settings.get('task')))} model taking "
            f"{_names(settings.get('inputs'))}, so their latencies do not compare; gate with a baseline of the same "
            "model (its float or an earlier build), or save one with --save-baseline.")
    if "data_sha256" in settings and settings["data_sha256"] == baseline.settings.get("data_sha256"):
        differ.pop("data", None)  # the same bytes under another name
    if differ:
        said = ", ".join(f"{k}: baseline {a!r}, now {b!r}" + (f" [{_SET_BY[k]}]" if k in _SET_BY else "")
                         for k, (a, b) in differ.items())
        raise ConfigError(
            f"the baseline was measured under other settings ({said}); run with the baseline's settings, or save a "
            "new baseline with --save-baseline."
        )


def _names(names: Any) -> str:
    """Input names as ``info`` shows them (a decoder's cache as ``past_key_values.{0..29}.key``); a
    hand-edited baseline's value as it is."""
    from slimml.runtime.artifact.manifest import TensorSpec, tensor_list

    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return repr(names)
    return tensor_list([TensorSpec(n, "", []) for n in names], types=False)


def _why(ch: Check) -> str:
    if ch.unit == "points":
        return f"{ch.metric} fell by {-ch.change:.4g} points (allowed {ch.baseline - ch.limit:.4g})"
    if not ch.baseline:
        return ch.metric
    allowed = 100 * (ch.limit / ch.baseline - 1)
    rose = 100 * ch.change / ch.baseline
    said = f"{rose:+.0f}" if abs(rose) >= 100 else f"{rose:+.3g}"  # +287, +1.01, +0.00213: never +0.00 nor +2.87e+02
    return f"{ch.metric} rose {said}% (allowed +{allowed:.3g}%)"


def _version() -> str:
    import slimml

    return getattr(slimml, "__version__", "")
