"""Tasks: the registry picks one class per artifact at load, a method the task lacks raises
TaskError with one exact line, and the server's wording of it names the route that works (the
served 400 itself: tests/test_serve_hostile.py)."""

from __future__ import annotations


import numpy as np
import pytest

from slimml.convert import ConvertConfig, convert
from slimml.errors import SlimmlError, TaskError
from slimml.runtime import Task, load
from slimml.runtime.artifact.manifest import Manifest, TensorSpec
from slimml.runtime.tasks.base import CALLS
from slimml.runtime.tasks.registry import (CausalLM, Generic, ImageClassifier, ImageEmbedding, Seq2Seq, TextClassifier,
                                           TextEmbedding, ZeroShot, kind_of, registered)


@pytest.fixture(scope="module")
def mlp_artifact(tmp_path_factory):
    from conftest import tiny_onnx_mlp

    folder = tmp_path_factory.mktemp("mlp")
    out = folder / "art"
    convert(tiny_onnx_mlp(folder / "mlp.onnx"), out, ConvertConfig(measure_latency=False))
    return out


@pytest.fixture(scope="module")
def text_classifier(tmp_path_factory):
    """A 2-layer BERT sequence classifier with two labels and the default model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("sst")
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2,
                        id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1})
    BertForSequenceClassification(config).eval().save_pretrained(folder / "src")
    tokenizer.save_pretrained(folder / "src")
    convert(folder / "src", folder / "art", ConvertConfig(measure_latency=False))
    return folder / "art"


# -- TaskError: type, attributes and the exact line -------------------------------------------------

def test_encode_on_a_classifier_raises_task_error_naming_classify(text_classifier):
    model = load(text_classifier)
    assert isinstance(model, TextClassifier) and model.kind == "text-classification"
    assert model.supports("classify") and model.supports("tokenize") and not model.supports("encode")
    task = model.manifest.task
    with pytest.raises(TaskError) as e:
        model.encode(["a fine film"])
    assert str(e.value) == (f"the artifact {text_classifier} cannot encode(): it is a {task!r} model, not a "
                            "sentence-embedding model; use classify(inputs), or run() for its raw outputs.")
    assert (e.value.task, e.value.method, e.value.alternatives) == (task, "encode", ("classify", "run"))
    assert isinstance(e.value, SlimmlError)
    assert [c["label"] for c in model.classify(["a fine film"], top_k=None)[0]] in (["negative", "positive"],
                                                                                     ["positive", "negative"])


def test_generate_on_an_encoder_raises_task_error_naming_encode(tiny_bert_artifact):
    model = load(tiny_bert_artifact)
    assert isinstance(model, TextEmbedding)
    with pytest.raises(TaskError) as e:
        model.generate(["Once upon a time"])
    assert str(e.value) == (f"the artifact {tiny_bert_artifact} cannot generate(): it is a 'sentence-embedding' model, "
                            "not a text-generation model; use encode(texts), or run() for its raw outputs.")
    assert (e.value.method, e.value.alternatives) == ("generate", ("encode", "run"))
    with pytest.raises(TaskError, match=r"cannot classify\(\): .* not a classifier; use encode\(texts\)"):
        model.classify(["a"])


def test_every_task_method_exists_on_a_generic_artifact_and_refuses(mlp_artifact):
    model = load(mlp_artifact)
    assert isinstance(model, Generic) and model.capabilities == frozenset() and model.accepts == frozenset()
    for method in CALLS:
        with pytest.raises(TaskError) as e:
            getattr(model, method)(["x"])
        assert e.value.method == method and e.value.alternatives == ("run",)
        assert str(e.value).endswith("; use run() for its raw outputs.") and "\n" not in str(e.value)
    assert model.run({"x": np.ones((1, 8), np.float32), "scale": np.ones((1, 1), np.float32)})["y"].shape == (1, 8)


def test_a_manifest_whose_task_its_graph_is_not_says_so_and_to_re_convert(mlp_artifact, tmp_path):
    import json
    import shutil

    folder = tmp_path / "art"
    shutil.copytree(mlp_artifact, folder)
    data = json.loads((folder / "manifest.json").read_text())
    data["task"] = "text-generation"  # an MLP's graph: x, scale -> y
    (folder / "manifest.json").write_text(json.dumps(data))
    model = load(folder)
    assert isinstance(model, Generic)
    for call in (lambda: model.generate([[1, 2]]), lambda: model.chat([{"role": "user", "content": "hi"}])):
        with pytest.raises(TaskError) as e:
            call()
        assert "its manifest says task 'text-generation', but its graph takes x, scale and gives y" in str(e.value)
        assert str(e.value).endswith("(tensors in, tensors out); use run() for its raw outputs, or re-convert it from "
                                     "its source (slimml convert SOURCE --task text-generation).")
        assert e.value.task == "generic"  # what it loaded as: a server says "a 'generic' model, not a text-generation model"
    with pytest.raises(TaskError, match=r"cannot encode\(\): it is a 'text-generation' model, not a sentence-embedding"):
        model.encode(["x"])


def test_a_decoder_says_generate_and_the_loop_sees_its_engine(tiny_llama_past_artifact):
    model = load(tiny_llama_past_artifact)
    assert isinstance(model, CausalLM) and model.engine is not None and model.parts == {}
    with pytest.raises(TaskError, match=r"cannot encode\(\): it is a 'text-generation-with-past' model, not a "
                                        r"sentence-embedding model; use generate\(prompts\), or run\(\)"):
        model.encode(["hi"])
    assert len(model.generate([[5, 6, 7]], max_new_tokens=2).tokens[0]) == 2


# -- the registry ------------------------------------------------------------------------------------

def test_the_registry_picks_one_class_per_kind_of_artifact(mlp_artifact, tiny_bert_artifact, tiny_llama_past_artifact,
                                                            text_classifier):
    for folder, cls in [(mlp_artifact, Generic), (tiny_bert_artifact, TextEmbedding),
                        (tiny_llama_past_artifact, CausalLM), (text_classifier, TextClassifier)]:
        model = load(folder)
        assert type(model) is cls, folder
        model.close()


def _manifest(task="generic", inputs=(("input_ids", 2),), outputs=("last_hidden_state",), **fields) -> Manifest:
    return Manifest(name="m", task=task, source={}, steps=[], shards=[], files=[],
                    inputs=[TensorSpec(n, "float32", [None] * rank) for n, rank in inputs],
                    outputs=[TensorSpec(n, "float32", [None, None]) for n in outputs], **fields)


def test_kind_of_reads_the_task_and_the_declared_fields():
    pixels = (("pixel_values", 4),)
    cases = [
        (_manifest(), Generic),
        (_manifest("feature-extraction", pooling={"mode": "mean", "output": "last_hidden_state", "normalize": True}),
         TextEmbedding),
        (_manifest("text-classification", outputs=("logits",), labels=["a", "b"]), TextClassifier),
        (_manifest("image-classification", pixels, ("logits",), labels=["a", "b"]), ImageClassifier),
        (_manifest("image-feature-extraction", pixels, ("pooler_output",)), ImageEmbedding),
        (_manifest("text-generation-with-past", outputs=("logits",)), CausalLM),
        (_manifest("text-generation", outputs=("hidden",)), Generic),  # no logits: nothing to generate from
        (_manifest("feature-extraction", components={"text": _manifest(), "vision": _manifest()},
                   zero_shot={"text": "text", "image": "vision", "scale": 100.0}), ZeroShot),
        (_manifest("text2text-generation", components={"encoder": _manifest()}, seq2seq={"decoder_start_token_id": 0}),
         Seq2Seq),
        (_manifest("feature-extraction", components={"a": _manifest()}), Generic),
    ]
    for manifest, cls in cases:
        assert kind_of(manifest) == cls.kind and registered()[cls.kind] is cls, manifest.task


def test_each_task_declares_the_methods_it_implements():
    own = {"tokenize", "count_tokens", "preprocess"}  # on the base: they work wherever the inputs were shipped
    for kind, cls in registered().items():
        overridden = {m for m in CALLS if getattr(cls, m) is not getattr(Task, m)}
        assert overridden == set(cls.methods) - own, kind
        assert set(cls.suggest) <= set(cls.methods), kind


# -- the server --------------------------------------------------------------------------------------

def test_task_refusal_names_the_route_that_works(tiny_bert_artifact, mlp_artifact):
    pytest.importorskip("ray")
    from slimml.serve.refusals import task_refusal

    refusal = task_refusal(load(tiny_bert_artifact).unsupported("generate"))
    assert refusal.status == 400 and str(refusal) == (
        "this artifact is a 'sentence-embedding' model, not a decoder, so it has no /v1/generate; use POST "
        "/v1/embeddings, or POST /v1/run for its raw outputs.")
    refusal = task_refusal(load(mlp_artifact).unsupported("encode_with_counts"))
    assert str(refusal) == ("this artifact is a 'generic' model, not a sentence-embedding one, so it has no "
                            "/v1/embeddings; use POST /v1/run for its raw outputs.")


def test_a_refusal_points_only_at_routes_that_serve_the_model():
    """A T5 was pointed at the chat routes, which only a language model has; /v1/classify serves
    texts, images and CLIP's zero-shot labels, nothing else that classifies."""
    pytest.importorskip("ray")
    from types import SimpleNamespace

    from slimml.errors import TaskError
    from slimml.serve.refusals import serving_routes, task_refusal

    vit, t5 = SimpleNamespace(kind="image-classification"), SimpleNamespace(kind="text2text-generation", speech=False)
    whisper = SimpleNamespace(kind="text2text-generation", speech=True)
    assert serving_routes("classify", vit) == "POST /v1/classify"
    assert serving_routes("classify", SimpleNamespace(kind="generic")) is None
    assert serving_routes("generate", t5) == "POST /v1/generate"
    assert serving_routes("generate", whisper) == "POST /v1/audio/transcriptions"
    assert serving_routes("generate", SimpleNamespace(kind="text-generation")).startswith("POST /v1/chat/completions")
    refusal = task_refusal(TaskError("x", "image-classification", "encode_with_counts", ("classify", "run")), vit)
    assert str(refusal).endswith("so it has no /v1/embeddings; use POST /v1/classify, or POST /v1/run for its raw outputs.")
    refusal = task_refusal(TaskError("x", "text2text-generation", "transcribe", ("generate", "run")), t5)
    assert str(refusal) == ("this artifact is a 'text2text-generation' model, not a speech model, so it has no "
                            "/v1/audio/transcriptions; use POST /v1/generate, or POST /v1/run for its raw outputs.")


def test_a_classifier_with_transformers_default_labels_classifies(tmp_path):
    """transformers leaves the default labels (two, LABEL_0 and LABEL_1) out of config.json: the artifact
    listed none and refused every call as damaged ("logits have shape (2, 2) but ... 0 labels")."""
    import json

    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    BertForSequenceClassification(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
                                  ).eval().save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    assert "id2label" not in json.loads((tmp_path / "src" / "config.json").read_text())
    convert(tmp_path / "src", tmp_path / "art", ConvertConfig(measure_latency=False))
    classes = load(tmp_path / "art").classify(["great movie", "bad movie"], top_k=2)
    assert [sorted(c["label"] for c in row) for row in classes] == [["LABEL_0", "LABEL_1"]] * 2


def test_bench_times_a_model_of_fewer_than_128_positions_at_its_most(text_classifier):
    """`slimml bench` with no --seq refused a model that takes fewer tokens than 128 (CLIP's text tower:
    77) with a flag the user never gave; it times it at its most, and an asked --seq past it is refused."""
    import json

    from typer.testing import CliRunner

    from slimml.cli import app

    ran = CliRunner().invoke(app, ["bench", str(text_classifier), "--runs", "2", "--json"])
    assert ran.exit_code == 0, ran.output
    assert json.loads(ran.output)["seq"] == 64
    ran = CliRunner().invoke(app, ["bench", str(text_classifier), "--runs", "2", "--seq", "100"])
    assert str(ran.exception) == "--seq 100 is past the 64 tokens this model takes; give --seq 64 or less."


def test_eval_of_a_model_it_does_not_score_says_so_before_reading_the_data(text_classifier, tmp_path):
    """A classifier given a text file was told its CSV lacked columns, as if a CSV would do."""
    from typer.testing import CliRunner

    from slimml.cli import app

    (tmp_path / "t.txt").write_text("hello world\n")
    ran = CliRunner().invoke(app, ["eval", str(text_classifier), "--data", str(tmp_path / "t.txt")])
    assert str(ran.exception).startswith("slimml eval scores sentence-embedding models (Spearman on STS pairs) and "
                                         f"language models (perplexity); {text_classifier} is a text-classification model.")


def test_texts_come_in_the_containers_the_libraries_take(text_classifier, tiny_bert_artifact):
    """A numpy array of texts (a data frame column's ``.values``) and a generator are texts, as
    sentence-transformers' ``encode`` and transformers' pipelines take them; the array was refused
    with "wrap a single text as [text]", which does not apply to it."""
    import numpy as np

    texts = ["a fine film", "a dull one"]
    classifier = load(text_classifier)
    want = classifier.classify(texts)
    assert classifier.classify(np.array(texts)) == want == classifier.classify(t for t in texts)
    bert = load(tiny_bert_artifact)
    np.testing.assert_array_equal(bert.tokenize(np.array(texts))["input_ids"], bert.tokenize(texts)["input_ids"])
    np.testing.assert_array_equal(bert.encode(np.array(texts)), bert.encode(texts))


def test_a_text_whose_first_characters_make_no_tokens_is_read_on(tiny_bert_artifact):
    """Texts are cut to limits.max_text_chars before tokenizing (a call's cost stays bounded); a text
    that opens with more blanks than that was embedded as the empty text (cosine -0.007 against
    sentence-transformers). Now more of it is read until its tokens fill the model's length."""
    import numpy as np

    bert = load(tiny_bert_artifact)
    for text in (" " * 20_000 + "a man plays the guitar", "\u0301" * 17_000 + "a man plays the guitar"):
        np.testing.assert_array_equal(bert.tokenize([text])["input_ids"], bert.tokenize(["a man plays the guitar"])["input_ids"])
    pair = bert.tokenize([(" " * 20_000 + "query", "passage")])["input_ids"]
    np.testing.assert_array_equal(pair, bert.tokenize([("query", "passage")])["input_ids"])
    long = "word " * 10_000  # cut, and still past the model's length: read as before
    assert bert.tokenize([long])["input_ids"].shape[1] == bert.manifest.tokenizer["max_length"]


def test_the_command_line_prints_texts_and_messages_as_written(text_classifier, tmp_path):
    """Its consoles read rich markup: a text "[/] ..." ended `slimml run` in rich's MarkupError
    traceback, "[b]love[/b]" was printed "love", and a message's "pip install 'slimml[bench]'" lost
    its extra."""
    import os
    import subprocess
    import sys

    def slimml(*args):
        return subprocess.run([sys.executable, "-m", "slimml", *map(str, args)], capture_output=True, text=True,
                              env=os.environ, timeout=300)

    r = slimml("run", text_classifier, "[/] closing tag", "I [b]love[/b] it")
    assert r.returncode == 0, r.stderr
    assert "[/] closing tag" in r.stdout and "I [b]love[/b] it" in r.stdout, r.stdout
    r = slimml("info", tmp_path / "[bench]")
    assert r.returncode == 1 and r.stderr.startswith(f"error: {tmp_path / '[bench]'} is not an artifact folder"), r.stderr
