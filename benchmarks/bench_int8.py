"""slimml through its public API against Optimum's int8 model run as Optimum's users run it.

    python benchmarks/bench_int8.py [--work /tmp/bench-int8] [--reuse] [--student ARTIFACT] [--compare NAME=ARTIFACT ...]
                                    [--runs1 300] [--runs32 20]

Builds, from the embedded all-MiniLM-L6-v2 (or reuses with --reuse):
  * fp32 ONNX through optimum-onnx (the exporter slimml uses),
  * the peer: Optimum ``ORTQuantizer`` with ``AutoQuantizationConfig.avx512_vnni(is_static=False,
    per_channel=True)``, what Optimum's docs show for dynamic int8,
  * slimml fp32 and int8 artifacts (``slimml convert`` and ``slimml convert --quantize int8``).

Every system runs with its own defaults, never slimml's settings:
  * ``optimum``: ``ORTModelForFeatureExtraction.from_pretrained(peer)``, called as ``model(**feeds)``;
  * ``ort``: a plain ``onnxruntime.InferenceSession(peer file)`` with default options (no wrapper);
  * ``slimml.run``: ``slimml.runtime.load(artifact).run(feeds)``;
  * ``encode`` rows: text in, normalised embeddings out: Optimum's tokenizer + model + mean pooling
    (as its docs show) against ``load(artifact).encode(texts)``.
Seq 128, every token real; the systems alternate in blocks of calls (``timing.interleaved``: 3
warm-up calls then ``runs / 10`` timed ones per block, the order reversed every other round) in one
process, and the medians are compared (ratios < 1: slimml is faster). Alternating call by call
instead lets each session's spinning thread pool slow the next system (``timing.py``). STSb dev
Spearman x100 of each is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
from timing import interleaved  # noqa: E402  (benchmarks/timing.py: blocks, not call by call)

STSB = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb"


def build(work: Path, calibration: Path | None) -> None:
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.export import export
    from slimml.convert.sources import resolve
    from slimml.quantize import Int8Config

    exported = export(resolve(None), work / "onnx")
    q = ORTQuantizer.from_pretrained(exported.onnx_path.parent, file_name=exported.onnx_path.name)
    q.quantize(save_dir=work / "peer", quantization_config=AutoQuantizationConfig.avx512_vnni(is_static=False, per_channel=True))
    convert(None, work / "fp32", ConvertConfig(measure_latency=False))
    convert(None, work / "int8", ConvertConfig(measure_latency=False, quantize=Int8Config("cpu", calibration=calibration)))


class OptimumEncoder:
    """What an Optimum user writes for sentence embeddings: tokenizer, model, mean pooling."""

    def __init__(self, folder: Path, file_name: str):
        from optimum.onnxruntime import ORTModelForFeatureExtraction
        from transformers import AutoTokenizer

        self.model = ORTModelForFeatureExtraction.from_pretrained(folder, file_name=file_name)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)

    def __call__(self, **feeds):
        return self.model(**feeds).last_hidden_state

    def encode(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        order = np.argsort([-len(t) for t in texts], kind="stable")  # as sentence-transformers: longest first
        out = np.empty((len(texts), 384), np.float32)
        for i in range(0, len(texts), batch_size):
            rows = order[i : i + batch_size]
            enc = self.tokenizer([texts[r] for r in rows], padding=True, truncation=True, max_length=256, return_tensors="np")
            hidden = np.asarray(self.model(**enc).last_hidden_state)
            mask = enc["attention_mask"][..., None].astype(np.float32)
            emb = (hidden * mask).sum(1) / np.clip(mask.sum(1), 1e-9, None)
            out[rows] = emb / np.linalg.norm(emb, axis=1, keepdims=True)
        return out


def texts_of_tokens(tokenizer, n: int, count: int) -> list[str]:
    """``count`` real sentences from STSb joined until each tokenizes to exactly ``n`` tokens."""
    from slimml.runtime.tools.evaluate import read_sts

    words = " ".join(read_sts(STSB / "sts-train.csv")[0][:2000]).split()
    out, start = [], 0
    while len(out) < count:
        lo, hi = 1, 400
        while lo < hi:  # the most words that fit in n tokens
            mid = (lo + hi + 1) // 2
            if len(tokenizer.encode(" ".join(words[start : start + mid]))) <= n:
                lo = mid
            else:
                hi = mid - 1
        text = " ".join(words[start : start + lo])
        if len(tokenizer.encode(text)) == n:
            out.append(text)
        start += lo
    return out


def sts_score(encode, path: Path) -> float:
    from slimml.runtime.tools.evaluate import read_sts, spearman

    s1, s2, gold = read_sts(path)
    e = encode(list(s1) + list(s2))
    return 100.0 * spearman((e[: len(s1)] * e[len(s1):]).sum(1), gold)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None, help="build folder (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true", help="reuse the models already built in --work")
    ap.add_argument("--student", type=Path, default=None, help="also time this artifact (e.g. the d3-p50 int8 student)")
    ap.add_argument("--compare", nargs="+", default=[], metavar="NAME=ARTIFACT",
                    help="also time these int8 variants against Optimum through load().run, b1 and b32, "
                         "e.g. unfused=DIR (made with Int8DynamicConfig(fuse=False)), and score them")
    ap.add_argument("--runs1", type=int, default=300)
    ap.add_argument("--runs32", type=int, default=20)
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = ap.parse_args()
    import onnxruntime as ort

    from slimml.runtime import load
    from slimml.runtime.tools.bench import sample_feeds

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-int8-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (args.reuse and (work / "int8" / "manifest.json").is_file()):
        build(work, STSB / "sts-train.csv")
    peer_dir, fp32_onnx = work / "peer", work / "onnx" / "onnx" / "model.onnx"
    int8, fp32 = load(work / "int8"), load(work / "fp32")
    optimum = OptimumEncoder(peer_dir, "model_quantized.onnx")
    plain = ort.InferenceSession(str(peer_dir / "model_quantized.onnx"))  # ORT's defaults, CPU
    whole_fp32 = ort.InferenceSession(str(fp32_onnx))
    student = load(args.student) if args.student else None
    variants = {}
    for spec in args.compare:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--compare takes NAME=ARTIFACT, got {spec!r}")
        variants[name] = load(path)
    res: dict = {"ort": ort.__version__, "cpu_count": os.cpu_count()}

    def row(name: str, ms: dict[str, float], ours: str, peer: str) -> None:
        res[name] = {k: round(v, 3) for k, v in ms.items()} | {"ratio": round(ms[ours] / ms[peer], 3)}
        print(f"{name:28s} " + "  ".join(f"{k} {v:.2f} ms" for k, v in ms.items()) + f"  ratio {ms[ours] / ms[peer]:.3f}", flush=True)

    for batch, runs in ((1, args.runs1), (32, args.runs32)):
        f = sample_feeds(int8.manifest.inputs, batch=batch, seq=128)
        fns = {"optimum": lambda: optimum(**f), "ort": lambda: plain.run(None, f), "slimml.run": lambda: int8.run(f)}
        fns |= {n: (lambda m=m: m.run(f)) for n, m in variants.items()}  # --compare: in the same blocks
        blocks = {"block": max(runs // 10, 4), "warmup": 3 if batch == 1 else 1}
        ms = interleaved(fns, runs, **blocks)
        row(f"int8 b{batch} run vs optimum", ms, "slimml.run", "optimum")
        res[f"int8 b{batch} run vs ort"] = round(ms["slimml.run"] / ms["ort"], 3)
        if variants:
            res[f"variants b{batch} vs optimum"] = {k: round(ms[k] / ms["optimum"], 3) for k in ["slimml.run", *variants]}
            print(f"variants b{batch} vs optimum: {res[f'variants b{batch} vs optimum']}", flush=True)
        texts = texts_of_tokens(optimum.tokenizer, 128, batch)
        ms = interleaved({"optimum": lambda: optimum.encode(texts), "slimml.encode": lambda: int8.encode(texts)}, runs, **blocks)
        row(f"int8 b{batch} encode", ms, "slimml.encode", "optimum")
        ms = interleaved({"ort": lambda: whole_fp32.run(None, f), "slimml.run": lambda: fp32.run(f)}, runs, **blocks)
        row(f"fp32 b{batch} run vs 1 session", ms, "slimml.run", "ort")
        if student is not None and batch == 1:
            ms = interleaved({"optimum": lambda: optimum(**f), "student.run": lambda: student.run(f)}, runs, **blocks)
            row("student b1 run vs optimum", ms, "student.run", "optimum")
    if not args.no_accuracy:
        scored = [("optimum int8", optimum.encode), ("slimml int8", int8.encode), ("slimml fp32", fp32.encode)]
        for name, enc in scored + [(n, m.encode) for n, m in variants.items()]:
            res[f"stsb_dev {name}"] = round(sts_score(enc, STSB / "sts-dev.csv"), 2)
            print(f"STSb dev {name}: {res[f'stsb_dev {name}']:.2f}", flush=True)
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
