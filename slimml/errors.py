"""One error family for slimml.

Every message says what was wrong, where, and what to do about it. The CLI turns any
``SlimmlError`` into one clean line and exit code 1 (set ``SLIMML_DEBUG=1`` for the traceback).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager


class SlimmlError(Exception):
    """Base class of every error slimml raises on purpose."""


class SourceError(SlimmlError):
    """The model to convert is missing, unreadable or of a kind slimml does not know."""


class ConfigError(SlimmlError):
    """An option or config value is out of range or contradicts another."""


class ArtifactError(SlimmlError):
    """An artifact folder is missing, malformed, tampered with or of an unknown format."""


class IntegrityError(ArtifactError):
    """A file of an artifact does not match the size or sha256 its manifest records."""


class FeedError(SlimmlError):
    """Inputs given to a model have the wrong names, dtypes or shapes."""


class OutOfMemoryError(FeedError):
    """A batch needed more memory than the machine gave: the same inputs fit in smaller calls, or later
    (a server answers 503 with ``Retry-After``, not the client's fault)."""


class TooLargeError(FeedError):
    """An input larger than what may be read where it is given (an image's pixels): its size is at
    fault, not its form (a server answers 413)."""


class DeviceError(SlimmlError):
    """The requested device or execution provider is not available."""


class DataError(SlimmlError):
    """A data file (evaluation, calibration, distillation) is missing, empty or malformed."""


class ExportError(SlimmlError):
    """Exporting a model to ONNX failed."""


class QuantizeError(SlimmlError):
    """Quantizing an artifact failed inside the quantizer (ONNX Runtime's tools, NNCF)."""


class StageError(SlimmlError):
    """A pipeline stage (a Ray actor owning some shards) died, or did not answer in time."""


class RequestError(SlimmlError):
    """An HTTP request the server refuses: ``status`` is its code (4xx; 5xx where the server could not
    answer it: 503 when it should be retried), the message says how to fix it,
    ``param`` names the request field at fault (OpenAI's ``error.param``), when there is one."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


class TaskError(SlimmlError):
    """A method the artifact's task does not have (``encode`` on a classifier, ``generate`` on an
    encoder). ``task`` is the artifact's task, ``method`` the one called, ``alternatives`` the
    methods that would work (``run`` always does)."""

    def __init__(self, message: str, task: str, method: str, alternatives: tuple[str, ...] = ("run",)):
        super().__init__(message)
        self.task = task
        self.method = method
        self.alternatives = tuple(alternatives)


class NoChatTemplateError(SlimmlError):
    """A chat asked of a language model whose artifact has no chat template: each caller says the fix
    in its own terms (``use_chat_template`` in Python, ``--chat-template`` on the command line,
    ``POST /v1/completions`` over HTTP)."""


class MissingExtraError(SlimmlError, ImportError):
    """A call needs a package of an extra this install does not have (``convert`` on the base
    install): the message names the package and the ``pip install 'slimml[EXTRA]'`` that brings it.
    Also an ImportError, for code that catches those."""


# the packages of each extra a call may import, by their module name (None: of the base install)
EXTRAS: dict[str, str | None] = {
    "torch": "convert", "transformers": "convert", "optimum": "convert", "nncf": "convert", "sympy": None,
    "onnx_ir": "convert", "gguf": "convert", "accelerate": "convert", "sentence_transformers": "convert",
    "ray": "serve", "orjson": "serve", "matplotlib": "bench", "PIL": "vision"}


def missing_extra(e: ImportError, what: str = "this command") -> MissingExtraError | None:
    """``e`` as one line naming the extra to install, where it names a package of one (``No module
    named 'torch'``, ONNX Runtime's ``missing 'sympy'``); else None."""
    from importlib.util import find_spec

    if isinstance(e, MissingExtraError):
        return e
    names = re.findall(r"missing '([\w.]+)'", str(e))  # ONNX Runtime's words for a missing sympy
    if isinstance(e, ModuleNotFoundError):  # not "cannot import name X" from a package that is there
        names.insert(0, e.name or "")
    for name in names:
        top = name.split(".")[0]
        if top in EXTRAS and find_spec(top) is None:  # not installed (an old version is another problem)
            group = EXTRAS[top]
            if group is None:  # a package of the base install, removed since
                return MissingExtraError(f"{what} needs the {top} package, which is not installed; pip install {top} "
                                         "(slimml's base install brings it).")
            after = " (after pip install torch==2.13.0)" if group == "convert" else ""
            return MissingExtraError(f"{what} needs the {top} package, which is not installed; "
                                     f"pip install 'slimml[{group}]'{after}.")
    return None


@contextmanager
def extras_for(what: str) -> Iterator[None]:
    """Inside: an ImportError of an extra's package becomes a :class:`MissingExtraError` naming
    ``what`` (``"convert"``) and the extra."""
    try:
        yield
    except ImportError as e:
        missing = missing_extra(e, what)
        if missing is None or missing is e:
            raise
        raise missing from e
