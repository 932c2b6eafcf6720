"""slimml convert on a GGUF of each decoder architecture llama.cpp writes and slimml meets: does it read, and generate as the model?

For each architecture, as a user with a llama.cpp file would meet it:
- a tiny random Hugging Face model (2 layers, hidden 64) saved with SmolLM2's tokenizer;
- llama.cpp's own ``convert_hf_to_gguf.py --outtype f32`` on that folder (from llama-cpp-python's
  source distribution, as ``bench_llm_quality.py`` gets it), its vocabulary step skipped and SmolLM2's
  ``tokenizer.*`` fields copied in after (the converter knows a tokenizer by the hash of its output,
  and a tiny model's saved tokenizer has no hash it knows); ``gpt_oss_mx``: gpt-oss with its experts in
  MXFP4 as OpenAI ships them, which the converter keeps as GGML MXFP4;
- ``slimml convert FILE -o ART`` in its own process (exit code, exporter, the report's check);
- greedy tokens of the artifact (``generate``, 16 new tokens after a 12-token prompt) against the
  Hugging Face model's own ``generate(do_sample=False)``: against the model, not the model as
  transformers reads the file back, so a reader that misreads the file is caught.

Run (minutes; needs the test extra and llama-cpp-python installed):
    python benchmarks/sweep_gguf_archs.py                      # every architecture
    python benchmarks/sweep_gguf_archs.py --archs qwen2moe gpt_oss_mx
Writes benchmarks/results/gguf_archs_<transformers version>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_llm_quality import llama_cpp_src, smollm2_gguf  # noqa: E402
from sweep_gguf_types import with_tokenizer_of  # noqa: E402

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)
ARCHS = {  # name -> (config class, its sizes); the vocabulary is SmolLM2's
    "llama": ("LlamaConfig", dict(SHAPE, intermediate_size=128, num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(SHAPE, intermediate_size=128, num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(SHAPE, intermediate_size=128, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(SHAPE, intermediate_size=128, num_key_value_heads=2, head_dim=16)),
    "qwen2moe": ("Qwen2MoeConfig", dict(SHAPE, intermediate_size=128, num_key_value_heads=2, num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)),
    "qwen3moe": ("Qwen3MoeConfig", dict(SHAPE, intermediate_size=128, num_key_value_heads=2, head_dim=16, num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    "stablelm": ("StableLmConfig", dict(SHAPE, intermediate_size=128, num_key_value_heads=4)),
    "starcoder2": ("Starcoder2Config", dict(SHAPE, intermediate_size=128, num_key_value_heads=2)),
    "nemotron": ("NemotronConfig", dict(SHAPE, intermediate_size=128, num_key_value_heads=2, head_dim=16)),
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, n_ctx=256)),
    "falcon40b": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       new_decoder_architecture=True, num_kv_heads=2)),
    "lfm2": ("Lfm2Config", dict(SHAPE, intermediate_size=128, num_hidden_layers=4, num_key_value_heads=2,
                                layer_types=["conv", "full_attention", "conv", "full_attention"])),
    "gpt_oss": ("GptOssConfig", dict(SHAPE, intermediate_size=64, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=4096, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "gpt_oss_mx": None,  # gpt_oss, experts as MXFP4
}
PROMPT, NEW = 12, 16


def make(name: str, out: Path) -> None:
    """The tiny random model ``name`` saved in ``out`` with SmolLM2's tokenizer (fast only)."""
    import torch
    import transformers

    gguf = smollm2_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cls, kw = ARCHS["gpt_oss" if name == "gpt_oss_mx" else name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(vocab_size=len(tok), initializer_range=0.2, **kw)
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    sys.path.insert(0, str(HERE.parent / "tests"))
    from test_decoder_archs import _as_mxfp4, _lively_gpt_oss

    if name.startswith("gpt_oss"):  # biases and sinks that matter, gate values past the SwiGLU clamp
        _lively_gpt_oss(model)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "tokenizer.model").unlink(missing_ok=True)  # the GGUF itself, saved as the slow tokenizer's file
    if name == "gpt_oss_mx":
        _as_mxfp4(out)


def to_gguf(src: Path, folder: Path, out: Path) -> str | None:
    """llama.cpp's converter on ``folder`` without its vocabulary step, then SmolLM2's tokenizer fields; the error or None."""
    r = subprocess.run([sys.executable, __file__, "--llama-convert", str(src), str(folder), "--outtype", "f32",
                        "--outfile", str(out)], capture_output=True, text=True)
    if r.returncode:
        return (r.stderr.strip().splitlines() or ["?"])[-1][:200]
    with_tokenizer_of(out.with_suffix(".tmp.gguf"), out, smollm2_gguf())
    return None


def _llama_convert(src: Path, args: list[str]) -> None:
    """``convert_hf_to_gguf.py ARGS`` with every ``_set_vocab_*`` a no-op (run in its own process)."""
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    import conversion.base as base

    for cls in [c for c in vars(base).values() if isinstance(c, type)]:
        for name in ("_set_vocab_gpt2", "_set_vocab_sentencepiece", "_set_vocab_llama_hf", "_set_vocab_qwen",
                     "_set_vocab_builtin"):
            if name in vars(cls):
                setattr(cls, name, lambda self, *a, **k: None)
    sys.argv = ["convert_hf_to_gguf.py", *args]
    runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")


def check(folder: Path, gguf: Path, art: Path) -> dict:
    """``slimml convert`` of the file, then its greedy tokens against the Hugging Face model's."""
    import numpy as np
    import torch
    import transformers

    shutil.rmtree(art, ignore_errors=True)
    r = subprocess.run([str(Path(sys.executable).with_name("slimml")), "convert", str(gguf), "-o", str(art)], capture_output=True, text=True)
    if r.returncode:
        return {"converts": False, "error": (r.stderr.strip() or r.stdout.strip()).splitlines()[-1][:400]}
    manifest = json.loads((art / "manifest.json").read_text())
    export = next(s for s in manifest["steps"] if s["step"] == "export")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).float().eval()
    model.generation_config.eos_token_id = None
    ids = np.random.default_rng(0).integers(3, 40000, size=(1, PROMPT))
    with torch.no_grad():
        want = model.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, PROMPT:].tolist()
    from slimml.runtime.loader import load

    art_model = load(art)
    try:
        got = art_model.generate(ids.tolist(), max_new_tokens=NEW, eos_token_id=()).tokens[0]
    finally:
        art_model.close()
    return {"converts": True, "exporter": export.get("exporter"), "source_quantization": manifest["source"].get("gguf", {}).get("gguf_file_type"),
            "greedy_equal_to_hf": got == want, "tokens_equal": sum(a == b for a, b in zip(got, want)), "of": NEW}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--llama-convert":
        return _llama_convert(Path(sys.argv[2]), sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", nargs="*", default=list(ARCHS))
    ap.add_argument("--work", type=Path, default=Path("/tmp/slimml-gguf-archs"))
    ap.add_argument("--llama-cpp-src", type=Path, default=None)
    args = ap.parse_args()
    import transformers

    src = llama_cpp_src(args.work, args.llama_cpp_src)
    results = {}
    for name in args.archs:
        folder, gguf = args.work / "hf" / name, args.work / "gguf" / f"{name}.gguf"
        gguf.parent.mkdir(parents=True, exist_ok=True)
        if not (folder / "config.json").is_file():
            make(name, folder)
        error = None if gguf.is_file() else to_gguf(src, folder, gguf)
        results[name] = {"converts": False, "error": f"llama.cpp's converter: {error}"} if error else check(
            folder, gguf, args.work / "art" / name)
        print(name, json.dumps(results[name]), flush=True)
    out = HERE / "results" / f"gguf_archs_{transformers.__version__}.json"
    earlier = json.loads(out.read_text())["archs"] if out.is_file() else {}  # --archs: the others' rows stay
    out.write_text(json.dumps({"transformers": transformers.__version__, "archs": {**earlier, **results}}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
