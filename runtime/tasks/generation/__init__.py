"""Text generation for decoder artifacts, one job a file.

``config`` (what to generate: :class:`GenerationConfig`, checked once), ``prompts`` (texts or ids
in, checked against the model once), ``loop`` (the decode loop over the engine), ``sampling``
(logits -> next ids), ``detokenize`` (ids -> text, as it comes), ``stopping`` (stop strings and
ids), ``chat`` (the model's chat template). :mod:`slimml.runtime.tasks.generate` puts them together.
"""

from slimml.runtime.tasks.generation.config import GenerationConfig

__all__ = ["GenerationConfig"]
