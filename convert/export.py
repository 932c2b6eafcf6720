"""Export a source model to one ONNX file (the input of the splitter).

Hugging Face folders go through optimum-onnx, which knows each architecture's inputs and dynamic
axes; torch modules through ``torch.onnx.export``; ONNX files are checked and used in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from slimml.convert.exported import Exported
from slimml.convert.folder_facts import (class_labels, config_facts, hf_config, is_causal_lm, preprocessor_file,
                                         seq2seq_spec, task_from_config, task_or_none, tokenizer_info)
from slimml.convert.sources import Source, resolve, sentence_transformers_pooling, sparse_encoder_splade, write_st_dense
from slimml.errors import ExportError, SlimmlError, SourceError

EXPORTERS = ("auto", "optimum", "torch", "layerwise", "fused")
# the Hugging Face tasks an exporter takes (optimum's names; "-with-past": with the KV cache), and
# sentence-embedding, a sentence-transformers folder's own
TASKS = ("auto", "audio-classification", "audio-frame-classification", "audio-xvector", "automatic-speech-recognition",
         "automatic-speech-recognition-with-past", "depth-estimation", "feature-extraction", "feature-extraction-with-past",
         "fill-mask", "image-classification", "image-segmentation", "image-to-text", "image-to-text-with-past",
         "mask-generation", "masked-im", "multiple-choice", "object-detection", "question-answering",
         "semantic-segmentation", "sentence-embedding", "text-classification", "text-generation",
         "text-generation-with-past", "text-to-audio", "text2text-generation", "text2text-generation-with-past",
         "token-classification", "zero-shot-image-classification", "zero-shot-object-detection")


@dataclass
class ExportConfig:
    """How to export.

    Args:
        opset: ONNX opset (default: optimum's choice for HF models, 17 for torch modules).
        task: Hugging Face task, or ``"auto"`` to infer it from the model's config.
        dynamic_batch: make dim 0 of every torch-module input and output of rank >= 1 dynamic (a 0-d
            tensor, a scale or a loss, has none).
        exporter: for Hugging Face folders, ``"optimum"`` (optimum-onnx traces the model whole, so it
            must fit in memory; it needs transformers < 4.58), ``"torch"`` (``torch.onnx.export`` of a
            single-graph model, encoders and classifiers, with any transformers: ``convert.export_torch``;
            a causal LM with its KV cache: ``convert.export_torch_decoder``),
            ``"layerwise"`` (a Llama-family decoder, one layer in memory at a time:
            ``convert.layerwise``), ``"fused"``: a decoder written from its safetensors as ONNX
            Runtime's fused decoder graph with its KV cache (GroupQueryAttention with rotary, packed
            projections: ``convert.fused_llama``), the fast one to decode; or ``"auto"``: fused for a
            decoder it can write (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Granite, OLMo 2/3, Gemma 1-3 text; task
            ``auto`` or ``text-generation-with-past``), layerwise for a cache-free decoder whose weights
            take more than a third of the memory available, optimum otherwise (torch where optimum-onnx
            does not load with the installed transformers). A decoder that
            fused cannot write is traced with its KV cache (optimum, else torch where optimum-onnx does
            not load or know it), with the reason in ``Exported.note``.
    """

    opset: int | None = field(default=None, metadata={"help": "ONNX opset."})
    task: str = field(default="auto", metadata={"help": "Hugging Face task to export, or 'auto'."})
    dynamic_batch: bool = True
    exporter: str = field(default="auto", metadata={"help": "auto (fused for Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Granite, OLMo 2/3 and Gemma 1/2/3 decoders, else "
                                                    "optimum, or torch where optimum-onnx does not load), optimum (traces the whole model; transformers < 4.58), "
                                                    "torch (torch.onnx.export of an encoder, classifier or decoder with its KV cache, any transformers), layerwise (Llama-family "
                                                    "decoders bigger than memory, one layer at a time, no cache) or fused "
                                                    "(Llama-family and Gemma decoders as ONNX Runtime's fused decoder graph with its "
                                                    "KV cache: the fastest to generate with)."})

    def __post_init__(self):
        if self.opset is not None and not 11 <= self.opset <= 23:
            raise SourceError(f"opset {self.opset} is outside what slimml supports (11..23); use 17 if unsure.")
        if self.exporter not in EXPORTERS:
            raise SourceError(f"unknown exporter {self.exporter!r}; use one of {', '.join(EXPORTERS)}.")
        if self.task not in TASKS:
            import difflib

            near = difflib.get_close_matches(str(self.task), TASKS, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise SourceError(f"unknown task {self.task!r}; {hint}use auto (the task the model's config names) or one "
                              f"of {', '.join(TASKS[1:])}.")


def export(source: Source, work_dir: str | os.PathLike, config: ExportConfig | None = None) -> Exported:
    """Export ``source`` to one ONNX graph in ``work_dir`` (weights may sit beside it as external
    data); an ONNX file is checked and used where it is.

    The first stage of :func:`~slimml.convert.convert`; :func:`~slimml.convert.shard` splits what it writes.

    Args:
        source: what to export: a :class:`~slimml.convert.sources.Source` from
            :func:`~slimml.convert.resolve`, or what ``resolve`` takes (a model folder, a ``.gguf``
            or ``.onnx`` file, a torch module; None: the default model).
        work_dir: a folder, made where missing.
        config: how to export (default: ``ExportConfig()``, the exporter chosen by the model).

    Returns:
        An :class:`~slimml.convert.exported.Exported`: ``onnx_path`` (``work_dir/onnx/model.onnx``
        for a model folder, ``work_dir/model.onnx`` for a torch module, the file itself for an ONNX
        file) and what the runtime needs beside the graph (tokenizer, pooling, labels, an
        encoder-decoder's ``graphs``); ``note`` says why ``"auto"`` did not use its first choice of
        exporter.

    Raises:
        ExportError: the exporter failed; the message keeps the exporter's first line.
        SourceError: an exporter that does not take this kind of source.

    Example:
        >>> from pathlib import Path
        >>> from slimml.convert import ExportConfig, export, resolve, shard
        >>> exported = export(resolve(None), Path("work"), ExportConfig(exporter="torch"))
        >>> exported.onnx_path
        PosixPath('work/onnx/model.onnx')
        >>> specs = shard(exported.onnx_path, "shards")   # shard_000.onnx, ...; specs for a manifest
    """
    config = config or ExportConfig()
    if not isinstance(source, Source):  # a path, as convert() takes it
        source = resolve(source)
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    if config.exporter == "layerwise" and source.kind != "huggingface":
        raise SourceError(f"--exporter layerwise exports Hugging Face model folders; {source.name} is a {source.kind} "
                          "source. Leave --exporter out.")
    if source.kind == "static":  # a table of token vectors: one Gather, written by slimml
        from slimml.convert.static_embedding import export_static

        return export_static(source, work_dir, config.task, config.exporter, config.opset)
    if config.exporter == "fused":
        return _export_fused(source, work_dir, config)
    if source.kind == "onnx":
        return _export_onnx_file(source, work_dir)
    if source.kind == "torch":
        return _export_module(source, work_dir, config)
    note = None
    if config.exporter == "auto":  # fused first, whatever the size: it reads one tensor at a time
        fused, note = _auto_fused(source.path, config.task)
        if fused:
            try:
                return _export_fused(source, work_dir, config)
            except (SlimmlError, KeyError, ValueError, TypeError) as e:  # never a failure: today's exporter instead
                shutil.rmtree(work_dir / "onnx", ignore_errors=True)
                note = f"the fused exporter failed ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if _layerwise(source.path, config):  # cache-free asked for, or fused could not write it: too big to trace
        return _export_layerwise(source, work_dir, config, note)
    if note and config.task == "auto":  # a decoder fused cannot write: a traced graph, with its cache where it can
        return _traced_decoder(source, work_dir, config, note)
    if config.exporter in ("torch", "optimum") and config.task == "auto" and is_causal_lm(source.path):  # generating wants the cache
        config = replace(config, task="text-generation-with-past")
    exported = _export_huggingface(source, work_dir, config)
    if note:
        exported.note = f"{note}; " + (exported.note or f"exported with {_EXPORTER_NAMES[exported.info['exporter']]}")
    return exported


_EXPORTER_NAMES = {"optimum": "optimum-onnx", "torch": "torch.onnx.export"}


def _traced_decoder(source: Source, work_dir: Path, config: ExportConfig, note: str) -> Exported:
    """A causal LM the fused exporter cannot write, traced whole (optimum-onnx, else the torch
    exporter) with its KV cache (what generating wants: each token then reads the cache, not the whole
    sequence again); where neither can write the cache, without it, the report's note saying so."""
    from slimml.convert.export_torch_decoder import experts_reason

    if why := experts_reason(hf_config(source.path)):  # neither traced exporter writes it
        raise ExportError(f"{why}; convert a model slimml's exporters write, or export this one to ONNX yourself and "
                          "convert the .onnx file.")
    try:
        exported = _export_huggingface(source, work_dir, replace(config, task="text-generation-with-past"))
        exported.note = f"{note}; exported with {_EXPORTER_NAMES[exported.info['exporter']]}, with its KV cache"
    except ExportError as e:
        shutil.rmtree(work_dir / "onnx", ignore_errors=True)
        exported = _export_huggingface(source, work_dir, replace(config, task="text-generation"))
        exported.note = (f"{note}; {_EXPORTER_NAMES[exported.info['exporter']]} could not write its KV cache "
                         f"({str(e).splitlines()[0][:160]}), so each generated token runs the whole sequence again")
    return exported


def _auto_fused(folder: Path, task: str) -> tuple[bool, str | None]:
    """Whether ``--exporter auto`` writes ``folder`` with the fused exporter, else why not (a decoder's
    reason, None for other models): a decoder asked for with its cache, or with task ``auto`` (a
    causal LM is converted to generate, and generating wants the cache)."""
    from slimml.convert.fused_llama import can_export_fused

    if task not in ("auto", "text-generation-with-past"):
        return False, None
    if task == "auto" and (task_or_none(folder) != "text-generation" or sentence_transformers_pooling(folder)):
        return False, None
    why = can_export_fused(folder)
    return why is None, why and f"the fused exporter cannot write it ({why})"


def _layerwise(folder: Path, config: ExportConfig) -> bool:
    from slimml.convert.layerwise import can_export_layerwise, check_layerwise_request
    from slimml.convert.weights import weight_bytes
    from slimml.runtime.engine.budget import bigger_than_memory

    if config.exporter == "layerwise":
        check_layerwise_request(folder, config.task)
        return True
    return (config.exporter == "auto" and config.task in ("auto", "text-generation") and can_export_layerwise(folder)
            and bigger_than_memory(weight_bytes(folder)))


def _export_layerwise(source: Source, work_dir: Path, config: ExportConfig, note: str | None = None) -> Exported:
    """Export a three-layer template of ``source``; ``convert.layerwise`` writes the real shards from it.
    ``note``: why the fused exporter did not write it (the report says the graph has no KV cache)."""
    from slimml.convert.layerwise import make_template

    template = work_dir / "template"
    depth = make_template(source.path, template)
    exported = _export_huggingface(Source(kind="huggingface", name=source.name, path=template), work_dir,
                                   ExportConfig(opset=config.opset, task="text-generation", exporter="optimum"))
    exported.layerwise = {"template": template, "folder": source.path, "depth": depth}
    exported.info = {"hf_task": "text-generation", **config_facts(source.path), "exporter": "layerwise"}
    if note:
        exported.note = f"{note}; exported layer by layer without its KV cache (too big to trace whole)"
    return exported


def _export_fused(source: Source, work_dir: Path, config: ExportConfig) -> Exported:
    """A decoder with its cache as ONNX Runtime's fused graph (``convert.fused_llama``)."""
    from slimml.convert.fused_llama import export_fused, rope_facts

    if source.kind != "huggingface" or config.task not in ("auto", "text-generation", "text-generation-with-past"):
        raise SourceError(f"--exporter fused exports a Llama-family or Gemma model folder as text-generation-with-past; "
                          f"{source.name} is a {source.kind} source asked for as {config.task!r}. Leave --exporter out.")
    onnx_dir = work_dir / "onnx"
    path = export_fused(source.path, onnx_dir)
    tokenizer = tokenizer_info(source.path, onnx_dir, None)
    return Exported(onnx_path=path, task="text-generation-with-past", tokenizer=tokenizer,
                    tokenizer_dir=onnx_dir if tokenizer else None,
                    info={"hf_task": "text-generation-with-past", **config_facts(source.path), **rope_facts(source.path),
                          "exporter": "fused"})


def _export_onnx_file(source: Source, work_dir: Path) -> Exported:
    import onnx

    try:
        onnx.checker.check_model(str(source.path))
    except Exception as e:
        raise SourceError(f"{source.path} is not a valid ONNX model ({str(e).splitlines()[0].rstrip('.')}); export it "
                          "again (onnx.checker.check_model names the fault), or convert the model it came from.") from None
    rows = _table_rows(onnx.load(str(source.path), load_external_data=False).graph)
    return Exported(onnx_path=source.path, task="generic", info={"vocab_size": rows} if rows else {})


def _table_rows(graph: Any) -> int | None:
    """The rows of the smallest table a graph input indexes (``Gather(table, ids)``, the ids cast or
    not): the check's and the timing's sample ids must stay inside it. None where no input does."""
    weights = {t.name: t for t in graph.initializer}
    inputs = {i.name for i in graph.input} - set(weights)
    cast = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Cast" and n.input and n.input[0] in inputs}
    rows = []
    for n in graph.node:
        if n.op_type == "Gather" and len(n.input) == 2 and n.input[0] in weights and (n.input[1] in inputs or n.input[1] in cast):
            axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
            dims = weights[n.input[0]].dims
            if -len(dims) <= axis < len(dims):
                rows.append(dims[axis])
    return int(min(rows)) if rows else None


def _export_module(source: Source, work_dir: Path, config: ExportConfig) -> Exported:
    """``torch.onnx.export`` of an ``nn.Module``: its inputs named and ordered as ``forward`` takes them
    (a dict of example inputs by its keys), dim 0 of each tensor of rank >= 1 dynamic (``dynamic_batch``)."""
    import torch

    module, args, kwargs, names = _module_call(source)
    with torch.no_grad():
        out = module(*args, **(kwargs or {}))
    outs = output_tensors(out)
    out_names = source.output_names or ([f"output_{i}" for i in range(len(outs))] if len(outs) > 1 else ["output"])
    given = [*(kwargs or {}).values(), *args]
    # a 0-d tensor (a scale, a loss) has no batch axis to make dynamic
    dynamic = {n: {0: "batch"} for n, t in [*zip(names, given), *zip(out_names, outs)]
               if getattr(t, "ndim", 0) >= 1} if config.dynamic_batch else None
    path = work_dir / "model.onnx"
    try:
        with warnings.catch_warnings(), _quiet_stdout():  # torch's C++ logger prints its IR on a failure
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module, args, str(path), kwargs=kwargs, input_names=names, output_names=out_names,
                dynamic_axes=dynamic, opset_version=config.opset or 17, dynamo=False, do_constant_folding=True,
            )
    except Exception as e:
        raise ExportError(f"torch.onnx.export failed for {source.name} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0].rstrip('.')}); try another --opset, replace what fails in forward(), "
                          "or export it to ONNX yourself and convert the .onnx file.") from None
    return Exported(onnx_path=path, task="generic")


def output_tensors(out) -> list:
    """A module's output as the ONNX exporter flattens it: tensors in order through tuples, lists
    and dicts (a transformers ``ModelOutput`` is one, its unset fields left out)."""
    if isinstance(out, dict):
        return [t for v in out.values() if v is not None for t in output_tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in output_tensors(v)]
    return [out]


def _module_call(source: Source) -> tuple[Any, tuple, dict | None, list[str]]:
    """How to call the source module for the export: (module, args, kwargs, input names).

    A tuple or list of example inputs is passed positionally, named ``input_N`` (or the source's
    ``input_names``). A dict is passed by name, its inputs ordered as ``forward``'s signature orders
    them (the TorchScript exporter binds them so, whatever the dict's order); keyword-only
    parameters go through a wrapper that takes every input positionally in that order. A forward
    that also takes ``**kwargs`` (transformers 5's models) is called through such a wrapper too:
    the exporter would pass every parameter's default by position, and transformers 5 then gave
    ``use_cache`` twice ("got multiple values for argument 'use_cache'").
    """
    import inspect

    example = source.example_inputs
    try:
        params = inspect.signature(source.module.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature Python can read
        params = None
    kinds = inspect.Parameter
    open_ended = params is not None and any(p.kind == kinds.VAR_KEYWORD for p in params.values())
    if not isinstance(example, dict):
        args = tuple(example) if isinstance(example, (tuple, list)) else (example,)
        names = list(source.input_names or [f"input_{i}" for i in range(len(args))])
        return (_exactly(source.module) if open_ended else source.module), args, None, names
    if params is None:  # the dict's order
        return source.module, (), dict(example), list(example)
    named = [n for n, p in params.items() if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    extra = [n for n in example if n not in named]
    if extra and not open_ended:
        raise SourceError(f"example_inputs names {', '.join(map(repr, extra))}, which {source.name}.forward does not take "
                          f"(its parameters: {', '.join(named) or 'none by name'}); name the inputs as forward does.")
    order = [n for n in named if n in example] + extra
    kwargs = {n: example[n] for n in order}
    if not open_ended and all(params[n].kind == kinds.POSITIONAL_OR_KEYWORD for n in order if n in params):
        return source.module, (), kwargs, order
    return _exactly(source.module, order), tuple(kwargs.values()), None, order


def _exactly(inner, order: list[str] | None = None):
    """``inner`` as a module called with exactly the inputs given, by position or by the names
    ``order`` (the TorchScript exporter passes inputs by position, and fills in the defaults it sees)."""
    import torch

    class Exactly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, *values):
            return self.inner(*values) if order is None else self.inner(**dict(zip(order, values)))

    # in the inner module's mode: the exporter sets eval for the trace and then restores the wrapper's
    # mode to every submodule, which left a module in eval mode training (dropout on) afterwards
    return Exactly().train(inner.training)


@contextlib.contextmanager
def _quiet_stdout():
    """Keep what C++ code writes to stdout (torch's ONNX logger) out of slimml's output."""
    import sys
    import tempfile

    fd = 1  # C++ writes to the process's stdout, whatever Python's sys.stdout is
    sys.stdout.flush()
    try:
        saved = os.dup(fd)
    except OSError:  # no stdout at all: nothing to keep quiet
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), fd)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, fd)
            os.close(saved)


def _export_huggingface(source: Source, work_dir: Path, config: ExportConfig) -> Exported:
    folder = source.path
    # --task feature-extraction: the transformer's token states, whatever sentence-transformers pipeline it heads
    pooling = sentence_transformers_pooling(folder) if config.task != "feature-extraction" else None
    # --task fill-mask: a SPLADE model's masked LM alone, its logits out
    splade = sparse_encoder_splade(folder) if config.task not in ("feature-extraction", "fill-mask") else None
    if pooling is not None:
        task, out_task = "feature-extraction", "sentence-embedding"
    elif splade is not None:
        task, out_task = "fill-mask", "sentence-embedding"
    elif config.task != "auto":
        task = out_task = config.task
    else:
        task = out_task = task_from_config(folder)
    if config.task != "auto" and pooling is None and splade is None:
        _refuse_new_head(folder, task)
    seq2seq = task.removesuffix("-with-past") in _SEQ2SEQ_TASKS and bool(hf_config(folder).get("is_encoder_decoder"))
    if seq2seq:  # an encoder and a decoder with its cache: three graphs
        out_task = task.removesuffix("-with-past")
        task = out_task + "-with-past"
    onnx_dir = work_dir / "onnx"
    exporter = _traced_exporter(folder, task, config)
    fallback = None
    if exporter == "optimum":
        try:
            _optimum_export(folder, onnx_dir, task, config)
        except ExportError as e:  # a model or head optimum-onnx does not know (StarCoder2, ModernBERT QA): torch's trace
            if not _torch_fallback(folder, task, config):
                raise
            shutil.rmtree(onnx_dir, ignore_errors=True)
            exporter = "torch"
            why = getattr(e, "cause", None) or str(e).splitlines()[0]
            fallback = f"optimum-onnx could not export it ({why[:200]}); exported with torch.onnx.export"
    if exporter == "torch":
        from slimml.convert.export_torch import export_torch
        from slimml.convert.export_torch_decoder import export_torch_decoder

        if seq2seq:  # three graphs, as optimum-onnx writes them
            from slimml.convert.export_torch_seq2seq import export_torch_seq2seq

            export_torch_seq2seq(folder, onnx_dir, task, config.opset)
        else:
            write = export_torch_decoder if _traced_decoder_task(folder, task) else export_torch
            write(folder, onnx_dir / "model.onnx", task, config.opset)
    graphs = {name: onnx_dir / f"{name}_model.onnx" for name in ("encoder", "decoder", "decoder_with_past")}
    if seq2seq and all(p.is_file() for p in graphs.values()):
        onnx_path = graphs["encoder"]
    else:
        graphs = {}
        onnx_path = onnx_dir / "model.onnx"
    if not onnx_path.is_file():
        wrote = sorted(p.name for p in onnx_dir.glob("*.onnx"))
        raise ExportError(
            f"optimum-onnx wrote {', '.join(wrote) or 'no ONNX file'} for {folder} (task {task!r}), not the graph(s) "
            "slimml expected; pass --task to choose another export, or convert an ONNX file you exported yourself."
        )
    if splade is not None:  # the embedding computed in the graph: the logits never leave it
        from slimml.convert.splade import POOLING, add_splade_pooling

        add_splade_pooling(onnx_path, splade)
        pooling = {**POOLING, **{k: splade[k] for k in ("prompts", "default_prompt") if k in splade}}
    tokenizer = tokenizer_info(folder, onnx_dir, pooling)
    preprocessor, unshipped = preprocessor_file(folder, onnx_path)
    if pooling is not None and pooling.get("dense"):
        write_st_dense(folder, pooling, onnx_dir)  # the projections after pooling, as the files the record names
    return Exported(
        onnx_path=onnx_path, task=out_task, pooling=pooling, pooling_dir=onnx_dir, tokenizer=tokenizer,
        tokenizer_dir=onnx_dir if tokenizer else None, preprocessor=preprocessor, preprocessing_note=unshipped,
        labels=class_labels(folder, task), graphs=graphs, seq2seq=seq2seq_spec(folder) if graphs else None,
        info={"hf_task": task, **config_facts(folder), "exporter": exporter, **({"splade": {k: splade[k] for k in ("strategy", "activation")}} if splade else {})},
        note=fallback,
    )


# the transformers class each head task loads (the weights a folder of another head lacks are made up)
_HEAD_CLASSES = {"text-classification": "AutoModelForSequenceClassification",
                 "token-classification": "AutoModelForTokenClassification",
                 "question-answering": "AutoModelForQuestionAnswering", "multiple-choice": "AutoModelForMultipleChoice",
                 "fill-mask": "AutoModelForMaskedLM", "image-classification": "AutoModelForImageClassification",
                 "audio-classification": "AutoModelForAudioClassification", "text-generation": "AutoModelForCausalLM",
                 "text2text-generation": "AutoModelForSeq2SeqLM"}


def _refuse_new_head(folder: Path, task: str) -> None:
    """Refuse a ``--task`` whose head the folder's weights do not hold (a classifier asked of a folder
    saved without one): transformers would start it from random weights, and the artifact with it.
    Loaded only where the task is not the one the config's architecture names (that class is what
    the weights were saved from)."""
    base = task.removesuffix("-with-past")
    name = _HEAD_CLASSES.get(base)
    if name is None or base == task_or_none(folder):
        return
    import transformers

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = getattr(transformers, name).from_pretrained(str(folder), local_files_only=True,
                                                                      output_loading_info=True)
    except Exception:  # noqa: BLE001 -- a folder this class does not load: the exporter's own error says why
        return
    del model
    new = sorted({*info.get("missing_keys", ()), *(k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", ()))})
    if new:
        named = task_or_none(folder)
        raise SourceError(
            f"{folder} holds no trained {task} head: transformers would start {len(new)} of its weights "
            f"({', '.join(new[:3])}{', ...' if len(new) > 3 else ''}) from random values, and the artifact would answer "
            f"at random; convert a folder trained for {task}, or pass --task {named or 'feature-extraction'} "
            f"(what the folder holds{'' if named else ': its token states'}).")


def _traced_exporter(folder: Path, task: str, config: ExportConfig) -> str:
    """``"optimum"`` or ``"torch"`` for a model traced whole: the one asked for, else optimum-onnx where it
    loads (transformers < 4.58) and the torch exporter where it does not and can write the model."""
    if config.exporter in ("optimum", "torch"):
        if config.exporter == "torch" and (why := _torch_reason(folder, task)):
            raise SourceError(f"{why}; leave --exporter out.")
        return config.exporter
    from slimml.convert.export_torch import encoder_only

    if encoder_only(hf_config(folder), task):  # optimum would write the whole encoder-decoder, from half its weights
        return "torch"
    if _optimum_loads() is None:
        return "optimum"
    why = _torch_reason(folder, task)
    if why is not None and _traced_decoder_task(folder, task):
        raise ExportError(f"{why}; convert a model slimml's exporters write, or export this one to ONNX yourself "
                          "and convert the .onnx file.")
    return "torch" if why is None else "optimum"


def _torch_reason(folder: Path, task: str) -> str | None:
    """Why the torch exporter cannot write ``folder`` as ``task`` (a causal LM through
    ``convert.export_torch_decoder``, any other model through ``convert.export_torch``), or None."""
    from slimml.convert.export_torch import torch_export_reason
    from slimml.convert.export_torch_decoder import decoder_export_reason

    config = hf_config(folder)
    if _traced_decoder_task(folder, task):
        return decoder_export_reason(config)
    if task.removesuffix("-with-past") in _SEQ2SEQ_TASKS and config.get("is_encoder_decoder"):
        from slimml.convert.export_torch_seq2seq import seq2seq_export_reason

        return seq2seq_export_reason(config)
    return torch_export_reason(folder, task, config)


def _traced_decoder_task(folder: Path, task: str) -> bool:
    """Whether ``task`` asks for a causal LM (with or without its cache), not an encoder-decoder's graphs."""
    from slimml.convert.export_torch_decoder import DECODER_TASKS

    return task in DECODER_TASKS and not hf_config(folder).get("is_encoder_decoder")


def _torch_fallback(folder: Path, task: str, config: ExportConfig) -> bool:
    """Whether a model optimum-onnx failed on goes to the torch exporter: with ``--exporter auto``
    (optimum-onnx was tried, so it loads) where the torch exporter writes the model; never a folder
    of custom code (``auto_map``), whose refusal stands (slimml does not run a folder's own Python)."""
    return (config.exporter == "auto" and not hf_config(folder).get("auto_map")
            and _torch_reason(folder, task) is None)


def _optimum_loads() -> str | None:
    """None when optimum-onnx imports, else why not (it needs transformers < 4.58)."""
    try:
        import optimum.exporters.onnx  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def _optimum_export(folder: Path, onnx_dir: Path, task: str, config: ExportConfig) -> None:
    """optimum-onnx's ``main_export`` of ``folder`` as ``task`` into ``onnx_dir``."""
    if (why := _optimum_loads()) is not None:  # measured: optimum-onnx 0.1.0 does not import under transformers 5
        import transformers

        raise ExportError(
            f"exporting this model as {task!r} needs optimum-onnx, which does not load with transformers "
            f"{transformers.__version__} ({why}); install it with the transformers it supports: "
            "pip install 'transformers==4.57.6' 'optimum-onnx==0.1.0' (with any transformers, --exporter auto writes "
            "Llama-family, Gemma and mixture-of-experts decoders fused, and other decoders, T5, BART, mBART, Marian, "
            "Whisper, encoders, classifiers and vision models through torch.onnx).")
    from optimum.exporters.onnx import main_export
    from transformers.utils import logging as hf_logging

    logging.getLogger("optimum").setLevel(logging.ERROR)
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            main_export(
                str(folder), output=onnx_dir, task=task, opset=config.opset, library_name="transformers",
                local_files_only=True, do_validation=False, no_post_process=True, device="cpu",
            )
    except Exception as e:
        raise _optimum_failure(folder, task, e) from None


_SEQ2SEQ_TASKS = ("text2text-generation", "automatic-speech-recognition")


def _optimum_failure(folder: Path, task: str, e: Exception) -> ExportError:
    """optimum-onnx's exception as one line; the failures a user can act on say what to do (a model
    type the installed transformers does not know never reaches here: ``config_check`` refuses it).
    The error's ``cause`` is optimum's own first line, which a fallback to torch's exporter reports."""
    from slimml.convert.fused_family import NAMES

    first = str(e).splitlines()[0] if str(e) else ""
    kind = hf_config(folder).get("model_type")
    if "unsupported architecture" in first:  # optimum's long advice on custom ONNX configs
        err = ExportError(
            f"neither of slimml's exporters writes a {kind!r} model (optimum-onnx does not know the architecture; "
            f"the fused exporter writes {NAMES} decoders): export it to ONNX yourself "
            "(torch.onnx.export) and convert the .onnx file.")
    elif "contains custom code" in first:  # trust_remote_code: slimml does not run a folder's own Python
        from slimml.convert.export_torch_decoder import custom_code_error

        err = custom_code_error(folder)
    else:
        err = ExportError(f"optimum-onnx could not export {folder} as {task!r} ({type(e).__name__}: {first.rstrip('.')}); "
                          "try --exporter torch or another --task, or export it to ONNX yourself and convert the .onnx "
                          "file.")
    err.cause = f"{type(e).__name__}: {first}"
    return err
    if "contains custom code" in first:  # trust_remote_code: slimml does not run a folder's own Python
        from slimml.convert.export_torch_decoder import custom_code_error

        return custom_code_error(folder)
    return ExportError(f"optimum-onnx could not export {folder} as {task!r} ({type(e).__name__}: {first.rstrip('.')}); "
                       "try --exporter torch or another --task, or export it to ONNX yourself and convert the .onnx file.")
