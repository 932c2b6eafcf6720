"""The ``slimml`` command line: thin Typer commands over the library, one module a command.

Errors from the library come out as one line on stderr and exit code 1; set ``SLIMML_DEBUG=1``
to see the traceback.
"""

from slimml.cli.common import app

# Each module registers its command on ``app``; imported in the order ``slimml --help`` lists them.
from slimml.cli import convert, quantize, info, run, evaluate, bench, generate, serve  # noqa: F401  (isort: skip)
from slimml.cli.entry import main

__all__ = ["app", "main"]
