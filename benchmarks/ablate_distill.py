"""Which parts of the distillation recipe matter: one student of all-MiniLM-L6-v2 per run, scored in torch.

Run (one variant a process; results are appended to --log as JSON lines):
    python benchmarks/ablate_distill.py --name base --lr 2e-4 --pre 0            # the first recipe
    python benchmarks/ablate_distill.py --name lr5  --lr 5e-4 --pre 0
    python benchmarks/ablate_distill.py --name e8   --lr 2e-4 --pre 0 --epochs 8
    python benchmarks/ablate_distill.py --name pre1 --lr 2e-4 --pre 1            # distil 1 epoch, then prune
    python benchmarks/ablate_distill.py --name v0   --lr 2e-4 --pre 0 --no-vocab # keep the whole vocabulary
    python benchmarks/ablate_distill.py --name extra --lr 2e-4 --pre 0 --extra   # + the stdlib docstring corpus
    python benchmarks/ablate_distill.py --name c1   --lr 5e-4 --pre 1            # the default recipe
    python benchmarks/ablate_distill.py --name fp32 --lr 5e-4 --pre 1 --precision off

The student (3 layers, heads and FFN pruned 0.5) is made by ``slimml.convert.distill.shrink`` on STSb
train sentences with the recipe's settings, saved as a Hugging Face folder and scored fp32 with
sentence-transformers on STSb dev (Spearman x100).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb"


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--prune", type=float, default=0.5)
    ap.add_argument("--no-vocab", action="store_true", help="keep the whole vocabulary")
    ap.add_argument("--epochs", type=float, default=3)
    ap.add_argument("--pre", type=float, default=1, help="epochs of distillation before pruning")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--precision", default="auto", help="--mixed-precision")
    ap.add_argument("--extra", action="store_true", help="add the default (stdlib docstring) corpus to the data")
    ap.add_argument("--out", type=Path, default=Path("artifacts/ablation"))
    ap.add_argument("--log", type=Path, default=Path("artifacts/ablation/results.jsonl"))
    a = ap.parse_args()

    from sentence_transformers import SentenceTransformer

    from slimml.convert.distill import DistillConfig, shrink
    from slimml.convert.distill.distill_data import load_texts
    from slimml.convert.distill.prune import PruneConfig
    from slimml.convert.sources import default_model_dir
    from slimml.runtime.tools.evaluate import read_sts, spearman

    t0 = time.time()
    data = DATA / "sts-train.csv"
    with tempfile.TemporaryDirectory() as tmp:
        if a.extra:
            data = Path(tmp) / "texts.txt"
            data.write_text("\n".join(load_texts(DATA / "sts-train.csv")[0] + load_texts(None)[0]) + "\n")
        out = a.out / a.name
        steps = shrink(default_model_dir(), out, DistillConfig(layers=a.layers, data=data, lr=a.lr, epochs=a.epochs,
                                                               pre_prune_epochs=a.pre, mixed_precision=a.precision),
                       PruneConfig(a.prune, vocab=not a.no_vocab) if a.prune > 0 else None)
    s1, s2, gold = read_sts(DATA / "sts-dev.csv")
    model = SentenceTransformer(str(out), device="cpu")
    e1, e2 = (model.encode(s, normalize_embeddings=True, batch_size=64) for s in (s1, s2))
    row = {"name": a.name, "args": {k: str(v) for k, v in vars(a).items()}, "stsb_dev": round(100 * spearman((e1 * e2).sum(1), gold), 2),
           "params": steps[-1]["student_params"], "precision": steps[0]["training"]["precision"],
           "seconds": round(time.time() - t0)}
    print(json.dumps(row), flush=True)
    a.log.parent.mkdir(parents=True, exist_ok=True)
    with a.log.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
