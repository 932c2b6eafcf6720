"""convert() on several real architectures: each artifact must match the unsharded ONNX model
(max abs diff <= 1e-5) and the original torch model."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from slimml.convert import ConvertConfig, ShardConfig, convert
from slimml.errors import ConfigError, SourceError
from slimml.runtime import load
from slimml.runtime.tools.bench import sample_feeds

FAST = ConvertConfig(measure_latency=False)


def test_sentence_embedding_folder_gives_a_checked_artifact(tiny_bert_artifact):
    manifest = json.loads((tiny_bert_artifact / "manifest.json").read_text())
    assert manifest["task"] == "sentence-embedding"
    assert [s["step"] for s in manifest["steps"]] == ["export", "shard"]
    assert len(manifest["shards"]) == 3  # embeddings, layer 0, layer 1
    assert manifest["shards"][1]["layers"] == ["encoder/layer.0"]
    assert manifest["checks"]["max_abs_diff"] <= 1e-5
    assert manifest["checks"]["embedding_cosine_vs_torch"] >= 0.9999
    assert {f["path"] for f in manifest["files"]} >= {"tokenizer.json", "shard_000.onnx", "shard_000.onnx.data"}


def test_encode_matches_torch_mean_pooling(tiny_bert_artifact, tiny_bert_dir):
    from transformers import AutoModel, AutoTokenizer

    texts = ["A man is playing a guitar.", "Two dogs run on the beach in the sun.", "Hi"]
    model = load(tiny_bert_artifact)
    ours = model.encode(texts)
    tok = AutoTokenizer.from_pretrained(str(tiny_bert_dir))
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(str(tiny_bert_dir))(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    theirs = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()
    assert ours.shape == (3, 32)
    assert (ours * theirs).sum(1).min() >= 0.9999


def test_decoder_llama_converts_per_layer_with_a_head_shard(tiny_llama_dir, tmp_path):
    report = convert(tiny_llama_dir, tmp_path / "llama", FAST)
    manifest = load(tmp_path / "llama").manifest
    assert report.task == "text-generation-with-past"  # fused cannot write head size 8: optimum, with its cache
    assert [s.layers for s in manifest.shards] == [[], ["model/layers.0"], ["model/layers.1"], ["model/layers.2"], []]
    assert manifest.shards[-1].outputs[0].name == "logits"
    assert report.checks["max_abs_diff"] <= 1e-5
    assert report.checks["max_abs_diff_vs_torch"] <= 1e-4


def test_torch_module_from_a_python_file(cnn_py, tmp_path):
    report = convert(cnn_py, tmp_path / "cnn", ConvertConfig(shard=ShardConfig(mode="count", count=3), measure_latency=False))
    model = load(tmp_path / "cnn")
    assert [t.name for t in model.inputs] == ["image"] and [t.name for t in model.outputs] == ["logits"]
    assert report.shards == 3
    assert report.checks["max_abs_diff"] <= 1e-5
    assert report.checks["max_abs_diff_vs_torch"] <= 1e-4


def test_torch_module_object_and_an_onnx_file_source(tmp_path):
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(4)]).eval()
    report = convert(net, tmp_path / "mlp", FAST, example_inputs=(torch.randn(2, 16),))
    assert report.shards == 4 and report.checks["max_abs_diff_vs_torch"] <= 1e-5
    # the exported graph itself, given back as an ONNX source, converts the same way
    onnx_src = tmp_path / "net.onnx"
    torch.onnx.export(net, (torch.randn(2, 16),), str(onnx_src), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "b"}, "y": {0: "b"}}, dynamo=False)
    convert(onnx_src, tmp_path / "from-onnx", FAST)
    model = load(tmp_path / "from-onnx")
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model.run({"x": x})["y"], want, atol=1e-5)


def test_a_module_returning_a_dict_or_a_model_output_converts_and_checks(tiny_bert_dir, tmp_path):
    """Every transformers model returns a ModelOutput (a dict): the check against torch took only a
    tuple, and failed on it ('... has no attribute detach')."""
    import transformers

    class Two(torch.nn.Module):
        def forward(self, x):
            return {"double": x * 2, "total": x.sum(-1)}

    report = convert(Two(), tmp_path / "dict", FAST, example_inputs=(torch.randn(2, 4),))
    assert report.checks["max_abs_diff_vs_torch"] <= 1e-5
    x = np.ones((3, 4), np.float32)
    assert [v.tolist() for v in load(tmp_path / "dict").run({load(tmp_path / "dict").inputs[0].name: x}).values()] == \
        [(x * 2).tolist(), x.sum(-1).tolist()]
    bert = transformers.AutoModel.from_pretrained(tiny_bert_dir).eval()
    report = convert(bert, tmp_path / "bert", FAST, example_inputs=(torch.ones(1, 8, dtype=torch.long),))
    assert report.checks["cosine_vs_torch"] > 0.9999


def test_a_module_whose_inputs_are_bounded_is_checked_on_its_own_example_inputs(tmp_path):
    """An embedding's ids must lie within its table: random sample ids failed the check of a valid
    module ('the exported graph refused slimml's sample inputs')."""
    net = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3)).eval()
    report = convert(net, tmp_path / "emb", FAST, example_inputs=(torch.tensor([[1, 2, 3]]),))
    assert report.checks["max_abs_diff_vs_torch"] <= 1e-5
    x = np.array([[4, 5, 9]])
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    model = load(tmp_path / "emb")
    np.testing.assert_allclose(next(iter(model.run({model.inputs[0].name: x}).values())), want, atol=1e-5)


def test_reconvert_replaces_an_artifact_atomically(mlp_onnx, tmp_path):
    out = tmp_path / "art"
    convert(mlp_onnx, out, FAST)
    first = (out / "manifest.json").read_text()
    convert(mlp_onnx, out, ConvertConfig(shard=ShardConfig(mode="count", count=2), measure_latency=False))
    assert (out / "manifest.json").read_text() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "mlp.onnx"]  # no temp folders left


def test_generic_inputs_are_documented_in_the_manifest(mlp_onnx, tmp_path):
    convert(mlp_onnx, tmp_path / "art", FAST)
    model = load(tmp_path / "art")
    assert [(t.name, t.dtype, t.shape) for t in model.inputs] == [("x", "float32", ["batch", 8]), ("scale", "float32", ["batch", 1])]
    feeds = sample_feeds(model.inputs, batch=3)
    assert model.run(feeds)["y"].shape == (3, 8)


def test_missing_source_names_the_kinds_slimml_takes(tmp_path):
    with pytest.raises(SourceError) as e:
        convert(tmp_path / "nope", tmp_path / "out", FAST)
    assert str(e.value) == (
        f"source {tmp_path / 'nope'} does not exist. Give a Hugging Face model folder, an .onnx or .gguf file, a .py file "
        "defining `model` and `example_inputs`, or a torch checkpoint (.pt/.pth/.ckpt)."
    )
    assert not (tmp_path / "out").exists()


def test_unsupported_file_is_refused(tmp_path):
    bad = tmp_path / "weights.h5"
    bad.write_bytes(b"\x89HDF")
    with pytest.raises(SourceError, match=r"weights.h5 is a .h5 file, which slimml cannot convert"):
        convert(bad, tmp_path / "out", FAST)


@pytest.mark.parametrize("task, hint", [("nonsense", ""), ("text-generation-withpast", "did you mean 'text-generation-with-past'? ")])
def test_an_unknown_task_is_refused_before_anything_is_exported(task, hint):
    """An unknown --task on a sentence-transformers folder was ignored (the manifest said "nonsense")."""
    from slimml.convert import ExportConfig

    with pytest.raises(SourceError, match=f"unknown task '{task}'; {re.escape(hint)}use auto"):
        ExportConfig(task=task)


def test_state_dict_checkpoint_explains_how_to_save_the_module(tmp_path):
    path = tmp_path / "sd.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    with pytest.raises(SourceError, match=r"holds a state dict \(weights only\)"):
        convert(path, tmp_path / "out", FAST)


def test_a_module_with_a_scalar_output_converts(tmp_path):
    """A 0-dim output (a loss, a score) failed the check with "IndexError: tuple index out of range"."""

    class Total(torch.nn.Module):
        def forward(self, x):
            return (x * 2).sum()

    report = convert(Total(), tmp_path / "out", FAST, example_inputs=(torch.randn(2, 3),))
    assert report.checks["cosine_vs_torch"] == 1.0
    model = load(tmp_path / "out")
    assert float(model.run({model.inputs[0].name: np.ones((4, 3), np.float32)})["output"]) == 24.0


def test_module_without_example_inputs_is_refused(tmp_path):
    with pytest.raises(SourceError, match="needs example inputs to be exported"):
        convert(torch.nn.Linear(2, 2), tmp_path / "out", FAST)


def test_refuses_to_overwrite_a_folder_that_is_not_an_artifact(mlp_onnx, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="is not empty and holds no slimml artifact"):
        convert(mlp_onnx, out, FAST)
    assert (out / "notes.txt").read_text() == "keep me"


def test_decoder_with_kv_cache_routes_each_layers_cache_to_its_shard(tiny_llama_dir, tmp_path):
    from slimml.convert import ExportConfig

    report = convert(tiny_llama_dir, tmp_path / "llama-past", ConvertConfig(export=ExportConfig(task="text-generation-with-past"), measure_latency=False))
    manifest = load(tmp_path / "llama-past").manifest
    for i in range(3):
        shard = next(s for s in manifest.shards if s.layers == [f"model/layers.{i}"])
        read = {t.name for t in shard.inputs} | ({t.name for t in manifest.shards[0].inputs} if i == 0 else set())
        assert {f"past_key_values.{i}.key", f"past_key_values.{i}.value"} <= read  # transformers 5's trace reads the
        assert f"past_key_values.{i}.value" in {t.name for t in shard.inputs}  # first key for the mask, in shard 0
        assert {f"present.{i}.key", f"present.{i}.value"} <= {t.name for t in shard.outputs}
    assert report.checks["max_abs_diff"] <= 1e-5
    assert report.checks["max_abs_diff_vs_torch"] <= 1e-4  # logits and every present.N against torch's cache


def test_a_vit_classifier_converts_and_checks_against_torch(tmp_path):
    """Image inputs are sized from the source config (channels, image size), not guessed."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    from slimml.convert import ConvertConfig, convert
    from slimml.runtime import load

    torch.manual_seed(0)
    src = tmp_path / "vit"
    ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                        image_size=32, patch_size=8, num_labels=3)).eval().save_pretrained(src)
    report = convert(src, tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.checks["max_abs_diff"] <= 1e-5 and report.checks["max_abs_diff_vs_torch"] <= 1e-4
    model = load(tmp_path / "art")
    out = model.run({"pixel_values": np.zeros((2, 3, 32, 32), dtype=np.float32)})
    assert out["logits"].shape == (2, 3)


def test_a_clip_model_converts_and_takes_its_text_towers_length(tmp_path):
    """Both towers in one graph: token ids sized by the text vocabulary, pixels by the vision
    config; the sequence limit comes from the text tower's positions, not the vision tower's patches."""
    import torch
    from transformers import CLIPConfig, CLIPModel

    from slimml.convert import ConvertConfig, convert
    from slimml.runtime import load

    torch.manual_seed(0)
    src = tmp_path / "clip"
    tower = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    CLIPModel(CLIPConfig(text_config=dict(tower, vocab_size=100, max_position_embeddings=40),
                         vision_config=dict(tower, image_size=32, patch_size=8), projection_dim=16)).eval().save_pretrained(src)
    report = convert(src, tmp_path / "art", ConvertConfig())
    assert report.checks["max_abs_diff"] <= 1e-5 and report.checks["max_abs_diff_vs_torch"] <= 1e-4
    assert load(tmp_path / "art").max_sequence_length == 40  # the vision tower has 17 positions


def test_a_dependency_failure_during_convert_is_one_line_naming_the_step():
    """Whatever convert cannot handle ends in one ExportError naming the step, not a dependency's traceback."""
    from pathlib import Path

    from slimml.errors import ExportError, SourceError
    from slimml.runtime.artifact.atomic import one_line_errors

    with pytest.raises(ExportError, match=r"converting m failed while splitting into shards \(ValueError: boom\)\. Do "
                                          r"this; SLIMML_DEBUG=1 shows the cause\.$"):
        with one_line_errors("converting m", ["splitting into shards"], Path("out"), ExportError, "Do this"):
            raise ValueError("boom\nsecond line")
    with pytest.raises(SourceError, match="^mine$"):  # slimml's own errors pass as they are
        with one_line_errors("converting m", ["x"], Path("out"), ExportError, "Do this"):
            raise SourceError("mine")


def test_a_module_exported_through_a_wrapper_keeps_its_eval_mode(tmp_path):
    """A forward with keyword-only parameters (or transformers 5's ``**kwargs``) exports through a
    wrapper; the exporter put the wrapper's training mode back on the model afterwards: its dropout
    on in the check against torch (a cosine of 0.97 on BERT) and in the user's model after convert."""

    class KeywordOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop, self.linear = torch.nn.Dropout(0.5), torch.nn.Linear(4, 4)

        def forward(self, *, x):
            return self.linear(self.drop(x))

    module = KeywordOnly().eval()
    report = convert(module, tmp_path / "kw", FAST, example_inputs={"x": torch.randn(2, 4)})
    assert not module.training and report.checks["max_abs_diff_vs_torch"] <= 1e-5


def test_export_takes_a_path_as_convert_does(tiny_bert_dir, tmp_path):
    """docs/convert.md shows export(source, ...) beside convert(source, ...); a folder given as a
    string was "AttributeError: 'str' object has no attribute 'kind'"."""
    from slimml.convert import export

    exported = export(str(tiny_bert_dir), tmp_path / "work")
    assert exported.onnx_path.is_file() and exported.task
