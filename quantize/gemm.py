"""``Gemm`` with a constant weight, rewritten as ``MatMul`` (+ ``Add``) so that the quantizers take it.

GPT-2's layers (its ``Conv1D``) and a classifier's pooler and head (``nn.Linear`` on a 2-d input)
export as ``Gemm``. ONNX Runtime's dynamic int8 quantizer and its 4-bit ``MatMulNBits`` quantizer
take ``MatMul`` (and ``Gather``), not ``Gemm``: every such weight stayed float, and a GPT-2's layer
shards were reported as having "nothing to quantize". The rewrite is exact: ``Gemm(A, B, C)`` with
``alpha = beta = 1`` and ``transA = 0`` is ``A @ B + C`` (``B`` transposed once, in the graph's
copy, where ``transB = 1``).
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper


def gemms_as_matmuls(model: onnx.ModelProto) -> int:
    """Rewrite, in place, each ``Gemm`` of ``model`` whose ``B`` is a 2-d float weight as
    ``MatMul`` followed by ``Add`` of its bias (when it has one). Returns how many were rewritten.

    A ``Gemm`` with ``alpha`` or ``beta`` other than 1, or ``transA`` set, stays as it is.
    """
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    taken = {o for n in graph.node for o in n.output} | {t.name for t in graph.initializer} | {i.name for i in graph.input}
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
            values = numpy_helper.to_array(weight).T.copy()
            if readers.get(b, 0) == 1:  # this Gemm's alone: transposed where it is
                weight.CopyFrom(numpy_helper.from_array(values, b))
            else:
                b = _fresh(f"{b}_transposed", taken)
                graph.initializer.append(numpy_helper.from_array(values, b))
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
    return done


def _fresh(name: str, taken: set[str]) -> str:
    """``name``, or ``name_1``, ``name_2``, ... : the first not ``taken`` (then taken)."""
    candidate, i = name, 0
    while candidate in taken:
        i += 1
        candidate = f"{name}_{i}"
    taken.add(candidate)
    return candidate
