"""How much a 4-bit GGUF source's weights lose if they are quantized again instead of kept.

For each 4-bit tensor of a GGUF file made from an fp32 Hugging Face folder, the normalised squared
error against the fp32 weights (``mean((w' - w)^2) / mean(w^2)``) of:

* the file's own weights (as gguf-py dequantizes them, as transformers reads them);
* those weights kept by slimml's ``gguf`` grid (``quantize/grids.py``, ``gguf_blocks``);
* those weights quantized again on the ``fitted`` grid in blocks of 128 (the off-grid default's grid,
  without calibration: GPTQ needs activations) and of 32;
* the fp32 weights on the fitted grid in blocks of 128 (what an fp32 source gets).

    python benchmarks/gguf_grid_error.py HF_FOLDER MODEL.Q4_K_M.gguf --tensors 4

Weights only (no perplexity): on random weights this measures the grids, not a model's quality.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="the fp32 Hugging Face folder the GGUF file was made from")
    p.add_argument("gguf", type=Path)
    p.add_argument("--tensors", type=int, default=4, help="how many 4-bit layer tensors to measure")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    from slimml.quantize.grids import dequantize as grid_dequantize
    from slimml.quantize.grids import fit_blocks, gguf_blocks

    names = {"attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}  # not attn_q / attn_k: llama.cpp permutes their rows
    fp32 = {}
    for f in sorted(args.folder.glob("*.safetensors")):
        fp32.update(load_file(str(f)))

    def nmse(a: np.ndarray, w: np.ndarray) -> float:
        return round(float(((a - w) ** 2).mean() / (w ** 2).mean()), 6)

    def fitted(x: np.ndarray, block: int) -> np.ndarray:
        n, k = x.shape
        q, s, z = fit_blocks(x.reshape(n, k // block, block))
        return grid_dequantize(q, s, z).reshape(n, k)

    rows = {}
    for t in GGUFReader(str(args.gguf)).tensors:
        if len(rows) >= args.tensors:
            break
        parts = t.name.split(".")
        if t.tensor_type.name not in ("Q4_0", "Q4_1", "Q4_K") or parts[0] != "blk" or parts[2] not in names:
            continue
        w = fp32[f"model.layers.{parts[1]}.{names[parts[2]]}.weight"].astype(np.float32)
        src = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(w.shape)
        n, k = src.shape
        q, d, m = gguf_blocks(src.reshape(n, k // 32, 32))
        kept = (d.astype(np.float32)[..., None] * q + m.astype(np.float32)[..., None]).reshape(n, k)
        rows[t.name] = {"type": t.tensor_type.name, "source": nmse(src, w), "kept (gguf grid)": nmse(kept, w),
                        "again, fitted b128": nmse(fitted(src, 128), w), "again, fitted b32": nmse(fitted(src, 32), w),
                        "fp32 on fitted b128": nmse(fitted(w, 128), w)}
        print(t.name, rows[t.name], flush=True)
    result = {"folder": str(args.folder), "gguf": str(args.gguf), "metric": "mean((w' - w)^2) / mean(w^2) against the fp32 weights",
              "tensors": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
