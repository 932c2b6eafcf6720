"""Calibration texts: from a file (text lines or an STS CSV) or a built-in corpus that needs no download.

The built-in corpus is English prose every Python install already carries: the docstrings of
standard-library modules, split into sentences. It is deterministic for a Python version and
varied enough (short and long sentences, code words, punctuation) to set activation ranges.
"""

from __future__ import annotations

import csv
import importlib
import os
import re
from pathlib import Path

from slimml.errors import DataError

_STDLIB_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal",
    "difflib", "email", "enum", "fractions", "functools", "heapq", "http.client", "inspect", "json",
    "logging", "mailbox", "pathlib", "pickle", "queue", "random", "re", "shutil", "socket", "sqlite3",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "zipfile",
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def read_texts(path: str | os.PathLike) -> list[str]:
    """Texts from ``path``: an STS-style CSV (its ``sentence1``/``sentence2`` columns) or one text per line.

    Raises:
        DataError: the file is missing, empty, binary, or a CSV without sentence columns.
    """
    from slimml.runtime.tools.evaluate import check_data_file

    path = Path(path)
    check_data_file(path, "calibration file", "give a text file (one sentence per line) or an STS CSV "
                    "(sentence1,sentence2,score) (for a model that takes images, a folder of images), or leave "
                    "--calibration out to use the built-in corpus")
    raw = path.read_bytes()
    if b"\x00" in raw[:4096]:
        raise DataError(
            f"calibration file {path} is binary, not text; give UTF-8 text with one sentence per line "
            "or an STS CSV (sentence1,sentence2,score)."
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"calibration file {path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8.") from None
    lines = text.splitlines()
    first = lines[0] if lines else ""
    if path.suffix.lower() in (".csv", ".tsv") or "sentence1" in first:
        texts = _csv_texts(path, text)
    else:
        texts = [ln.strip() for ln in lines if ln.strip()]
    if not texts:
        raise DataError(
            f"calibration file {path} holds no text; give at least a few sentences, one per line "
            "(or an STS CSV with sentence1,sentence2 columns)."
        )
    return texts


def _csv_texts(path: Path, text: str) -> list[str]:
    dialect = "excel-tab" if path.suffix.lower() == ".tsv" else "excel"
    from slimml.runtime.tools.evaluate import allow_long_csv_fields

    allow_long_csv_fields()
    reader = csv.DictReader(text.splitlines(), dialect=dialect)
    cols = [c for c in ("sentence1", "sentence2", "sentence", "text") if c in (reader.fieldnames or [])]
    if not cols:
        raise DataError(
            f"calibration file {path} is a CSV without a sentence1, sentence2, sentence or text column "
            f"(header: {reader.fieldnames}); name the text column in the first line, or give plain text "
            "with one sentence per line."
        )
    out: list[str] = []
    for row in reader:
        for c in cols:
            value = (row.get(c) or "").strip()
            if value:
                out.append(value)
    return out


def default_corpus(limit: int = 1024) -> list[str]:
    """Up to ``limit`` English sentences from standard-library docstrings (no download, deterministic)."""
    seen: set[str] = set()
    out: list[str] = []
    for name in _STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # a trimmed Python without, say, sqlite3
            continue
        docs = [module.__doc__ or ""]
        for attr in sorted(vars(module)):
            obj = getattr(module, attr, None)
            if not attr.startswith("_") and callable(obj) and getattr(obj, "__module__", None) == module.__name__:
                docs.append(getattr(obj, "__doc__", None) or "")
        for doc in docs:
            for para in re.split(r"\n\s*\n", doc):
                flat = " ".join(para.split())
                for sentence in _SENTENCE_END.split(flat):
                    words = sentence.split()
                    if 4 <= len(words) <= 60 and sentence[0].isupper() and sentence not in seen:
                        seen.add(sentence)
                        out.append(sentence)
    if not out:
        raise DataError("the built-in calibration corpus is empty on this Python; give --calibration FILE.")
    # spread over modules instead of taking the first few modules only
    step = max(1, len(out) // limit)
    return out[::step][:limit]


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")
AUDIO_SUFFIXES = (".wav",)


class FilePaths(list):
    """Calibration inputs that are files (a folder given as ``--calibration``), not texts."""

    kind = "files"


class ImagePaths(FilePaths):
    kind = "images"


class AudioPaths(FilePaths):
    kind = "recordings"


def media_files(folder: Path) -> FilePaths:
    """The image files in ``folder`` and its subfolders (by suffix, sorted; an ImageNet-style ``class/x.jpg``
    too), else its WAV recordings; hidden files (``._x.jpg``, macOS's metadata) left out; refused where it
    has neither."""
    files = sorted(p for p in folder.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    images = [str(p) for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    if images:
        return ImagePaths(images)
    audio = [str(p) for p in files if p.suffix.lower() in AUDIO_SUFFIXES]
    if audio:
        return AudioPaths(audio)
    raise DataError(f"calibration folder {folder} holds no images ({', '.join(IMAGE_SUFFIXES)}) or recordings (.wav); "
                    "give a folder of inputs like the model's own (images for an image model, 16 kHz WAV files for a "
                    "speech model), or a text file (one sentence per line).")


def calibration_texts(path: str | os.PathLike | None, limit: int) -> tuple[list[str], list[str], str]:
    """(calibration texts, held-out texts, where they came from); for a folder, its images' or
    recordings' paths instead (:class:`ImagePaths`, :class:`AudioPaths`), for a model that takes them.

    Every fifth text (or image) is held out for the accuracy guard, so the guard never measures on
    what calibration saw.
    """
    if path is not None and Path(path).is_dir():
        files = media_files(Path(path))
        kind = type(files)
        if len(files) < 5:
            raise DataError(f"calibration folder {path} has {len(files)} {files.kind[:-1]}(s); give at least 5 (a few "
                            "dozen like the model's real inputs work best).")
        return (kind([p for i, p in enumerate(files) if i % 5 != 4][:limit]),
                kind(files[4::5][: max(8, limit // 4)]), f"{path} ({len(files)} {files.kind})")
    texts = read_texts(path) if path is not None else default_corpus()
    origin = str(path) if path is not None else "built-in corpus (Python standard-library docstrings)"
    if len(texts) < 5:
        raise DataError(
            f"the calibration data ({origin}) has {len(texts)} text(s); give at least 5 "
            "(a few hundred sentences like the model's real inputs work best)."
        )
    held = texts[4::5]
    calib = [t for i, t in enumerate(texts) if i % 5 != 4]
    return calib[:limit], held[: max(8, limit // 4)], origin
