"""Distil a Llama teacher bigger than the memory cap into a 4-layer student, and where the memory goes.

Builds a Llama-architecture causal LM with random weights (default: hidden 1024, 92 layers,
~4.4 GB fp32), written as sharded safetensors a few layers at a time (never whole in memory). Then:

1. ``slimml convert TEACHER --distill-layers 4 --teacher-memory-budget B ...`` runs in a subprocess
   inside a Linux memory cgroup (v1, as root) with a hard limit (default 3 GB, page cache included).
   The teacher is exported layer by layer, its outputs (top-k logits) computed once by the slimml
   runtime streamed under B and cached on disk, and the student trained on the cache. Reported: the
   exit code, the cgroup's peak usage, the process's peak RSS, the held-out KL of the student to the
   teacher before and after training, sizes and times.
2. The teacher pass alone, three ways, each in its own subprocess (no cap) so peak RSS is its own:
   ``resident`` (the teacher artifact loaded whole), ``streamed`` (under B), ``cached`` (reading the
   cached outputs as an epoch does).

Usage:
    python benchmarks/bench_big_teacher.py                          # the goal: 4.4 GB teacher, 3 GB cap
    python benchmarks/bench_big_teacher.py --layers 6 --hidden 256 --cap 2GB --texts 128   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from bench_stream import MemoryCap  # noqa: E402

STS_TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb" / "sts-train.csv"


def build_teacher(folder: Path, args) -> int:
    """Random-weight Llama written a few layers per safetensors file; returns its bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from slimml.convert.sources import default_model_dir

    if (folder / "model.safetensors.index.json").is_file():
        return json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = LlamaConfig(vocab_size=30522, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
                         architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(config).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        key = "rest" if layer == "rest" else f"{int(layer) // 8:02d}"
        groups.setdefault(key, []).append(name)
    weight_map, total = {}, 0
    for key, names in sorted(groups.items()):
        file = f"model-{key}.safetensors"
        tensors = {n: (torch.ones(shapes[n]) if n.endswith("norm.weight") else
                       torch.randn(shapes[n], generator=gen) * 0.02) for n in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update({n: file for n in names})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    config.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(str(folder))
    return total


def write_texts(path: Path, n: int) -> None:
    import csv

    seen: dict[str, None] = {}
    with open(STS_TRAIN, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            for c in ("sentence1", "sentence2"):
                seen.setdefault(row[c].strip())
    path.write_text("\n".join(list(seen)[:n]) + "\n")


def run_capped(cmd: list[str], cap: MemoryCap | None) -> tuple[int, float, int, str]:
    """rc, seconds, peak RSS of the child (bytes), output tail."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=cap.join if cap else None)
    out, _ = proc.communicate()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child so far
    return proc.returncode, seconds, peak, out


def child_pass(variant: str, artifact: Path, texts: Path, budget: str, cache: Path, batch: int) -> None:
    """One teacher pass (or one read of the cache), then its peak RSS as a RESULT line.

    All three use the same batch (``--pass-batch`` texts), so what differs is the teacher's weights."""
    import numpy as np
    from transformers import AutoTokenizer

    from slimml.convert.distill.teacher import teacher_outputs

    tok = AutoTokenizer.from_pretrained(str(artifact.parent / "teacher"), local_files_only=True)
    ids = tok(texts.read_text().splitlines(), truncation=True, max_length=128)["input_ids"]
    t0 = time.perf_counter()
    if variant == "cached":
        out = teacher_outputs(artifact, "lm-kl", ids, 0, cache, None, 32, max_batch=batch)
        assert not out.stats["computed"]
        total = 0.0
        for i in range(len(ids)):  # an epoch's reads
            total += float(np.sum(out.rows([i])["lse"][0]))
    else:
        shutil.rmtree(cache, ignore_errors=True)
        teacher_outputs(artifact, "lm-kl", ids, 0, cache, budget if variant == "streamed" else None, 32, max_batch=batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"variant": variant, "peak_rss_mb": round(peak / 1e6), "seconds": round(time.perf_counter() - t0, 1)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=92)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--student-layers", type=int, default=4)
    p.add_argument("--cap", default="3GB", help="the memory cgroup's limit for the convert process")
    p.add_argument("--budget", default="800MB", help="--teacher-memory-budget")
    p.add_argument("--texts", type=int, default=768)
    p.add_argument("--epochs", type=float, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--work", type=Path, default=Path("/tmp/slimml-big-teacher"))
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "big_teacher.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--skip-passes", action="store_true", help="only the capped convert")
    p.add_argument("--passes-only", action="store_true", help="only the teacher passes (adds them to --out)")
    p.add_argument("--pass-batch", type=int, default=32, help="texts per teacher batch in the three passes")
    args = p.parse_args()
    work = args.work
    if args.child:
        child_pass(args.child, work / "teacher-art", work / "texts.txt", args.budget, work / "cache", args.pass_batch)
        return
    work.mkdir(parents=True, exist_ok=True)
    teacher_bytes = build_teacher(work / "teacher", args)
    write_texts(work / "texts.txt", args.texts)
    result: dict = {"teacher": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                                "heads": args.heads, "kv_heads": args.kv_heads, "gb_fp32": round(teacher_bytes / 1e9, 2)},
                    "cap": args.cap, "teacher_memory_budget": args.budget, "texts": args.texts, "epochs": args.epochs,
                    "batch_size": args.batch_size, "cpus": os.cpu_count()}
    print(f"teacher: {teacher_bytes / 1e9:.2f} GB fp32, {args.layers} layers", flush=True)

    if args.passes_only:
        result = json.loads(args.out.read_text())
    else:
        capped_convert(args, work, result)
    if not args.skip_passes:
        teacher_passes(args, work, result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


def capped_convert(args, work: Path, result: dict) -> None:
    """1. the whole convert under the cap."""
    from slimml.runtime.engine.budget import parse_bytes

    student = work / "student"
    shutil.rmtree(student, ignore_errors=True)
    cap = MemoryCap(parse_bytes(args.cap))
    cmd = [sys.executable, "-m", "slimml", "convert", str(work / "teacher"), "-o", str(student),
           "--distill-layers", str(args.student_layers), "--distill-data", str(work / "texts.txt"),
           "--distill-epochs", str(args.epochs), "--distill-batch-size", str(args.batch_size),
           "--teacher-memory-budget", args.budget, "--json"]
    try:
        rc, seconds, peak, out = run_capped(cmd, cap)
        result["capped_convert"] = {"command": " ".join(["slimml", *cmd[3:]]), "rc": rc, "seconds": round(seconds, 1),
                                    "cgroup_peak_mb": round(cap.max_usage() / 1e6),
                                    "process_peak_rss_mb": round(peak / 1e6),
                                    "failcnt": int((cap.path / "memory.failcnt").read_text())}
    finally:
        cap.close()
    if rc != 0:
        print(out[-3000:])
        sys.exit(f"the capped convert failed (rc {rc})")
    report = json.loads(out[out.index("{"):])
    distill = next(s for s in report["steps"] if s["step"] == "distill")
    tr = distill["training"]
    result["capped_convert"] |= {
        "student_mb": round(report["size_mb"], 1), "teacher_params": distill["teacher_params"],
        "student_params": distill["student_params"], "teacher_pass": distill["teacher_pass"], "training": tr,
        "heldout_kl_start": tr["heldout_loss_start"], "heldout_kl_end": tr["heldout_loss_end"],
        "kl_ratio": round(tr["heldout_loss_end"] / tr["heldout_loss_start"], 3),
        "export_checks": report["checks"]}
    print(json.dumps(result["capped_convert"], indent=1), flush=True)


def teacher_passes(args, work: Path, result: dict) -> None:
    """2. the teacher pass resident, streamed and cached, each in its own process."""
    art = work / "teacher-art"
    if not (art / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "slimml", "convert", str(work / "teacher"), "-o", str(art),
                        "--exporter", "layerwise", "--no-verify"], check=True, capture_output=True)
    passes = {}
    for variant in ("streamed", "cached", "resident"):
        proc = subprocess.run([sys.executable, __file__, "--child", variant, "--work", str(work), "--budget", args.budget,
                               "--pass-batch", str(args.pass_batch)],
                              capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        passes[variant] = json.loads(line[-1][7:]) if line else {"rc": proc.returncode, "error": proc.stderr[-500:]}
        print(variant, passes[variant], flush=True)
    result["teacher_pass_peak_rss"] = passes | {"batch_texts": args.pass_batch, "texts": args.texts}


if __name__ == "__main__":
    main()
