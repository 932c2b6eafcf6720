"""Accuracy against size from one or more ``bench_distill.py --json`` files, as a PNG (needs matplotlib).

Run:  python benchmarks/plot_distill.py docs/distill_sweep.json -o docs/distill_accuracy_vs_size.png

Students with the same layer count are joined by a line (prune 0 -> 0.3 -> 0.5 going left); the
teacher and its Optimum int8 peer are single points; the dashed lines are the issue's goals.
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
    colors = {2: "tab:orange", 3: "tab:green", 4: "tab:blue"}
    by_layers: dict[int, list] = {}
    for name, r in rows.items():
        if "peer" in name:
            ax.scatter(r["size_mb"], r["stsb_dev"], marker="*", color="tab:red", s=140, zorder=3, label="teacher, Optimum int8 (peer)")
        elif "teacher" in name:
            ax.scatter(r["size_mb"], r["stsb_dev"], marker="D", color="black", s=50, zorder=3, label="teacher, fp32")
        else:
            by_layers.setdefault(r["layers"], []).append((r["size_mb"], r["stsb_dev"], r["prune"]))
    for layers, pts in sorted(by_layers.items()):
        pts.sort()
        color = colors.get(layers, "tab:purple")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, zorder=3, label=f"{layers}-layer student, int8")
        for size, score, prune in pts:
            ax.annotate(f"prune {prune:g}", (size, score), textcoords="offset points", xytext=(5, -10), fontsize=7, color=color)
    ax.axhline(84.0, color="grey", linestyle="--", linewidth=0.8, label="goal: STSb dev >= 84.0")
    ax.axvline(12.0, color="grey", linestyle=":", linewidth=0.8, label="goal: <= 12 MB")
    ax.set_xscale("log")
    ax.set_xlabel("artifact size, MB (log scale)")
    ax.set_ylabel("STSb dev, Spearman x100")
    ax.set_title("all-MiniLM-L6-v2 students: accuracy against size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
