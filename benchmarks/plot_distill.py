"""Accuracy against size from one or more ``bench_distill.py --json`` files, as a PNG (needs matplotlib).

Run:  python benchmarks/plot_distill.py results.json [more.json] -o docs/distill_accuracy_vs_size.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("-o", "--out", type=Path, default=Path("docs/distill_accuracy_vs_size.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {}
    for f in args.results:
        rows |= json.loads(f.read_text())
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    styles = {"fp32": ("o", "tab:blue"), "int8 est.": ("s", "tab:green"), "mm-only": ("^", "tab:olive"),
              "peer": ("*", "tab:red"), "teacher": ("D", "black")}
    for name, r in rows.items():
        key = next((k for k in ("peer", "mm-only", "int8 est.", "fp32") if k in name), "teacher")
        if "teacher" in name and key == "fp32":
            key = "teacher"
        marker, color = styles[key]
        ax.scatter(r["size_mb"], r["stsb_dev"], marker=marker, color=color, s=60, zorder=3)
        ax.annotate(name, (r["size_mb"], r["stsb_dev"]), textcoords="offset points", xytext=(5, 4), fontsize=7)
    ax.axhline(84.0, color="grey", linestyle="--", linewidth=0.8)
    ax.axvline(12.0, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("artifact size, MB (log scale)")
    ax.set_ylabel("STSb dev, Spearman x100")
    ax.set_title("all-MiniLM-L6-v2 students: accuracy against size")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
