"""What ``run()`` costs per call: ``model.run(feeds)`` against the plan's bare ONNX Runtime session.

    python benchmarks/bench_overhead.py ARTIFACT [--batch 1] [--seq 128] [--calls 2000]

For a fully resident artifact (one merged session), alternates the two calls, the order reversed
every other round, and prints the medians and the difference: the feed checks, the file watch
and the plan walk. Use the small student (``--distill-layers 3 --prune 0.5 --quantize int8``),
where a call is shortest and the cost shows most.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    from slimml.runtime import load
    from slimml.runtime.tools.bench import sample_feeds

    model = load(args.artifact)
    if model.plan.sessions != 1:
        raise SystemExit(f"{args.artifact} runs as {model.plan.sessions} sessions; this measures a one-session plan.")
    feeds = sample_feeds(model.manifest.inputs, batch=args.batch, seq=args.seq)
    step = model.plan.segments[0].steps[0]
    fns = {"bare session": lambda: step.session.run(step.outputs, feeds), "model.run": lambda: model.run(feeds)}
    times = {k: [] for k in fns}
    keys = list(fns)
    for r in range(args.calls):
        for k in keys if r % 2 == 0 else keys[::-1]:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    extra = med["model.run"] - med["bare session"]
    print(f"{args.artifact}: b{args.batch} s{args.seq}, {args.calls} calls each: bare session {med['bare session']:.3f} ms, "
          f"model.run {med['model.run']:.3f} ms, run() costs {extra * 1e3:.0f} us = {extra / med['bare session'] * 100:.1f}%")


if __name__ == "__main__":
    main()
