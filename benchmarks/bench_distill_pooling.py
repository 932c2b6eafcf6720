"""How close a distilled student comes to a teacher that does not pool by its mean.

A distilled sentence embedder's student was trained to match its teacher's mean token state,
whatever the teacher's pooling; it is now trained on the teacher's embedding as the artifact makes
it (its pooling mode, then its Dense projections). No CLS-pooled or projected sentence embedder is
on this machine (no network), so the teachers are made from the default model's real weights:

- ``cls``: all-MiniLM-L6-v2 with its pooling set to CLS;
- ``cls+dense``: the same, then a Dense 384 -> 256 with tanh (seeded random weights), then
  Normalize: LaBSE's pipeline shape.

Each is distilled to 3 of its 6 layers for one epoch on the STSb train texts, through
``slimml convert --distill-layers 3`` (the public API: ``convert`` with a ``DistillConfig``), with
the objective of this release and, for ``cls``, the earlier one (every teacher's mean: the
teacher's pooler replaced by a mean one for that run). Reported: the student's mean and 5th
percentile cosine to its teacher's embeddings on the STSb dev sentences, and both models' STSb dev
Spearman x100 (which measures the synthetic teacher's fitness as much as the student's: MiniLM was
trained for mean pooling).

    python benchmarks/bench_distill_pooling.py [--work /tmp/bench_distill_pooling] [--out benchmarks/results/distill_pooling.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
from pathlib import Path

import numpy as np

STSB = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "stsb"


def teacher(work: Path, dense: bool) -> Path:
    """The default model with CLS pooling (and a LaBSE-shaped projection)."""
    import torch
    from safetensors.torch import save_file

    from slimml.convert.sources import default_model_dir

    out = work / ("teacher_cls_dense" if dense else "teacher_cls")
    if (out / "modules.json").is_file():
        return out
    shutil.copytree(default_model_dir(), out)
    config = json.loads((out / "1_Pooling" / "config.json").read_text())
    config = {k: (k == "pooling_mode_cls_token") if k.startswith("pooling_mode") else v for k, v in config.items()}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(config))
    if dense:
        torch.manual_seed(0)
        linear = torch.nn.Linear(384, 256)
        (out / "2_Dense").mkdir()
        save_file({"linear.weight": linear.weight.detach().contiguous(), "linear.bias": linear.bias.detach().contiguous()},
                  str(out / "2_Dense" / "model.safetensors"))
        (out / "2_Dense" / "config.json").write_text(json.dumps({"in_features": 384, "out_features": 256, "bias": True,
                                                                 "activation_function": "torch.nn.modules.activation.Tanh"}))
        modules = json.loads((out / "modules.json").read_text())
        last = [m for m in modules if m["type"].endswith("Normalize")]
        modules = [m for m in modules if not m["type"].endswith("Normalize")]
        modules += [{"idx": len(modules), "name": str(len(modules)), "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
        modules += [{**m, "idx": len(modules), "name": str(len(modules))} for m in last]
        (out / "modules.json").write_text(json.dumps(modules))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_distill_pooling"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "distill_pooling.json")
    args = ap.parse_args()

    import slimml.convert.distill.teacher as teachers
    from slimml.convert import ConvertConfig, convert
    from slimml.convert.distill import DistillConfig
    from slimml.runtime import load
    from slimml.runtime.tasks.inputs.pooling import Pooler
    from slimml.runtime.tools.evaluate import spearman

    args.work.mkdir(parents=True, exist_ok=True)
    dev = list(csv.DictReader(open(STSB / "sts-dev.csv", encoding="utf-8")))
    gold = np.asarray([float(r["score"]) for r in dev])
    texts = sorted({r["sentence1"] for r in dev} | {r["sentence2"] for r in dev})

    def sts(model) -> float:
        a, b = model.encode([r["sentence1"] for r in dev]), model.encode([r["sentence2"] for r in dev])
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        return round(100 * spearman(cos, gold), 2)

    own = teachers.teacher_pooler
    results = []
    for dense, objective in ((False, "teacher's pooling"), (False, "mean (before)"), (True, "teacher's pooling")):
        folder = teacher(args.work, dense)
        name = f"{folder.name} / {objective}"
        if not (args.work / f"{folder.name}_art" / "manifest.json").is_file():
            convert(folder, args.work / f"{folder.name}_art", ConvertConfig(measure_latency=False))
        teachers.teacher_pooler = own if objective.startswith("teacher") else (
            lambda _artifact: Pooler({"mode": "mean", "output": "last_hidden_state", "normalize": True}))
        out = args.work / f"{folder.name}_{'own' if objective.startswith('teacher') else 'mean'}"
        shutil.rmtree(out, ignore_errors=True)
        config = ConvertConfig(distill=DistillConfig(layers=3, epochs=1.0, data=STSB / "sts-train.csv"), measure_latency=False)
        convert(folder, out, config)
        teachers.teacher_pooler = own
        t_model, s_model = load(args.work / f"{folder.name}_art"), load(out)
        t, s = t_model.encode(texts), s_model.encode(texts)
        cos = (s * t).sum(1) / np.linalg.norm(s, axis=1) / np.linalg.norm(t, axis=1)
        row = {"run": name, "student_cosine_to_teacher_mean": round(float(cos.mean()), 4),
               "student_cosine_to_teacher_p5": round(float(np.percentile(cos, 5)), 4),
               "teacher_sts_x100": sts(t_model), "student_sts_x100": sts(s_model), "texts": len(texts)}
        print(json.dumps(row))
        results.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
