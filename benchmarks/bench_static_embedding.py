"""Static embedding models (sentence-transformers' StaticEmbedding) through slimml, against
sentence-transformers' own ``encode`` on the same folder.

No potion or static-retrieval checkpoint is on this machine (no network), so the static models are
made from the default model (all-MiniLM-L6-v2), on real weights:

- ``minilm-table``: its input token-embedding table (30,522 x 384) as the table, normalised;
- ``model2vec`` (with ``--model2vec``, needs ``pip install 'model2vec[distill]'``): model2vec's
  ``distill`` of it (PCA to 256, Zipf weighting), as potion models are made, saved by model2vec.

For each: ``slimml convert`` to fp32, then ``--quantize int8`` and ``int4-weights``; STSb dev
Spearman x100 of the library and of each artifact; and texts/s encoding the 5,820 STSb dev
sentences, the library and the artifacts interleaved in one process, ``--rounds`` rounds, each
system's median and its ratio to the library's.

    python benchmarks/bench_static_embedding.py [--model2vec] [--rounds 5] [--out benchmarks/results/static_embedding.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

STSB = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "stsb"
SCHEMES = (None, "int8", "int4-weights")


def minilm_table(out: Path) -> Path:
    from safetensors.numpy import load_file
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, StaticEmbedding
    from tokenizers import Tokenizer

    from slimml.convert.sources import default_model_dir

    table = load_file(str(default_model_dir() / "model.safetensors"))["embeddings.word_embeddings.weight"]
    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    SentenceTransformer(modules=[StaticEmbedding(tok, embedding_weights=table), Normalize()], device="cpu").save(str(out))
    return out


def model2vec(out: Path) -> Path:
    from model2vec.distill import distill

    from slimml.convert.sources import default_model_dir

    distill(model_name=str(default_model_dir()), pca_dims=256).save_pretrained(str(out))
    return out


def measure(folder: Path, work: Path, rounds: int) -> dict:
    from sentence_transformers import SentenceTransformer

    from slimml.convert import ConvertConfig, convert
    from slimml.quantize import scheme_config
    from slimml.runtime import load
    from slimml.runtime.tools.evaluate import read_sts, spearman

    a, b, gold = read_sts(STSB / "sts-dev.csv")
    texts = a + b
    systems = {"sentence-transformers": SentenceTransformer(str(folder), device="cpu").encode}
    sizes = {}
    for scheme in SCHEMES:
        name = f"slimml {scheme or 'fp32'}"
        art = work / f"{folder.name}-{scheme or 'fp32'}"
        report = convert(folder, art, ConvertConfig(measure_latency=False, quantize=scheme_config(scheme) if scheme else None))
        sizes[name] = round(report.size_mb, 2)
        systems[name] = load(art).encode

    def sts(encode) -> float:
        ea, eb = encode(a), encode(b)
        ea = ea / np.linalg.norm(ea, axis=1, keepdims=True).clip(1e-12)
        eb = eb / np.linalg.norm(eb, axis=1, keepdims=True).clip(1e-12)
        return round(100 * spearman((ea * eb).sum(1), gold), 3)

    quality = {name: sts(encode) for name, encode in systems.items()}
    speed: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(rounds):  # interleaved: each round runs every system once
        for name, encode in systems.items():
            t0 = time.perf_counter()
            encode(texts)
            speed[name].append(len(texts) / (time.perf_counter() - t0))
    base = statistics.median(speed["sentence-transformers"])
    return {"stsb_dev_spearman": quality, "artifact_mb": sizes,
            "texts_per_s_median": {n: round(statistics.median(v)) for n, v in speed.items()},
            "vs_library": {n: round(statistics.median(v) / base, 2) for n, v in speed.items()},
            "texts": len(texts), "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model2vec", action="store_true", help="also distill with model2vec (pip install 'model2vec[distill]')")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "static_embedding.json")
    args = parser.parse_args()
    import onnxruntime
    import sentence_transformers

    results = {"setup": {"onnxruntime": onnxruntime.__version__, "sentence_transformers": sentence_transformers.__version__}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        makers = {"minilm-table": minilm_table, **({"model2vec": model2vec} if args.model2vec else {})}
        for name, make in makers.items():
            results[name] = measure(make(work / name), work, args.rounds)
            print(name, json.dumps(results[name], indent=1))
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
