"""The ``slimml`` command line: thin Typer commands over the library.

Errors from the library come out as one line on stderr and exit code 1; set ``SLIMML_DEBUG=1``
to see the traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import zipfile
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from slimml.cli_options import Options, OptionValues, config_options
from slimml.convert.config import ConvertConfig, DistillConfig, ExportConfig, PruneConfig, ShardConfig
from slimml.errors import ConfigError, SlimmlError, missing_extra
from slimml.runtime.artifact.atomic import stop_asked
from slimml.quantize.config import QuantizeOptions
from slimml.runtime.engine.config import LoadConfig
from slimml.serve.config import ServeConfig

app = typer.Typer(
    name="slimml",
    help="Make trained models smaller and faster, and run them in layer shards on CPU or a small GPU.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
# Piped into a file or another program, a line stays one line: wrapping at a guessed width of 80 splits
# figures and messages in the middle of a phrase that scripts and logs look for.
console = Console(soft_wrap=not (sys.stdout and sys.stdout.isatty()))
err = Console(stderr=True, soft_wrap=not (sys.stderr and sys.stderr.isatty()))

Artifact = Annotated[Path, typer.Argument(help="An artifact folder written by `slimml convert`.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for machines.")]
Progress = Annotated[bool, typer.Option("--progress", help="Show a progress bar over the batches (on stderr).")]
BaselineIn = Annotated[Optional[Path], typer.Option(help="Compare with this baseline file; exit 3 on a regression.")]
BaselineOut = Annotated[Optional[Path], typer.Option(help="Write what this run measured as a baseline file (with --baseline: only if it passes).")]
Budget = Annotated[Optional[str], typer.Option("--memory-budget", help="Memory for loaded shards, e.g. 4GB; picks K and P.")]
@app.command()
@config_options(
    export=Options(ExportConfig, only=("task", "opset")),
    checks=Options(ConvertConfig, only=("verify", "eval_text")),
    distill=Options(DistillConfig, prefix="distill", only=("layers", "data", "epochs")),
    prune=Options(PruneConfig, defaults={"fraction": None}),  # no --prune: no pruning
    compare=Options(ConvertConfig, only=("compare_on",)),
    training=Options(DistillConfig, prefix="distill", only=("teacher_memory_budget", "batch_size", "grad_accum",
                                                            "mixed_precision", "checkpointing")),
    exporter=Options(ExportConfig, only=("exporter",)),
    quantizing=Options(QuantizeOptions),
)
def convert(
    source: Annotated[Optional[str], typer.Argument(help="HF model folder, .onnx, .gguf, .py or torch checkpoint. Default: all-MiniLM-L6-v2.")] = None,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Artifact folder. Default: artifacts/<name>, with -d3-p50 for a student or -int8 (the scheme) for a quantized model, so the float artifact is never replaced.")] = None,
    shards: Annotated[str, typer.Option(help="'per-layer' or a number of shards balanced by weight bytes.")] = "per-layer",
    shard_size: Annotated[Optional[float], typer.Option(help="Largest shard in MB of weights (instead of --shards).")] = None,
    export: OptionValues = None,
    checks: OptionValues = None,
    distill: OptionValues = None,
    prune: OptionValues = None,
    compare: OptionValues = None,
    training: OptionValues = None,
    exporter: OptionValues = None,
    quantizing: OptionValues = None,
    as_json: AsJson = False,
):
    """Export a model to ONNX, split it into layer shards, check them, and write an artifact folder."""
    from slimml.convert import convert as do_convert

    qconfig = quantizing.build().to_config()
    if qconfig is not None and checks["eval_text"] is not None:
        qconfig.eval_text = checks["eval_text"]  # a language model's guard scores perplexity on it
    student = distill["layers"] is not None or prune["fraction"] is not None
    if training.changed() and not student:
        raise SlimmlError(f"{', '.join(training.changed())} shape distillation; give --distill-layers N or --prune F with it.")
    if distill.changed() and not student:
        raise SlimmlError("--distill-data and --distill-epochs need --distill-layers N or --prune F.")
    config = ConvertConfig(
        export=export.build(**exporter.values), shard=ShardConfig.parse(shards, shard_size), quantize=qconfig,
        distill=distill.build(**training.values) if student else None,
        prune=prune.build() if prune["fraction"] is not None else None, **checks.values, **compare.values,
    )
    if student:
        report = _convert_with_progress(do_convert, source, out, config)
    else:
        with console.status("converting", spinner="dots") as status:
            report = do_convert(source, out, config, on_step=lambda msg: status.update(f"{msg}..."))
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
        return
    table = Table(title=f"slimml convert: {report.name} -> {report.out}", show_header=False)
    table.add_row("task", report.task)
    table.add_row("shards", str(report.shards))
    table.add_row("size", f"{report.size_mb:.1f} MB")
    for key, value in report.checks.items():
        if isinstance(value, dict):
            continue
        table.add_row(key.replace("_", " "), f"{value:.3g}" if isinstance(value, float) else str(value))
    for s in report.steps:  # the student against its teacher, when distilled or pruned
        if s["step"] == "distill":
            table.add_row("distill", f"{s['teacher_layers']} -> {s['layers']} layers (teacher layers {s['kept_teacher_layers']}), "
                          f"{s['teacher_params'] / 1e6:.1f}M -> {s['student_params'] / 1e6:.1f}M params, {s['steps']} steps")
        elif s["step"] == "prune":
            table.add_row("prune", f"{s['heads_per_layer']} heads, {s['ffn_per_layer']} FFN neurons a layer, vocabulary "
                          f"{s['vocab_size']}: {s['student_params'] / 1e6:.1f}M params")
        if "teacher_pass" in s:
            t, tr = s["teacher_pass"], s["training"]
            ran = "from the cache" if t["from_cache"] else f"{t['batches']} batches of {t['batch_texts']} texts"
            rebuilt = f"; rebuilt: {t['rebuilt_because']}" if t["rebuilt_because"] else ""
            table.add_row("teacher pass", f"{ran}, {t['seconds']} s, peak RSS {t['peak_rss_mb']:.0f} MB, cache "
                          f"{t['cache_mb']:.1f} MB ({t['teacher_passes_saved']} teacher passes saved){rebuilt}")
            table.add_row("training", f"{tr['precision']} precision, batch {tr['effective_batch']} (accumulate "
                          f"{tr['grad_accum']}), checkpointing {'on' if tr['checkpointing'] else 'off'}, "
                          f"{tr['train_seconds']} s, peak RSS {tr['peak_rss_mb']:.0f} MB")
            if tr["heldout_loss_start"] is not None:
                table.add_row("held-out loss", f"{tr['heldout_loss_start']:.4g} -> {tr['heldout_loss_end']:.4g} "
                              f"({tr['heldout_texts']} texts kept out of training)")
    table.add_row("time", f"{report.seconds:.1f} s")
    console.print(table)
    if report.teacher:
        console.print(_teacher_table(report.teacher))


def _teacher_table(c: dict) -> Table:
    """Teacher against student: parameters, MB, latency (batch 1 x seq 128, timed interleaved), STSb."""
    table = Table(title="teacher against student")
    for col in ("", "params", "MB", "latency b1 s128", "STS (Spearman x100)"):
        table.add_column(col, justify="right")
    for name in ("teacher", "student"):
        r = c[name]
        ratio = "1.00x" if name == "teacher" else f"{c['latency_ratio']:.2f}x"
        table.add_row(name, f"{r['params'] / 1e6:.1f} M", f"{r['mb']:.1f}", f"{r['latency_ms']:.2f} ms ({ratio})",
                      f"{r['stsb']:.2f}" if "stsb" in r else "(--compare-on FILE)")
    return table


def _convert_with_progress(do_convert, source, out, config):
    """Convert with a progress bar for the training steps and a spinner line for the stage."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeRemainingColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[loss]}"), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("converting", total=None, loss="")

        def on_step(msg):
            bar.update(task, description=f"{msg}...", total=None, completed=0, loss="")

        def on_progress(done, total, loss):  # loss None: texts through the teacher
            bar.update(task, total=total, completed=done, loss="texts" if loss is None else f"loss {loss:.4f}")

        return do_convert(source, out, config, on_step=on_step, on_progress=on_progress)


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


@app.command()
def info(artifact: Artifact, as_json: AsJson = False,
         verify: Annotated[bool, typer.Option("--verify", help="Hash every file against the manifest (else: each file "
                                                               "there, of its recorded size).")] = False):
    """Show an artifact's manifest as a table (after checking its files are there, and with --verify, intact)."""
    from slimml.runtime.artifact.files import check_present, verify_files
    from slimml.runtime.artifact.manifest import read_manifest
    from slimml.runtime.tasks.registry import kind_of, registered

    m = read_manifest(artifact)
    if verify:  # IntegrityError: one line, exit 1
        verify_files(artifact, m)
    else:
        check_present(artifact, m)
    if as_json:
        print(json.dumps(m.to_json(), indent=2))
        return
    console.print(f"[bold]{m.name}[/bold]  task={m.task}  format v{m.format_version}  slimml {m.slimml_version}")
    kind = kind_of(m)  # what load() will make of it, without loading
    methods = sorted(registered()[kind].methods)
    console.print(f"runs as: {kind} ({', '.join(f'{n}()' for n in methods) + ', ' if methods else ''}run())")
    console.print("steps: " + " -> ".join(s.get("step", "?") for s in m.steps))
    if m.components:
        console.print("components: " + ", ".join(f"{n} ({len(c.shards)} shards)" for n, c in m.components.items()))
    if m.labels is not None:
        console.print(f"labels ({len(m.labels)}): " + ", ".join(m.labels[:10]) + (", ..." if len(m.labels) > 10 else ""))
    for name, part in (m.components or {None: m}).items():
        if name is not None:
            console.print(f"[bold]component {name}[/bold]")
        console.print("inputs: " + _tensor_list(part.inputs))
        console.print("outputs: " + _tensor_list(part.outputs))
        if part.pooling is not None:
            p = part.pooling
            steps = [f"{p.mode} of {p.output}" if p.mode != "none" else f"{p.output} (pooled by the model)", *(f"projection ({d['activation']})" for d in p.dense),
                     *(["normalized"] if p.normalize else []), *([f"first {p.truncate_dim} values"] if p.truncate_dim else [])]
            console.print("pooling: " + " -> ".join(steps) + (f"; prompts: {', '.join(p.prompts)}" if p.prompts else ""))
        table = Table("shard", "file", "MB", "layers", "inputs from", "outputs")
        for s in part.shards:
            size = sum(f.bytes for f in m.files if f.path in (s.file, s.data))
            sources = sorted({"model" if t.source == "input" else f"shard {t.source}" for t in s.inputs})
            table.add_row(str(s.index), s.file, f"{size / 1e6:.1f}", ", ".join(x.rsplit("/", 1)[-1] for x in s.layers),
                          ", ".join(sources), str(len(s.outputs)))
        console.print(table)
    state = "each hashed against the manifest" if verify else "each of its recorded size (--verify hashes them)"
    console.print(f"total {m.total_bytes / 1e6:.1f} MB in {len(m.files)} files, {state}; checks: {m.checks}")


def _tensor_list(tensors) -> str:
    """Tensors as ``name dtype[shape]``, one entry per numbered family: a decoder's 60 cache tensors
    read ``past_key_values.{0..29}.key float32[...]`` (the indices as a range where they run without a gap)."""
    groups: dict[tuple, list[int]] = {}
    for t in tensors:
        numbered = re.fullmatch(r"(.*?\.)(\d+)(\..*)", t.name)
        key = (numbered[1] + "{}" + numbered[3] if numbered else t.name, t.dtype, str(t.shape))
        groups.setdefault(key, []).append(int(numbered[2]) if numbered else -1)
    shown = []
    for (name, dtype, shape), idx in groups.items():
        if len(idx) > 2:
            span = f"{idx[0]}..{idx[-1]}" if idx == list(range(idx[0], idx[0] + len(idx))) else ",".join(map(str, idx))
            name = name.replace("{}", "{" + span + "}")
        elif "{}" in name:
            shown += [f"{name.format(i)} {dtype}{shape}" for i in idx[:-1]]
            name = name.format(idx[-1])
        shown.append(f"{name} {dtype}{shape}")
    return ", ".join(shown)


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
        raise SlimmlError(f"--aggregation is for token classifiers' entities; {artifact} is a {model.kind!r} artifact "
                          "(or no texts were given): drop it.")
    if top_k is not None and texts and question is None and not image and model.supports("entities"):
        raise SlimmlError("--top-k is for classes and answers; a token classifier gives every entity it finds: drop it.")
    if question is not None:
        if not texts or not model.supports("answer"):
            raise SlimmlError(f"--question needs an extractive question-answering artifact and texts to answer from; "
                              f"{artifact} is a {model.kind!r} artifact." if texts else
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
            console.print(f"[bold]{p}[/bold]  {t}")
        return
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
        console.print(f"[bold]{name}[/bold] {value.dtype}{list(value.shape)}")
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


@app.command("eval")
@config_options(loading=Options(LoadConfig, only=("device",)))
def eval_(
    artifact: Artifact,
    data: Annotated[Path, typer.Option(help="An embedding model: a CSV with sentence1,sentence2,score (STS style). "
                                            "A language model: a UTF-8 text file, scored by perplexity.")],
    loading: OptionValues = None,
    batch_size: Annotated[Optional[int], typer.Option(help="An embedding model: sentences per batch (default 32).", show_default=False)] = None,
    window: Annotated[Optional[int], typer.Option(help="A language model: tokens a scored window holds (default 512, at most its context).", show_default=False)] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="A language model: tokens of the text scored at most (default 32768).", show_default=False)] = None,
    progress: Progress = False,
    baseline: BaselineIn = None,
    save_baseline: BaselineOut = None,
    max_accuracy_drop: Annotated[Optional[float], typer.Option(help="An embedding model: points (x100) the score may fall below --baseline. [default: 0.1]", show_default=False)] = None,
    max_perplexity_increase: Annotated[Optional[float], typer.Option(help="A language model: percent its perplexity may rise above --baseline. [default: 0.1]", show_default=False)] = None,
    as_json: AsJson = False,
):
    """Spearman x100 of cosine similarity against gold scores (STS benchmark style); for a language
    model, its perplexity on a text."""
    from slimml.runtime import load, read_manifest
    from slimml.runtime.tools.baseline import Baseline, Tolerances
    from slimml.runtime.tools.evaluate import evaluate_perplexity, evaluate_sts, read_sts, read_text

    old = Baseline.load(baseline) if baseline else None  # a missing baseline fails before the model runs
    if save_baseline is not None:
        Baseline.check_writable(save_baseline)
    task = str(read_manifest(artifact).task)
    language = task.startswith("text-generation")
    if language and max_accuracy_drop is not None or not language and max_perplexity_increase is not None:
        raise ConfigError("--max-accuracy-drop gates an embedding model's Spearman score and --max-perplexity-increase "
                          f"a language model's perplexity; this artifact ({task}) is gated by "
                          f"{'--max-perplexity-increase' if language else '--max-accuracy-drop'}.")
    tol = Tolerances(accuracy_drop=0.1 if max_accuracy_drop is None else max_accuracy_drop,
                     perplexity_increase_pct=0.1 if max_perplexity_increase is None else max_perplexity_increase)
    read_text(data) if language else read_sts(data)  # a bad data file fails before the model loads
    metric = "perplexity" if language else "spearman"
    if old is not None and old.kind == "eval" and old.settings.get("metric", metric) != metric:
        raise ConfigError(f"the baseline {baseline} holds {old.settings['metric']}, and this artifact is scored by {metric}; "
                          "compare with a baseline saved from this kind of model (--save-baseline).")
    for name, value, low in (("--window", window, 2), ("--max-tokens", max_tokens, 2), ("--batch-size", batch_size, 1)):
        if value is not None and value < low:
            raise ConfigError(f"{name} must be at least {low}, got {value}.")
    if language and (batch_size is not None or progress):
        raise ConfigError(f"{'--batch-size' if batch_size is not None else '--progress'} is for embedding models (STS "
                          "pairs); a language model is scored one window at a time: drop it.")
    if not language and (window is not None or max_tokens is not None):
        raise ConfigError("--window and --max-tokens are for language models (perplexity); drop them.")
    if old is not None:  # other data or another window: refused before the model runs, not after
        from slimml.runtime.artifact.files import sha256_file
        from slimml.runtime.tools.baseline import check_settings

        if language and window is None and isinstance(old.settings.get("window"), int):
            window = old.settings["window"]  # measured as the baseline was
        if language and max_tokens is None and isinstance(old.settings.get("max_tokens"), int):
            max_tokens = old.settings["max_tokens"]
        if not language and batch_size is None and isinstance(old.settings.get("batch_size"), int):
            batch_size = old.settings["batch_size"]
        early = {"metric": metric, "data": data.name, "data_sha256": sha256_file(data),
                 **({"window": window} if language and window is not None else {}),
                 **({"max_tokens": max_tokens} if language and max_tokens is not None else {}),
                 **({} if language else {"batch_size": batch_size or 32})}
        check_settings(old, "eval", early)
    model = load(artifact, loading.build())
    if not language and not model.supports("encode"):
        raise ConfigError(f"slimml eval scores sentence-embedding models (Spearman on STS pairs) and language models "
                          f"(perplexity); {artifact} is a {task} model. Score it on your labelled data through the "
                          "Python API (docs/runtime.md), and gate its speed with slimml bench.")
    if language:
        result = evaluate_perplexity(model, data, window=window, max_tokens=max_tokens)
        said = (f"perplexity = {result.score:.4f} on {result.count} tokens ({data.name}, {result.settings['windows']} "
                f"windows of up to {result.settings['window']} tokens)")
    else:
        result = evaluate_sts(model, data, batch_size=batch_size or 32, show_progress=progress)
        said = f"{result.metric} x100 = {result.score:.2f} on {result.count} pairs ({data.name})"
    now = Baseline.from_eval(result, str(artifact), data)
    if as_json:
        _with_baseline(result.to_json(), now, old, baseline, save_baseline, tol)
    else:
        console.print(said)
        _with_baseline(None, now, old, baseline, save_baseline, tol)


@app.command()
@config_options(loading=Options(LoadConfig, only=("device", "resident", "prefetch", "memory_budget", "pin", "pack", "cache_dir")))
def bench(
    artifact: Artifact,
    batch: Annotated[int, typer.Option(help="Batch size.")] = 1,
    seq: Annotated[int, typer.Option(help="Sequence length for dynamic axes.")] = 128,
    runs: Annotated[int, typer.Option(help="Timed runs.")] = 50,
    loading: OptionValues = None,
    baseline: BaselineIn = None,
    save_baseline: BaselineOut = None,
    max_latency_increase: Annotated[float, typer.Option(help="Percent the p50 latency may rise above --baseline.")] = 50.0,
    max_size_increase: Annotated[float, typer.Option(help="Percent the model size may grow above --baseline.")] = 1.0,
    sweep: Annotated[Optional[str], typer.Option("--sweep", help="Try every K,P: e.g. '2,3,4' or '2,3,4:0,1' (K values:P values).")] = None,
    sweep_out: Annotated[Path, typer.Option("--sweep-out", help="Folder for the sweep's table, CSV and PNG plot.")] = Path("sweep"),
    component: Annotated[Optional[str], typer.Option("--component", help="For an artifact of components: the one to time (default: each).")] = None,
    against: Annotated[Optional[Path], typer.Option("--against", help="A reference artifact timed alternately with this one in this run; exit 3 if this one's p50 is past --max-latency-increase of it (steadier than a saved --baseline on a shared machine).", show_default=False)] = None,
    as_json: AsJson = False,
):
    """Latency p50/p90, throughput, peak RSS and size of an artifact; streaming counters; a K,P sweep."""
    device, pin = loading["device"], loading["pin"]
    from slimml.runtime import load
    from slimml.runtime.tools.baseline import Baseline, Tolerances, check_settings
    from slimml.runtime.tools.bench import bench as do_bench, latency_settings

    if batch < 1 or seq < 1 or runs < 1:
        raise SlimmlError(f"--batch, --seq and --runs must be >= 1 (got {batch}, {seq}, {runs}).")
    tol = Tolerances(latency_increase_pct=max_latency_increase, size_increase_pct=max_size_increase)
    if sweep is not None and (baseline is not None or save_baseline is not None or against is not None):
        raise ConfigError("--sweep times many K,P plans and a gate one: drop --baseline/--save-baseline/--against, "
                          "or --sweep (then give the plan to gate with --resident/--prefetch or --memory-budget).")
    if against is not None and (baseline is not None or save_baseline is not None):
        raise ConfigError("--against gates on a reference timed in this run, --baseline on a run saved before: give one "
                          "of them.")
    old = Baseline.load(baseline) if baseline else None
    if save_baseline is not None:
        Baseline.check_writable(save_baseline)
    if old is not None:  # other settings fail before the timing runs
        from slimml.runtime.engine.backends import resolve_device

        check_settings(old, "bench", {"batch": batch, "seq": seq, "device": resolve_device(device),
                                      **({"component": component} if component is not None else {})})
    if sweep is not None:
        from slimml.runtime.tools.sweep import sweep as do_sweep

        ks, _, ps = sweep.partition(":")
        try:
            k_values = [int(x) for x in ks.split(",") if x.strip()]
            p_values = [int(x) for x in ps.split(",") if x.strip()] or None
        except ValueError:
            raise SlimmlError(f"--sweep {sweep!r} is not 'K,K,...' or 'K,K,...:P,P,...' (whole numbers).") from None
        result = do_sweep(artifact, k_values, p_values, sweep_out, device=device, batch=batch, seq=seq, runs=runs, pin=pin)
        if as_json:
            print(json.dumps({"rows": result.rows, "table": str(result.table), "plot": str(result.plot) if result.plot else None,
                              "skipped": result.skipped}))
            return
        console.print(result.table.read_text())
        if result.skipped:
            console.print(f"skipped: {'; '.join(result.skipped)}")
        console.print(f"wrote {result.table}, {result.csv}" + (f", {result.plot}" if result.plot else
                      " (no plot: pip install 'slimml[bench]' for matplotlib)"))
        return
    model = load(artifact, loading.build())
    parts = model.parts
    if parts:  # several graphs: each is timed on its own sample inputs
        if component is None:
            if old is not None or save_baseline is not None or against is not None:
                raise ConfigError(f"{artifact} has components {', '.join(parts)}; a gate is for one: add --component NAME.")
            results = {name: do_bench(part, batch=batch, seq=seq, runs=runs) for name, part in parts.items()}
            if as_json:
                print(json.dumps({name: r.to_json() for name, r in results.items()}))
                return
            for name, r in results.items():
                console.print(f"component {name}: batch {batch} x seq {seq} on {device}: p50 {r.p50_ms:.2f} ms, "
                              f"p90 {r.p90_ms:.2f} ms, {r.throughput_per_s:.1f} items/s, model {r.model_mb:.1f} MB")
            return
        model = model.part(component)
    elif component is not None:
        raise SlimmlError(f"{artifact} is one chain of shards, without components; leave --component out.")
    longest = model.max_sequence_length
    if longest is not None and seq > longest and any(t.name == "input_ids" for t in model.manifest.inputs):
        raise ConfigError(f"--seq {seq} is past the {longest} tokens this model takes; give --seq {longest} or less.")
    timed = {**({"component": component} if component is not None else {}), **latency_settings(model)}
    if old is not None:  # another streaming plan or thread count: refused before the timing runs
        check_settings(old, "bench", timed)
    if not as_json:
        console.print(model.plan.describe(), highlight=False)
    if against is not None:
        _bench_against(model, against, loading.build(), component, batch, seq, runs, timed, tol, as_json)
        return
    result = do_bench(model, batch=batch, seq=seq, runs=runs)
    now = Baseline.from_bench(result, str(artifact), **timed)
    if as_json:
        _with_baseline(result.to_json(), now, old, baseline, save_baseline, tol)
        return
    rate = f"{result.throughput_per_s:.1f} items/s"
    if str(model.manifest.task).startswith("text-generation"):  # a pass is a prefill of seq tokens a row
        rate = f"{result.throughput_per_s:.1f} prompts/s ({result.throughput_per_s * seq:.0f} prompt tokens/s prefilled)"
    console.print(
        f"batch {batch} x seq {seq} on {model.device}: p50 {result.p50_ms:.2f} ms, p90 {result.p90_ms:.2f} ms, "
        f"{rate}, peak RSS {result.peak_rss_mb:.0f} MB, model {result.model_mb:.1f} MB"
    )
    if result.stream:
        st = result.stream
        console.print(
            f"per run: {st['bytes_per_run'] / 1e6:.1f} MB streamed in, {st['wait_s_per_run'] * 1e3:.1f} ms waiting on "
            f"loads, {st['compute_s_per_run'] * 1e3:.1f} ms computing; peak RSS during runs {result.run_peak_rss_mb:.0f} MB"
        )
    _with_baseline(None, now, old, baseline, save_baseline, tol)


def _bench_against(model, against: Path, config, component, batch, seq, runs, timed, tol, as_json) -> None:
    """``slimml bench ART --against REF``: the two timed alternately, ART gated on REF's p50 and size."""
    from slimml.runtime import load
    from slimml.runtime.tools.baseline import Baseline
    from slimml.runtime.tools.bench import bench_against, check_comparable

    reference = load(against, config)
    if component is not None:
        if component not in reference.parts:
            raise ConfigError(f"the reference {against} has no component {component!r}"
                              + (f" (it has {', '.join(reference.parts)})" if reference.parts else "")
                              + "; give a reference of the same model.")
        reference = reference.part(component)
    elif reference.parts:
        raise ConfigError(f"the reference {against} has components ({', '.join(reference.parts)}) and {model.folder} "
                          "has none; give a reference of the same model.")
    check_comparable(model, reference, str(against))
    result, ref = bench_against(model, reference, batch=batch, seq=seq, runs=runs)
    now = Baseline.from_bench(result, str(model.folder), **timed)
    then = Baseline.from_bench(ref, str(against), **timed)
    source = f"{against}, timed alternately in this run"
    if as_json:
        _with_baseline(result.to_json() | {"reference": ref.to_json()}, now, then, source, None, tol)
        return
    for who, r in (("this artifact", result), ("the reference", ref)):
        console.print(f"{who}: batch {batch} x seq {seq} on {model.device}: p50 {r.p50_ms:.2f} ms, p90 {r.p90_ms:.2f} ms, "
                      f"model {r.model_mb:.1f} MB", highlight=False)
    _with_baseline(None, now, then, source, None, tol)


def _with_baseline(payload, now, old, old_path, save_path, tol) -> None:
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


@app.command()
@config_options(loading=Options(LoadConfig, only=("device", "resident", "prefetch", "memory_budget", "pin", "pack", "cache_dir")))
def generate(
    artifact: Artifact,
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts, after the artifact (or --prompt).", show_default=False)] = None,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="A prompt (repeat for a batch).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(help="Tokens to add per prompt at most (default 32; an encoder-decoder: its generation config's max_length).", show_default=False)] = None,
    num_beams: Annotated[Optional[int], typer.Option(help="Encoder-decoders: beam search over this many hypotheses (1: greedy; default: the model's generation config).", show_default=False)] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Sampling temperature; 0 is greedy (the most likely token each step). Default 0; an encoder-decoder: its generation config's (greedy unless it samples).", show_default=False)] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Sample among the k most likely tokens only (0: off). Default off; an encoder-decoder: its generation config's.", show_default=False)] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Sample among the most likely tokens whose probabilities add up to p (1: off). Default off; an encoder-decoder: its generation config's.", show_default=False)] = None,
    repetition_penalty: Annotated[float, typer.Option(help="Divide the logits of tokens already seen by this (1: off).")] = 1.0,
    presence_penalty: Annotated[float, typer.Option(help="Subtract this from the logit of every token the answer already holds (OpenAI's; -2 to 2, 0: off).")] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(help="Subtract this from a token's logit for each time the answer already holds it (OpenAI's; -2 to 2, 0: off).")] = 0.0,
    logit_bias: Annotated[Optional[list[str]], typer.Option("--logit-bias", help="ID=BIAS: add BIAS (-100 to 100) to token ID's logit before sampling, as OpenAI's logit_bias; -100 keeps the token out (repeat).", show_default=False)] = None,
    logprobs: Annotated[Optional[int], typer.Option(help="With --json: each new token's log-probability and this many most likely alternatives (0 to 20).", show_default=False)] = None,
    response_format: Annotated[Optional[str], typer.Option(help='Hold the answer to a format: "json" (a JSON object), or OpenAI\'s response_format as JSON, e.g. \'{"type": "json_schema", "json_schema": {"schema": {...}}}\' (also {"type": "regex", "regex": ...} and {"type": "grammar", "grammar": LARK}).', show_default=False)] = None,
    seed: Annotated[Optional[int], typer.Option(min=0, help="Seed for sampling: the same seed gives the same text.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop where this text appears; it is not printed (repeat).")] = None,
    stop_token_id: Annotated[Optional[list[int]], typer.Option("--stop-token-id", help="Stop after this token id, beside the end-of-sequence ones (repeat).")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt as a user message in the model's chat template.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="With --chat: a system message before each prompt.")] = None,
    tools: Annotated[Optional[str], typer.Option("--tools", help='With --chat: a JSON file of the functions the model may call, OpenAI\'s tools list ([{"type": "function", "function": {"name", "description", "parameters"}}]); each call prints after the text, and under "tool_calls" with --json.', show_default=False)] = None,
    tool_choice: Annotated[str, typer.Option(help='With --tools: "auto" (text or calls), "required" (calls only), "none", or the name of the one function to call.')] = "auto",
    chat_template: Annotated[Optional[str], typer.Option("--chat-template", help="With --chat: a Jinja chat template file rendered instead of the artifact's (e.g. one that knows tools).", show_default=False)] = None,
    truncate: Annotated[bool, typer.Option("--truncate", help="Keep the end of a prompt longer than the model's context instead of refusing it.")] = False,
    prompt_lookup: Annotated[int, typer.Option(min=0, help="Also compute this many guessed positions a pass, copied from where the last tokens appeared before (same text, fewer passes when it quotes its prompt; 0: off).")] = 0,
    loading: OptionValues = None,
    as_json: AsJson = False,
):
    """Continue prompts with a decoder artifact (converted with --task text-generation[-with-past]),
    printing the text as it comes: greedy by default, sampled with --temperature."""
    from slimml.errors import ConfigError
    from slimml.runtime import load
    from slimml.runtime.tasks.generation import GenerationConfig

    length = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    config = GenerationConfig(**length, temperature=0.0 if temperature is None else temperature,
                              top_k=0 if top_k is None else top_k, top_p=1.0 if top_p is None else top_p,
                              repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, logit_bias=_logit_bias(logit_bias), logprobs=logprobs,
                              response_format=_response_format(response_format), seed=seed, stop=tuple(stop or ()),
                              stop_token_ids=tuple(stop_token_id or ()), truncate=truncate, prompt_lookup=prompt_lookup)
    if logprobs is not None and not as_json:
        raise ConfigError("--logprobs adds each token's log-probabilities to the JSON output; add --json.")
    if system is not None and not chat:
        raise ConfigError("--system is a chat message; add --chat, or put the text in --prompt.")
    for flag, value in (("--tools", tools), ("--chat-template", chat_template)):
        if value is not None and not chat:
            raise ConfigError(f"{flag} is for chats; add --chat.")
    offered = _tool_options(tools, tool_choice)
    prompt = [*(prompts or ()), *(prompt or ())]
    if not prompt:
        raise ConfigError(f'no prompt given; add one after the artifact: slimml generate {artifact} "Once upon a time" '
                          '(or --prompt TEXT, repeated for a batch).')
    head = [{"role": "system", "content": system}] if system is not None else []
    conversations = [[*head, {"role": "user", "content": p}] for p in prompt]
    model = load(artifact, loading.build())
    if not model.supports("generate"):  # the task's own refusal names Python's methods: here, the command
        raise ConfigError(f"{artifact} is a {model.manifest.task!r} model, which does not generate text; use "
                          f"`slimml run {artifact} TEXT` for its outputs.")
    if num_beams is not None and model.supports("stream"):
        raise ConfigError("--num-beams is beam search for encoder-decoders (T5, BART, Marian); a decoder decodes greedily "
                          "or samples (--temperature): drop --num-beams.")
    if chat_template is not None and model.supports("stream"):
        model.use_chat_template(chat_template)
    if model.plan.streaming and not as_json:
        err.print(model.plan.describe())
    if not model.supports("stream"):  # an encoder-decoder answers: greedy, sampled or by beam search
        sampling = dict(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, seed=seed)
        if chat or config != GenerationConfig(**length, **sampling, truncate=truncate, prompt_lookup=prompt_lookup):
            raise ConfigError(f"{artifact} is an encoder-decoder, which generates greedily, by sampling (--temperature, "
                              "--top-k, --top-p, --seed) or by beam search (--num-beams), without a chat template; drop "
                              "--repetition-penalty, --presence-penalty, --frequency-penalty, --logit-bias, --logprobs, "
                              "--response-format, --stop and --chat.")
        result = model.generate(list(prompt), max_new_tokens=max_new_tokens, num_beams=num_beams, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed)  # None: the model's own; 0 and 1.0 turn them off
        if not as_json:
            for p, text in zip(prompt, result.texts):
                console.print(Text(p, style="bold") + Text(f" -> {text}"), soft_wrap=True)
    elif as_json:
        result = model.chat(conversations, config, **offered) if chat else model.generate(list(prompt), config=config)
    else:
        made, seconds = 0, 0.0
        for p, messages in zip(prompt, conversations):  # one at a time, so that each prompt's text prints as it is produced
            pieces = (model.chat(messages, config, stream="deltas", **offered) if chat  # thoughts print as they come
                      else model.stream(p, config))  # refuses before printing
            console.print(Text(p, style="bold"), end="\n" if chat else "", highlight=False,  # Text: a prompt's [brackets]
                          soft_wrap=True)  # are not markup; soft_wrap: no line breaks of the console's width in it
            thinking = False
            for piece in pieces:
                if chat:  # a reasoning model's thoughts between <think> tags, whatever its format writes
                    text = ("" if thinking else "<think>\n") + piece.reasoning if piece.reasoning else ""
                    thinking = thinking or bool(piece.reasoning)
                    if piece.content and thinking:
                        text, thinking = text + "\n</think>\n\n", False
                    piece = text + piece.content
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n</think>\n" if thinking else "\n")
            for call in (pieces.result.tool_calls or [[]])[0]:
                sys.stdout.write(f"[tool call {call.id}] {call.name}({json.dumps(call.arguments, ensure_ascii=False)})\n")
            made, seconds = made + len(pieces.result.tokens[0]), seconds + pieces.result.seconds
        err.print(f"{made} tokens in {seconds:.2f} s ({made / seconds if seconds else 0:.1f} tokens/s)")
        return
    if as_json:
        out = {"texts": result.texts, "tokens": result.tokens, "finish_reasons": result.finish_reasons,
               "seconds": round(result.seconds, 3), "tokens_per_s": round(result.tokens_per_s, 2)}
        if getattr(result, "reasoning", None) is not None:
            out["reasoning"] = result.reasoning
        if getattr(result, "tool_calls", None) is not None:
            out["tool_calls"] = [[{"id": c.id, "name": c.name, "arguments": c.arguments} for c in row] for row in result.tool_calls]
        if result.logprobs is not None:
            out["logprobs"] = [[{"id": e.id, "logprob": e.logprob, "top": [list(t) for t in e.top]} for e in row]
                               for row in result.logprobs]
        print(json.dumps(out))
        return
    err.print(f"{sum(map(len, result.tokens))} tokens in {result.seconds:.2f} s ({result.tokens_per_s:.1f} tokens/s)")


def _logit_bias(values: list[str] | None) -> dict[str, float] | None:
    """``--logit-bias ID=BIAS`` (repeated) as ``{ID: BIAS}`` (checked by GenerationConfig)."""
    from slimml.errors import ConfigError

    out: dict[str, float] = {}
    for v in values or ():
        token, _, bias = v.partition("=")
        try:
            if not (token.strip().isascii() and token.strip().isdigit()):
                raise ValueError
            out[token.strip()] = float(bias)
        except ValueError:
            raise ConfigError(f"--logit-bias {v!r} is not ID=BIAS (a token id and a number); write e.g. --logit-bias "
                              "50256=-100.") from None
    return out or None


def _tool_options(path: str | None, choice: str) -> dict:
    """``--tools FILE`` and ``--tool-choice`` as ``chat``'s ``tools`` and ``tool_choice`` (checked there)."""
    from slimml.errors import ConfigError

    if path is None:
        if choice not in ("auto", "none"):
            raise ConfigError("--tool-choice chooses among --tools; add --tools FILE, or leave --tool-choice out.")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            tools = json.load(f)
    except OSError as e:
        raise ConfigError(f"--tools {path} cannot be read ({e.strerror}); give a JSON file of OpenAI's tools list.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--tools {path} is not JSON ({getattr(e, 'msg', e)}); write OpenAI's tools list, "
                          '[{"type": "function", "function": {"name": ..., "parameters": {...}}}].') from None
    if choice not in ("auto", "required", "none"):
        choice = {"type": "function", "function": {"name": choice}}
    return {"tools": tools, "tool_choice": choice}


def _response_format(value: str | None) -> dict | None:
    """``--response-format``: "json", or OpenAI's response_format written as JSON."""
    from slimml.errors import ConfigError

    if value is None:
        return None
    if value.strip() == "json":
        return {"type": "json_object"}
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError) as e:  # ValueError: a number of more than 4,300 digits
        why = f"{e.msg} at character {e.pos}" if isinstance(e, json.JSONDecodeError) else "nested too deeply or a number too long"
        raise ConfigError(f"--response-format is not JSON ({why}); pass \"json\", or e.g. "
                          '\'{"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}\'.') from None
    return parsed


@app.command("serve")
@config_options(serving=Options(ServeConfig))
def serve_(
    artifact: Artifact,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 for other machines).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    address: Annotated[Optional[str], typer.Option(help="Ray cluster to join ('auto' after `ray start`); default: a local Ray.")] = None,
    direct_ingress: Annotated[bool, typer.Option("--direct-ingress", help="One replica answers HTTP on --port itself, without Serve's proxy in between (Ray Serve's direct ingress): 0.87-0.90x of in-process encode at 32 texts a request on 2 cores, against 0.73x through the proxy. A replica that crashes leaves the port refusing connections until Serve's replacement listens (seconds to a minute, as Serve notices).")] = False,
    serving: OptionValues = None,
):
    """Serve an artifact over HTTP on Ray Serve (needs the serve extra); Ctrl-C or SIGTERM stops it."""
    from slimml.scale.cluster import require_ray
    from slimml.serve import serve

    require_ray()
    serving.values["api_key"] = serving["api_key"] or None  # an empty SLIMML_API_KEY is no key
    config = serving.build(artifact=str(artifact))
    serve(config, host=host, port=port, address=address, direct_ingress=direct_ingress,
          ready=lambda url: err.print(f"serving {artifact} at {url} (POST /v1/embeddings, /v1/chat/completions, "
                                      "/v1/completions, /v1/rerank, /v1/entities, /v1/answer, /v1/classify, "
                                      "/v1/audio/transcriptions, /v1/responses, /v1/generate or /v1/run, as the model allows; GET /health, "
                                      "/v1/models); Ctrl-C stops"))


def _terminated(signum, frame) -> None:
    stop_asked(signum)  # should the exception be lost (raised in a __del__), no artifact is swapped in after all
    raise SystemExit(128 + signum)  # unwind as Ctrl-C does: a convert removes its half-written folder


def _interrupted(signum, frame) -> None:
    stop_asked(signum)
    raise KeyboardInterrupt


def main() -> None:
    """Entry point: run the app, turning slimml errors into one line and exit code 1, and a
    command line Typer cannot parse (an unknown option, ``--seed abc``) into one line and exit code 2.
    SIGTERM ends a command as Ctrl-C does, leaving nothing half-written (exit 143); ``serve``
    installs its own handler."""
    signal.signal(signal.SIGTERM, _terminated)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the shell ignores it (cmd &)
        signal.signal(signal.SIGINT, _interrupted)
    try:
        code = app(standalone_mode=False)
    except SlimmlError as e:
        if os.environ.get("SLIMML_DEBUG"):
            raise
        err.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)  # a path "[x]" is text
        sys.exit(1)
    except OSError as e:  # a path the library did not expect to fail on (a name too long, a link loop)
        if os.environ.get("SLIMML_DEBUG"):
            raise
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        err.print(f"[bold red]error:[/bold red] {escape(e.strerror or str(e))}{escape(where)}; check the path and its "
                  "permissions (SLIMML_DEBUG=1 shows the traceback).", highlight=False, soft_wrap=True)
        sys.exit(1)
    except MemoryError as e:  # numpy's _ArrayMemoryError too: a batch or input the machine cannot hold
        if os.environ.get("SLIMML_DEBUG"):
            raise
        what = " ".join(str(e).split())[:200]
        err.print(f"[bold red]error:[/bold red] out of memory{escape(f' ({what})' if what else '')}; use fewer rows or "
                  "shorter inputs a call (--batch), or a memory budget (--memory-budget).", highlight=False, soft_wrap=True)
        sys.exit(1)
    except typer.Abort:
        err.print("aborted.")
        sys.exit(1)
    except ImportError as e:  # a command of an extra this install does not have (quantize on the base install)
        missing = missing_extra(e)
        if missing is None or os.environ.get("SLIMML_DEBUG"):
            raise
        err.print(f"[bold red]error:[/bold red] {escape(str(missing))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except Exception as e:
        if not (hasattr(e, "format_message") and hasattr(e, "exit_code")):
            raise
        # click's UsageError, BadParameter, NoSuchOption (vendored by Typer): the user's command line
        where = e.ctx.command_path if getattr(e, "ctx", None) is not None else "slimml"
        err.print(f"[bold red]error:[/bold red] {escape(e.format_message().rstrip('.'))}; see `{where} --help`.",
                  highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)  # typer.Exit(n) comes back as n without standalone mode
