"""Token classification (named entities) and extractive question answering: converted, then
answered as transformers' pipelines answer them, on a WordPiece (BERT) and a byte-level BPE
(RoBERTa) tokenizer; quantized under a guard that reads what their users read; from the CLI and
without torch.

Tiny random-weight models built here (random weights give arbitrary entities and answers, which
is enough to hold every step to the pipeline's); no downloads.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import run_without_torch

from slimml.errors import FeedError, TaskError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]
TEXTS = ["Angela Merkel visited Paris and met Emmanuel Macron at the Élysée Palace.",
         "unbelievably, John's brothers-in-law arrived from São Paulo (Brazil) on 3/4/2021!", "x", "Berlin"]
CONTEXT = ("My name is Wolfgang and I live in Berlin. The city has many museums, and the river Spree runs "
           "through it. ") * 2
QUESTION = "Where do I live?"
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def slimml(*args):
    return subprocess.run([sys.executable, "-m", "slimml", *map(str, args)], capture_output=True, text=True, timeout=300)


def _roberta_tokenizer(folder):
    """A byte-level BPE tokenizer as RoBERTa's is made (no continuing-subword prefix, so the
    pipeline's no-space heuristic decides what is a piece of a word), trained on the README."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").splitlines(), trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True, add_prefix_space=False)
    fast = transformers.RobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                             cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                             model_max_length=128)
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{(family, task): (artifact, transformers pipeline)} for BERT and RoBERTa, NER and QA."""
    from transformers import (AutoTokenizer, BertConfig, BertForQuestionAnswering, BertForTokenClassification,
                              RobertaConfig, RobertaForQuestionAnswering, RobertaForTokenClassification, pipeline)

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.sources import default_model_dir
    from slimml.runtime import load

    root = tmp_path_factory.mktemp("tokentasks")
    labels = dict(num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id={x: i for i, x in enumerate(LABELS)})
    out = {}
    for family in ("bert", "roberta"):
        folder = root / family
        if family == "bert":
            tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
            tok.save_pretrained(folder)
            configs = (BertConfig(vocab_size=tok.vocab_size, **SMALL, **labels), BertConfig(vocab_size=tok.vocab_size, **SMALL))
            classes = (BertForTokenClassification, BertForQuestionAnswering)
        else:
            tok = _roberta_tokenizer(folder)
            common = dict(vocab_size=len(tok), pad_token_id=1, bos_token_id=0, eos_token_id=2, max_position_embeddings=130, **SMALL)
            configs = (RobertaConfig(**common, **labels), RobertaConfig(**common))
            classes = (RobertaForTokenClassification, RobertaForQuestionAnswering)
        for task, config, cls in zip(("ner", "qa"), configs, classes):
            torch.manual_seed(len(out))
            src = root / f"{family}-{task}"
            cls(config).eval().save_pretrained(src)
            tok.save_pretrained(src)
            convert(src, root / f"{family}-{task}-art", ConvertConfig(measure_latency=False))
            name = "token-classification" if task == "ner" else "question-answering"
            try:
                reference = pipeline(name, model=str(src), tokenizer=str(src))
            except KeyError:  # transformers 5 removed the question-answering pipeline (slimml keeps its answers)
                reference = None
            out[family, task] = (load(root / f"{family}-{task}-art"), reference, root / f"{family}-{task}-art")
    return out


def same(a, b) -> bool:
    """Equal results: the same keys, texts and offsets, scores within float32 noise."""
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (float, np.floating)):
        return abs(float(a) - float(b)) <= 2e-5 * max(1.0, abs(float(b)))
    return a == b


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_entities_are_the_pipeline_s_for_every_aggregation(models, family):
    model, ner, _ = models[family, "ner"]
    assert model.kind == "token-classification" and model.supports("entities") and not model.supports("classify")
    for aggregation in ("none", "simple", "first", "average", "max"):
        for ignore in (["O"], []):
            want = ner(TEXTS, aggregation_strategy=aggregation, ignore_labels=ignore)
            got = model.entities(TEXTS, aggregation=aggregation, ignore_labels=ignore)
            assert same(got, want), (aggregation, ignore, got[0][:3], want[0][:3])
    assert sum(map(len, model.entities(TEXTS, ignore_labels=[]))) > 10  # random weights still label every token
    assert model.entities(TEXTS, ignore_labels=None) == model.entities(TEXTS)  # None: the pipeline's default, ["O"]
    long = " ".join(TEXTS * 40)  # past the model's length: windows that overlap, merged
    got = model.entities([long], stride=16)
    assert same(got, ner([long], aggregation_strategy="simple", stride=16))
    assert got[0][-1]["end"] > len(long) // 2 > max(e["end"] for e in model.entities([long])[0])
    blank = " " * 17_000 + TEXTS[0]  # the tokenizer reads past limits.max_text_chars: its words come from the text
    for aggregation in ("simple", "first"):  # (first reads each piece's text to find words)
        want = ner([blank], aggregation_strategy=aggregation, ignore_labels=[])
        assert same(model.entities([blank], aggregation=aggregation, ignore_labels=[]), want), aggregation


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_answers_are_the_pipeline_s(models, family):
    model, qa, _ = models[family, "qa"]
    assert model.kind == "question-answering" and model.supports("answer")
    if qa is None:
        pytest.skip(f"transformers {transformers.__version__} has no question-answering pipeline to compare with")
    for kw in ({}, {"top_k": 3}, {"handle_impossible_answer": True}, {"align_to_words": False, "top_k": 2},
               {"max_answer_len": 3, "top_k": 4}):
        assert same(model.answer(QUESTION, CONTEXT, **kw), qa(question=QUESTION, context=CONTEXT, **kw)), kw
    long = CONTEXT * 12  # windows of the model's length, overlapping by doc_stride
    for kw in ({"top_k": 2}, {"doc_stride": 20, "max_seq_len": 64, "top_k": 3}):
        assert same(model.answer(QUESTION, long, **kw), qa(question=QUESTION, context=long, **kw)), kw
    questions, contexts = [QUESTION, "What runs through it?"], [CONTEXT, long]
    assert same(model.answer(questions, contexts, batch_size=3), qa(question=questions, context=contexts))
    assert same(model.answer(questions, CONTEXT), qa(question=questions, context=CONTEXT))  # each question of one context
    assert same(model.answer(QUESTION, contexts), [model.answer(QUESTION, c) for c in contexts])  # one question of each


def test_a_tokenizer_that_pads_on_the_left_reads_the_context_first(models, tmp_path):
    """XLNet's convention: the pipeline puts the context first and lets any token be the answer."""
    import shutil

    from transformers import pipeline

    from slimml.convert import ConvertConfig, convert
    from slimml.runtime import load

    src = tmp_path / "left"
    shutil.copytree(models["bert", "qa"][2].parent / "bert-qa", src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "left"}))
    convert(src, tmp_path / "art", ConvertConfig(measure_latency=False))
    if models["bert", "qa"][1] is None:
        pytest.skip(f"transformers {transformers.__version__} has no question-answering pipeline to compare with")
    model, qa = load(tmp_path / "art"), pipeline("question-answering", model=str(src), tokenizer=str(src))
    assert model.manifest.tokenizer["padding_side"] == "left"
    for kw in ({}, {"top_k": 3}, {"doc_stride": 20, "max_seq_len": 64, "top_k": 2}):
        assert same(model.answer(QUESTION, CONTEXT * 3, **kw), qa(question=QUESTION, context=CONTEXT * 3, **kw)), kw


def test_a_token_classifier_is_not_a_classifier_of_texts(models):
    """Before, a token classifier's artifact was taken for a text classifier and `classify` told the
    user it was damaged; now it is its own task, and its refusals name the call that works."""
    ner, qa = models["bert", "ner"][0], models["bert", "qa"][0]
    with pytest.raises(TaskError, match=r"not a classifier; use entities\(texts\), or run\(\)"):
        ner.classify(["a"])
    with pytest.raises(TaskError, match=r"not an extractive question-answering model; use entities\(texts\)"):
        ner.answer("q", "c")
    with pytest.raises(TaskError, match=r"use answer\(question, context\), or run\(\)"):
        qa.entities(["a"])


@pytest.mark.parametrize("call, words", [
    (lambda m: m.entities("one text"), "non-empty list of texts"),
    (lambda m: m.entities(["a", 3]), r"texts\[1\] must be a text, got int"),
    (lambda m: m.entities(["a"], aggregation="mean"), "aggregation must be one of none, simple"),
    (lambda m: m.entities(["a"], aggregation="none", stride=8), "give aggregation='simple'"),
    (lambda m: m.entities(["a"], stride=510), r"stride must be a whole number from 0 to 509 \(windows of 512 tokens, 510"),
    (lambda m: m.entities(["a"], stride=-1), "stride must be a whole number from 0 to 509"),
    (lambda m: m.entities(["a"], ignore_labels="O"), "ignore_labels must be a list"),
    (lambda m: m.entities(["a"], ignore_labels=5), r'ignore_labels must be a list of labels, e\.g\. \["O"\], got 5'),
    (lambda m: m.entities(["a " * 9000], stride=8), "text 0 has 18000 characters, more than the 16384"),
    (lambda m: m.entities(["a " * 8000], stride=500), r"windows of up to \d+ tokens in all, more than the "
                                                      "65536 a call reads; overlap the windows less"),
    (lambda m: m.entities(["\ud800"]), "not valid Unicode"),
])
def test_bad_entity_calls_are_one_line(models, call, words):
    with pytest.raises(FeedError, match=words) as e:
        call(models["bert", "ner"][0])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("args, words", [
    (("", CONTEXT), "question 0 must be a non-empty text"),
    ((None, CONTEXT), "question must be a non-empty text, or a list"),
    (([], CONTEXT), "question must be a non-empty text, or a list"),
    ((QUESTION, ["a", " "]), "context 1 must be a non-empty text, got ' '"),
    (([QUESTION], ["a", "b"]), "got 1 questions and 2 contexts"),
    ((QUESTION, 7), "context must be a non-empty text, or a list"),
    ((QUESTION, CONTEXT, 1, None, 15, 1000), "max_seq_len must be at most 512, the tokens this model reads"),
    ((QUESTION, "x" * 20_000), "context 0 has 20000 characters, more than the 16384 a call reads; split it, or raise"),
    ((QUESTION, CONTEXT, 0), "top_k must be a whole number >= 1"),
    ((QUESTION, CONTEXT, 1, 400), r"doc_stride \(400\) must be smaller than max_seq_len \(384\)"),
    (("why " * 300, CONTEXT * 20), r"question 0 \(300 tokens\) leaves 81 tokens of each 384-token window for the context, "
                                   "not more than doc_stride 128"),
    (("why " * 500, CONTEXT * 20), r"question 0 \(500 tokens\) leaves 0 tokens"),
    ((QUESTION, "a " * 8000, 1, 3, 15, 12), r"windows of up to \d+ tokens in all, more than the 65536 a call reads"),
    ((QUESTION, CONTEXT, 1, None, 15, None, "no"), "handle_impossible_answer must be True or False, got \"no\""),  # read as True
    ((QUESTION, CONTEXT, 1, None, 15, None, False, "no"), "align_to_words must be True or False, got \"no\""),
])
def test_bad_questions_are_one_line(models, args, words):
    with pytest.raises(FeedError, match=words) as e:
        models["bert", "qa"][0].answer(*args)
    assert "\n" not in str(e.value)


def test_many_short_texts_fit_the_window_budget(models):
    """Each window was counted at the model's full length, so 1,100 short texts with a stride (or 1,100
    questions) were refused as "70400 tokens", advising shorter texts, which changed nothing: the
    windows of a call are padded to the longest, and these hold a few tokens each."""
    ner, qa = models["bert", "ner"][0], models["bert", "qa"][0]
    assert len(ner.entities(["Paris is nice."] * 1100, stride=8)) == 1100
    assert len(qa.answer(["Where?"] * 1100, "Berlin is nice.")) == 1100


def test_quantized_they_are_judged_by_the_scores_their_users_read(models, tmp_path):
    """int8: the guard compares each token's label probabilities (entities), and each pair's start
    and end over its tokens (answers, from question-passage pairs), not the logits' cosine."""
    from slimml.quantize import quantize
    from slimml.quantize.config import Int8Config
    from slimml.runtime import load

    for task in ("ner", "qa"):
        model, _, art = models["bert", task]
        report = quantize(art, tmp_path / task, Int8Config())
        assert report.checks["drop_metric"] == "100*(1-probability)" and report.checks["agreement_probability"] > 0.99
        assert report.checks["agreement_top1"] > 0.9
        quantized = load(tmp_path / task)
        assert quantized.kind == model.kind
    ner = load(tmp_path / "ner")
    got, want = ner.entities(TEXTS, aggregation="none", ignore_labels=[]), models["bert", "ner"][0].entities(
        TEXTS, aggregation="none", ignore_labels=[])
    agree = np.mean([g["entity"] == w["entity"] for a, b in zip(got, want) for g, w in zip(a, b)])
    assert agree > 0.9


def test_the_cli_prints_entities_and_answers(models):
    ner_art, qa_art = models["bert", "ner"][2], models["bert", "qa"][2]
    r = slimml("run", ner_art, TEXTS[0], "--aggregation", "first", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [{"input": TEXTS[0], "entities": models["bert", "ner"][0].entities(
        TEXTS[:1], aggregation="first")[0]}]
    r = slimml("run", qa_art, "--question", QUESTION, CONTEXT, "--top-k", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["answers"] == models["bert", "qa"][0].answer(QUESTION, CONTEXT, top_k=2)
    r = slimml("run", ner_art, "--question", QUESTION, CONTEXT)
    assert r.returncode == 1 and r.stderr == (f"error: --question needs an extractive question-answering artifact and "
                                              f"texts to answer from; {ner_art} is a 'token-classification' artifact.\n")
    r = slimml("run", qa_art, CONTEXT, "--json")
    assert r.returncode == 1 and r.stderr == (f"error: {qa_art} answers questions from texts: give --question QUESTION, "
                                              "and the texts to answer from.\n")
    r = slimml("run", qa_art, "--question", QUESTION, CONTEXT, "--json")  # one answer unless --top-k asks for more
    assert json.loads(r.stdout)[0]["answers"] == [models["bert", "qa"][0].answer(QUESTION, CONTEXT)]
    # options another kind of artifact takes, ignored before: refused in one line
    r = slimml("run", ner_art, TEXTS[0], "--top-k", "3")
    assert r.returncode == 1 and "--top-k is for classes and answers; a token classifier gives every entity" in r.stderr
    r = slimml("run", qa_art, "--question", QUESTION, CONTEXT, "--aggregation", "max")
    assert r.returncode == 1 and "--aggregation is for token classifiers' entities" in r.stderr, r.stderr
    r = slimml("run", ner_art, "text", "--aggregation", "mean")
    assert r.returncode == 1 and "aggregation must be one of none, simple, first, average, max" in r.stderr


def test_they_run_without_torch(models):
    ner_art, qa_art = models["bert", "ner"][2], models["bert", "qa"][2]
    lines = run_without_torch([
        "from slimml.runtime import load",
        f"print(len(load({str(ner_art)!r}).entities({TEXTS!r}, ignore_labels=[])[0]))",
        f"print(load({str(qa_art)!r}).answer({QUESTION!r}, {CONTEXT!r})['answer'].strip() != '')",
    ])
    assert lines == [str(len(models["bert", "ner"][0].entities(TEXTS, ignore_labels=[])[0])), "True"]


@pytest.mark.parametrize("task", ["ner", "qa"])
def test_served_entities_and_answers_equal_in_process(ray_env, models, task):
    """``POST /v1/entities`` and ``POST /v1/answer`` on a server on 127.0.0.1: what the model gives
    in process, a list of spans an input; the other route, a bad option and a bad body are 400s
    naming the fix, and the server answers on."""
    pytest.importorskip("ray")
    from conftest import serving
    from test_serve_cli import post

    from slimml.serve import ServeConfig

    model, _, art = models["bert", task]
    with serving(ServeConfig(str(art), name="m", max_text_chars=20_000)) as port:
        url = f"http://127.0.0.1:{port}"
        if task == "ner":
            status, body = post(f"{url}/v1/entities", {"input": TEXTS, "aggregation": "first", "model": "m"})
            assert status == 200 and body["object"] == "list" and body["model"] == "m"
            assert [d["entities"] for d in body["data"]] == model.entities(TEXTS, aggregation="first")
            long = " ".join(TEXTS * 40)
            status, body = post(f"{url}/v1/entities", {"input": long, "stride": 16, "ignore_labels": []})
            assert status == 200 and body["data"][0]["entities"] == model.entities([long], stride=16, ignore_labels=[])[0]
            status, body = post(f"{url}/v1/entities", {"input": ["a"], "aggregation": "mean"})
            assert status == 400 and body["error"]["message"].startswith("aggregation must be one of none, simple")
            status, body = post(f"{url}/v1/answer", {"question": "q", "context": "c"})
            assert status == 400 and body["error"]["message"] == (
                "this artifact is a 'token-classification' model, not an extractive question-answering model, so it has "
                "no /v1/answer; use POST /v1/entities, or POST /v1/run for its raw outputs.")
        else:
            status, body = post(f"{url}/v1/answer", {"question": QUESTION, "context": CONTEXT, "top_k": 3})
            assert status == 200 and body["data"] == [{"index": 0, "answers": model.answer(QUESTION, CONTEXT, top_k=3)}]
            questions = [QUESTION, "What runs through it?"]
            status, body = post(f"{url}/v1/answer", {"question": questions, "context": CONTEXT * 12})
            assert status == 200 and [d["answers"] for d in body["data"]] == [[a] for a in model.answer(questions, CONTEXT * 12)]
            many = [f"{QUESTION} ({i})" for i in range(300)]  # three calls of 128 pairs: one call, 300 pairs before
            status, body = post(f"{url}/v1/answer", {"question": many, "context": CONTEXT})
            assert status == 200 and [d["answers"] for d in body["data"]] == [[a] for a in model.answer(many, [CONTEXT] * 300)]
            status, body = post(f"{url}/v1/answer", {"question": QUESTION, "context": "x" * 20_001})
            assert status == 400 and "more than the 20000 a call reads" in body["error"]["message"]
            status, body = post(f"{url}/v1/answer", {"question": QUESTION, "context": CONTEXT, "align_to_words": "yes"})
            assert status == 400 and body["error"]["message"] == '"align_to_words" must be true or false, got a JSON string.'
            status, body = post(f"{url}/v1/answer", {"question": QUESTION, "context": CONTEXT, "doc_stride": -1})
            assert status == 400 and body["error"]["param"] == "doc_stride", body  # the model's refusal: param was null
            status, body = post(f"{url}/v1/answer", {"question": QUESTION, "context": CONTEXT, "top_k": 101})
            assert status == 400 and body["error"]["message"] == '"top_k" must be at most 100 answers a question, got 101; ask for fewer.'
            status, body = post(f"{url}/v1/answer", {"question": QUESTION, "context": CONTEXT, "align_to_words": None,
                                                     "max_answer_len": 10 ** 30})  # null: the default; a span fits a window
            assert status == 200 and body["data"][0]["answers"] == [model.answer(QUESTION, CONTEXT, max_answer_len=384)]
            status, body = post(f"{url}/v1/answer", {"question": [], "context": CONTEXT})
            assert status == 400 and body["error"]["message"] == '"question" is an empty list; give at least one text.'
            status, body = post(f"{url}/v1/entities", {"input": ["a"]})
            assert status == 400 and "use POST /v1/answer" in body["error"]["message"]
        assert post(f"{url}/v1/embeddings", {"input": ["a"]})[0] == 400


def test_a_tokenizer_that_names_no_length_reads_the_model_s_positions(tmp_path):
    """Without ``model_max_length``, transformers' pipeline reads as many tokens as the model has
    positions; the artifact's length is those positions (before: 512), less RoBERTa's offset."""
    from transformers import AutoTokenizer, BertConfig, BertForTokenClassification, RobertaConfig, RobertaModel, pipeline

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.sources import default_model_dir
    from slimml.runtime import load

    def unnamed(folder):
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.pop("model_max_length", None)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))

    labels = dict(num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id={x: i for i, x in enumerate(LABELS)})
    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    torch.manual_seed(0)
    BertForTokenClassification(BertConfig(vocab_size=tok.vocab_size, max_position_embeddings=1024, **SMALL, **labels)).save_pretrained(tmp_path / "bert")
    tok.save_pretrained(tmp_path / "bert")
    unnamed(tmp_path / "bert")
    convert(tmp_path / "bert", tmp_path / "bert-art", ConvertConfig(measure_latency=False))
    model = load(tmp_path / "bert-art")
    assert model.manifest.tokenizer["max_length"] == 1024
    text = " ".join(TEXTS[:2] * 18)  # 700-odd tokens
    ner = pipeline("token-classification", model=str(tmp_path / "bert"), tokenizer=str(tmp_path / "bert"))
    got = model.entities([text], ignore_labels=[])
    assert same(got, ner([text], aggregation_strategy="simple", ignore_labels=[])) and got[0][-1]["end"] > len(text) - 20
    _roberta_tokenizer(tmp_path / "roberta")
    unnamed(tmp_path / "roberta")
    RobertaModel(RobertaConfig(vocab_size=700, pad_token_id=1, max_position_embeddings=514, **SMALL)).save_pretrained(tmp_path / "roberta")
    convert(tmp_path / "roberta", tmp_path / "roberta-art", ConvertConfig(measure_latency=False))
    roberta = load(tmp_path / "roberta-art")
    assert roberta.manifest.tokenizer["max_length"] == 512  # 514 rows, 2 of them before the first position
    assert roberta.engine.max_sequence_length == 512  # ids past it read no row: refused with the limit (before: ORT's Gather error)
    ids = np.full((1, 513), 5, dtype=np.int64)
    with pytest.raises(FeedError, match="takes at most 512 tokens; truncate to 512"):
        roberta.run({"input_ids": ids, "attention_mask": np.ones_like(ids)})


def test_usable_positions_reads_each_family_s_key(tmp_path):
    """GPT-2 names its table ``n_positions``; a two-tower config keeps it in its text tower."""
    from slimml.convert.folder_facts import usable_positions

    for name, config, want in (("gpt2", {"model_type": "gpt2", "n_positions": 1024, "n_ctx": 1024}, 1024),
                               ("clip", {"model_type": "clip", "text_config": {"max_position_embeddings": 77}}, 77),
                               ("t5", {"model_type": "t5", "relative_attention_num_buckets": 32}, None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert usable_positions(tmp_path / name) == want, name
