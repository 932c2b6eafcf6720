"""How many of a decoder's layers keep their sensitive matrices at 8 bits: as many as fit in the size of
llama.cpp's Q4_K_M file of the same model.

Q4_K_M stores most matrices as Q4_K (4.5 bits a weight) and, in the layers ``use_more_bits`` picks,
V and FFN down as Q6_K (6.5625), the output as Q6_K; a matrix whose rows are not a multiple of 256
falls back to Q5_0 (5.5) and Q8_0 (8.5) (SmolLM2's 576-wide rows: most of it is 5-bit). The fitted
recipe spends that budget its own way: 4-bit blocks everywhere (4 + 20 / block bits: a float16
scale and a 4-bit zero point), then the FFN down, attention output and V projections of one layer
after another at 8 bits (the more-bits layers first) while the whole stays within the budget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from slimml.quantize.grids import LM_HEAD_MIN_COLUMNS, SENSITIVE, block_for, layer_of, more_bits_layers

Q4_K, Q5_0, Q6_K, Q8_0 = 4.5, 5.5, 6.5625, 8.5  # llama.cpp's bits a weight, scales included
_MORE_BITS = re.compile(r"down|(^|[^a-z])v_proj")  # what Q4_K_M gives Q6_K in its more-bits layers


@dataclass
class Plan:
    sensitive_layers: tuple[int, ...]
    embedding_bits: int
    budget_mb: float  # Q4_K_M's weights (its file: these and its metadata)
    planned_mb: float  # ours: the weights and tokenizer.json


def _matrices(folder: Path, manifest: Any) -> tuple[list[tuple[str, int, int, int | None]], bool, int]:
    """``(name, K, N, layer)`` of every weight MatMul, the embedding as ``("embedding", hidden, vocab, None)``;
    whether the embedding and the output projection hold the same values (tied); the bytes of every
    other initializer (norms, rotary caches: they stay as they are)."""
    rows, table, head, other = [], None, None, 0
    for spec in manifest.shards:
        model = onnx.load(str(folder / spec.file), load_external_data=False)
        inits = {t.name: t for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "MatMul" and node.input[1] in inits and len(inits[node.input[1]].dims) == 2:
                k, n = inits[node.input[1]].dims
                rows.append((node.name, k, n, layer_of(node.name)))
                if n >= LM_HEAD_MIN_COLUMNS:
                    head = inits[node.input[1]]
            elif node.op_type == "Gather" and node.input[0] in inits and len(inits[node.input[0]].dims) == 2:
                vocab, hidden = inits[node.input[0]].dims
                rows.append(("embedding", hidden, vocab, None))
                table = inits[node.input[0]]
        weights = {n.input[1] for n in model.graph.node if n.op_type == "MatMul"} | {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
        other += sum(int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                     for t in inits.values() if t.name not in weights)
    tied = table is not None and head is not None and np.array_equal(weight_array(folder, table), weight_array(folder, head).T)
    return rows, tied, other


def weight_array(folder: Path, t: onnx.TensorProto) -> np.ndarray:
    """A weight whose graph is already read, its data from the artifact's files."""
    onnx.external_data_helper.load_external_data_for_tensor(t, str(folder))
    return numpy_helper.to_array(t)


def q4_k_m_plan(folder: Path, manifest: Any, block: int = 128) -> Plan:
    """The layers (in ``use_more_bits`` order, then the rest) whose FFN down, O and V fit at 8 bits
    within Q4_K_M's size; an untied embedding is stored 4-bit, a tied one 8-bit once (with the output)."""
    n_layers = int(manifest.source.get("num_hidden_layers") or 0)
    rows, tied, other = _matrices(folder, manifest)
    more = set(more_bits_layers(n_layers))
    budget = 0.0
    tokenizer = folder / manifest.tokenizer["file"] if manifest.tokenizer else None
    ours = 8.0 * other + (8.0 * tokenizer.stat().st_size if tokenizer is not None and tokenizer.is_file() else 0.0)  # GGUF holds its vocabulary too
    extra: dict[int, float] = {}
    for name, k, n, layer in rows:
        whole = k % 256 == 0
        head = n >= LM_HEAD_MIN_COLUMNS and name != "embedding"
        if name == "embedding":
            budget += 0 if tied else k * n * (Q4_K if whole else Q5_0)
            ours += 0 if tied else k * n * (4 + 20 / block_for(k, block))  # tied: the output's 8-bit table, below
        elif head:
            budget += k * n * (Q6_K if whole else Q8_0)
            ours += k * n * (8 + 16 / block_for(k, block))
        else:
            up = layer in more and _MORE_BITS.search(name)
            budget += k * n * ((Q6_K if whole else Q8_0) if up else (Q4_K if whole else Q5_0))
            four = k * n * (4 + 20 / block_for(k, block))
            ours += four
            if layer is not None and SENSITIVE.search(name):
                extra[layer] = extra.get(layer, 0.0) + k * n * (8 + 16 / block_for(k, block)) - four
    chosen = []
    for layer in [*sorted(more), *[i for i in range(n_layers) if i not in more]]:
        if layer in extra and ours + extra[layer] <= budget:
            ours += extra[layer]
            chosen.append(layer)
    return Plan(tuple(sorted(chosen)), 8 if tied else 4, round(budget / 8e6, 2), round(ours / 8e6, 2))
