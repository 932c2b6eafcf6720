"""Which parts of the distillation recipe matter: one student of all-MiniLM-L6-v2 per run, scored in torch.

Run (one variant a process; results are appended to --log as JSON lines):
    python benchmarks/ablate_distill.py --name base --lr 2e-4 --pre 0            # the first recipe
    python benchmarks/ablate_distill.py --name lr5  --lr 5e-4 --pre 0
    python benchmarks/ablate_distill.py --name e8   --lr 2e-4 --pre 0 --epochs 8
    python benchmarks/ablate_distill.py --name pre1 --lr 2e-4 --pre 1            # distil 1 epoch, then prune
    python benchmarks/ablate_distill.py --name v0   --lr 2e-4 --pre 0 --vocab 0  # keep the whole vocabulary
    python benchmarks/ablate_distill.py --name hid1 --lr 2e-4 --pre 0 --hidden 1 # + layer-wise hidden-state MSE
    python benchmarks/ablate_distill.py --name extra --lr 2e-4 --pre 0 --extra   # + the stdlib docstring corpus
    python benchmarks/ablate_distill.py --name c1   --lr 5e-4 --pre 1            # the default recipe
    python benchmarks/ablate_distill.py --name c3   --lr 5e-4 --pre 1 --vocab 0.3

The student (3 layers, heads and FFN pruned 0.5) is trained on STSb train sentences with the library's
``Trainer`` and pruning functions, saved as a Hugging Face folder and scored fp32 with
sentence-transformers on STSb dev (Spearman x100). ``--hidden`` adds an MSE between each student
layer's output and its teacher layer's, which the library does not use (it did not help).
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
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--prune", type=float, default=0.5)
    ap.add_argument("--vocab", type=float, default=None, help="share of the vocabulary removed (default: --prune)")
    ap.add_argument("--epochs", type=float, default=3)
    ap.add_argument("--pre", type=float, default=1, help="epochs of distillation before pruning")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--hidden", type=float, default=0.0, help="weight of a layer-wise hidden-state MSE")
    ap.add_argument("--extra", action="store_true", help="add the default (stdlib docstring) corpus to the data")
    ap.add_argument("--out", type=Path, default=Path("artifacts/ablation"))
    ap.add_argument("--log", type=Path, default=Path("artifacts/ablation/results.jsonl"))
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from sentence_transformers import SentenceTransformer

    from slimml.convert import distill, prune_vocab
    from slimml.convert import prune as pruning
    from slimml.convert.distill_data import load_texts
    from slimml.convert.distill_train import Trainer, load_teacher
    from slimml.convert.sources import default_model_dir
    from slimml.runtime.evaluate import read_sts, spearman

    t0 = time.time()
    teacher_dir = Path(default_model_dir())
    texts, _ = load_texts(DATA / "sts-train.csv", None)
    if a.extra:
        texts += load_texts(None, None)[0]
    teacher, kind, _ = load_teacher(teacher_dir)
    kept = distill.evenly_spaced(teacher.config.num_hidden_layers, a.layers)

    class WithHidden(Trainer):
        def loss(self, student, batch):
            if a.hidden == 0:
                return super().loss(student, batch)
            mask = batch["attention_mask"].unsqueeze(-1).float()
            out = student(input_ids=batch["student_input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
            s = F.normalize((out.last_hidden_state * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=-1)
            t = F.normalize(self.targets[batch["index"]], dim=-1)
            loss = (1 - (s * t).sum(-1)).mean() + 10.0 * F.mse_loss(s @ s.T, t @ t.T)
            with torch.no_grad():
                th = self.teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True).hidden_states
            hidden = sum(((out.hidden_states[i + 1] - th[k + 1]) ** 2 * mask).sum() / (mask.sum() * th[0].shape[-1])
                         for i, k in enumerate(kept))
            return loss + a.hidden * hidden / len(kept)

    trainer = WithHidden(teacher, kind, teacher_dir, texts, distill.DistillConfig(layers=a.layers, lr=a.lr))
    student = trainer.student(kept)
    no_save = lambda *_: None  # noqa: E731
    if a.pre > 0:
        trainer.train(student, trainer.steps(a.pre), None, no_save, None)
    remap = None
    if a.prune > 0:
        config = pruning.PruneConfig(a.prune)
        plan = pruning.plan(student, config, *pruning.importance(student, trainer.batches(16), trainer.loss))
        pruning.apply_plan(student, plan)
        vocab = a.prune if a.vocab is None else a.vocab
        if vocab > 0:
            keep = prune_vocab.plan(teacher_dir, {i for s in trainer.ids for i in s}, vocab)
            remap = prune_vocab.apply(student, keep)
            trainer.renumber(remap)
    trainer.train(student, trainer.steps(a.epochs), None, no_save, None, first_epoch=1 if a.pre else 0)
    out = a.out / a.name
    distill._save_student(student, teacher_dir, out)
    if remap is not None:
        prune_vocab.write_tokenizer(teacher_dir, out, remap)

    s1, s2, gold = read_sts(DATA / "sts-dev.csv")
    model = SentenceTransformer(str(out), device="cpu")
    e1, e2 = (model.encode(s, normalize_embeddings=True, batch_size=64) for s in (s1, s2))
    row = {"name": a.name, "args": {k: str(v) for k, v in vars(a).items()}, "stsb_dev": round(100 * spearman((e1 * e2).sum(1), gold), 2),
           "params": sum(p.numel() for p in student.parameters()), "vocab": student.config.vocab_size,
           "seconds": round(time.time() - t0)}
    print(json.dumps(row), flush=True)
    a.log.parent.mkdir(parents=True, exist_ok=True)
    with a.log.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
