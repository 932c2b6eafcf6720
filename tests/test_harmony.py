"""gpt-oss's harmony replies: thoughts, answer and tool calls read from its messages, as one
reader hands them out piece by piece; its calls held to their functions' schemas by a grammar of
its own special tokens, on a tiny model whose tokenizer has harmony's markers (random weights:
the grammar makes the shape, the schema the arguments)."""

from __future__ import annotations

import json

import pytest

from slimml.runtime.tasks.generation.reply import ReplyFormat
from slimml.runtime.tasks.generation.tools import Harmony, Tools, tool_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Oslo", "Paris"]}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
            "<|call|>"]
# a harmony-shaped template with tools (gpt-oss's format, written for this test): the tools in a developer
# message, an assistant's call as gpt-oss's template writes it, the reply opened with <|start|>assistant
TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n"
    "{%- for t in tools %}\ntype {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;{% endfor %}\n"
    "}<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|start|>assistant to=functions.{{ m.tool_calls[0].function.name }}"
    "<|channel|>commentary json<|message|>{{ m.tool_calls[0].function.arguments | tojson }}<|call|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.f to=assistant<|channel|>commentary<|message|>{{ m.content | tojson }}"
    "<|end|>"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]

THOUGHT_CALL = ("<|channel|>analysis<|message|>The user wants Oslo's weather. Call get_weather.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\", \"days\": 2}")
ROLE_CALL = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}'
PREAMBLE = ("<|channel|>analysis<|message|>Check first.<|end|><|start|>assistant<|channel|>commentary<|message|>One moment."
            "<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}")
ANSWER = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is {sunny}."


@pytest.mark.parametrize("text, thoughts, content, calls", [
    (THOUGHT_CALL, "The user wants Oslo's weather. Call get_weather.", "", [("get_weather", {"city": "Oslo", "days": 2})]),
    (ROLE_CALL, None, "", [("get_weather", {"city": "Paris"})]),
    (PREAMBLE, "Check first.", "One moment.", [("get_time", {})]),
    (ANSWER, "Easy.", "It is {sunny}.", []),
    (THOUGHT_CALL[:-12], "The user wants Oslo's weather. Call get_weather.", "", []),  # cut off by max_new_tokens
])
def test_a_harmony_reply_comes_apart_into_thoughts_content_and_a_call_in_pieces_of_any_size(text, thoughts, content, calls):
    """One reader, fed the reply as gpt-oss writes it (thoughts on the analysis channel, a call as a
    message to ``functions.NAME``, the answer on the final channel) in pieces of any size: the
    thoughts, the content and the call's pieces that go out add up to the whole reply's, and
    the call's name goes out before its arguments end."""
    form = ReplyFormat.of(TEMPLATE, Tools.of([WEATHER, TIME]))
    assert isinstance(form.use.format, Harmony) and form.thinking is not None
    for size in (1, 3, 8, len(text)):
        reader, got, pieces = form.reader("<|start|>assistant"), ["", ""], []
        for i in range(0, len(text), size):
            delta = reader.feed(text[i : i + size])
            got = [got[0] + delta.reasoning, got[1] + delta.content]
            pieces += [d.openai() for d in delta.calls]
        rest, reply = reader.finish()
        pieces += [d.openai() for d in rest.calls]
        assert (reply.reasoning, reply.content, [(c.name, c.arguments) for c in reply.calls]) == (thoughts, content, calls)
        assert [got[0] + rest.reasoning, got[1] + rest.content] == [thoughts or "", content]
        joined: dict[int, list] = {}
        for p in pieces:
            call = joined.setdefault(p["index"], [None, ""])
            call[0] = call[0] or p["function"].get("name")
            call[1] += p["function"]["arguments"]
        if calls:  # (a call cut off went out as far as it was written; its answer's finish reason is "length")
            assert [(n, json.loads(a)) for n, a in joined.values()] == calls
            assert [p["id"] for p in pieces if "id" in p] == [c.id for c in reply.calls]
        if size == 1 and calls and calls[0][1]:
            assert len(pieces) > 2  # the arguments came in pieces


def test_the_harmony_tool_format_is_found_in_a_template_that_writes_calls():
    """A template with harmony's channels and ``<|call|>`` (gpt-oss's) has harmony's calls; one
    with channels but no calls keeps the generic format."""
    assert tool_format(TEMPLATE).name == "harmony"
    assert tool_format(TEMPLATE.replace("<|call|>", "<|end|>")).name == "generic"


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    """A tiny random Llama whose tokenizer has harmony's special tokens, converted with its KV cache."""
    from conftest import tiny_llama_with_specials

    from slimml.runtime import load

    out = tiny_llama_with_specials(tmp_path_factory.mktemp("harmony"), SPECIALS, [
        "the weather in Oslo and Paris", "analysis commentary final to=functions.get_weather json",
        '{"city": "Oslo", "days": 2}'], bos="<|endoftext|>", eos="<|return|>")
    model = load(out)
    path = out.parent / "harmony.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    model.use_chat_template(str(path))
    return model


@pytest.mark.parametrize("choice, name", [("required", None), ({"type": "function", "function": {"name": "get_time"}},
                                                                "get_time")])
def test_a_harmony_model_held_to_a_call_makes_one_that_fits(harmony_model, choice, name):
    """With ``tool_choice`` required or a named function, the reply is one call written as
    harmony writes it, ended by ``<|call|>``: it parses, names a function offered, and its
    arguments fit the schema; the same sampled reply comes back for the same seed."""
    got = harmony_model.chat(ASK, tools=[WEATHER, TIME], tool_choice=choice, max_new_tokens=48, temperature=1.0, seed=3)
    again = harmony_model.chat(ASK, tools=[WEATHER, TIME], tool_choice=choice, max_new_tokens=48, temperature=1.0, seed=3)
    (call,) = got.tool_calls[0]
    assert got.finish_reasons == ["tool_calls"] and got.texts == [""] and got.tokens == again.tokens
    assert call.name == (name or call.name) and call.name in ("get_weather", "get_time")
    if call.name == "get_weather":
        assert call.arguments["city"] in ("Oslo", "Paris") and set(call.arguments) <= {"city", "days"}
    else:
        assert call.arguments == {}
    assert got.reasoning == [None]  # a held call has no thoughts
    parts = harmony_model.chat(ASK, tools=[WEATHER, TIME], tool_choice=choice, max_new_tokens=48, temperature=1.0, seed=3,
                               stream="deltas")  # the call in pieces as it is written, as a server streams it
    pieces = [c for d in parts for c in d.calls]
    assert parts.result.tokens == got.tokens and pieces[0].name == call.name and len(pieces) > 1
    assert json.loads("".join(p.arguments for p in pieces)) == call.arguments


def test_the_harmony_grammar_takes_replies_as_gpt_oss_writes_them(harmony_model):
    """The auto grammar accepts gpt-oss's replies token by token (thoughts then a call in either
    place of the recipient, a preamble, a final answer) and refuses a call to a function not
    offered; the required grammar refuses thoughts before the call."""
    from slimml.runtime.tasks.generation.structured import Constraint, grammar_of

    tok = harmony_model.text.tokenizer if hasattr(harmony_model.text, "tokenizer") else harmony_model.text
    ends = frozenset({tok.token_to_id("<|call|>"), tok.token_to_id("<|return|>")})
    vocab = tok.get_vocab_size()

    def takes(text: str, choice: str = "auto") -> bool:
        grammar = grammar_of({"type": "grammar", "grammar": Harmony().grammar(Tools.of([WEATHER, TIME], choice))})
        held = Constraint(grammar, tok, vocab, ends)
        for t in tok.encode(text, add_special_tokens=False).ids:
            held.consume(t)
            if held.matcher.is_error():
                return False
        return True

    for text in (THOUGHT_CALL, ROLE_CALL, PREAMBLE, ANSWER):
        assert takes(text), text
    assert not takes(THOUGHT_CALL.replace("get_weather <", "get_news <"))
    assert not takes(THOUGHT_CALL, "required") and takes(ROLE_CALL, "required")
