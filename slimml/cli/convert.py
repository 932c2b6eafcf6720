"""``slimml convert``: export, shard, check (and distill, prune, quantize) a model into an artifact."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from slimml.cli.common import AsJson, app, console, err
from slimml.cli.options import Options, OptionValues, config_options
from slimml.convert.config import ConvertConfig, DistillConfig, ExportConfig, PruneConfig, ShardConfig
from slimml.errors import SlimmlError
from slimml.quantize.config import QuantizeOptions


@app.command()
@config_options(
    export=Options(ExportConfig, only=("task", "opset")),
    checks=Options(ConvertConfig, only=("verify", "eval_text")),
    distill=Options(DistillConfig, prefix="distill", only=("layers", "data", "epochs")),
    prune=Options(PruneConfig, defaults={"fraction": None}),  # no --prune: no pruning
    compare=Options(ConvertConfig, only=("compare_on",)),
    training=Options(DistillConfig, prefix="distill", only=("teacher_memory_budget", "batch_size", "grad_accum",
                                                            "mixed_precision", "checkpointing")),
    exporter=Options(ExportConfig, only=("exporter",)),
    quantizing=Options(QuantizeOptions),
)
def convert(
    source: Annotated[Optional[str], typer.Argument(help="HF model folder, .onnx, .gguf, .py or torch checkpoint. Default: all-MiniLM-L6-v2.")] = None,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Artifact folder. Default: artifacts/<name>, with -d3-p50 for a student or -int8 (the scheme) for a quantized model, so the float artifact is never replaced.")] = None,
    shards: Annotated[str, typer.Option(help="'per-layer' or a number of shards balanced by weight bytes.")] = "per-layer",
    shard_size: Annotated[Optional[float], typer.Option(help="Largest shard in MB of weights (instead of --shards).")] = None,
    export: OptionValues = None,
    checks: OptionValues = None,
    distill: OptionValues = None,
    prune: OptionValues = None,
    compare: OptionValues = None,
    training: OptionValues = None,
    exporter: OptionValues = None,
    quantizing: OptionValues = None,
    as_json: AsJson = False,
):
    """Export a model to ONNX, split it into layer shards, check them, and write an artifact folder."""
    from slimml.convert import convert as do_convert

    qconfig = quantizing.build().to_config()
    if qconfig is not None and checks["eval_text"] is not None:
        qconfig.eval_text = checks["eval_text"]  # a language model's guard scores perplexity on it
    student = distill["layers"] is not None or prune["fraction"] is not None
    if training.changed() and not student:
        raise SlimmlError(f"{', '.join(training.changed())} shape distillation; give --distill-layers N or --prune F with it.")
    if distill.changed() and not student:
        raise SlimmlError("--distill-data and --distill-epochs need --distill-layers N or --prune F.")
    config = ConvertConfig(
        export=export.build(**exporter.values), shard=ShardConfig.parse(shards, shard_size), quantize=qconfig,
        distill=distill.build(**training.values) if student else None,
        prune=prune.build() if prune["fraction"] is not None else None, **checks.values, **compare.values,
    )
    if student:
        try:
            report = _convert_with_progress(do_convert, source, out, config)
        except (KeyboardInterrupt, SystemExit) as e:  # stopped: the last line names the resume files left
            from slimml.cli.entry import keep_resume_files

            keep_resume_files(e)
            raise
    else:
        with console.status("converting", spinner="dots") as status:
            report = do_convert(source, out, config, on_step=lambda msg: status.update(f"{msg}..."))
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
        return
    table = Table(title=f"slimml convert: {report.name} -> {report.out}", show_header=False)
    table.add_row("task", report.task)
    table.add_row("shards", str(report.shards))
    table.add_row("size", f"{report.size_mb:.1f} MB")
    for key, value in report.checks.items():
        if isinstance(value, dict):
            continue
        table.add_row(key.replace("_", " "), f"{value:.3g}" if isinstance(value, float) else str(value))
    for s in report.steps:  # the student against its teacher, when distilled or pruned
        if s["step"] == "distill":
            table.add_row("distill", f"{s['teacher_layers']} -> {s['layers']} layers (teacher layers {s['kept_teacher_layers']}), "
                          f"{s['teacher_params'] / 1e6:.1f}M -> {s['student_params'] / 1e6:.1f}M params, {s['steps']} steps")
        elif s["step"] == "prune":
            removed = f" ({s['heads_removed']:.0%} removed)" if s.get("heads_removed") is not None else ""
            table.add_row("prune", f"{s['heads_per_layer']} heads a layer{removed}, {s['ffn_per_layer']} FFN neurons a "
                          f"layer, vocabulary {s['vocab_size']}: {s['student_params'] / 1e6:.1f}M params")
        if "teacher_pass" in s:
            t, tr = s["teacher_pass"], s["training"]
            ran = "from the cache" if t["from_cache"] else f"{t['batches']} batches of {t['batch_texts']} texts"
            rebuilt = f"; rebuilt: {t['rebuilt_because']}" if t["rebuilt_because"] else ""
            table.add_row("teacher pass", f"{ran}, {t['seconds']} s, peak RSS {t['peak_rss_mb']:.0f} MB, cache "
                          f"{t['cache_mb']:.1f} MB ({t['teacher_passes_saved']} teacher passes saved){rebuilt}")
            table.add_row("training", _training_row(s))
            table.add_row("held-out loss", _heldout_row(tr))
    table.add_row("time", f"{report.seconds:.1f} s")
    console.print(table)
    if report.teacher:
        console.print(_teacher_table(report.teacher))


def _training_row(s: dict) -> str:
    """The precision trained in, the steps (and where a resumed run took up), batch, the time of all the
    training (before pruning too), the final training loss, peak RSS."""
    tr = s["training"]
    precision = {"off": "fp32", None: "precision not recorded"}.get(tr["precision"], tr["precision"])
    resumed = f", resumed at step {s['resumed_at_step']} of {s['steps']}" if s.get("resumed_at_step") else ""
    loss = f", final loss {s['final_loss']:.4g}" if s.get("final_loss") is not None else ""
    return (f"{precision}, {s['steps']} steps{resumed}, batch {tr['effective_batch']} (accumulate {tr['grad_accum']}), "
            f"checkpointing {'on' if tr['checkpointing'] else 'off'}, {tr['train_seconds']} s{loss}, "
            f"peak RSS {tr['peak_rss_mb']:.0f} MB")


def _heldout_row(tr: dict) -> str:
    """The loss on the texts kept out of training: at the start, after pruning (when pruned), at the end."""
    if not tr["heldout_texts"]:
        return "none (fewer than 80 texts: none kept out of training)"
    pruned = f" -> {_loss(tr['heldout_loss_pruned'])} (pruned)" if "heldout_loss_pruned" in tr else ""
    return (f"{_loss(tr['heldout_loss_start'])}{pruned} -> {_loss(tr['heldout_loss_end'])} "
            f"({tr['heldout_texts']} texts kept out of training)")


def _loss(x: float | None) -> str:
    """A loss to 4 figures; a loss is never below 0, so rounding's -0 (a student equal to its teacher) is 0."""
    return "?" if x is None else f"{float(x) if float(x) > 0 else 0.0:.4g}"


def _teacher_table(c: dict) -> Table:
    """Teacher against student: parameters, MB, latency (batch 1 x seq 128, timed interleaved), STSb."""
    table = Table(title="teacher against student")
    for col in ("", "params", "MB", "latency b1 s128", "STS (Spearman x100)"):
        table.add_column(col, justify="right")
    for name in ("teacher", "student"):
        r = c[name]
        ratio = "1.00x" if name == "teacher" else f"{c['latency_ratio']:.2f}x"
        table.add_row(name, f"{r['params'] / 1e6:.1f} M", f"{r['mb']:.1f}", f"{r['latency_ms']:.2f} ms ({ratio})",
                      f"{r['stsb']:.2f}" if "stsb" in r else "(--compare-on FILE)")
    return table


def _convert_with_progress(do_convert, source, out, config):
    """Convert with a progress bar for the training steps and a spinner line for the stage; off a
    terminal (a log file, CI), where the bar draws nothing, with plain lines (:class:`_PlainProgress`)."""
    if not err.is_terminal:
        shown = _PlainProgress(lambda line: err.print(line, highlight=False, soft_wrap=True))
        return do_convert(source, out, config, on_step=shown.on_step, on_progress=shown.on_progress)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeRemainingColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[loss]}"), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("converting", total=None, loss="")

        def on_step(msg):
            bar.update(task, description=f"{msg}...", total=None, completed=0, loss="")

        def on_progress(done, total, loss):  # loss None: texts through the teacher
            bar.update(task, total=total, completed=done, loss="texts" if loss is None else f"loss {loss:.4f}")

        return do_convert(source, out, config, on_step=on_step, on_progress=on_progress)


class _PlainProgress:
    """Progress as plain lines, for a stderr that is not a terminal: each stage's name as it starts, and
    through the teacher pass and the training a line at each tenth of the way or after 30 s without
    one, whichever comes first (not one a step: a log of a 20-minute distillation stays readable)."""

    EVERY_S = 30.0

    def __init__(self, say, clock=time.monotonic):
        self.say, self.clock = say, clock
        self._start()

    def _start(self) -> None:
        self.first = None  # (done, time) of the stage's first report: the rate is measured from it
        self.last_t, self.tenth = self.clock(), None

    def on_step(self, msg: str) -> None:
        self._start()
        self.say(f"{msg}...")

    def on_progress(self, done: int, total: int, loss: float | None) -> None:
        now = self.clock()
        tenth = done * 10 // max(total, 1)
        if self.first is None:
            self.first, self.tenth = (done, now), tenth
            if done < total:
                return
        if done < total and tenth == self.tenth and now - self.last_t < self.EVERY_S:
            return
        self.last_t, self.tenth = now, tenth
        d0, t0 = self.first
        rate = (now - t0) / (done - d0) if done > d0 else None
        pace = "" if rate is None else f", {rate:.2f} s/{'step' if loss is not None else 'text'}"
        left = "" if rate is None or done >= total else f", {_duration(rate * (total - done))} left"
        if loss is None:  # the teacher's outputs, text by text
            self.say(f"teacher pass: {done}/{total} texts{pace}{left}")
        else:
            self.say(f"training: step {done}/{total}, loss {loss:.4g}{pace}{left}")


def _duration(seconds: float) -> str:
    """``42 s``, ``16 min 10 s``, ``2 h 05 min``."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"
