"""A regression gate's output: the comparison with a baseline printed, the run saved, exit 3 on a regression."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer

from slimml.cli.common import console, err
from slimml.errors import ConfigError

log = logging.getLogger("slimml")
GATE_RUNS = 10  # fewer timed runs than this, and a latency gate is one burst of load away from its verdict
GATE_PAIRS = 50  # fewer STS pairs, and Spearman moves by points with one pair's rank
GATE_TOKENS = 256  # fewer tokens of text, and a perplexity is a few windows' chance


def counted(count: int, unit: str) -> str:
    """``1 token``, ``1,001 tokens``: a count as a gate's lines say it."""
    return f"{count:,} {unit}{'' if count == 1 else 's'}"


def refuse_ungated(tolerances: dict[str, float | None], gated: bool, against: bool = False) -> None:
    """Refuse a tolerance flag given (``tolerances``: flag -> value, None where not given) without what
    it compares the run with (``gated``: --baseline, or bench's --against where ``against``): such a
    gate step was ignored, and would pass forever."""
    given = [flag for flag, value in tolerances.items() if value is not None]
    if given and not gated:
        raise ConfigError(f"{given[0]} gates this run against {'a baseline or a reference' if against else 'a baseline'}; "
                          f"give --baseline FILE (saved by --save-baseline){' or --against ARTIFACT' if against else ''}, "
                          "or drop it.")


def with_baseline(payload, now, old, old_path, save_path, tol) -> None:
    """Save and/or check a regression baseline; print the diff; exit 3 on a regression.

    ``payload`` is the --json output (printed here, with the comparison added) or None.
    """
    from slimml.runtime.tools.baseline import REGRESSION_EXIT_CODE, compare

    report = compare(old, now, tol) if old is not None else None
    regressed = report is not None and not report.ok
    if save_path is not None and not regressed:  # a regressed run never becomes the baseline it failed
        now.save(save_path)
    if payload is not None:
        if report is not None:
            payload["baseline"] = report.to_json()
        if save_path is not None:
            payload["baseline_saved"] = None if regressed else str(save_path)  # a regressed run is not saved
        print(json.dumps(payload))
    else:
        if save_path is not None:
            where = Path(save_path).absolute()
            console.print(f"baseline not saved to {where}: this run regressed" if regressed
                          else f"baseline saved to {where}", highlight=False, markup=False, soft_wrap=True)
        if report is not None:
            console.print(report.format(str(old_path)), highlight=False, markup=False, soft_wrap=True)
    if report is not None and not report.ok:
        if payload is not None:
            err.print(report.format(str(old_path)), highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(REGRESSION_EXIT_CODE)
