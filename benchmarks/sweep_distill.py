"""Students of all-MiniLM-L6-v2 for the accuracy-vs-size curve: layers x prune fractions, int8.

Run:  python benchmarks/sweep_distill.py --out artifacts/sweep [--layers 2 3 4] [--prune 0 0.3 0.5] [--max-steps 40]
then: python benchmarks/bench_distill.py artifacts/sweep/* --json docs/distill_sweep.json
      python benchmarks/plot_distill.py docs/distill_sweep.json -o docs/distill_accuracy_vs_size.png

Each student is what ``slimml convert --distill-layers L [--prune P] --quantize int8 --distill-data
sts-train.csv`` writes (the default recipe), built through the library in one process so the
teacher's embeddings of the training sentences are computed once for all. A student folder that
already exists is kept (so a stopped sweep continues). ``--max-steps`` caps each training phase (a
quick curve); leave it out for real runs.
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
    ap.add_argument("--quantize", default="int8", help="as `slimml convert --quantize` (none for fp32 students)")
    ap.add_argument("--epochs", type=float, default=None)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--data", type=Path, default=STS_TRAIN)
    args = ap.parse_args()

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.distill import DistillConfig
    from slimml.convert.distill.prune import PruneConfig
    from slimml.quantize.config import scheme_config

    for layers in args.layers:
        for fraction in args.prune:
            name = f"d{layers}p{int(round(fraction * 100)):02d}"
            if (args.out / name / "manifest.json").is_file():
                print(f"{name}: kept (already built)", flush=True)
                continue
            t0 = time.perf_counter()
            config = ConvertConfig(
                distill=DistillConfig(layers=layers, data=args.data, epochs=args.epochs, max_steps=args.max_steps),
                prune=PruneConfig(fraction) if fraction > 0 else None, measure_latency=False,
                quantize=scheme_config(args.quantize))
            report = convert(None, args.out / name, config)
            print(f"{name}: {report.size_mb:.1f} MB in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
