"""Streamed vs fully resident ONNX Runtime on a decoder larger than K shards (CPU).

Builds a Llama-architecture causal LM with random weights (default ~1.1B parameters, ~4.4 GB
fp32), exports it to ONNX once (kept as the unsharded reference), shards it with slimml, then
runs prefill (batch x seq tokens) three ways, each in its own subprocess so peak RSS is its own:

- ``unsharded``: one ONNX Runtime session over the unsharded model.onnx (the peer);
- ``streamed``: ``slimml.runtime.load(artifact, resident=K)``: K shards loaded at once;
- the rounds alternate unsharded / streamed so machine load drifts hit both alike.

Prints and writes (``--out``) a JSON report: max abs diff of the logits, peak RSS of each, the
RSS goal (30% of model bytes + 300 MB), prefill tokens/s and the streamed/unsharded ratio.

Usage:
    python benchmarks/bench_stream.py                      # the goal's setting: K=2, batch 4 x 256
    python benchmarks/bench_stream.py --layers 4 --hidden 512 --vocab 8000   # a quick small run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def build(work: Path, args) -> tuple[Path, Path]:
    """Random-weight Llama -> unsharded ONNX (work/onnx/model.onnx) -> artifact (work/artifact)."""
    onnx_path, artifact = work / "onnx" / "model.onnx", work / "artifact"
    if onnx_path.is_file() and (artifact / "manifest.json").is_file():
        return onnx_path, artifact
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimml.convert import ConvertConfig, ExportConfig, convert
    from slimml.convert.export import export
    from slimml.convert.sources import resolve

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "src"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=2048)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).eval()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(src)
    del model
    print(f"built Llama {params / 1e9:.2f}B params ({params * 4 / 1e9:.2f} GB fp32) in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    exported = export(resolve(src), work, ExportConfig(task=args.task))
    shutil.rmtree(src)
    print(f"exported to ONNX in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    convert(exported.onnx_path, artifact, ConvertConfig(verify=False, measure_latency=False))
    if args.task != "text-generation":  # an .onnx source converts as "generic": say it is a decoder
        import json as _json

        path = artifact / "manifest.json"
        raw = _json.loads(path.read_text())
        raw["task"] = args.task
        path.write_text(_json.dumps(raw, indent=2) + "\n")
    print(f"sharded in {time.perf_counter() - t0:.0f} s", flush=True)
    return exported.onnx_path, artifact


def peak_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: on Linux ru_maxrss survives exec, so a
    child would report the parent's (model-building) peak."""
    from slimml.runtime.bench import peak_rss_mb as peak

    return peak()


def feeds_for(batch: int, seq: int, vocab: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    return {
        "input_ids": rng.integers(0, vocab, size=(batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, seq), dtype=np.int64),
        "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy(),
    }


def child(args) -> None:
    """One variant in this process: load, warm up, time ``--runs`` passes, save logits."""
    import numpy as np

    feeds = feeds_for(args.batch, args.seq, args.vocab)
    t0 = time.perf_counter()
    if args.child.startswith("gen-"):
        return child_generate(args)
    if args.child == "unsharded":
        import onnxruntime as ort

        from slimml.runtime.session import session_options

        session = ort.InferenceSession(args.onnx, session_options(), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()][:1]
        names = ["logits"] if "logits" in [o.name for o in session.get_outputs()] else names
        run = lambda: dict(zip(names, session.run(names, feeds)))  # noqa: E731
        stats = None
    else:
        from slimml.runtime import load

        model = load(args.artifact, resident=args.resident, prefetch=args.prefetch, pin=args.pin or None)
        run = lambda: model.run(feeds)  # noqa: E731
        stats = model
    load_s = time.perf_counter() - t0
    out = run()  # warm-up: the first pass also reads the model in
    if stats is not None:
        model._stream.reset_stats() if model._stream else None
    times = []
    for _ in range(args.runs):
        t = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t)
    np.save(args.save, out["logits"])
    report = {
        "variant": args.child,
        "load_s": round(load_s, 2),
        "pass_s": [round(t, 3) for t in times],
        "tokens_per_s": round(args.batch * args.seq / float(np.median(times)), 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    if stats is not None:
        report["plan"] = model.plan.describe()
        report["stream"] = model.stats.to_json()
    print("RESULT " + json.dumps(report), flush=True)


def child_generate(args) -> None:
    """Greedy generation with the KV cache: streamed (K) or fully resident."""
    import numpy as np

    from slimml.runtime import load

    t0 = time.perf_counter()
    streamed = args.child == "gen-streamed"
    model = load(args.artifact, resident=args.resident if streamed else None, pin=(args.pin or None) if streamed else None)
    load_s = time.perf_counter() - t0
    prompts = np.random.default_rng(0).integers(0, args.vocab, size=(args.batch, args.seq)).tolist()
    gen = model.generate(prompts, max_new_tokens=args.generate)
    np.save(args.save, np.array(gen.tokens))
    report = {"variant": args.child, "load_s": round(load_s, 2), "seconds": round(gen.seconds, 2),
              "new_tokens": sum(map(len, gen.tokens)), "tokens_per_s": round(gen.tokens_per_s, 3),
              "peak_rss_mb": round(peak_rss_mb(), 1), "plan": model.plan.describe()}
    if streamed:
        report["stream"] = model.stats.to_json()
    print("RESULT " + json.dumps(report), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=None, help="build folder (default /tmp/slimml-bench-stream[-past])")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--resident", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=None)
    p.add_argument("--pin", type=int, nargs="*", default=None)
    p.add_argument("--runs", type=int, default=2, help="timed passes per subprocess")
    p.add_argument("--rounds", type=int, default=2, help="alternating unsharded/streamed subprocess rounds")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--task", default="text-generation", choices=["text-generation", "text-generation-with-past"])
    p.add_argument("--generate", type=int, default=0, help="instead of prefill: greedy-generate N tokens per prompt "
                   "(batch prompts of --seq tokens), streamed vs resident (use --task text-generation-with-past)")
    p.add_argument("--child", choices=["unsharded", "streamed", "gen-resident", "gen-streamed"], help=argparse.SUPPRESS)
    p.add_argument("--onnx", help=argparse.SUPPRESS)
    p.add_argument("--artifact", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    work = Path(args.work or ("/tmp/slimml-bench-stream" + ("-past" if "past" in args.task else "")))
    onnx_path, artifact = build(work, args)
    if args.build_only:
        return
    from slimml.runtime.manifest import read_manifest

    manifest = read_manifest(artifact)
    model_bytes = manifest.total_bytes
    variants = ("gen-resident", "gen-streamed") if args.generate else ("unsharded", "streamed")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for variant in variants:
            cmd = [sys.executable, __file__, "--child", variant, "--onnx", str(onnx_path), "--artifact", str(artifact),
                   "--save", str(work / f"logits_{variant}.npy"), "--batch", str(args.batch), "--seq", str(args.seq),
                   "--vocab", str(args.vocab), "--runs", str(args.runs), "--resident", str(args.resident),
                   "--generate", str(args.generate)]
            if args.prefetch is not None:
                cmd += ["--prefetch", str(args.prefetch)]
            if args.pin:
                cmd += ["--pin", *map(str, args.pin)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"{variant} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            res = json.loads(line[-1][7:])
            results[variant].append(res)
            print(f"round {r + 1} {variant}: {json.dumps(res)}", flush=True)
    import numpy as np

    if args.generate:
        same = bool((np.load(work / "logits_gen-resident.npy") == np.load(work / "logits_gen-streamed.npy")).all())
        tps = {v: float(np.median([x["tokens_per_s"] for x in rs])) for v, rs in results.items()}
        report = {"model_gb": round(model_bytes / 1e6 / 1e3, 3), "shards": len(manifest.shards),
                  "generate": f"{args.batch} prompts x {args.seq} tokens, {args.generate} new tokens each (KV cache)",
                  "same_tokens": same, "tokens_per_s": tps,
                  "peak_rss_mb": {v: max(x["peak_rss_mb"] for x in rs) for v, rs in results.items()},
                  "plan": results["gen-streamed"][-1]["plan"], "stream_stats_last": results["gen-streamed"][-1].get("stream")}
        print(json.dumps(report, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        return
    a = np.load(work / "logits_unsharded.npy")
    b = np.load(work / "logits_streamed.npy")
    diff = float(np.abs(a - b).max())
    tps = {v: float(np.median([x["tokens_per_s"] for x in rs])) for v, rs in results.items()}
    rss = {v: max(x["peak_rss_mb"] for x in rs) for v, rs in results.items()}
    rss_goal = 0.3 * model_bytes / 2**20 + 300
    report = {
        "model_gb": round(model_bytes / 1e9, 3),
        "shards": len(manifest.shards),
        "largest_shard_mb": round(max(s.weight_bytes for s in manifest.shards) / 1e6, 1),
        "prefill": f"batch {args.batch} x {args.seq} tokens",
        "resident": args.resident,
        "plan": results["streamed"][-1].get("plan"),
        "max_abs_diff": diff,
        "peak_rss_mb": rss,
        "rss_goal_mb": round(rss_goal, 1),
        "tokens_per_s": tps,
        "throughput_ratio": round(tps["streamed"] / tps["unsharded"], 3),
        "stream_stats_last": results["streamed"][-1].get("stream"),
        "goals": {
            "max_abs_diff<=1e-4": diff <= 1e-4,
            "peak_rss<=30%+300MB": rss["streamed"] <= rss_goal,
            "throughput>=70%": tps["streamed"] >= 0.7 * tps["unsharded"],
        },
    }
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
