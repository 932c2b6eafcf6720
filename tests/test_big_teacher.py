"""Teachers bigger than memory: layer-by-layer export, the teacher through the runtime with its outputs
cached on disk, decoder pruning, and the small-hardware training flags, on tiny real models."""

from __future__ import annotations

import json

import numpy as np
import pytest

from slimml.convert import ConvertConfig, ExportConfig, convert
from slimml.convert.distill import DistillConfig, shrink
from slimml.convert.distill.prune import PruneConfig
from slimml.convert.distill.teacher import check_budget, teacher_outputs
from slimml.convert.export import _optimum_loads
from slimml.errors import ConfigError
from slimml.runtime import load
from conftest import STS_TRAIN

# The layer-wise teacher (an optimum-onnx template) and this file's head-size-8 Llama, which the fused
# exporter does not write, need optimum-onnx, which transformers 5 does not load.
needs_optimum = pytest.mark.skipif(_optimum_loads() is not None, reason="needs optimum-onnx (transformers 4.57)")


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory):
    lines = [line.split(",")[0] for line in STS_TRAIN.read_text(encoding="utf-8").splitlines()[1:121]]
    path = tmp_path_factory.mktemp("texts") / "texts.txt"
    path.write_text("\n".join(dict.fromkeys(lines)) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A 5-layer Llama causal LM with grouped-query attention (4 heads, 2 KV groups), random weights, a tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama5")
    config = LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # trained-looking norms: a wrong layer's weights would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def teacher_artifact(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher") / "art"
    convert(llama_dir, out, ConvertConfig(export=ExportConfig(exporter="layerwise"), measure_latency=False))
    return out


def _feeds(texts=("A man is playing a guitar.", "Short.")):
    from transformers import AutoTokenizer

    from slimml.convert.sources import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    enc = tok(list(texts), padding=True, return_tensors="np")
    mask = enc["attention_mask"].astype(np.int64)
    return {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": mask,
            "position_ids": np.clip(mask.cumsum(1) - 1, 0, None)}


@needs_optimum
def test_layerwise_export_matches_torch_and_the_whole_model_export(llama_dir, teacher_artifact, tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    manifest = json.loads((teacher_artifact / "manifest.json").read_text())
    assert manifest["steps"][0]["exporter"] == "layerwise (optimum-onnx template)"
    assert manifest["checks"]["max_abs_diff_vs_torch"] < 1e-4 and manifest["checks"]["reference"] == "torch, layer by layer"
    assert len(manifest["shards"]) == 5 + 2  # embeddings, five layers, head
    whole = convert(llama_dir, tmp_path / "whole", ConvertConfig(export=ExportConfig(exporter="optimum", task="text-generation"),
                                                                 measure_latency=False))
    feeds = _feeds()
    ours = load(teacher_artifact).run(feeds)["logits"]
    np.testing.assert_array_equal(ours, load(whole.out).run(feeds)["logits"])
    ref = LlamaForCausalLM.from_pretrained(llama_dir).eval()
    with torch.no_grad():
        want = ref(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
    mask = feeds["attention_mask"].astype(bool)
    assert np.abs(ours - want)[mask].max() < 1e-4


@needs_optimum
def test_teacher_outputs_are_cached_reused_and_rebuilt_when_stale(teacher_artifact, tmp_path):
    ids = [[101, 2000 + i, 2001 + i, 102][: 2 + i % 3] for i in range(40)]
    cache = tmp_path / "cache"
    first = teacher_outputs(teacher_artifact, "lm-kl", ids, 0, cache, "8MB", top_k=8)
    assert first.stats["computed"] and first.rebuilt is None
    assert first.arrays["top_ids"].shape == (sum(len(s) for s in ids), 8)
    again = teacher_outputs(teacher_artifact, "lm-kl", ids, 0, cache, None, top_k=8)
    assert not again.stats["computed"] and again.sha256 == first.sha256
    # the cached top-k and log-sum-exp are the teacher's own: compare one text with a direct run
    model = load(teacher_artifact)
    logits = model.run({"input_ids": np.array([ids[5]]), "attention_mask": np.ones((1, len(ids[5])), np.int64),
                        "position_ids": np.arange(len(ids[5]))[None]})["logits"][0]
    rows = again.rows([5])
    np.testing.assert_allclose(np.sort(rows["top_values"][0], axis=1)[:, ::-1], -np.sort(-logits, axis=1)[:, :8], atol=1e-5)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    np.testing.assert_allclose(rows["lse"][0], lse, atol=1e-5)
    other = teacher_outputs(teacher_artifact, "lm-kl", ids[:-1], 0, cache, None, top_k=8)  # other data
    assert other.rebuilt == "it was made for another teacher or other data" and other.stats["computed"]
    with open(cache / "lse.npy", "r+b") as f:  # damaged on disk
        f.seek(-4, 2)
        f.write(b"\x00\x00\x80\x7f")
    fixed = teacher_outputs(teacher_artifact, "lm-kl", ids[:-1], 0, cache, None, top_k=8)
    assert fixed.rebuilt == "its files do not match their sha256 (changed or damaged)" and fixed.sha256 == other.sha256


@needs_optimum
def test_a_killed_teacher_pass_resumes_where_it_stopped(teacher_artifact, tmp_path):
    ids = [[101, 3000 + i, 102] for i in range(64)]
    whole = teacher_outputs(teacher_artifact, "lm-kl", ids, 0, tmp_path / "whole", None, top_k=4)

    def kill(done, total):
        if done >= 16:
            raise KeyboardInterrupt

    cache = tmp_path / "killed"
    from slimml.convert.distill import teacher as teacher_mod

    small = teacher_mod.MAX_BATCH
    teacher_mod.MAX_BATCH = 8  # several batches, so the kill lands between two
    try:
        with pytest.raises(KeyboardInterrupt):
            teacher_outputs(teacher_artifact, "lm-kl", ids, 0, cache, None, top_k=4, progress=kill)
    finally:
        teacher_mod.MAX_BATCH = small
    assert json.loads((cache / "meta.json").read_text())["done"] == 16
    seen = []
    resumed = teacher_outputs(teacher_artifact, "lm-kl", ids, 0, cache, None, top_k=4, progress=lambda d, t: seen.append(d))
    assert seen[0] > 16 and resumed.sha256 == whole.sha256


@needs_optimum
def test_a_budget_below_the_largest_teacher_shard_is_refused_before_training(teacher_artifact, llama_dir, texts_file, tmp_path):
    with pytest.raises(ConfigError) as e:
        check_budget(teacher_artifact, "10KB")
    assert str(e.value).startswith("--teacher-memory-budget 10.00 KB is smaller than the teacher's largest shard (shard_")
    with pytest.raises(ConfigError, match="smaller than the teacher's largest shard"):
        shrink(llama_dir, tmp_path / "s", DistillConfig(layers=2, data=texts_file, teacher_memory_budget="10KB"),
               teacher_artifact=teacher_artifact, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "s").exists() and not (tmp_path / "cache").exists()


@needs_optimum
def test_decoder_distilled_with_a_streamed_teacher_learns_and_accumulates(llama_dir, teacher_artifact, texts_file, tmp_path):
    config = DistillConfig(layers=2, data=texts_file, batch_size=8, grad_accum=2, epochs=3, lr=3e-3,
                           teacher_memory_budget="8MB", mixed_precision="off", checkpointing=True)
    steps = shrink(llama_dir, tmp_path / "student", config, teacher_artifact=teacher_artifact, cache_dir=tmp_path / "c")
    d = steps[0]
    assert d["objective"] == "lm-kl" and d["kept_teacher_layers"] == [0, 4]
    tr = d["training"]
    assert tr["effective_batch"] == 16 and tr["checkpointing"] and tr["precision"] == "off"
    train_texts = d["texts"] - tr["heldout_texts"]
    assert d["steps"] == 3 * -(-(-(-train_texts // 8)) // 2)  # ceil(texts / 8) batches, two per step
    assert tr["heldout_loss_end"] < 0.5 * tr["heldout_loss_start"]
    assert d["teacher_pass"]["budget"] == "8MB" and d["teacher_pass"]["teacher_passes_saved"] == 2.0


def test_student_starts_from_the_teachers_own_layers_read_tensor_by_tensor(llama_dir):
    import torch
    from transformers import LlamaForCausalLM

    from slimml.convert.distill.distill_train import build_student

    student = build_student(llama_dir, "LlamaForCausalLM", [0, 3, 4])
    teacher = LlamaForCausalLM.from_pretrained(llama_dir)
    for i, t in enumerate([0, 3, 4]):
        for (n, p), (_, q) in zip(student.model.layers[i].named_parameters(), teacher.model.layers[t].named_parameters()):
            assert torch.equal(p, q), n
    assert torch.equal(student.lm_head.weight, teacher.lm_head.weight)


@needs_optimum
def test_llama_pruning_removes_whole_kv_groups_and_neurons_and_matches_torch(llama_dir, texts_file, tmp_path):
    report = convert(llama_dir, tmp_path / "pruned", ConvertConfig(
        distill=DistillConfig(data=texts_file, max_steps=2, batch_size=8), prune=PruneConfig(0.5, importance_batches=2),
        measure_latency=False))
    prune = next(s for s in report.steps if s["step"] == "prune")
    assert prune["heads_per_layer"] == 2 and prune["kv_heads_per_layer"] == 1 and prune["ffn_per_layer"] == 32
    assert report.checks["max_abs_diff_vs_torch"] < 1e-4 and report.checks["max_abs_diff"] < 1e-5
    config = json.loads((tmp_path / "pruned" / "manifest.json").read_text())["source"]
    assert config["model_type"] == "llama"
    assert not list(tmp_path.glob(".pruned.*"))  # checkpoint, cache and teacher artifact removed


@pytest.fixture(scope="module")
def llama16_dir(tmp_path_factory):
    """A 2-layer Llama whose head size (16) the fused exporter writes: 4 heads, 2 KV groups, a tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama16")
    config = LlamaConfig(vocab_size=30522, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(folder)
    return folder


def test_a_fused_teacher_gives_every_positions_logits_of_right_padded_texts(llama16_dir, tmp_path):
    """Where optimum-onnx does not load (transformers 5), a decoder's teacher is its fused graph, run
    from an empty cache with every position in ``logits_index``: each text's logits equal torch's."""
    import torch
    from transformers import LlamaForCausalLM

    from slimml.convert.distill.teacher import _feeds

    art = convert(llama16_dir, tmp_path / "t", ConvertConfig(
        export=ExportConfig(exporter="fused", task="text-generation-with-past"), verify=False, measure_latency=False)).out
    model = load(art)
    ids = [[101, 2023, 2003, 1037, 3231, 102], [101, 2460, 102]]
    got = model.run(_feeds(model.inputs, ids, pad_id=0))["logits"]
    ref = LlamaForCausalLM.from_pretrained(llama16_dir).eval()
    for row, text in enumerate(ids):
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([text])).logits[0].numpy()
        np.testing.assert_allclose(got[row, :len(text)], want, rtol=0, atol=1e-4)


def test_llama_pruned_with_any_transformers_exports_fused_and_matches_torch(llama16_dir, texts_file, tmp_path):
    """A Llama the fused exporter writes is pruned and converted under transformers 4.57 and 5 alike:
    the student is the fused decoder, checked against the pruned model itself."""
    report = convert(llama16_dir, tmp_path / "pruned", ConvertConfig(
        distill=DistillConfig(data=texts_file, max_steps=2, batch_size=8), prune=PruneConfig(0.5, importance_batches=2),
        measure_latency=False))
    prune = next(s for s in report.steps if s["step"] == "prune")
    assert prune["heads_per_layer"] == 2 and prune["kv_heads_per_layer"] == 1 and prune["ffn_per_layer"] == 32
    assert next(s for s in report.steps if s["step"] == "export")["exporter"].startswith("fused")
    assert report.checks["max_abs_diff_vs_torch"] < 1e-4
    assert abs(report.checks["perplexity_rel_diff"]) < 1e-3 and report.checks["top1_agreement"] > 0.99


def test_mixed_precision_the_device_cannot_do_is_refused(monkeypatch):
    from slimml.convert.distill import precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)  # a CPU without AMX or AVX512-BF16
    with pytest.raises(ConfigError) as e:
        precision.check("bf16", "cpu")
    assert str(e.value) == ("--mixed-precision bf16: this CPU has no native bf16 (AMX or AVX512-BF16), so bf16 would be "
                            "emulated and slower than fp32; use --mixed-precision off (or auto).")
    assert precision.candidates("cpu") == ["off"]  # auto does not even try it there


def test_a_convert_killed_in_export_resumes_from_the_finished_student(tiny_bert_dir, texts_file, tmp_path):
    config = lambda: ConvertConfig(distill=DistillConfig(layers=1, data=texts_file, max_steps=3, batch_size=8,  # noqa: E731
                                                         mixed_precision="off"), measure_latency=False)

    def kill_at_export(msg):
        if msg.startswith("exporting"):
            raise KeyboardInterrupt

    out = tmp_path / "student"
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_bert_dir, out, config(), on_step=kill_at_export)
    assert not out.exists() and (tmp_path / ".student.distill-checkpoint.pt").is_file()
    resumed = convert(tiny_bert_dir, out, config())
    distill = next(s for s in resumed.steps if s["step"] == "distill")
    assert distill["resumed_at_step"] == distill["steps"] == 3  # trained by the killed run, not again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]  # checkpoint, cache, teacher: gone
    whole = convert(tiny_bert_dir, tmp_path / "whole", config())
    shards = lambda r: {f["path"]: f["sha256"] for f in json.loads((r.out / "manifest.json").read_text())["files"]}  # noqa: E731
    assert shards(resumed) == shards(whole)


@needs_optimum
def test_a_student_whose_training_state_cannot_fit_is_refused_before_it_is_built(llama_dir, teacher_artifact, texts_file,
                                                                                 tmp_path, monkeypatch):
    from slimml.runtime.engine import budget

    monkeypatch.setattr(budget, "available_memory", lambda: 2_000_000)  # a machine with 2 MB to spare
    with pytest.raises(ConfigError) as e:
        shrink(llama_dir, tmp_path / "s", DistillConfig(layers=2, data=texts_file), teacher_artifact=teacher_artifact,
               cache_dir=tmp_path / "cache")
    assert str(e.value).startswith("the student's training state (fp32 weights, gradients and AdamW moments of 2M "
                                   "parameters: 19.83 MB) does not fit in the 2.00 MB available.")
    assert "DeepSpeed ZeRO-Offload" in str(e.value) and not (tmp_path / "s").exists()
    assert not (tmp_path / "cache").exists()  # refused before the teacher ran


def test_layerwise_export_refuses_what_it_cannot_export(tiny_bert_dir, mlp_onnx, tmp_path):
    from slimml.errors import SourceError

    config = ConvertConfig(export=ExportConfig(exporter="layerwise"))
    with pytest.raises(ConfigError) as e:
        convert(tiny_bert_dir, tmp_path / "a", config)
    assert str(e.value).startswith("--exporter layerwise exports Llama-family causal LMs with safetensors weights and "
                                   "3 layers or more;")
    with pytest.raises(SourceError, match="--exporter layerwise exports Hugging Face model folders"):
        convert(mlp_onnx, tmp_path / "b", config)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_teacher_passes_saved_is_never_negative():
    """Under one epoch the cache was filled for the whole data and read for part of it: none saved (was -0.5)."""
    from slimml.convert.distill.distill import _passes_saved

    assert _passes_saved(0.5, 0.0, True) == 0.0 and _passes_saved(3, 0, True) == 2.0 and _passes_saved(0.5, 0, False) == 0.5


@needs_optimum
def test_a_tied_lm_heads_transposed_table_is_not_read_as_the_vocabulary(tmp_path):
    """Layer by layer, a model whose lm_head is its embedding table (SmolLM2) holds the table's
    transposed copy (hidden, vocab) in the head's shard: its 64 rows were taken for the vocabulary,
    and the convert's own check refused every id past 63. Only a table a Gather reads counts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=True)).eval().save_pretrained(tmp_path / "tied")
    report = convert(tmp_path / "tied", tmp_path / "art", ConvertConfig(export=ExportConfig(exporter="layerwise"),
                                                                        measure_latency=False))
    model = load(report.out)
    assert model.vocab_size == 512
    ids = np.array([[5, 300, 511]], np.int64)
    assert model.run({"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(3)[None]})[
        "logits"].shape == (1, 3, 512)
