"""Static embeddings (sentence-transformers' ``StaticEmbedding``: model2vec's potion models,
static-retrieval-mrl) convert, as sentence-transformers saves them and as model2vec saves them,
and embed as the library's ``encode`` does: the mean of the tokens' rows, no special tokens, the
saved truncation, prompts, projections and normalisation. What the library would not read either
is refused in one line, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from slimml.convert import ConvertConfig, convert
from slimml.convert.config import ExportConfig
from slimml.errors import FeedError, SourceError
from slimml.runtime import load

from conftest import STS_DEV

pytest.importorskip("sentence_transformers")
torch = pytest.importorskip("torch")

TEXTS = ["", "A man is playing a guitar.", "naïve café — 東京 🙂", "Someone plays music in the park. " * 30, "x"]
CONFIG = ConvertConfig(measure_latency=False)


def _tokenizer():
    from tokenizers import Tokenizer

    from slimml.convert.sources import default_model_dir

    return Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))  # BERT's, truncating at 128


def _save(folder: Path, *modules) -> Path:
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(modules=list(modules), device="cpu").save(str(folder))
    return folder


@pytest.fixture(scope="module")
def static_dirs(tmp_path_factory) -> dict[str, Path]:
    """Three static models on the default model's tokenizer, 24 random dimensions: normalised (as
    potion models are), with a tanh projection to 8 and no normalisation, and as model2vec saves one
    (its ``embeddings`` key in float16, the module at the folder's root, model2vec's config.json)."""
    from safetensors.numpy import save_file
    from sentence_transformers.models import Dense, Normalize, StaticEmbedding

    root = tmp_path_factory.mktemp("static")
    torch.manual_seed(0)
    out = {"normalized": _save(root / "normalized", StaticEmbedding(_tokenizer(), embedding_dim=24), Normalize()),
           "projected": _save(root / "projected", StaticEmbedding(_tokenizer(), embedding_dim=24),
                              Dense(24, 8, activation_function=torch.nn.Tanh()))}
    native = root / "model2vec"
    native.mkdir()
    table = np.random.default_rng(1).standard_normal((_tokenizer().get_vocab_size(), 24)).astype(np.float16)
    save_file({"embeddings": table}, str(native / "model.safetensors"))
    _tokenizer().save(str(native / "tokenizer.json"))
    (native / "config.json").write_text(json.dumps({"model_type": "model2vec", "architectures": ["StaticModel"],
                                                    "normalize": True, "hidden_dim": 24}))
    (native / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": ".", "type": "sentence_transformers.models.StaticEmbedding"},
        {"idx": 1, "name": "1", "path": "1_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    out["model2vec"] = native
    return out


def _library(folder: Path, texts: list[str], **kw) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, **kw)


@pytest.mark.parametrize("kind", ["normalized", "projected", "model2vec"])
def test_a_static_model_embeds_as_sentence_transformers_does(static_dirs, tmp_path, kind):
    """Empty, short, non-ASCII and truncated texts (the saved tokenizer cuts at 128 tokens), with and
    without a prompt: the library's embeddings, from one shard holding the table."""
    report = convert(static_dirs[kind], tmp_path / "art", CONFIG)
    assert report.task == "sentence-embedding" and report.shards == 1
    assert report.checks["embedding_cosine_vs_library"] > 0.9999
    assert report.steps[0]["exporter"] == "static (slimml, the table's Gather)"
    model = load(tmp_path / "art")
    # model2vec saves its table in float16, and the library computes in it: to float16's precision (and
    # its empty bag's mean is NaN there; the artifact's is 0, as the library's in float32)
    texts, atol = (TEXTS[1:], 2e-3) if kind == "model2vec" else (TEXTS, 2e-6)
    for prompt in (None, "query: "):
        np.testing.assert_allclose(model.encode(texts, prompt=prompt), _library(static_dirs[kind], texts, prompt=prompt),
                                   atol=atol)
    assert kind == "projected" or not model.encode([""]).any()  # a projection's bias makes a vector of nothing
    tokenizer = model.manifest.tokenizer
    assert tokenizer["max_length"] == 128
    bare = _tokenizer()
    bare.no_padding()
    assert model.text.encodings(["hello world"])[0].ids == bare.encode("hello world", add_special_tokens=False).ids


def test_a_static_model_quantizes_and_gives_its_token_vectors_alone(static_dirs, tmp_path):
    """``--quantize int8`` stores the table in 8 bits and keeps the embeddings; ``--task
    feature-extraction`` gives each token's row (zero where a batch pads)."""
    from slimml.quantize import Int8Config

    convert(static_dirs["normalized"], tmp_path / "q", ConvertConfig(measure_latency=False, quantize=Int8Config()))
    assert sum(s.weight_bytes for s in load(tmp_path / "q").manifest.shards) < 30522 * 24 * 1.01  # a byte a value
    np.testing.assert_allclose(load(tmp_path / "q").encode(TEXTS), _library(static_dirs["normalized"], TEXTS), atol=0.02)
    convert(static_dirs["normalized"], tmp_path / "tokens", ConvertConfig(measure_latency=False,
                                                                          export=ExportConfig(task="feature-extraction")))
    model = load(tmp_path / "tokens")
    feeds = model.text(["A man", "A man is playing"])
    vectors = model.run(feeds)["last_hidden_state"]
    from safetensors.numpy import load_file

    table = load_file(str(static_dirs["normalized"] / "model.safetensors"))["embedding.weight"]
    np.testing.assert_allclose(vectors[1], table[feeds["input_ids"][1]], atol=1e-7)
    assert not vectors[0, 2:].any() and model.manifest.pooling is None
    with pytest.raises(FeedError, match="30522"):  # ids are checked against the table's rows, as a transformer's are
        model.run({"input_ids": np.array([[5, -1]]), "attention_mask": np.ones((1, 2), np.int64)})
    from slimml.errors import ConfigError
    from slimml.quantize import Int8StaticConfig, quantize

    convert(static_dirs["normalized"], tmp_path / "float", CONFIG)
    with pytest.raises(ConfigError, match=r"int8-static quantizes MatMul ops, and it has none \(int8-dynamic and "
                                          r"int4-weights take an embedding's Gather\)"):  # was: "(MatMul/Gather ...)"
        quantize(tmp_path / "float", tmp_path / "static-int8", Int8StaticConfig())
    assert not (tmp_path / "static-int8").exists()


def _copy(folder: Path, tmp_path: Path) -> Path:
    return shutil.copytree(folder, tmp_path / "src")


def _truncate_left(path: Path) -> None:
    config = json.loads(path.read_text())
    config["truncation"] = {"direction": "Left", "max_length": 64, "strategy": "LongestFirst", "stride": 0}
    path.write_text(json.dumps(config))


def _refuse_table(f: Path, tensors: dict) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(f / "model.safetensors"))


@pytest.mark.parametrize("change, words", [
    (lambda f: _refuse_table(f, {"embeddings": np.zeros((30522, 8), np.float32), "mappings": np.zeros(30522, np.int64)}),
     "mappings"),  # model2vec's vocabulary quantization: the library would read the wrong rows
    (lambda f: _refuse_table(f, {"embeddings": np.zeros((30522, 8), np.int8)}), "not floating-point"),
    (lambda f: _refuse_table(f, {"embeddings": np.zeros((1000, 8), np.float32)}), "1000 rows"),
    (lambda f: (f / "tokenizer.json").write_text("{broken"), "could not read the StaticEmbedding tokenizer"),
    (lambda f: (f / "modules.json").write_text(json.dumps(json.loads((f / "modules.json").read_text())[::-1])),
     "Normalize -> StaticEmbedding"),
    (lambda f: _truncate_left(f / "tokenizer.json"), "cuts long texts from the left"),
    (lambda f: (f / "modules.json").unlink(), "saved without sentence-transformers' modules.json"),  # model2vec alone
    (lambda f: _refuse_table(f, {"embedding.weight": np.zeros((30522, 16), np.float32)}), "takes 24 values, and what comes "
     "before it gives 16"),  # the projection does not fit the table
])
def test_what_the_library_would_not_read_is_refused_in_one_line(static_dirs, tmp_path, change, words):
    folder = _copy(static_dirs["projected" if "before it gives" in words else "model2vec"], tmp_path)
    change(folder)
    with pytest.raises(SourceError) as e:
        convert(folder, tmp_path / "art", CONFIG)
    assert words in str(e.value) and "\n" not in str(e.value) and not (tmp_path / "art").exists()


@pytest.mark.parametrize("export, words", [(ExportConfig(exporter="fused"), "leave --exporter out"),
                                           (ExportConfig(task="text-classification"), "leave --task out")])
def test_an_export_option_that_does_not_apply_is_refused(static_dirs, tmp_path, export, words):
    with pytest.raises(SourceError, match=words):
        convert(static_dirs["normalized"], tmp_path / "art", ConvertConfig(measure_latency=False, export=export))
    assert not (tmp_path / "art").exists()


@pytest.mark.slow
def test_a_static_model_of_real_token_vectors_scores_stsb_as_the_library(tmp_path):
    """Real weights: the default model's own token-embedding table as a static model (each text the
    mean of its tokens' MiniLM input vectors, normalised). On STSb dev the artifact's Spearman equals
    sentence-transformers' to 0.01 points, and int8 stays within 0.5 of it."""
    from safetensors.numpy import load_file
    from sentence_transformers.models import Normalize, StaticEmbedding

    from slimml.convert.sources import default_model_dir
    from slimml.quantize import Int8Config
    from slimml.runtime.tools.evaluate import read_sts, spearman

    table = load_file(str(default_model_dir() / "model.safetensors"))["embeddings.word_embeddings.weight"]
    folder = _save(tmp_path / "minilm-static", StaticEmbedding(_tokenizer(), embedding_weights=table), Normalize())
    a, b, gold = read_sts(STS_DEV)

    def score(encode) -> float:
        return 100 * spearman((encode(a) * encode(b)).sum(1), gold)

    theirs = score(lambda t: _library(folder, t))
    convert(folder, tmp_path / "f32", CONFIG)
    convert(folder, tmp_path / "int8", ConvertConfig(measure_latency=False, quantize=Int8Config()))
    ours, int8 = score(load(tmp_path / "f32").encode), score(load(tmp_path / "int8").encode)
    assert abs(ours - theirs) < 0.01 and abs(int8 - theirs) < 0.5, (theirs, ours, int8)
    assert theirs > 50  # real vectors rank the pairs (random ones score near 0)
