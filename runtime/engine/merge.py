"""One graph from consecutive shards, built at load time without copying a weight.

Sharding is for conversion, transport and streaming; a model that fits runs fastest as one
ONNX Runtime session: one thread pool, one hop from Python, and graph optimisations (fusions)
across the cuts. :func:`merge_shards` concatenates the shards' nodes into one in-memory graph.
Every external initializer keeps its ``location`` (its own shard's data file, relative to the
artifact folder), so ONNX Runtime reads each weight from the same hashed file it would have read
for the shard alone; the session is told where that folder is
(:func:`slimml.runtime.engine.session.session_options` ``weights_folder``).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import numpy as np
import onnx
from onnx import external_data_helper, helper

from slimml.errors import ArtifactError
from slimml.runtime.artifact.files import safe_path
from slimml.runtime.artifact.manifest import Manifest, TensorSpec


def merge_shards(folder: Path, manifest: Manifest, indices: list[int]) -> onnx.ModelProto:
    """The shards ``indices`` (consecutive, in order) as one graph; weights stay external.

    Raises:
        ArtifactError: two shards define the same function, or compute one of their inputs or
            outputs, differently, so they cannot share one graph (the caller then runs them one by
            one). A weight or an inner value two shards name alike but define differently is
            renamed in the later shard.
    """
    inputs, outputs = manifest.segment_io(indices)
    named = {d for t in inputs + outputs for d in t.shape if isinstance(d, str)}  # the model's own dynamic axes
    nodes, inits, infos, functions = [], {}, {}, {}
    made: dict[str, bytes] = {}  # output name -> the node that makes it (name cleared), serialised
    node_names: set[str] = set()
    opsets: dict[str, int] = {}
    ir_version = 0
    models = {i: onnx.load_model_from_string(safe_path(folder, manifest.shards[i].file).read_bytes())  # weights not read
              for i in indices}
    newest = max((o.version for m in models.values() for o in m.opset_import if o.domain in ("", "ai.onnx")), default=0)
    for i in indices:
        shard = manifest.shards[i]
        m = _at_opset(models.pop(i), newest)
        relative_to_folder(m, PurePosixPath(shard.file).parent)
        ir_version = max(ir_version, m.ir_version)
        for op in m.opset_import:
            if opsets.setdefault(op.domain, op.version) != op.version:
                raise ArtifactError(f"shard {i} uses opset {op.version} of {op.domain or 'ai.onnx'!r}, the others {opsets[op.domain]}")
        for f in m.functions:
            _merge_unique(functions, (f.domain, f.name), f, "function", i)
        renames: dict[str, str] = {}  # this shard's names that an earlier shard uses for something else
        for t in m.graph.initializer:
            if t.name in inits and not _same_weight(folder, inits[t.name], t):
                # a weight the splitter copied into several shards, converted differently in each
                # (fp16 keeps a norm's bias fp32 where only the norm reads it): each keeps its own
                renames[t.name] = f"{t.name}__shard{i}"
                t = _copy(t)
                t.name = renames[t.name]
            inits.setdefault(t.name, t)
        boundary = {t.name for t in shard.inputs} | {t.name for t in shard.outputs}
        for node in _in_order(m.graph.node):
            _add_node(nodes, node, made, node_names, i, boundary, renames)
        for v in m.graph.value_info:
            v = _own_dims(v, named, i)
            if v.name in renames:
                v.name = renames[v.name]
            infos.setdefault(v.name, v)
    graph = helper.make_graph(
        nodes, f"{manifest.name}-shards-{indices[0]}-{indices[-1]}",
        [_value_info(t) for t in inputs], [_value_info(t) for t in outputs], list(inits.values()),
        value_info=[v for name, v in infos.items() if name not in {t.name for t in inputs + outputs}],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
                              functions=list(functions.values()))
    model.ir_version = ir_version
    return model


def _add_node(nodes: list, node: onnx.NodeProto, made: dict[str, bytes], names: set[str], shard: int,
              boundary: set[str], renames: dict[str, str]) -> None:
    """Append ``node``, dropping an exact repeat of an earlier one and renaming clashing names.

    Quantizing shard by shard can put the same node in several shards (each decoder layer
    quantizes the ``encoder_hidden_states`` it reads): one graph keeps one of them. A value
    inside a shard (not one of its inputs or outputs, ``boundary``) that an earlier shard also
    made differently (fp16 shards each name their cast ``graph_output_cast_0``) is renamed within
    this shard (``renames``)."""
    if renames and any(n in renames for n in node.input):
        node = _copy(node)
        node.input[:] = [renames.get(n, n) for n in node.input]
    key = onnx.NodeProto()
    key.CopyFrom(node)
    key.name = ""
    body = key.SerializeToString()
    seen = [made.get(o) for o in node.output if o]
    if seen and all(b == body for b in seen):
        return  # the same computation of the same values, already in the graph
    clash = [o for o in node.output if o and made.get(o) is not None]
    if any(o in boundary for o in clash):
        raise ArtifactError(f"shard {shard} computes {list(node.output)} differently from an earlier shard")
    if clash:
        node = _copy(node)
        for o in clash:
            renames[o] = f"{o}__shard{shard}"
        node.output[:] = [renames.get(o, o) if o in clash else o for o in node.output]
        key.output[:] = node.output
        body = key.SerializeToString()
    for o in node.output:
        if o:
            made[o] = body
    if node.name and node.name in names:
        node = _copy(node)
        node.name = f"{node.name}__shard{shard}"
    names.add(node.name)
    nodes.append(node)


def _in_order(nodes) -> list:
    """A shard's nodes in topological order (a producer before its readers). ONNX asks for it,
    but some tools write graphs without it (onnxconverter's fp16 casts), which ONNX Runtime
    sorts itself; renaming values across shards needs it."""
    produced = {o for n in nodes for o in n.output if o}
    known, ready, pending = set(), [], list(nodes)
    while pending:
        rest = []
        for n in pending:
            if all(x in known or x not in produced for x in n.input if x):
                ready.append(n)
                known.update(o for o in n.output if o)
            else:
                rest.append(n)
        if len(rest) == len(pending):  # a cycle: keep the rest as written
            ready += rest
            break
        pending = rest
    return ready


def _copy(proto):
    out = type(proto)()
    out.CopyFrom(proto)
    return out


def _at_opset(m: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """A shard's graph at ONNX opset ``version``, the newest of the shards merged: a
    quantizer moves the shards it rewrites to opset 21 and leaves a shard it keeps float (an
    embedding, a small head) at its export's, and one graph takes one opset. onnx's version
    converter moves it up (its adapters keep each op's meaning); where it cannot, the mismatch
    stands and the shards run one session each, as before."""
    current = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), version)
    if current >= version:
        return m
    try:
        from onnx import version_converter

        return version_converter.convert_version(m, version)
    except Exception:  # an op it has no adapter for: merge_shards then names the mismatch
        return m


def relative_to_folder(m: onnx.ModelProto, shard_dir: PurePosixPath) -> None:
    """External-data locations are relative to the shard's own file; a component's shards sit in
    a subfolder (``text/shard_000.onnx``), so make them relative to the artifact folder."""
    if str(shard_dir) in ("", "."):
        return
    for t in m.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = (shard_dir / entry.value).as_posix()


def _merge_unique(seen: dict, key, proto, what: str, shard: int) -> None:
    if key in seen and seen[key].SerializeToString() != proto.SerializeToString():
        raise ArtifactError(f"shard {shard} defines the {what} {key!r} differently from an earlier shard")
    seen.setdefault(key, proto)


def _same_weight(folder: Path, a: onnx.TensorProto, b: onnx.TensorProto) -> bool:
    """Whether two initializers of one name hold the same tensor. The splitter copies a weight
    that several shards read (a shared norm, tied embeddings) into each of them, each copy in its
    own shard's data file: compare type, shape and bytes, not where the bytes live."""
    if a.data_type != b.data_type or list(a.dims) != list(b.dims):
        return False
    return _tensor_bytes(folder, a) == _tensor_bytes(folder, b)


def _tensor_bytes(folder: Path, t: onnx.TensorProto) -> bytes:
    if not external_data_helper.uses_external_data(t):
        return t.SerializeToString()  # inline: its raw or typed data are in the proto
    info = {e.key: e.value for e in t.external_data}
    with open(safe_path(folder, info["location"]), "rb") as f:
        f.seek(int(info.get("offset", 0)))
        return f.read(int(info["length"]))


def _own_dims(v: onnx.ValueInfoProto, named: set[str], shard: int) -> onnx.ValueInfoProto:
    """A copy of shard ``shard``'s value info ``v`` whose symbolic dims other than the model's own
    axes (``named``) are the shard's: each shard's shape inference names the dims it cannot tell
    ``unk__0``, ``unk__1``... afresh, and one name for two different dims in one graph makes ONNX
    Runtime reuse a buffer of the wrong size ("Shape mismatch attempting to re-use buffer": a tiny
    int8 BART's decoder failed so on its first step)."""
    v = _copy(v)
    for d in v.type.tensor_type.shape.dim:
        if d.HasField("dim_param") and d.dim_param not in named:
            d.dim_param = f"{d.dim_param}__shard{shard}"
    return v


def _value_info(t: TensorSpec) -> onnx.ValueInfoProto:
    shape = [d if isinstance(d, (int, str)) else None for d in t.shape]
    return helper.make_tensor_value_info(t.name, helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype)), shape)
