"""Sentence-transformers folders are read as the library reads them: every pooling mode in both
of its config formats (5.x names the mode, earlier versions set one flag per mode), a decoder
embedder pooled at its last token, and a pipeline slimml cannot carry refused in one line. The
convert check compares the artifact's embeddings with sentence-transformers' own ``encode``, so a
misread pipeline is refused, never shipped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from slimml.convert import ConvertConfig, convert
from slimml.convert.config import ExportConfig
from slimml.convert.sources import sentence_transformers_pooling
from slimml.errors import ExportError, SlimmlError, SourceError
from slimml.runtime import load
from slimml.runtime.tasks.inputs.pooling import pool

MODES = ["mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens", "weightedmean"]
TEXTS = ["A man is playing a guitar.", "Someone plays music in the park on a sunny day.", "A cat."]
PROMPTS = {"query": "Instruct: find the passage\nQuery: ", "document": "passage: ", "plain": ""}  # Qwen3-Embedding's kind


@pytest.mark.parametrize("mode", MODES)
def test_each_pooling_mode_computes_what_sentence_transformers_computes(mode):
    """Token states of texts of different lengths (padded on the right, as slimml pads): the
    embedding of each mode equals sentence-transformers' ``Pooling`` on the same states."""
    import torch
    from sentence_transformers.models import Pooling

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((3, 7, 16)).astype(np.float32)
    mask = np.array([[1] * 7, [1] * 4 + [0] * 3, [1] + [0] * 6], dtype=np.int64)
    theirs = Pooling(16, pooling_mode=mode)({"token_embeddings": torch.from_numpy(hidden),
                                             "attention_mask": torch.from_numpy(mask)})["sentence_embedding"]
    np.testing.assert_allclose(pool(hidden, mask, mode, normalize=False), theirs.numpy(), rtol=1e-5, atol=1e-6)


def _pooling(folder: Path, config: dict) -> Path:
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.mark.parametrize("config, mode", [
    ({"embedding_dimension": 32, "pooling_mode": "cls"}, "cls"),  # sentence-transformers 5.x
    ({"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
      "pooling_mode_max_tokens": True}, "max"),  # earlier versions
    ({"embedding_dimension": 32, "pooling_mode": "weightedmean"}, "weightedmean"),
    ({"embedding_dimension": 32, "pooling_mode": ["lasttoken"]}, "lasttoken"),  # 5.x's list, of one
    ({"word_embedding_dimension": 32, "pooling_mode_cls_token": False}, "mean"),  # no mode set: the library's mean
])
def test_the_pooling_is_read_in_either_config_format(tiny_bert_dir, tmp_path, config, mode):
    folder = shutil.copytree(tiny_bert_dir, tmp_path / "st")
    assert sentence_transformers_pooling(_pooling(folder, config))["mode"] == mode


@pytest.mark.parametrize("header, body", [
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (-2, -2), }", 16),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", 0),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (True, 4), }", 16),
    ("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 2), }", 16),
    ("{'descr': '|O', 'fortran_order': False, 'shape': (2, 2), }", 16),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 3), }", 16),
])
def test_a_hostile_projection_file_is_refused_in_one_line(tmp_path, header, body):
    """A projection's ``.npy`` whose header lies (negative, huge or boolean sizes, another byte
    order, objects, more values than bytes) is refused as an ArtifactError naming it, before any
    array is made of it; a well-formed one reads back, in either memory order."""
    from slimml.errors import ArtifactError
    from slimml.runtime.tasks.inputs.pooling import _read_array

    text = header.encode() + b" " * (118 - len(header)) + b"\n"
    (tmp_path / "w.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + bytes(body))
    with pytest.raises(ArtifactError, match="w.npy"):
        _read_array(tmp_path, "w.npy", None, 2)
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    for order in ("C", "F"):
        np.save(tmp_path / "ok.npy", np.asarray(array, order=order))
        np.testing.assert_array_equal(_read_array(tmp_path, "ok.npy", None, 2), array)


@pytest.mark.parametrize("base, change, words", [
    ("tiny_bert_dir", lambda f: _pooling(f, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}), "mean + cls"),
    ("tiny_bert_dir", lambda f: _pooling(f, {"pooling_mode": "attention"}), "attention"),
    ("tiny_bert_dir", lambda f: _pooling(f, {"pooling_mode": ["mean", "max"]}), "mean + max"),
    ("tiny_bert_dir", lambda f: (f / "modules.json").write_text(json.dumps(json.loads((f / "modules.json").read_text()) + [
        {"idx": 3, "name": "3", "path": "3_LSTM", "type": "sentence_transformers.models.LSTM"}])), "LSTM"),
    ("tiny_bert_dir", lambda f: (f / "modules.json").write_text("{not json"), "not sentence-transformers' list"),
    ("tiny_bert_dir", lambda f: shutil.rmtree(f / "1_Pooling"), "lists a Pooling module, but"),  # before: pooled by mean
    ("projected", lambda f: _module_config(f, "2_Dense", activation_function="torch.nn.modules.activation.GELU"), "GELU"),
    ("projected", lambda f: _module_config(f, "2_Dense", module_input_name="token_embeddings"), "'token_embeddings'"),
    ("projected", lambda f: (f / "modules.json").write_text(json.dumps([m for i, m in sorted(
        enumerate(json.loads((f / "modules.json").read_text())), key=lambda im: (im[0] in (2, 3), im[0]))][:5])),
     "Transformer -> Pooling -> Normalize -> Dense -> Dense"),
])
def test_a_pipeline_slimml_cannot_carry_is_refused_in_one_line(request, tmp_path, base, change, words):
    """Modules an artifact cannot carry, pooling it cannot compute, projections of another kind
    (GELU, over each token's state) or out of the library's order: one line, nothing written."""
    folder = shutil.copytree(request.getfixturevalue(base), tmp_path / "st")
    change(folder)
    with pytest.raises(SourceError) as e:
        convert(folder, tmp_path / "art", ConvertConfig(measure_latency=False))
    assert words in str(e.value) and "\n" not in str(e.value) and not (tmp_path / "art").exists()


def _module_config(folder: Path, module: str, **changes) -> None:
    config = folder / module / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


@pytest.mark.parametrize("settings", [{"max_seq_length": 40}, {"processor_kwargs": {"model_max_length": 40}},
                                      {"tokenizer_args": {"model_max_length": 40}, "max_seq_length": 200},
                                      {"processing_kwargs": {"text": {"max_length": 40}}, "max_seq_length": 200}])
def test_the_longest_text_is_read_where_the_library_reads_it(tiny_bert_dir, tmp_path, settings):
    """sentence-transformers finds a Transformer's length in several keys of its config, the newest
    first; the artifact cuts where the library cuts (the check's long text would show a difference)."""
    folder = shutil.copytree(tiny_bert_dir, tmp_path / "st")
    (folder / "sentence_bert_config.json").write_text(json.dumps(settings))
    report = convert(folder, tmp_path / "art", ConvertConfig(measure_latency=False))
    assert load(tmp_path / "art").manifest.tokenizer["max_length"] == 40
    assert report.checks["embedding_cosine_vs_library"] > 0.9999


def test_the_transformer_under_a_pipeline_converts_alone_and_a_cross_encoder_is_no_embedder(tiny_bert_dir, tmp_path):
    """``--task feature-extraction`` converts the transformer under a pipeline slimml cannot carry
    (its token states out), as the refusal says; a folder sentence-transformers saved as a
    CrossEncoder (its modules.json lists the transformer alone) is not read as a sentence embedder."""
    folder = shutil.copytree(tiny_bert_dir, tmp_path / "st")
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules + [{"idx": 3, "name": "3", "path": "3_LSTM",
                                                                "type": "sentence_transformers.models.LSTM"}]))
    convert(folder, tmp_path / "art", ConvertConfig(export=ExportConfig(task="feature-extraction"), measure_latency=False))
    model = load(tmp_path / "art")
    assert model.manifest.pooling is None and "last_hidden_state" in model.run(model.text(TEXTS))
    with pytest.raises(SlimmlError, match=r"use run\(\) for its raw outputs; for sentence embeddings, save the source as "
                       r"sentence-transformers does \(SentenceTransformer\(FOLDER\).save\(OUT\): mean pooling\)"):
        model.encode(TEXTS)
    (folder / "modules.json").write_text(json.dumps(modules[:1]))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"model_type": "CrossEncoder"}))
    assert sentence_transformers_pooling(folder) is None


@pytest.fixture(scope="module")
def projected(tiny_bert_dir, tmp_path_factory) -> Path:
    """LaBSE's pipeline on the tiny BERT, saved by sentence-transformers: CLS pooling, a Dense
    projection with tanh, a second without bias or activation (GTR's), then normalisation."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Dense, Normalize, Pooling, Transformer

    torch.manual_seed(1)
    out = tmp_path_factory.mktemp("projected") / "st"
    SentenceTransformer(modules=[Transformer(str(tiny_bert_dir)), Pooling(32, pooling_mode="cls"),
                                 Dense(32, 24, activation_function=torch.nn.Tanh()),
                                 Dense(24, 16, bias=False, activation_function=torch.nn.Identity()), Normalize()],
                        device="cpu").save(str(out))
    return out


def test_projections_after_pooling_are_carried_as_sentence_transformers_applies_them(projected, tmp_path):
    """A pipeline with ``Dense`` modules after its pooling (LaBSE, distiluse, GTR) converts: the
    artifact's embeddings equal the library's ``encode``, at the last projection's size; the
    manifest is format version 3 (an older slimml refuses it instead of skipping the projections);
    int8 quantizes the transformer and keeps the projections; ``info`` shows them."""
    from sentence_transformers import SentenceTransformer
    from typer.testing import CliRunner

    from slimml.cli import app

    report = convert(projected, tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.checks["embedding_cosine_vs_library"] >= 0.9999
    model = load(tmp_path / "art")
    assert model.manifest.format_version == 3 and [d["activation"] for d in model.manifest.pooling.dense] == ["tanh", "identity"]
    ours, theirs = model.encode(TEXTS), SentenceTransformer(str(projected), device="cpu").encode(TEXTS)
    assert ours.shape == theirs.shape == (3, 16)
    np.testing.assert_allclose(ours, theirs, atol=2e-5)
    from slimml.quantize import Int8Config, quantize

    quantize(tmp_path / "art", tmp_path / "int8", Int8Config("cpu"))
    small = load(tmp_path / "int8")
    assert small.manifest.pooling.dense == model.manifest.pooling.dense and small.manifest.format_version == 3
    assert float((small.encode(TEXTS) * theirs).sum(axis=1).min()) >= 0.99
    shown = CliRunner().invoke(app, ["info", str(tmp_path / "int8")]).output
    assert "cls of last_hidden_state -> projection (tanh) -> projection (identity) -> normalized" in " ".join(shown.split())


def test_a_t5_encoder_pipeline_converts_as_gtr_and_sentence_t5_are_saved(tiny_bert_dir, tmp_path):
    """GTR and sentence-T5 are T5's encoder saved alone (``T5EncoderModel``, a T5 config), then mean
    pooling and a projection without bias: the encoder is exported as its own class (optimum and
    transformers' feature extraction would read the config as the whole encoder-decoder, and want
    decoder inputs), and the artifact matches the library."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Dense, Normalize, Pooling, Transformer
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    torch.manual_seed(2)
    base = tmp_path / "t5"
    T5EncoderModel(T5Config(vocab_size=30522, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)).eval().save_pretrained(base)
    AutoTokenizer.from_pretrained(str(tiny_bert_dir), model_input_names=["input_ids", "attention_mask"]).save_pretrained(base)
    SentenceTransformer(modules=[Transformer(str(base)), Pooling(32, pooling_mode="mean"),
                                 Dense(32, 16, bias=False, activation_function=torch.nn.Identity()), Normalize()],
                        device="cpu").save(str(tmp_path / "st"))
    report = convert(tmp_path / "st", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.checks["embedding_cosine_vs_library"] >= 0.9999 and report.checks["embedding_cosine_vs_torch"] >= 0.9999
    theirs = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(load(tmp_path / "art").encode(TEXTS), theirs, atol=2e-5)


def test_a_changed_projection_or_an_older_format_version_is_refused(projected, tmp_path):
    """The projections' weights are listed with their sha256: one changed is refused at load, and
    also when the caller skips the hash check (the pooler checks the bytes it reads). A manifest
    that claims a format version from before projections existed is refused too."""
    from slimml.errors import ArtifactError, IntegrityError

    convert(projected, tmp_path / "art", ConvertConfig(measure_latency=False))
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    older = shutil.copytree(tmp_path / "art", tmp_path / "older")
    (older / "manifest.json").write_text(json.dumps({**manifest, "format_version": 2}))
    with pytest.raises(ArtifactError, match="pooling.dense needs format_version 3"):
        load(older)
    weight = tmp_path / "art" / manifest["pooling"]["dense"][0]["weight"]
    data = bytearray(weight.read_bytes())
    data[-1] ^= 1
    weight.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="pooling_dense_0_weight.npy"):
        load(tmp_path / "art")
    with pytest.raises(IntegrityError, match="pooling's weight file pooling_dense_0_weight.npy .* is not the one its manifest lists"):
        load(tmp_path / "art", verify=False)


@pytest.fixture(scope="module")
def decoder_embedder(tmp_path_factory) -> Path:
    """A tiny random Qwen3 saved by sentence-transformers with last-token pooling (Qwen3-Embedding's
    pipeline): its tokenizer ends each text with <|endoftext|>, the token that is pooled."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling, Transformer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    base, out = tmp_path_factory.mktemp("qwen3_base"), tmp_path_factory.mktemp("qwen3_st") / "st"
    Qwen3Model(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, max_position_embeddings=512)).eval().save_pretrained(base)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([t.lower() for t in TEXTS] * 30, trainers.BpeTrainer(
        vocab_size=480, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                            padding_side="left").save_pretrained(base)
    SentenceTransformer(modules=[Transformer(str(base)), Pooling(64, pooling_mode="lasttoken"), Normalize()],
                        truncate_dim=48,  # a Matryoshka cut the library applies by default
                        prompts=PROMPTS, default_prompt_name="document").save(str(out))
    return out


def test_a_decoder_embedder_pools_its_last_token_as_sentence_transformers_does(decoder_embedder, tmp_path):
    """Converted, the Qwen3 embedder's embeddings equal sentence-transformers' ``encode`` (which pads
    on the left, slimml on the right: a causal model's last token sees the same text), and the
    convert check says it compared with the library."""
    from sentence_transformers import SentenceTransformer

    report = convert(decoder_embedder, tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.checks["embedding_cosine_vs_library"] >= 0.9999
    assert report.checks["embedding_cosine_vs_torch"] >= 0.9999  # the torch model's texts had no prompt: nor do the artifact's
    assert report.checks["embedding_library"].startswith("sentence-transformers ")
    model = load(tmp_path / "art")
    assert model.manifest.pooling.mode == "lasttoken"
    ours = model.encode(TEXTS)
    library = SentenceTransformer(str(decoder_embedder), device="cpu")
    theirs = library.encode(TEXTS)  # its default prompt, "document", before each text, and its cut: as the artifact's
    assert ours.shape == theirs.shape == (3, 48) and model.manifest.pooling.truncate_dim == 48
    np.testing.assert_allclose(ours, theirs, atol=1e-5)  # cut after the normalisation, not normalised again
    for cut in (16, 64):  # shorter than the saved cut, and every value: as the library's encode(truncate_dim=)
        np.testing.assert_allclose(model.encode(TEXTS, truncate_dim=cut), library.encode(TEXTS, truncate_dim=cut), atol=1e-5)
    from slimml.errors import FeedError

    with pytest.raises(FeedError, match="truncate_dim must be a whole number >= 1, got 0"):
        model.encode(TEXTS, truncate_dim=0)
    with pytest.raises(FeedError, match="truncate_dim is 65, more than this model's 64 values; ask for at most 64"):
        model.encode(TEXTS, truncate_dim=65)  # the library gives all 64 without a word


def test_a_model_s_prompts_go_before_the_texts_as_sentence_transformers_puts_them(decoder_embedder, tmp_path):
    """The prompts of the model's config travel in the artifact: ``encode(prompt_name=)``,
    ``prompt=`` and the default prompt give sentence-transformers' embeddings; a prompt the model
    does not have is refused in one line; a model that pools without its prompt's tokens and puts
    one before every text is refused at convert."""
    from sentence_transformers import SentenceTransformer

    from slimml.errors import FeedError

    convert(decoder_embedder, tmp_path / "art", ConvertConfig(measure_latency=False))
    model = load(tmp_path / "art")
    assert model.manifest.pooling.prompts == PROMPTS and model.manifest.pooling.default_prompt == "document"
    assert model.manifest.format_version == 3  # a slimml that would leave the default prompt out refuses it
    library = SentenceTransformer(str(decoder_embedder), device="cpu")
    for asked in ({"prompt_name": "query"}, {"prompt_name": "plain"}, {"prompt": ""}, {"prompt": "Represent: "}):
        np.testing.assert_allclose(model.encode(TEXTS, **asked), library.encode(TEXTS, **asked), atol=1e-5, err_msg=str(asked))
    assert np.abs(model.encode(TEXTS, prompt_name="query") - model.encode(TEXTS)).max() > 1e-3
    with pytest.raises(FeedError, match="'summary' is not one of this model's prompts .its prompts are '(query|document|plain)'"):
        model.encode(TEXTS, prompt_name="summary")
    folder = shutil.copytree(decoder_embedder, tmp_path / "no_prompt_tokens")
    config = json.loads((folder / "1_Pooling" / "config.json").read_text())
    _pooling(folder, {**config, "include_prompt": False})
    with pytest.raises(SourceError, match="without the tokens of its prompt"):
        sentence_transformers_pooling(folder)
    settings = json.loads((decoder_embedder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**settings, "default_prompt_name": "summary"}))
    with pytest.raises(SourceError, match="names the default prompt 'summary', which is not among its prompts"):
        sentence_transformers_pooling(folder)


def test_a_misread_pipeline_fails_the_check_against_the_library(decoder_embedder, tmp_path, monkeypatch):
    """Were the pooling read otherwise than sentence-transformers reads it (mean for last-token, as
    slimml read every 5.x folder before), the convert check refuses the artifact, and nothing is
    left behind."""
    import importlib

    export = importlib.import_module("slimml.convert.export")  # the module (the package's `export` is its function)
    monkeypatch.setattr(export, "sentence_transformers_pooling", lambda folder: {
        "mode": "mean", "normalize": True, "output": "last_hidden_state"})
    with pytest.raises(ExportError, match="disagree with sentence-transformers"):
        convert(decoder_embedder, tmp_path / "art", ConvertConfig(measure_latency=False))
    assert not (tmp_path / "art").exists()


def test_a_student_is_distilled_on_the_texts_its_artifact_will_read(tmp_path):
    """A teacher whose config puts a default prompt before every text: the texts a student is
    distilled on (and its vocabulary pruned for) carry that prompt, as the student's artifact will
    put it before every text."""
    from slimml.convert.distill.distill import DistillConfig, check
    from slimml.convert.sources import default_model_dir

    teacher = shutil.copytree(default_model_dir(), tmp_path / "teacher")
    settings = teacher / "config_sentence_transformers.json"
    config = json.loads(settings.read_text()) if settings.is_file() else {}
    settings.write_text(json.dumps({**config, "prompts": {"query": "query: "}, "default_prompt_name": "query"}))
    texts = check(teacher, DistillConfig(layers=3), None)["texts"]
    assert texts and all(t.startswith("query: ") for t in texts)


@pytest.mark.parametrize("mode", MODES)
def test_a_student_is_pooled_in_torch_as_its_teacher_s_artifact_pools(mode):
    """Distillation trains a sentence embedder's student through its teacher's pooling: the torch
    computation (mode, then the teacher's projections) equals the runtime's ``Pooler.pooled``."""
    import torch

    from slimml.convert.distill.pooled import StudentPooling
    from slimml.runtime.tasks.inputs.pooling import Dense, Pooler

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((3, 7, 16)).astype(np.float32)
    mask = np.array([[1] * 7, [1] * 4 + [0] * 3, [1] + [0] * 6], dtype=np.int64)
    dense = [Dense(rng.standard_normal((16, 12)).astype(np.float32), rng.standard_normal(12).astype(np.float32), "tanh"),
             Dense(rng.standard_normal((12, 8)).astype(np.float32), None, "identity")]
    pooler = Pooler({"mode": mode, "output": "h", "normalize": True, "truncate_dim": 4}, dense)
    ours = StudentPooling(pooler)(torch.from_numpy(hidden), torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(ours, pooler.pooled({"h": hidden}, mask), rtol=1e-5, atol=1e-5)
    assert pooler({"h": hidden}, mask).shape == (3, 4) and pooler.width(16) == 8 and pooler.size(16) == 4


def test_a_teacher_converted_without_its_pooling_distills_on_its_mean(projected, tmp_path):
    """``shrink`` given a teacher artifact that has no pooling (converted with ``--task
    feature-extraction``): the student learns the teacher's mean token state, the library's
    default pooling, as before the teacher's own pooling was used."""
    from slimml.convert.distill import DistillConfig, shrink

    teacher = tmp_path / "teacher"
    convert(projected, teacher, ConvertConfig(export=ExportConfig(task="feature-extraction"), measure_latency=False))
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"{a} {b} is here" for a in TEXTS for b in ("one", "two", "three", "four", "five", "six")))
    shrink(projected, tmp_path / "student", DistillConfig(layers=1, data=texts, epochs=0.5), teacher_artifact=teacher)
    assert (tmp_path / "student" / "config.json").is_file()
