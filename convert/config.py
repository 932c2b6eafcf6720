"""What ``convert`` does, stage by stage: :class:`ConvertConfig` and the configs it holds.

Kept apart from the pipeline so the CLI reads its options from these dataclasses (see
:mod:`slimml.cli.options`) without loading ONNX or torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimml.convert.distill.distill import DistillConfig
from slimml.convert.distill.prune import PruneConfig
from slimml.convert.export import ExportConfig
from slimml.convert.shard import ShardConfig
from slimml.errors import ConfigError


@dataclass
class ConvertConfig:
    """Everything ``convert`` does, stage by stage.

    Args:
        export: how to export to ONNX.
        shard: how to split the graph.
        verify: compare the artifact with the unsharded graph and the torch model.
        measure_latency: time the artifact (batch 1) for the report.
        distill: train a student with fewer layers before export (``convert.distill``).
        prune: remove attention heads and FFN neurons before export (``convert.distill.prune``).
        quantize: a ``slimml.quantize`` config, applied to the sharded artifact after the
            checks (``None``: stay float).
        compare_on: with ``distill``/``prune``, an STS CSV on which the report scores the teacher
            and the student (``measure_latency`` also times the two side by side).
        eval_text: for a language model, the held-out text (UTF-8) on which the check scores the
            artifact's perplexity and top-1 agreement against the source (default: a built-in sample).
    """

    export: ExportConfig = field(default_factory=ExportConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    verify: bool = field(default=True, metadata={"help": "Check the artifact against the original model."})
    measure_latency: bool = True
    distill: DistillConfig | None = None
    prune: PruneConfig | None = None
    quantize: Any = None
    compare_on: str | os.PathLike | None = field(default=None, metadata={
        "help": "With --distill-layers/--prune: an STS CSV on which the report scores the teacher and the student.",
        "flags": ("--compare-on",), "type": Path})
    eval_text: str | os.PathLike | None = field(default=None, metadata={
        "help": "Language models: held-out UTF-8 text the check (and the quantization guard) scores perplexity on. "
                "Default: a built-in sample.", "flags": ("--eval-text",), "type": Path})

    def __post_init__(self):
        if self.compare_on is not None and self.distill is None and self.prune is None:
            raise ConfigError("--compare-on compares a student with its teacher; give --distill-layers N or --prune F "
                              "with it. In Python, set ConvertConfig's distill or prune with compare_on.")
