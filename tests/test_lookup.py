"""Prompt lookup (``GenerationConfig.prompt_lookup``): passes that also compute guessed positions,
copied from where the text's last tokens appeared before. The tokens are the plain loop's; where the
text quotes its prompt, fewer passes make them. Real weights: SmolLM2 (fp32) copying a news article."""

from __future__ import annotations

import numpy as np
import pytest

from slimml.errors import ConfigError
from slimml.runtime.tasks.generation.lookup import guess


def test_a_guess_is_what_followed_the_latest_earlier_occurrence_of_the_tail():
    seq = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7])
    assert guess(seq, 3).tolist() == [8, 9, 1]  # "5 6 7" appeared at 0 ("6 7", later at 6, would give 2 3 5): the 3-gram wins
    assert guess(np.array([1, 2, 3, 4, 2, 3]), 5).tolist() == [4, 2, 3]  # no 3-gram: the 2-gram "2 3"
    assert guess(np.array([1, 2, 3, 4]), 4).tolist() == []  # nothing repeats
    assert guess(np.array([4, 4]), 2).tolist() == []  # too short for a 2-gram before the tail


def test_prompt_lookup_is_checked():
    from slimml.runtime.tasks.generation import GenerationConfig

    with pytest.raises(ConfigError, match=r"prompt_lookup must be a whole number >= 0 \(0 turns it off\), got -1"):
        GenerationConfig(prompt_lookup=-1)


@pytest.fixture(scope="module")
def smol(smollm2_artifact, lee_slice):
    from slimml.runtime import load

    model = load(smollm2_artifact)
    article = lee_slice.read_text().split("\n")[0][:700]
    yield model, [{"role": "user", "content": "Copy the following news article word for word.\n\n" + article}]
    model.close()


def test_a_copied_article_takes_fewer_passes_and_the_same_tokens(smol):
    model, messages = smol
    plain = model.chat(messages, max_new_tokens=48)
    looked = model.chat(messages, max_new_tokens=48, prompt_lookup=4)
    assert looked.tokens == plain.tokens and plain.passes == 48
    assert looked.passes < 40, looked.passes  # measured 26 (the guesses hold along the copied text)


def test_sampled_text_is_the_same_from_the_same_seed(smol):
    """The sampler draws once per token whichever pass computed its logits."""
    model, messages = smol
    options = dict(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=7)
    assert model.chat(messages, prompt_lookup=4, **options).tokens == model.chat(messages, **options).tokens


def test_a_batch_and_a_traced_graph_ignore_it(smol, tiny_llama_past_artifact):
    from slimml.runtime import load

    model, messages = smol
    batch = model.chat([messages, messages], max_new_tokens=8, prompt_lookup=4)  # several prompts: the plain loop
    assert batch.tokens[0] == batch.tokens[1] and batch.passes == 8
    traced = load(tiny_llama_past_artifact)
    try:
        ids = [[3, 4, 5, 3, 4, 5, 3, 4]]
        assert traced.generate(ids, max_new_tokens=6, prompt_lookup=3).tokens == traced.generate(ids, max_new_tokens=6).tokens
    finally:
        traced.close()


def test_the_servers_batch_uses_it_while_one_answer_runs_alone(smol):
    """``slimml serve --prompt-lookup K``: the continuous batch guesses while one sequence runs alone
    (the same tokens as generate, fewer passes) and stops guessing while others share the pass."""
    from collections import deque

    from slimml.runtime.tasks.generate import chat_prompt
    from slimml.runtime.tasks.generation.config import GenerationConfig
    from slimml.runtime.tasks.generation.continuous import ContinuousBatch

    model, messages = smol
    want = model.chat(messages, max_new_tokens=40).tokens[0]
    batch = ContinuousBatch(model, max_batch=2)
    prompt = chat_prompt(model, messages)
    one = batch.prepare(prompt, GenerationConfig(max_new_tokens=40, prompt_lookup=4), raw_text=True)
    batch.admit([one])
    while batch.rows:
        batch.step()
    assert one.tokens == want and batch.cache.lookahead.kept > 10, batch.cache.lookahead.kept  # tokens made without a pass of their own
    two = [batch.prepare(prompt, GenerationConfig(max_new_tokens=12, prompt_lookup=4), raw_text=True) for _ in range(2)]
    waiting = deque(two)
    while waiting or batch.rows:
        batch.admit(batch.take(waiting))
        batch.step()
    assert [s.tokens for s in two] == [want[:12]] * 2  # sharing each pass: no guesses, the same tokens


def test_no_guess_is_one_the_no_repeat_ngram_size_bans(smol):
    """With ``no_repeat_ngram_size`` n, the j-th guess after a matched m-gram completes an (m + j)-gram that
    occurred before: the sampler bans it from m + j >= n on, so every pass computed those positions for nothing
    (n = 2 or 3: every guess)."""
    import numpy as np

    from slimml.runtime.tasks.generation.lookup import guess

    text = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3])
    assert guess(text, 5).tolist() == [4, 5, 6, 7, 8]
    assert [len(guess(text, 5, no_repeat=n)) for n in (2, 3, 4, 5, 6, 8, 20)] == [0, 0, 0, 1, 2, 4, 5]
    model, messages = smol
    options = dict(max_new_tokens=40, no_repeat_ngram_size=8)
    plain = model.chat(messages, **options)
    looked = model.chat(messages, prompt_lookup=4, **options)
    assert looked.tokens == plain.tokens and looked.passes < plain.passes, (looked.passes, plain.passes)
