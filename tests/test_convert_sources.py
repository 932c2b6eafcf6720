"""convert() of sources that are easy to get subtly wrong: torch modules called by name, with 0-d
inputs, with Python code that depends on the batch size, with tiny embedding tables; ONNX graphs
whose outputs no node makes, or whose subgraphs keep their weights in an external data file;
Hugging Face folders asked for a head they do not hold, or with a broken tokenizer file. Each
converts right or is refused in one line; none is written wrong with exit 0."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto as T  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402

from slimml.convert import ConvertConfig, ExportConfig, convert  # noqa: E402
from slimml.errors import ExportError, SourceError  # noqa: E402
from slimml.runtime import load  # noqa: E402

FAST = ConvertConfig(measure_latency=False)
nn = torch.nn


class _XY(nn.Module):
    def forward(self, x, y):
        return x * 2 + y[:, :1]


class _KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, *, y):
        return self.linear(x) + y


def test_dict_inputs_are_named_in_forwards_order_whatever_the_dicts(tmp_path):
    torch.manual_seed(0)
    module = _XY()
    convert(module, tmp_path / "a", FAST, example_inputs={"y": torch.randn(2, 4), "x": torch.randn(2, 4)})
    model = load(tmp_path / "a")
    assert [t.name for t in model.inputs] == ["x", "y"]
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    got = model.run({"x": x.numpy(), "y": y.numpy()})["output"]
    np.testing.assert_allclose(got, module(x, y).numpy(), atol=1e-6)


def test_keyword_only_parameters_and_a_list_of_inputs_are_exported(tmp_path):
    torch.manual_seed(0)
    module = _KeywordOnly()
    convert(module, tmp_path / "kw", FAST, example_inputs={"y": torch.randn(2, 3), "x": torch.randn(2, 4)})
    x, y = torch.randn(3, 4), torch.randn(3, 3)
    got = load(tmp_path / "kw").run({"x": x.numpy(), "y": y.numpy()})["output"]
    np.testing.assert_allclose(got, module(x=x, y=y).detach().numpy(), atol=1e-6)
    convert(_XY(), tmp_path / "list", FAST, example_inputs=[torch.randn(2, 4), torch.randn(2, 4)])  # as a tuple
    assert [t.name for t in load(tmp_path / "list").inputs] == ["input_0", "input_1"]


def test_example_inputs_forward_does_not_take_are_refused_in_one_line(tmp_path):
    with pytest.raises(SourceError, match=r"^example_inputs names 'z', which _XY.forward does not take \(its parameters: "
                                          r"x, y\); name the inputs as forward does\.$"):
        convert(_XY(), tmp_path / "a", FAST, example_inputs={"x": torch.randn(2, 4), "z": torch.randn(2, 4)})


class _Counting(nn.Module):
    """Its trace bakes in the call count: the graph computes what the module did once, not what it does."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.calls


def test_a_graph_that_disagrees_with_its_module_is_refused_not_written(tmp_path):
    with pytest.raises(ExportError, match=r"^the exported graph of _Counting disagrees with the source model in torch "
                                          r"\(cosine 1, difference 0\.\d+ of its largest value\): slimml does not ship it; "
                                          r"the trace of its forward does not compute what the module does"):
        convert(_Counting(), tmp_path / "a", FAST, example_inputs=(torch.randn(2, 4),))
    assert not (tmp_path / "a").exists()


class _BatchLoop(nn.Module):
    def forward(self, x):
        return torch.stack([x[i] * (i + 1) for i in range(x.shape[0])])


def test_a_module_whose_python_loops_over_the_batch_is_refused_at_another_batch(tmp_path):
    with pytest.raises(ExportError, match=r"^the exported graph of _BatchLoop gives its 'output' output in shape \[2, 4\] "
                                          r"where the source model gives \[3, 4\] at a batch of 3 .*write it without Python "
                                          r"loops over the batch, or convert with a fixed batch"):
        convert(_BatchLoop(), tmp_path / "a", FAST, example_inputs=(torch.randn(2, 4),))
    fixed = ConvertConfig(measure_latency=False, export=ExportConfig(dynamic_batch=False))
    report = convert(_BatchLoop(), tmp_path / "b", fixed, example_inputs=(torch.randn(2, 4),))  # its batch: right
    assert report.checks["other_batch"] == "not run: no input with a dynamic batch axis"
    assert convert(_XY(), tmp_path / "c", FAST, example_inputs=(torch.randn(2, 4), torch.randn(2, 4))).checks[
        "other_batch"] == "batch 3: agrees"


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, scale):
        return self.linear(x) * scale, scale * 2


def test_a_0d_input_and_output_get_no_batch_axis_and_torch_prints_nothing(tmp_path, capfd):
    torch.manual_seed(0)
    module = _Scaled()
    convert(module, tmp_path / "a", FAST, example_inputs=(torch.randn(2, 4), torch.tensor(2.0)))
    model = load(tmp_path / "a")
    assert [t.shape for t in model.inputs] == [["batch", 4], []]
    assert [t.shape for t in model.manifest.outputs] == [["batch", 4], []]
    x = torch.randn(5, 4)
    got = model.run({"input_0": x.numpy(), "input_1": np.array(3.0, np.float32)})
    np.testing.assert_allclose(got["output_0"], module(x, torch.tensor(3.0))[0].detach().numpy(), atol=1e-5)
    assert got["output_1"] == 6.0

    class Svd(nn.Module):  # the TorchScript exporter has no symbolic for it: it logs its IR to stdout, then raises
        def forward(self, x):
            return torch.linalg.svd(x)[1]

    capfd.readouterr()
    with pytest.raises(ExportError, match=r"^torch\.onnx\.export failed for Svd"):
        convert(Svd(), tmp_path / "b", FAST, example_inputs=(torch.randn(2, 3, 3),))
    assert capfd.readouterr().out == ""


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.dropout = nn.Dropout(0.5)

    def forward(self, ids):
        return self.dropout(self.embedding(ids))


def test_a_small_embedding_is_timed_on_its_example_ids_and_train_mode_comes_back(tmp_path):
    module = _Embed().train()
    module.dropout.eval()  # a submodule the caller keeps in eval mode stays in it
    report = convert(module, tmp_path / "a", ConvertConfig(), example_inputs=(torch.tensor([[1, 2, 3], [4, 5, 9]]),))
    assert report.latency_ms is not None and report.checks["latency_ms_example_inputs"] > 0
    assert module.training and module.embedding.training and not module.dropout.training


def _gather_onnx(path, rows: int = 10):
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((rows, 8)).astype(np.float32), "emb"),
             nh.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")]
    nodes = [h.make_node("Gather", ["emb", "ids"], ["e"], name="/embeddings/Gather"),
             h.make_node("MatMul", ["e", "w"], ["y"], name="/layers.0/MatMul")]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("ids", T.INT64, ["batch", "seq"])],
                         [h.make_tensor_value_info("y", T.FLOAT, ["batch", "seq", 8])], inits)
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))
    return path


def test_an_onnx_graph_with_a_small_table_is_checked_and_timed_inside_it(tmp_path):
    report = convert(_gather_onnx(tmp_path / "emb.onnx"), tmp_path / "a", ConvertConfig())
    assert report.checks["latency_ms_b1_s128"] > 0
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["source"]["vocab_size"] == 10


def test_a_latency_failure_keeps_the_checked_artifact(tmp_path, monkeypatch):
    import slimml.convert.pipeline as pipeline

    def refuse(*a, **k):
        raise RuntimeError("no such input")

    monkeypatch.setattr(pipeline, "time_runs", refuse)
    report = convert(_gather_onnx(tmp_path / "emb.onnx"), tmp_path / "a", ConvertConfig())
    assert report.latency_ms is None and report.checks["latency_note"].startswith(
        "not measured: the artifact refused the sample inputs timed (no such input)")
    assert load(tmp_path / "a").run({"ids": np.array([[1, 2]])})["y"].shape == (1, 2, 8)


def test_outputs_no_node_makes_are_carried_through(tmp_path):
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"w{i}") for i in range(2)]
    nodes = [h.make_node("MatMul", ["x", "w0"], ["a"], name="/layers.0/MatMul"),
             h.make_node("MatMul", ["a", "w1"], ["y"], name="/layers.1/MatMul"),
             h.make_node("Constant", [], ["c"], value=nh.from_array(np.arange(3, dtype=np.float32), "cv"))]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["batch", 8]),
                                      h.make_tensor_value_info("z", T.INT64, ["batch"])],
                         [h.make_tensor_value_info("y", T.FLOAT, ["batch", 8]),  # made by a node
                          h.make_tensor_value_info("z", T.INT64, ["batch"]),  # an input no node reads
                          h.make_tensor_value_info("c", T.FLOAT, [3]),  # a Constant's value
                          h.make_tensor_value_info("w1", T.FLOAT, [8, 8])], inits)  # a weight a node reads too
    path = tmp_path / "odd.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))
    convert(path, tmp_path / "a", FAST)
    feeds = {"x": rng.standard_normal((3, 8)).astype(np.float32), "z": np.array([4, 5, 6])}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = load(tmp_path / "a").run(feeds)
    assert list(got) == ["y", "z", "c", "w1"]
    for name, value in zip(got, want):
        np.testing.assert_allclose(got[name], value, atol=1e-5)


def test_weights_inside_an_if_in_external_data_go_into_the_shards(tmp_path):
    rng = np.random.default_rng(0)
    weight = lambda name: nh.from_array(rng.standard_normal((64, 64)).astype(np.float32), name)  # noqa: E731
    then = h.make_graph([h.make_node("MatMul", ["a", "tw"], ["t"])], "then", [],
                        [h.make_tensor_value_info("t", T.FLOAT, None)], [weight("tw")])
    other = h.make_graph([h.make_node("MatMul", ["a", "ew"], ["e"])], "else", [],
                         [h.make_tensor_value_info("e", T.FLOAT, None)], [weight("ew")])
    nodes = [h.make_node("MatMul", ["x", "w0"], ["a"], name="/layers.0/MatMul"),
             h.make_node("ReduceSum", ["a"], ["s"], keepdims=0, name="/layers.0/ReduceSum"),
             h.make_node("Greater", ["s", "zero"], ["cond"], name="/layers.0/Greater"),
             h.make_node("If", ["cond"], ["b"], then_branch=then, else_branch=other, name="/layers.1/If"),
             h.make_node("MatMul", ["b", "w1"], ["y"], name="/layers.2/MatMul")]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [1, 64])],
                         [h.make_tensor_value_info("y", T.FLOAT, [1, 64])],
                         [weight("w0"), weight("w1"), nh.from_array(np.array(0, np.float32), "zero")])
    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / "if.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path), save_as_external_data=True,
              all_tensors_to_one_file=True, location="if.onnx.data", size_threshold=0)
    convert(path, tmp_path / "a", FAST)
    shutil.rmtree(tmp_path / "src")  # the artifact reads nothing of its source
    x = rng.standard_normal((1, 64)).astype(np.float32)
    assert load(tmp_path / "a").run({"x": x})["y"].shape == (1, 64)


@pytest.fixture(scope="module")
def headless_bert(tmp_path_factory):
    """A 1-layer BERT saved without a head (BertModel), with the default model's tokenizer files."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("headless")
    config = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64)
    BertModel(config).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy2(default_model_dir() / name, folder / name)
    return folder


def test_a_task_whose_head_the_folder_lacks_is_refused_in_one_line(headless_bert, tmp_path):
    config = ConvertConfig(measure_latency=False, export=ExportConfig(task="text-classification"))
    with pytest.raises(SourceError, match=r"holds no trained text-classification head: transformers would start 2 of its "
                                          r"weights \(classifier\.bias, classifier\.weight\) from random values.*; convert a "
                                          r"folder trained for text-classification, or pass --task feature-extraction "):
        convert(headless_bert, tmp_path / "a", config)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json"])
def test_a_broken_tokenizer_file_is_refused_not_dropped(headless_bert, tmp_path, name):
    folder = tmp_path / "bert"
    shutil.copytree(headless_bert, folder)
    (folder / name).write_text('{"model_max_length": ')
    with pytest.raises(SourceError, match=rf"^{folder / name} is not valid JSON \(.*\); restore it \(save the "
                                          r"tokenizer again .*\), or delete it\.$"):
        convert(folder, tmp_path / "a", FAST)


def test_a_tokenizer_larger_than_the_models_embedding_is_named(tmp_path):
    """A tokenizer whose ids pass the embedding's rows is named as the cause (was: the exported graph
    refused slimml's sample inputs, convert with --no-verify)."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    from slimml.convert.sources import default_model_dir

    folder = tmp_path / "small"
    BertModel(BertConfig(vocab_size=1000, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy2(default_model_dir() / name, folder / name)
    with pytest.raises(ExportError, match=r"the tokenizer gives token id \d+, and the model's embedding has 1000 rows: the "
                                          r"tokenizer is not this model's"):
        convert(folder, tmp_path / "a", FAST)
    assert not (tmp_path / "a").exists()


def test_a_gguf_artifact_is_named_for_its_model_not_its_file_type():
    """SmolLM2's file is SmolLM2-135M-Instruct.Q4_1.gguf: its artifact and the model a server named were
    "SmolLM2-135M-Instruct.Q4_1", so the README's OpenAI client (model="SmolLM2-135M-Instruct") got a 404."""
    from slimml.convert.sources import gguf_model_name

    for stem, name in (("SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct"),
                       ("Meta-Llama-3-8B-Instruct-Q4_K_M", "Meta-Llama-3-8B-Instruct"),
                       ("Phi-3-mini-4k-instruct-IQ4_XS", "Phi-3-mini-4k-instruct"), ("qwen2.5-0.5b-instruct-q8_0",
                       "qwen2.5-0.5b-instruct"), ("model-f16", "model"), ("gpt-oss-20b-mxfp4", "gpt-oss-20b"),
                       ("plain", "plain"), ("Q4_0", "Q4_0"), ("qwen2.5-0.5b-instruct-fp16", "qwen2.5-0.5b-instruct"),
                       ("Meta-Llama-3-8B.i1-Q4_K_M", "Meta-Llama-3-8B"), ("Qwen3-0.6B-UD-Q4_K_XL", "Qwen3-0.6B"),
                       ("Llama-3-8B-Q4_K_M-00001-of-00002", "Llama-3-8B"), ("tiny.fp32", "tiny"),
                       ("model-00001-of-00003", "model")):
        assert gguf_model_name(stem) == name
