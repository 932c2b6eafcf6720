"""``slimml bench --sweep``: the memory / speed trade-off over K (resident) and P (prefetch).

Each setting loads the artifact afresh, times it with :func:`slimml.runtime.tools.bench.bench`, and
drops it before the next, so the RSS sampled during its runs is its own. The results go to a
Markdown table, a CSV and (with matplotlib, ``pip install 'slimml[bench]'``) a PNG plot.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from pathlib import Path

from slimml.errors import ConfigError, SlimmlError
from slimml.runtime.artifact.manifest import read_manifest
from slimml.runtime.artifact.places import unwritable
from slimml.runtime.tools.bench import bench

COLUMNS = ["resident", "prefetch", "loaded_mb", "run_peak_rss_mb", "p50_ms", "items_per_s",
           "wait_s", "compute_s", "mb_per_run"]


@dataclass
class SweepResult:
    rows: list[dict]
    table: Path
    csv: Path
    plot: Path | None
    skipped: list[str] = field(default_factory=list)  # the points asked for that cannot stream this artifact, and why


def _check_writable(out: Path) -> None:
    """Refuse, before the runs, a sweep folder that could not be made or written (it is made, with
    its parents, once they are done)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--sweep-out {out} is a file; give a folder for the sweep's table, CSV and plot.")
    why = unwritable(out)
    if why:
        raise ConfigError(f"cannot write the sweep to {out} ({why}); give --sweep-out a writable folder.")


def sweep(
    path: str | os.PathLike,
    resident: list[int],
    prefetch: list[int] | None = None,
    out_dir: str | os.PathLike = "sweep",
    device: str = "cpu",
    batch: int = 1,
    seq: int = 128,
    runs: int = 5,
    pin: list[int] | None = None,
    pack: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> SweepResult:
    """Bench every (K, P) pair that is valid, plus the fully resident model, and write the results.

    Args:
        path: the artifact folder.
        resident: K values to try.
        prefetch: P values to try (default: each K's own default, K - pinned - 1).
        out_dir: where ``sweep.md``, ``sweep.csv`` and ``sweep.png`` go.
        pack, cache_dir: as :func:`~slimml.runtime.load` takes them, for every plan timed.

    Example:
        >>> sweep("artifacts/my-llama", resident=[2, 3, 4], prefetch=[0, 1, 2], out_dir="sweep")
    """
    from slimml.runtime.loader import load

    manifest = read_manifest(path)
    if manifest.components:
        raise ConfigError(f"--sweep times the plans of one chain of shards, and {path} has components "
                          f"({', '.join(manifest.components)}); time one with slimml bench --component NAME --resident K.")
    _check_writable(Path(out_dir).absolute())  # before the runs, not after them
    if not resident or any(k < 1 for k in resident):
        raise ConfigError(f"--sweep needs resident values >= 1, got {resident}.")
    n = len(manifest.shards)
    combos, skipped, pinned = [], [], len(pin or [])
    for k in sorted(set(resident)):
        for p in sorted(set(prefetch)) if prefetch else [None]:
            slots = k - pinned
            why = (f"K={k} holds all {n} shards: nothing streams" if k >= n else
                   f"K={k} leaves no slot beside the {pinned} pinned" if slots < 1 else
                   f"P={p} needs K >= {p + 1 + pinned}" if p is not None and p > slots - 1 else None)
            if why:
                skipped.append(f"K={k}" + (f" P={p}" if p is not None else "") + f" ({why})")
                continue
            combos.append((k, p))
    if not combos:
        raise ConfigError(f"no point of the sweep streams this artifact of {n} shards: {'; '.join(skipped)}. Give K values "
                          f"from {1 + pinned} to {n - 1}, and P values below K, e.g. --sweep 2,3:0,1.")
    combos.append((None, None))  # the fully resident reference
    rows = []
    verify = True
    for k, p in combos:
        try:
            model = load(path, device=device, resident=k, prefetch=p, pin=pin if k else None, verify=verify, pack=pack,
                         cache_dir=cache_dir)
        except ConfigError as e:  # said with the others skipped, not dropped without a word
            skipped.append(f"K={k}" + (f" P={p}" if p is not None else "") + f" ({str(e).rstrip('.')})")
            continue
        verify = False  # hashing every file once is enough
        r = bench(model, batch=batch, seq=seq, runs=runs, warmup=1)
        st = r.stream or {}
        rows.append({
            "resident": model.plan.resident,
            "prefetch": model.plan.prefetch if model.plan.streaming else "-",
            "loaded_mb": round(model.plan.peak_bytes / 1e6, 3),
            "run_peak_rss_mb": round(r.run_peak_rss_mb or 0, 1),
            "p50_ms": round(r.p50_ms, 2),
            "items_per_s": round(r.throughput_per_s, 2),
            "wait_s": st.get("wait_s_per_run", 0.0),
            "compute_s": st.get("compute_s_per_run", 0.0),
            "mb_per_run": round(st.get("bytes_per_run", 0) / 1e6, 3),
        })
        model.close()
        del model
    if not rows:
        raise SlimmlError("no (resident, prefetch) setting of the sweep fits this artifact; give --sweep K values from 1 "
                          "to the number of shards, each P below its K.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "sweep.md"
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for row in rows]
    table.write_text(f"{manifest.name}: batch {batch} x seq {seq}, {device}, {runs} runs each\n\n" + "\n".join(lines) + "\n")
    csv_path = out / "sweep.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return SweepResult(rows=rows, table=table, csv=csv_path, plot=_plot(rows, out / "sweep.png", manifest.name),
                       skipped=skipped)


def _plot(rows: list[dict], path: Path, name: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None  # the table and CSV are written; the CLI says how to get the plot
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["run_peak_rss_mb"] for r in rows]
    ys = [r["items_per_s"] for r in rows]
    ax.scatter(xs, ys)
    for r, x, y in zip(rows, xs, ys):
        label = "all resident" if r["prefetch"] == "-" else f"K={r['resident']} P={r['prefetch']}"
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("peak RSS during runs (MB)")
    ax.set_ylabel("throughput (items/s)")
    ax.set_title(f"{name}: memory vs speed")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
