"""The torch exporter (``--exporter torch``): encoders and classifiers through ``torch.onnx.export``,
with any transformers (optimum-onnx 0.1.0 needs transformers < 4.58; ``--exporter auto`` takes this
one where optimum-onnx does not load). Its graph must be what optimum's is to the rest of slimml:
same inputs and outputs, same layer shards, same numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from slimml.convert import ConvertConfig, ExportConfig, convert  # noqa: E402
from slimml.errors import SlimmlError  # noqa: E402
from slimml.runtime import load  # noqa: E402

TORCH = ConvertConfig(export=ExportConfig(exporter="torch"), measure_latency=False)
TEXTS = ["A man is playing a guitar.", "The weather is lovely today, isn't it?", "short"]


def _export_step(out) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    return next(s for s in manifest["steps"] if s["step"] == "export")


def test_the_default_model_exported_by_torch_equals_the_default_export(default_artifact, tmp_path):
    """Under transformers 4.57 the default export is optimum-onnx's: the two graphs agree."""
    report = convert(None, tmp_path / "art", TORCH)
    assert _export_step(tmp_path / "art")["exporter"] == "torch.onnx"
    assert report.checks["max_abs_diff_vs_torch"] <= 1e-4
    ours, theirs = load(tmp_path / "art"), load(default_artifact)
    try:
        assert len(ours.manifest.shards) == len(theirs.manifest.shards)  # the same layer cuts
        got, want = ours.encode(TEXTS), theirs.encode(TEXTS)
        np.testing.assert_allclose(got, want, atol=1e-5)
    finally:
        ours.close(), theirs.close()


def test_a_text_classifier_exported_by_torch_classifies_as_torch_does(tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    labels = ["negative", "neutral", "positive"]
    model = BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128, num_labels=3, id2label=dict(enumerate(labels)))).eval()
    model.save_pretrained(tmp_path / "src")
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    tokenizer.save_pretrained(tmp_path / "src")
    report = convert(tmp_path / "src", tmp_path / "art", TORCH)
    assert report.task == "text-classification" and report.checks["max_abs_diff_vs_torch"] <= 1e-4
    with torch.no_grad():  # texts of different lengths in one batch: the sequence axis is dynamic
        want = torch.softmax(model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits, -1).numpy()
    art = load(tmp_path / "art")
    try:
        for row, classes in zip(want, art.classify(TEXTS, top_k=None)):
            assert [c["label"] for c in classes] == [labels[i] for i in np.argsort(-row, kind="stable")]
            np.testing.assert_allclose([c["score"] for c in classes], np.sort(row)[::-1], atol=1e-5)
    finally:
        art.close()


def test_a_deberta_v3_with_relative_attention_exports_by_torch(tmp_path):
    """DeBERTa-v3's relative-position helpers are TorchScript functions: the trace holds If nodes
    whose branches read the main graph's values, and renaming those left the branches reading names
    that were gone ("ONNX shape inference could not tell the type of ..."): every real DeBERTa-v3
    failed on the convert extra alone (no optimum-onnx), where the torch exporter writes encoders."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(0)
    model = DebertaV2ForSequenceClassification(DebertaV2Config(
        vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128, type_vocab_size=0, relative_attention=True, pos_att_type=["p2c", "c2p"],
        position_buckets=32, max_relative_positions=-1, position_biased_input=False, norm_rel_ebd="layer_norm",
        share_att_key=True, num_labels=2)).eval()
    model.save_pretrained(tmp_path / "src")
    report = convert(tmp_path / "src", tmp_path / "art", TORCH)
    assert report.checks["max_abs_diff_vs_torch"] <= 1e-4
    ids = torch.tensor([[1, 5, 9, 200, 7, 2], [1, 8, 3, 2, 0, 0]])
    mask = (ids > 0).long()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits.numpy()
    art = load(tmp_path / "art")
    try:
        got = art.run({"input_ids": ids.numpy(), "attention_mask": mask.numpy()})["logits"]
        np.testing.assert_allclose(got, want, atol=1e-5)
    finally:
        art.close()


def test_an_image_classifier_exported_by_torch_takes_any_batch(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                intermediate_size=64, image_size=32, patch_size=8, num_labels=2)).eval()
    model.save_pretrained(tmp_path / "src")
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path / "src")
    report = convert(tmp_path / "src", tmp_path / "art", TORCH)
    assert report.task == "image-classification" and report.checks["max_abs_diff_vs_torch"] <= 1e-4
    pixels = np.random.default_rng(0).standard_normal((5, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        want = model(pixel_values=torch.from_numpy(pixels)).logits.numpy()
    art = load(tmp_path / "art")
    try:
        np.testing.assert_allclose(art.run({"pixel_values": pixels})["logits"], want, atol=1e-4)
    finally:
        art.close()


def test_the_torch_exporter_refuses_an_encoder_decoder_it_does_not_write_in_one_line(tmp_path):
    from transformers import PegasusConfig, PegasusForConditionalGeneration

    PegasusForConditionalGeneration(PegasusConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                                  decoder_ffn_dim=32)).save_pretrained(tmp_path / "t5")
    with pytest.raises(SlimmlError, match="writes the encoder-decoders .* not 'pegasus'; leave --exporter out") as e:
        convert(tmp_path / "t5", tmp_path / "art", TORCH)
    assert "\n" not in str(e.value) and not (tmp_path / "art").exists()


def test_attention_of_a_torch_exported_encoder_fuses_in_every_layer_shard(tmp_path):
    """The torch exporter writes the attention ONNX Runtime's fusion matches, under transformers 4.57
    and 5 alike: the additive mask 4.57 built (transformers 5's boolean one is ~50 ops the fusion
    does not follow into a layer shard), the head counts spelled out in the reshapes, the scores
    divided by sqrt(d). int8 then runs one QAttention per layer, as optimum's graph does."""
    import onnx

    from slimml.quantize import Int8DynamicConfig

    report = convert(None, tmp_path / "art", ConvertConfig(export=ExportConfig(exporter="torch"), measure_latency=False,
                                                           quantize=Int8DynamicConfig(calibration_size=16)))
    assert report.checks["float_max_abs_diff_vs_torch"] <= 1e-4  # the float artifact's, kept under float_
    art = tmp_path / "art"
    manifest = json.loads((art / "manifest.json").read_text())
    layers = manifest["source"]["num_hidden_layers"]
    ops = [n.op_type for f in sorted(art.glob("shard_*.onnx")) for n in onnx.load(str(f), load_external_data=False).graph.node]
    assert ops.count("QAttention") == layers and "Softmax" not in ops
    model = load(art)
    try:
        emb = model.encode(TEXTS)
        assert emb.shape == (3, 384) and np.all(np.isfinite(emb))
        assert float(emb[0] @ emb[1]) < float(emb[0] @ emb[0])  # unit vectors, different texts
    finally:
        model.close()


def test_a_head_optimum_onnx_does_not_export_goes_to_the_torch_exporter(tmp_path):
    """optimum-onnx 0.1.0 exports ModernBERT for four tasks, not question answering: `--exporter auto`
    stopped at its error, which named no fix, though the torch exporter writes the model exactly."""
    pytest.importorskip("optimum.exporters.onnx")  # with optimum-onnx installed, auto tries it first
    from transformers import AutoTokenizer, ModernBertConfig, ModernBertForQuestionAnswering

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    ModernBertForQuestionAnswering(ModernBertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=101, eos_token_id=102, cls_token_id=101,
        sep_token_id=102)).eval().save_pretrained(tmp_path / "src")
    AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(tmp_path / "src")
    report = convert(tmp_path / "src", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.task == "question-answering" and report.checks["max_abs_diff_vs_torch"] <= 1e-4
    assert _export_step(tmp_path / "art")["exporter"] == "torch.onnx"
    assert load(tmp_path / "art").answer("Who plays?", "A man is playing a guitar.")["answer"]
    assert report.checks["exporter_note"].startswith("optimum-onnx could not export it (ValueError: Asked to export a "
                                                     "modernbert model for the task question-answering")
    custom = tmp_path / "src"  # a folder of custom code is not taken by the torch exporter: its refusal stands
    config = json.loads((custom / "config.json").read_text())
    (custom / "config.json").write_text(json.dumps({**config, "model_type": "my_bert", "architectures": ["MyBertForQuestionAnswering"],
                                                    "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}))
    (custom / "configuration_my.py").write_text("raise RuntimeError('custom code ran')\n")
    with pytest.raises(SlimmlError, match=r"needs its own modeling code \(auto_map in its config\), which slimml does not run"):
        convert(custom, tmp_path / "custom", ConvertConfig(measure_latency=False))


def test_a_graph_the_exporter_writes_wrong_is_refused_as_the_exporters_fault(tmp_path):
    """torch's TorchScript exporter writes Falcon's ALiBi (a bfloat16 cast) as a COMPLEX128 Cast, a
    graph ONNX Runtime refuses; the convert said "The file is not a valid ONNX model for this
    onnxruntime; re-convert it", which no re-convert fixes. Now it names the exporter and the way out
    (or, once torch writes it right, the model converts)."""
    from transformers import FalconConfig, FalconForCausalLM

    from slimml.errors import ExportError

    torch.manual_seed(0)
    FalconForCausalLM(FalconConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   alibi=True, multi_query=False, parallel_attn=False, bias=True,
                                   new_decoder_architecture=False)).save_pretrained(tmp_path / "src")
    try:
        report = convert(tmp_path / "src", tmp_path / "art", ConvertConfig(
            export=ExportConfig(exporter="torch", task="text-generation"), measure_latency=False))
    except ExportError as e:
        assert str(e).startswith("the exporter wrote a graph ONNX Runtime cannot load (") and "--exporter" in str(e)
        assert "re-convert" not in str(e) and not (tmp_path / "art").exists()
    else:
        assert report.checks["max_abs_diff_vs_torch"] <= 1e-3
