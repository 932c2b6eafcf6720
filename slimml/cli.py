"""The ``slimml`` command line: thin Typer commands over the library.

Errors from the library come out as one line on stderr and exit code 1; set ``SLIMML_DEBUG=1``
to see the traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from slimml.errors import SlimmlError

app = typer.Typer(
    name="slimml",
    help="Make trained models smaller and faster, and run them in layer shards on CPU or a small GPU.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()
err = Console(stderr=True)

Artifact = Annotated[Path, typer.Argument(help="An artifact folder written by `slimml convert`.")]
Device = Annotated[str, typer.Option(help="cpu or cuda.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for machines.")]
Quantize = Annotated[str, typer.Option("--quantize", help="none, int8 (best for --target), int8-dynamic, int8-static, int8-weights, int4-weights, fp16 (cuda).")]
Calibration = Annotated[Optional[Path], typer.Option("--calibration", help="Calibration texts: one per line, or an STS CSV. Default: a built-in corpus.")]
MaxDrop = Annotated[Optional[float], typer.Option("--max-drop", help="Accuracy guard: keep sensitive shards float until the drop is at most this.")]
EvalFile = Annotated[Optional[Path], typer.Option("--eval", help="STS CSV the guard measures the drop on (Spearman x100 points).")]
Target = Annotated[str, typer.Option("--target", help="cpu or cuda: what the quantized model will run on.")]
KeepBest = Annotated[bool, typer.Option("--keep-best", help="If --max-drop cannot be met, write the best model found instead of failing.")]


@app.command()
def convert(
    source: Annotated[Optional[str], typer.Argument(help="HF model folder, .onnx, .py or torch checkpoint. Default: all-MiniLM-L6-v2.")] = None,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Artifact folder. Default: artifacts/<name>.")] = None,
    shards: Annotated[str, typer.Option(help="'per-layer' or a number of shards balanced by weight bytes.")] = "per-layer",
    shard_size: Annotated[Optional[float], typer.Option(help="Largest shard in MB of weights (instead of --shards).")] = None,
    task: Annotated[str, typer.Option(help="Hugging Face task to export, or 'auto'.")] = "auto",
    opset: Annotated[Optional[int], typer.Option(help="ONNX opset.")] = None,
    verify: Annotated[bool, typer.Option(help="Check the artifact against the original model.")] = True,
    quantize: Quantize = "none",
    calibration: Calibration = None,
    max_drop: MaxDrop = None,
    eval_file: EvalFile = None,
    target: Target = "cpu",
    keep_best: KeepBest = False,
    as_json: AsJson = False,
):
    """Export a model to ONNX, split it into layer shards, check them, and write an artifact folder."""
    from slimml.convert import ConvertConfig, ExportConfig, ShardConfig
    from slimml.convert import convert as do_convert
    from slimml.quantize.config import scheme_config

    qconfig = scheme_config(quantize, target, calibration, max_drop, eval_file, keep_best)
    config = ConvertConfig(export=ExportConfig(opset=opset, task=task), shard=ShardConfig.parse(shards, shard_size), verify=verify,
                           quantize=qconfig)
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
        table.add_row(key.replace("_", " "), f"{value:.3g}" if isinstance(value, float) else str(value))
    table.add_row("time", f"{report.seconds:.1f} s")
    console.print(table)


@app.command("quantize")
def quantize_(
    artifact: Artifact,
    out: Annotated[Path, typer.Option("-o", "--out", help="The quantized artifact folder.")],
    quantize: Quantize = "int8",
    calibration: Calibration = None,
    max_drop: MaxDrop = None,
    eval_file: EvalFile = None,
    target: Target = "cpu",
    keep_best: KeepBest = False,
    as_json: AsJson = False,
):
    """Quantize a float artifact into a new artifact folder (each shard, calibrated as the whole)."""
    from slimml.quantize import quantize as do_quantize
    from slimml.quantize.config import scheme_config

    config = scheme_config(quantize, target, calibration, max_drop, eval_file, keep_best)
    if config is None:
        raise SlimmlError("--quantize none leaves the artifact as it is; choose a scheme, e.g. --quantize int8.")
    with console.status("quantizing", spinner="dots") as status:
        report = do_quantize(artifact, out, config, on_step=lambda msg: status.update(f"{msg}..."))
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
        return
    table = Table(title=f"slimml quantize: {artifact} -> {report.out}", show_header=False)
    table.add_row("scheme", f"{quantize} ({report.scheme})")
    table.add_row("size", f"{report.float_size_mb:.1f} MB -> {report.size_mb:.1f} MB")
    table.add_row("quantized shards", ", ".join(map(str, report.quantized_shards)))
    for index, why in report.float_shards.items():
        table.add_row(f"shard {index} float", why)
    for key, value in report.checks.items():
        table.add_row(key.replace("_", " "), f"{value:.4g}" if isinstance(value, float) else str(value))
    table.add_row("time", f"{report.seconds:.1f} s")
    console.print(table)


@app.command()
def info(artifact: Artifact, as_json: AsJson = False):
    """Show an artifact's manifest as a table."""
    from slimml.runtime.manifest import read_manifest

    m = read_manifest(artifact)
    if as_json:
        print(json.dumps(m.to_json(), indent=2))
        return
    console.print(f"[bold]{m.name}[/bold]  task={m.task}  format v{m.format_version}  slimml {m.slimml_version}")
    console.print("steps: " + " -> ".join(s.get("step", "?") for s in m.steps))
    console.print("inputs: " + ", ".join(f"{t.name} {t.dtype}{t.shape}" for t in m.inputs))
    console.print("outputs: " + ", ".join(f"{t.name} {t.dtype}{t.shape}" for t in m.outputs))
    table = Table("shard", "file", "MB", "layers", "inputs from", "outputs")
    for s in m.shards:
        size = sum(f.bytes for f in m.files if f.path in (s.file, s.data))
        sources = sorted({"model" if t.source == "input" else f"shard {t.source}" for t in s.inputs})
        table.add_row(str(s.index), s.file, f"{size / 1e6:.1f}", ", ".join(x.rsplit("/", 1)[-1] for x in s.layers),
                      ", ".join(sources), str(len(s.outputs)))
    console.print(table)
    console.print(f"total {m.total_bytes / 1e6:.1f} MB in {len(m.files)} files; checks: {m.checks}")


@app.command()
def run(
    artifact: Artifact,
    texts: Annotated[Optional[list[str]], typer.Argument(help="Texts to embed (sentence-embedding artifacts).")] = None,
    input: Annotated[Optional[Path], typer.Option("--input", help="An .npz file of named input arrays.")] = None,
    device: Device = "cpu",
    as_json: AsJson = False,
):
    """Run an artifact on texts or on arrays from an .npz file and print the outputs."""
    import numpy as np

    from slimml.runtime import load

    if bool(texts) == bool(input):
        raise SlimmlError("give either TEXT arguments or --input FILE.npz, not both or neither.")
    model = load(artifact, device=device)
    if texts:
        outputs = {"embeddings": model.encode(list(texts))} if model.manifest.pooling else model.run(model.tokenize(list(texts)))
    else:
        if not input.is_file():
            raise SlimmlError(f"--input {input} does not exist; save arrays with np.savez(path, input_ids=...).")
        with np.load(input, allow_pickle=False) as npz:
            outputs = model.run({k: npz[k] for k in npz.files})
    if as_json:
        print(json.dumps({k: {"shape": list(v.shape), "dtype": str(v.dtype), "data": v.tolist()} for k, v in outputs.items()}))
        return
    np.set_printoptions(precision=4, suppress=True, threshold=20, edgeitems=3)
    for name, value in outputs.items():
        console.print(f"[bold]{name}[/bold] {value.dtype}{list(value.shape)}")
        console.print(str(value))


@app.command("eval")
def eval_(
    artifact: Artifact,
    data: Annotated[Path, typer.Option(help="CSV with sentence1,sentence2,score (STS style).")],
    device: Device = "cpu",
    batch_size: Annotated[int, typer.Option(help="Sentences per batch.")] = 64,
    as_json: AsJson = False,
):
    """Spearman x100 of cosine similarity against gold scores (STS benchmark style)."""
    from slimml.runtime import load
    from slimml.runtime.evaluate import evaluate_sts, read_sts

    read_sts(data)  # a bad data file fails before the model loads
    result = evaluate_sts(load(artifact, device=device), data, batch_size=batch_size)
    if as_json:
        print(json.dumps(result.to_json()))
    else:
        console.print(f"{result.metric} x100 = {result.score:.2f} on {result.pairs} pairs ({data.name})")


@app.command()
def bench(
    artifact: Artifact,
    batch: Annotated[int, typer.Option(help="Batch size.")] = 1,
    seq: Annotated[int, typer.Option(help="Sequence length for dynamic axes.")] = 128,
    runs: Annotated[int, typer.Option(help="Timed runs.")] = 50,
    device: Device = "cpu",
    as_json: AsJson = False,
):
    """Latency p50/p90, throughput, peak RSS and size of an artifact."""
    from slimml.runtime import load
    from slimml.runtime.bench import bench as do_bench

    if batch < 1 or seq < 1 or runs < 1:
        raise SlimmlError(f"--batch, --seq and --runs must be >= 1 (got {batch}, {seq}, {runs}).")
    result = do_bench(load(artifact, device=device), batch=batch, seq=seq, runs=runs)
    if as_json:
        print(json.dumps(result.to_json()))
        return
    console.print(
        f"batch {batch} x seq {seq} on {device}: p50 {result.p50_ms:.2f} ms, p90 {result.p90_ms:.2f} ms, "
        f"{result.throughput_per_s:.1f} items/s, peak RSS {result.peak_rss_mb:.0f} MB, model {result.model_mb:.1f} MB"
    )


def main() -> None:
    """Entry point: run the app, turning slimml errors into one line and exit code 1."""
    try:
        app()
    except SlimmlError as e:
        if os.environ.get("SLIMML_DEBUG"):
            raise
        err.print(f"[bold red]error:[/bold red] {e}", highlight=False, soft_wrap=True)
        sys.exit(1)
