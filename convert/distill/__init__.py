"""Distillation and pruning: a smaller student of a Hugging Face teacher, made before export.

``shrink`` (teacher folder in, student folder out) is the entry point; ``convert`` calls it when
``ConvertConfig.distill`` or ``prune`` is set. The parts: the training loop (:mod:`.distill_train`),
the data (:mod:`.distill_data`), the teacher's outputs from its artifact (:mod:`.teacher`), head,
neuron and vocabulary pruning (:mod:`.prune`, :mod:`.prune_vocab`), mixed precision
(:mod:`.precision`) and the student-against-teacher report (:mod:`.compare`).

Example:
    >>> from slimml.convert.distill import DistillConfig, PruneConfig, shrink
    >>> shrink("teacher/", "student/", DistillConfig(layers=3), PruneConfig(0.5))
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from slimml.convert.distill.distill import DEFAULT_EPOCHS, DistillConfig, check, evenly_spaced
from slimml.convert.distill.distill import shrink as _shrink
from slimml.convert.distill.prune import PruneConfig


def convert_teacher(teacher_dir: str | os.PathLike, out: Path, opset: int | None = None) -> Path:
    """Convert the teacher into a float artifact at ``out`` (unchecked: its outputs are only read)."""
    from slimml.convert.distill.teacher import teacher_export
    from slimml.convert.pipeline import ConvertConfig, convert

    return convert(teacher_dir, out, ConvertConfig(export=teacher_export(teacher_dir, opset), verify=False,
                                                   measure_latency=False)).out


@functools.wraps(_shrink)
def shrink(*args, **kwargs):
    kwargs.setdefault("convert_teacher", convert_teacher)
    return _shrink(*args, **kwargs)


__all__ = ["DEFAULT_EPOCHS", "DistillConfig", "PruneConfig", "check", "convert_teacher", "evenly_spaced", "shrink"]
