"""A real corpus through each system's own encode: sentences per second and STSb dev score.

    python benchmarks/bench_corpus.py --fp32 ARTIFACT --int8 ARTIFACT [--student ARTIFACT] [--rounds 3] [--work DIR]

The 3,000 STSb dev sentences (variable lengths), batch 32, each system as its users run it:
  * ``st torch fp32``: ``SentenceTransformer(folder).encode(texts, batch_size=32)``;
  * ``st onnx fp32``: the same with ``backend="onnx"`` (its own export through Optimum);
  * ``st onnx int8``: ``export_dynamic_quantized_onnx_model(model, CONFIG, folder)``, then
    ``backend="onnx"`` with that file, CONFIG being the best this CPU has (``avx512_vnni``,
    ``avx512`` or ``avx2``), as sentence-transformers' docs advise;
  * ``fastembed``: ``TextEmbedding(..., specific_model_path=folder)`` over the fp32 ONNX export, if
    fastembed is installed (``pip install fastembed``);
  * ``slimml fp32``/``int8``/``student``: ``slimml.runtime.load(artifact).encode(texts, batch_size=32)``.
Each round encodes the whole corpus with every system, in an order reversed every other round;
the median round gives sentences/s. The STS score is Spearman x100 of each system's own embeddings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

STSB = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb"


def cpu_config() -> str:
    """The quantization config sentence-transformers' docs match to a CPU: the best it has."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    return "avx512" if "avx512f" in flags else "avx2"


def systems(args, work: Path) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

    from slimml.convert.sources import default_model_dir
    from slimml.runtime import load

    torch.set_num_threads(os.cpu_count() or 1)
    folder = work / "st-model"
    if not folder.is_dir():
        shutil.copytree(default_model_dir(), folder)
    out = {"st torch fp32": SentenceTransformer(str(folder), device="cpu")}
    onnx_fp32 = SentenceTransformer(str(folder), device="cpu", backend="onnx")
    if not (folder / "onnx" / "model.onnx").is_file():
        onnx_fp32.save_pretrained(str(folder))  # keep its export for the int8 step and fastembed
        shutil.copy(default_model_dir() / "config.json", folder / "config.json")  # as shipped (with model_type)
    out["st onnx fp32"] = onnx_fp32
    config = cpu_config()
    int8 = sorted((folder / "onnx").glob(f"model_*int8_{config}.onnx"))
    if not int8:
        export_dynamic_quantized_onnx_model(onnx_fp32, config, str(folder))
        int8 = sorted((folder / "onnx").glob(f"model_*int8_{config}.onnx"))
    print(f"st onnx int8: {int8[0].name} (quantization config {config!r} for this CPU)")
    out["st onnx int8"] = SentenceTransformer(str(folder), device="cpu", backend="onnx",
                                              model_kwargs={"file_name": f"onnx/{int8[0].name}"})
    st = {name: (lambda m: lambda texts: m.encode(texts, batch_size=32, convert_to_numpy=True))(m) for name, m in out.items()}
    try:
        from fastembed import TextEmbedding

        fe_dir = work / "fastembed-model"
        if not fe_dir.is_dir():
            shutil.copytree(folder, fe_dir)
            shutil.copy(folder / "onnx" / "model.onnx", fe_dir / "model.onnx")
        fe = TextEmbedding(model_name="sentence-transformers/all-MiniLM-L6-v2", specific_model_path=str(fe_dir))
        st["fastembed fp32"] = lambda texts: np.array(list(fe.embed(texts, batch_size=32)))
    except ImportError:
        print("fastembed is not installed: skipped (pip install fastembed)")
    for name, path in (("slimml fp32", args.fp32), ("slimml int8", args.int8), ("slimml student", args.student)):
        if path is not None:
            st[name] = (lambda m: lambda texts: m.encode(texts, batch_size=32))(load(path))
    return st


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp32", type=Path, required=True)
    ap.add_argument("--int8", type=Path, required=True)
    ap.add_argument("--student", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from slimml.runtime.tools.evaluate import read_sts, spearman

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-corpus-"))
    work.mkdir(parents=True, exist_ok=True)
    s1, s2, gold = read_sts(STSB / "sts-dev.csv")
    texts = list(s1) + list(s2)
    enc = systems(args, work)
    for fn in enc.values():
        fn(texts[:64])  # warm-up
    times = {k: [] for k in enc}
    scores = {}
    for r in range(args.rounds):
        for name in list(enc) if r % 2 == 0 else list(enc)[::-1]:
            t0 = time.perf_counter()
            e = np.asarray(enc[name](texts), dtype=np.float32)
            times[name].append(time.perf_counter() - t0)
            if name not in scores:
                e = e / np.linalg.norm(e, axis=1, keepdims=True)
                scores[name] = 100.0 * spearman((e[: len(s1)] * e[len(s1):]).sum(1), gold)
        print(f"round {r + 1} done", flush=True)
    res = {}
    ref = len(texts) / statistics.median(times["st onnx int8"])
    print(f"{len(texts)} STSb dev sentences, batch 32, {args.rounds} rounds (median)")
    for name in enc:
        sps = len(texts) / statistics.median(times[name])
        res[name] = {"sentences_per_s": round(sps, 1), "vs_st_onnx_int8": round(sps / ref, 2), "stsb_dev": round(scores[name], 2)}
        print(f"  {name:16s} {sps:8.1f} sentences/s  {sps / ref:5.2f}x st onnx int8   STSb dev {scores[name]:.2f}")
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
