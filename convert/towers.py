"""Split an exported graph into components: the independent towers of a two-tower model.

CLIP-style models (a ``text_config`` and a ``vision_config``) export as one graph whose text
path (token ids -> ``text_embeds``) and image path (pixels -> ``image_embeds``) share nothing
but the final similarity. slimml keeps each path as a component of its own, so texts run
without loading the vision tower, each tower streams under its own budget, and zero-shot
classification is computed from the two embeddings with the model's ``exp(logit_scale)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slimml.errors import ExportError


@dataclass
class Component:
    name: str
    onnx_path: Path  # a graph beside the exported one, sharing its external-data file
    inputs: list[str]
    outputs: list[str]


# (component, the graph inputs it takes, the output that is its result)
_TOWERS = [("text", ("input_ids", "attention_mask", "position_ids"), "text_embeds"),
           ("vision", ("pixel_values",), "image_embeds")]


def split_towers(onnx_path: Path, source_folder: Path | None) -> tuple[list[Component], dict | None]:
    """The text and vision components of a two-tower graph, and its zero-shot scoring.

    Returns ``([], None)`` for any other graph: it stays one chain of shards.
    """
    import onnx
    from onnx import numpy_helper
    from onnx.utils import Extractor

    if source_folder is None or not (source_folder / "config.json").is_file():
        return [], None
    config = json.loads((source_folder / "config.json").read_text())
    if not (config.get("text_config") is not None and config.get("vision_config") is not None):
        return [], None
    model = onnx.load(str(onnx_path), load_external_data=False)
    inputs = [i.name for i in model.graph.input]
    outputs = {o.name for o in model.graph.output}
    parts = []
    for name, takes, result in _TOWERS:
        ins = [i for i in inputs if i in takes]
        if result not in outputs or not ins:
            return [], None  # not the layout this split knows: keep the graph whole
        parts.append((name, ins, result))
    components = []
    try:
        extractor = Extractor(model)
        for name, ins, result in parts:
            sub = extractor.extract_model(ins, [result])
            used = {i.name for i in sub.graph.input}
            path = onnx_path.with_name(f"{name}.onnx")  # beside model.onnx: its external-data paths still resolve
            onnx.save_model(sub, str(path))
            components.append(Component(name, path, [i for i in ins if i in used], [result]))
    except Exception as e:  # onnx's own errors: a graph whose towers are not separable
        raise ExportError(
            f"could not split {onnx_path.name} into its text and vision towers ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); convert it with --task pointing at one tower, or report it."
        ) from None
    scale = next((t for t in model.graph.initializer if t.name == "logit_scale"), None)
    if scale is not None:
        log_scale = float(numpy_helper.to_array(scale, base_dir=str(onnx_path.parent)).reshape(-1)[0])
    else:
        log_scale = float(config.get("logit_scale_init_value", np.log(100.0)))
    return components, {"text": "text", "image": "vision", "scale": float(np.exp(log_scale))}
