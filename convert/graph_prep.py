"""A whole ONNX graph made ready to cut into shards, and the reads of its nodes.

Before the splitter walks a graph: the external data of subgraph tensors is read in (a shard moves
only top-level weights into its own data file), ``Constant`` nodes become initializers (each shard
that reads one gets its copy) with exporters' Identity aliases of weights read through, and every
graph output comes out of a node. ``toposort`` orders the nodes so that each input is made before it
is read, counting what subgraphs capture from the outer scope (``node_uses``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from slimml.errors import ExportError

if TYPE_CHECKING:
    import onnx


def prepare(graph: onnx.GraphProto, src_dir: Path) -> None:
    """Make ``graph`` (its external data beside it in ``src_dir``) ready to cut, in place."""
    _inline_subgraph_data(graph, src_dir)
    _constants_to_initializers(graph)
    _outputs_made_by_nodes(graph)


def _constants_to_initializers(graph: onnx.GraphProto) -> None:
    """Turn ``Constant`` nodes into initializers, so each shard that reads one gets its own copy."""
    import onnx
    from onnx import helper, numpy_helper

    keep = []
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1:
            attr = node.attribute[0]
            value = helper.get_attribute_value(attr)
            if attr.name == "value":
                t = onnx.TensorProto()
                t.CopyFrom(value)
            elif attr.name in ("value_float", "value_floats"):
                t = numpy_helper.from_array(np.asarray(value, dtype=np.float32))
            elif attr.name in ("value_int", "value_ints"):
                t = numpy_helper.from_array(np.asarray(value, dtype=np.int64))
            else:
                keep.append(node)
                continue
            t.name = node.output[0]
            graph.initializer.append(t)
        else:
            keep.append(node)
    # Exporters alias shared weights through Identity nodes at the top of the graph; read the
    # weight directly instead, or every alias would count as an activation crossing every cut.
    weights = {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    captured = set().union(*(node_uses(n) - set(n.input) for n in keep)) if keep else set()
    alias = {
        n.output[0]: n.input[0]
        for n in keep
        if n.op_type == "Identity" and n.input[0] in weights and n.output[0] not in outputs | captured
    }
    keep = [n for n in keep if not (n.op_type == "Identity" and n.output[0] in alias)]
    for n in keep:
        n.input[:] = [alias.get(x, x) for x in n.input]
    del graph.node[:]
    graph.node.extend(keep)


def _inline_subgraph_data(graph: onnx.GraphProto, src_dir: Path) -> None:
    """Read the external data of the tensors inside subgraphs (an If's branches, a Loop's body) into
    the graph: the splitter moves only top-level weights into a shard's data file, and a shard must
    not read the source's."""
    import onnx
    from onnx import external_data_helper

    def tensors(g: onnx.GraphProto):
        for node in g.node:
            for attr in node.attribute:
                yield from ([attr.t] if attr.type == onnx.AttributeProto.TENSOR else list(attr.tensors))
                for sg in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                    yield from sg.initializer
                    yield from tensors(sg)

    for t in tensors(graph):
        if external_data_helper.uses_external_data(t):
            external_data_helper.load_external_data_for_tensor(t, str(src_dir))
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]


def _outputs_made_by_nodes(graph: onnx.GraphProto) -> None:
    """Give each graph output that no node makes but a weight is (an initializer, or a Constant's
    value, one now) an Identity node making it, the weight renamed: every output then comes out of
    a shard. (An output that is a graph input is the input itself: see ``families._io``.)"""
    from onnx import helper

    made = {o for n in graph.node for o in n.output}
    weights = {t.name: t for t in graph.initializer}
    inputs = {i.name for i in graph.input}
    taken = made | set(weights) | inputs
    for out in graph.output:
        name = out.name
        if name in made or name not in weights or name in inputs:
            continue
        new = f"{name}.slimml_value"
        while new in taken:
            new += "_"
        taken.add(new)
        weights[name].name = new
        _rename_reads(graph, name, new)
        graph.node.append(helper.make_node("Identity", [new], [name], name=f"{name}.slimml_output"))
        made.add(name)


def _rename_reads(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Make every node of ``graph`` and of its subgraphs read ``new`` where it read ``old``."""
    import onnx

    for node in graph.node:
        node.input[:] = [new if x == old else x for x in node.input]
        for attr in node.attribute:
            for sg in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                _rename_reads(sg, old, new)


def node_uses(node: onnx.NodeProto) -> set[str]:
    """Names a node reads: its inputs and the outer-scope names its subgraphs capture."""
    import onnx

    names = {x for x in node.input if x}
    for attr in node.attribute:
        subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for sg in subs:
            names |= _captures(sg)
    return names


def _captures(graph: onnx.GraphProto) -> set[str]:
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    used: set[str] = set()
    for node in graph.node:
        used |= node_uses(node) - defined
        defined |= set(node.output)
    return used - defined


def toposort(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """Nodes in an order where every input is made before it is read (stable for sorted graphs)."""
    have = set(available)
    done = [False] * len(nodes)
    order: list[onnx.NodeProto] = []
    uses = [node_uses(n) for n in nodes]
    producers = {o for n in nodes for o in n.output}
    progress = True
    while progress and len(order) < len(nodes):
        progress = False
        for i, n in enumerate(nodes):
            if not done[i] and all(u in have or u not in producers for u in uses[i]):
                done[i] = True
                order.append(n)
                have.update(n.output)
                progress = True
    if len(order) != len(nodes):
        raise ExportError("the ONNX graph has a cycle or reads tensors no node makes; check the model with onnx.checker.")
    return order
