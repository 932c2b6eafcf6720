"""Export a Hugging Face folder through ``torch.onnx.export``, without optimum-onnx.

optimum-onnx 0.1.0, the traced exporter, needs transformers < 4.58; this one works with the
installed transformers, 4.57 or 5. It writes the single-graph models (encoders and
sentence-transformers, classifiers, masked LMs, extractive QA, ViT) with optimum's input and output
names and dynamic axes, so the splitter, the runtime's tasks and the quantizers see the same graph.
Decoders go through the fused exporter (``convert.fused_llama``); encoder-decoders and two-tower
models still need optimum-onnx.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

from slimml.errors import ExportError

# task -> the model's outputs as optimum names them, and whether they have a sequence axis
TORCH_TASKS = {
    "feature-extraction": (("last_hidden_state",), True),
    "text-classification": (("logits",), False),
    "token-classification": (("logits",), True),
    "fill-mask": (("logits",), True),
    "question-answering": (("start_logits", "end_logits"), True),
    "image-classification": (("logits",), False),
}
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
DEFAULT_OPSET = 17


def torch_export_reason(folder: Path, task: str, config: dict[str, Any]) -> str | None:
    """Why ``export_torch`` cannot write ``folder`` as ``task`` (one line), or None when it can."""
    if config.get("is_encoder_decoder") or "text_config" in config or "vision_config" in config:
        return "the torch exporter writes single-graph models, not encoder-decoders or two-tower models"
    if task not in TORCH_TASKS:
        return f"the torch exporter writes {', '.join(TORCH_TASKS)}, not {task!r}"
    return None


def export_torch(folder: Path, onnx_path: Path, task: str, opset: int | None = None) -> None:
    """Write ``folder``'s model for ``task`` to ``onnx_path`` (weights as external data beside it
    when over 2 GB), inputs and outputs named as optimum names them, batch (and sequence) dynamic."""
    import torch
    from optimum.exporters.tasks import TasksManager  # optimum's task -> model class map (base optimum, any transformers)

    from slimml.convert.distill.prune_heads import from_pretrained  # a pruned encoder's folder reads the same way

    try:
        model = from_pretrained(lambda f, **kw: TasksManager.get_model_from_task(
            task, str(f), library_name="transformers", local_files_only=True, attn_implementation="eager", **kw), folder)
    except Exception as e:
        raise ExportError(f"transformers could not load {folder} as {task!r} ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0]}); pass --task with the model's task.") from None
    model.eval()
    names, example, dynamic = _inputs(folder, model, task)
    outputs, per_position = TORCH_TASKS[task]
    wrapper = _outputs_module(model, names, outputs).eval()
    per_position = per_position and names[0] != "pixel_values"  # a ViT's hidden states: its patch count is fixed
    dynamic.update({o: {0: "batch_size", **({1: "sequence_length"} if per_position else {})} for o in outputs})
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(wrapper, example, str(onnx_path), input_names=list(names), output_names=list(outputs),
                              dynamic_axes=dynamic, opset_version=opset or DEFAULT_OPSET, dynamo=False,
                              do_constant_folding=True)
    except Exception as e:
        raise ExportError(f"torch.onnx.export could not write {folder} as {task!r} ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0]}); install optimum-onnx with transformers 4.57 "
                          "(pip install 'transformers==4.57.6' 'optimum-onnx==0.1.0') and pass --exporter optimum.") from None
    _drop_wrapper_scope(onnx_path)


def _drop_wrapper_scope(onnx_path: Path) -> None:
    """Names as optimum writes them: ``/encoder/layer.3/...`` for the wrapper's ``/model/encoder/layer.3/...``
    (the manifest records each shard's layers by these names), ``encoder.layer.3...`` for its weights."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)  # the names only: weights stay where they are
    graph = model.graph

    def bare(name: str) -> str:
        return "/" + name[len("/model/"):] if name.startswith("/model/") else name[len("model."):] if name.startswith("model.") else name

    for node in graph.node:
        node.name = bare(node.name)
        node.input[:] = [bare(x) for x in node.input]
        node.output[:] = [bare(x) for x in node.output]
    for value in [*graph.initializer, *graph.value_info]:
        value.name = bare(value.name)
    onnx.save(model, str(onnx_path))


def _outputs_module(model: Any, names: tuple[str, ...], outputs: tuple[str, ...]) -> Any:
    import torch

    class Outputs(torch.nn.Module):
        """The model called by keyword, its named outputs returned as a tuple (what the exporter traces).
        The model sits under ``model``, so node names read ``/model/encoder/layer.3/...``."""

        def __init__(self, model, names, outputs):
            super().__init__()
            self.model, self.names, self.outputs = model, tuple(names), tuple(outputs)

        def forward(self, *args):
            out = self.model(**dict(zip(self.names, args)), return_dict=True)
            return tuple(out[o] for o in self.outputs)

    return Outputs(model, names, outputs)


def _inputs(folder: Path, model: Any, task: str) -> tuple[tuple[str, ...], tuple[Any, ...], dict[str, dict[int, str]]]:
    """The graph's input names, example tensors and dynamic axes: pixels for an image model, else the
    text inputs its forward takes."""
    import torch

    accepted = set(inspect.signature(model.forward).parameters)
    config = model.config
    if "pixel_values" in accepted and "input_ids" not in accepted:
        size = getattr(config, "image_size", 224)
        size = (size, size) if isinstance(size, int) else tuple(size)
        pixels = torch.zeros(2, getattr(config, "num_channels", 3), *size)
        return ("pixel_values",), (pixels,), {"pixel_values": {0: "batch_size"}}
    names = tuple(n for n in TEXT_INPUTS if n in accepted)
    if "input_ids" not in names:
        raise ExportError(f"the torch exporter found no text or image input on {type(model).__name__}.forward; "
                          "export it to ONNX yourself and convert the .onnx file.")
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102], [101, 2460, 102, 0, 0, 0]]) % config.vocab_size
    tensors = {"input_ids": ids, "attention_mask": (ids != 0).long(), "token_type_ids": torch.zeros_like(ids)}
    tensors["attention_mask"][:, 0] = 1
    axes = {n: {0: "batch_size", 1: "sequence_length"} for n in names}
    return names, tuple(tensors[n] for n in names), axes
