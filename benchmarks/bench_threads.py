"""Thread settings for a plan of several ONNX Runtime sessions that run one after another.

    python benchmarks/bench_threads.py ARTIFACT [--rounds 3] [--batch 1 32] [--resident K]

A plan with one session keeps ORT's defaults. A plan with several (streamed shards, or shards
whose merge ONNX Runtime refused) must choose: each session's own pool spin-waiting (ORT's
default), not spinning, or one global pool shared by every session
(``onnxruntime.set_global_thread_pool_sizes`` + ``use_per_session_threads = False``), spinning or
not. Each setting runs in its own subprocess (the global pool is process-wide), alternating
over ``--rounds``; the shards run as slimml's plan runs them (``weights_as_inputs`` sessions fed
from memory-mapped slots when ``--resident`` streams, else one session per shard). Prints the
median ms per pass of each setting and its ratio to the setting slimml uses (no spinning, own pools).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "own pools, no spin (slimml)": {"spin": False, "shared": False},
    "own pools, spin (ORT default)": {"spin": True, "shared": False},
    "own pools, spin, stop after run": {"spin": True, "shared": False, "stop": True},
    "shared pool, no spin": {"spin": False, "shared": True},
    "shared pool, spin": {"spin": True, "shared": True},
}


def child(args) -> None:
    import onnxruntime as ort

    setting = SETTINGS[args.child]
    if setting["shared"]:
        ort.set_global_thread_pool_sizes(os.cpu_count() or 1, 1)
    from slimml.runtime import load
    from slimml.runtime.engine.backends.base import Backend
    from slimml.runtime.tools.bench import sample_feeds

    real = Backend.session_options

    def options(self, threads=None, spinning=True, weights_folder=None, shared_arena=False):  # every session of the plan
        so = real(self, threads, setting["spin"], weights_folder, shared_arena)
        if setting.get("stop"):
            so.add_session_config_entry("session.force_spinning_stop", "1")
        if setting["shared"]:
            so.use_per_session_threads = False
        return so

    import slimml.runtime.engine.plan as plan_mod

    Backend.session_options = options
    if not args.resident:  # one session per shard: the plan a refused merge falls back to
        plan_mod.merge_shards = _refuse
    model = load(args.artifact, resident=args.resident) if args.resident else load(args.artifact)
    out = {}
    for batch in args.batch:
        feeds = sample_feeds(model.manifest.inputs, batch=batch, seq=args.seq,
                             vocab_size=model.manifest.source.get("vocab_size"))
        for _ in range(3):
            model.run(feeds)
        times = []
        for _ in range(args.runs if batch == 1 else max(args.runs // 8, 5)):
            t0 = time.perf_counter()
            model.run(feeds)
            times.append(time.perf_counter() - t0)
        out[str(batch)] = statistics.median(times) * 1e3
    print("RESULT " + json.dumps({"sessions": model.plan.sessions, "ms": out}), flush=True)


def _refuse(*a, **k):
    from slimml.errors import ArtifactError

    raise ArtifactError("measuring one session per shard")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=80)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--resident", type=int, default=None, help="stream with K resident (default: one session per shard)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import logging

        logging.getLogger("slimml").setLevel(logging.ERROR)
        return child(args)
    results = {name: {str(b): [] for b in args.batch} for name in SETTINGS}
    sessions = None
    for r in range(args.rounds):
        names = list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]
        for name in names:
            cmd = [sys.executable, __file__, args.artifact, "--child", name, "--runs", str(args.runs), "--seq", str(args.seq),
                   "--batch", *map(str, args.batch)] + (["--resident", str(args.resident)] if args.resident else [])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            res = json.loads(line[-1][7:])
            sessions = res["sessions"]
            for b, ms in res["ms"].items():
                results[name][b].append(ms)
    base = list(SETTINGS)[0]
    print(f"{args.artifact}: {sessions} sessions, seq {args.seq}, {'K=' + str(args.resident) if args.resident else 'one session per shard'}")
    report = {}
    for name, per in results.items():
        cells = []
        for b, v in per.items():
            med = statistics.median(v)
            ratio = med / statistics.median(results[base][b])
            report.setdefault(name, {})[f"b{b}_ms"] = round(med, 2)
            report[name][f"b{b}_vs_slimml"] = round(ratio, 3)
            cells.append(f"b{b} {med:8.2f} ms ({ratio:.2f}x)")
        print(f"  {name:32s} " + "  ".join(cells))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
