"""What sharding costs: the sharded artifact vs the same graph unsharded vs torch, interleaved.

Run:  python benchmarks/bench_shards.py [--batch 1] [--seq 128] [--rounds 30]

Converts the default model (or SOURCE) into a temp folder, then times, in blocks of calls
alternating in one process (``timing.py``): torch (sentence-transformers module), the unsharded ONNX graph,
and the slimml artifact. Prints medians and ratios; absolute times on a shared machine are noise.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from timing import interleaved  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", nargs="?", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="ORT and torch threads (0: library default)")
    args = ap.parse_args()

    import torch

    from slimml.convert import ConvertConfig, convert, export, resolve
    from slimml.runtime import load
    from slimml.runtime.tools.bench import sample_feeds
    from slimml.runtime.engine.session import make_session

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        convert(args.source, tmp / "art", ConvertConfig(measure_latency=False))
        src = resolve(args.source)
        exported = export(src, tmp / "whole")
        model = load(tmp / "art", threads=args.threads or None)
        whole = make_session(exported.onnx_path, "cpu", threads=args.threads or None)
        feeds = sample_feeds(model.inputs, batch=args.batch, seq=args.seq, vocab_size=model.manifest.source.get("vocab_size"))
        names = [t.name for t in model.outputs]
        from slimml.convert.reference import reference_for

        ref = reference_for(src, exported, names)
        contenders = {
            "torch": lambda: ref(feeds),
            "onnx (unsharded)": lambda: whole.run(names, feeds),
            f"slimml ({len(model.manifest.shards)} shards)": lambda: model.run(feeds),
        }
        ms = interleaved(contenders, args.rounds)
        base = ms["onnx (unsharded)"]
        print(f"batch {args.batch} x seq {args.seq}, {args.rounds} calls each, interleaved in blocks")
        print(f"{'system':<24}{'p50 ms':>10}{'vs unsharded':>14}")
        for name, med in ms.items():
            print(f"{name:<24}{med:>10.2f}{med / base:>13.2f}x")

if __name__ == "__main__":
    main()
