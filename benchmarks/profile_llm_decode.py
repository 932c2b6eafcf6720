"""Where a decoder's time goes on CPU (docs/llm_decode.md).

``graph``: the ORT profiler over one decoder graph (onnxruntime-genai's ``model.onnx`` or a fused
slimml artifact's shards merged), a prompt pass then decode steps with past and present in one
buffer; prints each op type's share of the prompt pass and of a decoded token.

``matmul``: one weight MatMul (2048 x 5632 and 5632 x 2048) as quantize/decoder.py writes it, 4 and
8 bits, block sizes 32-256, accuracy level unset or 4, with and without integer zero points, the
GGUF Q4_1 grid (with its block-sum correction) and fp32; M=1 (a decode step) and M=128 (a prompt),
alternated round by round; times relative to 4-bit block 32 level 4 (onnxruntime-genai's builder).

    python benchmarks/profile_llm_decode.py graph /tmp/decode/og_int4/model.onnx --prompt 128 --steps 32
    python benchmarks/profile_llm_decode.py graph ARTIFACT_FOLDER          # merges the shards first
    python benchmarks/profile_llm_decode.py matmul --rounds 9
    python benchmarks/profile_llm_decode.py matmul --rounds 5 --only 8-bit,b128
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
        indexed = any(i.name == "logits_index" for i in s.get_inputs())

        def run(x: np.ndarray, total: int) -> None:
            b = s.io_binding()
            b.bind_cpu_input("input_ids", x)
            b.bind_cpu_input("attention_mask", np.ones((1, total), np.int64))
            if indexed:  # a fused graph computes the logits of the positions it is given: the last one
                b.bind_cpu_input("logits_index", np.full((1, 1), x.shape[1] - 1, np.int64))
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


MATMUL_CONFIGS = [  # (label, bits, block, accuracy_level, integer zero points)
    ("4-bit b32 L4 (onnxruntime-genai)", 4, 32, 4, False),
    ("4-bit b32 L4 zp", 4, 32, 4, True),
    ("4-bit b64 L4", 4, 64, 4, False),
    ("4-bit b64 L4 zp", 4, 64, 4, True),
    ("4-bit b128 L4", 4, 128, 4, False),
    ("4-bit b128 L4 zp", 4, 128, 4, True),
    ("4-bit b256 L4 zp", 4, 256, 4, True),
    ("4-bit b32 unset", 4, 32, None, False),
    ("4-bit b32 gguf Q4_1 unset", 4, 32, None, "gguf"),
    ("4-bit b32 gguf Q4_1 L4", 4, 32, 4, "gguf"),
    ("8-bit b32 unset", 8, 32, None, False),
    ("8-bit b32 L4", 8, 32, 4, False),
    ("8-bit b64 L4", 8, 64, 4, False),
    ("8-bit b128 L4", 8, 128, 4, False),
    ("8-bit b256 L4", 8, 256, 4, False),
    ("8-bit b128 L4 zp", 8, 128, 4, True),
    ("fp32 MatMul", 32, 0, None, False),
]


def _on_q4_1_grid(w: np.ndarray) -> np.ndarray:
    """``w`` (K, N) rounded to llama.cpp's Q4_1 along K (blocks of 32, fp16 ``d`` and ``m``), as a Q4_1 file holds it."""
    k, n = w.shape
    b = w.T.reshape(n, k // 32, 32)
    m = b.min(axis=-1).astype(np.float16).astype(np.float32)
    d = ((b.max(axis=-1) - m) / 15).astype(np.float16).astype(np.float32)
    q = np.clip(np.rint((b - m[..., None]) / np.where(d > 0, d, 1)[..., None]), 0, 15)
    return np.ascontiguousarray((d[..., None] * q + m[..., None]).reshape(n, k).T.astype(np.float32))


def _matmul_graph(w: np.ndarray, bits: int, block: int, level, zp) -> bytes:
    """One weight MatMul of ``w`` (K, N) as slimml's language-model backend writes it (quantize/decoder.py)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from slimml.quantize.decoder import matmul_nbits_node
    from slimml.quantize.grids import Recipe

    k, n = w.shape
    node = helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")
    if bits == 32:
        nodes, inits = [node], [numpy_helper.from_array(w, "W")]
    else:
        grid = "gguf" if zp == "gguf" else "fitted"
        if grid == "gguf":  # the weights of a Q4_1 source (off a grid, the gguf grid would store them at 8 bits)
            w = _on_q4_1_grid(w)
        recipe = Recipe(bits=bits, block_size=block, accuracy_level=level, grid=grid, zero_points=zp is True)
        nodes, inits = matmul_nbits_node(node, w, recipe, bits, {})
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "M", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "M", n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m.SerializeToString()


def profile_matmul(rounds: int, threads: int, only: str | None = None) -> None:
    """MatMulNBits as the language-model backend writes it: each config x (2048x5632, 5632x2048) x
    (M=1, M=128), alternated round by round; medians, relative to 4-bit block 32 level 4."""
    rng = np.random.default_rng(0)
    configs = [c for c in MATMUL_CONFIGS if only is None or any(o in c[0] for o in only.split(",")) or c[0].startswith("4-bit b32 L4 (")]
    shapes = [(2048, 5632), (5632, 2048)]
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sessions = {}
    for k, n in shapes:
        w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
        for c in configs:
            sessions[(c[0], k)] = ort.InferenceSession(_matmul_graph(w, *c[1:]), so, providers=["CPUExecutionProvider"])
    xs = {k: [(rng.standard_normal((1, 1, k)).astype(np.float32), 100), (rng.standard_normal((1, 128, k)).astype(np.float32), 3)]
          for k, _ in shapes}
    times = collections.defaultdict(list)  # (label, K, M) -> seconds per run
    for _ in range(rounds):
        for (label, k), s in sessions.items():
            for x, reps in xs[k]:
                s.run(None, {"x": x})
                t = time.perf_counter()
                for _ in range(reps):
                    s.run(None, {"x": x})
                times[(label, k, x.shape[1])].append((time.perf_counter() - t) / reps)
    base = configs[0][0]
    rows = {}
    print(f"{'config':34s}" + "".join(f"  {k}x{n} M={m:<4d}" for k, n in shapes for m in (1, 128)) + "   (time / first row; us)")
    for c in configs:
        cells = []
        for k, n in shapes:
            for m in (1, 128):
                r = float(np.median(np.array(times[(c[0], k, m)]) / np.array(times[(base, k, m)])))
                us = float(np.median(times[(c[0], k, m)])) * 1e6
                rows[f"{c[0]} {k}x{n} M={m}"] = {"ratio": round(r, 3), "us": round(us, 1)}
                cells.append(f"  {r:5.2f} ({us:7.0f})  ")
        print(f"{c[0]:34s}" + "".join(cells))
    print(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["graph", "matmul"])
    p.add_argument("path", nargs="?", type=Path)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", default=None, help="matmul: only the configs whose label holds one of these comma-separated texts")
    args = p.parse_args()
    if args.what == "graph":
        profile_graph(args.path, args.prompt, args.steps, args.threads)
    else:
        profile_matmul(args.rounds, args.threads, args.only)


if __name__ == "__main__":
    main()
