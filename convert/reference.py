"""Outputs of the original (torch) model, to check an artifact against."""

from __future__ import annotations

import gc
import json
import numpy as np

from slimml.convert.export import Exported, output_tensors
from slimml.convert.export_torch_decoder import cache_keyword, cache_tensors, dynamic_cache, past_layers, returned_cache
from slimml.convert.sources import Source, st_model_type
from slimml.runtime.tasks.inputs.pooling import Pooler


class Reference:
    """Runs the source model in torch on numpy feeds and returns numpy outputs by ONNX name.

    ``None`` from :func:`reference_for` means there is nothing to compare with but the
    unsharded ONNX graph (an ONNX file given as source).
    """

    def __init__(self, fn, pooler: Pooler | None):
        self._fn = fn
        self.pooler = pooler

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        with torch.no_grad():
            return self._fn({k: torch.from_numpy(v) for k, v in feeds.items()})

    def embed(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        return self.pooler(self(feeds), feeds["attention_mask"])


def reference_for(source: Source, exported: Exported, output_names: list[str]) -> Reference | None:
    if source.kind in ("onnx", "static"):  # a static embedding's reference is its library (the check's)
        return None
    if source.kind == "torch":
        module = source.module
        dict_inputs = isinstance(source.example_inputs, dict)

        def run_module(feeds):
            out = module(**feeds) if dict_inputs else module(*feeds.values())
            return {n: o.detach().numpy() for n, o in zip(output_names, output_tensors(out))}

        return Reference(run_module, None)
    model = _load_hf(source, exported)

    def run_hf(feeds):
        past = sorted(k for k in feeds if k.startswith("past_key_values."))
        if past:  # ONNX names the cache per layer; torch takes a Cache object
            feeds[cache_keyword(model)] = dynamic_cache({i: (feeds.pop(f"past_key_values.{i}.key"),
                                                          feeds.pop(f"past_key_values.{i}.value")) for i in past_layers(past)})
            feeds["use_cache"] = True
        out = model(**feeds)
        result = {n: out[n].detach().float().numpy() for n in output_names if n in out}
        if past:
            for i, (k, v) in cache_tensors(returned_cache(out)).items():
                result[f"present.{i}.key"], result[f"present.{i}.value"] = k.float().numpy(), v.float().numpy()
        return {n: v for n, v in result.items() if n in output_names}

    splade = exported.info.get("splade")
    if splade is not None:  # the masked LM's logits, pooled in torch as the graph pools them
        return Reference(lambda feeds: {n: v for n, v in {"sentence_embedding": _splade(model(**feeds).logits, feeds["attention_mask"], splade)}.items()
                                        if n in output_names}, Pooler.of(exported.pooling, "."))
    return Reference(run_hf, Pooler.of(exported.pooling, exported.pooling_dir or "."))


def _splade(logits, mask, splade: dict[str, str]) -> np.ndarray:
    """sentence-transformers' ``SpladePooling`` of torch logits (batch, sequence, vocabulary)."""
    x = (logits.float() * mask.unsqueeze(-1).float()).relu().log1p()
    if splade["activation"] == "log1p_relu":
        x = x.log1p()
    return (x.amax(dim=1) if splade["strategy"] == "max" else x.sum(dim=1)).numpy()


def _load_hf(source: Source, exported: Exported):
    """The source model in float32, as the artifact computes: transformers 5 would load a bf16 checkpoint
    in bf16 (its default ``dtype="auto"``), and MXFP4 experts are dequantized to bf16 on a CPU whatever
    the dtype asked (gpt-oss), so the parameters are cast after loading too."""
    import torch

    from slimml.convert.distill.prune_heads import from_pretrained  # a pruned encoder's folder reads the same way

    task = exported.info.get("hf_task", "feature-extraction")
    if task == "feature-extraction":
        import transformers

        from slimml.convert.export_torch import encoder_only

        encoder = encoder_only(json.loads((source.path / "config.json").read_text()), task)  # T5's encoder saved alone
        cls = getattr(transformers, encoder) if encoder and hasattr(transformers, encoder) else transformers.AutoModel
        model = from_pretrained(lambda f, **kw: cls.from_pretrained(str(f), local_files_only=True, dtype=torch.float32, **kw),
                                source.path)
    else:
        from optimum.exporters.tasks import TasksManager

        from slimml.convert.fused_family import reference_kwargs

        model = from_pretrained(lambda f, **kw: TasksManager.get_model_from_task(
            task, str(f), library_name="transformers", local_files_only=True, torch_dtype=torch.float32,
            **reference_kwargs(source.path), **kw), source.path)
    return model.float().eval()


def sentence_transformers_embed(source: Source, texts: list[str]) -> tuple[np.ndarray | None, str]:
    """``(embeddings of texts, "sentence-transformers VERSION")`` from the source folder as its own
    library computes them (its modules, pooling, normalisation and default prompt; float32, every
    dimension), or ``(None, why not)`` where sentence-transformers is not installed or cannot load
    the folder (the check then pools the torch model's token states as the artifact does)."""
    try:
        import sentence_transformers
        import torch
        from sentence_transformers import SentenceTransformer, SparseEncoder
    except ImportError:
        return None, "none (sentence-transformers is not installed)"
    model = None
    sparse = st_model_type(source.path) == "SparseEncoder"
    step = "load the folder"
    try:
        model = (SparseEncoder if sparse else SentenceTransformer)(str(source.path), device="cpu", local_files_only=True,
                                                                  model_kwargs={"dtype": torch.float32})
        step = "embed the check's texts with it"  # e.g. a tokenizer that reads more positions than the model has
        # its default prompt and its saved truncate_dim, as the artifact's; a sparse encoder's every value
        emb = model.encode(texts, convert_to_sparse_tensor=False, show_progress_bar=False) if sparse else \
            model.encode(texts, convert_to_numpy=True, show_progress_bar=False)
        emb = emb.numpy() if hasattr(emb, "numpy") else emb
    except Exception as e:  # a folder it cannot read (remote code, a pruned student's own files)
        return None, f"none (sentence-transformers could not {step}: {type(e).__name__})"
    finally:
        del model
        gc.collect()  # the library's model sits in reference cycles: freed before the artifact loads
    return np.asarray(emb, dtype=np.float32), f"sentence-transformers {sentence_transformers.__version__}"
