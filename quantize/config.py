"""Quantization configs: one dataclass per scheme, each checking itself on creation.

A config says *what* to do; :mod:`slimml.quantize.registry` maps its type to the backend that
does it. ``scheme_config("int8", target="cpu")`` turns the CLI's ``--quantize`` word into one.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimml.errors import ConfigError
from slimml.quantize.grids import GRIDS

BACKENDS = ("ort", "nncf")
LM_BACKEND = "lm"  # weight-only blocks for language models (quantize/decoder.py), chosen for them by quantize
SCHEMES = ("none", "int8", "int8-dynamic", "int8-static", "int8-weights", "int4-weights", "fp16")
PRESETS = ("int8", "int8-weights", "int4-weights")  # the words a language model turns into its decoder recipe
TARGETS = ("cpu", "cuda")


def _whole(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ConfigError(f"{name} must be a whole number >= {low}, got {value!r}.")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}.")


def _path(name: str, value: Any) -> Path:
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ConfigError(f"{name} must be a file path, got {value!r}.")
    return Path(value)


def _op_types(value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or not value \
            or not all(isinstance(t, str) and t.isidentifier() for t in value):
        raise ConfigError(f"op_types must be ONNX op type names, e.g. ('MatMul',), got {value!r}.")
    return tuple(value)


@dataclass
class GuardConfig:
    """The accuracy guard: keep the most sensitive shards in float until the drop is at most ``max_drop``.

    Args:
        max_drop: largest accepted drop. With ``eval_file`` (an STS CSV) it is in Spearman x100
            points against the unquantized model; without, it is ``100 * (1 - agreement)`` on held-out
            calibration texts, the agreement being what matters for the task (docs/quantize.md: the
            embeddings' cosine, a classifier's scores, a cross-encoder's ranking; a language model's
            perplexity ratio, its drop in perplexity percent).
        eval_file: an STS-style CSV (sentence1,sentence2,score) to measure the drop on.
        keep_best: when the drop cannot be met within ``max_float_shards``, write the best model
            found (and say so in the report) instead of failing.
        max_float_shards: at most this many shards may stay in float (default: half of the
            quantized ones, rounded down; past that, quantizing no longer pays).
    """

    max_drop: float
    eval_file: Path | None = None
    keep_best: bool = False
    max_float_shards: int | None = None

    def __post_init__(self):
        if isinstance(self.max_drop, bool) or not isinstance(self.max_drop, numbers.Real) or not self.max_drop >= 0 \
                or self.max_drop == float("inf"):  # not nan, not inf
            raise ConfigError(f"--max-drop must be a number >= 0, got {self.max_drop!r}.")
        self.max_drop = float(self.max_drop)
        if self.eval_file is not None:
            self.eval_file = _path("eval_file", self.eval_file)
        if self.max_float_shards is not None:
            _whole("max_float_shards", self.max_float_shards, 0)
        _flag("keep_best", self.keep_best)


def _is_preset(config) -> bool:
    """``config`` is what its ``preset`` word makes (scheme_config, Int8Config)."""
    kind, bits = type(config).__name__, getattr(config, "bits", None)
    return {"int8": kind == "Int8DynamicConfig" or (kind == "WeightOnlyConfig" and bits == 8),
            "int8-weights": kind == "WeightOnlyConfig" and bits == 8,
            "int4-weights": kind == "WeightOnlyConfig" and bits == 4}[config.preset]


@dataclass
class _Common:
    """Settings every scheme shares.

    Args:
        calibration: text lines or an STS CSV used for calibration (static int8) and for the
            guard's held-out check; for a model that takes images, a folder of images, and for a
            speech model a folder of WAV recordings (every fifth held out for the guard); ``None``
            uses the built-in corpus (generated pixels or features for those).
        calibration_size: at most this many texts are used for calibration.
        guard: the accuracy guard, or ``None`` for none.
        exclude_shards: shard indices kept in float (the guard adds to these).
        eval_text: for a language model, the held-out UTF-8 text on which the quantized model's
            perplexity is measured against the float one (default: a built-in sample).
        preset: the scheme word this config stands for (``"int8"``, ``"int8-weights"``,
            ``"int4-weights"``; set by ``Int8Config`` and :func:`scheme_config`, as the CLI's
            ``--quantize`` sets it): on a language model it becomes slimml's decoder recipe
            (``quantize/decoder.py``). A config without one is used as written.
    """

    calibration: Path | None = None
    calibration_size: int = 256
    guard: GuardConfig | None = None
    exclude_shards: tuple[int, ...] = ()
    eval_text: Path | None = None
    preset: str | None = None

    def _check_common(self):
        if self.calibration is not None:
            self.calibration = _path("calibration", self.calibration)
        if self.eval_text is not None:
            self.eval_text = _path("eval_text", self.eval_text)
        _whole("calibration_size", self.calibration_size, 4)
        if self.guard is not None and not isinstance(self.guard, GuardConfig):
            raise ConfigError(f"guard must be a GuardConfig (e.g. GuardConfig(max_drop=1.0)) or None, got {self.guard!r}.")
        if isinstance(self.exclude_shards, (str, bytes)) or not isinstance(self.exclude_shards, Iterable):
            raise ConfigError(f"exclude_shards must be shard indices, e.g. (0, 5), got {self.exclude_shards!r}.")
        for i in self.exclude_shards:
            _whole("each of exclude_shards", i, 0)
        self.exclude_shards = tuple(sorted(set(self.exclude_shards)))
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(f"preset must be one of {', '.join(map(repr, PRESETS))} or None, got {self.preset!r}.")
        if self.preset is not None and not _is_preset(self):
            raise ConfigError(f"preset={self.preset!r} does not describe this {type(self).__name__}"
                              f"{f'(bits={self.bits})' if hasattr(self, 'bits') else ''}; use scheme_config({self.preset!r}), "
                              "or leave preset out to quantize as the config says.")

    def _check_backend(self, internal: tuple[str, ...] = ()):
        if self.backend not in BACKENDS + internal:
            raise ConfigError(f"unknown --backend {self.backend!r}; use one of: {', '.join(BACKENDS)}.")


@dataclass
class Int8DynamicConfig(_Common):
    """int8 weights, activations quantized on the fly (ONNX Runtime dynamic quantization), for CPUs.

    Args:
        fuse: run ONNX Runtime's transformer fusions (attention, GELU) on each shard before
            quantizing, so each layer's attention becomes one ``QAttention`` (the attention mask
            is recomputed inside each shard so attention fuses there as on the whole graph).
            Measured on the int8 all-MiniLM-L6-v2, 2-core Sapphire Rapids, against Optimum's
            int8 model: batch 1 0.68x its time fused, 0.86x unfused; batch 32 0.83x and 1.00x;
            STSb dev 86.60 fused, 86.57 unfused (docs/quantize.md). Layer norms
            are left unfused (ONNX Runtime's CPU ``SkipLayerNormalization`` is the slow part: an
            earlier AVX2 measurement, fused with it, was 3-5% slower than unfused). Applies to
            BERT-family encoders (``quantize/fuse.py``, ``FUSABLE_MODEL_TYPES``); other models
            are quantized unfused.
        per_channel: one scale per output channel of each weight.
        reduce_range: 7-bit weights. On CPUs without VNNI (AVX2 ``vpmaddubsw``) this avoids the
            int16 saturation that costs accuracy; it costs nothing in speed.
        activation_symmetric: symmetric activation ranges; as accurate on STSb dev and steadier
            across batchings (the activation scales see every row of the batch, padding included).
        op_types: ONNX op types to quantize.
    """

    fuse: bool = True
    per_channel: bool = True
    reduce_range: bool = True
    activation_symmetric: bool = True
    op_types: tuple[str, ...] = ("MatMul", "Attention", "Gather", "EmbedLayerNormalization")

    def __post_init__(self):
        self._check_common()
        self.op_types = _op_types(self.op_types)
        for name in ("fuse", "per_channel", "reduce_range", "activation_symmetric"):
            _flag(name, getattr(self, name))


@dataclass
class Int8StaticConfig(_Common):
    """int8 weights and activations with ranges from calibration data (QDQ format).

    Args:
        per_channel: one scale per output channel of each weight.
        reduce_range: 7-bit weights (see :class:`Int8DynamicConfig`).
        method: calibration method: ``"minmax"``, ``"entropy"`` or ``"percentile"`` (ort backend).
        op_types: ONNX op types to quantize (ort backend; NNCF places its own QDQ pairs).
        backend: ``"ort"`` (ONNX Runtime's ``quantize_static``) or ``"nncf"`` (``nncf.quantize``
            with ``ModelType.TRANSFORMER``; it uses ``per_channel`` and, for 7-bit weights,
            ``reduce_range``).
    """

    per_channel: bool = True
    reduce_range: bool = True
    method: str = "minmax"
    op_types: tuple[str, ...] = ("MatMul",)
    backend: str = "ort"

    def __post_init__(self):
        self._check_common()
        self._check_backend()
        if self.method not in ("minmax", "entropy", "percentile"):
            raise ConfigError(f"unknown calibration method {self.method!r}; use minmax, entropy or percentile.")
        self.op_types = _op_types(self.op_types)
        for name in ("per_channel", "reduce_range"):
            _flag(name, getattr(self, name))


@dataclass
class WeightOnlyConfig(_Common):
    """Weight-only quantization of MatMul weights into ``MatMulNBits`` (activations stay float).

    For GPUs and big decoders, where memory, not int8 arithmetic, is what is short.

    Args:
        bits: 4 or 8.
        block_size: weights per scale along the input dimension (a power of two >= 16).
        symmetric: symmetric blocks (no zero point).
        accuracy_level: ONNX Runtime's compute type on CPU: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8.
        backend: ``"ort"`` (ONNX Runtime's ``MatMulNBitsQuantizer``) or ``"nncf"``
            (``nncf.compress_weights``, data-free: int8 per output channel, int4 in blocks of
            ``block_size``).
        grid: language-model backend only (``quantize/grids.py``): ``"gguf"`` keeps a 4-bit GGUF
            source's own grid, ``"fitted"`` searches each block's scale and zero point; None: the
            backend's choice.
        sensitive_layers: language-model backend, 4 bits: layers whose FFN down, attention output
            and V projections stay 8-bit.
        embedding_bits: language-model backend: the token embedding table's bits (8; 4 for an untied one).
    """

    bits: int = 4
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int | None = None
    backend: str = "ort"
    grid: str | None = None
    sensitive_layers: tuple[int, ...] = ()
    embedding_bits: int = 8

    def __post_init__(self):
        self._check_common()
        self._check_backend(internal=(LM_BACKEND,))
        if type(self.bits) is not int or self.bits not in (4, 8):
            raise ConfigError(f"weight-only bits must be 4 or 8, got {self.bits!r}.")
        _whole("block_size", self.block_size, 16)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 16, got {self.block_size!r}.")
        if self.accuracy_level is not None and (type(self.accuracy_level) is not int or self.accuracy_level not in (0, 1, 2, 3, 4)):
            raise ConfigError(f"accuracy_level must be 0..4 (or None), got {self.accuracy_level!r}.")
        _flag("symmetric", self.symmetric)
        if self.grid not in (None, *GRIDS):
            raise ConfigError(f"grid must be 'gguf' or 'fitted' (or None: the backend's choice), got {self.grid!r}.")
        self.sensitive_layers = tuple(int(i) for i in self.sensitive_layers)
        if self.embedding_bits not in (4, 8):
            raise ConfigError(f"embedding_bits must be 4 or 8, got {self.embedding_bits!r}.")


@dataclass
class Fp16Config(_Common):
    """Weights and arithmetic in float16, for CUDA (CPUs run fp16 slower than fp32).

    Args:
        keep_io_types: inputs and outputs stay float32, so the runtime's feeds do not change.
        op_block_list: op types kept in float32 (numerically touchy ones).
    """

    keep_io_types: bool = True
    op_block_list: tuple[str, ...] = ("Softmax", "LayerNormalization", "SkipLayerNormalization", "ReduceMean", "Pow", "Sqrt",
                                      "Range")  # ONNX defines Range for float32, not float16 (a rotary table's positions)

    def __post_init__(self):
        self._check_common()
        self.op_block_list = tuple(self.op_block_list)


QuantizeConfig = Int8DynamicConfig | Int8StaticConfig | WeightOnlyConfig | Fp16Config


def Int8Config(target: str = "cpu", **kwargs) -> QuantizeConfig:
    """The best int8 scheme for ``target``: dynamic int8 with fusions on CPU, int8 weights on CUDA.

    (ONNX Runtime's CUDA provider does not accelerate int8 activations, so on CUDA int8 means
    int8 weights.)

    Args:
        target: ``"cpu"`` or ``"cuda"``: what the quantized model will run on.
        **kwargs: fields of the config it makes (``calibration``, ``guard``, ...); ``preset``
            defaults to ``"int8"`` (a language model gets its decoder recipe).

    Returns:
        An :class:`Int8DynamicConfig` for CPU, a :class:`WeightOnlyConfig` (``bits=8``) for CUDA.

    Raises:
        ConfigError: an unknown target, or a field out of range.

    Example:
        >>> type(Int8Config("cpu")).__name__, type(Int8Config("cuda")).__name__
        ('Int8DynamicConfig', 'WeightOnlyConfig')
    """
    _check_target(target)
    kwargs.setdefault("preset", "int8")  # the best int8: on a language model, its decoder recipe
    if target == "cuda":
        return WeightOnlyConfig(bits=8, **kwargs)
    return Int8DynamicConfig(**kwargs)


def scheme_config(
    scheme: str,
    target: str = "cpu",
    calibration: str | os.PathLike | None = None,
    max_drop: float | None = None,
    eval_file: str | os.PathLike | None = None,
    keep_best: bool = False,
    backend: str = "ort",
) -> QuantizeConfig | None:
    """Turn the CLI's ``--quantize`` word into a config (``None`` for ``"none"``).

    ``backend`` (``--backend``) picks who quantizes: ``"ort"`` (ONNX Runtime's tools) or
    ``"nncf"``, which serves ``int8-static``, ``int8-weights`` and ``int4-weights``.

    Args:
        scheme: one of :data:`SCHEMES`: ``none``, ``int8``, ``int8-dynamic``, ``int8-static``,
            ``int8-weights``, ``int4-weights``, ``fp16`` (``fp16`` needs ``target="cuda"``).
        target: ``"cpu"`` or ``"cuda"``.
        calibration: calibration texts (one a line, or an STS CSV; default: a built-in corpus).
        max_drop: the accuracy guard's largest drop allowed (None: no guard).
        eval_file: the STS CSV the guard measures on (needs ``max_drop``).
        keep_best: write the best model the guard finds where ``max_drop`` cannot be met.
        backend: ``"ort"`` or ``"nncf"``.

    Returns:
        The scheme's config, or None for ``"none"``.

    Raises:
        ConfigError: an unknown scheme, target or backend, or options that do not go together.

    Example:
        >>> scheme_config("int4-weights")
        WeightOnlyConfig(...bits=4...)
    """
    _check_target(target)
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown --quantize value {scheme!r}; use one of: {', '.join(SCHEMES)}.")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown --backend {backend!r}; use one of: {', '.join(BACKENDS)}.")
    if backend != "ort" and scheme not in ("int8-static", "int8-weights", "int4-weights"):
        raise ConfigError(
            f"--backend {backend} serves --quantize int8-static, int8-weights and int4-weights, not {scheme!r}; "
            "choose one of those or leave --backend out."
        )
    if scheme == "none":
        if max_drop is not None or calibration is not None or eval_file is not None:
            raise ConfigError("--calibration, --max-drop and --eval need --quantize; give e.g. --quantize int8.")
        return None
    if eval_file is not None and max_drop is None:
        raise ConfigError("--eval is used by the accuracy guard; give --max-drop X with it.")
    if keep_best and max_drop is None:
        raise ConfigError("--keep-best writes the best model the accuracy guard finds; give --max-drop X with it.")
    guard = GuardConfig(max_drop=max_drop, eval_file=eval_file, keep_best=keep_best) if max_drop is not None else None
    common = {"calibration": Path(calibration) if calibration is not None else None, "guard": guard}
    if scheme == "int8":
        return Int8Config(target, **common)
    if scheme == "int8-dynamic":
        return Int8DynamicConfig(**common)
    if scheme == "int8-static":
        return Int8StaticConfig(backend=backend, **common)
    if scheme == "int8-weights":
        return WeightOnlyConfig(bits=8, backend=backend, preset=scheme, **common)
    if scheme == "int4-weights":
        return WeightOnlyConfig(bits=4, backend=backend, preset=scheme, **common)
    if target != "cuda":
        raise ConfigError("--quantize fp16 is for GPUs (ONNX Runtime runs fp16 slower than fp32 on CPUs); add --target cuda.")
    return Fp16Config(**common)


@dataclass
class QuantizeOptions:
    """The command line's choice of quantization (``--quantize`` and what goes with it); the help
    texts are the CLI's (see :mod:`slimml.cli.options`). :meth:`to_config` makes the config.

    Example:
        >>> QuantizeOptions(scheme="int8", target="cpu").to_config()
    """

    scheme: str = field(default="none", metadata={
        "help": "none, int8 (best for --target), int8-dynamic, int8-static, int8-weights, int4-weights, fp16 (cuda).",
        "flags": ("--quantize",)})
    calibration: Path | None = field(default=None, metadata={
        "help": "Calibration texts: one per line, or an STS CSV; a folder of images (image models) or of WAV recordings (speech models). Default: a built-in corpus."})
    max_drop: float | None = field(default=None, metadata={
        "help": "Accuracy guard: keep sensitive shards float until the drop is at most this."})
    eval_file: Path | None = field(default=None, metadata={
        "help": "STS CSV the guard measures the drop on (Spearman x100 points).", "flags": ("--eval",)})
    target: str = field(default="cpu", metadata={"help": "cpu or cuda: what the quantized model will run on."})
    keep_best: bool = field(default=False, metadata={
        "help": "If --max-drop cannot be met, write the best model found instead of failing.", "flags": ("--keep-best",)})
    backend: str = field(default="ort", metadata={
        "help": "Who quantizes: ort (ONNX Runtime) or nncf (int8-static, int8-weights, int4-weights)."})

    def to_config(self) -> QuantizeConfig | None:
        """The scheme's config (``None`` for ``none``); see :func:`scheme_config`."""
        return scheme_config(self.scheme, self.target, self.calibration, self.max_drop, self.eval_file, self.keep_best,
                             self.backend)


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ConfigError(f"unknown --target {target!r}; use cpu or cuda.")


def scheme_tag(config: QuantizeConfig) -> str:
    """The ``--quantize`` word for what ``config`` does: ``int8``, ``int8-static``,
    ``int8-weights``, ``int4-weights`` or ``fp16`` (``int8`` on CUDA is ``int8-weights``)."""
    if isinstance(config, Int8DynamicConfig):
        return "int8"
    if isinstance(config, Int8StaticConfig):
        return "int8-static"
    if isinstance(config, WeightOnlyConfig):
        return f"int{config.bits}-weights"
    return "fp16"


def describe(config: QuantizeConfig) -> dict:
    """The config as JSON-able settings for the manifest's steps."""
    from dataclasses import asdict

    d = {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()}
    d.pop("guard", None)
    if config.guard is not None:
        d["max_drop"] = config.guard.max_drop
        if config.guard.eval_file is not None:
            d["eval_file"] = str(config.guard.eval_file)
    d["scheme"] = type(config).__name__
    return d


__all__ = [
    "BACKENDS", "SCHEMES", "TARGETS", "GuardConfig", "Int8DynamicConfig", "Int8StaticConfig", "WeightOnlyConfig",
    "Fp16Config", "Int8Config", "QuantizeConfig", "scheme_config", "scheme_tag", "describe", "field",
]
