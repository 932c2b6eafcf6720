"""Students of all-MiniLM-L6-v2 for the accuracy-vs-size curve: layers x prune fractions.

Run:  python benchmarks/sweep_distill.py --out artifacts/sweep [--layers 2 3 4] [--prune 0 0.3 0.5] [--max-steps 40]
then: python benchmarks/bench_distill.py artifacts/sweep/* --json sweep.json && python benchmarks/plot_distill.py sweep.json

One process, so the teacher's embeddings of the training sentences are computed once for all.
``--max-steps`` caps the training of each student (a quick curve); leave it out for full runs.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STS_TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb" / "sts-train.csv"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("artifacts/sweep"))
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--prune", type=float, nargs="+", default=[0.0, 0.3, 0.5])
    ap.add_argument("--epochs", type=float, default=None)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--data", type=Path, default=STS_TRAIN)
    args = ap.parse_args()

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.distill import DistillConfig
    from slimml.convert.prune import PruneConfig

    for layers in args.layers:
        for fraction in args.prune:
            t0 = time.perf_counter()
            name = f"d{layers}p{int(round(fraction * 100)):02d}"
            config = ConvertConfig(
                distill=DistillConfig(layers=layers, data=args.data, epochs=args.epochs, max_steps=args.max_steps),
                prune=PruneConfig(fraction) if fraction > 0 else None, measure_latency=False)
            report = convert(None, args.out / name, config)
            print(f"{name}: {report.size_mb:.1f} MB in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
