"""Prefix caching (``slimml serve --prefix-cache``): a prompt that begins with text the batch read
before gets those positions' keys and values copied and prefills only the rest. The store's rules
on plain arrays; the answers on real weights (SmolLM2 fp32): a conversation's later turns reuse the
earlier ones and give the tokens a whole prefill gives."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from slimml.runtime.tasks.generation.prefix import BLOCK, PrefixStore


def _buffers(rows: int = 2, positions: int = 8 * BLOCK) -> dict[str, np.ndarray]:
    """Two layers' cache (rows, kv_heads 2, positions, head_dim 4), each position's values its index."""
    pos = np.arange(positions, dtype=np.float32)[None, None, :, None]
    return {f"past_key_values.{i}.key": np.broadcast_to(pos + 1000 * i, (rows, 2, positions, 4)).copy() for i in range(2)}


def test_whole_blocks_of_equal_tokens_are_reused_and_one_position_is_always_left():
    store, bufs = PrefixStore(1 << 20), _buffers()
    text = list(range(100, 100 + 3 * BLOCK + 5))
    store.keep(text, bufs, 0, len(text))
    assert store.stats["blocks"] == 3  # whole blocks only
    assert len(store.match(text + [7, 8])) == 3
    assert len(store.match(text[: 3 * BLOCK])) == 2  # the same prompt: its last position is prefilled for its logits
    assert store.match([99] + text[1:]) == []  # a different first token: nothing is shared
    other = text[:BLOCK] + [5] * (2 * BLOCK)
    assert len(store.match(other)) == 1  # shared up to the block where they part
    out = np.zeros_like(bufs["past_key_values.0.key"])
    n = store.load(store.match(text + [1]), {"past_key_values.0.key": out, "past_key_values.1.key": out.copy()}, 1)
    assert n == 3 * BLOCK and np.array_equal(out[1, :, :n], bufs["past_key_values.0.key"][0, :, :n])
    assert store.stats["reused_tokens"] == 3 * BLOCK  # what was copied, not what was looked up


def test_a_shared_beginning_is_stored_once_and_the_oldest_branch_goes_first():
    bufs = _buffers()
    block_bytes = 2 * 2 * BLOCK * 4 * 4  # two layers, 2 kv heads, head_dim 4, float32
    store = PrefixStore(5 * block_bytes)
    system = list(range(2 * BLOCK))
    a, b = system + [1] * BLOCK, system + [2] * BLOCK
    store.keep(a, bufs, 0, len(a))
    store.keep(b, bufs, 0, len(b))
    assert store.stats["blocks"] == 4 and store.nbytes == 4 * block_bytes  # the system prompt once, a branch each
    store.match(b + [0])  # b's branch used last
    c = system + [3] * (2 * BLOCK)
    store.keep(c, bufs, 0, len(c))  # two more blocks: one must go, a's branch (the oldest), never the shared root
    assert store.nbytes <= 5 * block_bytes
    assert len(store.match(a + [0])) == 2 and len(store.match(b + [0])) == 3 and len(store.match(c + [0])) == 4
    PrefixStore(0).keep(a, bufs, 0, len(a))  # a zero budget keeps nothing
    tiny = PrefixStore(block_bytes)
    tiny.keep(c, bufs, 0, len(c))
    assert tiny.nbytes == block_bytes and len(tiny.match(c + [0])) == 1  # as much as fits, from the start


@pytest.fixture(scope="module")
def smol(smollm2_artifact):
    from slimml.runtime import load

    model = load(smollm2_artifact)
    yield model
    model.close()


def _conversation(model, prefix_bytes: int, questions: list[str], turns: int):
    """Each question as a conversation of ``turns`` turns (a system prompt, then "Tell me more."),
    one continuous batch for all: the tokens of every answer, and the batch."""
    from slimml.runtime.tasks.generate import chat_prompt
    from slimml.runtime.tasks.generation.config import GenerationConfig
    from slimml.runtime.tasks.generation.continuous import ContinuousBatch

    batch = ContinuousBatch(model, max_batch=4, prefix_bytes=prefix_bytes)
    system = "You are a concise assistant. Answer questions about geography, history and science in one sentence."
    talks = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    answers = []
    for _ in range(turns):  # every conversation's turn at once: they share the batch and the system prompt
        seqs = [batch.prepare(chat_prompt(model, m), GenerationConfig(max_new_tokens=12), raw_text=True) for m in talks]
        waiting = deque(seqs)
        while waiting or batch.rows:
            batch.admit(batch.take(waiting))
            batch.step()
        for m, s in zip(talks, seqs):
            answers.append(s.tokens)
            m += [{"role": "assistant", "content": model.text.tokenizer.decode(s.tokens, skip_special_tokens=True)},
                  {"role": "user", "content": "Tell me more."}]
    return answers, batch


def test_later_turns_reuse_the_conversation_and_answer_as_a_whole_prefill(smol):
    questions = ["What is the capital of France?", "Who wrote Hamlet?", "Why is the sky blue?"]
    plain, _ = _conversation(smol, 0, questions, 3)
    cached, batch = _conversation(smol, 64 << 20, questions, 3)
    assert cached == plain  # float32: the copied positions are the numbers a prefill computes
    stats = batch.prefix.stats
    assert stats["reused_tokens"] > stats["prompt_tokens"] // 2, stats  # the system prompt, then earlier turns
    assert 0 < stats["bytes"] <= 64 << 20 and batch.cache_bytes == 0  # the batch's own cache is freed when it empties


def test_a_burst_over_one_document_prefills_it_once(smol):
    """Prompts that begin alike and arrive together: the first is prefilled, the others wait one
    step and copy its cache; their answers are those of a batch without a store."""
    from slimml.runtime.tasks.generation.config import GenerationConfig
    from slimml.runtime.tasks.generation.continuous import ContinuousBatch

    document = "The city council met on Tuesday to discuss the new bridge over the river. " * 6
    prompts = [document + q for q in ("Who met?", "What was discussed?", "Where is the bridge?")]
    answers = {}
    for budget in (0, 64 << 20):
        batch = ContinuousBatch(smol, max_batch=4, prefix_bytes=budget)
        seqs = [batch.prepare(p, GenerationConfig(max_new_tokens=8)) for p in prompts]
        waiting, taken = deque(seqs), []
        while waiting or batch.rows:
            joining = batch.take(waiting)
            taken.append(len(joining))
            batch.admit(joining)
            batch.step()
        answers[budget] = [s.tokens for s in seqs]
        if budget:
            assert taken[:2] == [1, 2], taken  # the document once, then both others from its cache
            assert batch.prefix.stats["reused_tokens"] >= 2 * (len(seqs[0].ids) // BLOCK - 1) * BLOCK
        else:
            assert taken[0] == 3
    assert answers[0] == answers[64 << 20]


def test_a_long_prompt_is_prefilled_a_chunk_a_step_while_the_batch_decodes(smol):
    """A prompt past ``prefill_tokens`` is read that many positions a step, in a row of its own,
    while the running answers each get a token every step (before, its whole prefill held them
    up); both answers are the ones each gets alone."""
    from slimml.runtime.tasks.generation.config import GenerationConfig
    from slimml.runtime.tasks.generation.continuous import ContinuousBatch

    batch = ContinuousBatch(smol, max_batch=3, prefill_tokens=64)
    # the running answer guesses ahead (prompt lookup, while it runs alone): its guessed positions
    # must not be kept when the long prompt grows the buffers (the review found them lost)
    short = batch.prepare("Repeat after me word for word: the quick brown fox jumps over the lazy dog, the quick brown "
                          "fox jumps over the lazy dog, the quick brown", GenerationConfig(max_new_tokens=48, min_new_tokens=48,
                                                                                           prompt_lookup=8))
    long = batch.prepare("The city council met on Tuesday to discuss the new bridge over the river. " * 18 + "Who met?",
                         GenerationConfig(max_new_tokens=6))
    assert len(long.ids) > 4 * 64
    waiting = deque([short])
    batch.admit(batch.take(waiting))
    for _ in range(30):
        batch.step()
        if batch.cache.lookahead.ahead:
            break
    assert batch.cache.lookahead.ahead  # guesses pending when the long prompt arrives and grows the buffers
    waiting.append(long)
    during, fills = [], 0
    while waiting or batch.busy:
        batch.admit(batch.take(waiting))
        before, reading = len(short.tokens), batch.filling is not None
        fills += reading
        batch.step()
        if reading and short.finish_reason is None:
            during.append(len(short.tokens) - before)
    assert fills == -(-len(long.ids) // 64) and during and set(during) == {1}  # a token a step while it was read
    assert short.tokens == smol.generate([short.ids], max_new_tokens=48, min_new_tokens=48).tokens[0]
    assert long.tokens == smol.generate([long.ids], max_new_tokens=6).tokens[0]
    assert batch.cache_bytes == 0 and batch.free == 3  # all gone: the cache freed


def test_a_short_prompt_behind_a_waiting_long_one_joins_at_once(smol):
    """Two long prompts then a short one: while the first is read, the second keeps its place and
    a row, and the short one joins past it (before, it waited for the second's turn and its whole
    reading); every answer is the one each gets alone."""
    from slimml.runtime.tasks.generation.config import GenerationConfig
    from slimml.runtime.tasks.generation.continuous import ContinuousBatch

    text = "The city council met on Tuesday to discuss the new bridge over the river. "
    batch = ContinuousBatch(smol, max_batch=3, prefill_tokens=64)
    first, second = (batch.prepare(text * n + "Who met?", GenerationConfig(max_new_tokens=4)) for n in (6, 5))
    short = batch.prepare("What is the capital of France?", GenerationConfig(max_new_tokens=6))
    waiting = deque([first, second, short])
    assert batch.take(waiting) == [short] and batch.filling is first and list(waiting) == [second]
    batch.admit([short])
    filled = []
    while waiting or batch.busy:
        batch.admit(batch.take(waiting))
        filled.append(batch.filling)
        batch.step()
    assert filled.index(second) == filled.count(first)  # read as soon as the first was in
    for s in (first, second, short):
        assert s.tokens == smol.generate([s.ids], max_new_tokens=len(s.tokens)).tokens[0]
    tight = ContinuousBatch(smol, max_batch=2, prefill_tokens=64)  # one row left: kept for the long prompt
    waiting = deque(tight.prepare(p, GenerationConfig(max_new_tokens=2)) for p in (first.ids, second.ids, short.ids))
    assert tight.take(waiting) == [] and len(waiting) == 2 and tight.filling is not None
    tight.cancel_all()


def test_a_chat_in_a_loop_prefills_only_each_turns_new_text(smol):
    """In process (``model.chat`` turn after turn): the model's own store, the same tokens."""
    def talk():
        messages = [{"role": "system", "content": "You are a concise assistant who answers in one sentence."}]
        out = []
        for q in ("What is the capital of France?", "And of Spain?", "Which is larger?"):
            messages.append({"role": "user", "content": q})
            g = smol.chat(messages, max_new_tokens=12)
            messages.append({"role": "assistant", "content": g.texts[0]})
            out.append((g.tokens[0], g.prompt_tokens))
        return out

    smol.prefix_cache(0)
    plain = talk()
    smol.prefix_cache("16MB")
    try:
        cached = talk()
        stats = smol.prefix.stats
    finally:
        smol.prefix_cache(0)
    assert cached == plain
    sizes = [n for _, n in plain]
    at_least = sum((n // BLOCK - 1) * BLOCK for n in sizes[:-1])  # each turn holds the one before (whole blocks)
    assert stats["prompt_tokens"] == sum(sizes) and stats["reused_tokens"] >= at_least, (stats, sizes)
    assert 0 < stats["bytes"] <= 16 << 20 and smol.prefix.stats["bytes"] == 0  # prefix_cache(0) frees it


def test_a_prefix_cache_size_that_is_not_one_keeps_the_store(smol):
    """A bad size is refused before the store is dropped: what it held stays (it was cleared first)."""
    from slimml.errors import ConfigError

    smol.prefix_cache("16MB")
    try:
        smol.generate([" ".join(["The three oldest cities in Europe are older than their countries."] * 20)],
                      max_new_tokens=2)  # whole blocks of prompt are kept
        held = smol.prefix.stats["bytes"]
        with pytest.raises(ConfigError, match=r"^prefix cache 'lots' is not a size; .*, or 0 to turn it off\.$"):
            smol.prefix_cache("lots")
        assert held > 0 and smol.prefix.stats["bytes"] == held
    finally:
        smol.prefix_cache(0)


def test_a_traced_graph_prefills_every_prompt_whole(tiny_llama_past_artifact):
    from slimml.runtime import load
    from slimml.runtime.tasks.generation.config import GenerationConfig
    from slimml.runtime.tasks.generation.continuous import ContinuousBatch

    model = load(tiny_llama_past_artifact)
    try:
        batch = ContinuousBatch(model, max_batch=2, prefix_bytes=1 << 20)
        ids = list(range(3, 3 + 3 * BLOCK))
        for _ in range(2):
            s = batch.prepare(ids, GenerationConfig(max_new_tokens=2))
            batch.admit([s])
            while batch.rows:
                batch.step()
            assert batch.cache.reuse(s) == 0 and len(s.tokens) == 2
    finally:
        model.close()
