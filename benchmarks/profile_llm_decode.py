"""Where a decoder's time goes on CPU (docs/llm_decode.md).

``graph``: the ORT profiler over one decoder graph (onnxruntime-genai's ``model.onnx`` or a fused
slimml artifact's shards merged), a prompt pass then decode steps with past and present in one
buffer; prints each op type's share of the prompt pass and of a decoded token.

``matmul``: one 4-bit MatMulNBits (2048 x 5632) at block sizes 32-256 and accuracy levels 0 and 4,
M=1 (a decode step) and M=128 (a prompt), alternated round by round; times relative to block 32,
level 4 (onnxruntime-genai's builder).

    python benchmarks/profile_llm_decode.py graph /tmp/decode/og_int4/model.onnx --prompt 128 --steps 32
    python benchmarks/profile_llm_decode.py graph ARTIFACT_FOLDER          # merges the shards first
    python benchmarks/profile_llm_decode.py matmul --rounds 9
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


def _graph_file(path: Path, tmp: Path) -> Path:
    if path.is_file():
        return path
    import onnx

    from slimml.runtime.artifact.manifest import read_manifest
    from slimml.runtime.engine.merge import merge_shards

    manifest = read_manifest(path)
    merged = path / f".profile-{os.getpid()}.onnx"  # beside the shards: their data files resolve
    onnx.save(merge_shards(path, manifest, [s.index for s in manifest.shards]), str(merged))
    return merged


def profile_graph(path: Path, prompt: int, steps: int, threads: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        graph = _graph_file(path, Path(tmp))
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "prof")
        s = ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
        if graph != path:
            graph.unlink()
        past = [i for i in s.get_inputs() if i.name.startswith("past_key_values.")]
        head = int(past[0].shape[3]) if isinstance(past[0].shape[3], int) else 64
        bufs = {i.name: np.zeros((1, i.shape[1], prompt + steps, head), np.float32) for i in past}
        values = {n: ort.OrtValue.ortvalue_from_numpy(b) for n, b in bufs.items()}
        ids = np.random.default_rng(0).integers(3, 32000, size=(1, prompt)).astype(np.int64)

        def run(x: np.ndarray, total: int) -> None:
            b = s.io_binding()
            b.bind_cpu_input("input_ids", x)
            b.bind_cpu_input("attention_mask", np.ones((1, total), np.int64))
            for n, v in values.items():
                b.bind_ortvalue_input(n, v)
                b.bind_ortvalue_output(n.replace("past_key_values.", "present."), v)
            b.bind_output("logits", "cpu")
            s.run_with_iobinding(b)

        run(ids, prompt)
        for i in range(steps):
            run(ids[:, :1], prompt + i + 1)
        events = json.loads(Path(s.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    first_end = runs[0]["ts"] + runs[0]["dur"]
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"]["op_name"] + (" (lm_head)" if "lm_head" in e["name"] else "")
            agg[op][0 if e["ts"] < first_end else 1] += e["dur"]
    tp, td = sum(v[0] for v in agg.values()), sum(v[1] for v in agg.values())
    run_ms = sum(r["dur"] for r in runs[1:]) / 1e3 / steps
    print(f"kernels: prompt {tp / 1e3:.1f} ms; decode {td / 1e3 / steps:.2f} ms/token of {run_ms:.2f} ms/token model_run")
    for op, (p, d) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"  {op:34s} prompt {100 * p / tp:5.1f}%   decode {100 * d / td:5.1f}%")


def profile_matmul(rounds: int, threads: int) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    k, n = 2048, 5632
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)

    def session(block: int, level: int) -> ort.InferenceSession:
        g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
                              [numpy_helper.from_array(w, "W")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        q = MatMulNBitsQuantizer(m, algo_config=DefaultWeightOnlyQuantConfig(
            block_size=block, is_symmetric=True, accuracy_level=level, bits=4))
        q.process()
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        return ort.InferenceSession(q.model.model.SerializeToString(), so, providers=["CPUExecutionProvider"])

    configs = [(32, 4), (64, 4), (128, 4), (256, 4), (32, 0)]
    sessions = {c: session(*c) for c in configs}
    xs = [(rng.standard_normal((1, k)).astype(np.float32), 200), (rng.standard_normal((128, k)).astype(np.float32), 5)]
    times = {c: [[], []] for c in configs}
    for _ in range(rounds):
        for c, s in sessions.items():
            for j, (x, reps) in enumerate(xs):
                s.run(None, {"x": x})
                t = time.perf_counter()
                for _ in range(reps):
                    s.run(None, {"x": x})
                times[c][j].append((time.perf_counter() - t) / reps)
    base = times[(32, 4)]
    for c, (one, many) in times.items():
        r1 = np.median(np.array(one) / np.array(base[0]))
        r128 = np.median(np.array(many) / np.array(base[1]))
        print(f"block {c[0]:3d} accuracy_level {c[1]}: M=1 {r1:.2f}x   M=128 {r128:.2f}x   (of block 32, level 4)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["graph", "matmul"])
    p.add_argument("path", nargs="?", type=Path)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.what == "graph":
        profile_graph(args.path, args.prompt, args.steps, args.threads)
    else:
        profile_matmul(args.rounds, args.threads)


if __name__ == "__main__":
    main()
