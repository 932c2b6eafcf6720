"""SPLADE (sentence-transformers' SparseEncoder: ``MLMTransformer -> SpladePooling``) as one graph.

A SPLADE model embeds a text as one weight per vocabulary token: its masked LM's logits, each
position's ``log(1 + relu(logit))`` (``log1p_relu``: the log once more, as OpenSearch's models do),
padding zeroed, then the max (or sum) over the positions. The pooling is appended to the exported
masked LM's graph, so the artifact's output is the (batch, vocabulary) embedding, never the
(batch, sequence, vocabulary) logits (2 GB for 32 texts of 512 tokens with BERT's vocabulary).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OUTPUT = "sentence_embedding"
LOGITS = "logits"
# the artifact's pooling record: the model pools itself, and the library does not normalise
POOLING = {"mode": "none", "output": OUTPUT, "normalize": False}


def add_splade_pooling(onnx_path: Path, splade: dict[str, str]) -> None:
    """Rewrite the masked LM at ``onnx_path`` (output ``logits``, input ``attention_mask``) to output
    its SPLADE embedding ``sentence_embedding`` instead, its weights as external data beside it."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(onnx_path))
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    vocab = next(o for o in graph.output if o.name == LOGITS).type.tensor_type.shape.dim[-1]

    def const(name: str, value: Any, dtype: Any) -> str:
        graph.initializer.append(numpy_helper.from_array(np.array(value, dtype=dtype), f"splade/{name}"))
        return f"splade/{name}"

    one = const("one", 1.0, "float32")
    nodes = [helper.make_node("Cast", ["attention_mask"], ["splade/mask"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["splade/mask", const("last", [-1], "int64")], ["splade/mask3"]) if opset >= 13
             else helper.make_node("Unsqueeze", ["splade/mask"], ["splade/mask3"], axes=[-1]),
             helper.make_node("Mul", [LOGITS, "splade/mask3"], ["splade/masked"]),
             helper.make_node("Relu", ["splade/masked"], ["splade/relu"]),
             helper.make_node("Add", ["splade/relu", one], ["splade/plus1"]),
             helper.make_node("Log", ["splade/plus1"], ["splade/log1p"])]
    last = "splade/log1p"
    if splade["activation"] == "log1p_relu":  # OpenSearch's: the log once more
        nodes += [helper.make_node("Add", [last, one], ["splade/plus1_2"]), helper.make_node("Log", ["splade/plus1_2"], ["splade/log1p_2"])]
        last = "splade/log1p_2"
    reduce = "ReduceMax" if splade["strategy"] == "max" else "ReduceSum"
    axes_as_input = opset >= (18 if reduce == "ReduceMax" else 13)
    nodes.append(helper.make_node(reduce, [last, const("positions", [1], "int64")], [OUTPUT], keepdims=0) if axes_as_input
                 else helper.make_node(reduce, [last], [OUTPUT], axes=[1], keepdims=0))
    graph.node.extend(nodes)
    batch = next(o for o in graph.output if o.name == LOGITS).type.tensor_type.shape.dim[0]
    out = helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [batch.dim_param or batch.dim_value or "batch",
                                                                    vocab.dim_param or vocab.dim_value])
    del graph.output[:]
    graph.output.append(out)
    data = onnx_path.with_name(onnx_path.name + ".data")
    for stale in onnx_path.parent.glob("*.onnx_data"):  # the exporter's own external data, now read in
        stale.unlink()
    data.unlink(missing_ok=True)
    onnx.save_model(model, str(onnx_path), save_as_external_data=True, location=data.name, size_threshold=1024)
