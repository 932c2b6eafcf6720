"""One all-MiniLM-L6-v2 student per run, made by ``convert`` exactly as the CLI makes it but with the
recipe's settings open (epochs, vocabulary share), quantized int8 and scored on STSb dev.

    python benchmarks/recipe_distill.py NAME LAYERS PRUNE VOCAB EPOCHS      # VOCAB "d": the default share
    python benchmarks/recipe_distill.py d3p50-e6-v03 3 0.5 0.3 6
    python benchmarks/recipe_distill.py d4-e6 4 0 d 6

Prints one JSON line: STSb dev of the int8 student, its MB, seconds, latency against the teacher.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb"


def main() -> None:
    from slimml.convert import ConvertConfig, convert
    from slimml.convert.distill import DistillConfig
    from slimml.convert.distill.prune import PruneConfig
    from slimml.quantize.config import scheme_config

    name, layers, prune, vocab, epochs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], float(sys.argv[5])
    t0 = time.time()
    config = ConvertConfig(
        distill=DistillConfig(layers=layers, data=DATA / "sts-train.csv", epochs=epochs),
        prune=PruneConfig(prune, vocab_fraction=None if vocab == "d" else float(vocab)) if prune > 0 else None,
        quantize=scheme_config("int8", "cpu", None, None, None, False, "ort"), compare_on=DATA / "sts-dev.csv")
    report = convert(None, Path("artifacts/recipe") / name, config)
    print(json.dumps({"name": name, "stsb": report.teacher["student"]["stsb"], "mb": round(report.size_mb, 2),
                      "seconds": round(time.time() - t0), "latency_ratio": report.teacher["latency_ratio"]}), flush=True)


if __name__ == "__main__":
    main()
