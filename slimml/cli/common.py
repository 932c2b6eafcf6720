"""What the commands share: the Typer app, the consoles, and the argument types several commands take."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.rich_utils
from rich.console import Console

app = typer.Typer(
    name="slimml",
    help="Make trained models smaller and faster, and run them in layer shards on CPU or a small GPU.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
# Piped into a file or another program, a line stays one line: wrapping at a guessed width of 80 splits
# figures and messages in the middle of a phrase that scripts and logs look for.
# No markup: what they print holds the user's texts, model outputs, paths and pip extras ("[bench]"),
# which rich's markup would eat or refuse ("[/]"); bold is asked for with Text styles.
console = Console(soft_wrap=not (sys.stdout and sys.stdout.isatty()), markup=False)
if not (sys.stdout and sys.stdout.isatty()) and typer.rich_utils.MAX_WIDTH is None:  # --help piped (grep, a file):
    typer.rich_utils.MAX_WIDTH = 120  # at 80 columns Typer cut long flags ("--repetition-penal…") in its table
err = Console(stderr=True, soft_wrap=not (sys.stderr and sys.stderr.isatty()), markup=False)

Artifact = Annotated[Path, typer.Argument(help="An artifact folder written by `slimml convert`.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for machines.")]
Progress = Annotated[bool, typer.Option("--progress", help="Show a progress bar over the batches (on stderr).")]
BaselineIn = Annotated[Optional[Path], typer.Option(help="Compare with this baseline file; exit 3 on a regression.")]
BaselineOut = Annotated[Optional[Path], typer.Option(help="Write what this run measured as a baseline file (with --baseline: only if it passes).")]
