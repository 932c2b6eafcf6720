"""Distilled / pruned students of all-MiniLM-L6-v2 against the Optimum int8 peer of the teacher.

Run:
    slimml convert --distill-layers 3 --prune 0.5 --quantize int8 --distill-data ../shared/data/stsb/sts-train.csv -o artifacts/d3p5
    python benchmarks/bench_distill.py artifacts/d3p5 [more student artifacts...] [--rounds 30]

For the teacher, Optimum exports all-MiniLM-L6-v2 to ONNX and ``ORTQuantizer`` quantizes it with
``AutoQuantizationConfig.avx512_vnni(is_static=False, per_channel=True)`` (the peer), and the fp32
teacher is converted by slimml. Each student artifact is measured as it is; a float student also
gets an int8 estimate made here with ``onnxruntime.quantization.quantize_dynamic`` on every shard
(per-channel, MatMul + Gather, close to what ``--quantize int8`` does). All are timed round after
round in one process (batch 1, seq 128) and scored on STSb dev (Spearman x100).
Prints a table (and ``--json FILE``); ratios are what to read, absolute times on a shared machine are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

STS_DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb" / "sts-dev.csv"


def optimum_int8_peer(work: Path) -> Path:
    """The teacher exported by Optimum and quantized by ORTQuantizer (dynamic, per-channel, avx512_vnni)."""
    from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    from slimml.convert.sources import default_model_dir

    fp32 = work / "optimum-fp32"
    ORTModelForFeatureExtraction.from_pretrained(str(default_model_dir()), export=True).save_pretrained(fp32)
    quantizer = ORTQuantizer.from_pretrained(str(fp32))
    qconfig = AutoQuantizationConfig.avx512_vnni(is_static=False, per_channel=True)
    quantizer.quantize(save_dir=work / "optimum-int8", quantization_config=qconfig)
    return next((work / "optimum-int8").glob("*quantized*.onnx"))


def int8_copy(artifact: Path, out: Path, op_types: list[str]) -> Path:
    """A copy of ``artifact`` with every shard dynamically quantized (per-channel int8 weights)."""
    import dataclasses

    from onnxruntime.quantization import QuantType, quantize_dynamic

    from slimml.runtime.artifact.manifest import read_manifest
    from slimml.runtime.artifact.writer import ArtifactWriter

    m = read_manifest(artifact)
    with ArtifactWriter(out) as w:
        for s in m.shards:  # weights inline: the quantized shards are small
            (w.folder / s.file).parent.mkdir(parents=True, exist_ok=True)
            quantize_dynamic(str(artifact / s.file), str(w.folder / s.file), op_types_to_quantize=op_types,
                             per_channel=True, weight_type=QuantType.QInt8)
        w.copy_assets(artifact, m)
        w.add_chain([dataclasses.replace(s, data=None) for s in m.shards], m.inputs, m.outputs, pooling=m.pooling)
        step = {"step": "quantize (bench estimate)", "tool": "onnxruntime.quantize_dynamic", "op_types": op_types,
                "per_channel": True}
        w.commit(**{**m.header(), "steps": [*m.steps, step]})
    return out


class PeerModel:
    """The Optimum int8 peer as one ORT session, with the teacher's tokenizer and mean pooling."""

    def __init__(self, onnx_path: Path, tokenizer_dir: Path):
        from slimml.runtime.artifact.manifest import TensorSpec
        from slimml.runtime.engine.session import make_session
        from slimml.runtime.tasks.inputs.text import TextEncoder

        self.session = make_session(onnx_path, "cpu")
        names = [i.name for i in self.session.get_inputs()]
        self.inputs = [TensorSpec(name=n, dtype="int64", shape=["batch_size", "sequence_length"]) for n in names]
        self.text = TextEncoder(tokenizer_dir / "tokenizer.json", {"max_length": 256, "pad_id": 0, "pad_token": "[PAD]"}, names)
        self.size_mb = onnx_path.stat().st_size / 1e6

    def run(self, feeds):
        return self.session.run(["last_hidden_state"], feeds)[0]

    def encode(self, texts, batch_size=64):
        from slimml.runtime.tasks.inputs.pooling import pool

        out = []
        for b in range(0, len(texts), batch_size):
            feeds = self.text(texts[b : b + batch_size])
            out.append(pool(self.run(feeds), feeds["attention_mask"], "mean", True))
        return np.concatenate(out)


def _shape(model) -> dict:
    """Layers, prune fraction and parameters of a contender, from its manifest's steps (teachers: the students' record)."""
    steps = {} if isinstance(model, PeerModel) else {s.get("step"): s for s in model.manifest.steps}
    distill, prune = steps.get("distill", {}), steps.get("prune", {})
    return {"layers": distill.get("layers", 6), "prune": prune.get("fraction", 0.0),
            "params": prune.get("student_params") or distill.get("student_params"),
            "teacher_params": distill.get("teacher_params")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("students", nargs="+", type=Path, help="student artifacts written by `slimml convert --distill-layers/--prune`")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.sources import default_model_dir
    from slimml.runtime import load
    from slimml.runtime.tools.bench import sample_feeds
    from slimml.runtime.tools.evaluate import evaluate_sts

    work = Path(tempfile.mkdtemp(prefix="bench-distill-"))
    try:
        contenders = {"optimum int8 (teacher, peer)": PeerModel(optimum_int8_peer(work), default_model_dir())}
        convert(None, work / "teacher", ConvertConfig(measure_latency=False))
        contenders["slimml fp32 (teacher)"] = load(work / "teacher")
        for art in args.students:
            model = load(art)
            if any(s.get("step") == "quantize" for s in model.manifest.steps):
                contenders[f"{art.name} quantized"] = model
            else:
                contenders[f"{art.name} fp32"] = model
                contenders[f"{art.name} int8 est."] = load(int8_copy(art, work / f"{art.name}-int8", ["MatMul", "Gather"]))
        rows = {}
        for name, model in contenders.items():
            size = model.size_mb if isinstance(model, PeerModel) else model.manifest.total_bytes / 1e6
            sts = evaluate_sts(model, STS_DEV).score
            rows[name] = {"size_mb": round(size, 2), **_shape(model), "stsb_dev": round(sts, 2)}
            print(f"scored {name}: {sts:.2f}", flush=True)
        teacher_params = next((r["teacher_params"] for r in rows.values() if r["teacher_params"]), 0)
        for r in rows.values():
            r["params"] = r["params"] or teacher_params
            del r["teacher_params"]
        feeds = {}
        for name, model in contenders.items():
            f = sample_feeds(model.inputs, batch=1, seq=args.seq)
            if not isinstance(model, PeerModel) and model.manifest.source.get("vocab_size", 30522) < 2000:
                f["input_ids"] %= model.manifest.source["vocab_size"]
            feeds[name] = f
        for name, model in contenders.items():  # warm up
            for _ in range(3):
                model.run(feeds[name])
        times = {k: [] for k in contenders}
        for _ in range(args.rounds):
            for name, model in contenders.items():
                t0 = time.perf_counter()
                model.run(feeds[name])
                times[name].append(time.perf_counter() - t0)
        base = float(np.median(times["optimum int8 (teacher, peer)"]))
        print(f"\nbatch 1 x seq {args.seq}, {args.rounds} interleaved rounds; STSb dev = Spearman x100 on {STS_DEV.name}")
        print(f"{'system':<34}{'layers':>7}{'prune':>7}{'params M':>10}{'MB':>9}{'STSb dev':>10}{'p50 ms':>9}{'vs peer':>9}")
        for name, r in rows.items():
            med = float(np.median(times[name]))
            r |= {"p50_ms": round(med * 1e3, 3), "latency_vs_peer": round(med / base, 3)}
            print(f"{name:<34}{r['layers']:>7}{r['prune']:>7}{r['params'] / 1e6:>10.1f}{r['size_mb']:>9.2f}"
                  f"{r['stsb_dev']:>10.2f}{r['p50_ms']:>9.2f}{r['latency_vs_peer']:>8.2f}x")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
