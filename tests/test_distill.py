"""Distillation and structured pruning on tiny real models: shapes really shrink, outputs stay right."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from slimml.convert import ConvertConfig, convert
from slimml.convert.distill import DistillConfig, evenly_spaced, shrink
from slimml.convert.distill.distill_data import load_texts
from slimml.convert.distill.prune import PruneConfig
from slimml.convert.export import _optimum_loads
from slimml.errors import ConfigError, DataError
from slimml.runtime import load
from conftest import STS_TRAIN


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory):
    s1 = []
    for line in STS_TRAIN.read_text(encoding="utf-8").splitlines()[1:41]:
        s1.append(line.split(",")[0])
    path = tmp_path_factory.mktemp("distill") / "texts.txt"
    path.write_text("\n".join(s1) + "\n", encoding="utf-8")
    return path


def _tiny(folder, model_cls, config_cls, **kw):
    import torch
    from transformers import AutoTokenizer

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    model_cls(config_cls(vocab_size=30522, max_position_embeddings=128, **kw)).eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_classifier_dir(tmp_path_factory):
    """A 4-layer BERT sentence classifier (3 labels), random weights, the default tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    return _tiny(tmp_path_factory.mktemp("tiny_cls"), BertForSequenceClassification, BertConfig, hidden_size=32,
                 num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, num_labels=3)


@pytest.fixture(scope="module")
def tiny_decoder_dir(tmp_path_factory):
    """A 3-layer Llama causal LM, random weights, the default tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny(tmp_path_factory.mktemp("tiny_llm"), LlamaForCausalLM, LlamaConfig, hidden_size=16, intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)


def test_evenly_spaced_keeps_first_and_last():
    assert evenly_spaced(6, 3) == [0, 2, 5]
    assert evenly_spaced(6, 2) == [0, 5]
    assert evenly_spaced(12, 4) == [0, 4, 7, 11]
    assert evenly_spaced(6, 1) == [5]


def test_sentence_model_distilled_and_pruned_shrinks_and_runs(tiny_bert_dir, texts_file, tmp_path):
    # tiny_bert: 2 layers, 2 heads, FFN 64 -> 1 layer, 1 head, FFN 32
    from conftest import STS_DEV

    sts = tmp_path / "sts.csv"
    sts.write_text("".join(STS_DEV.read_text(encoding="utf-8").splitlines(keepends=True)[:41]), encoding="utf-8")
    config = ConvertConfig(distill=DistillConfig(layers=1, data=texts_file, max_steps=4, batch_size=8),
                           prune=PruneConfig(0.5, importance_batches=2), measure_latency=False, compare_on=sts)
    report = convert(tiny_bert_dir, tmp_path / "art", config)
    # the report's teacher-vs-student table: the teacher converted beside the student, timed interleaved
    t, st = report.teacher["teacher"], report.teacher["student"]
    assert t["params"] > st["params"] > 0 and t["mb"] > st["mb"] > 0 and report.teacher["latency_ratio"] > 0
    assert -100 <= st["stsb"] <= 100 and -100 <= t["stsb"] <= 100
    assert not (report.out / ".work").exists()
    with pytest.raises(DataError, match=r"data file .*nope.csv does not exist"):  # before any training
        convert(tiny_bert_dir, tmp_path / "art2", ConvertConfig(prune=PruneConfig(0.5), compare_on=tmp_path / "nope.csv"))
    with pytest.raises(ConfigError, match=r"compares a student with its teacher"):
        convert(tiny_bert_dir, tmp_path / "art2", ConvertConfig(compare_on=sts))
    assert not (tmp_path / "art2").exists()
    model = load(report.out)
    m = model.manifest
    assert [s["step"] for s in m.steps] == ["distill", "prune", "export", "shard"]
    assert m.steps[0]["kept_teacher_layers"] == [1] and m.steps[0]["texts"] == 40
    assert m.steps[1]["heads_per_layer"] == 1 and m.steps[1]["ffn_per_layer"] == 32
    trained = m.steps[0]["training"]  # what pruning cost, measured before training won it back
    assert "heldout_loss_pruned" in trained and (trained["heldout_loss_pruned"] is None) == (trained["heldout_texts"] == 0)
    assert m.steps[1]["vocab_size"] == round(30522 * 0.7) == m.source["vocab_size"]  # the vocabulary: 0.3 at most
    assert m.source["path"] == str(tiny_bert_dir) and m.task == "sentence-embedding"
    assert [s.layers for s in m.shards if s.layers] == [["encoder/layer.0"]]
    # Q, K, V: (32 -> 1 head x 16), attention out (16 -> 32), FFN in/out (32 <-> 32 neurons): real shapes
    layer_file = report.out / m.shards[-1].file
    weights = [list(t.dims) for t in onnx.load(str(layer_file), load_external_data=False).graph.initializer
               if len(t.dims) == 2 and not t.name.startswith("embeddings.")]  # one layer: 5's graph cuts it in (docs)
    assert sorted(weights) == sorted([[32, 16]] * 3 + [[16, 32]] + [[32, 32]] * 2)
    assert m.checks["max_abs_diff"] <= 1e-5 and m.checks["embedding_cosine_vs_torch"] >= 0.9999
    emb = model.encode(["A man plays a guitar.", "Two dogs run."])
    assert emb.shape == (2, 32) and np.allclose(np.linalg.norm(emb, axis=1), 1, atol=1e-5)


@pytest.mark.parametrize("family", ["bert", "roberta", "electra"])
def test_pruned_model_equals_the_original_with_those_heads_and_neurons_zeroed(family, tmp_path):
    """Structured pruning removes exactly what it claims: the pruned model computes what the
    original computes once the removed heads' output columns and neurons' weights are zero, and its
    folder reads back through slimml's loader to the same outputs (transformers 4.57 and 5 alike;
    4.57 reads the folder's ``pruned_heads`` by itself too)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModel, PreTrainedModel

    from slimml.convert.distill import prune as pr
    from slimml.convert.distill.prune_heads import from_pretrained

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=16, max_position_embeddings=40, embedding_size=32)
    model = AutoModel.from_config(config).eval()
    rng = np.random.default_rng(0)
    kept = {"heads": [sorted(rng.choice(4, 2, replace=False).tolist()) for _ in range(2)],
            "ffn": [sorted(rng.choice(16, 8, replace=False).tolist()) for _ in range(2)]}
    zeroed = __import__("copy").deepcopy(model)
    with torch.no_grad():
        for layer, heads, neurons in zip(zeroed.encoder.layer, kept["heads"], kept["ffn"]):
            for h in set(range(4)) - set(heads):
                layer.attention.output.dense.weight[:, h * 8:(h + 1) * 8] = 0
            for j in set(range(16)) - set(neurons):
                layer.intermediate.dense.weight[j] = 0
                layer.intermediate.dense.bias[j] = 0
    pr.apply_plan(model, kept)
    layer = model.encoder.layer[0]
    assert layer.attention.self.query.weight.shape == (16, 32) and layer.attention.output.dense.weight.shape == (32, 16)
    assert layer.intermediate.dense.weight.shape == (8, 32) and layer.output.dense.weight.shape == (32, 8)
    assert model.config.pruned_heads == {i: sorted(set(range(4)) - set(h)) for i, h in enumerate(kept["heads"])}
    ids = torch.randint(3, 100, (2, 10))
    with torch.no_grad():
        got = model(input_ids=ids).last_hidden_state
        want = zeroed(input_ids=ids).last_hidden_state
    assert torch.allclose(got, want, atol=1e-5)
    model.save_pretrained(tmp_path / "pruned")  # and it reloads with the same shapes
    again = from_pretrained(AutoModel.from_pretrained, tmp_path / "pruned").eval()
    assert again.encoder.layer[1].attention.self.value.weight.shape == (16, 32)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).last_hidden_state, got)
    if hasattr(PreTrainedModel, "prune_heads"):  # transformers 4.57 (optimum-onnx loads with it)
        native = AutoModel.from_pretrained(tmp_path / "pruned").eval()
        with torch.no_grad():
            assert torch.equal(native(input_ids=ids).last_hidden_state, got), transformers.__version__


def test_a_pruned_folder_converts_with_the_torch_exporter_and_equals_the_pruned_model(tmp_path):
    """The path transformers 5 takes (no optimum-onnx), run under any transformers: the torch exporter
    and the check's reference read the pruned folder through slimml's loader, so the artifact has
    the pruned shapes, the same layer shards, and computes what the pruned model computes."""
    import torch
    from transformers import BertConfig, BertModel

    from slimml.convert import ExportConfig
    from slimml.convert.distill import prune as pr

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=16, max_position_embeddings=32)).eval()
    pr.apply_plan(model, {"heads": [[0, 3], [1, 2]], "ffn": [list(range(8)), list(range(8, 16))]})
    model.save_pretrained(tmp_path / "pruned")
    report = convert(tmp_path / "pruned", tmp_path / "art", ConvertConfig(export=ExportConfig(exporter="torch"),
                                                                           measure_latency=False))
    assert report.checks["max_abs_diff_vs_torch"] < 1e-5
    art = load(report.out)
    assert [s.layers for s in art.manifest.shards] == [[], ["encoder/layer.0"], ["encoder/layer.1"]]
    layer = report.out / art.manifest.shards[-1].file
    weights = [list(t.dims) for t in onnx.load(str(layer), load_external_data=False).graph.initializer if len(t.dims) == 2]
    assert sorted(weights) == sorted([[32, 16]] * 3 + [[16, 32]] + [[32, 8]] + [[8, 32]])
    ids = np.array([[5, 17, 42, 9, 3, 60], [8, 2, 77, 0, 0, 0]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    got = art.run({"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})["last_hidden_state"]
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_heads_pruned_twice_are_recorded_in_the_original_numbering(tmp_path):
    """A pruned encoder pruned again (a pruned folder as the teacher) records every removed head as
    the unpruned model numbers them, so its folder reads back."""
    import torch
    from transformers import BertConfig, BertModel

    from slimml.convert.distill.prune_heads import from_pretrained, remove_heads

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                 intermediate_size=16, max_position_embeddings=16)).eval()
    remove_heads(model, {0: [0, 2, 3]})  # heads 0, 2, 3 left, numbered 0, 1, 2 now
    remove_heads(model, {0: [0, 2]})  # keeps original heads 0 and 3
    assert model.config.pruned_heads == {0: [1, 2]}
    model.save_pretrained(tmp_path / "twice")
    again = from_pretrained(BertModel.from_pretrained, tmp_path / "twice").eval()
    ids = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)


def test_pruned_llama_equals_the_original_with_those_groups_and_neurons_zeroed(tmp_path):
    """A decoder loses whole key-value groups (their K, V and query heads) and MLP neurons; the
    pruned config (head_dim, head counts, intermediate_size) reloads under transformers 4.57 and 5."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimml.convert.distill import prune as pr

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=16, max_position_embeddings=32)).eval()
    kept = {"heads": [[1], [0]], "ffn": [list(range(0, 16, 2)), list(range(8))]}
    zeroed = __import__("copy").deepcopy(model)
    with torch.no_grad():  # group g holds query heads 2g, 2g+1 (8 wide each): o_proj columns 16g..16g+15
        for layer, groups, neurons in zip(zeroed.model.layers, kept["heads"], kept["ffn"]):
            for g in set(range(2)) - set(groups):
                layer.self_attn.o_proj.weight[:, g * 16:(g + 1) * 16] = 0
            for j in set(range(16)) - set(neurons):
                layer.mlp.down_proj.weight[:, j] = 0
    pr.apply_plan(model, kept)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim) == (2, 1, 8)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (8, 32)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        got = model(input_ids=ids).logits
        assert torch.allclose(got, zeroed(input_ids=ids).logits, atol=1e-5)
    model.save_pretrained(tmp_path / "pruned")
    again = LlamaForCausalLM.from_pretrained(tmp_path / "pruned").eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, got)


def test_classifier_distilled_with_kl_and_pruned(tiny_classifier_dir, texts_file, tmp_path):
    config = ConvertConfig(distill=DistillConfig(layers=2, data=texts_file, max_steps=3, batch_size=8),
                           prune=PruneConfig(0.5, importance_batches=1), measure_latency=False)
    report = convert(tiny_classifier_dir, tmp_path / "art", config)
    m = load(report.out).manifest
    assert m.task == "text-classification" and m.steps[0]["objective"] == "logits-kl"
    assert m.steps[0]["kept_teacher_layers"] == [0, 3] and m.steps[1]["heads_per_layer"] == 2
    assert m.steps[0]["student_params"] < m.steps[0]["teacher_params"]
    assert m.steps[1]["student_params"] < m.steps[0]["student_params"]
    assert m.checks["max_abs_diff_vs_torch"] <= 1e-4
    assert [o.name for o in m.outputs] == ["logits"]


@pytest.mark.skipif(_optimum_loads() is not None, reason="its teacher (head size 8: not the fused exporter's) needs "
                    "optimum-onnx (transformers 4.57)")
def test_decoder_layer_distillation_with_kl(tiny_decoder_dir, texts_file, tmp_path):
    steps = shrink(tiny_decoder_dir, tmp_path / "student", DistillConfig(layers=2, data=texts_file, max_steps=2, batch_size=8))
    assert steps[0]["objective"] == "lm-kl" and steps[0]["kept_teacher_layers"] == [0, 2]
    cfg = json.loads((tmp_path / "student" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    assert (tmp_path / "student" / "tokenizer.json").is_file()


def test_interrupted_training_resumes_from_the_checkpoint(tiny_bert_dir, texts_file, tmp_path):
    # Two phases of 4 steps each: distillation (steps 1-4), then pruning and recovery (steps 5-8).
    ckpt = tmp_path / "ckpt.pt"
    # an explicit precision: "auto" measures, and two runs on a busy machine may measure differently
    config = DistillConfig(layers=1, data=texts_file, max_steps=4, batch_size=8, checkpoint_every=2, mixed_precision="off")
    prune = PruneConfig(0.5, importance_batches=1)

    def stop_at(n, seen):
        def progress(step, total, loss):
            if loss is None:  # the teacher pass: texts, not steps
                return
            seen.append(step)
            assert total == 8
            if step == n:
                raise KeyboardInterrupt
        return progress

    for stop, want_seen in ((3, [1, 2, 3]), (7, [3, 4, 5, 6, 7])):  # killed before pruning, then after
        seen = []
        with pytest.raises(KeyboardInterrupt):
            shrink(tiny_bert_dir, tmp_path / "s1", config, prune, ckpt, stop_at(stop, seen))
        assert ckpt.is_file() and seen == want_seen
    seen = []
    steps = shrink(tiny_bert_dir, tmp_path / "s2", config, prune, ckpt, lambda s, t, l: l is None or seen.append(s))
    assert steps[0]["resumed_at_step"] == 6 and seen == [7, 8]
    assert steps[1]["trained_before_pruning"] == {"epochs": 1.0, "steps": 4}
    assert not ckpt.exists()
    shrink(tiny_bert_dir, tmp_path / "s3", config, prune)  # the same run, never interrupted
    assert (tmp_path / "s2" / "model.safetensors").read_bytes() == (tmp_path / "s3" / "model.safetensors").read_bytes()


def test_bad_requests_fail_before_any_work(tiny_bert_dir, tiny_decoder_dir, texts_file, tmp_path):
    with pytest.raises(ConfigError) as e:
        PruneConfig(1.0)
    assert str(e.value) == ("--prune 1.0 is outside (0, 1); give the share of heads and FFN neurons to remove, "
                            "e.g. --prune 0.3.")
    with pytest.raises(ConfigError, match=r"--prune 0 is outside \(0, 1\)"):
        PruneConfig(0)
    with pytest.raises(ConfigError) as e:
        shrink(tiny_bert_dir, tmp_path / "s", DistillConfig(layers=2, data=texts_file))
    assert str(e.value) == "--distill-layers 2 is not fewer than the teacher's 2 layers; give 1 to 1."
    with pytest.raises(DataError, match=r"distillation data .*nope.txt does not exist"):
        shrink(tiny_bert_dir, tmp_path / "s", DistillConfig(layers=1, data=tmp_path / "nope.txt"))
    small = tmp_path / "small.txt"
    small.write_text("one\ntwo\ntwo\nthree\n")
    with pytest.raises(DataError) as e:
        shrink(tiny_bert_dir, tmp_path / "s", DistillConfig(layers=1, data=small))
    assert str(e.value) == (f"distillation data {small} has 3 distinct non-empty texts; at least 16 are needed "
                            "(thousands for a good student). Give a larger file with --distill-data.")
    with pytest.raises(ConfigError) as e:  # one KV group: pruning any group leaves none
        shrink(tiny_decoder_dir, tmp_path / "s", DistillConfig(data=texts_file), PruneConfig(0.6))
    assert str(e.value) == ("--prune 0.6 would leave every layer with no attention heads: this model has 1 key-value "
                            "group(s) of 2 query heads, and pruning removes whole groups to keep grouped-query attention "
                            "consistent. Give --prune below 0.50.")
    for bad in (0, -2, 1.5, "2"):
        with pytest.raises(ConfigError, match=r"--grad-accum .* must be a whole number >= 1"):
            DistillConfig(layers=1, grad_accum=bad)
    with pytest.raises(ConfigError, match=r"--mixed-precision fp16 trains with a gradient scaler on a CUDA GPU"):
        shrink(tiny_bert_dir, tmp_path / "s", DistillConfig(layers=1, data=texts_file, mixed_precision="fp16", device="cpu"))
    with pytest.raises(ConfigError, match=r"memory budget 'lots' is not a size"):
        DistillConfig(layers=1, teacher_memory_budget="lots")
    assert not (tmp_path / "s").exists()


def test_default_corpus_needs_no_download():
    texts, origin = load_texts(None, limit=200)
    assert origin == "python-stdlib-docstrings" and len(texts) == 200 and len(set(texts)) == 200
    assert all(t[0].isupper() and len(t) >= 25 for t in texts)


def test_vocabulary_pruning_keeps_the_data_tokens_and_never_makes_unknowns(tmp_path):
    from tokenizers import Tokenizer

    import slimml.convert.distill.prune_vocab as prune_vocab
    from slimml.convert.sources import default_model_dir

    folder = default_model_dir()
    old = Tokenizer.from_file(str(folder / "tokenizer.json"))
    seen = ["A man is playing a flute.", "Quantized encoders run on CPUs."]
    used = {i for t in seen for i in old.encode(t).ids}
    keep = prune_vocab.plan(folder, used, 0.5)
    assert len(keep) == round(30522 * 0.5) and used <= set(keep)
    prune_vocab.write_tokenizer(folder, tmp_path, {o: n for n, o in enumerate(keep)})
    new = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert new.get_vocab_size() == len(keep)
    for text in seen:  # the same pieces, renumbered
        assert new.encode(text).tokens == old.encode(text).tokens and new.encode(text).ids != old.encode(text).ids
    rare = [t for t in new.encode("Zygomorphic antidisestablishmentarianism, naïve café!").tokens if t != "[PAD]"]
    assert "[UNK]" not in rare and rare[0] == "[CLS]" and rare[-1] == "[SEP]"
    assert new.encode("x").ids[0] == new.token_to_id("[CLS]") == keep.index(101)


def test_cli_rejects_bad_requests_with_one_line(tmp_path):
    from test_cli import slimml

    r = slimml("convert", "--prune", "1.5", "-o", tmp_path / "a")
    assert r.returncode == 1
    assert "--prune 1.5 is outside (0, 1); give the share of heads and FFN neurons to remove" in r.stderr
    r = slimml("convert", "--distill-layers", "6", "-o", tmp_path / "a")
    assert r.returncode == 1
    assert "--distill-layers 6 is not fewer than the teacher's 6 layers; give 1 to 5." in r.stderr
    r = slimml("convert", "--compare-on", tmp_path / "sts.csv", "-o", tmp_path / "a")
    assert r.returncode == 1
    assert "--compare-on compares a student with its teacher; give --distill-layers N or --prune F with it." in r.stderr
    r = slimml("convert", "--grad-accum", "4", "--checkpointing", "-o", tmp_path / "a")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "--grad-accum, --checkpointing shape distillation; give --distill-layers N or --prune F with it." in r.stderr
    r = slimml("convert", "--distill-layers", "2", "--grad-accum", "-1", "-o", tmp_path / "a")
    assert r.returncode == 1 and "--grad-accum -1 must be a whole number >= 1" in r.stderr
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_default_model_student_three_layers_half_pruned(tmp_path):
    """The real default model: 3 of 6 layers, half the heads and FFN neurons, 30% of the vocabulary."""
    from conftest import STS_TRAIN as data

    config = ConvertConfig(distill=DistillConfig(layers=3, data=data, max_texts=64, max_steps=2),
                           prune=PruneConfig(0.5, importance_batches=1), measure_latency=False)
    report = convert(None, tmp_path / "student", config)
    model = load(report.out)
    m = model.manifest
    assert [s.layers for s in m.shards if s.layers] == [[f"encoder/layer.{i}"] for i in range(3)]
    assert m.steps[0]["kept_teacher_layers"] == [0, 2, 5]
    assert (m.steps[1]["heads_per_layer"], m.steps[1]["ffn_per_layer"], m.steps[1]["vocab_size"]) == (6, 768, 21365)
    assert 40e6 < m.total_bytes < 50e6  # the teacher: 90.9 MB
    assert m.checks["embedding_cosine_vs_torch"] >= 0.9999
    assert model.encode(["A man is playing a guitar."]).shape == (1, 384)


def test_a_student_or_quantized_model_never_lands_on_the_float_default_folder():
    from slimml.convert.pipeline import _default_suffix
    from slimml.quantize import Int8Config, Int8StaticConfig, WeightOnlyConfig

    assert _default_suffix(ConvertConfig(distill=DistillConfig(layers=3), prune=PruneConfig(0.5))) == "-d3-p50"
    assert _default_suffix(ConvertConfig(distill=DistillConfig(layers=3), prune=PruneConfig(0.5),
                                         quantize=Int8Config())) == "-d3-p50"  # the README's student folder
    assert _default_suffix(ConvertConfig(distill=DistillConfig(), prune=PruneConfig(0.3))) == "-p30"
    assert _default_suffix(ConvertConfig(distill=DistillConfig(layers=2))) == "-d2"
    assert _default_suffix(ConvertConfig()) == ""
    assert _default_suffix(ConvertConfig(quantize=Int8Config())) == "-int8"
    assert _default_suffix(ConvertConfig(quantize=Int8Config("cuda"))) == "-int8-weights"
    assert _default_suffix(ConvertConfig(quantize=Int8StaticConfig())) == "-int8-static"
    assert _default_suffix(ConvertConfig(quantize=WeightOnlyConfig(bits=4))) == "-int4-weights"


def test_distill_data_files_as_spreadsheets_write_them(tmp_path):
    """A CSV with Excel's byte-order mark reads its header; a file in another encoding, a folder and a
    broken CSV are refused in one line."""
    rows = "".join(f"sentence {i} about something else\n" for i in range(40))
    (tmp_path / "bom.csv").write_bytes(("text\n" + rows).encode("utf-8-sig"))
    texts, _ = load_texts(tmp_path / "bom.csv")
    assert len(texts) == 40 and texts[0] == "sentence 0 about something else"
    (tmp_path / "bom.txt").write_bytes(rows.encode("utf-8-sig"))
    assert load_texts(tmp_path / "bom.txt")[0][0] == "sentence 0 about something else"
    (tmp_path / "latin.csv").write_bytes(("text\n" + rows + "caf\xe9\n").encode("latin-1"))
    with pytest.raises(DataError, match=r"latin.csv is not UTF-8 text \(byte \d+\); save it as UTF-8"):
        load_texts(tmp_path / "latin.csv")
    with pytest.raises(DataError, match="is a folder; give a file in it"):
        load_texts(tmp_path)
    (tmp_path / "d.tsv").write_text("id\ttext\n" + "".join(f"{i}\tsentence {i}, with a comma\n" for i in range(20)))
    assert load_texts(tmp_path / "d.tsv")[0][:2] == ["sentence 0, with a comma", "sentence 1, with a comma"]
    lines = [{"text": f"a text {i}", "label": 1} for i in range(10)] + [f"a string {i}" for i in range(10)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n")
    assert load_texts(tmp_path / "d.jsonl")[0] == [f"a text {i}" for i in range(10)] + [f"a string {i}" for i in range(10)]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"label": 1}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2 has no text field"):
        load_texts(tmp_path / "bad.jsonl")


def test_a_decoder_optimum_does_not_know_is_distilled_from_its_fused_graph(tmp_path):
    """optimum-onnx writes the teacher's cache-free graph; for an architecture it does not know
    (Mixtral) the distillation failed with "neither of slimml's exporters writes a 'mixtral' model"
    while the fused exporter writes it (as it did already where optimum-onnx does not load)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from slimml.convert.distill.teacher import teacher_export
    from slimml.convert.export import _optimum_loads

    small = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)  # heads of 16: GroupQueryAttention's least
    MixtralForCausalLM(MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)).save_pretrained(tmp_path / "mixtral")
    LlamaForCausalLM(LlamaConfig(**small)).save_pretrained(tmp_path / "llama")
    assert teacher_export(tmp_path / "mixtral").exporter == "fused"
    assert teacher_export(tmp_path / "llama").exporter == ("fused" if _optimum_loads() else "auto")


def test_a_model_that_shares_its_layers_is_refused_before_its_teacher_is_converted(tmp_path):
    """ALBERT runs every layer on one group's weights: --distill-layers converted the teacher, then
    blamed the checkpoint ("lacks encoder.albert_layer_groups.0...: re-save or re-download the
    model") and left the teacher's files (86 MB at hidden 64) beside the output."""
    from transformers import AlbertConfig, AlbertModel

    AlbertModel(AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=2, intermediate_size=64)).save_pretrained(tmp_path / "albert")
    with pytest.raises(ConfigError, match=r"shares its layers' weights \(2 layers run 1 group\(s\).* leave "
                                          r"--distill-layers out"):
        convert(tmp_path / "albert", tmp_path / "out" / "a", ConvertConfig(distill=DistillConfig(layers=1)))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_sentence_transformers_5_folder_is_distilled_within_its_max_seq_length(tmp_path):
    """sentence-transformers 5 saves max_seq_length as the tokenizer's model_max_length, not in
    sentence_bert_config.json: the student was trained on texts cut at 128 tokens, and a teacher
    without a position table (DeBERTa-v3), which reads 64, refused them ("takes at most 64 tokens")."""
    pytest.importorskip("sentence_transformers")
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer
    from transformers import AutoTokenizer, DebertaV2Config, DebertaV2Model

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    DebertaV2Model(DebertaV2Config(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=128, type_vocab_size=0,
                                   relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=32,
                                   position_biased_input=False, norm_rel_ebd="layer_norm", share_att_key=True)) \
        .save_pretrained(tmp_path / "enc")
    tok.save_pretrained(tmp_path / "enc")
    module = Transformer(str(tmp_path / "enc"), max_seq_length=16)
    SentenceTransformer(modules=[module, Pooling(32, pooling_mode="mean")], device="cpu").save(str(tmp_path / "st"))
    long = tmp_path / "long.txt"  # texts past 16 tokens
    long.write_text("\n".join(f"text {i} " + "a man plays a guitar in the park " * 4 for i in range(40)) + "\n")
    report = convert(tmp_path / "st", tmp_path / "art", ConvertConfig(
        distill=DistillConfig(layers=1, data=long, epochs=0.02), measure_latency=False))
    assert load(report.out).manifest.tokenizer["max_length"] == 16


def test_a_folder_whose_length_setting_is_past_its_position_table_is_distilled_within_the_table(tmp_path):
    """max_seq_length 256 (copied from another model's folder) over 64 positions: the teacher was fed
    90-token rows and convert ended in the runtime's feed error. A plain convert of it worked."""
    import shutil

    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    src, folder = default_model_dir(), tmp_path / "st64"
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=64)).eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(folder)
    for name in ("modules.json", "sentence_bert_config.json"):  # max_seq_length 256
        shutil.copy2(src / name, folder / name)
    (folder / "1_Pooling").mkdir()
    shutil.copy2(src / "1_Pooling" / "config.json", folder / "1_Pooling" / "config.json")
    long = tmp_path / "long.txt"  # texts past 64 tokens
    long.write_text("\n".join(f"text {i} " + "a man plays a guitar in the park " * 12 for i in range(40)) + "\n")
    report = convert(folder, tmp_path / "art", ConvertConfig(distill=DistillConfig(layers=1, data=long, epochs=0.02),
                                                             measure_latency=False))
    assert load(report.out).encode(["a man plays a guitar in the park " * 20]).shape == (1, 32)


# -- the distill/prune journey: refusals before any work, progress off a terminal, what the report says --------


def _sts(tmp_path):
    from conftest import STS_DEV

    sts = tmp_path / "sts.csv"
    sts.write_text("".join(STS_DEV.read_text(encoding="utf-8").splitlines(keepends=True)[:41]), encoding="utf-8")
    return sts


@pytest.mark.parametrize("which, said", [
    ("classifier", "a text-classification model (BertForSequenceClassification)"),
    ("decoder", "a text-generation model (LlamaForCausalLM)"),
])
def test_compare_on_a_model_that_is_not_a_sentence_embedder_is_refused_before_any_work(
        which, said, tiny_classifier_dir, tiny_decoder_dir, texts_file, tmp_path):
    """--compare-on scores sentence embeddings: on a classifier or a language model it failed only after all
    the training, with "the artifact /tmp/x/.out.teacher cannot encode(): ... use generate(prompts)"."""
    folder = tiny_classifier_dir if which == "classifier" else tiny_decoder_dir
    stages = []
    with pytest.raises(ConfigError) as e:
        convert(folder, tmp_path / "out" / "art", ConvertConfig(
            distill=DistillConfig(layers=2, data=texts_file, max_steps=1, batch_size=8), compare_on=_sts(tmp_path),
            measure_latency=False), on_step=stages.append)
    assert str(e.value) == (f"--compare-on scores sentence embeddings on an STS file; {folder.name} is {said}, not a "
                            "sentence embedder: leave --compare-on out.")
    assert "converting the teacher" not in stages
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_convert_progress_off_a_terminal_prints_plain_lines(monkeypatch):
    """Off a terminal (a log file, CI) the rich bar drew nothing: a 20-minute distillation printed nothing
    until its table. Now each stage's name, and about every tenth of the training a line with the step,
    loss, seconds a step and what is left."""
    import io

    from rich.console import Console

    import slimml.cli.convert as cli

    out = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=out, force_terminal=False, width=300))

    def fake_convert(source, dest, config, on_step, on_progress):
        on_step("converting the teacher")
        on_step("running the teacher")
        for i in range(0, 401, 40):
            on_progress(i, 400, None)
        on_step("training the student")
        for i in range(1, 101):
            on_progress(i, 100, 1.0 / i)
        on_step("exporting to ONNX")
        return "report"

    assert cli._convert_with_progress(fake_convert, None, None, None) == "report"
    lines = out.getvalue().splitlines()
    for stage in ("converting the teacher...", "running the teacher...", "training the student...",
                  "exporting to ONNX..."):
        assert stage in lines
    steps = [line for line in lines if line.startswith("training: step ")]
    assert 10 <= len(steps) <= 11 and steps[-1].startswith("training: step 100/100, loss 0.01, ")
    assert all(" s/step, " in line and line.endswith(" s left") for line in steps[:-1])
    assert len([line for line in lines if line.startswith("teacher pass: ")]) <= 11


def test_plain_progress_prints_every_30_seconds_on_slow_steps():
    import slimml.cli.convert as cli

    lines, now = [], [0.0]
    shown = cli._PlainProgress(lines.append, clock=lambda: now[0])
    shown.on_step("training the student")
    for i in range(1, 1001):  # 1,000 steps of 1 s: a tenth is 100 s, so 30 s comes first (30, 60, 90, 100, 130, ...)
        now[0] += 1.0
        shown.on_progress(i, 1000, 0.5)
    steps = [line for line in lines if line.startswith("training: step ")]
    assert len(steps) == 40 and steps[3].startswith("training: step 100/1000, ")
    assert steps[0] == "training: step 30/1000, loss 0.5, 1.00 s/step, 16 min 10 s left"


def test_ctrl_c_during_a_distillation_says_how_to_resume_or_give_up(tiny_bert_dir, texts_file, tmp_path, monkeypatch):
    """Ctrl-C in a distillation said "nothing half-written is left." while the checkpoint, the teacher's
    artifact and its cache (180 MB for MiniLM) stayed beside the output, for the next run to resume from."""
    import signal

    import slimml.cli.entry as entry
    from slimml.runtime.artifact import atomic

    def stop_at_step_2(done, total, loss):
        if loss is not None and done == 2:
            raise KeyboardInterrupt

    out = tmp_path / "art"
    config = ConvertConfig(distill=DistillConfig(layers=1, data=texts_file, max_steps=3, batch_size=8, checkpoint_every=1,
                                                 mixed_precision="off"), measure_latency=False)
    with pytest.raises(KeyboardInterrupt) as e:
        convert(tiny_bert_dir, out, config, on_progress=stop_at_step_2)
    left = [p.name for p in e.value.resume_files]
    assert e.value.resume_out == out
    assert left == [".art.distill-checkpoint.pt", ".art.teacher-cache", ".art.teacher", ".art.teacher.source"]
    assert all((tmp_path / name).exists() for name in left) and not out.exists()

    def stopped(*args, **kw):  # the command line's convert, stopped as that one was
        atomic.stop_asked(signal.SIGINT)
        raise e.value

    said = []
    monkeypatch.setattr(atomic, "_stop_asked", [])
    monkeypatch.setattr("slimml.convert.pipeline.convert", stopped)
    monkeypatch.setattr("sys.argv", ["slimml", "convert", str(tiny_bert_dir), "--distill-layers", "1", "-o", str(out)])
    monkeypatch.setattr(entry.err, "print", lambda text, **kw: said.append(str(text)))
    with pytest.raises(SystemExit) as stop:
        entry.main()
    assert stop.value.code == 130
    assert said == [f"stopped (SIGINT); {out} was not written. Run the same command again to resume from the checkpoint, "
                    f"or delete {', '.join(left)} in {tmp_path} to give up."]
    out.mkdir()  # an earlier artifact there stays
    assert entry._stopped("SIGTERM", (out, e.value.resume_files)).startswith(
        f"stopped (SIGTERM); {out} was not written (the artifact there is the earlier one). Run the same command ")


def _report(steps):
    from slimml.convert.pipeline import ConvertReport

    return ConvertReport(out=__import__("pathlib").Path("art"), name="m", task="sentence-embedding", shards=2,
                         size_mb=1.0, checks={}, seconds=3.0, steps=steps)


def _step(**training):
    """A prune step record as the manifest has it (a student of the whole teacher, pruned)."""
    return {"step": "prune", "heads_per_layer": 6, "heads_removed": 0.5, "ffn_per_layer": 768, "vocab_size": 21365,
            "student_params": 8.9e6, "steps": 8, "final_loss": 0.01234, "resumed_at_step": 0,
            "teacher_pass": {"from_cache": True, "batches": 0, "batch_texts": 0, "seconds": 0.1, "peak_rss_mb": 900.0,
                             "cache_mb": 1.0, "teacher_passes_saved": 2, "rebuilt_because": None},
            "training": {"precision": "off", "grad_accum": 1, "effective_batch": 32, "checkpointing": False,
                         "train_seconds": 12.5, "peak_rss_mb": 1000.0, "heldout_texts": 40, "heldout_loss_start": -0.0,
                         "heldout_loss_pruned": 4.3621, "heldout_loss_end": 1.14213, **training}}


def _rows(monkeypatch, report) -> dict[str, str]:
    """The convert command's table, row name -> text, for a report (the conversion itself faked)."""
    import io

    from rich.console import Console
    from typer.testing import CliRunner

    import slimml.cli.convert as cli
    import slimml.convert.pipeline as pipeline
    from slimml.cli.common import app

    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=400))
    monkeypatch.setattr(cli, "err", Console(file=io.StringIO(), width=400))
    monkeypatch.setattr(pipeline, "convert", lambda *a, **kw: report)
    r = CliRunner().invoke(app, ["convert", "--prune", "0.5"])
    assert r.exit_code == 0, r.output
    rows = {}
    for line in out.getvalue().splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def test_the_heldout_row_shows_what_pruning_did_and_never_minus_zero(monkeypatch):
    rows = _rows(monkeypatch, _report([_step()]))
    assert rows["held-out loss"] == "0 -> 4.362 (pruned) -> 1.142 (40 texts kept out of training)"
    rows = _rows(monkeypatch, _report([_step(heldout_texts=0, heldout_loss_start=None, heldout_loss_pruned=None,
                                             heldout_loss_end=None)]))
    assert rows["held-out loss"] == "none (fewer than 80 texts: none kept out of training)"


def test_the_training_row_names_the_precision_the_whole_time_and_the_final_loss(monkeypatch):
    rows = _rows(monkeypatch, _report([_step()]))
    assert rows["training"] == ("fp32, 8 steps, batch 32 (accumulate 1), checkpointing off, 12.5 s, final loss 0.01234, "
                                "peak RSS 1000 MB")
    assert _rows(monkeypatch, _report([_step(precision="bf16")]))["training"].startswith("bf16, 8 steps, ")
    assert rows["prune"] == "6 heads a layer (50% removed), 768 FFN neurons a layer, vocabulary 21365: 8.9M params"


def test_a_resumed_run_says_where_it_resumed(monkeypatch):
    rows = _rows(monkeypatch, _report([dict(_step(), resumed_at_step=6)]))
    assert rows["training"].startswith("fp32, 8 steps, resumed at step 6 of 8, batch 32 ")


def test_training_seconds_cover_the_epoch_before_pruning_too(tiny_bert_dir, texts_file, tmp_path, monkeypatch):
    """With --distill-layers and --prune, the training row's seconds were only the steps after pruning."""
    from slimml.convert.distill import distill_train

    train, took = distill_train.Trainer.train, []

    def timed(self, *a, **kw):
        result = train(self, *a, **kw)
        result["seconds"] = 10.0 * (len(took) + 1)  # 10 s, then 20 s
        took.append(result["seconds"])
        return result

    monkeypatch.setattr(distill_train.Trainer, "train", timed)
    steps = shrink(tiny_bert_dir, tmp_path / "s", DistillConfig(layers=1, data=texts_file, max_steps=2, batch_size=8,
                                                                mixed_precision="off"), PruneConfig(0.5, importance_batches=1))
    assert took == [10.0, 20.0] and steps[0]["training"]["train_seconds"] == 30.0
    assert steps[0]["training"]["precision"] == "off"


def test_compare_on_the_distillation_data_is_warned(texts_file, tmp_path, caplog):
    from slimml.convert.pipeline import _check_inputs

    sts = _sts(tmp_path)
    with caplog.at_level("WARNING", logger="slimml"):
        _check_inputs(ConvertConfig(distill=DistillConfig(layers=1, data=texts_file), compare_on=sts))
    assert not caplog.records
    with caplog.at_level("WARNING", logger="slimml"):
        _check_inputs(ConvertConfig(distill=DistillConfig(layers=1, data=str(tmp_path / "." / "sts.csv")), compare_on=sts))
    assert [r.getMessage() for r in caplog.records] == [
        f"slimml: --compare-on {sts} is the --distill-data file: the student trained on those texts, so its score "
        "there flatters it; compare on an STS file kept out of training."]


def test_grouped_query_pruning_removes_at_least_the_share_asked_and_says_what_it_removed(tiny_decoder_dir, texts_file,
                                                                                        caplog):
    """SmolLM2 (3 key-value groups) at --prune 0.5 kept 2 of 3 groups, and a 1-group Llama at --prune 0.3 kept
    all its heads, while the manifest said heads: true."""
    from types import SimpleNamespace

    from slimml.convert.distill import prune as pr
    from slimml.convert.distill.distill import check

    smol = SimpleNamespace(model_type="llama", num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    assert pr.kept_counts(smol, PruneConfig(0.5)) == (1, 768)
    assert pr.kept_counts(smol, PruneConfig(0.3)) == (2, round(1536 * 0.7))
    bert = SimpleNamespace(model_type="bert", num_attention_heads=12, intermediate_size=1536)
    assert pr.kept_counts(bert, PruneConfig(0.5))[0] == 6 and pr.kept_counts(bert, PruneConfig(0.3))[0] == 8
    one = SimpleNamespace(model_type="llama", num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    assert pr.kept_counts(one, PruneConfig(0.3))[0] == 1
    with caplog.at_level("WARNING", logger="slimml"):
        check(tiny_decoder_dir, DistillConfig(data=texts_file), PruneConfig(0.3))
    assert [r.getMessage() for r in caplog.records] == [
        "slimml: --prune 0.3 removes 0% of the attention heads, not 30%: this model has 1 key-value group(s) of 2 "
        "query heads, pruning removes whole groups, and every layer keeps one; the FFN neurons lose 30%."]


def test_a_batch_of_one_is_refused_naming_the_flag():
    with pytest.raises(ConfigError) as e:
        DistillConfig(layers=1, batch_size=1)
    assert str(e.value) == ("--distill-batch-size 1 must be >= 2 (the in-batch similarity and the held-out loss compare "
                            "texts within a batch).")
