"""A shard's graph with its external weights turned into graph inputs: compiled once, fed per pass.

A streamed shard must not build an InferenceSession on every pass (~50 ms per shard, and on
CUDA a copy of every weight through session construction). Instead its session is built once
over the shard's graph with every external initializer replaced by a graph input of the same
name, type and shape; each pass feeds those inputs with arrays that point into memory a slot
owns (a memory-mapped data file on CPU). Small inline initializers (shapes, axes, scales) stay
constants, so ONNX Runtime still folds what depends only on them. Weights of two values a byte
(INT4, UINT4, FLOAT4E2M1: an encoder's 4-bit embedding table) stay initializers read from their
file when the session is built: numpy cannot view them, nor ONNX Runtime's Python API feed them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import external_data_helper, helper

from slimml.errors import ArtifactError


@dataclass(frozen=True)
class WeightSpec:
    """Where one weight lives in its shard's data file."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


# element types stored two a byte: kept as initializers (see the module's docstring)
PACKED_TYPES = frozenset(getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
                         if hasattr(onnx.TensorProto, n))


def weights_as_inputs(model: onnx.ModelProto, what: str) -> tuple[bytes, list[WeightSpec], int]:
    """``model`` (loaded without external data) with its external weights as graph inputs.

    Returns:
        The serialized graph, per former initializer where its bytes are in the data file, and
        the bytes of the external weights that stayed initializers (packed types: the session must
        be told where their files are, and holds them for its life).

    Raises:
        ArtifactError: a weight's type has no numpy equivalent, or its data record is malformed.
    """
    graph = model.graph
    keep, specs, packed = [], [], 0
    for t in graph.initializer:
        external = external_data_helper.uses_external_data(t)
        info = {e.key: e.value for e in t.external_data}
        if not external or t.data_type in PACKED_TYPES:
            packed += int(info.get("length", 0)) if external else 0
            keep.append(t)
            continue
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
            offset, length = int(info.get("offset", 0)), int(info["length"])
        except (KeyError, ValueError, TypeError):
            raise ArtifactError(
                f"{what}: weight {t.name!r} (type {t.data_type}) cannot be streamed: its type or data record is not "
                "one slimml reads; load the model fully resident (resident= its shard count) or re-convert it."
            ) from None
        shape = tuple(int(d) for d in t.dims)
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != length:
            raise ArtifactError(f"{what}: weight {t.name!r} records {length} bytes for shape {shape}; re-convert it.")
        specs.append(WeightSpec(t.name, dtype, shape, offset, length))
        graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(shape)))
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return model.SerializeToString(), specs, packed


def unpacked_bytes(model: onnx.ModelProto, fed: set[str]) -> int:
    """The bytes of the largest float matrix ONNX Runtime's CPU ``MatMulNBits`` unpacks a fed
    weight into (K x N float32): a weight that is an input, not a constant, is not pre-packed at
    session creation, so each pass dequantizes it whole (a 49152 x 576 lm_head: 113 MB)."""
    largest = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and len(node.input) > 1 and node.input[1] in fed:
            dims = {a.name: a.i for a in node.attribute if a.name in ("K", "N")}
            largest = max(largest, dims.get("K", 0) * dims.get("N", 0) * 4)
    return largest


def canonical(graph_bytes: bytes) -> tuple[str, bytes, dict[str, str]] | None:
    """The graph with every value and node renamed by position, so that shards of one layer type
    (every decoder layer of a Llama) give the same bytes and can share one compiled session.

    Returns:
        (key, canonical graph bytes, the shard's names -> the canonical ones), or None for a graph
        with subgraphs (If, Loop, Scan), which may read outer names and is left as it is.
    """
    model = onnx.load_model_from_string(graph_bytes)
    graph = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        return None
    names: dict[str, str] = {}

    def rename(name: str, prefix: str) -> str:
        if name and name not in names:
            names[name] = f"{prefix}{len(names)}"
        return names.get(name, name)

    for v in graph.input:
        v.name = rename(v.name, "i")
    for t in graph.initializer:
        t.name = rename(t.name, "c")
    for node in graph.node:  # outputs first: some tools write nodes out of order (fp16 casts)
        node.output[:] = [rename(x, "v") for x in node.output]
    for k, node in enumerate(graph.node):
        node.input[:] = [names.get(x, x) for x in node.input]
        node.name = f"n{k}"
        node.doc_string = ""
    for v in list(graph.output) + list(graph.value_info):
        v.name = names.get(v.name, v.name)
    graph.name, graph.doc_string, model.doc_string = "layer", "", ""
    del model.metadata_props[:]
    data = model.SerializeToString()
    return hashlib.sha256(data).hexdigest(), data, names
