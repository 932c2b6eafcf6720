"""A chat template is code that a server runs for every request: one that loops for ever or builds a
string of gigabytes is stopped within the budget (runtime/tasks/generation/template_budget.py),
in one line, and real templates render as before."""

import time

import pytest

from slimml.errors import SlimmlError
from slimml.runtime.tasks.generation.chat import ChatTemplate
from slimml.runtime.tasks.generation.template_budget import RENDER_SECONDS

MESSAGES = [{"role": "user", "content": "Hi: 50% of 1234567890123 {x} %s"}]

HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    "string product": "{{ 'x' * 1000000000 }}",
    "list product joined": "{{ (range(100000)|list * 1000)|join }}",
    "power": "{{ 10 ** 100000000 }}",
    "filter width": "{{ 'a'|center(1000000000) }}",
    "format filter width": "{{ '%1000000000s'|format('a') }}",
    "str.format width": "{{ '{:>1000000000}'.format('a') }}",
    "percent width": "{{ '%1000000000s' % 'a' }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "exponential macro": "{% macro f(n) %}{% if n < 40 %}{{ f(n+1) }}{{ f(n+1) }}{% endif %}{% endmacro %}{{ f(0) }}x",
    "growing replace": "{% set s = 'a' * 10000 %}{{ s|replace('a', s) }}",
    "endless output": "{% for i in range(100000) %}{% for j in range(9) %}{{ 'y' * 100 }}{% endfor %}{% endfor %}",
    # sized before they are built (a review found each allocating 0.3-0.6 GB, or 16 GB for [s] * 1000, first)
    "a list of big strings printed": "{% set s = 'x' * 16000000 %}{% set l = [s, s, s, s, s, s, s, s, s, s] %}{{ l }}",
    "a list of big strings joined": "{% set s = 'x' * 16000000 %}{{ ([s] * 20)|join|length }}",
    "a tuple of big strings formatted": "{% set s = 'x' * 16000000 %}{{ ('%s' * 10) % (s, s, s, s, s, s, s, s, s, s) }}",
    "str.format of big strings": "{% set s = 'x' * 16000000 %}{{ '{}{}{}{}'.format(s, s, s, s) }}",
    "a list repeated a thousand times": "{% set s = 'x' * 16000000 %}{{ [s] * 1000 }}",
    # single steps that took seconds to minutes: |map's filter calls, an integer squared over and over
    "map over a huge list": "{% set big = range(100000)|list * 100 %}{{ big|map('string')|join|length }}",
    "an integer squared": "{% set ns = namespace(x=3) %}{% for i in range(30) %}{% set ns.x = ns.x * ns.x %}{% endfor %}x",
    "a width of 8,001 digits": "{% set x = 10 ** 4000 %}{{ 'a'|center(x * x) }}",
    "str.ljust width": "{{ 'a'.ljust(1000000000) }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_runaway_template_is_stopped_in_one_line(name):
    template = ChatTemplate(HOSTILE[name], given=True)
    started = time.monotonic()
    with pytest.raises(SlimmlError) as e:
        template.render(MESSAGES)
    assert time.monotonic() - started < RENDER_SECONDS + 2
    message = str(e.value)
    assert "\n" not in message and "budget" in message and "fix the template" in message, message


def test_a_recursive_loop_s_inner_items_are_counted():
    """``loop(children)`` in a recursive For went round its items uncounted (only the 2 s deadline held it)."""
    source = ("{% set big = range(100000)|list * 12 %}{% for x in [1] recursive %}{% if loop.depth == 1 %}{{ loop(big) }}"
              "{% endif %}{% endfor %}x")  # counted: refused at the call, before going round
    for call in ("loop(big)", "loop(iterable=big)"):
        with pytest.raises(SlimmlError, match="more than 1,000,000 loop steps and calls"):
            ChatTemplate(source.replace("loop(big)", call), given=True).render(MESSAGES)
    tree = [{"role": "user", "content": "a", "children": [{"role": "user", "content": "b", "children": []}]}]
    nested = "{% for m in messages recursive %}{{ m.content }}{% if m.children %}{{ loop(m.children) }}{% endif %}{% endfor %}"
    assert ChatTemplate(nested, given=True).render(tree) == "ab"


def test_large_numbers_in_messages_render():
    """GLM-4.5's tool-call line with an order id past 16,777,216 was refused as a "width" (every
    number given to a filter was checked): only widths and counts are."""
    source = ("{% for m in messages %}{% for tc in m.tool_calls or [] %}{% for k, v in tc.function.arguments.items() %}"
              "<arg_key>{{ k }}</arg_key><arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}"
              "</arg_value>{% endfor %}{% endfor %}{% endfor %}{{ 1700000000|string }} {{ '%d' % 12345678901 }}")
    calls = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_order",
                                                                              "arguments": {"order_id": 12345678901}}}]}]
    text = ChatTemplate(source, given=True).render(calls)
    assert text == "<arg_key>order_id</arg_key><arg_value>12345678901</arg_value>1700000000 12345678901"


def test_real_template_features_render_as_before():
    """Loops with loop.last/length and else, selectattr, filters, format, replace, ~ and a message
    whose text has percent signs, braces and long numbers (never taken for a format string)."""
    source = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content|trim }}|{{ '%s'|format(m.content) }}|"
              "{{ m.content.replace('Hi', 'Yo') ~ '!' }}{% if loop.last %} L{{ loop.length }}{% endif %}{% endfor %}"
              "{% for m in messages|selectattr('role', 'equalto', 'system') %}s{% else %} none{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    text = ChatTemplate(source, given=True).render(MESSAGES)
    content = MESSAGES[0]["content"]
    assert text == (f"<|user|>{content}|{content}|{content.replace('Hi', 'Yo')}! L1 none<|assistant|>")


def test_a_long_conversation_fits_the_budget():
    source = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content | trim + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} " + "word " * 50} for i in range(5000)]
    text = ChatTemplate(source, given=True).render(messages)
    assert text.count("<|im_end|>") == 5000 and text.endswith("<|im_start|>assistant\n")
