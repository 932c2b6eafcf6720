"""``slimml quantize``: a float artifact into a quantized one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from slimml.cli.common import Artifact, AsJson, app, console
from slimml.cli.options import Options, OptionValues, config_options
from slimml.convert.config import ConvertConfig
from slimml.errors import SlimmlError
from slimml.quantize.config import QuantizeOptions


@app.command("quantize")
@config_options(quantizing=Options(QuantizeOptions, defaults={"scheme": "int8"}),
                checks=Options(ConvertConfig, only=("eval_text",)))
def quantize_(
    artifact: Artifact,
    out: Annotated[Path, typer.Option("-o", "--out", help="The quantized artifact folder.")],
    quantizing: OptionValues = None,
    checks: OptionValues = None,
    as_json: AsJson = False,
):
    """Quantize a float artifact into a new artifact folder (each shard, calibrated as the whole)."""
    from slimml.quantize import quantize as do_quantize

    quantize = quantizing["scheme"]
    config = quantizing.build().to_config()
    if config is None:
        raise SlimmlError("--quantize none leaves the artifact as it is; choose a scheme, e.g. --quantize int8.")
    if checks["eval_text"] is not None:
        config.eval_text = checks["eval_text"]  # a language model's guard scores perplexity on it
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
