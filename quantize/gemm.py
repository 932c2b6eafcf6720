"""``Gemm`` with a constant weight, rewritten as ``MatMul`` (+ ``Add``) so that the quantizers take it.

GPT-2's layers (its ``Conv1D``) export as ``Gemm``. ONNX Runtime's dynamic int8 quantizer and its
4-bit ``MatMulNBits`` quantizer take ``MatMul`` (and ``Gather``), not ``Gemm``: every such weight
stayed float, and a GPT-2's layer shards were reported as having "nothing to quantize". It is done
for language models only: an encoder's Gemms are a classifier's pooler and output (``nn.Linear`` on
a 2-d input), small, and the most sensitive (a tiny cross-encoder's ranking agreement fell from
over 0.9 to 0.23 with its pooler in int8), so they stay float as before. The rewrite is exact: ``Gemm(A, B, C)`` with
``alpha = beta = 1`` and ``transA = 0`` is ``A @ B + C`` (``B`` transposed once, in the graph's
copy, where ``transB = 1``).
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper


def gemms_as_matmuls(model: onnx.ModelProto) -> int:
    """Rewrite, in place, each ``Gemm`` of ``model``'s main graph whose ``B`` is a 2-d float weight as
    ``MatMul`` followed by ``Add`` of its bias (when it has one). Returns how many were rewritten.

    A ``Gemm`` with ``alpha`` or ``beta`` other than 1, or ``transA`` set, stays as it is. A weight
    read transposed by several Gemms is transposed once; the original is dropped once nothing reads it.
    """
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    taken = _names(graph) | {t.name for t in graph.initializer} | {i.name for i in graph.input}
    transposed: dict[str, str] = {}  # weight -> its transposed copy
    nodes: list[onnx.NodeProto] = []
    done = 0
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weight = inits.get(node.input[1]) if node.op_type == "Gemm" and len(node.input) > 1 else None
        if (weight is None or len(weight.dims) != 2 or weight.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0 or attrs.get("transA", 0)):
            nodes.append(node)
            continue
        b = weight.name
        if attrs.get("transB", 0):
            if b not in transposed:
                transposed[b] = _fresh(f"{b}_transposed", taken)
                graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(weight).T.copy(), transposed[b]))
            b = transposed[b]
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        name = node.name or f"gemm_{done}"
        product = _fresh(f"{node.output[0]}_matmul", taken) if bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], b], [product], name=f"{name}_MatMul"))
        if bias:
            nodes.append(helper.make_node("Add", [product, bias], [node.output[0]], name=f"{name}_Add"))
        done += 1
    if done:
        del graph.node[:]
        graph.node.extend(nodes)
        read = _read(graph) | {o.name for o in graph.output}
        kept = [t for t in graph.initializer if t.name not in transposed or t.name in read]
        if len(kept) < len(graph.initializer):  # a weight now read only transposed: its original goes
            del graph.initializer[:]
            graph.initializer.extend(kept)
    return done


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                                                 list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else [])]


def _read(graph: onnx.GraphProto) -> set[str]:
    """Every name a node of ``graph`` or of its subgraphs (an If's branches, a Loop's body) reads."""
    out = set()
    for node in graph.node:
        out.update(node.input)
        for g in _subgraphs(node):
            out |= _read(g)
    return out


def _names(graph: onnx.GraphProto) -> set[str]:
    """Every name a node of ``graph`` or of its subgraphs makes."""
    out = set()
    for node in graph.node:
        out.update(node.output)
        for g in _subgraphs(node):
            out |= _names(g) | {t.name for t in g.initializer}
    return out


def _fresh(name: str, taken: set[str]) -> str:
    """``name``, or ``name_1``, ``name_2``, ... : the first not ``taken`` (then taken)."""
    candidate, i = name, 0
    while candidate in taken:
        i += 1
        candidate = f"{name}_{i}"
    taken.add(candidate)
    return candidate
