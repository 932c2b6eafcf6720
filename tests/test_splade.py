"""SPLADE models (sentence-transformers' SparseEncoder, ``MLMTransformer -> SpladePooling``: SPLADE,
OpenSearch's neural sparse models) convert into artifacts whose ``encode`` is the library's
embedding, one weight per vocabulary token, pooled inside the graph (the logits never leave it).
Before, such a folder converted silently as a masked LM. Other sparse encoders are refused in one
line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from slimml.convert import ConvertConfig, convert
from slimml.convert.config import ExportConfig
from slimml.errors import SourceError
from slimml.runtime import load

pytest.importorskip("sentence_transformers")
torch = pytest.importorskip("torch")

TEXTS = ["", "A man is playing a guitar.", "What is the capital of France?", "Someone plays music in the park. " * 40]
CONFIG = ConvertConfig(measure_latency=False)


@pytest.fixture(scope="module")
def splade_dirs(tmp_path_factory) -> dict[str, Path]:
    """A 2-layer BERT masked LM (random weights, the default model's tokenizer) as two SparseEncoders:
    SPLADE v2's max of log(1 + relu) with query and document prompts, and OpenSearch's sum with the
    log taken twice."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from slimml.convert.sources import default_model_dir

    root = tmp_path_factory.mktemp("splade")
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4)).save_pretrained(root / "mlm")
    AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(root / "mlm")
    out = {}
    for name, pooling, prompts in (("max", SpladePooling("max"), {"query": "query: ", "document": ""}),
                                   ("sum_log1p_relu", SpladePooling("sum", activation_function="log1p_relu"), None)):
        SparseEncoder(modules=[MLMTransformer(str(root / "mlm")), pooling], prompts=prompts).save(str(root / name))
        out[name] = root / name
    # as sentence-transformers 5.4 and later save it: a Transformer asked for its fill-mask logits
    out["transformer"] = shutil.copytree(root / "max", root / "transformer")
    modules = json.loads((out["transformer"] / "modules.json").read_text())
    modules[0]["type"] = "sentence_transformers.base.modules.transformer.Transformer"
    (out["transformer"] / "modules.json").write_text(json.dumps(modules))
    return out


def _library(folder: Path, texts: list[str], **kw) -> np.ndarray:
    from sentence_transformers import SparseEncoder

    return SparseEncoder(str(folder), device="cpu").encode(texts, convert_to_sparse_tensor=False, **kw).numpy()


@pytest.mark.parametrize("kind", ["max", "sum_log1p_relu", "transformer"])
def test_a_splade_model_embeds_as_the_library_does(splade_dirs, tmp_path, kind):
    report = convert(splade_dirs[kind], tmp_path / "art", CONFIG)
    assert report.task == "sentence-embedding" and report.checks["embedding_cosine_vs_library"] > 0.9999
    model = load(tmp_path / "art")
    assert [o.name for o in model.manifest.outputs] == ["sentence_embedding"]  # (batch, vocabulary), no logits
    ours = model.encode(TEXTS)
    assert ours.shape == (len(TEXTS), 30522) and (ours >= 0).all()
    np.testing.assert_allclose(ours, _library(splade_dirs[kind], TEXTS), rtol=1e-4, atol=2e-5)
    if kind != "sum_log1p_relu":  # its query prompt, as encode_query puts it before each text
        np.testing.assert_allclose(model.encode(TEXTS, prompt_name="query"),
                                   _library(splade_dirs[kind], TEXTS, prompt_name="query"), rtol=1e-4, atol=2e-5)


def test_a_splade_model_quantizes_and_its_masked_lm_converts_alone(splade_dirs, tmp_path):
    from slimml.quantize import Int8Config

    convert(splade_dirs["max"], tmp_path / "q", ConvertConfig(measure_latency=False, quantize=Int8Config()))
    ours, theirs = load(tmp_path / "q").encode(TEXTS), _library(splade_dirs["max"], TEXTS)
    cos = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cos.min() > 0.99, cos
    report = convert(splade_dirs["max"], tmp_path / "mlm", ConvertConfig(measure_latency=False, export=ExportConfig(task="fill-mask")))
    assert report.task == "fill-mask" and load(tmp_path / "mlm").manifest.pooling is None


def _edit(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("change, words", [
    (lambda f: _edit(f / "1_SpladePooling" / "config.json", pooling_strategy="mean"), "pooling_strategy 'mean'"),
    (lambda f: _edit(f / "config_sentence_transformers.json", max_active_dims=64), "max_active_dims"),
    (lambda f: (f / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.sparse_encoder.models.SparseStaticEmbedding"}])),
     "sparse encoder of SparseStaticEmbedding"),
    (lambda f: _edit(f / "sentence_bert_config.json", transformer_task="feature-extraction"), "Transformer -> SpladePooling"),
])
def test_another_sparse_encoder_is_refused_in_one_line(splade_dirs, tmp_path, change, words):
    folder = shutil.copytree(splade_dirs["transformer" if words.startswith("Transformer") else "max"], tmp_path / "src")
    change(folder)
    with pytest.raises(SourceError) as e:
        convert(folder, tmp_path / "art", CONFIG)
    assert words in str(e.value) and "\n" not in str(e.value) and not (tmp_path / "art").exists()
