"""Mistral's tool calls: ``[TOOL_CALLS]`` then a list of calls (Mistral 7B v0.3, Nemo, Small 3 and
3.1), or ``[TOOL_CALLS]NAME[ARGS]{...}`` a call (Small 3.2, Magistral, Devstral). In Mistral's own
tokenizers the markers are special tokens: the grammar writes them as those tokens and the text
keeps them, checked on a tiny model whose tokenizer has them (random weights: the grammar makes
the shape, the schema the arguments). In any other tokenizer they are text, checked on the real
SmolLM2. Either way the calls come back parsed, streamed in pieces, and the conversation's call
ids reach the template as the 9 letters or digits Mistral's templates demand."""

from __future__ import annotations

import json

import pytest

from slimml.runtime.tasks.generation.chat import ChatTemplate
from slimml.runtime.tasks.generation.reply import ReplyFormat
from slimml.runtime.tasks.generation.tools import MistralArgs, MistralJSON, Tools, tool_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Oslo", "Paris"]}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"]

# Mistral-shaped templates with tools, written for these tests after the format of Mistral's own:
# the tools before the last user message, a call's id refused unless 9 letters or digits
_HEAD = ("{{- bos_token }}{%- for m in messages %}"
         "{%- if m.role == 'user' %}{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
         "{%- endif %}[INST]{{ m.content }}[/INST]"
         "{%- elif m.role == 'tool' %}{%- if m.tool_call_id | length != 9 %}"
         "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
         "[TOOL_RESULTS]{\"content\": {{ m.content | tojson }}, \"call_id\": \"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
         "{%- elif m.role == 'assistant' and m.tool_calls %}")
_TAIL = ("{%- elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}{%- endif %}{%- endfor %}")
_ID_CHECK = ("{%- if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with "
             "length 9!') }}{%- endif %}")
NEMO = (_HEAD + "[TOOL_CALLS][{%- for c in m.tool_calls %}" + _ID_CHECK
        + "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}, \"id\": \"{{ c.id }}\"}"
          "{{ ', ' if not loop.last }}{%- endfor %}]{{ eos_token }}" + _TAIL)
ARGS = (_HEAD + "{%- for c in m.tool_calls %}" + _ID_CHECK
        + "[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}[ARGS]{{ c.function.arguments | tojson }}{%- endfor %}"
          "{{ eos_token }}" + _TAIL)

# Magistral's (2507, 2509): Small 3.2's calls, and thoughts between [THINK] and [/THINK], which its
# system prompt teaches
MAGISTRAL = ARGS.replace("{{- bos_token }}", "{{- bos_token }}Draft your thinking between [THINK] and [/THINK] first.", 1)

LIST_REPLY = 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}, "id": "a1B2c3D4e"}]'
TWO_LIST = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}, '
            '{"name": "get_time", "arguments": {}, "id": "Zz9Yy8Xx7"}]')
ARGS_REPLY = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}[TOOL_CALLS]get_time[CALL_ID]Zz9Yy8Xx7[ARGS]{}'


def test_the_mistral_formats_are_found_in_their_templates():
    assert isinstance(tool_format(NEMO), MistralJSON) and isinstance(tool_format(ARGS), MistralArgs)


@pytest.mark.parametrize("template, text, content, calls", [
    (NEMO, LIST_REPLY, "Checking.", [("get_weather", {"city": "Oslo", "days": 2})]),
    (NEMO, TWO_LIST, "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (NEMO, "It is sunny in [Oslo].", "It is sunny in [Oslo].", []),
    (NEMO, LIST_REPLY[:-20], "Checking.", []),  # cut off by max_new_tokens: no call
    (NEMO, TWO_LIST[:-30], "", [("get_weather", {"city": "Paris"})]),  # the whole call before the cut stays
    (ARGS, '[TOOL_CALLS]get_time[ARGS]{"q": "see [TOOL_CALLS]get_weather[ARGS]{} here"}', "",
     [("get_time", {"q": "see [TOOL_CALLS]get_weather[ARGS]{} here"})]),  # a marker in a string is no call
    (ARGS, ARGS_REPLY, "", [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]),
    (ARGS, "Sure. " + ARGS_REPLY[:-25], "Sure.", [("get_weather", {"city": "Oslo", "days": 2})]),
])
def test_a_mistral_reply_comes_apart_into_content_and_calls_in_pieces_of_any_size(template, text, content, calls):
    """One reader, fed the reply in pieces of any size: the content and each call's pieces add up
    to the whole reply's, and a call's name goes out before its arguments end."""
    form = ReplyFormat.of(template, Tools.of([WEATHER, TIME], parallel_tool_calls=True))
    for size in (1, 3, 8, len(text)):
        reader, got, pieces = form.reader("[INST]x[/INST]"), "", []
        for i in range(0, len(text), size):
            delta = reader.feed(text[i : i + size])
            got += delta.content
            pieces += [d.openai() for d in delta.calls]
        rest, reply = reader.finish()
        pieces += [d.openai() for d in rest.calls]
        assert (reply.content, [(c.name, c.arguments) for c in reply.calls]) == (content, calls)
        assert got + rest.content == content
        joined: dict[int, list] = {}
        for p in pieces:
            call = joined.setdefault(p["index"], [None, ""])
            call[0] = call[0] or p["function"].get("name")
            call[1] += p["function"]["arguments"]
        whole = [(n, json.loads(a)) for n, a in joined.values()]
        assert whole[: len(calls)] == calls and [p["id"] for p in pieces if "id" in p][: len(calls)] == [c.id for c in reply.calls]


@pytest.mark.parametrize("template", [NEMO, ARGS])
def test_a_conversation_with_openai_call_ids_renders_with_nine_letter_ids(template):
    """A client's ids (``call_...``) are no Mistral ids: the call and its answer get the same 9
    letters or digits; an answer without an id takes its call's; a Mistral id stays as it is."""
    form = ReplyFormat.of(template, Tools.of([WEATHER, TIME]))
    chat = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_8f2e0c1b9a7d4e6f", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                {"id": "k9L8m7N6o", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_8f2e0c1b9a7d4e6f", "content": "sunny"},
            {"role": "tool", "content": "noon"}]  # no id: the next call's
    messages = form.messages(chat)
    first, second = (c["id"] for c in messages[1]["tool_calls"])
    assert len(first) == 9 and first.isalnum() and second == "k9L8m7N6o"
    assert [m["tool_call_id"] for m in messages[2:]] == [first, second]
    text = ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"}).render(messages, **form.variables())
    assert text.count(first) == 2 and text.count(second) == 2 and "call_8f2e" not in text
    assert form.messages(chat)[1]["tool_calls"][0]["id"] == first  # the same every time the conversation comes back
    after = ReplyFormat.of(template, None)  # the turn after the tools' answers, offering no tools
    assert after.messages(chat)[2:] == messages[2:] and after.messages(chat)[1]["tool_calls"][0]["id"] == first


@pytest.fixture(scope="module")
def mistral_model(tmp_path_factory):
    """A tiny random Llama whose tokenizer has Mistral's special tokens, converted with its KV cache."""
    from conftest import tiny_llama_with_specials

    from slimml.runtime import load

    out = tiny_llama_with_specials(tmp_path_factory.mktemp("mistral"), SPECIALS, [
        "the weather in Oslo and Paris", "get_weather get_time name arguments id", '{"city": "Oslo", "days": 2}'],
        bos="<s>", eos="</s>")
    return load(out), out


def _use(model, folder, name, template):
    path = folder.parent / name
    path.write_text(template, encoding="utf-8")
    model.use_chat_template(str(path))
    return model


@pytest.mark.parametrize("template", [NEMO, ARGS])
def test_a_mistral_model_held_to_a_call_writes_its_special_token_and_a_call_that_fits(mistral_model, template):
    """With ``tool_choice`` required, the reply opens with the ``[TOOL_CALLS]`` token (kept in
    the text to be read) and holds calls that parse and fit their schemas; streamed in pieces, the
    same calls; the same seed, the same reply."""
    model = _use(*mistral_model, f"t{len(template)}.jinja", template)
    marker = model.text.tokenizer.token_to_id("[TOOL_CALLS]")
    ask = dict(tools=[WEATHER, TIME], tool_choice="required", max_new_tokens=128, temperature=1.0, seed=5)
    got, again = model.chat(ASK, **ask), model.chat(ASK, **ask)
    assert got.tokens == again.tokens and got.tokens[0][0] == marker
    assert got.finish_reasons == ["tool_calls"] and got.texts == [""] and got.tool_calls[0]
    for call in got.tool_calls[0]:
        if call.name == "get_weather":
            assert call.arguments["city"] in ("Oslo", "Paris") and set(call.arguments) <= {"city", "days"}
        else:
            assert call.name == "get_time" and call.arguments == {}
    parts = model.chat(ASK, stream="deltas", **ask)
    pieces = [c for d in parts for c in d.calls]
    assert parts.result.tokens == got.tokens
    joined: dict[int, list] = {}
    for p in pieces:
        joined.setdefault(p.index, [p.name, ""])[1] += p.arguments
    assert [(n, json.loads(a)) for n, a in joined.values()] == [(c.name, c.arguments) for c in got.tool_calls[0]]


@pytest.mark.parametrize("format, reply", [(MistralJSON(), LIST_REPLY), (MistralJSON(), TWO_LIST),
                                           (MistralArgs(), ARGS_REPLY), (MistralArgs(), "Sure. " + ARGS_REPLY)])
def test_the_mistral_grammars_take_replies_as_mistral_writes_them_in_its_special_tokens(mistral_model, format, reply):
    """The auto grammar, its markers as special tokens, takes Mistral's replies token by token
    (text first or not, one call or several) and refuses a call to a function not offered; the
    required grammar refuses text before the call."""
    from slimml.runtime.tasks.generation.prompts import special_tokens

    specials = {m: i for m, i in special_tokens(mistral_model[0].text).items() if m in format.markers}

    def takes(text: str, choice: str = "auto") -> bool:
        grammar = format.grammar(Tools.of([WEATHER, TIME], choice, parallel_tool_calls=True), specials)
        assert "<[" in grammar  # the markers as their tokens
        return _grammar_takes(mistral_model[0], grammar, text)

    assert takes(reply) and takes("It is sunny.")
    assert not takes(reply.replace("get_weather", "get_news"))
    assert takes(reply, "required") == (not reply.startswith(("Checking", "Sure")))


def _grammar_takes(model, grammar: str, text: str) -> bool:
    """Whether ``grammar`` takes ``text``'s tokens (in ``model``'s tokenizer, specials and all) one by one."""
    from slimml.runtime.tasks.generation.structured import Constraint, grammar_of

    tok = model.text.tokenizer
    held = Constraint(grammar_of({"type": "grammar", "grammar": grammar}), tok, tok.get_vocab_size(),
                      frozenset({tok.token_to_id("</s>")}))
    for t in tok.encode(text, add_special_tokens=False).ids:
        held.consume(t)
        if held.matcher.is_error():
            return False
    return True


def test_with_a_tokenizer_that_lacks_the_markers_they_are_text(smollm2_artifact, tmp_path):
    """SmolLM2's tokenizer has no ``[TOOL_CALLS]`` token: the grammar writes the marker as text,
    special tokens stay out of the text, and a call held by it comes back parsed and fitting."""
    from conftest import templated

    model, _ = templated(smollm2_artifact, tmp_path, "nemo.jinja", NEMO)
    got = model.chat(ASK, tools=[WEATHER], tool_choice="required", max_new_tokens=48)
    (call,) = got.tool_calls[0]
    assert call.name == "get_weather" and call.arguments["city"] in ("Oslo", "Paris") and got.finish_reasons == ["tool_calls"]
    assert MistralJSON().grammar(Tools.of([WEATHER], "required"), {}).startswith('start: "[TOOL_CALLS]"')


THOUGHT_CALL = "[THINK]Oslo: the weather tool.[/THINK]" + ARGS_REPLY


@pytest.mark.parametrize("tools, text, reasoning, content, calls", [
    (None, "[THINK]Easy: look outside.[/THINK]It is sunny.", "Easy: look outside.", "It is sunny.", []),
    ([WEATHER, TIME], THOUGHT_CALL, "Oslo: the weather tool.", "", [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]),
    ([WEATHER, TIME], "[THINK]No tool needed.[/THINK]Hello.", "No tool needed.", "Hello.", []),
    (None, "[THINK]cut off by max_tokens", "cut off by max_tokens", "", []),
])
def test_magistral_s_thoughts_come_apart_from_its_answer_and_calls(tools, text, reasoning, content, calls):
    """Magistral writes its thoughts between ``[THINK]`` and ``[/THINK]`` (special tokens, kept in
    the text), then its answer or its calls: the thoughts come out as ``reasoning``, in pieces of any
    size, never a piece of a marker in the content; the calls are read from the answer after them."""
    from slimml.runtime.tasks.generation.reasoning import MistralThink, reasoning_format

    assert isinstance(reasoning_format(MAGISTRAL), MistralThink) and reasoning_format(ARGS) is None
    form = ReplyFormat.of(MAGISTRAL, Tools.of(tools, parallel_tool_calls=True) if tools else None)
    for size in (1, 4, len(text)):
        reader, thought, said = form.reader("[INST]x[/INST]"), "", ""
        for i in range(0, len(text), size):
            delta = reader.feed(text[i : i + size])
            thought, said = thought + delta.reasoning, said + delta.content
            assert "[" not in said
        rest, reply = reader.finish()
        assert (reply.reasoning, reply.content, [(c.name, c.arguments) for c in reply.calls]) == (reasoning, content, calls)
        assert thought + rest.reasoning == reasoning and said + rest.content == content


def test_magistral_may_think_before_the_calls_its_grammar_holds(mistral_model):
    """The call grammar of a template that teaches thinking lets the thoughts come first, between
    the two special tokens, with ``tool_choice`` auto or required; one that does not, does not. On
    the tiny model held to a call, the reply's calls parse and fit, thoughts or not."""
    from slimml.runtime.tasks.generation.prompts import special_tokens
    from slimml.runtime.tasks.generation.tools import ToolUse

    model, folder = mistral_model

    def takes(template: str, text: str, choice: str) -> bool:
        use = ToolUse.of(Tools.of([WEATHER, TIME], choice, parallel_tool_calls=True), MAGISTRAL if template == "m" else ARGS,
                         special_tokens(model.text))
        return _grammar_takes(model, use.format.grammar(use.tools, use.specials), text)

    for choice in ("auto", "required"):
        assert takes("m", THOUGHT_CALL, choice) and takes("m", ARGS_REPLY, choice) and not takes("a", THOUGHT_CALL, choice)
    assert takes("m", "[THINK]Hm.[/THINK]It is sunny.", "auto") and not takes("m", "[THINK]Hm.[/THINK]It is sunny.", "required")
    got = _use(model, folder, "magistral.jinja", MAGISTRAL).chat(ASK, tools=[WEATHER, TIME], tool_choice="required",
                                                                max_new_tokens=160, temperature=1.0, seed=3)
    assert got.finish_reasons == ["tool_calls"] and got.tool_calls[0]
    assert all(c.name in ("get_weather", "get_time") for c in got.tool_calls[0]) and "[THINK]" not in got.texts[0]


def test_magistral_s_format_needs_its_tokens_and_keep_keeps_its_thoughts_when_served():
    """Where the tokenizer lacks ``[THINK]`` and ``[/THINK]`` as special tokens, Magistral's template
    reads no thoughts and keeps no special tokens in the text (a call written after a text
    ``[THINK]`` is a call); ``reasoning="keep"`` holds in a server too (only harmony's template
    refuses its markers back); with the tokens, the text keeps them."""
    from slimml.runtime.tasks.generation.reasoning import MistralThink

    plain = ReplyFormat.of(MAGISTRAL, Tools.of([WEATHER, TIME]), specials={"</s>": 2})
    assert plain.thinking is None and not plain.keep_specials
    reader = plain.reader("[INST]x[/INST]")
    reader.feed("[THINK]I will call " + ARGS_REPLY)
    assert [c.name for c in reader.finish()[1].calls] == ["get_weather", "get_time"]
    tokens = {"[THINK]": 40, "[/THINK]": 41}
    kept = ReplyFormat.of(MAGISTRAL, None, "keep", served=True, specials=tokens)
    assert isinstance(kept.thinking, MistralThink) and kept.reasoning == "keep" and kept.keep_specials
    from slimml.runtime.tasks.generation.config import GenerationConfig

    assert kept.config(GenerationConfig()).skip_special_tokens is False
    assert plain.config(GenerationConfig(max_new_tokens=4)).skip_special_tokens is True  # tools' grammar, no marker tokens
