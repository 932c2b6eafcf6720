"""How long a running answer stalls while a long prompt joins the continuous batch (the server's
scheduler, in process): one streaming answer of 80 tokens, then a ~2,000-token prompt arrives;
``--prefill-tokens`` 8192 reads it in one pass (as before), 512 a chunk a step beside the answer;
then two long prompts and a short question arrive together (the short one joins past the second).
Prints the answer's longest and median gap between tokens and the long prompt's time to its first
token, two rounds alternated.

    python benchmarks/bench_long_prompt_stall.py ARTIFACT     # a fused decoder with a tokenizer (SmolLM2)
"""
import time, statistics, sys, importlib.util
from collections import deque
from pathlib import Path
from slimml.runtime import load
from slimml.runtime.tasks.generation.config import GenerationConfig
from slimml.runtime.tasks.generation.continuous import ContinuousBatch
model = load(sys.argv[1])
spec = importlib.util.find_spec("gensim")
text = (Path(spec.submodule_search_locations[0]) / "test/test_data/lee_background.cor").read_text()
out = {}
for rnd in range(2):
  for budget in (8192, 512):   # 8192: the whole prompt in one pass (before); 512: a chunk a step
    batch = ContinuousBatch(model, max_batch=4, prefill_tokens=budget)
    stamps = []
    short = batch.prepare("Tell me a long story about a dragon.", GenerationConfig(max_new_tokens=80, min_new_tokens=80),
                          on_text=lambda p: stamps.append(time.perf_counter()))
    long = batch.prepare(text[:9000] + " Summarize.", GenerationConfig(max_new_tokens=4))
    waiting = deque([short]); batch.admit(batch.take(waiting))
    for _ in range(5): batch.step()
    waiting.append(long); t0 = time.perf_counter()
    while waiting or batch.busy:
        batch.admit(batch.take(waiting)); batch.step()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    out.setdefault(budget, []).append((max(gaps), statistics.median(gaps), len(long.ids), long.first_token_s))
    print(budget, "long prompt", len(long.ids), "tokens; short's longest gap %.3f s, median %.3f s; long's TTFT %.2f s" % (max(gaps), statistics.median(gaps), long.first_token_s), flush=True)

# Two long prompts, then a short question, arrive together: the short one's time to its first
# token (it joins past the second long prompt while the first is read) and the second's.
for rnd in range(2):
    batch = ContinuousBatch(model, max_batch=4, prefill_tokens=512)
    first, second = (batch.prepare(text[a:a + 9000] + " Summarize.", GenerationConfig(max_new_tokens=4)) for a in (0, 20000))
    short = batch.prepare("What is the capital of France?", GenerationConfig(max_new_tokens=4))
    waiting = deque([first, second, short])
    while waiting or batch.busy:
        batch.admit(batch.take(waiting)); batch.step()
    out.setdefault("behind", []).append((short.first_token_s, second.first_token_s))
    print("behind two long prompts: short's TTFT %.2f s, second long's TTFT %.2f s" % (short.first_token_s, second.first_token_s), flush=True)
