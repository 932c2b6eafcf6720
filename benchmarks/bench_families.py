"""Each model family at a realistic size: convert, quantize, and resident against streamed.

For ViT (vit-base-patch16-224's shape), CLIP (clip-vit-base-patch32's), T5 (t5-small's) and
Whisper (whisper-tiny's), a model with random weights and the real configuration is saved as a
Hugging Face folder (no download; text models use the default model's tokenizer, so their
vocabulary is 30,522), then:

- ``slimml.convert.convert`` (timed; shard count; fp32 size);
- ``slimml.quantize.quantize`` with ``Int8Config("cpu")`` (int8 size; the guard's agreement);
- the fp32 artifact run through its public API, fully resident (``load(art)``, which fits) and streamed with
  two shards per component resident (``load(art, resident=2)``), each in its own subprocess so
  peak RSS is its own, the two alternated over ``--rounds`` rounds; reported as the streamed
  throughput over the resident one, and the two peak RSS.

What "a run" is per family: ViT ``classify`` of 8 images; CLIP ``embed_images`` of 8 images and
``embed_texts`` of 8 texts; T5 ``generate`` of 4 prompts x 16 tokens; Whisper ``generate`` from
two 5-second recordings, 16 tokens.

Usage:
    python benchmarks/bench_families.py                     # all four -> benchmarks/results/families.json
    python benchmarks/bench_families.py --family vit --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FAMILIES = ("vit", "clip", "t5", "whisper")


def build(family: str, folder: Path) -> None:
    """A random-weight Hugging Face folder of ``family`` at its usual smallest public size."""
    import torch
    from transformers import AutoTokenizer

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    if family == "vit":
        from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

        ViTForImageClassification(ViTConfig(num_labels=1000)).eval().save_pretrained(folder)  # vit-base-patch16-224
        ViTImageProcessor().save_pretrained(folder)
    elif family == "clip":
        from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

        config = CLIPConfig(text_config={"vocab_size": tokenizer.vocab_size}, vision_config={"patch_size": 32})
        CLIPModel(config).eval().save_pretrained(folder)  # clip-vit-base-patch32
        tokenizer.save_pretrained(folder)
        CLIPImageProcessor().save_pretrained(folder)
    elif family == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(vocab_size=tokenizer.vocab_size, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        T5ForConditionalGeneration(config).eval().save_pretrained(folder)  # t5-small: d_model 512, 6 + 6 layers
        tokenizer.save_pretrained(folder)
    else:
        from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

        config = WhisperConfig(begin_suppress_tokens=None, suppress_tokens=None)  # whisper-tiny: d_model 384, 4 + 4 layers
        WhisperForConditionalGeneration(config).eval().save_pretrained(folder)
        WhisperFeatureExtractor().save_pretrained(folder)


def workload(family: str, model) -> tuple[float, int]:
    """Run the family's workload once; (seconds, items) where items are images, texts or tokens."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)) for _ in range(8)]
    t0 = time.perf_counter()
    if family == "vit":
        model.classify(images)
        return time.perf_counter() - t0, 8
    if family == "clip":
        model.embed_images(images)
        model.embed_texts([f"a photo of a thing number {i}" for i in range(8)])
        return time.perf_counter() - t0, 16
    if family == "t5":
        out = model.generate([f"translate English to German: sentence number {i} is here" for i in range(4)], max_new_tokens=16)
        return time.perf_counter() - t0, sum(map(len, out.tokens))
    waves = [(0.1 * rng.standard_normal(16000 * 5)).astype(np.float32) for _ in range(2)]
    out = model.generate(waves, max_new_tokens=16)
    return time.perf_counter() - t0, sum(map(len, out.tokens))


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(args) -> None:
    from slimml.runtime import load

    model = load(args.artifact, resident=2 if args.variant == "streamed" else None)
    family = args.family[0]
    workload(family, model)  # warm-up: sessions built, caches written
    times, items = [], 0
    for _ in range(args.repeat):
        seconds, items = workload(family, model)
        times.append(seconds)
    print(json.dumps({"per_s": items / statistics.median(times), "peak_rss_mb": peak_rss_mb()}))


def spawn(family: str, artifact: Path, variant: str, repeat: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--family", family, "--artifact", str(artifact), "--variant", variant,
           "--repeat", str(repeat)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{family} {variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench(family: str, work: Path, rounds: int, repeat: int) -> dict:
    from slimml.convert import ConvertConfig, convert
    from slimml.quantize import Int8Config, quantize

    src = work / f"{family}-src"
    build(family, src)
    t0 = time.perf_counter()
    report = convert(src, work / family, ConvertConfig(measure_latency=False))
    convert_s = time.perf_counter() - t0
    q = quantize(work / family, work / f"{family}-int8", Int8Config("cpu"))
    runs = {"resident": [], "streamed": []}
    for r in range(rounds):  # alternated, the order flipped each round
        for variant in (("resident", "streamed") if r % 2 == 0 else ("streamed", "resident")):
            runs[variant].append(spawn(family, work / family, variant, repeat))
    res = {v: statistics.median(x["per_s"] for x in rs) for v, rs in runs.items()}
    rss = {v: max(x["peak_rss_mb"] for x in rs) for v, rs in runs.items()}
    agreement = {k: v for k, v in q.checks.items() if "agreement_" in k}
    return {
        "family": family, "convert_s": round(convert_s, 1), "shards": report.shards,
        "fp32_mb": round(report.size_mb, 1), "int8_mb": round(q.size_mb, 1), "int8_agreement": agreement,
        "checks": {k: v for k, v in report.checks.items() if "diff" in k},
        "resident_per_s": round(res["resident"], 2), "streamed_per_s": round(res["streamed"], 2),
        "streamed_over_resident": round(res["streamed"] / res["resident"], 3),
        "peak_rss_mb": {k: round(v) for k, v in rss.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=FAMILIES, action="append")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "families.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--artifact", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    work = Path(tempfile.mkdtemp(prefix="slimml-families-"))
    results = []
    try:
        for family in args.family or FAMILIES:
            row = bench(family, work, args.rounds, args.repeat)
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = f"{'family':8} {'convert s':>9} {'shards':>6} {'fp32 MB':>8} {'int8 MB':>8} {'resident/s':>10} {'streamed/s':>10} {'ratio':>6} {'RSS res/str MB':>15}"
    print(header)
    for r in results:
        print(f"{r['family']:8} {r['convert_s']:9} {r['shards']:6} {r['fp32_mb']:8} {r['int8_mb']:8} {r['resident_per_s']:10} "
              f"{r['streamed_per_s']:10} {r['streamed_over_resident']:6} {r['peak_rss_mb']['resident']:>7}/{r['peak_rss_mb']['streamed']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": os.uname().machine, "cpus": os.cpu_count(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
