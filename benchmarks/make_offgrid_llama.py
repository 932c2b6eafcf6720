"""An exactly equivalent copy of a Llama whose weights sit on no quantization grid.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF: its weights lie on Q4_1's grid (32-value blocks, a
scale and a minimum each), so a 4-bit quantizer that matches that grid loses nothing and says little
about weights in general. This script rewrites such a model into one that computes the same function
(up to float rounding) with weights off any grid and with the uneven input-channel ranges of real
models:

- each RMSNorm's weight ``g`` is folded into the linears that read it (the norm's weight becomes 1);
- a random orthogonal ``Q`` (QR of a seeded Gaussian) rotates the residual stream: with torch's
  ``y = x W^T``, the embedding becomes ``E Q``, a linear reading the residual ``W diag(g) Q``, a
  linear writing into it ``Q^T W`` (its bias ``b Q``), and the (untied) ``lm_head`` ``W diag(g) Q``;
  RMSNorm commutes with ``Q`` since ``|x Q| = |x|``;
- the MLP's intermediate channels are scaled by ``s = exp(N(0, sigma))``: ``up_proj`` rows times
  ``s``, ``down_proj`` columns divided by ``s`` (``silu(gate) * up`` is linear in ``up``);
- the value channels likewise: ``v_proj`` rows times ``s``, ``o_proj`` columns divided by the ``s``
  of the kv channel each query head reads (one factor per kv channel, shared under GQA).

Run:
    python benchmarks/make_offgrid_llama.py SmolLM2-135M-Instruct.Q4_1.gguf /tmp/offgrid/smol_rot \\
        --seed 0 --plain /tmp/offgrid/smol_fp32 --check gensim/test/test_data/lee_background.cor

SRC is a Hugging Face folder or a ``.gguf`` file (transformers dequantizes it to fp32). ``--plain``
also saves the untouched fp32 model; ``--check TEXT`` scores both on the text's first 2048 tokens
(windows of 512) in transformers and fails unless their perplexities agree within 1e-4.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load(src: Path):
    """The model (fp32) and its tokenizer from a folder or a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": src.name} if src.suffix == ".gguf" else {}
    folder = str(src.parent if kw else src)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True, **kw).eval()
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kw)
    return model, tok


def random_orthogonal(n: int, gen) -> "torch.Tensor":
    """A Haar-random orthogonal ``(n, n)`` matrix in float64."""
    import torch

    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r))[None, :]


def rotate(model, seed: int = 0, sigma: float = 0.5) -> None:
    """Rewrite ``model`` (a Llama-family ``*ForCausalLM``) in place as described in the module docstring."""
    import torch

    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    d = cfg.hidden_size
    q = random_orthogonal(d, gen)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or d // heads

    def w64(lin):
        return lin.weight.data.to(torch.float64)

    def put(lin, w):
        lin.weight = torch.nn.Parameter(w.to(torch.float32).contiguous())

    def reads(lin, g):  # W' = W diag(g) Q
        put(lin, w64(lin) * g[None, :] @ q)

    def writes(lin):  # W' = Q^T W, b' = b Q
        put(lin, q.T @ w64(lin))
        if lin.bias is not None:
            lin.bias = torch.nn.Parameter((lin.bias.data.to(torch.float64) @ q).float())

    emb = model.get_input_embeddings()
    lm_head = model.get_output_embeddings()
    head_w = w64(lm_head).clone()  # before untying: it may be the embedding itself
    emb.weight = torch.nn.Parameter((emb.weight.data.to(torch.float64) @ q).float())
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        g1 = layer.input_layernorm.weight.data.to(torch.float64)
        g2 = layer.post_attention_layernorm.weight.data.to(torch.float64)
        for lin in (att.q_proj, att.k_proj, att.v_proj):
            reads(lin, g1)
        for lin in (mlp.gate_proj, mlp.up_proj):
            reads(lin, g2)
        writes(att.o_proj)
        writes(mlp.down_proj)
        layer.input_layernorm.weight.data.fill_(1.0)
        layer.post_attention_layernorm.weight.data.fill_(1.0)
        # MLP intermediate channels: up rows * s, down columns / s
        s = torch.exp(sigma * torch.randn(mlp.up_proj.out_features, generator=gen, dtype=torch.float64))
        _scale_rows(mlp.up_proj, s)
        put(mlp.down_proj, w64(mlp.down_proj) / s[None, :])
        # value channels: one factor per kv channel, shared by the query heads of its group
        sv = torch.exp(sigma * torch.randn(kv * head_dim, generator=gen, dtype=torch.float64))
        _scale_rows(att.v_proj, sv)
        per_q = sv.view(kv, 1, head_dim).expand(kv, heads // kv, head_dim).reshape(heads * head_dim)
        put(att.o_proj, w64(att.o_proj) / per_q[None, :])
    gf = model.model.norm.weight.data.to(torch.float64)
    new_head = torch.nn.Linear(d, head_w.shape[0], bias=False)
    new_head.weight = torch.nn.Parameter((head_w * gf[None, :] @ q).float())
    model.model.norm.weight.data.fill_(1.0)
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(new_head)


def _scale_rows(lin, s) -> None:
    import torch

    lin.weight = torch.nn.Parameter((lin.weight.data.to(torch.float64) * s[:, None]).float())
    if lin.bias is not None:
        lin.bias = torch.nn.Parameter((lin.bias.data.to(torch.float64) * s).float())


def save(model, tok, out: Path) -> None:
    """An fp32 safetensors folder with the tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.torch_dtype = "float32"
    model.save_pretrained(str(out), safe_serialization=True)
    # the fast tokenizer only: a GGUF's slow (sentencepiece) tokenizer would save the GGUF file itself as
    # tokenizer.model, which llama.cpp's convert_hf_to_gguf.py then fails to parse
    tok.save_pretrained(str(out), legacy_format=False)
    (out / "tokenizer.model").unlink(missing_ok=True)


def perplexity(folder: Path, text_file: Path, window: int = 512, budget: int = 2048) -> float:
    """transformers' fp32 perplexity of the model in ``folder`` on the text's first ``budget`` tokens."""
    import numpy as np

    from slimml.convert.llm_check import token_windows, torch_scores

    windows = token_windows(folder / "tokenizer.json", text_file.read_text(encoding="utf-8"), window, budget)
    return float(np.exp(torch_scores(folder, windows)[0].mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", type=Path, help="a Llama-family HF folder or .gguf file")
    ap.add_argument("out", type=Path, help="where the rotated fp32 folder goes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sigma", type=float, default=0.5, help="log-std of the channel scale factors")
    ap.add_argument("--plain", type=Path, default=None, help="also save the untouched fp32 model here")
    ap.add_argument("--check", type=Path, default=None, help="a text file: compare both perplexities in transformers")
    args = ap.parse_args()

    model, tok = load(args.src)
    plain = args.plain
    if plain is None and args.check is not None:
        plain = args.out.with_name(args.out.name + "_plain")
    if plain is not None:
        save(model, tok, plain)
    rotate(model, args.seed, args.sigma)
    save(model, tok, args.out)
    print(f"wrote {args.out}" + (f" and {plain}" if plain else ""))
    if args.check is not None:
        a, b = perplexity(plain, args.check), perplexity(args.out, args.check)
        rel = b / a - 1.0
        print(json.dumps({"perplexity_plain": round(a, 5), "perplexity_rotated": round(b, 5), "rel_diff": rel}))
        if abs(rel) > 1e-4:
            raise SystemExit(f"the rotated model's perplexity differs by {rel:.2e} (> 1e-4): the rewrite is wrong")


if __name__ == "__main__":
    main()
