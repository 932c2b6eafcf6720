"""Peak memory and step time of the student's training with and without mixed precision, gradient
accumulation and activation checkpointing, on the device it runs on.

Each variant trains the same student on the same cached teacher outputs for ``--steps`` optimizer
steps in its own subprocess (so its peak RSS is its own); the variants run round-robin ``--rounds``
times so machine load hits them alike, and the report gives the median step time (first two steps
of each run excluded), the largest peak RSS during training (sampled every 25 ms, seldom enough not to disturb the two cores) and how much of it
training added to what the process held when it started. Every variant has the same effective batch:
accumulation runs ``--accum`` batches of ``batch / accum`` texts per step.

Students:
- ``minilm``: all-MiniLM-L6-v2 cut to 3 layers (embedding objective), STSb train sentences;
- ``llama``: 4 layers of the 4.4 GB Llama teacher that ``bench_big_teacher.py`` builds (hidden 1024,
  top-k logit KL objective; run that benchmark first, it leaves the teacher in its work folder).

Usage:
    python benchmarks/bench_train.py --student minilm --batch 32
    python benchmarks/bench_train.py --student llama --batch 16 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

STS_TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb" / "sts-train.csv"
VARIANTS = {  # name -> (mixed precision, accumulation, checkpointing)
    "fp32": ("off", False, False),
    "bf16": ("bf16", False, False),
    "fp32 + accumulation": ("off", True, False),
    "fp32 + checkpointing": ("off", False, True),
    "bf16 + accumulation + checkpointing": ("bf16", True, True),
}


def setup(args) -> tuple[Path, Path, Path, Path]:
    """(teacher folder, teacher artifact, texts file, cache folder), the cache filled once here."""
    from slimml.convert import ConvertConfig, convert
    from slimml.convert.distill.distill_train import Trainer, teacher_kind
    from slimml.convert.distill import DistillConfig
    from slimml.convert.distill.teacher import teacher_outputs

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    if args.student == "llama":
        big = Path("/tmp/slimml-big-teacher")
        teacher, texts = big / "teacher", big / "texts.txt"
        if not (teacher / "config.json").is_file():
            sys.exit("run benchmarks/bench_big_teacher.py first: it builds the Llama teacher this student comes from")
    else:
        from slimml.convert.sources import default_model_dir

        teacher, texts = default_model_dir(), STS_TRAIN
    art = work / f"{args.student}-teacher"
    if args.student == "llama" and (teacher.parent / "teacher-art" / "manifest.json").is_file():
        art = teacher.parent / "teacher-art"  # bench_big_teacher.py's, exported layer by layer
    if not (art / "manifest.json").is_file():
        convert(teacher, art, ConvertConfig(verify=False, measure_latency=False))
    trainer = Trainer(teacher_kind(teacher)[0], teacher, _texts(texts, args), DistillConfig(layers=args.layers))
    teacher_outputs(art, trainer.kind, trainer.ids, trainer.pad_id, work / f"{args.student}-cache", "2GB")
    return teacher, art, texts, work / f"{args.student}-cache"


def _texts(path: Path, args) -> list[str]:
    from slimml.convert.distill.distill_data import load_texts

    return load_texts(path, args.max_texts)[0]


def child(args) -> None:
    from slimml.convert.distill import DistillConfig, evenly_spaced
    from slimml.convert.distill.distill_train import Trainer, build_student, teacher_kind
    from slimml.convert.distill.teacher import teacher_outputs, teacher_pooler

    precision, accum, ckpt = VARIANTS[args.child]
    teacher, art, texts, cache = Path(args.teacher), Path(args.art), Path(args.texts), Path(args.cache)
    n = args.accum if accum else 1
    config = DistillConfig(layers=args.layers, batch_size=args.batch // n, grad_accum=n, mixed_precision=precision,
                           checkpointing=ckpt, device="cpu", max_steps=args.steps)
    kind, cls = teacher_kind(teacher)
    trainer = Trainer(kind, teacher, _texts(texts, args), config, teacher_pooler(art) if kind == "embedding-cosine" else None)
    trainer.use(teacher_outputs(art, kind, trainer.ids, trainer.pad_id, cache, "2GB"))
    from transformers import AutoConfig

    depth = AutoConfig.from_pretrained(str(teacher)).num_hidden_layers
    student = build_student(teacher, cls, evenly_spaced(depth, args.layers))
    times: list[float] = []
    last = [time.perf_counter()]

    def progress(step, loss):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    import gc
    import threading

    gc.collect()
    start = _rss()
    peak, done = [start], threading.Event()

    def sample():  # the high-water mark of training alone (ru_maxrss also counts the set-up)
        while not done.wait(0.025):
            peak[0] = max(peak[0], _rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    last[0] = time.perf_counter()
    trainer.train(student, args.steps, None, lambda *a: None, progress)
    done.set()
    sampler.join()
    steady = sorted(times[2:]) or times
    print("RESULT " + json.dumps({"step_ms": round(steady[len(steady) // 2] * 1000, 1),
                                  "peak_rss_mb": round(peak[0] / 1e6), "added_mb": round((peak[0] - start) / 1e6)}))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--student", choices=("minilm", "llama"), default="minilm")
    p.add_argument("--layers", type=int, default=None, help="student layers (default: 3 minilm, 4 llama)")
    p.add_argument("--batch", type=int, default=32, help="the effective batch (texts per optimizer step)")
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-texts", type=int, default=2000)
    p.add_argument("--work", type=Path, default=Path("/tmp/slimml-bench-train"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    for name in ("teacher", "art", "texts", "cache"):
        p.add_argument(f"--{name}", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.layers = args.layers or (4 if args.student == "llama" else 3)
    if args.child:
        child(args)
        return
    teacher, art, texts, cache = setup(args)
    rows: dict[str, dict] = {v: {"step_ms": [], "peak_rss_mb": [], "added_mb": []} for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            cmd = [sys.executable, __file__, "--child", v, "--student", args.student, "--layers", str(args.layers),
                   "--batch", str(args.batch), "--accum", str(args.accum), "--steps", str(args.steps),
                   "--max-texts", str(args.max_texts), "--teacher", str(teacher), "--art", str(art),
                   "--texts", str(texts), "--cache", str(cache)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                sys.exit(f"{v} failed: {proc.stderr[-1500:]}")
            r = json.loads(line[-1][7:])
            rows[v]["step_ms"].append(r["step_ms"])
            rows[v]["peak_rss_mb"].append(r["peak_rss_mb"])
            rows[v]["added_mb"].append(r["added_mb"])
            print(v, r, flush=True)
    base = sorted(rows["fp32"]["step_ms"])[len(rows["fp32"]["step_ms"]) // 2]
    table = {}
    print(f"\n{args.student}: {args.layers} layers, effective batch {args.batch}, accumulation {args.accum} x {args.batch // args.accum}")
    print(f"{'variant':40s} {'step ms':>9s} {'vs fp32':>8s} {'peak RSS MB':>12s} {'training adds MB':>17s}")
    for v, r in rows.items():
        ms = sorted(r["step_ms"])[len(r["step_ms"]) // 2]
        table[v] = {"step_ms": ms, "vs_fp32": round(ms / base, 2), "peak_rss_mb": max(r["peak_rss_mb"]),
                    "added_mb": max(r["added_mb"])}
        print(f"{v:40s} {ms:9.1f} {ms / base:7.2f}x {max(r['peak_rss_mb']):12d} {max(r['added_mb']):17d}")
    out = args.out or Path(__file__).parent / "results" / f"train_{args.student}.json"
    out.write_text(json.dumps({"student": args.student, "layers": args.layers, "batch": args.batch, "accum": args.accum,
                               "steps": args.steps, "rounds": args.rounds, "cpus": os.cpu_count(), "table": table}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
