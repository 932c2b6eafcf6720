"""The CUDA path on a real GPU, in one run that writes one JSON report.

    python benchmarks/bench_cuda.py --artifacts DIR [--sts sts-dev.csv] [--out results/cuda.json]

Sections (each recorded, or its error recorded, so one failure loses nothing else):

- ``env``: GPU, driver, CUDA (from nvidia-smi), onnxruntime version and providers.
- ``h2d``: a 256 MB host-to-device copy from pinned and from pageable memory (torch, when it is
  installed: the bound for streaming weights).
- ``resident_vs_ort``: each MiniLM artifact in ``--artifacts`` (seq 128, batch 1 and 32) through
  ``load(..., device="cuda").run`` against one plain ``InferenceSession`` over the same graph
  in one file, with ONNX Runtime's defaults, its users' way (``sess.run`` on numpy feeds);
  interleaved rounds, medians, ratio slimml / peer.
- ``sts``: STSb dev Spearman x100 of each artifact encoded on CUDA (``load().encode``).
- ``stream``: a synthetic MLP chain of ``--layers`` x ``--hidden`` fp32 weights (default 48 x
  4096: 3.2 GB), converted by ``slimml convert``; resident on the GPU against streamed with K=2
  device slots, each in its own process while nvidia-smi samples the GPU's memory; the bytes
  streamed per second against the h2d rates; outputs against resident and CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
DEVICE = os.environ.get("SLIMML_BENCH_DEVICE", "cuda")  # "cpu" only to try this script where there is no GPU


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", type=Path, help="a folder of MiniLM artifacts (fp16, int4-weights, ...)")
    ap.add_argument("--sts", type=Path, help="STSb dev CSV")
    ap.add_argument("--out", type=Path, default=RESULTS / "cuda.json")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=1024, help="rows fed through the MLP chain per pass")
    ap.add_argument("--only", help="comma-separated sections to run (default: all)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--own-arenas", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--host", default="auto", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(Path(args.child), args.k, args.tokens, args.hidden, args.own_arenas, args.host)))
        return
    report: dict = {}
    for name, fn in [("env", _env), ("h2d", _h2d),
                     ("resident_vs_ort", lambda: _resident_vs_ort(args.artifacts)),
                     ("sts", lambda: _sts(args.artifacts, args.sts)),
                     ("stream", lambda: _stream(args.layers, args.hidden, args.tokens))]:
        if args.only and name not in args.only.split(","):
            continue
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # keep the other sections
            report[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        print(f"[{name}] {time.perf_counter() - t0:.0f} s: {json.dumps(report[name])[:600]}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


def _env() -> dict:
    import onnxruntime as ort

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
    cuda = head.split("CUDA Version:")[1].split()[0] if "CUDA Version:" in head else None
    return {"gpu": smi, "cuda_driver_api": cuda, "onnxruntime": ort.__version__,
            "providers": ort.get_available_providers(), "python": sys.version.split()[0]}


def _h2d() -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed"}
    n = 256 << 20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for kind, host in [("pinned", torch.empty(n, dtype=torch.uint8).pin_memory()),
                       ("pageable", torch.from_numpy(np.ones(n, np.uint8)))]:
        times = []
        for _ in range(12):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dev.copy_(host, non_blocking=kind == "pinned")
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[f"h2d_{kind}_gbps"] = round(n / statistics.median(times[2:]) / 1e9, 2)
    return out


def _artifacts(folder: Path | None) -> list[Path]:
    if folder is None or not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if (p / "manifest.json").is_file())


def _single_file(art: Path, dst: Path) -> Path:
    """The artifact's graph as one ONNX file with its weights inline: what a user of plain ORT runs."""
    import onnx
    from onnx import external_data_helper

    from slimml.runtime.artifact.manifest import read_manifest
    from slimml.runtime.engine.merge import merge_shards

    manifest = read_manifest(art)
    model = merge_shards(art, manifest, [s.index for s in manifest.shards])
    external_data_helper.load_external_data_for_model(model, str(art))
    onnx.save(model, str(dst))
    return dst


def _text_feeds(batch: int, seq: int = 128) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, (batch, seq), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def _resident_vs_ort(folder: Path | None) -> dict:
    import onnxruntime as ort

    from slimml.runtime import load

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for art in _artifacts(folder):
            model = load(art, device=DEVICE)
            peer = ort.InferenceSession(str(_single_file(art, Path(tmp) / f"{art.name}.onnx")),
                                        providers=["CUDAExecutionProvider" if DEVICE == "cuda" else "CPUExecutionProvider"])
            names = {i.name for i in peer.get_inputs()}
            row = {"plan": model.plan.describe().splitlines()[-1].strip()}
            for batch in (1, 32):
                feeds = {k: v for k, v in _text_feeds(batch).items() if k in names}
                a, b = model.run(feeds), peer.run(None, feeds)
                first = next(iter(a.values()))
                row[f"b{batch}_max_abs_diff"] = float(np.abs(first.astype(np.float32) - b[0].astype(np.float32)).max())
                ours, theirs = [], []
                for r in range(10):
                    for who in ((0, 1) if r % 2 == 0 else (1, 0)):
                        t0 = time.perf_counter()
                        for _ in range(20):
                            model.run(feeds) if who == 0 else peer.run(None, feeds)
                        (ours if who == 0 else theirs).append((time.perf_counter() - t0) / 20)
                row[f"b{batch}_slimml_ms"] = round(statistics.median(ours) * 1e3, 3)
                row[f"b{batch}_ort_ms"] = round(statistics.median(theirs) * 1e3, 3)
                row[f"b{batch}_ratio"] = round(statistics.median(ours) / statistics.median(theirs), 3)
            out[art.name] = row
            del model, peer
    return out


def _sts(folder: Path | None, sts: Path | None) -> dict:
    from slimml.runtime import load
    from slimml.runtime.tools.evaluate import evaluate_sts

    out = {}
    for art in _artifacts(folder):
        if sts is None:
            break
        t0 = time.perf_counter()
        result = evaluate_sts(load(art, device=DEVICE), sts)
        out[art.name] = {"spearman_x100": round(result.score, 2), "seconds": round(time.perf_counter() - t0, 1)}
    return out


def _write_chain(folder: Path, layers: int, hidden: int) -> Path:
    """An ONNX MLP chain with external fp32 weights: x -> [MatMul, Add, Relu, Add residual] x layers."""
    import onnx
    from onnx import TensorProto, helper

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    nodes, inits, h, offset = [], [], "x", 0
    data = folder / "chain.onnx.data"
    with open(data, "wb") as f:
        for i in range(layers):
            for name, arr in [(f"layers.{i}.w", (rng.standard_normal((hidden, hidden), dtype=np.float32) / np.sqrt(hidden)).astype(np.float32)),
                              (f"layers.{i}.b", rng.standard_normal(hidden, dtype=np.float32) * 0.1)]:
                t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=arr.shape)
                t.data_location = TensorProto.EXTERNAL
                for k, v in (("location", data.name), ("offset", str(offset)), ("length", str(arr.nbytes))):
                    e = t.external_data.add()
                    e.key, e.value = k, v
                f.write(arr.tobytes())
                offset += arr.nbytes
                pad = (-offset) % 4096
                f.write(b"\0" * pad)
                offset += pad
                inits.append(t)
            p = f"/layers.{i}"
            nodes += [helper.make_node("MatMul", [h, f"layers.{i}.w"], [f"{p}/mm"], name=f"{p}/MatMul"),
                      helper.make_node("Add", [f"{p}/mm", f"layers.{i}.b"], [f"{p}/add"], name=f"{p}/Add"),
                      helper.make_node("Relu", [f"{p}/add"], [f"{p}/relu"], name=f"{p}/Relu"),
                      helper.make_node("Add", [f"{p}/relu", h], [f"{p}/out"], name=f"{p}/Residual")]
            h = f"{p}/out"
    nodes.append(helper.make_node("Identity", [h], ["y"], name="/head/Identity"))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "chain.onnx"
    onnx.save(model, str(path))
    return path


def _accelerate(layers: int, hidden: int, tokens: int, budget: str) -> dict:
    """The peer: the same chain as a torch module, offloaded by Hugging Face Accelerate the way
    ``device_map="auto"`` with ``max_memory`` does it (layers beyond the GPU budget stay in CPU
    memory and are moved to the GPU by hooks at each forward)."""
    import torch
    from accelerate import dispatch_model, infer_auto_device_map
    from torch import nn

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x)) + x
            return x

    model = Chain().eval()
    rng = np.random.default_rng(0)  # the weights of _write_chain, drawn in the same order
    with torch.no_grad():
        for layer in model.layers:
            w = (rng.standard_normal((hidden, hidden), dtype=np.float32) / np.sqrt(hidden)).astype(np.float32)
            layer.weight.copy_(torch.from_numpy(w.T.copy()))
            layer.bias.copy_(torch.from_numpy(rng.standard_normal(hidden, dtype=np.float32) * 0.1))
    device_map = infer_auto_device_map(model, max_memory={0: budget, "cpu": "100GiB"})
    model = dispatch_model(model, device_map=device_map)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((tokens, hidden), dtype=np.float32)).cuda()
    with torch.no_grad():
        y = model(x)
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = model(x)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    on_gpu = sum(1 for v in device_map.values() if v == 0)
    return {"pass_s": round(statistics.median(times), 4), "layers_on_gpu": on_gpu, "budget": budget,
            "y": y.float().cpu().numpy()}


def _child(art: Path, k: int, tokens: int, hidden: int, own_arenas: bool = False, host: str = "auto") -> dict:
    """One variant in its own process: k=0 resident on CUDA, k=-1 CPU, else streamed with K=k.
    Ablations: ``own_arenas``, one arena per streamed session instead of one shared; ``host``,
    how weights reach the GPU (cuda_slots: pinned, staged, pageable; auto picks)."""
    if k == -2:
        row = _accelerate(int(os.environ["CHAIN_LAYERS"]), hidden, tokens, os.environ.get("ACCELERATE_BUDGET", "512MiB"))
        y = row.pop("y")
        if tokens > 4:
            np.save(art.parent / "y_accelerate.npy", y)
        return row
    from slimml.runtime import load
    from slimml.runtime.engine.cuda_slots import CudaSlots

    CudaSlots.host = host

    if own_arenas:
        from slimml.runtime.engine.backends import CudaBackend

        plain = CudaBackend.session_options  # the streamed shards' sessions: each with its own arena
        CudaBackend.session_options = lambda self, *a, **kw: plain(self, *a, **{**kw, "shared_arena": False})

    device = "cpu" if k < 0 else DEVICE
    model = load(art, device=device, resident=k if k > 0 else None)
    x = np.random.default_rng(1).standard_normal((tokens, hidden), dtype=np.float32)
    y = model.run({"x": x})["y"]  # warm-up
    model.plan.reset_stats()
    times = []
    for _ in range(3 if device == "cpu" else 8):
        t0 = time.perf_counter()
        y = model.run({"x": x})["y"]
        times.append(time.perf_counter() - t0)
    if not own_arenas and host == "auto" and tokens > 4:
        np.save(art.parent / f"y_{k}.npy", y)
    stats = model.plan.stats.to_json()
    modes = [seg.source.host_mode for seg in model.plan.segments if isinstance(getattr(seg, "source", None), CudaSlots)]
    return {"pass_s": round(statistics.median(times), 4), "plan": model.plan.describe(), "stats": stats,
            "host": modes[0] if modes else None, "sessions": model.plan.sessions}


def _stream(layers: int, hidden: int, tokens: int) -> dict:
    from slimml.convert import ConvertConfig, convert

    tmp = Path(tempfile.mkdtemp(prefix="slimml-cuda-"))
    t0 = time.perf_counter()
    art = tmp / "art"
    convert(_write_chain(tmp / "src", layers, hidden), art, ConvertConfig(measure_latency=False))
    out = {"model_bytes": sum(p.stat().st_size for p in art.glob("*.data")), "layers": layers, "hidden": hidden,
           "tokens": tokens, "convert_s": round(time.perf_counter() - t0, 1)}
    base = _vram_used()
    variants = [(0, "", tokens), (2, "", tokens), (3, "", tokens), (2, "--own-arenas", tokens), (2, "--host=staged", tokens),
                (2, "--host=pageable", tokens), (-2, "", tokens), (-1, "", tokens)]
    variants += [(0, "", 4), (2, "", 4), (-2, "", 4)]  # decode-sized: 4 rows a pass, the transfer is all
    for k, flag, rows in variants:
        peak = [base]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _vram_used())
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        proc = subprocess.run([sys.executable, __file__, "--child", str(art), "--k", str(k), "--tokens", str(rows),
                               "--hidden", str(hidden)] + ([flag] if flag else []), capture_output=True, text=True,
                              env={**os.environ, "CHAIN_LAYERS": str(layers)})
        stop.set()
        sampler.join()
        name = {0: "resident", -1: "cpu", -2: "accelerate"}.get(k, f"streamed_k{k}") + flag.replace("--host=", "_").replace("--", "_").replace("-", "_") + (
            f"_{rows}rows" if rows != tokens else "")
        if proc.returncode:
            out[name] = {"error": proc.stderr[-1500:]}
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        if k >= 0 or k == -2:
            row["peak_vram_mb"] = round((peak[0] - base) / 2**20)
        if k > 0:
            row["stream_gbps"] = round(row["stats"].get("bytes_per_pass", 0) / row["pass_s"] / 1e9, 2)
        out[name] = row
    ref = np.load(tmp / "y_0.npy")
    for k in (2, 3, -1, "accelerate"):
        f = tmp / f"y_{k}.npy"
        if f.exists():
            out[f"max_abs_diff_{k}_vs_resident"] = float(np.abs(np.load(f) - ref).max())
    out["output_scale"] = float(np.abs(ref).max())
    if "accelerate" in out and "pass_s" in out["accelerate"] and "pass_s" in out.get("streamed_k2", {}):
        out["slimml_k2_vs_accelerate_speedup"] = round(out["accelerate"]["pass_s"] / out["streamed_k2"]["pass_s"], 2)
    if "pass_s" in out.get("accelerate_4rows", {}) and "pass_s" in out.get("streamed_k2_4rows", {}):
        out["slimml_k2_vs_accelerate_speedup_4rows"] = round(
            out["accelerate_4rows"]["pass_s"] / out["streamed_k2_4rows"]["pass_s"], 2)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _vram_used() -> int:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
        return int(r.stdout.split()[0]) << 20
    except (OSError, IndexError, ValueError):
        return 0


if __name__ == "__main__":
    main()
