"""Cross-encoders and classifier scores: a model with one output (a reranker) scores each input
by the sigmoid of its logit, as transformers' pipeline and sentence-transformers' ``CrossEncoder``
do (a softmax over one label was 1 for every input); a multi-label model by each label's sigmoid;
pairs of texts are read together; ``rerank(query, documents)`` ranks as ``CrossEncoder.rank``, in
process and over ``POST /v1/rerank`` (Jina's, Cohere's and vLLM's shape)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from slimml.convert import ConvertConfig, convert
from slimml.errors import FeedError, TaskError
from slimml.runtime import load

QUERY = "what is an open format for models"
DOCS = ["ONNX is an open format for machine learning models.", "Cats sleep most of the day.",
        "The weather is cold in Oslo today.", "Models can be exported to an open format."]


def _classifier(folder: Path, labels: int, problem_type: str | None = None) -> Path:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(labels)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=128, num_labels=labels, problem_type=problem_type)
    BertForSequenceClassification(config).eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny BERT cross-encoder (one output, random weights) and its artifact."""
    src = _classifier(tmp_path_factory.mktemp("ce") / "src", 1)
    convert(src, src.parent / "art", ConvertConfig(measure_latency=False))
    return src, src.parent / "art"


def test_a_cross_encoder_scores_pairs_as_sentence_transformers_does(reranker):
    """Each (query, document) pair is tokenized as one pair (token types and all) and scored by
    the sigmoid of the model's one output: ``classify`` and ``rerank`` give sentence-transformers'
    ``CrossEncoder.predict`` and ``rank``."""
    from sentence_transformers import CrossEncoder

    src, art = reranker
    model, library = load(art), CrossEncoder(str(src), device="cpu")
    want = library.predict([(QUERY, d) for d in DOCS])
    got = [r[0]["score"] for r in model.classify([[QUERY, d] for d in DOCS])]
    np.testing.assert_allclose(got, want, atol=1e-5)
    ranked = model.rerank(QUERY, DOCS)
    assert [r["index"] for r in ranked] == [r["corpus_id"] for r in library.rank(QUERY, DOCS)]
    np.testing.assert_allclose([r["score"] for r in ranked], sorted(want, reverse=True), atol=1e-5)
    assert [r["index"] for r in model.rerank(QUERY, DOCS, top_n=2)] == [r["index"] for r in ranked[:2]]


@pytest.mark.parametrize("labels, problem_type, sums_to_one", [(3, None, True), (3, "multi_label_classification", False),
                                                              (1, "regression", False)])
def test_a_classifier_s_scores_are_its_softmax_or_for_multi_label_each_sigmoid(tmp_path, labels, problem_type, sums_to_one):
    """A single-label classifier's scores are the softmax over its labels; a multi-label one's are
    each label's sigmoid, a regression's its value (read from the config's ``problem_type``), as
    transformers' pipeline has them; a model of several outputs does not rerank."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    src = _classifier(tmp_path / "src", labels, problem_type)
    convert(src, tmp_path / "art", ConvertConfig(measure_latency=False))
    model = load(tmp_path / "art")
    got = model.classify(DOCS[:2], top_k=None)
    tok = AutoTokenizer.from_pretrained(str(src))
    with torch.no_grad():
        logits = AutoModelForSequenceClassification.from_pretrained(str(src)).eval()(**tok(DOCS[:2], padding=True,
                                                                                       return_tensors="pt")).logits
    want = torch.softmax(logits, -1) if sums_to_one else logits if problem_type == "regression" else torch.sigmoid(logits)
    for row, scores in zip(got, want.numpy()):
        np.testing.assert_allclose([s["score"] for s in sorted(row, key=lambda s: s["label"])], scores, atol=1e-5)
    assert (abs(sum(s["score"] for s in got[0]) - 1) < 1e-6) == sums_to_one
    if labels > 1:
        assert not model.supports("rerank")
        with pytest.raises(TaskError, match="rerank"):
            model.rerank(QUERY, DOCS)


def test_a_cross_encoder_whose_config_names_identity_ranks_by_its_logits(reranker, tmp_path):
    """A CrossEncoder saved with ``activation_fn`` Identity (as the ms-marco rerankers are) ranks
    by the logit itself, as sentence-transformers reads that config; ``classify`` keeps
    transformers' sigmoid."""
    import json
    import shutil

    from sentence_transformers import CrossEncoder

    src = shutil.copytree(reranker[0], tmp_path / "identity")
    config = json.loads((src / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (src / "config.json").write_text(json.dumps(config))
    convert(src, tmp_path / "art", ConvertConfig(measure_latency=False))
    ranked = load(tmp_path / "art").rerank(QUERY, DOCS)
    want = CrossEncoder(str(src), device="cpu").rank(QUERY, DOCS)
    assert [r["index"] for r in ranked] == [w["corpus_id"] for w in want]
    np.testing.assert_allclose([r["score"] for r in ranked], [float(w["score"]) for w in want], atol=1e-5)
    sigmoid = {r["index"]: r["score"] for r in load(reranker[1]).rerank(QUERY, DOCS)}  # the same weights, the default
    np.testing.assert_allclose([1 / (1 + np.exp(-r["score"])) for r in ranked], [sigmoid[r["index"]] for r in ranked], atol=1e-6)


@pytest.mark.parametrize("args, words", [
    (("", DOCS), "query as a non-empty text"), ((QUERY, "one text"), "non-empty list of texts"),
    ((QUERY, [QUERY, 3]), r"documents\[1\] must be a text, got int"), ((QUERY, DOCS, 0), "top_n must be"),
    ((QUERY, ["ok", "lone \ud800"]), "text 1 is not valid Unicode"),
])
def test_bad_rerank_calls_are_refused_in_one_line(reranker, args, words):
    with pytest.raises(FeedError, match=words) as e:
        load(reranker[1]).rerank(*args)
    assert "\n" not in str(e.value)
    with pytest.raises(FeedError, match="not valid Unicode"):  # a pair's text checked as a text is
        load(reranker[1]).count_tokens([("q", "lone \ud800")])


def test_rerank_over_http_ranks_as_in_process(ray_env, reranker):
    """``POST /v1/rerank`` on a real server: the in-process ranking, the documents returned or
    not, token usage counted; bad requests get OpenAI-style 400s; an embedding route on a
    reranker names the route that works."""
    pytest.importorskip("ray")
    from conftest import serving
    from test_serve_cli import post

    from slimml.serve import ServeConfig

    want = load(reranker[1]).rerank(QUERY, DOCS, top_n=3)
    with serving(ServeConfig(str(reranker[1]))) as port:
        url = f"http://127.0.0.1:{port}/v1"
        status, body = post(f"{url}/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 3})
        assert status == 200, body
        assert [(r["index"], r["document"]["text"]) for r in body["results"]] == [(w["index"], DOCS[w["index"]]) for w in want]
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], [w["score"] for w in want], atol=1e-6)
        assert body["usage"]["total_tokens"] == sum(load(reranker[1]).count_tokens([[QUERY, d] for d in DOCS]))
        long = "word " * 5000  # past the server's --max-text-chars: scored cut, returned as sent (was cut to 16,384)
        status, body = post(f"{url}/rerank", {"query": QUERY, "documents": [long, DOCS[0]]})
        assert status == 200 and sorted(r["document"]["text"] for r in body["results"]) == sorted([long, DOCS[0]]), body
        status, body = post(f"{url}/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False})
        assert status == 200 and len(body["results"]) == len(DOCS) and "document" not in body["results"][0]
        for bad, words in [({"documents": DOCS}, '"query"'), ({"query": QUERY, "documents": []}, '"documents"'),
                           ({"query": QUERY, "documents": ["ok", 5]}, '"documents"[1]'),
                           ({"query": QUERY, "documents": DOCS, "top_n": -1}, '"top_n"')]:
            status, body = post(f"{url}/rerank", bad)
            assert status == 400 and words in body["error"]["message"], (bad, body)
        status, body = post(f"{url}/embeddings", {"input": ["hi"]})
        assert status == 400 and "POST /v1/rerank" in body["error"]["message"], body
    many = [f"{d} ({i})" for i in range(10) for d in DOCS]  # 40 documents: five calls of 8 at batch_size 1
    want = load(reranker[1]).rerank(QUERY, many, top_n=7)
    with serving(ServeConfig(str(reranker[1]), batch_size=1)) as port:
        status, body = post(f"http://127.0.0.1:{port}/v1/rerank", {"query": QUERY, "documents": many, "top_n": 7})
        assert status == 200 and [r["index"] for r in body["results"]] == [w["index"] for w in want], body
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], [w["score"] for w in want], atol=1e-6)


def test_the_quantize_guard_judges_a_cross_encoder_by_its_ranking_on_pairs(reranker, tmp_path):
    """A cross-encoder's one logit per input made the guard's logit cosine 1 whenever two signs
    agreed: it is judged by the Spearman correlation of its float and quantized scores instead, on
    held-out query-passage pairs (static calibration reads pairs too); a softmax classifier by the
    probability that stays where it was, with its top-1 agreement."""
    from slimml.quantize import Int8Config, Int8StaticConfig, quantize
    from slimml.quantize.classifier_guard import ClassifierScore, query_passage_pairs

    _, art = reranker
    report = quantize(art, tmp_path / "int8", Int8Config("cpu"))
    assert report.checks["drop_metric"] == "100*(1-spearman)" and "agreement_cosine" not in report.checks
    assert 0.9 < report.checks["agreement_spearman"] <= 1.0
    assert any(why.startswith("left float: its weights are Gemm heads") for why in report.float_shards.values()), \
        report.float_shards  # the pooler and output stay float, said as such (not "nothing to quantize")
    static = quantize(art, tmp_path / "static", Int8StaticConfig(calibration_size=16))
    assert "agreement_spearman" in static.checks
    pairs = query_passage_pairs(["one two three four five six seven", "eight nine"])
    assert pairs == [("one two three four five six", "one two three four five six seven"),
                     ("one two three four five six", "eight nine"), ("eight nine", "eight nine"),
                     ("eight nine", "one two three four five six seven")]

    class Manifest:  # the float model's facts the score reads
        source: dict = {}
    ranked = np.array([[3.0], [2.0], [1.0], [-1.0]])
    same_signs_other_order = np.array([[1.0], [2.0], [3.0], [-1.0]])  # cosine per row: 1 everywhere
    assert ClassifierScore(Manifest, [ranked]).measure([same_signs_other_order])["agreement"] < 0.5
    probs = ClassifierScore(Manifest, [np.array([[2.0, 0.0], [0.0, 2.0]])]).measure([np.array([[0.0, 2.0], [0.0, 2.0]])])
    assert probs["top1"] == 0.5 and 0.2 < probs["agreement"] < 0.7
    classifier = _classifier(tmp_path / "sentiment", 3)
    convert(classifier, tmp_path / "sentiment_art", ConvertConfig(measure_latency=False))
    checks = quantize(tmp_path / "sentiment_art", tmp_path / "sentiment_int8", Int8Config("cpu")).checks
    assert checks["drop_metric"] == "100*(1-probability)" and 0 <= checks["agreement_top1"] <= 1


def test_the_classifier_guard_s_edges(tmp_path):
    """NaN scores agree 0 (a rank would place them anywhere); a regression of several outputs is
    ranked output by output; a single held-out text still gives two different pairs; a token
    classifier (logits a token) is scored token by token, and a language model under
    ``--max-drop`` names perplexity while it searches."""
    from slimml.quantize.classifier_guard import ClassifierScore, is_classifier, is_scored, query_passage_pairs

    class One:
        source: dict = {}

    class Regression:
        source = {"problem_type": "regression"}

    ranked = (np.arange(16) - 8.0).reshape(-1, 1)
    nan = ranked.copy()
    nan[12:] = np.nan
    assert ClassifierScore(One, [ranked]).measure([nan])["agreement"] == 0.0
    two = np.c_[np.linspace(0, 1, 20), np.linspace(10, 11, 20)]
    shuffled = np.c_[two[::-1, 0], two[:, 1]]  # the first output's order reversed, the second kept
    assert ClassifierScore(Regression, [two]).measure([shuffled])["agreement"] == pytest.approx(0.0)
    (a, b) = query_passage_pairs(["one two three"])
    assert a != b and a[0] == b[0]

    class Tokens:
        labels = ["O", "B", "I"]
        outputs = [type("T", (), {"name": "logits", "shape": ["batch_size", "sequence_length", 3]})()]

    assert not is_classifier(Tokens) and is_scored(Tokens)


def test_a_text_classifier_is_served_on_v1_classify(tmp_path):
    """``POST /v1/classify`` on a real server: each text's labels and scores as ``model.classify`` gives
    them (before, a classifier had no route but the raw logits of /v1/run); bad requests are 400s."""
    pytest.importorskip("ray")
    from conftest import serving
    from test_serve_cli import post

    from slimml.serve import ServeConfig

    convert(_classifier(tmp_path / "src", 3), tmp_path / "art", ConvertConfig(measure_latency=False))
    model = load(tmp_path / "art")
    with serving(ServeConfig(str(tmp_path / "art"), name="m")) as port:
        url = f"http://127.0.0.1:{port}/v1"
        status, body = post(f"{url}/classify", {"input": DOCS[:3], "model": "m"})
        assert status == 200 and body["object"] == "list" and body["model"] == "m", body
        want = model.classify(DOCS[:3], top_k=None)
        assert [[x["label"] for x in d["labels"]] for d in body["data"]] == [[x["label"] for x in w] for w in want]
        np.testing.assert_allclose([[x["score"] for x in d["labels"]] for d in body["data"]],
                                   [[x["score"] for x in w] for w in want], atol=1e-6)
        status, body = post(f"{url}/classify", {"input": DOCS[0], "top_k": 1})
        assert status == 200 and [d["index"] for d in body["data"]] == [0] and len(body["data"][0]["labels"]) == 1
        pairs = [[DOCS[0], DOCS[1]], [DOCS[2], DOCS[0]]]  # an NLI model's (premise, hypothesis): refused as "token ids" before
        status, body = post(f"{url}/classify", {"input": pairs, "top_k": 2})
        want = model.classify([tuple(p) for p in pairs], top_k=2)
        assert status == 200 and [[x["label"] for x in d["labels"]] for d in body["data"]] == [[x["label"] for x in w]
                                                                                               for w in want], body
        np.testing.assert_allclose([[x["score"] for x in d["labels"]] for d in body["data"]],
                                   [[x["score"] for x in w] for w in want], atol=1e-6)
        for bad, words in [({"input": DOCS, "top_k": 0}, '"top_k" must be a whole number >= 1'),
                           ({"input": []}, '"input" is an empty list'), ({"top_k": 1}, 'needs "input"'),
                           ({"input": [["a", ""]]}, '"input"[0] must be two non-empty texts'),
                           ({"input": [True]}, '"input"[0] is a JSON boolean, not a text')]:
            status, body = post(f"{url}/classify", bad)
            assert status == 400 and words in body["error"]["message"], (bad, body)
