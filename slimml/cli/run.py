"""``slimml run``: an artifact on texts, images, audio or arrays, and what it gives, printed."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from slimml.cli.common import Artifact, AsJson, Progress, app, console
from slimml.cli.options import Options, OptionValues, config_options
from slimml.errors import SlimmlError
from slimml.runtime.engine.config import LoadConfig
from slimml.runtime.tasks.limits import a_or_an


@app.command()
@config_options(loading=Options(LoadConfig, only=("device",)))
def run(
    artifact: Artifact,
    texts: Annotated[Optional[list[str]], typer.Argument(help="Texts: to embed, classify, or score images against.")] = None,
    text: Annotated[Optional[list[str]], typer.Option("--text", help="A text (repeat); with --image, the labels to score (CLIP).")] = None,
    image: Annotated[Optional[list[Path]], typer.Option("--image", help="An image file (repeat): classified, embedded, or scored against --text.")] = None,
    audio: Annotated[Optional[list[Path]], typer.Option("--audio", help="A 16 kHz WAV file (repeat) to transcribe (Whisper; past 30 s in overlapping windows).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(help="Tokens per transcript at most, per 30 s window (--audio; default: the model's max_length).", show_default=False)] = None,
    language: Annotated[Optional[str], typer.Option(help="The recordings' language, an ISO 639-1 code such as de (--audio, multilingual Whisper; default: detected).", show_default=False)] = None,
    input: Annotated[Optional[Path], typer.Option("--input", help="An .npz file of named input arrays.")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Classes shown per input (classifiers; default 5); answers per context (--question; default 1).")] = None,
    question: Annotated[Optional[str], typer.Option("--question", help="A question each text (a context) answers (extractive question answering).")] = None,
    aggregation: Annotated[Optional[str], typer.Option(help="How a token classifier groups tokens: none, simple, first, average or max (default simple).", show_default=False)] = None,
    loading: OptionValues = None,
    progress: Progress = False,
    as_json: AsJson = False,
):
    """Run an artifact on texts, images, or arrays from an .npz file and print what it gives.

    A classifier prints labels and scores; a token classifier the entities in each text; a question
    answerer (with --question) the answer in each text; CLIP scores each --image against the
    --text labels; an embedding model prints embeddings; anything else its raw outputs.
    """
    import numpy as np

    from slimml.runtime import load

    from slimml.runtime.tasks.token_classification import AGGREGATIONS

    texts = [*(texts or []), *(text or [])]
    if sum(map(bool, (texts or image, audio, input))) != 1:
        raise SlimmlError("give texts (TEXT or --text), --image files, --audio files or --input FILE.npz: one kind of input.")
    if language is not None and not audio:
        raise SlimmlError("--language is the language of --audio recordings (Whisper); give --audio files, or leave it out.")
    if top_k is not None and top_k < 1:  # checked whatever the artifact: a value it ignores is still a mistake
        raise SlimmlError(f"--top-k must be a whole number >= 1, got {top_k}.")
    if aggregation is not None and aggregation not in AGGREGATIONS:
        raise SlimmlError(f"--aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}.")
    model = load(artifact, loading.build())
    if aggregation is not None and not (texts and question is None and model.supports("entities")):
        raise SlimmlError(f"--aggregation is for token classifiers' entities; {artifact} is {a_or_an(repr(model.kind))} artifact "
                          "(or no texts were given): drop it.")
    if top_k is not None and texts and question is None and not image and model.supports("entities"):
        raise SlimmlError("--top-k is for classes and answers; a token classifier gives every entity it finds: drop it.")
    if question is not None:
        if not texts or not model.supports("answer"):
            raise SlimmlError(f"--question needs an extractive question-answering artifact and texts to answer from; "
                              f"{artifact} is {a_or_an(repr(model.kind))} artifact." if texts else
                              "--question needs the texts to answer from (TEXT or --text): the contexts.")
        answers = [model.answer(question, t, top_k=1 if top_k is None else top_k) for t in texts]
        return _print_spans(texts, [a if isinstance(a, list) else [a] for a in answers], "answers", as_json)
    if audio:
        if "audio" not in model.accepts:
            raise SlimmlError(f"{artifact} is not a speech model (it has no audio feature extractor); --audio needs one, e.g. Whisper.")
        result = model.generate([str(p) for p in audio], max_new_tokens=max_new_tokens,
                                **({"language": language} if language is not None else {}))
        if as_json:
            print(json.dumps([{"input": str(p), "text": t, "tokens": k} for p, t, k in zip(audio, result.texts, result.tokens)]))
            return
        for p, t in zip(audio, result.texts):
            console.print(Text(str(p), style="bold") + Text(f"  {t}"))
        return
    if (texts or image) and "audio" in model.accepts and "text" not in model.accepts:  # a speech model's input: audio
        raise SlimmlError(f"{artifact} is a speech model: it transcribes recordings; give --audio FILE.wav (16 kHz).")
    if image and texts:  # images scored against texts: an image-text model (CLIP)
        if not {"text", "images"} <= model.accepts or not model.supports("classify"):
            raise SlimmlError(f"{artifact} is not an image-text model (CLIP); give --image files or texts, not both.")
        return _print_classes([str(p) for p in image], model.classify(list(image), labels=texts, top_k=5 if top_k is None else top_k), as_json)
    if image:
        if "images" not in model.accepts:
            takes = "text: give TEXT" if "text" in model.accepts else "arrays: give --input FILE.npz"
            raise SlimmlError(f"{artifact} cannot take images; it takes {takes}.")
        if model.supports("embed_images"):
            outputs = {"embeddings": model.embed_images(list(image))}
        else:  # a classifier, or the TaskError that says what this artifact takes
            return _print_classes([str(p) for p in image], model.classify(list(image), top_k=5 if top_k is None else top_k), as_json)
    elif texts:
        if "text" not in model.accepts:
            takes = ("images: give --image FILE" if "images" in model.accepts else
                     "token ids, from Python (`load(ART).generate([[ids]])`)" if model.supports("generate") else
                     "arrays: give --input FILE.npz")
            raise SlimmlError(f"{artifact} has no tokenizer, so it cannot take text; it takes {takes} (or re-convert it "
                              "from a folder that holds its tokenizer).")
        if model.supports("encode"):
            outputs = {"embeddings": model.encode(texts, show_progress=progress)}
        elif model.supports("entities"):
            return _print_spans(texts, model.entities(texts, aggregation=aggregation or "simple"), "entities", as_json)
        elif model.supports("answer"):
            raise SlimmlError(f"{artifact} answers questions from texts: give --question QUESTION, and the texts to "
                              "answer from.")
        elif model.supports("classify"):
            return _print_classes(texts, model.classify(texts, top_k=5 if top_k is None else top_k), as_json)
        elif model.supports("generate"):  # a language model: its raw pass needs a cache; what a user wants is text
            chat = "" if model.manifest.seq2seq else " (or `--chat` for its chat template)"
            raise SlimmlError(f"{artifact} is a text-generation model; continue a text with `slimml generate {artifact} "
                              f"TEXT`{chat}.")
        else:
            outputs = model.run(model.tokenize(texts))
    else:
        if not input.is_file():
            raise SlimmlError(f"--input {input} " + ("is a folder, not a file" if input.is_dir() else "does not exist")
                              + "; save arrays with np.savez(path, input_ids=...) and give that file.")
        try:  # never unpickle: an .npz from elsewhere must not run code
            with np.load(input, allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
        except Exception as e:  # BadZipFile, object arrays, a plain .npy, ...
            why = ("a single .npy array, not named arrays" if isinstance(e, TypeError) else
                   "object arrays, which slimml never unpickles" if "allow_pickle" in str(e) and zipfile.is_zipfile(input) else
                   "not an .npz file" if "allow_pickle" in str(e) else f"{type(e).__name__}: {e}")
            raise SlimmlError(
                f"--input {input} is not an .npz of plain arrays ({why}); save inputs with "
                "np.savez(path, input_ids=...), numeric arrays only."
            ) from None
        outputs = model.run(arrays)
    if as_json:
        print(json.dumps({k: {"shape": list(v.shape), "dtype": str(v.dtype), "data": v.tolist()} for k, v in outputs.items()}))
        return
    np.set_printoptions(precision=4, suppress=True, threshold=20, edgeitems=3)
    for name, value in outputs.items():
        console.print(Text(name, style="bold") + Text(f" {value.dtype}{list(value.shape)}"))
        console.print(str(value))


def _print_spans(texts: list[str], results: list[list[dict]], what: str, as_json: bool) -> None:
    """Entities or answers: per text, its spans (``entity_group``/``entity`` or ``answer``, score, start, end)."""
    if as_json:
        print(json.dumps([{"input": t, what: r} for t, r in zip(texts, results)]))
        return
    answers = what == "answers"
    table = Table("input", *(() if answers else ("entity",)), "answer" if answers else "text", "score", "chars")
    for text, spans in zip(texts, results):
        for i, s in enumerate(spans or [{}]):
            label = () if answers else (s.get("entity_group", s.get("entity", "")),)
            where = f"{s['start']}-{s['end']}" if "start" in s else ""
            table.add_row(text if i == 0 else "", *label, s.get("answer", s.get("word", "(none)")),
                          f"{s['score']:.4f}" if "score" in s else "", where)
    console.print(table)


def _print_classes(names: list[str], results: list[list[dict]], as_json: bool) -> None:
    if as_json:
        print(json.dumps([{"input": n, "classes": r} for n, r in zip(names, results)]))
        return
    table = Table("input", "label", "score")
    for name, classes in zip(names, results):
        for i, c in enumerate(classes):
            table.add_row(name if i == 0 else "", c["label"], f"{c['score']:.4f}")
    console.print(table)
