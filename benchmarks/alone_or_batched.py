"""Does a chat prompt get the same greedy answer alone as in a batch? Per artifact: 16 chat prompts,
32 greedy tokens each, alone against batches of 4 and of 16 (docs/runtime.md, "Sampling").

    python benchmarks/alone_or_batched.py ARTIFACT [ARTIFACT ...]

An fp32 artifact's logits do not depend on the batch; a 4- or 8-bit one's (MatMulNBits with int8
activations) can, by the CPU's kernels: one row is summed in another order than several.
"""

from __future__ import annotations

import argparse
import json
import platform

from slimml.runtime import load

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
             "List three fruits.", "What is 17 times 3?", "Who wrote Hamlet?", "Give me a tip for sleeping well.",
             "Describe a cat.", "Why is the sky blue?", "Name a famous painter.", "How do plants grow?",
             "What is a computer?", "Tell me a joke.", "What is the tallest mountain?", "How do I boil an egg?",
             "What is rain?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", help="language-model artifacts (fp32, int8, int4 of one model)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per answer")
    args = parser.parse_args()
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    results = []
    for folder in args.artifacts:
        model = load(folder)
        try:
            alone = [model.chat(c, max_new_tokens=args.tokens).tokens[0] for c in chats]
            same = {}
            for size in (4, 16):
                batched = [t for k in range(0, len(chats), size)
                           for t in model.chat(chats[k:k + size], max_new_tokens=args.tokens).tokens]
                same[size] = sum(a == b for a, b in zip(alone, batched))
        finally:
            model.close()
        results.append({"artifact": folder, "prompts": len(chats), "same_alone_as_in_batches_of": same})
        print(f"{folder}: the same answer alone as in batches of 4: {same[4]} of {len(chats)}, of 16: {same[16]} of "
              f"{len(chats)}")
    print(json.dumps({"cpu": platform.processor() or platform.machine(), "results": results}))


if __name__ == "__main__":
    main()
