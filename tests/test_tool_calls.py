"""Tool calls (OpenAI's ``tools``): each family's format held by a grammar and read back, on the real SmolLM2.

SmolLM2's own template knows no tools, so it gets the generic format (a system message lists the
tools, the answer is one JSON object); the same model with a Qwen 2.5-style template
(``HERMES``, below) writes ``<tool_call>`` blocks. Either way a call that comes back parses and
fits its function's schema, streamed or not, and the text outside the calls is the content.
"""

from __future__ import annotations

import json
import re

import pytest

from slimml.errors import ConfigError, FeedError
from slimml.runtime import load
from slimml.runtime.tasks.generation.tools import Generic, Hermes, Llama3, ToolText, Tools, tool_format

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 40}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]

# the tool parts of Qwen 2.5's chat template (Apache-2.0), the Hermes format
HERMES = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {#- and, asked with enable_thinking, a <think> block opened, which the model ends with </think> (this test's, after Qwen3's) #}
    {%- if enable_thinking is defined and enable_thinking %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""


@pytest.fixture(scope="module")
def generic(smollm2_artifact):
    return load(smollm2_artifact)


@pytest.fixture(scope="module")
def hermes(smollm2_artifact, tmp_path_factory):
    from conftest import templated

    return templated(smollm2_artifact, tmp_path_factory.mktemp("template"), "hermes.jinja", HERMES)[0]


def _calls(generation):
    return [(c.name, c.arguments) for c in generation.tool_calls[0]]


def test_the_format_is_read_from_the_template():
    assert isinstance(tool_format(HERMES), Hermes)
    assert isinstance(tool_format("{{ '<|python_tag|>' }}"), Llama3)
    assert isinstance(tool_format("{% for m in messages %}{{ m.content }}{% endfor %}"), Generic)


@pytest.mark.parametrize("model_name", ["generic", "hermes"])
def test_calls_fit_their_schema_and_leave_the_content(model_name, request):
    """auto, required and a named function, greedy and seeded: every call names a tool and its
    arguments fit the schema; the answer ends by itself with finish reason tool_calls. (One call
    for required: SmolLM2 was not trained on tools and, left to make several, makes them until
    max_new_tokens.)"""
    model = request.getfixturevalue(model_name)
    for choice, options in [("auto", {}), ("required", {"temperature": 0.8, "seed": 3, "parallel_tool_calls": False}),
                            ({"type": "function", "function": {"name": "get_time"}}, {})]:
        g = model.chat(ASK, tools=[WEATHER, TIME], tool_choice=choice, max_new_tokens=80, **options)
        calls = _calls(g)
        if choice == "auto" and not calls:  # the model may answer in text instead
            assert g.texts[0] and g.finish_reasons == ["stop"]
            continue
        assert calls and g.finish_reasons == ["tool_calls"], (choice, g.texts, g.finish_reasons)
        for name, args in calls:
            want = {"get_weather": {"city"}, "get_time": {"tz"}}[name]
            assert want <= set(args) <= want | {"unit"} and all(isinstance(v, str) for v in args.values())
        if isinstance(choice, dict):
            assert [n for n, _ in calls] == ["get_time"]
        assert g.texts[0] == "" or "<tool_call>" not in g.texts[0]
    generic_auto = request.getfixturevalue("generic").chat(ASK, tools=[WEATHER, TIME], max_new_tokens=80)
    assert _calls(generic_auto) == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_a_stream_gives_the_content_and_the_result_the_calls(hermes, generic):
    for model in (hermes, generic):
        for choice in ("auto", "required"):
            whole = model.chat(ASK, tools=[WEATHER, TIME], tool_choice=choice, max_new_tokens=80, parallel_tool_calls=False)
            stream = model.chat(ASK, tools=[WEATHER, TIME], tool_choice=choice, max_new_tokens=80, parallel_tool_calls=False,
                                stream=True)
            assert "".join(stream) == whole.texts[0]
            assert _calls(stream.result) == _calls(whole) and stream.result.finish_reasons == whole.finish_reasons


def test_a_tool_result_goes_back_through_the_template(hermes, generic):
    """The next turn: the assistant's call (arguments as OpenAI sends them, JSON text) and the
    tool's answer are rendered by the template, and the model answers (in text with tool_choice none)."""
    from slimml.runtime.tasks.generate import chat_prompt

    for model in (generic, hermes):
        call = model.chat(ASK, tools=[WEATHER], tool_choice="required", max_new_tokens=60).tool_calls[0][0]
        turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.openai()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
        for choice in ("auto", "none"):
            answer = model.chat(turn, tools=[WEATHER], tool_choice=choice, max_new_tokens=40)
            if choice == "none":
                assert answer.texts[0] and answer.tool_calls is None
            else:  # a text answer, or another call (this model often calls again)
                assert answer.texts[0] or answer.tool_calls[0]
    rendered = chat_prompt(hermes, turn)
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(call.arguments) in rendered
    assert '<tool_response>\n{"temperature": 21' in rendered


def streamed_calls(pieces) -> list[tuple[str, dict]]:
    """The calls that OpenAI-style pieces (``delta.tool_calls`` entries, dicts or the client's
    objects) add up to, put together by ``index`` as clients do: the first piece's name, every
    piece's arguments text."""
    calls: dict[int, list] = {}
    for p in pieces:
        p = p if isinstance(p, dict) else p.model_dump()
        call = calls.setdefault(p["index"], [None, ""])
        call[0] = call[0] or p["function"].get("name")
        call[1] += p["function"].get("arguments") or ""
    return [(name, json.loads(arguments)) for _, (name, arguments) in sorted(calls.items())]


def test_a_call_handed_out_keeps_its_id_though_a_block_before_it_was_no_call():
    """A ``<tool_call>`` block left unclosed (free text, to the parser) between two calls: the
    final calls keep the ids their pieces had, matched by name and arguments, not by position."""
    reader = ToolText(Hermes())
    pieces = reader.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", '
                         '"arguments": {"b": 1}}\nthen\n<tool_call>\n{"name": "g", "arguments": {"b": 2}}\n</tool_call>')[1]
    _, _, calls = reader.finish()
    ids = {p.id: (p.name, json.loads(p.arguments)) for p in pieces}
    assert [(c.name, c.arguments) for c in calls] == [("f", {"a": 1}), ("g", {"b": 2})]
    assert [ids[c.id] for c in calls] == [(c.name, c.arguments) for c in calls] and not reader.unsent(calls)


@pytest.mark.parametrize("format, text, content, calls", [
    (Hermes(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os\\"lo {x}", "n": [1, {"a": '
     '"]}"}]}}\n</tool_call>\n<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>', "Let me check.",
     [("get_weather", {"city": 'Os"lo {x}', "n": [1, {"a": "]}"}]}), ("get_time", {})]),
    (Hermes(), 'Sunny.\n<tool_call>\n{"name": "get_weather", "argu', "Sunny.", []),  # cut off by max_new_tokens: no content
    (Llama3(), ' {"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", {"city": "Oslo"})]),
    (Llama3(), " Hello {x}", " Hello {x}", []),
    (Generic(), '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", '
     '"arguments": {"tz": "\\u00e9\\ud83d\\ude00"}}]}', "", [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "é😀"})]),
    (Generic(), '{"response": "Hi \\"there\\"\\n\\u00e9 \\ud83d\\ude00."}', 'Hi "there"\né 😀.', []),
    (Generic(), '{"response": "Cut \\u00', "Cut ", []),
    (Generic(), '{"response": "Write \\\\ud83d as \\ud83d\\ude00"}', "Write \\ud83d as 😀", []),  # an escaped backslash
    (Hermes(), '\n Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "Sure.", [("f", {})]),
    (Llama3(), '\x0c{"name": "f", "parameters": {"x": 1}}', '\x0c{"name": "f", "parameters": {"x": 1}}', []),  # free text
    (Generic(), '{"tool_calls": [{"name": "f", "arguments": {"t":1.50, "c": "Z\\u00fcrich"}}]}', "",
     [("f", {"t": 1.5, "c": "Zürich"})]),  # compact, as the grammar allows: written again, it read {"t": 1.5, ...}
])
def test_a_stream_hands_out_content_and_each_call_in_pieces(format, text, content, calls):
    """Fed in pieces of any size, the reader hands out content that the whole answer keeps (never
    the start of a call), each call's id and name once written and then its arguments' JSON text as
    it comes: put together as a client does, the pieces are the calls the whole answer holds."""
    for size in (1, 2, 3, 7, len(text)):
        reader = ToolText(format)
        out, pieces = "", []
        for i in range(0, len(text), size):
            piece, deltas = reader.feed(text[i : i + size])
            out, pieces = out + piece, pieces + [d.openai() for d in deltas]
        rest, whole, got = reader.finish()
        assert out + rest == whole == content and [(c.name, c.arguments) for c in got] == calls
        assert streamed_calls(pieces) == calls and not reader.unsent(got)
        assert [p["id"] for p in pieces if "id" in p] == [c.id for c in got]
        if size == 1 and calls:
            assert len(pieces) > 2 * len(calls)  # the arguments came in pieces, not whole
        # the whole reply's arguments are the text its pieces add up to, read whole too (as a request not streamed
        # reads it): json.dumps wrote them again ('{"name":"get_time","arguments":{}}' streamed '{}' either way, but
        # '{"city": "Os\\"lo {x}", "n": [1, {"a": "]}"}]}' came back with other spaces where the model wrote others)
        texts = [p["function"]["arguments"] for p in pieces]
        joined = ["".join(t for p, t in zip(pieces, texts) if p["index"] == k) for k in range(len(calls))]
        whole_reader = ToolText(format)
        whole_reader.feed(text, calls=False)
        assert [c.arguments_text for c in whole_reader.finish()[2]] == [c.arguments_text for c in got] == joined


DEEP: dict = {"type": "string"}
for _ in range(600):  # deeper than Python's recursion allows json.dumps to write
    DEEP = {"type": "object", "properties": {"a": DEEP}}


@pytest.mark.parametrize("tools, choice, words", [
    ("get_weather", None, "tools must be a non-empty list"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "must be 1 to 64 letters"),
    ([WEATHER, WEATHER], None, "twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "must be a JSON Schema object"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "not among the tools (get_weather)"),
    ([WEATHER], "sometimes", 'tool_choice must be "auto", "required", "none"'),
    (None, "required", "needs tools to choose from"),
    ([{"type": "function", "function": {"name": "f\n"}}], None, "must be 1 to 64 letters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "must describe an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": DEEP}}], None, "nest deeper than 64 levels"),
])
def test_bad_tools_are_refused_in_one_line(tools, choice, words):
    with pytest.raises(ConfigError, match=None) as e:
        Tools.of(tools, choice)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_tools_with_a_response_format_or_bad_arguments_are_refused(generic):
    with pytest.raises(ConfigError, match="tools and response_format both shape the answer"):
        generic.chat(ASK, tools=[WEATHER], response_format={"type": "json_object"}, max_new_tokens=8)
    bad = [*ASK, {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]
    with pytest.raises(FeedError, match="has arguments that are not JSON"):
        generic.chat(bad, tools=[WEATHER], max_new_tokens=8)
    assert Tools.of([WEATHER], "none") is None and Tools.of([], None) is None


def test_a_chat_template_that_is_not_a_file_or_does_not_parse_is_refused(smollm2_artifact, tmp_path):
    from slimml.serve import ServeConfig

    with pytest.raises(ConfigError, match="is not a file; give the path of a Jinja chat template"):
        ServeConfig(str(smollm2_artifact), chat_template=str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}", encoding="utf-8")
    with pytest.raises(Exception, match="does not parse"):
        ServeConfig(str(smollm2_artifact), chat_template=str(broken))
    with pytest.raises(ConfigError, match="is not a file"):
        load(smollm2_artifact).use_chat_template(str(tmp_path / "missing.jinja"))


def test_served_with_a_hermes_template_the_client_gets_the_calls_and_the_streamed_text(ray_env, smollm2_artifact, hermes,
                                                                                       tmp_path):
    """``slimml serve --chat-template``: the Hermes format through the real client, streamed and
    not, equal to in process; a text answer streams as text, never showing ``<tool_call>``; with
    ``chat_template_kwargs`` opening a ``<think>`` block, the thoughts come as ``reasoning_content``."""
    openai = pytest.importorskip("openai")
    from conftest import serving
    from slimml.serve import ServeConfig

    path = tmp_path / "hermes.jinja"
    path.write_text(HERMES, encoding="utf-8")
    config = ServeConfig(str(smollm2_artifact), name="smollm2", max_running=4, max_new_tokens=80, chat_template=str(path))
    with serving(config) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        for choice, parallel in (("required", False), ({"type": "function", "function": {"name": "get_time"}}, True)):
            want = hermes.chat(ASK, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel, max_new_tokens=80)
            r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                               parallel_tool_calls=parallel, max_tokens=80, temperature=0)
            got = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
            assert got == _calls(want) and r.choices[0].finish_reason == "tool_calls"
            chunks = list(client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                                         parallel_tool_calls=parallel, max_tokens=80, temperature=0, stream=True))
            deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
            assert streamed_calls(deltas) == got and len(deltas) > len(got)
        want = hermes.chat(ASK, tools=[WEATHER, TIME], max_new_tokens=80)  # auto: this model answers in text
        chunks = list(client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], max_tokens=80,
                                                     temperature=0, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.texts[0] and "<tool" not in text and len([c for c in chunks if c.choices]) > 3
        # a reasoning model's thoughts (the template opens a <think> block when chat_template_kwargs asks): as
        # reasoning_content, as llama.cpp's and vLLM's servers give them (runtime/tasks/generation/reasoning.py)
        think = {"chat_template_kwargs": {"enable_thinking": True}}
        want = hermes.chat(ASK, max_new_tokens=12, **think)
        r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=12, temperature=0, extra_body=think)
        assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (want.reasoning[0], want.texts[0])
        assert want.reasoning[0] and want.texts[0] == "" and want.finish_reasons == ["length"]  # cut off in its thoughts
        deltas = [c.choices[0].delta for c in client.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=12, temperature=0, stream=True, extra_body=think) if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == want.reasoning[0]
        assert not "".join(d.content or "" for d in deltas)
        # the Responses API: the thoughts as a reasoning item, the Hermes calls as function_call items
        r = client.responses.create(model="smollm2", input=ASK, max_output_tokens=12, temperature=0, extra_body=think)
        assert [o.type for o in r.output] == ["reasoning"] and r.status == "incomplete"  # cut off in its thoughts
        assert r.output[0].content[0].text == want.reasoning[0] and r.output_text == ""
        with client.responses.stream(model="smollm2", input=ASK, max_output_tokens=12, temperature=0, extra_body=think) as s:
            thought = "".join(e.delta for e in s if e.type == "response.reasoning_text.delta")
        assert thought == want.reasoning[0]
        flat = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
        r = client.responses.create(model="smollm2", input=ASK, tools=flat, tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=80, temperature=0)
        want = hermes.chat(ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_new_tokens=80)
        assert [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"] == _calls(want)
        r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=12, temperature=0, extra_body=think,
                                           response_format={"type": "json_object"})
        assert r.choices[0].message.content.startswith("{") and getattr(r.choices[0].message, "reasoning_content", None) is None
        with pytest.raises(openai.BadRequestError, match="which the server sets itself"):
            client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4,
                                           extra_body={"chat_template_kwargs": {"messages": []}})


def test_forced_tokens_are_computed_several_a_pass_with_the_same_answer(generic, monkeypatch):
    """What the format forces (a call's wrapper and name, a schema's keys) is computed beside the
    newest token in one pass: fewer passes than tokens, the tokens of one pass a token (fp32)."""
    import slimml.runtime.tasks.generation.lookup as lookup

    named = {"type": "function", "function": {"name": "get_time"}}
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}}}
    asks = [(ASK, {"tools": [WEATHER, TIME], "tool_choice": named}),
            ([{"role": "user", "content": "A person's name and age, as JSON."}], {"response_format": schema})]
    for messages, options in asks:
        fast = generic.chat(messages, max_new_tokens=60, **options)
        monkeypatch.setattr(lookup, "FORCED", 0)
        plain = generic.chat(messages, max_new_tokens=60, **options)
        monkeypatch.undo()
        assert fast.tokens == plain.tokens and plain.passes == len(plain.tokens[0])
        assert fast.passes < len(fast.tokens[0]), (fast.passes, len(fast.tokens[0]))


def test_each_format_holds_its_calls_and_reads_them_back_whole(smollm2_artifact):
    """The grammars against SmolLM2's tokenizer: Llama 3's free text cannot hide a call behind
    whitespace; a schema's ``$defs`` references resolve in every format; a Hermes call whose
    argument holds ``</tool_call>`` is read whole."""
    import llguidance
    import tokenizers

    from slimml.runtime.tasks.generation.structured import ll_tokenizer

    tok = tokenizers.Tokenizer.from_file(str(smollm2_artifact / "tokenizer.json"))
    view = ll_tokenizer(tok, tok.get_vocab_size(), frozenset([2]))

    def takes(fmt, tools, text):
        matcher = llguidance.LLMatcher(view, llguidance.LLMatcher.grammar_from_lark(fmt.grammar(tools)), log_level=0)
        return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids) and matcher.is_accepting()

    weather = Tools.of([WEATHER])
    assert takes(Llama3(), weather, "Hello.") and takes(Llama3(), weather, '\n{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert not takes(Llama3(), weather, ' {"name": "evil", "parameters": {}}')
    booking = {"type": "function", "function": {"name": "book", "parameters": {
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}, "required": ["to"]}}}
    both = Tools.of([booking, WEATHER])
    assert takes(Hermes(), both, '<tool_call>\n{"name": "book", "arguments": {"to": {"city": "Rome"}}}\n</tool_call>')
    assert takes(Llama3(), both, '{"name": "book", "parameters": {"to": {"city": "Rome"}}}')
    assert takes(Generic(), both, '{"tool_calls": [{"name": "book", "arguments": {"to": {"city": "Rome"}}}]}')
    assert not takes(Generic(), both, '{"tool_calls": [{"name": "book", "arguments": {"to": {"town": "Rome"}}}]}')
    content, calls = Hermes().parse('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": "see </tool_call> here"}}\n</tool_call>')
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [("f", {"a": "see </tool_call> here"})]


def test_a_template_path_with_braces_continue_final_message_and_tools(smollm2_artifact, tmp_path):
    model = load(smollm2_artifact)
    folder = tmp_path / "odd_{name}"
    folder.mkdir()
    (folder / "t.jinja").write_text(HERMES, encoding="utf-8")
    model.use_chat_template(str(folder / "t.jinja"))  # a path, though it holds a brace
    from slimml.runtime.tasks.generate import chat_prompt

    assert chat_prompt(model, ASK).startswith("<|im_start|>system\nYou are a helpful assistant.")
    with pytest.raises(ConfigError, match="continue_final_message continues a reply as text"):
        model.chat([*ASK, {"role": "assistant", "content": "It is"}], tools=[WEATHER], continue_final_message=True,
                   add_generation_prompt=False, max_new_tokens=4)


def test_slimml_generate_offers_tools_from_a_file(smollm2_artifact, generic, hermes, tmp_path):
    """``slimml generate --chat --tools FILE [--tool-choice] [--chat-template]``: the calls print
    after the text (and under ``tool_calls`` with --json), the same as in process; misused flags
    are refused in one line."""
    from typer.testing import CliRunner

    from slimml.cli import app

    runner = CliRunner()
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER, TIME]), encoding="utf-8")
    (tmp_path / "hermes.jinja").write_text(HERMES, encoding="utf-8")
    ask = ["generate", str(smollm2_artifact), "--chat", ASK[0]["content"], "--tools", str(tmp_path / "tools.json"),
           "--max-new-tokens", "60"]
    r = runner.invoke(app, [*ask, "--tool-choice", "get_time", "--chat-template", str(tmp_path / "hermes.jinja"), "--json"])
    assert r.exit_code == 0, r.output
    want = hermes.chat(ASK, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                       max_new_tokens=60)
    out = json.loads(r.stdout)
    assert [(c["name"], c["arguments"]) for c in out["tool_calls"][0]] == _calls(want)
    assert out["finish_reasons"] == ["tool_calls"]
    r = runner.invoke(app, [*ask, "--tool-choice", "required"])
    call = generic.chat(ASK, tools=[WEATHER, TIME], tool_choice="required", max_new_tokens=60).tool_calls[0][0]
    assert r.exit_code == 0 and f"] {call.name}({json.dumps(call.arguments)})\n" in r.stdout, r.output
    for args, words in ((["generate", str(smollm2_artifact), "hi", "--tools", str(tmp_path / "tools.json")], "add --chat"),
                        ([*ask[:4], "--tools", str(tmp_path / "missing.json")], "cannot be read"),
                        ([*ask[:4], "--tool-choice", "required"], "add --tools FILE")):
        r = runner.invoke(app, args)
        assert isinstance(r.exception, ConfigError) and words in str(r.exception)


def test_a_call_turn_renders_as_each_template_reads_it():
    """An assistant's call sent the OpenAI way (content None, arguments as JSON text): DeepSeek-R1's
    template writes the calls only where content is none and joins the arguments to text, and
    lost the call (slimml gave content "" and an object); Llama 3.1's writes ``arguments | tojson``
    (an object); Phi-3's joins every content to text (None: transformers fails; slimml gives "")."""
    from slimml.runtime.tasks.generation.chat import ChatTemplate
    from slimml.runtime.tasks.generation.tools import template_messages

    deepseek = ("{% for m in messages %}{% if m.role == 'assistant' and m.content is none %}"
                "{% for t in m.tool_calls %}<call>{{ t.function.name }}"
                "{{ '\\n```json\\n' + t.function.arguments + '\\n```' }}</call>{% endfor %}"
                "{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}")
    llama31 = ("{% for m in messages %}{% if m.tool_calls %}{% for t in m.tool_calls %}"
               "{\"name\": \"{{ t.function.name }}\", \"parameters\": {{ t.function.arguments | tojson }}}"
               "{% endfor %}{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}")
    phi3 = "{% for m in messages %}{{ '<|' + m.role + '|>' + m.content + '<|end|>' }}{% endfor %}"
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = template_messages([{"role": "user", "content": "Weather?"},
                                  {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert ChatTemplate(deepseek).render(messages, add_generation_prompt=False) == (
        "<user>Weather?<call>get_weather\n```json\n{\"city\": \"Paris\"}\n```</call>")
    assert ChatTemplate(llama31).render(messages, add_generation_prompt=False) == (
        '<user>Weather?{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert ChatTemplate(phi3).render(messages, add_generation_prompt=False) == "<|user|>Weather?<|end|><|assistant|><|end|>"
    left_out = template_messages([{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [call]}])
    assert ChatTemplate(deepseek).render(left_out, add_generation_prompt=False).endswith("```</call>")  # as None
    printed = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"  # Gemma's: None would print "None"
    assert ChatTemplate(printed).render(left_out, add_generation_prompt=False) == "<user>Weather?<assistant>"
    from slimml.serve.openai import _messages  # the server's reading of a request's messages keeps None too

    served = _messages({"messages": [{"role": "user", "content": "Weather?"},
                                     {"role": "assistant", "content": None, "tool_calls": [call]}]})
    assert ChatTemplate(deepseek).render(template_messages(served), add_generation_prompt=False).endswith("```</call>")
    for arguments, shown in (("5", "5"), ('"text"', '"text"'), ("[1, 2]", "[1, 2]"), ({"a": {1, 2}}, None)):
        bad = {**call, "function": {"name": "f", "arguments": arguments}}
        if shown is None:  # a Python value JSON cannot write: kept, written as its text
            assert template_messages([{"role": "assistant", "tool_calls": [bad]}])[0]["tool_calls"][0]["function"]["arguments"]
            continue
        with pytest.raises(FeedError, match=f"has arguments {re.escape(shown)}; a call's arguments are a JSON object"):
            template_messages([{"role": "assistant", "tool_calls": [bad]}])
    qwen3 = ("{% for m in messages %}{% if m.reasoning_content is not none %}{{ m.reasoning_content }}{% endif %}"
             "{% if '</think>' in m.content %}!{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}")  # reads thoughts
    assert not ChatTemplate(qwen3).tests_none  # "reasoning_content is not none" is not content's test: Qwen3 failed
    assert ChatTemplate(qwen3).render(left_out, add_generation_prompt=False) == "<user>Weather?<assistant>"
    both = "{% if messages[1].content is none %}none {% endif %}" + phi3  # tests none, then joins it to text: ""
    assert ChatTemplate(both).render(left_out, add_generation_prompt=False) == "<|user|>Weather?<|end|><|assistant|><|end|>"
    spaced = template_messages([{"role": "assistant", "content": None, "tool_calls": [
        {**call, "function": {"name": "f", "arguments": '{ "city" :"Paris" }'}}]}])
    assert str(spaced[0]["tool_calls"][0]["function"]["arguments"]) == '{ "city" :"Paris" }'  # the text as sent


def test_tool_results_reach_a_template_that_does_not_write_the_tool_role():
    """Gemma's templates refuse a ``tool`` message ("roles must alternate"), Phi-4's drops it: a
    model that called a function never read its result. As llama.cpp does, such a template gets each
    result as a user turn (``{"tool_response": ...}``), one reply's results in one turn; a template
    that writes the role (probed, as llama.cpp probes) gets the messages as they are."""
    from slimml.runtime.tasks.generation.chat import ChatTemplate

    gemma = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
             "<{{ 'model' if m.role == 'assistant' else m.role }}>{{ m.content }}{% endfor %}")
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"temp": 21}'},
                {"role": "tool", "tool_call_id": "c2", "content": "dry"}]
    assert not ChatTemplate(gemma).writes_tool_results(False) and ChatTemplate(chatml).writes_tool_results(False)
    got = ChatTemplate(gemma).render(messages, add_generation_prompt=False)
    results = json.loads("[" + got.split("<user>")[-1].replace("}\n{", "},{") + "]")
    assert got.startswith("<user>Weather?<model><user>{") and results == [
        {"tool_response": {"tool": "get_weather", "tool_call_id": "c1", "content": '{"temp": 21}'}},
        {"tool_response": {"tool_call_id": "c2", "content": "dry"}}]
    assert "<|im_start|>tool\n{\"temp\": 21}<|im_end|>" in ChatTemplate(chatml).render(messages, add_generation_prompt=False)
    after = ChatTemplate(gemma).render([*messages, {"role": "user", "content": "And Rome?"}], add_generation_prompt=False)
    assert after.endswith('"dry"\n  }\n}\nAnd Rome?')  # the user's next words join the results' turn: roles alternate
    hermes = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools>{% endif %}"
              "{% for m in messages %}{% if m.role == 'tool' and not tools %}{% continue %}{% endif %}"
              "<{{ m.role }}>{{ m.content }}{% endfor %}")  # writes tool results only where tools are given
    only = ChatTemplate(hermes)
    assert only.writes_tool_results(True) and not only.writes_tool_results(False)
    assert "<tool>dry" in only.render(messages, add_generation_prompt=False, tools=[{"type": "function", "function": {"name": "f"}}])
    assert '<user>{\n  "tool_response"' in only.render(messages, add_generation_prompt=False)
