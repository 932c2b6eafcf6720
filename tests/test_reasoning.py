"""A reasoning model's thoughts (``<think>`` blocks, gpt-oss's harmony channels) read apart from its
answer, in process (``Generation.reasoning``), on the real SmolLM2 with a DeepSeek-R1-style
template (the prompt opens the block) that Qwen3's ``enable_thinking`` closes. Served
(``reasoning_content``): ``test_tool_calls.py``, whose Hermes template opens a block when asked."""

from __future__ import annotations

import re

import pytest

from slimml.runtime import load
from slimml.runtime.tasks.generation.reasoning import Harmony, ThinkTags, reasoning_format

pytestmark = pytest.mark.slow

THINK = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
         "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
         "{% set content = message['content'] %}"
         "{% if message['role'] == 'assistant' and '</think>' in content %}"
         "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
         "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
         "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
         "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is two plus two?"}]
ANSWER = {"type": "regex", "regex": "[A-Z][a-z]+( [a-z]+){0,3}\\."}


@pytest.fixture(scope="module")
def thinker(smollm2_artifact, tmp_path_factory):
    from conftest import templated

    return templated(smollm2_artifact, tmp_path_factory.mktemp("template"), "think.jinja", THINK)[0]


HARMONY_OPENER = "<|start|>user<|message|>Hi<|end|><|start|>assistant"


@pytest.mark.parametrize("format, prompt, text, thoughts, content", [
    (ThinkTags(), "<|im_start|>assistant\n", "<think>\nTwo and two.\n</think>\n\nFour.", "Two and two.", "Four."),
    (ThinkTags(), "assistant\n<think>\n", "\nTwo and two.\n</think>\n\nFour.", "Two and two.", "Four."),
    (ThinkTags(), "assistant\n<think>\n", "Cut off before </thi", "Cut off before </thi", ""),
    (ThinkTags(), "assistant\n", " No block <think> here", None, " No block <think> here"),
    (ThinkTags(), "assistant\n", "<think>\n\n</think>\n\nFour.", "", "Four."),
    (Harmony(), HARMONY_OPENER, "<|channel|>analysis<|message|>User says hi. Reply.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Hello! <b>How</b> can I help?", "User says hi. Reply.", "Hello! <b>How</b> can I help?"),
    (Harmony(), HARMONY_OPENER, "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>"
     "Second.<|end|><|start|>assistant<|channel|>commentary<|message|>One moment.<|end|><|start|>assistant to=functions.f"
     "<|channel|>commentary <|constrain|>json<|message|>{\"a\": 1}<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     "First.\n\nSecond.", "One moment.\n\nDone."),
    (Harmony(), HARMONY_OPENER, "<|channel|>analysis<|message|>Cut in the thoughts <|en", "Cut in the thoughts <|en", ""),
    (Harmony(), HARMONY_OPENER, "Plain text, no channels.", None, "Plain text, no channels."),
    (Harmony(), HARMONY_OPENER, "<|channel|>analysis<|message|>Think.<|end|>Then text with no header.", "Think.",
     "Then text with no header."),
    (Harmony(), HARMONY_OPENER, ' to=functions.f<|channel|>commentary json<|message|>{"a": 1}', None, ""),  # a call first
    (Harmony(), HARMONY_OPENER, "to be or not", None, "to be or not"),
    (Harmony(), HARMONY_OPENER + "<|channel|>final<|message|>", '{"a": 1}', None, '{"a": 1}'),  # a format's answer
])
def test_thoughts_and_answer_come_apart_in_pieces_of_any_size(format, prompt, text, thoughts, content):
    for size in (1, 2, 5, len(text)):
        reader, got = format.reader(prompt), ["", ""]
        for i in range(0, len(text), size):
            for k, piece in enumerate(reader.feed(text[i : i + size])):
                got[k] += piece
        rest_thoughts, rest, whole_thoughts, whole = reader.finish()
        assert (whole_thoughts, whole) == (thoughts, content)
        assert (got[0] + rest_thoughts, got[1] + rest) == (thoughts or "", content)  # never a piece of a tag


def test_chat_splits_the_thoughts_unless_kept_or_a_format_holds_the_answer(thinker):
    model = thinker
    kept = model.chat(ASK, max_new_tokens=12, reasoning="keep")
    split = model.chat(ASK, max_new_tokens=12)
    assert split.reasoning == [kept.texts[0].strip()] and split.texts == [""] and kept.reasoning is None
    assert split.tokens == kept.tokens and split.finish_reasons == ["length"]
    off = model.chat(ASK, max_new_tokens=12, chat_template_kwargs={"enable_thinking": False})
    assert off.reasoning == [None] and off.texts[0] and off.tokens != split.tokens
    held = model.chat(ASK, max_new_tokens=12, response_format=ANSWER)  # a format: the block is closed empty
    assert re.fullmatch(ANSWER["regex"], held.texts[0]) and held.reasoning == [None]
    assert "".join(model.chat(ASK, max_new_tokens=12, stream=True)) == ""  # a stream yields the answer only
    parts = model.chat(ASK, max_new_tokens=40, stream="deltas")  # thoughts and answer, each piece as it comes
    deltas = list(parts)
    assert "".join(d.reasoning for d in deltas) == parts.result.reasoning[0] and len(deltas) > 2
    assert "".join(d.content for d in deltas) == parts.result.texts[0] and not any(d.calls for d in deltas)


# a harmony-shaped template (gpt-oss's format, written for this test): messages between <|start|>ROLE<|message|>
# and <|end|>, the reply opened with <|start|>assistant
HARMONY = ("{% for message in messages %}{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
           "{# replies: <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>... #}")


def test_special_tokens_stay_in_the_text_when_asked_and_harmony_is_found(smollm2_artifact, tmp_path):
    """``skip_special_tokens=False`` keeps a special token the answer holds (here forced by a
    grammar) in its text, as harmony's channels need; a harmony template is read as harmony, and
    an answer without channels is all content."""
    model = load(smollm2_artifact)
    grammar = {"type": "grammar", "grammar": "start: /[A-Z][a-z]{1,8}/ <|im_start|> /[a-z]{1,8}/"}
    kept = model.generate(["The weather today is"], max_new_tokens=12, response_format=grammar, skip_special_tokens=False)
    plain = model.generate(["The weather today is"], max_new_tokens=12, response_format=grammar)
    assert kept.tokens == plain.tokens and "<|im_start|>" in kept.texts[0]
    assert kept.texts[0].replace("<|im_start|>", "") == plain.texts[0]
    path = tmp_path / "harmony.jinja"
    path.write_text(HARMONY, encoding="utf-8")
    model.use_chat_template(str(path))
    assert isinstance(reasoning_format(HARMONY), Harmony) and isinstance(reasoning_format(THINK), ThinkTags)
    assert reasoning_format("{{ messages[0]['content'] }}") is None
    split, keep = model.chat(ASK, max_new_tokens=8), model.chat(ASK, max_new_tokens=8, reasoning="keep")
    assert split.reasoning == [None] and split.texts == keep.texts and split.tokens == keep.tokens
    assert Harmony().closed("<|start|>assistant").endswith("<|start|>assistant<|channel|>final<|message|>")
