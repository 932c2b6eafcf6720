"""Named entities and extractive question answering: slimml against transformers' pipelines (torch)
and Optimum's ONNX Runtime pipelines, each as its users run it, on the same texts.

A BERT-base-shaped model (12 layers, hidden 768, the default model's WordPiece tokenizer; random
weights: this measures speed, not accuracy) as a token classifier (9 CoNLL labels) and as a SQuAD
question answerer. Texts: the first sentences of gensim's ``lee_background.cor`` news articles (NER),
and its articles as contexts with a question each (QA; long articles read in windows). Systems,
interleaved in one process, ``--rounds`` rounds, each system's median texts/s and its ratio to
transformers' pipeline:

- ``transformers``: ``pipeline("token-classification", aggregation_strategy="simple")`` /
  ``pipeline("question-answering")`` on the torch model;
- ``optimum``: the same pipelines over ``ORTModelForTokenClassification`` /
  ``ORTModelForQuestionAnswering`` (``export=True``), fp32;
- ``slimml fp32``, ``slimml int8``: ``load(ART).entities(texts)`` / ``.answer(questions, contexts)``
  on ``slimml convert`` and ``--quantize int8`` artifacts.

Every system's first-round results are compared with the pipeline's (the same entities and
answers for fp32; int8's agreement is reported).

    python benchmarks/bench_token_tasks.py [--rounds 3] [--texts 200] [--threads 2] [--out benchmarks/results/token_tasks.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
QUESTIONS = ["Who was involved?", "Where did it happen?", "When did it happen?", "What happened?"]


def corpus(n: int) -> tuple[list[str], list[str]]:
    """(first sentences of articles, whole articles), from gensim's wheel (nothing imported)."""
    spec = importlib.util.find_spec("gensim")
    lines = (Path(spec.submodule_search_locations[0]) / "test" / "test_data" / "lee_background.cor").read_text(
        encoding="utf-8").splitlines()
    articles = [a.strip() for a in lines if a.strip()]
    sentences = [a.split(". ")[0] + "." for a in articles]
    return (sentences * (n // len(sentences) + 1))[:n], (articles * (n // len(articles) + 1))[:n]


def build(root: Path) -> dict[str, Path]:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForQuestionAnswering, BertForTokenClassification

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.sources import default_model_dir
    from slimml.quantize.config import Int8Config

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    base = dict(vocab_size=tok.vocab_size, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072)
    labels = dict(num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id={x: i for i, x in enumerate(LABELS)})
    out = {}
    for task, model in (("ner", BertForTokenClassification(BertConfig(**base, **labels))),
                        ("qa", BertForQuestionAnswering(BertConfig(**base)))):
        torch.manual_seed(0)
        src = root / task
        model.eval().save_pretrained(src)
        tok.save_pretrained(src)
        convert(src, root / f"{task}-fp32", ConvertConfig(measure_latency=False))
        convert(src, root / f"{task}-int8", ConvertConfig(measure_latency=False, quantize=Int8Config()))
        out[task] = src
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--texts", type=int, default=200)
    ap.add_argument("--contexts", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/token_tasks.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from optimum.onnxruntime import ORTModelForQuestionAnswering, ORTModelForTokenClassification
    from transformers import AutoModelForQuestionAnswering, AutoModelForTokenClassification, AutoTokenizer, pipeline

    from slimml.runtime import load

    torch.set_num_threads(args.threads)
    sentences, articles = corpus(args.texts)
    articles = articles[: args.contexts]
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(len(articles))]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = build(root)
        tok = {t: AutoTokenizer.from_pretrained(str(p)) for t, p in src.items()}
        ner_ort = ORTModelForTokenClassification.from_pretrained(str(src["ner"]), export=True)
        qa_ort = ORTModelForQuestionAnswering.from_pretrained(str(src["qa"]), export=True)
        ner = {
            "transformers": pipeline("token-classification", model=AutoModelForTokenClassification.from_pretrained(src["ner"]),
                                     tokenizer=tok["ner"], aggregation_strategy="simple"),
            "optimum": pipeline("token-classification", model=ner_ort, tokenizer=tok["ner"], aggregation_strategy="simple"),
        }
        qa = {
            "transformers": pipeline("question-answering", model=AutoModelForQuestionAnswering.from_pretrained(src["qa"]),
                                     tokenizer=tok["qa"]),
            "optimum": pipeline("question-answering", model=qa_ort, tokenizer=tok["qa"]),
        }
        arts = {f"slimml {s}": {t: load(root / f"{t}-{s}", threads=args.threads) for t in ("ner", "qa")}
                for s in ("fp32", "int8")}
        systems = {
            "ner": {**{k: (lambda p=p: p(sentences)) for k, p in ner.items()},
                    **{k: (lambda m=m: m["ner"].entities(sentences)) for k, m in arts.items()}},
            "qa": {**{k: (lambda p=p: p(question=questions, context=articles)) for k, p in qa.items()},
                   **{k: (lambda m=m: m["qa"].answer(questions, articles)) for k, m in arts.items()}},
        }
        times: dict[str, dict[str, list[float]]] = {t: {k: [] for k in s} for t, s in systems.items()}
        first: dict[str, dict[str, object]] = {t: {} for t in systems}
        for r in range(args.rounds):
            for task, runs in systems.items():
                for name, fn in runs.items():
                    t0 = time.perf_counter()
                    got = fn()
                    times[task][name].append(time.perf_counter() - t0)
                    first[task].setdefault(name, got)
            print(f"round {r + 1}: " + ", ".join(f"{t} {k} {v[-1]:.2f}s" for t, s in times.items() for k, v in s.items()), flush=True)
    result = {"model": "BERT-base-shaped (12 x 768), random weights, the default model's tokenizer", "threads": args.threads,
              "rounds": args.rounds, "ner_texts": len(sentences), "qa_contexts": len(articles),
              "qa_context_chars_mean": round(sum(map(len, articles)) / len(articles)), "tasks": {}}
    for task, runs in times.items():
        n = len(sentences) if task == "ner" else len(articles)
        base = statistics.median(runs["transformers"])
        ref = first[task]["transformers"]
        result["tasks"][task] = {
            name: {"texts_per_s": round(n / statistics.median(v), 2), "vs_transformers": round(base / statistics.median(v), 3),
                   "same_as_pipeline": _agreement(task, first[task][name], ref)} for name, v in runs.items()}
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def _agreement(task: str, got, want) -> float:
    """The share of inputs whose entities (labels, spans) or best answer (span) equal the pipeline's."""
    if task == "ner":
        key = lambda es: [(e["entity_group"], e["start"], e["end"]) for e in es]  # noqa: E731
        return round(sum(key(g) == key(w) for g, w in zip(got, want)) / len(want), 4)
    return round(sum((g["start"], g["end"]) == (w["start"], w["end"]) for g, w in zip(got, want)) / len(want), 4)


if __name__ == "__main__":
    main()
