"""The entry point: the commands run with slimml's errors as one line and an exit code, and SIGTERM as Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys

import typer
from rich.text import Text

from slimml.cli.common import app, err
from slimml.errors import SlimmlError, missing_extra
from slimml.runtime.artifact.atomic import stop_asked, stop_signal


def _terminated(signum, frame) -> None:
    stop_asked(signum)  # should the exception be lost (raised in a __del__), no artifact is swapped in after all
    raise SystemExit(128 + signum)  # unwind as Ctrl-C does: a convert removes its half-written folder


def _interrupted(signum, frame) -> None:
    stop_asked(signum)
    raise KeyboardInterrupt


def _error(message: str) -> None:
    """One line on stderr: "error: " and the message, as written (a path or text "[x]" is not markup)."""
    err.print(Text("error:", style="bold red") + Text(f" {message}"), highlight=False, soft_wrap=True)


def _plain_warnings() -> None:
    """slimml's warnings as their one line on stderr. Without a handler of its own they went to
    Python's last resort, or, once a library had called ``logging.basicConfig`` (ONNX Runtime's
    quantizer does), printed as ``WARNING:slimml:slimml: ...``."""
    import logging

    class CurrentStderr(logging.StreamHandler):  # sys.stderr as it is when a line is written: rich swaps in a
        stream = property(lambda self: sys.stderr, lambda self, value: None)  # proxy under its spinner

    log = logging.getLogger("slimml")
    if not log.handlers:
        handler = CurrentStderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.setLevel(logging.WARNING)
        log.addHandler(handler)
        log.propagate = False


_kept: list[tuple] = []  # what keep_resume_files saw: Typer turns a command's Ctrl-C into exit code 130, exception gone


def keep_resume_files(e: BaseException) -> None:
    """Called by a command with the interrupt that stops it, so the last line can name the resume files a
    distillation left (see :func:`_stopped`)."""
    found = _left_by(e)
    if found:
        _kept.append(found)


def _left_by(e: BaseException | None) -> tuple | None:
    """``(out, files)``: the output a stopped distillation did not write and the resume files it left beside it
    (the convert pipeline names them on the interrupt; click wraps Ctrl-C in an Abort raised from it)."""
    for _ in range(4):
        if e is None:
            return None
        if getattr(e, "resume_files", None):
            return e.resume_out, list(e.resume_files)
        e = e.__cause__ or e.__context__
    return None


def _stopped(name: str, left: tuple | None) -> str:
    """The last line of a stopped command: nothing half-written is left, or, for a distillation, that its output
    was not written, that the same command resumes, and which files to delete to give up."""
    if not left:
        return f"stopped ({name}); nothing half-written is left."
    out, files = left
    how = "from the checkpoint" if any(p.name.endswith(".distill-checkpoint.pt") for p in files) else "where it stopped"
    kept = " (the artifact there is the earlier one)" if out.exists() else ""
    return (f"stopped ({name}); {out} was not written{kept}. Run the same command again to resume {how}, or delete "
            f"{', '.join(p.name for p in files)} in {files[0].parent} to give up.")


def main() -> None:
    """Entry point: run the app, turning slimml errors into one line and exit code 1, and a
    command line Typer cannot parse (an unknown option, ``--seed abc``) into one line and exit code 2.
    SIGTERM ends a command as Ctrl-C does, leaving nothing half-written (exit 143); ``serve``
    installs its own handler."""
    signal.signal(signal.SIGTERM, _terminated)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the shell ignores it (cmd &)
        signal.signal(signal.SIGINT, _interrupted)
    _plain_warnings()
    left = None  # a stopped distillation's resume files (see _stopped)
    try:
        code = app(standalone_mode=False)
    except (KeyboardInterrupt, typer.Abort, SystemExit) as e:
        left = _left_by(e)
        stopped = stop_signal()
        if stopped is None or (isinstance(e, SystemExit) and e.code != 128 + stopped):
            if isinstance(e, typer.Abort):
                err.print("aborted.")
                sys.exit(1)
            raise
        code = 128 + stopped
    except SlimmlError as e:
        if os.environ.get("SLIMML_DEBUG"):
            raise
        _error(str(e))
        sys.exit(1)
    except BrokenPipeError:  # `slimml info ART | head -2`: the reader had enough
        if os.environ.get("SLIMML_DEBUG"):
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the flush at exit would fail again
        sys.exit(1)  # quietly, as rich's consoles do when the pipe closes under them
    except OSError as e:  # a path the library did not expect to fail on (a name too long, a link loop)
        if os.environ.get("SLIMML_DEBUG"):
            raise
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        _error(f"{e.strerror or e}{where}; check the path and its permissions (SLIMML_DEBUG=1 shows the traceback).")
        sys.exit(1)
    except MemoryError as e:  # numpy's _ArrayMemoryError too: a batch or input the machine cannot hold
        if os.environ.get("SLIMML_DEBUG"):
            raise
        what = " ".join(str(e).split())[:200]
        _error(f"out of memory{f' ({what})' if what else ''}; use fewer rows or shorter inputs a call (--batch), or a "
               "memory budget (--memory-budget).")
        sys.exit(1)
    except ImportError as e:  # a command of an extra this install does not have (quantize on the base install)
        missing = missing_extra(e)
        if missing is None or os.environ.get("SLIMML_DEBUG"):
            raise
        _error(str(missing))
        sys.exit(1)
    except Exception as e:
        if not (hasattr(e, "format_message") and hasattr(e, "exit_code")):
            raise
        # click's UsageError, BadParameter, NoSuchOption (vendored by Typer): the user's command line
        where = e.ctx.command_path if getattr(e, "ctx", None) is not None else "slimml"
        if not e.format_message().strip():  # `slimml` alone: its help was printed, nothing was wrong
            sys.exit(e.exit_code)
        _error(f"{e.format_message().rstrip('.')}; see `{where} --help`.")
        sys.exit(e.exit_code)
    stopped = stop_signal()
    if stopped is not None and code == 128 + stopped:  # click hands Ctrl-C back as 130
        err.print(_stopped(signal.Signals(stopped).name, left or (_kept[-1] if _kept else None)), highlight=False)
    sys.exit(code if isinstance(code, int) else 0)  # typer.Exit(n) comes back as n without standalone mode
