"""Texts to distil on: a text file (one text a line), a CSV or TSV with a header, JSON Lines, or a default corpus.

The default corpus needs no download: it is the English prose of the Python standard library's
docstrings, read with ``ast`` from the installed sources (nothing is imported or run), split into
sentences. It is generic, varied and always present; a corpus from the model's own domain is
better, so pass ``--distill-data`` when you have one.
"""

from __future__ import annotations

import ast
import csv
import os
import re
import sysconfig
from pathlib import Path

from slimml.errors import DataError
from slimml.runtime.tools.evaluate import allow_long_csv_fields

MIN_TEXTS = 16  # fewer texts than this cannot train anything; the message says so before any work
DEFAULT_CORPUS_SIZE = 20_000
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_CODE_LIKE = re.compile(r"[>{}\[\]=_`|\\]|::|\(\)|^\W|\.\.\.")


def load_texts(data: str | os.PathLike | None, limit: int | None = None) -> tuple[list[str], str]:
    """The distillation texts and a short description of where they came from.

    Args:
        data: a ``.csv`` or ``.tsv`` with a header (every text column is used: ``sentence1``/``sentence2``
            of STS files, or ``text``/``sentence``), a ``.jsonl`` file (one object a line, its text
            fields by the same names, or one JSON string a line), any other file as one text a line,
            or ``None`` for the default corpus.
        limit: keep at most this many texts (the first ones, after removing duplicates).

    Raises:
        DataError: the file is missing or holds fewer than ``MIN_TEXTS`` distinct texts.
    """
    if data is None:
        texts, origin = default_corpus(limit or DEFAULT_CORPUS_SIZE), "python-stdlib-docstrings"
    else:
        path = Path(data).expanduser()
        if path.is_dir():
            raise DataError(f"distillation data {path} is a folder; give a file in it (one text a line, or a CSV).")
        if not path.is_file():
            raise DataError(
                f"distillation data {path} does not exist; give a text file (one text a line) or a CSV "
                "with a sentence1/sentence2 or text column, or leave --distill-data out for the default corpus."
            )
        suffix = path.suffix.lower()
        texts = (_read_csv(path) if suffix in (".csv", ".tsv") else _read_jsonl(path) if suffix in (".jsonl", ".ndjson")
                 else _read_lines(path))
        origin = str(path)
    texts = list(dict.fromkeys(t for t in texts if t))  # distinct, in order
    if limit is not None:
        texts = texts[:limit]
    if len(texts) < MIN_TEXTS:
        raise DataError(
            f"distillation data {origin} has {len(texts)} distinct non-empty texts; at least {MIN_TEXTS} are needed "
            "(thousands for a good student). Give a larger file with --distill-data."
        )
    return texts, origin


def _read_lines(path: Path) -> list[str]:
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is not text
            return [line.strip() for line in f]
    except UnicodeDecodeError:
        raise DataError(f"distillation data {path} is not UTF-8 text; give one text a line in UTF-8.") from None


TEXT_FIELDS = ("sentence1", "sentence2", "text", "sentence")  # the columns (or JSON fields) read as texts


def _read_csv(path: Path) -> list[str]:
    try:  # utf-8-sig: the byte-order mark Excel writes is not part of the first column's name
        allow_long_csv_fields()
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
            fields = reader.fieldnames or []
            columns = [c for c in fields if c in TEXT_FIELDS]
            if not columns:
                raise DataError(
                    f"{path} has no text column (header: {fields}); name it text or sentence, or use sentence1,sentence2 "
                    "as STS files do, or give a plain text file with one text a line."
                )
            return [(row[c] or "").strip() for row in reader for c in columns]
    except UnicodeDecodeError as e:
        raise DataError(f"distillation data {path} is not UTF-8 text (byte {e.start}); save it as UTF-8 "
                        "(iconv -t UTF-8).") from None
    except csv.Error as e:
        raise DataError(f"distillation data {path} is not a readable CSV ({e}); give a CSV with a text column, "
                        "or a plain text file with one text a line.") from None


def _read_jsonl(path: Path) -> list[str]:
    """JSON Lines: each line an object whose text fields (``TEXT_FIELDS``) are read, or a JSON string."""
    import json

    texts = []
    for number, line in enumerate(_read_lines(path), 1):
        if not line:
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            raise DataError(f"{path}:{number} is not JSON; give one JSON object a line (with a text field) in a "
                            ".jsonl file, or name a plain text file otherwise.") from None
        if isinstance(value, str):
            texts.append(value.strip())
            continue
        found = [value[k].strip() for k in TEXT_FIELDS if isinstance(value, dict) and isinstance(value.get(k), str)]
        if not found:
            raise DataError(f"{path}:{number} has no text field; give each line a \"text\" (or sentence, sentence1, "
                            "sentence2) string.")
        texts += found
    return texts


def default_corpus(size: int = DEFAULT_CORPUS_SIZE) -> list[str]:
    """Up to ``size`` English sentences from the standard library's docstrings, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: dict[str, None] = {}
    for file in sorted(root.glob("*.py")) + sorted(root.glob("[a-z]*/*.py")):
        if "test" in file.parts[-2:][0] or "site-packages" in file.parts:
            continue
        for sentence in _docstring_sentences(file):
            out.setdefault(sentence)
            if len(out) >= size:
                return list(out)
    return list(out)


def _docstring_sentences(file: Path) -> list[str]:
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if not doc:
                continue
            for para in doc.split("\n\n"):
                text = " ".join(para.split())
                for s in _SENTENCE_END.split(text):
                    if 25 <= len(s) <= 300 and s[0].isupper() and not _CODE_LIKE.search(s):
                        found.append(s)
    return found
