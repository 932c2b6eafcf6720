"""The task registry: which task class an artifact gets, decided once, at load.

:func:`kind_of` reads the manifest's task and the fields it declares (components, zero_shot,
seq2seq, labels, pooling, the preprocessor's kind) and names a kind; :func:`build_task` makes
the class registered for that kind (``@register_task`` in :mod:`.base`) over the loaded
engines. This module and the artifact package are the only places that look at a manifest's
optional fields: the server, the CLI and the pipeline ask the task (``task.supports("encode")``,
``task.accepts``) instead.

Example:
    >>> task = build_task(folder, manifest, {None: engine})
    >>> task.kind, sorted(task.capabilities)
    ('sentence-embedding', ['count_tokens', 'encode', 'encode_with_counts', 'tokenize'])
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from slimml.runtime.artifact.manifest import Manifest
from slimml.runtime.tasks.base import _TASKS, Task, register_task, task_class

# the built-in tasks: importing them registers them
from slimml.runtime.tasks.causal_lm import CausalLM
from slimml.runtime.tasks.classify import IMAGE_OUTPUTS
from slimml.runtime.tasks.generic import Generic
from slimml.runtime.tasks.image_classification import ImageClassifier
from slimml.runtime.tasks.image_embedding import ImageEmbedding
from slimml.runtime.tasks.question_answering import QuestionAnswerer
from slimml.runtime.tasks.seq2seq import Seq2Seq
from slimml.runtime.tasks.text_classification import TextClassifier
from slimml.runtime.tasks.text_embedding import TextEmbedding
from slimml.runtime.tasks.token_classification import TokenClassifier
from slimml.runtime.tasks.zero_shot import ZeroShot

if TYPE_CHECKING:
    from slimml.runtime.engine.engine import Engine

__all__ = ["CausalLM", "Generic", "ImageClassifier", "ImageEmbedding", "QuestionAnswerer", "Seq2Seq", "TextClassifier",
           "TextEmbedding", "TokenClassifier", "ZeroShot", "build_task", "kind_of", "register_task", "registered",
           "task_class"]

def kind_of(manifest: Manifest) -> str:
    """The task kind of an artifact, from its manifest's task and declared fields.

    An artifact of components is an encoder-decoder (``seq2seq``), an image-text model
    (``zero_shot``) or generic; one chain is a decoder (task ``text-generation*`` with
    ``input_ids`` -> ``logits``), a classifier (``labels``, of images where it takes pixels),
    a sentence embedder (``pooling``), an image embedder (pixels in, an embedding out), or generic
    (task ``generic``: what came as an ONNX file or torch module, and a pipeline stage).
    """
    inputs = {t.name for t in manifest.inputs}
    outputs = {t.name for t in manifest.outputs}
    pixels = any(t.name == "pixel_values" or len(t.shape) == 4 for t in manifest.inputs)
    if manifest.components:
        if manifest.seq2seq:
            return Seq2Seq.kind
        if manifest.zero_shot:
            return ZeroShot.kind
        return Generic.kind
    if manifest.task == "generic":  # an ONNX file, a torch module, a pipeline stage: tensors in, tensors out
        return Generic.kind
    if manifest.task.startswith("text-generation") and "input_ids" in inputs and "logits" in outputs:
        return CausalLM.kind
    if manifest.task == "token-classification" and manifest.labels is not None and "logits" in outputs:
        return TokenClassifier.kind
    if manifest.task == "question-answering" and {"start_logits", "end_logits"} <= outputs:
        return QuestionAnswerer.kind
    if manifest.labels is not None and "logits" in outputs:
        return ImageClassifier.kind if pixels else TextClassifier.kind
    if manifest.pooling is not None:
        return TextEmbedding.kind
    if pixels and outputs & set(IMAGE_OUTPUTS):
        return ImageEmbedding.kind
    return Generic.kind


def build_task(folder: str | Path, manifest: Manifest, engines: Mapping[str | None, Engine]) -> Task:
    """The task for an artifact over its loaded engines.

    Args:
        folder: the artifact folder.
        manifest: its manifest (a stage's, for a pipeline stage).
        engines: component name -> its engine; ``{None: engine}`` for one chain of shards.

    Returns:
        An instance of the class registered for :func:`kind_of` ``(manifest)``.
    """
    return task_class(kind_of(manifest))(Path(folder), manifest, engines)


def registered() -> dict[str, type[Task]]:
    """Kind -> task class, for every registered task."""
    return dict(_TASKS)
