"""A regression gate's output: the comparison with a baseline printed, the run saved, exit 3 on a regression."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from slimml.cli.common import console, err


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
