"""A mixture of experts with real weights, from a dense Llama: each layer's MLP copied into E experts.

No real mixture-of-experts checkpoint ships offline here, and random weights say nothing of how
its experts quantize. "Sparse upcycling" gives one that does: a Mixtral whose E experts in each
layer are all the dense model's MLP, top-2 routing, a random router. The chosen experts' weights are
renormalized to sum 1 and the experts are equal, so the model computes exactly the dense function
(its perplexity is the dense model's); its experts carry the dense model's real weights, so the
way a quantizer rounds them shows in perplexity as it would in a trained mixture.

Run:
    python benchmarks/make_upcycled_moe.py /tmp/offgrid/smol_rot /tmp/moe/rot_moe 4    # make_offgrid_llama.py's
    python benchmarks/bench_llm_quality.py --model /tmp/moe/rot_moe                     # docs/quantize.md
    python benchmarks/make_upcycled_moe.py SMOL_FP32 /tmp/moe/mx_moe 4 --mxfp4           # experts as MXFP4 values

``--mxfp4`` rounds the experts to MXFP4 (OCP MX: blocks of 32 along the input, one power of two a
block, ``floor(log2(max)) - 2``, each value to the nearest e2m1 level, clipped at 6), stored as
float32: a mixture whose experts sit on gpt-oss's grid, to measure what slimml's 4 and 8 bits keep of one.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

ROLES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # Mixtral's names for an expert's gate, up, down


FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)  # e2m1's magnitudes


def mxfp4(w: np.ndarray) -> np.ndarray:
    """``w`` (out, in) rounded to MXFP4 in blocks of 32 along ``in``, as float32."""
    b = w.astype(np.float32).reshape(w.shape[0], -1, 32)
    scale = np.exp2(np.floor(np.log2(np.maximum(np.abs(b).max(-1, keepdims=True), 1e-30))) - 2)
    level = FP4[np.abs(np.abs(b)[..., None] / scale[..., None] - FP4).argmin(-1)]
    return (np.sign(b) * level * scale).reshape(w.shape).astype(np.float32)


def upcycle(src: Path, dst: Path, experts: int, seed: int = 0, as_mxfp4: bool = False) -> None:
    """Write ``dst``: the Llama folder ``src`` (one ``model.safetensors``) as a Mixtral of ``experts`` equal experts."""
    from safetensors.numpy import load_file, save_file

    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst)
    config = json.loads((src / "config.json").read_text())
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                  num_experts_per_tok=2, sliding_window=None, router_aux_loss_coef=0.0, output_router_logits=False)
    for key in ("mlp_bias", "attention_bias", "pretraining_tp", "head_dim"):
        config.pop(key, None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if ".mlp." not in name:
            tensors[name] = w
            continue
        layer, role = name.split(".mlp.")
        role = role.split(".")[0]
        w = mxfp4(w) if as_mxfp4 else w
        for e in range(experts):
            tensors[f"{layer}.block_sparse_moe.experts.{e}.{ROLES[role]}.weight"] = w.copy()
        if role == "gate_proj":  # any router: the experts are equal
            tensors[f"{layer}.block_sparse_moe.gate.weight"] = (rng.standard_normal((experts, w.shape[1])) * 0.02).astype(w.dtype)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", type=Path, help="a Llama folder with one model.safetensors")
    ap.add_argument("out", type=Path)
    ap.add_argument("experts", type=int, nargs="?", default=4)
    ap.add_argument("--mxfp4", action="store_true", help="experts rounded to MXFP4 (gpt-oss's grid)")
    args = ap.parse_args()
    upcycle(args.source, args.out, args.experts, as_mxfp4=args.mxfp4)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
