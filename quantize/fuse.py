"""Graph fusions on one shard, done so that they match as they would on the whole graph.

ONNX Runtime's transformer optimizer fuses a layer's attention into one ``Attention`` node only
when it can trace the attention mask back to the model's ``attention_mask`` input. In a sharded
artifact the mask is prepared once, in the embedding shard, and reaches each layer shard as an
activation, so the pattern is cut off and attention stays unfused. :func:`rematerialize_inputs`
copies such cheap side computations (tensors made from model inputs alone, through no heavy
weight) into the shard that reads them; after that, fusions inside a layer match as they do on
the whole graph. Fusions stay inside a shard: a layer cut by a boundary (more shards than layers)
stays unfused.
"""

from __future__ import annotations

import logging
import os

import onnx
from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

_MAX_COPIED_BYTES = 1 << 16  # side computations read small constants only; never copy weights

# Encoders whose graphs ONNX Runtime's BERT optimizer is made for. Other families (ViT, CLIP,
# T5, Whisper, decoders) are quantized unfused.
FUSABLE_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "camembert", "mpnet", "electra"})


def fusable(source: dict) -> bool:
    """Whether the fusions apply to an artifact converted from ``source`` (its manifest's)."""
    return source.get("model_type") in FUSABLE_MODEL_TYPES


def rematerialize_inputs(shard: onnx.ModelProto, earlier: list[onnx.ModelProto], model_inputs: dict[str, onnx.ValueInfoProto],
                         folder: str | os.PathLike | None = None) -> list[str]:
    """Recompute, inside ``shard``, inputs that earlier shards derive from model inputs alone.

    Args:
        shard: the shard to edit in place.
        earlier: the graphs of all earlier shards (weights need not be loaded).
        model_inputs: the model's input value infos, by name.
        folder: where the earlier shards' external data lies: a constant copied from there is
            read into the shard (a shard cut inside a layer keeps even a mask's constants in its
            data file, which the edited shard, saved elsewhere, cannot reach).

    Returns:
        The names of the inputs that are now computed inside the shard.
    """
    producers: dict[str, tuple[onnx.GraphProto, onnx.NodeProto]] = {}
    inits: dict[str, onnx.TensorProto] = {}
    for m in earlier:
        for node in m.graph.node:
            for o in node.output:
                producers[o] = (m.graph, node)
        for t in m.graph.initializer:
            inits.setdefault(t.name, t)
    graph = shard.graph
    present = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    done: list[str] = []
    for vi in list(graph.input):
        if vi.name in model_inputs or vi.name not in producers:
            continue
        plan = _trace(vi.name, producers, inits, model_inputs)
        if plan is None:
            continue
        nodes, needed_inits, needed_inputs = plan
        graph.input.remove(vi)
        for name in needed_inputs:
            if name not in present:
                graph.input.append(model_inputs[name])
                present.add(name)
        for name in needed_inits:
            if name not in present:
                graph.initializer.append(inits[name])
                if folder is not None and uses_external_data(graph.initializer[-1]):
                    load_external_data_for_tensor(graph.initializer[-1], os.fspath(folder))  # made inline
                present.add(name)
        made = {o for n in graph.node for o in n.output}
        new = [n for n in nodes if not set(n.output) & made]
        copies = []
        for n in new:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            copies.append(c)
        old = list(graph.node)
        del graph.node[:]
        graph.node.extend(copies + old)
        done.append(vi.name)
    return done


def _trace(name, producers, inits, model_inputs):
    """The nodes (in order), initializers and model inputs that make ``name``; None if it needs more."""
    order: list[onnx.NodeProto] = []
    seen: set[str] = set()
    need_inits: set[str] = set()
    need_inputs: set[str] = set()
    copied = 0

    def visit(t: str) -> bool:
        nonlocal copied
        if t in seen or not t:
            return True
        seen.add(t)
        if t in model_inputs:
            need_inputs.add(t)
            return True
        if t in inits:
            copied += _nbytes(inits[t])
            need_inits.add(t)
            return copied <= _MAX_COPIED_BYTES
        if t not in producers:
            return False
        _, node = producers[t]
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return False
        if not all(visit(x) for x in node.input):
            return False
        if node not in order:
            order.append(node)
        return True

    if not visit(name) or len(order) > 64:
        return None
    return order, sorted(need_inits), sorted(need_inputs)


def _nbytes(t: onnx.TensorProto) -> int:
    count = 1
    for d in t.dims:
        count *= d
    return count * max(1, onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize)


def fuse_transformer(model: onnx.ModelProto, model_type: str = "bert") -> tuple[onnx.ModelProto, dict[str, int]]:
    """ONNX Runtime's transformer fusions (attention, GELU) on one graph.

    Returns the fused model and the count of each fused op (only those that occurred). Layer
    norms stay ``Add`` + ``LayerNormalization``: ONNX Runtime's CPU ``SkipLayerNormalization``
    kernel measured 5x slower than the two ops it replaces (``runtime/engine/session.py``). The FFN's
    bias stays an ``Add`` before ``Gelu``, not fused into ``BiasGelu``: once quantized, ONNX
    Runtime folds that ``Add`` into the ``DynamicQuantizeMatMul`` before it, and ``Gelu`` alone
    costs 0.6x ``BiasGelu`` (18.7 vs 27.9 ms a batch-32 pass of all-MiniLM-L6-v2).
    """
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.onnx_model_bert import BertOnnxModel

    options = FusionOptions(model_type)
    # keep the embedding lookup plain: EmbedLayerNormalization needs position ids it derives
    # itself, and the embedding shard is memory-bound anyway
    options.enable_embed_layer_norm = False
    options.enable_skip_layer_norm = False
    options.enable_bias_gelu = False
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the optimizer's modules warn on their own loggers ("fusion_attention")
    try:
        bert = BertOnnxModel(model, num_heads=0, hidden_size=0)  # 0: read heads/hidden from the graph
        bert.optimize(options, add_dynamic_axes=False)
    finally:
        logging.disable(previous)
    stats = {k: v for k, v in bert.get_fused_operator_statistics().items() if v}
    fused = bert.model
    if not any(o.domain == "com.microsoft" for o in fused.opset_import):
        fused.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return fused, stats
