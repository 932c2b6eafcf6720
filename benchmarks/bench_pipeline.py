"""Pipeline stages on a simulated two-node Ray cluster against the ideal pipelining model.

    python benchmarks/bench_pipeline.py ARTIFACT [--batch 32] [--microbatches 1 2 4 8] [--rounds 7]
                                        [--balance compute] [--json OUT]

A local cluster of two Ray nodes with one CPU each (``ray.cluster_utils.Cluster``: separate
raylets and object stores on this machine), and ``slimml.scale.pipeline(artifact, stages=2)``
placing one stage per node. One call runs a batch of ``--batch`` STSb dev sentences cut into M
microbatches. For each M, rounds interleaved:

* ``wall``: the call's time (median);
* ``t_k``: stage k's compute time per microbatch, from the stages' own busy counters;
* ``ideal``: ``sum_k t_k + (M - 1) * max_k t_k``, the pipelining model (``(M + S - 1) * t`` when
  the S stages take t each); ``efficiency = ideal / wall`` (1.0: no overhead beyond the model);
* ``busy``: each stage's share of the wall time spent computing.

The stages' microbatch count is set between calls (``segment.microbatch``), so every M runs on
the same actors.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path

STSB = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb" / "sts-dev.csv"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", type=Path)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--balance", default="compute")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    ray_tmp = tempfile.mkdtemp(prefix="slimml-ray-", dir="/tmp")
    os.environ.update({"RAY_TMPDIR": ray_tmp, "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"})
    import ray
    from ray.cluster_utils import Cluster

    from slimml.runtime import load
    from slimml.scale import pipeline

    with open(STSB, newline="", encoding="utf-8") as f:
        texts = [r["sentence1"] for r in csv.DictReader(f)][: args.batch]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        model = pipeline(args.artifact, stages=2, balance=args.balance)
        seg = model.plan.segments[0]
        nodes = [i["node"][:8] for i in seg.stage_info()]
        feeds = model.tokenize(texts)
        local = load(args.artifact)
        want = local.run(feeds)["last_hidden_state"]
        walls: dict[int, list[float]] = {m: [] for m in args.microbatches}
        per_stage: dict[int, list[list[float]]] = {m: [] for m in args.microbatches}
        for m in args.microbatches:  # warm every setting
            seg.microbatch = m
            model.run(feeds)
        for r in range(args.rounds):
            for m in args.microbatches if r % 2 == 0 else args.microbatches[::-1]:
                seg.microbatch = m
                seg.stage_stats(reset=True)
                t0 = time.perf_counter()
                out = model.run(feeds)["last_hidden_state"]
                walls[m].append(time.perf_counter() - t0)
                per_stage[m].append([s["busy_s"] / max(s["calls"], 1) for s in seg.stage_stats()])
        diff = float(abs(out - want).max())
        model.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    res = {"artifact": str(args.artifact), "batch": args.batch, "stages": 2, "balance": args.balance,
           "groups": [list(g) for g in seg.groups], "nodes": nodes, "max abs diff vs one process": diff, "runs": {}}
    base = statistics.median(walls[args.microbatches[0]])
    for m in args.microbatches:
        wall = statistics.median(walls[m])
        t = [statistics.median(x[k] for x in per_stage[m]) for k in range(2)]
        ideal = sum(t) + (m - 1) * max(t)
        res["runs"][f"M={m}"] = {"wall ms": round(wall * 1000, 2), "stage ms per microbatch": [round(x * 1000, 2) for x in t],
                                 "ideal ms": round(ideal * 1000, 2), "efficiency": round(ideal / wall, 3),
                                 "busy share": [round(x * m / wall, 3) for x in t],
                                 "speedup vs M=%d" % args.microbatches[0]: round(base / wall, 3)}
        print(f"M={m}: wall {wall * 1000:.1f} ms, stages {t[0] * 1000:.1f}/{t[1] * 1000:.1f} ms per microbatch, "
              f"ideal {ideal * 1000:.1f} ms, efficiency {ideal / wall:.2f}", flush=True)
    print(json.dumps(res, indent=2))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
