"""Decode and prefill tokens/s of a Llama on CPU: slimml against onnxruntime-genai and llama.cpp.

Each system runs as its users run it, in a process of its own, the systems alternated round by
round so that a busy machine slows them alike (report ratios within a round, not one absolute
figure):

- slimml: ``slimml.runtime.load(artifact, threads=T).generate(ids, max_new_tokens=N)``;
- onnxruntime-genai: ``og.Model`` + ``og.Generator`` (``append_tokens``, ``generate_next_token``);
- llama.cpp: ``llama_cpp.Llama(gguf, n_threads=T).generate(ids, top_k=1)`` (batch 1 only).

Prompts are random token ids (the weights may be random too: speed does not depend on them),
every prompt of a batch the same length; generation never stops early (no end token). Prefill
tokens/s = prompt tokens / time to the first new token; decode tokens/s = the later new tokens
(all prompts) / the time after the first.

Usage (the TinyLlama-shaped model of issue 25; see docs/llm_decode.md for building the three):
    python benchmarks/bench_llm_decode.py --slimml ART [--slimml-label NAME ART2 ...] --og OG_DIR \
        --gguf model-q4_0.gguf --threads 2 --prompt 128 --new 64 --batch 1 8 --rounds 2 \
        --out benchmarks/results/llm_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

VOCAB_LO = 3  # ids below are special (unk, bos, eos) in a Llama tokenizer
REPEATS = int(os.environ.get("BENCH_REPEATS", "2"))  # timed generations per process (the fastest kept)


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(VOCAB_LO, vocab, size=(batch, length)).tolist()


def _fastest(once) -> dict:
    """The run with the shortest decode of REPEATS timed runs."""
    return min((once() for _ in range(REPEATS)), key=lambda r: r["decode_s"])


def run_slimml(path: str, ids: list[list[int]], new: int, threads: int) -> dict:
    from slimml.runtime import load

    model = load(path, threads=threads)
    if hasattr(model, "prefix_cache"):  # each timed run prefills its whole prompt (the same prompt, run again,
        model.prefix_cache(0)            # would otherwise come from the prefix store: benchmarks/bench_prefix_cache.py)
    model.generate([p[:16] for p in ids], max_new_tokens=4, eos_token_id=())  # warm-up: sessions, arenas

    def once() -> dict:
        g = model.generate(ids, max_new_tokens=new, eos_token_id=())
        return {"prefill_s": g.prefill_s, "decode_s": g.seconds - g.prefill_s, "new": [len(t) for t in g.tokens]}

    return _fastest(once)


def run_slimml_cache(path: str, ids: list[list[int]], new: int, threads: int) -> dict:
    """The loop ``generate`` runs on the engine's in-place cache (``model.kv_cache``): prompt pass,
    then one position per row per token, greedy."""
    import numpy as np

    from slimml.runtime import load

    model = load(path, threads=threads)
    arr = np.asarray(ids, dtype=np.int64)

    def once(prompt: np.ndarray, n: int) -> dict:
        b, s = prompt.shape
        t0 = time.perf_counter()
        cache = model.kv_cache(batch=b, capacity=s + n)
        last = np.full(b, s - 1)  # logits at each row's last position only (what generate asks for)
        nxt = cache.step(prompt, np.ones((b, s), np.int64), at=last).argmax(-1)
        t1 = time.perf_counter()
        for _ in range(n - 1):
            nxt = cache.step(nxt[:, None].astype(np.int64), np.ones((b, cache.length + 1), np.int64), at=last * 0).argmax(-1)
        t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "new": [n] * b}

    once(arr[:, :16], 4)
    return _fastest(lambda: once(arr, new))


def run_og(path: str, ids: list[list[int]], new: int, threads: int) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(path)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    arr = np.asarray(ids, dtype=np.int32)

    def once(prompt: np.ndarray, n: int) -> dict:
        params = og.GeneratorParams(model)
        length = prompt.shape[1] + n
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=prompt.shape[0])
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(prompt)  # the prompt's pass
        gen.generate_next_token()  # picks the first new token from its logits
        t1 = time.perf_counter()
        count = 1
        while not gen.is_done() and count < n:
            gen.generate_next_token()
            count += 1
        t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "new": [count] * prompt.shape[0]}

    once(arr[:, :16], 4)
    return _fastest(lambda: once(arr, new))


def run_llamacpp(path: str, ids: list[list[int]], new: int, threads: int) -> dict:
    from llama_cpp import Llama

    if len(ids) != 1:
        raise SystemExit("llama.cpp runs batch 1 here (llama-cpp-python's generate takes one sequence)")
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=len(ids[0]) + new + 8,
                n_batch=512, verbose=False)

    def once(prompt: list[int], n: int) -> dict:
        llm.reset()
        t0 = time.perf_counter()
        t1 = None
        count = 0
        for _tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            count += 1
            if t1 is None:
                t1 = time.perf_counter()
            if count >= n:
                break
        t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "new": [count]}

    once(ids[0][:16], 4)
    return _fastest(lambda: once(ids[0], new))


def make_gguf(folder: str, out: str, ftype: str = "Q4_0", threads: int = 2) -> str:
    """A Llama or Mixtral folder (safetensors) as a llama.cpp GGUF of ``ftype`` (``Q4_0``, ``Q8_0``, ``Q4_K_M``).

    The weights go to an F16 GGUF with the ``gguf`` package (tensor names and the q/k row order of
    llama.cpp's ``convert_hf_to_gguf.py``; Mixtral as llama.cpp writes it: a ``llama`` whose experts
    are stacked ``ffn_{gate,up,down}_exps`` and whose router is ``ffn_gate_inp``; a placeholder
    vocabulary of the model's size, which speed does not depend on), then
    ``llama_cpp.llama_model_quantize`` makes ``ftype``.
    """
    import ctypes

    import gguf
    import llama_cpp
    import numpy as np
    from safetensors import safe_open

    c = json.loads((Path(folder) / "config.json").read_text())
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    f16 = str(Path(out).with_suffix(".f16.gguf"))
    w = gguf.GGUFWriter(f16, "llama")
    w.add_context_length(c.get("max_position_embeddings", 2048))
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(float(c.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    w.add_rope_dimension_count(c["hidden_size"] // heads)
    experts = int(c.get("num_local_experts") or 0)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(int(c["num_experts_per_tok"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    vocab = c["vocab_size"]
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def permute(x: np.ndarray, n: int) -> np.ndarray:  # HF's rotary halves -> llama.cpp's interleaved rows
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "block_sparse_moe.gate": "ffn_gate_inp"}
    stacked: dict[str, list] = {}  # Mixtral's experts, one tensor each: stacked per layer and role
    roles = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                x = f.get_tensor(name).float().numpy()
                if ".block_sparse_moe.experts." in name:  # model.layers.I.block_sparse_moe.experts.E.wN.weight
                    part = name.split(".")
                    stacked.setdefault(f"blk.{part[2]}.{roles[part[6]]}.weight", [None] * experts)[int(part[5])] = x
                    continue
                if name in names:
                    new = names[name]
                else:
                    _, _, i, rest = name.split(".", 3)
                    new = f"blk.{i}.{parts[rest.removesuffix('.weight')]}.weight"
                    if rest.startswith("self_attn.q_proj"):
                        x = permute(x, heads)
                    elif rest.startswith("self_attn.k_proj"):
                        x = permute(x, kv)
                w.add_tensor(new, x.astype(np.float32 if x.ndim == 1 else np.float16))
    for new, parts in stacked.items():
        w.add_tensor(new, np.stack(parts).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    if llama_cpp.llama_model_quantize(f16.encode(), out.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {out}")
    Path(f16).unlink()
    return out


RUNNERS = {"slimml": run_slimml, "slimml-cache": run_slimml_cache, "og": run_og, "llamacpp": run_llamacpp}


def _worker(args) -> None:
    kind = args.worker.split(":")[0]
    ids = _prompts(args.batch[0], args.prompt, args.vocab)
    r = RUNNERS[kind](args.path, ids, args.new, args.threads)
    batch = len(ids)
    r["prefill_tps"] = batch * args.prompt / r["prefill_s"]
    later = sum(n - 1 for n in r["new"])
    r["decode_tps"] = later / r["decode_s"] if r["decode_s"] else 0.0
    print("RESULT " + json.dumps(r), flush=True)


def _systems(args) -> list[tuple[str, str, str]]:
    """(label, runner kind, path) per system to time."""
    out = []
    for label, path in args.slimml:
        out.append((label, "slimml", path))
    for label, path in args.slimml_cache:
        out.append((label, "slimml-cache", path))
    if args.og:
        out.append(("onnxruntime-genai int4", "og", args.og))
    for label, path in args.gguf:
        out.append((label, "llamacpp", path))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slimml", nargs=2, action="append", default=[], metavar=("LABEL", "ARTIFACT"))
    p.add_argument("--slimml-cache", nargs=2, action="append", default=[], metavar=("LABEL", "ARTIFACT"),
                   help="a fused artifact driven through model.kv_cache (the engine's in-place cache)")
    p.add_argument("--og", help="an onnxruntime-genai model folder (its builder's output)")
    p.add_argument("--gguf", nargs=2, action="append", default=[], metavar=("LABEL", "GGUF"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--out", default="benchmarks/results/llm_decode.json")
    p.add_argument("--make-gguf", nargs=3, metavar=("FOLDER", "OUT", "FTYPE"),
                   help="write a llama.cpp GGUF (Q4_0, Q8_0, ...) of a Llama folder and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    if args.make_gguf:
        print(make_gguf(*args.make_gguf, threads=args.threads))
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), SLIMML_THREADS=str(args.threads), HF_HUB_OFFLINE="1")
    rows = []
    for rnd in range(args.rounds):
        for batch in args.batch:
            for label, kind, path in _systems(args):
                if kind == "llamacpp" and batch != 1:
                    continue
                cmd = [sys.executable, __file__, "--worker", kind, "--path", path, "--batch", str(batch),
                       "--threads", str(args.threads), "--prompt", str(args.prompt), "--new", str(args.new),
                       "--vocab", str(args.vocab)]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                    print(f"round {rnd} batch {batch} {label}: FAILED ({err})", flush=True)
                    rows.append({"round": rnd, "batch": batch, "system": label, "error": err})
                    continue
                r = json.loads(line[len("RESULT "):])
                row = {"round": rnd, "batch": batch, "system": label, "prefill_tps": round(r["prefill_tps"], 2),
                       "decode_tps": round(r["decode_tps"], 2)}
                rows.append(row)
                print(f"round {rnd} batch {batch} {label:32s} prefill {row['prefill_tps']:8.1f} tok/s  "
                      f"decode {row['decode_tps']:7.2f} tok/s", flush=True)
    result = {"setup": {"threads": args.threads, "prompt": args.prompt, "new": args.new, "batches": args.batch,
                        "rounds": args.rounds, "machine": platform.processor() or platform.machine(),
                        "cores": os.cpu_count(), "systems": [(lbl, k, pth) for lbl, k, pth in _systems(args)]},
              "rows": rows, "ratios": _ratios(rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"], indent=2))


def _ratios(rows: list[dict]) -> dict:
    """Per round and batch, each system's prefill and decode over the best of the others' (the
    systems of one round ran back to back, so the ratio is what a busy machine leaves comparable)."""
    out: dict = {}
    ok = [r for r in rows if "error" not in r]
    for key in sorted({(r["round"], r["batch"]) for r in ok}):
        group = [r for r in ok if (r["round"], r["batch"]) == key]
        for r in group:
            if not r["system"].startswith("slimml"):
                continue
            others = [o for o in group if not o["system"].startswith("slimml")]
            for o in others:
                name = f"b{key[1]} {r['system']} / {o['system']}"
                out.setdefault(name, {"prefill": [], "decode": []})
                out[name]["prefill"].append(round(r["prefill_tps"] / o["prefill_tps"], 3))
                out[name]["decode"].append(round(r["decode_tps"] / o["decode_tps"], 3))
    return out


if __name__ == "__main__":
    main()
