"""Layer distillation (and the recovery pass after pruning): a smaller student trained to match its teacher.

The student keeps N evenly spaced teacher layers, first and last included (the DistilBERT recipe
of initialising from the teacher's own layers), then learns to match the teacher on unlabelled
texts: sentence-embedding models match the pooled embeddings (cosine, plus the in-batch
similarity matrix, which is what STS-style ranking depends on); plain encoders match the last
hidden states (masked MSE); classifiers and language models match the logits (KL divergence).

``shrink`` is the stage the convert pipeline calls: teacher folder in, student folder out (a normal
Hugging Face folder, tokenizer and sentence-transformers files included), before export.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import slimml.convert.distill.prune as pruning
import slimml.convert.distill.prune_vocab as prune_vocab
from slimml.convert.distill.distill_data import load_texts
import slimml.convert.distill.precision as mp
from slimml.convert.distill.distill_train import Trainer, build_student, teacher_kind
from slimml.convert.distill.prune import PruneConfig
from slimml.convert.sources import sentence_transformers_pooling
from slimml.errors import ConfigError, SourceError

DEFAULT_EPOCHS = 6.0  # 3 -> 6: STSb dev 84.2 -> 84.6 (d3, pruned 0.5) and 86.45 -> 86.66 (d4); 10 adds ~0.1
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "config.json", "model.safetensors.index.json")


@dataclass
class DistillConfig:
    """How to train the student.

    Args:
        layers: transformer layers the student keeps (fewer than the teacher's); ``None`` keeps them
            all (a pruned model then gets only the short recovery pass).
        data: a text file (one text a line), a CSV/TSV with text columns or JSON Lines; ``None``: the default corpus.
        epochs: passes over the data (fractions allowed). ``None``: 6 for a layer-distilled student,
            1 for a recovery pass after pruning only.
        batch_size: texts per step.
        lr: peak AdamW learning rate (linear warm-up over 5% of the steps, then linear decay).
        max_length: longest tokenized text; longer ones are truncated.
        max_texts: use at most this many texts (quick runs).
        max_steps: stop after this many steps (quick runs, tests).
        seed: data order and anything random.
        checkpoint_every: save a resumable checkpoint every this many steps.
        pre_prune_epochs: with both ``layers`` and pruning, passes of distillation *before* the
            importance scores are measured and the student is pruned (``epochs`` more follow).
        teacher_memory_budget: bytes of teacher shards loaded at once while the teacher's outputs are
            computed (``"2GB"``): the teacher streams through the slimml runtime, so it may be bigger
            than memory. ``None``: the teacher runs resident.
        teacher_top_k: for causal LMs, the teacher logits cached per token (with their log-sum-exp).
        grad_accum: batches whose gradients make one optimizer step (effective batch ``grad_accum *
            batch_size``, at the memory of one batch).
        mixed_precision: ``"auto"`` (measured: see ``convert.precision``), ``"off"``, ``"bf16"`` or
            ``"fp16"`` (CUDA, with a gradient scaler).
        checkpointing: activation checkpointing of the student's layers: less memory, more compute.
        device: where the student trains: ``"auto"`` (CUDA when torch sees a GPU), ``"cpu"`` or ``"cuda"``.
    """

    # the help texts are the CLI's (see slimml.cli.options)
    layers: int | None = field(default=None, metadata={"help": "Distil into a student with this many layers (fewer than the model's)."})
    data: str | os.PathLike | None = field(default=None, metadata={
        "help": "Texts to distil on: one a line, a CSV or TSV with text/sentence1/sentence2 columns, or JSON Lines with "
                "those fields. Default: a built-in corpus."})
    epochs: float | None = field(default=None, metadata={
        "help": "Passes over the distillation data (default 6; 1 after --prune alone). With both --distill-layers and "
                "--prune, one more pass trains the student before it is pruned."})
    batch_size: int = field(default=32, metadata={"help": "Distillation: texts per batch."})
    lr: float = 5e-4
    max_length: int = 128
    max_texts: int | None = None
    max_steps: int | None = None
    seed: int = 0
    checkpoint_every: int = 100
    pre_prune_epochs: float = 1.0
    teacher_memory_budget: int | str | None = field(default=None, metadata={
        "help": "Distillation: run the teacher streamed with at most this much of it loaded, e.g. 2GB (a teacher bigger "
                "than memory).", "flags": ("--teacher-memory-budget",)})
    teacher_top_k: int = 32
    grad_accum: int = field(default=1, metadata={
        "help": "Distillation: batches whose gradients make one step (effective batch N x the batch size, at the memory "
                "of one batch).", "flags": ("--grad-accum",)})
    mixed_precision: str = field(default="auto", metadata={
        "help": "Distillation: auto (measured: the faster of fp32 and the device's native low precision), off, bf16, "
                "fp16 (CUDA).", "flags": ("--mixed-precision",)})
    checkpointing: bool = field(default=False, metadata={
        "help": "Distillation: activation checkpointing of the student's layers (less memory, more compute).",
        "flags": ("--checkpointing",)})
    device: str = "auto"

    def __post_init__(self):
        from slimml.runtime.engine.budget import parse_bytes

        if isinstance(self.grad_accum, bool) or not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ConfigError(f"--grad-accum {self.grad_accum!r} must be a whole number >= 1 (batches per optimizer step).")
        if self.mixed_precision not in mp.CHOICES:
            raise ConfigError(f"--mixed-precision {self.mixed_precision!r} is not one of {', '.join(mp.CHOICES)}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"distillation device {self.device!r} must be auto, cpu or cuda.")
        if self.teacher_memory_budget is not None:
            parse_bytes(self.teacher_memory_budget)  # a malformed size fails here, naming the fix
        if self.teacher_top_k < 1:
            raise ConfigError(f"teacher_top_k {self.teacher_top_k} must be >= 1.")
        if self.layers is not None and self.layers < 1:
            raise ConfigError(f"--distill-layers {self.layers} must be >= 1 (the student's transformer layers).")
        if self.epochs is not None and not self.epochs > 0:
            raise ConfigError(f"--distill-epochs {self.epochs} must be > 0, e.g. 1 or 0.5.")
        if self.batch_size < 2:
            raise ConfigError(f"--distill-batch-size {self.batch_size} must be >= 2 (the in-batch similarity and the "
                              "held-out loss compare texts within a batch).")
        if not 0 < self.lr < 1:
            raise ConfigError(f"distillation lr {self.lr} must be in (0, 1), e.g. 2e-4.")
        if self.pre_prune_epochs < 0:
            raise ConfigError(f"pre_prune_epochs {self.pre_prune_epochs} must be >= 0.")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps {self.max_steps} must be >= 1.")


def evenly_spaced(teacher_layers: int, n: int) -> list[int]:
    """Indices of ``n`` teacher layers, first and last included: 6 -> 3 gives [0, 2, 5]."""
    if n == 1:
        return [teacher_layers - 1]
    return sorted({round(i * (teacher_layers - 1) / (n - 1)) for i in range(n)})


def check(teacher_dir: Path, distill: DistillConfig, prune: PruneConfig | None) -> dict[str, Any]:
    """Everything that can be wrong with the request, checked before any long work."""
    from transformers import AutoConfig

    from slimml.convert.distill.distill_train import training_device

    try:
        config = AutoConfig.from_pretrained(str(teacher_dir), local_files_only=True)
    except Exception as e:
        raise SourceError(f"cannot read the model config in {teacher_dir} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                          "save the model with save_pretrained so its config.json is one transformers reads.") from None
    n_teacher = getattr(config, "num_hidden_layers", None)
    if n_teacher is None:
        raise ConfigError(f"{teacher_dir} has no num_hidden_layers in its config; distillation needs a layered transformer: "
                          "leave --distill-layers and --prune out for it.")
    if distill.layers is not None and distill.layers >= n_teacher:
        raise ConfigError(
            f"--distill-layers {distill.layers} is not fewer than the teacher's {n_teacher} layers; "
            f"give 1 to {n_teacher - 1}."
        )
    groups = getattr(config, "num_hidden_groups", None)  # ALBERT: every layer runs one group's shared weights
    if distill.layers is not None and isinstance(groups, int) and groups < n_teacher:
        raise ConfigError(f"{teacher_dir} shares its layers' weights ({n_teacher} layers run {groups} group(s) of "
                          "weights, ALBERT's way), so there are no layers to keep or drop; leave --distill-layers out "
                          "(--quantize works on it).")
    kind, model_class = teacher_kind(teacher_dir)
    if prune is not None:
        pruning.check_prunable(config, prune)
        short = pruning.heads_shortfall(config, prune)
        if short:  # grouped-query attention: a layer's last group stays
            logging.getLogger("slimml").warning("slimml: %s", short)
    if not any((teacher_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        raise SourceError(f"{teacher_dir} has no tokenizer; distillation tokenizes texts, so save one with the model.")
    mp.check(distill.mixed_precision, training_device(distill.device).type)
    texts, origin = load_texts(distill.data, distill.max_texts)
    pooling = sentence_transformers_pooling(teacher_dir)
    if pooling is not None and pooling.get("default_prompt"):  # the student reads every text after it, as the teacher
        prompt = pooling["prompts"][pooling["default_prompt"]]
        texts = [prompt + t for t in texts]
    return {"config": config, "teacher_layers": n_teacher, "texts": texts, "origin": origin, "kind": kind,
            "model_class": model_class}


def shrink(
    teacher_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    distill: DistillConfig | None = None,
    prune: PruneConfig | None = None,
    checkpoint: str | os.PathLike | None = None,
    progress: Callable[[int, int, float | None], None] | None = None,
    teacher_artifact: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    on_step: Callable[[str], None] | None = None,
    keep_checkpoint: bool = False,
    checked: dict[str, Any] | None = None,
    convert_teacher: Callable[[Path, Path], Path] | None = None,
) -> list[dict[str, Any]]:
    """Make a smaller student of the Hugging Face model in ``teacher_dir`` and save it in ``out_dir``.

    Args:
        teacher_dir: a Hugging Face (or sentence-transformers) model folder.
        out_dir: where the student folder goes (same layout as the teacher's).
        distill: layers to keep and how to train; ``None`` with ``prune`` set: prune, then a
            one-epoch recovery pass on the default corpus.
        prune: heads and FFN neurons to remove.
        checkpoint: a file for a resumable checkpoint; a run with the same settings resumes from it.
            It is deleted once the student is saved, unless ``keep_checkpoint`` (the convert pipeline
            keeps the finished student there until its artifact is written, so a kill in export resumes).
        progress: called as ``progress(done, total, loss)``: texts through the teacher (``loss`` None),
            then training steps.
        teacher_artifact: the teacher as a slimml artifact (float); ``None``: converted here, in a
            temporary folder.
        cache_dir: where the teacher's outputs are cached; ``None``: beside ``checkpoint`` (or temporary).
        on_step: called with a short description as each phase starts.
        checked: what :func:`check` returned, when the caller has run it already (it reads the data).
        convert_teacher: ``convert_teacher(teacher_dir, out)`` converts the teacher into the artifact
            ``out`` when ``teacher_artifact`` is None (``slimml.convert.distill.shrink`` passes the
            convert pipeline's; the pipeline itself gives ``teacher_artifact``).

    Returns:
        The manifest step records, e.g. ``[{"step": "distill", "layers": 3, ...}, {"step": "prune", ...}]``.

    Example:
        >>> shrink(default_model_dir(), "student", DistillConfig(layers=3), PruneConfig(0.5))
    """
    import tempfile

    teacher_dir, out_dir = Path(teacher_dir), Path(out_dir)
    distill = distill or DistillConfig()
    if distill.layers is None and prune is None:
        raise ConfigError("nothing to do: give --distill-layers N, --prune F, or both.")
    facts = checked if checked is not None else check(teacher_dir, distill, prune)
    say = on_step or (lambda msg: None)
    with tempfile.TemporaryDirectory(prefix="slimml-teacher-") as scratch:
        if teacher_artifact is None:
            if convert_teacher is None:
                raise ConfigError("shrink needs the teacher as an artifact: give teacher_artifact, or call "
                                  "slimml.convert.distill.shrink, which converts the teacher itself.")
            say("converting the teacher")
            teacher_artifact = convert_teacher(teacher_dir, Path(scratch) / "teacher")
        if cache_dir is None:
            cache_dir = Path(checkpoint).with_suffix(".teacher-cache") if checkpoint is not None else Path(scratch) / "cache"
        steps = _shrink(teacher_dir, out_dir, distill, prune, facts, checkpoint, progress, Path(teacher_artifact),
                        Path(cache_dir), say)
    if checkpoint is not None and not keep_checkpoint:
        Path(checkpoint).unlink(missing_ok=True)
    return steps


def _shrink(teacher_dir, out_dir, distill, prune, facts, checkpoint, progress, teacher_artifact, cache_dir, say):
    from slimml.convert.distill.teacher import check_budget, teacher_outputs, teacher_pooler

    t0 = time.perf_counter()
    check_budget(teacher_artifact, distill.teacher_memory_budget)  # before anything trains
    kept_layers = evenly_spaced(facts["teacher_layers"], distill.layers) if distill.layers else list(range(facts["teacher_layers"]))
    _check_training_fits(teacher_dir, kept_layers)
    kind = facts["kind"]
    epochs = distill.epochs if distill.epochs is not None else (DEFAULT_EPOCHS if distill.layers else 1.0)
    fingerprint = _fingerprint(teacher_dir, distill, prune, epochs, facts["texts"])
    pooler = teacher_pooler(teacher_artifact) if kind == "embedding-cosine" else None
    trainer = Trainer(kind, teacher_dir, facts["texts"], distill, pooler)
    say("running the teacher")
    mem0 = _peak_rss()
    targets = teacher_outputs(teacher_artifact, kind, trainer.ids, trainer.pad_id, cache_dir,
                              distill.teacher_memory_budget, distill.teacher_top_k,
                              None if progress is None else (lambda done, total: progress(done, total, None)), pooler=pooler)
    teacher_peak = _peak_rss()
    trainer.use(targets)
    state = _load_checkpoint(checkpoint, fingerprint, targets.sha256)
    say("training the student")
    student = build_student(teacher_dir, facts["model_class"], kept_layers)
    teacher_params = _teacher_params(teacher_dir)
    distilled_params = _params(student)
    start_loss = trainer.heldout_loss(student) if state is None else state.get("heldout_start")
    # Distil first, prune second: importance measured on a student that already works picks better
    # heads and neurons than importance measured on the freshly cut copy.
    pre_epochs = distill.pre_prune_epochs if (distill.layers and prune is not None) else 0.0
    pre_steps = trainer.steps(pre_epochs) if pre_epochs else 0
    main_steps = trainer.steps(epochs)
    phase = state.get("phase") if state else None
    plan = state["plan"] if state else None

    def saver(phase_name: str) -> Callable[[int, dict], None]:
        def save(step: int, optim_state: dict) -> None:
            if checkpoint is not None:
                _save_checkpoint(Path(checkpoint), {"fingerprint": fingerprint, "teacher_cache": targets.sha256,
                                                    "phase": phase_name, "plan": plan, "step": step,
                                                    "student": student.state_dict(), "optim": optim_state,
                                                    "heldout_start": start_loss, "heldout_pruned": pruned_loss})
        return save

    def shown(offset: int) -> Callable[[int, float], None] | None:
        return None if progress is None else (lambda step, loss: progress(offset + step, pre_steps + main_steps, loss))

    pre = None
    pruned_loss = state.get("heldout_pruned") if state else None
    if pre_steps and phase in (None, "pre"):
        pre = trainer.train(student, pre_steps, state, saver("pre"), shown(0))
        state = None
    groups_before = pruning.head_groups(student.config) if prune is not None else None  # before apply_plan renumbers
    if prune is not None:
        if plan is None:
            scores = pruning.importance(student, trainer.batches(prune.importance_batches), trainer.loss)
            plan = pruning.plan(student, prune, *scores)
            if prune.vocab and prune_vocab.is_wordpiece(teacher_dir) and student.get_output_embeddings() is None:
                used = {i for s in trainer.ids for i in s}
                plan["vocab"] = prune_vocab.plan(teacher_dir, used, prune.vocab_share)
        pruning.apply_plan(student, plan)
        if plan.get("vocab"):
            remap = prune_vocab.apply(student, plan["vocab"])
            trainer.renumber(remap)
        if phase in (None, "pre"):  # what pruning cost, before training won it back (resumed: from the checkpoint)
            pruned_loss = trainer.heldout_loss(student)
    first_epoch = max(1, math.ceil(pre_epochs)) if pre_steps else 0
    if phase == "done":  # a run killed after training: the finished student is in the checkpoint
        student.load_state_dict(state["student"])
        result = dict(state["result"], resumed_at=pre_steps + main_steps)  # nothing left to train
    else:
        result = trainer.train(student, main_steps, state, saver("main"), shown(pre_steps), first_epoch=first_epoch)
        result["precision"] = trainer.precision
        result["precision_ms"] = trainer.precision_ms
        result["heldout_end"] = trainer.heldout_loss(student)
        result["peak_rss"] = _peak_rss()
        if pre is not None:  # where this run started, in steps of the whole training; the time of both phases
            result["resumed_at"] = pre["resumed_at"]
            result["seconds"] = round(pre["seconds"] + result["seconds"], 1)
        elif result["resumed_at"]:
            result["resumed_at"] += pre_steps
        if checkpoint is not None:
            _save_checkpoint(Path(checkpoint), {"fingerprint": fingerprint, "teacher_cache": targets.sha256,
                                                "phase": "done", "plan": plan, "step": main_steps,
                                                "student": student.state_dict(), "result": result,
                                                "heldout_start": start_loss, "heldout_pruned": pruned_loss})
    _save_student(student, teacher_dir, out_dir)
    if prune is not None and plan.get("vocab"):
        prune_vocab.write_tokenizer(teacher_dir, out_dir, remap)
    seconds = round(time.perf_counter() - t0, 1)
    teacher = {"teacher_pass": {"budget": distill.teacher_memory_budget, "batches": targets.stats["teacher_batches"],
                                "batch_texts": targets.stats["batch_texts"], "seconds": targets.stats["teacher_seconds"],
                                "peak_rss_mb": round(teacher_peak / 1e6, 1), "rss_before_mb": round(mem0 / 1e6, 1),
                                "cache_mb": round(targets.bytes / 1e6, 2), "cache_sha256": targets.sha256,
                                "from_cache": not targets.stats["computed"], "rebuilt_because": targets.rebuilt,
                                "teacher_passes_saved": _passes_saved(epochs, pre_epochs, targets.stats["computed"])}}
    train = {"precision": result.get("precision"), "precision_ms": result.get("precision_ms"),
             "grad_accum": distill.grad_accum, "effective_batch": distill.grad_accum * distill.batch_size,
             "checkpointing": distill.checkpointing, "train_seconds": result.get("seconds"),
             "peak_rss_mb": round((result.get("peak_rss") or 0) / 1e6, 1),
             "heldout_texts": len(trainer.heldout), "heldout_loss_start": _round(start_loss),
             **({"heldout_loss_pruned": _round(pruned_loss)} if prune is not None else {}),
             "heldout_loss_end": _round(result.get("heldout_end"))}
    common = {"data": facts["origin"], "texts": len(facts["texts"]), "epochs": epochs, "steps": pre_steps + result["steps"],
              "final_loss": round(result["loss"], 6), "resumed_at_step": result["resumed_at"], "seconds": seconds,
              **teacher, "training": train}
    steps = []
    if distill.layers:
        steps.append({"step": "distill", "objective": kind, "teacher_layers": facts["teacher_layers"],
                      "layers": distill.layers, "kept_teacher_layers": kept_layers,
                      "teacher_params": teacher_params, "student_params": distilled_params, **common})
    if prune is not None:
        steps.append({"step": "prune", "method": "taylor-first-order", **asdict(prune), **pruning.describe(student, plan, groups_before),
                      "vocab_size": len(plan["vocab"]) if plan.get("vocab") else student.config.vocab_size,
                      "teacher_params": teacher_params, "student_params": _params(student), "trained_before_pruning": {"epochs": pre_epochs, "steps": pre_steps},
                      **({} if distill.layers else common)})
    return steps


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)


def _passes_saved(epochs: float, pre_epochs: float, computed: bool) -> float:
    """Teacher passes over the data that the cache replaced: one per epoch, less the one that filled it
    (none under one epoch: the cache was filled for the whole data, and read for part of it)."""
    return round(max(epochs + pre_epochs - (1 if computed else 0), 0.0), 2)


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _check_training_fits(folder: Path, kept_layers: list[int]) -> None:
    """Refuse, before building it, a student whose training state alone exceeds the memory available.

    fp32 AdamW keeps the weights (4 bytes a parameter) and, for each trained parameter, its gradient
    and two moments (12 bytes more); the token embeddings are frozen. Past that, only offloading the
    optimizer state (DeepSpeed's ZeRO-Offload) or a smaller student helps; slimml does not offload.
    """
    import re

    from slimml.convert.weights import numel, open_weights
    from slimml.runtime.engine.budget import available_memory, fmt_bytes

    weights = open_weights(folder)
    layer = re.compile(r"\.(?:layers?|h|block)\.(\d+)\.")
    kept = set(kept_layers)
    total = frozen = 0
    for name in weights.names():
        m = layer.search(name)
        if m and int(m.group(1)) not in kept:
            continue
        n = numel(weights, name)
        total += n
        frozen += n if "embed_tokens" in name or "word_embeddings" in name else 0
    need = 4 * total + 12 * (total - frozen)
    room = available_memory()
    if need > room:
        raise ConfigError(
            f"the student's training state (fp32 weights, gradients and AdamW moments of {total / 1e6:.0f}M parameters: "
            f"{fmt_bytes(need)}) does not fit in the {fmt_bytes(room)} available. Keep fewer layers "
            "(--distill-layers), prune (--prune), or train it with optimizer-state offload (DeepSpeed ZeRO-Offload), "
            "which slimml does not do."
        )


def _teacher_params(folder: Path) -> int:
    """The teacher's parameter count from its checkpoint's tensor shapes (nothing is loaded)."""
    from slimml.convert.weights import numel, open_weights

    weights = open_weights(folder)
    buffers = ("position_ids", "inv_freq", "token_type_ids")
    return sum(numel(weights, name) for name in weights.names() if not name.endswith(buffers))


def _params(model: Any) -> int:
    return int(sum(p.numel() for p in model.parameters()))


def _save_student(student: Any, teacher_dir: Path, out_dir: Path) -> None:
    """The student's weights and config, plus every other file of the teacher (tokenizer, pooling)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in teacher_dir.iterdir():
        if item.name in WEIGHT_FILES or item.name.startswith(("pytorch_model", "model-")) or item.suffix in (".onnx", ".h5", ".msgpack"):
            continue
        if item.is_dir():
            if item.name in ("onnx", "openvino", ".git", ".cache"):
                continue
            shutil.copytree(item, out_dir / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, out_dir / item.name)
    student.save_pretrained(str(out_dir), safe_serialization=True)


def _fingerprint(teacher_dir: Path, distill: DistillConfig, prune: PruneConfig | None, epochs: float, texts: list[str]) -> str:
    h = hashlib.sha256()
    h.update(str(teacher_dir.resolve()).encode())
    settings = {k: v for k, v in asdict(distill).items() if k not in ("teacher_memory_budget", "checkpoint_every")}
    h.update(json.dumps({**settings, "data": str(distill.data), "epochs": epochs,
                         "prune": asdict(prune) if prune else None}, sort_keys=True).encode())
    for t in texts:
        h.update(t.encode())
    return h.hexdigest()


def _load_checkpoint(path: str | os.PathLike | None, fingerprint: str, cache_sha: str) -> dict[str, Any] | None:
    """The resume state in ``path`` when it belongs to this run, else None (start over).

    Loaded with ``weights_only=True``: the checkpoint holds tensors and plain values only, so a
    file planted beside the output that would run code when unpickled is refused, never run.

    Raises:
        ConfigError: the file is there but is not a checkpoint this slimml wrote, naming it.
    """
    import torch

    if path is None or not Path(path).is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError for anything but tensors and plain values; a torn file
        raise ConfigError(
            f"the resume checkpoint {path} cannot be read as one slimml wrote ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160] if str(e) else 'unreadable'}); it was not loaded. Delete it to train from the start."
        ) from None
    if not isinstance(state, dict) or state.get("fingerprint") != fingerprint:
        return None
    return state if state.get("teacher_cache") == cache_sha else None  # targets rebuilt: train again on them


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write the resume state atomically (a kill mid-save leaves the previous checkpoint whole),
    readable by this user only."""
    import torch

    from slimml.runtime.artifact.replace import replace_file

    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, lambda f: torch.save(state, f), mode=0o600)

