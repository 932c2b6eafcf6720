"""What the quantize guard says about a cross-encoder, against what int8 really does to it.

There is no cross-encoder on this machine (no network), so one is made as the STSb cross-encoders
are: the default model (all-MiniLM-L6-v2) with one output, fine-tuned for one epoch on STSb train
pairs (the score / 5 as the target of a sigmoid, as sentence-transformers' CrossEncoder trains it),
saved as a CrossEncoder folder. Then, through slimml's public API:

- ``convert`` to fp32 and ``quantize`` to int8 (the CPU default), once without a guard and once
  with ``--max-drop 1``;
- the truth: STSb dev Spearman x100 of the fp32 and int8 artifacts' scores against the gold
  scores, and the Spearman of the int8 scores against the fp32 scores;
- the guard's measure (``agreement_spearman`` on held-out query-passage pairs) and, on the same
  held-out feeds, the measure it replaced (the mean cosine of each row's logits: for one logit,
  +1 where the signs agree and -1 where they do not).

    python benchmarks/bench_classifier_guard.py [--work /tmp/bench_ce] [--out benchmarks/results/classifier_guard.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import random
from pathlib import Path

import numpy as np

STSB = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "stsb"


def train(out: Path, seed: int = 0) -> float:
    """Fine-tune the default model as an STSb cross-encoder into ``out``; its dev Spearman in torch."""
    import torch
    from sentence_transformers import CrossEncoder

    from slimml.convert.sources import default_model_dir
    from slimml.runtime.tools.evaluate import spearman

    torch.manual_seed(seed)
    rows = list(csv.DictReader(open(STSB / "sts-train.csv", encoding="utf-8")))
    random.Random(seed).shuffle(rows)
    ce = CrossEncoder(str(default_model_dir()), num_labels=1, device="cpu")
    optimizer = torch.optim.AdamW(ce.model.parameters(), lr=4e-5)
    ce.model.train()
    for start in range(0, len(rows), 32):
        batch = rows[start : start + 32]
        enc = ce.tokenizer([r["sentence1"] for r in batch], [r["sentence2"] for r in batch], padding=True,
                           truncation=True, return_tensors="pt")
        target = torch.tensor([float(r["score"]) / 5 for r in batch])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(ce.model(**enc).logits.squeeze(-1), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ce.model.eval()
    ce.save(str(out))
    dev = list(csv.DictReader(open(STSB / "sts-dev.csv", encoding="utf-8")))
    return 100 * spearman(np.asarray(ce.predict([(r["sentence1"], r["sentence2"]) for r in dev])),
                          np.asarray([float(r["score"]) for r in dev]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_ce"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "classifier_guard.json")
    args = ap.parse_args()

    import slimml.quantize.chain as ch
    from slimml.convert import ConvertConfig, convert
    from slimml.quantize import Int8Config, quantize
    from slimml.quantize.calibration import calibration_texts
    from slimml.quantize.config import GuardConfig
    from slimml.runtime import load
    from slimml.runtime.tools.evaluate import spearman

    args.work.mkdir(parents=True, exist_ok=True)
    src = args.work / "stsb-cross-encoder"
    torch_dev = train(src) if not (src / "config.json").is_file() else None
    f32, q8, guarded = args.work / "f32", args.work / "int8", args.work / "int8-max-drop-1"
    if not (f32 / "manifest.json").is_file():
        convert(src, f32, ConvertConfig(measure_latency=False))
    report = quantize(f32, q8, Int8Config("cpu"))
    config = Int8Config("cpu")
    config.guard = GuardConfig(max_drop=1.0)
    held_report = quantize(f32, guarded, config)

    dev = list(csv.DictReader(open(STSB / "sts-dev.csv", encoding="utf-8")))
    pairs, gold = [[r["sentence1"], r["sentence2"]] for r in dev], np.asarray([float(r["score"]) for r in dev])
    scores = {name: np.asarray([r[0]["score"] for r in load(path).classify(pairs, top_k=1)])
              for name, path in (("fp32", f32), ("int8", q8), ("int8 --max-drop 1", guarded))}

    # the measure the guard used before, on the guard's own held-out feeds
    manifest = load(f32).manifest
    _, held, _ = calibration_texts(None, Int8Config("cpu").calibration_size)
    text = ch.text_encoder(f32, manifest)
    feeds = ch.batches(manifest, text, held)
    float_chain = ch.Chain(manifest, ch.shard_paths(f32, manifest), text)
    q_manifest = load(q8).manifest
    q_chain = ch.Chain(q_manifest, ch.shard_paths(q8, q_manifest), text)
    old = float(np.mean([ch.outputs_agreement(float_chain.run(f), q_chain.run(f), f.get("attention_mask")) for f in feeds]))

    result = {
        "model": "all-MiniLM-L6-v2 + 1 output, 1 epoch on STSb train (made here)",
        "torch_dev_spearman_x100": None if torch_dev is None else round(torch_dev, 2),
        "dev_spearman_x100": {k: round(100 * spearman(v, gold), 2) for k, v in scores.items()},
        "int8_vs_fp32_spearman_dev": round(spearman(scores["int8"], scores["fp32"]), 4),
        "guard_now": {k: v for k, v in report.checks.items() if k.startswith(("agreement", "drop"))},
        "guard_before_mean_logit_cosine": round(old, 4),
        "guard_before_drop": round(100 * (1 - old), 3),
        "held_out_inputs": int(sum(len(f["input_ids"]) for f in feeds)),
        "max_drop_1": {"float_shards": {str(k): v for k, v in held_report.float_shards.items()},
                       "size_mb": round(held_report.size_mb, 1),
                       "checks": {k: v for k, v in held_report.checks.items() if k.startswith(("agreement", "drop", "max"))}},
        "int8_size_mb": round(report.size_mb, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
