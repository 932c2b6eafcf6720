"""NNCF static int8 against slimml's default int8 (ORT dynamic) on the default model.

Builds fp32, ``Int8Config("cpu")`` and ``Int8StaticConfig(backend="nncf")`` artifacts from one
conversion, scores STSb dev for each (sentence-transformers' batching, as bench_int8.py) and
times batch 1, seq 128 interleaved in one process, single thread, CPU time of the calling
thread. Prints one JSON line.

    python benchmarks/bench_nncf.py [--work DIR] [--runs 60]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_int8 import STSB, sts_score  # noqa: E402
from timing import interleaved  # noqa: E402

from slimml.convert import ConvertConfig, convert  # noqa: E402
from slimml.quantize import Int8Config, Int8StaticConfig, quantize  # noqa: E402
from slimml.runtime import load  # noqa: E402

STS_DEV, STS_TRAIN = STSB / "sts-dev.csv", STSB / "sts-train.csv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None, help="build folder (default: a temporary one)")
    ap.add_argument("--runs", type=int, default=60)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="slimml-nncf-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "fp32").exists():
        convert(None, work / "fp32", ConvertConfig(measure_latency=False))
    builds = {"ort": lambda: Int8Config("cpu", calibration=STS_TRAIN),
              "nncf": lambda: Int8StaticConfig(backend="nncf", calibration=STS_TRAIN, calibration_size=256)}
    for name, config in builds.items():
        if not (work / name).exists():
            t = time.perf_counter()
            r = quantize(work / "fp32", work / name, config())
            print(f"built {name} in {time.perf_counter() - t:.0f} s: {json.dumps(r.checks)}", flush=True)
    models = {k: load(work / k, threads=1) for k in ("fp32", "ort", "nncf")}
    res = {f"stsb_dev_{k}": round(sts_score(m.encode, STS_DEV), 2) for k, m in models.items()}
    feeds = models["fp32"].tokenize(["word " * 126])  # 128 tokens with [CLS] and [SEP]
    ms = interleaved({k: (lambda m=m: m.run(feeds)) for k, m in models.items()}, args.runs, clock=time.process_time)
    res["seq"] = int(feeds["input_ids"].shape[1])
    res["b1_cpu_ms"] = {k: round(v, 2) for k, v in ms.items()}
    res["nncf_over_ort"] = round(ms["nncf"] / ms["ort"], 3)
    res["sizes_mb"] = {k: round(m.manifest.total_bytes / 1e6, 2) for k, m in models.items()}
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
