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
    scale, bias = _similarity(model, onnx_path.parent)
    siglip = "siglip" in str(config.get("model_type", ""))
    zero_shot = {"text": "text", "image": "vision",
                 "scale": scale if scale is not None else float(np.exp(float(config.get("logit_scale_init_value", np.log(100.0)))))}
    if siglip:  # as transformers' zero-shot pipeline scores and pads SigLIP
        if bias is None or scale is None:  # scored without them, every label would read as near certain
            raise ExportError(f"could not read SigLIP's logit {'bias' if bias is None else 'scale'} from "
                              f"{onnx_path.name}'s image-text logits (its zero-shot scores would be wrong); convert a tower alone "
                              "with --task, or report it.")
        zero_shot.update(bias=bias, activation="sigmoid", text_length=SIGLIP_TEXT_LENGTH)
    elif bias:
        raise ExportError(f"{onnx_path.name} adds a bias of {bias:g} to its image-text logits, which slimml scores only "
                          "for SigLIP (model_type siglip); convert it with --task pointing at one tower, or report it.")
    return components, zero_shot


SIGLIP_TEXT_LENGTH = 64  # transformers' zero-shot pipeline pads SigLIP's texts to 64 tokens (its text tower has no mask)


def _similarity(model, base_dir: Path) -> tuple[float | None, float | None]:
    """``(exp(logit_scale), logit_bias)`` as the graph computes its image-text logits
    (``logits_per_text = cos * exp(scale) [+ bias]``), read from the nodes (through Identity and
    Cast) rather than from initializer names (the exporter may merge equal initializers: a SigLIP
    whose scale and bias are both 0 shares one), else from initializers named ``logit_scale`` and
    ``logit_bias``; None for what neither says."""
    from onnx import numpy_helper

    made = {o: n for n in model.graph.node for o in n.output}
    consts = {t.name: t for t in model.graph.initializer}
    consts.update({n.output[0]: next((a.t for a in n.attribute if a.name == "value"), None)
                   for n in model.graph.node if n.op_type == "Constant"})

    def through(name: str) -> str:
        while name in made and made[name].op_type in ("Identity", "Cast"):
            name = made[name].input[0]
        return name

    def value(name: str) -> float | None:
        t = consts.get(through(name))
        if t is None:
            return None
        a = numpy_helper.to_array(t, base_dir=str(base_dir)).reshape(-1)
        return float(a[0]) if a.size == 1 else None

    scale = bias = None
    node = made.get(through("logits_per_text"))
    if node is not None and node.op_type == "Add":
        got = [value(i) for i in node.input]
        bias = next((b for b in got if b is not None), None)
        node = next((made.get(through(i)) for i, b in zip(node.input, got) if b is None), None)
    if node is not None and node.op_type == "Mul":
        exp = next((made[through(i)] for i in node.input if through(i) in made and made[through(i)].op_type == "Exp"), None)
        if exp is None:  # exp(logit_scale) folded into a constant
            scale = next((v for v in map(value, node.input) if v is not None), None)
        elif (log_scale := value(exp.input[0])) is not None:
            scale = float(np.exp(log_scale))
    if scale is None and value("logit_scale") is not None:
        scale = float(np.exp(value("logit_scale")))
    if bias is None:
        bias = value("logit_bias")
    return scale, bias
