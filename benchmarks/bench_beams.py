"""Beam search on a real decoder: slimml against transformers' ``generate(num_beams=...)``.

    python benchmarks/bench_beams.py --artifact ART --gguf FILE.gguf [--beams 4] [--prompt-tokens 200]
        [--max-new-tokens 32] [--rounds 3] [--threads 2]

Both run as their users run them, interleaved in one process: slimml through ``load(ART).generate``,
transformers through ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` in float32 and
``generate(num_beams=B, do_sample=False)``, on the same prompt: the first ``--prompt-tokens`` tokens
of "Summarize: " and gensim's ``lee_background.cor``. Reported: each system's seconds a round, whether
the tokens are the same, and transformers' median time over slimml's (above 1: slimml is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, required=True, help="a decoder artifact with its KV cache and tokenizer")
    ap.add_argument("--gguf", type=Path, required=True, help="the GGUF file it was converted from")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from slimml.runtime import load

    torch.set_num_threads(args.threads)
    hf = AutoModelForCausalLM.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name, dtype=torch.float32).eval()
    model = load(args.artifact)
    corpus = next(Path(importlib.util.find_spec("gensim").submodule_search_locations[0]).rglob("lee_background.cor"))
    prompt = model.text.tokenizer.encode("Summarize: " + corpus.read_text()[:4000]).ids[: args.prompt_tokens]
    eos = hf.generation_config.eos_token_id
    options = dict(num_beams=args.beams, max_new_tokens=args.max_new_tokens)
    times: dict[str, list[float]] = {"slimml": [], "transformers": []}
    same = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        ours = model.generate([prompt], eos_token_id=eos, **options).tokens[0]
        times["slimml"].append(time.perf_counter() - t)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            t = time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=eos,
                              **options)
            times["transformers"].append(time.perf_counter() - t)
        same.append(ours == out[0, len(prompt):].tolist())
    print(json.dumps({"seconds": {k: [round(v, 3) for v in vs] for k, vs in times.items()}, "same_tokens": all(same),
                      "transformers_over_slimml": round(statistics.median(times["transformers"])
                                                        / statistics.median(times["slimml"]), 2)}))


if __name__ == "__main__":
    main()
