"""A bound on what one chat template rendering may spend.

A chat template is code: Jinja's sandbox keeps it from the process's objects, not from running for
ever or filling memory. The template ships with the artifact (so the manifest's hashes vouch for
it) or comes from the caller, and a server renders it for every request; a template with a loop
that does not end, or one that builds a string of gigabytes, would stall that server. Real templates
take a few loop steps and calls per message, so the bounds below are far above any of them:

- **steps**: loop iterations, calls (macros, methods, globals), filters and operators, at most
  ``RENDER_STEPS`` in all;
- **time**: at most ``RENDER_SECONDS``, checked at every step;
- **size**: no string or list past ``RENDER_CHARS`` characters of text is built by ``*``, ``+``,
  ``~``, ``%``, ``.format``, a filter that writes text or a printed ``{{ value }}`` (sized from its
  parts before it is built, :func:`text_size`, so none is allocated), no width or count past it is
  given to ``center``, ``indent``, ``ljust``... , no integer past 65,536 bits is made, and the
  rendered text stops there too.

The For loops (and a recursive loop's ``loop(...)`` calls), ``~`` joins and printed values of a parsed template are routed through the ``Budget``
extension's methods (which a template cannot rebind), binary operators and calls through the
``BudgetedSandbox``, filters through :func:`budgeted_filter`; each counts against the current
rendering's :class:`Meter`.
"""

from __future__ import annotations

import functools
import re
import time
from contextvars import ContextVar
from typing import Any

RENDER_STEPS = 1_000_000
RENDER_SECONDS = 2.0
RENDER_CHARS = 1 << 24  # 16 Mi characters: a prompt is at most a context of tokens, far below

_meter: ContextVar[Meter | None] = ContextVar("slimml_template_meter", default=None)
_BIG_FIELD = re.compile(r"\d{9,}")  # a width or precision of 9+ digits in a format string ('%1000000000s')


class OverBudget(Exception):
    """A rendering went past one of the bounds; the text says which."""


class Meter:
    """One rendering's steps and deadline; ``with Meter():`` makes it the current one."""

    __slots__ = ("steps", "deadline", "_token")

    def __init__(self):
        self.steps = 0
        self.deadline = time.monotonic() + RENDER_SECONDS

    def __enter__(self) -> Meter:
        self._token = _meter.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _meter.reset(self._token)

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > RENDER_STEPS:
            raise OverBudget(f"more than {RENDER_STEPS:,} loop steps and calls")
        if time.monotonic() > self.deadline:
            raise OverBudget(f"more than {RENDER_SECONDS:g} s")


def step(n: int = 1) -> None:
    """Count ``n`` steps against the current rendering (none outside one: compiling folds constants)."""
    meter = _meter.get()
    if meter is not None:
        meter.step(n)


def check_size(n: int, what: str) -> None:
    if n > RENDER_CHARS:
        raise OverBudget(f"{what} of {_num(n)} characters or items (more than {RENDER_CHARS:,})")


def _num(n: int) -> str:
    """``n`` for a message: a number past 19 digits by its count of digits (formatting one of 5,000
    digits is itself refused by Python)."""
    return f"{n:,}" if abs(n).bit_length() < 64 else f"a {int(abs(n).bit_length() * 0.30103) + 1:,}-digit number"


def text_size(x: Any, limit: int = RENDER_CHARS) -> int:
    """About the characters ``str(x)``, ``tojson`` or ``join`` would write for ``x``, counted without
    writing them: strings' lengths, containers' items (2 a separator), numbers' digits; it stops
    counting once past ``limit`` (a list of 16 million references costs nothing to count then)."""
    stack, n = [x], 0
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            n += len(v) + 2
        elif isinstance(v, bool) or v is None:
            n += 5
        elif isinstance(v, int):
            n += int(abs(v).bit_length() * 0.30103) + 2
        elif isinstance(v, (list, tuple, set, frozenset, dict)):
            if n + 2 * len(v) > limit:
                return limit + 1
            n += 2
            stack.extend(v.items() if isinstance(v, dict) else v)
        else:
            n += 24
        if n > limit:
            return n
    return n


WIDTH_FILTERS = frozenset({"do_center", "do_indent", "do_truncate", "do_wordwrap", "do_batch", "do_slice", "do_round"})
TEXT_FILTERS = frozenset({"do_join", "do_tojson", "_tojson", "do_string", "do_indent", "do_center", "do_format",
                          "do_replace", "do_wordwrap", "do_pprint", "do_urlencode", "do_xmlattr", "do_list"})
WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})  # str methods given a width


def _check_widths(numbers) -> None:
    """A width or count past RENDER_CHARS (real templates give a few)."""
    for x in numbers:
        if isinstance(x, int) and not isinstance(x, bool) and abs(x) > RENDER_CHARS:
            raise OverBudget(f"a width or count of {_num(x)} (more than {RENDER_CHARS:,})")


def _check_format(fmt: Any) -> None:
    """A format string's own widths ('%1000000000s', '{:>1000000000}'); the values it formats are
    the messages' text, never checked."""
    if isinstance(fmt, str) and _BIG_FIELD.search(fmt):
        raise OverBudget("a format string with a field width of 9 or more digits")


def _checked_result(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple)):
        check_size(len(value), "a result")
    return value


def budgeted_filter(f):
    """``f`` (a Jinja filter) counted as a step (``|map`` calls one an item), its widths and the text
    it would write checked first, its result's size after."""
    value_at = 1 if hasattr(f, "jinja_pass_arg") else 0  # pass_context / eval_context / environment: value second
    name = f.__name__

    @functools.wraps(f)  # keeps jinja_pass_arg (pass_context, pass_eval_context, pass_environment)
    def run(*args, **kwargs):
        step()
        if name in WIDTH_FILTERS:
            _check_widths([*args[value_at + 1:], *kwargs.values()])
        if name in TEXT_FILTERS and len(args) > value_at:
            check_size(text_size(args[value_at]), "a filter's text")
        if name == "do_replace":
            _check_replace(args, kwargs)
        elif name == "do_format":
            _check_format(args[0] if args else None)
            check_size(text_size(args) + text_size(kwargs), "a formatted string")
        return _checked_result(f(*args, **kwargs))
    return run


def _check_replace(args: tuple, kwargs: dict) -> None:
    strings = [a for a in args if isinstance(a, str)][-3:]  # (eval_ctx,) s, old, new
    if len(strings) == 3:
        s, old, new = strings
        grows = len(new) - len(old)
        if grows > 0:
            hits = s.count(old) if old else len(s) + 1
            check_size(len(s) + hits * grows, "a replaced string")


@functools.cache
def sandbox_class():
    """The sandboxed environment class with the budget's hooks (jinja2 is imported only when a
    template is compiled, as chat.py does)."""
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, op, left, right):
            step()
            ints = isinstance(left, int) and isinstance(right, int)
            if op == "*" and ints:
                if abs(left).bit_length() + abs(right).bit_length() > 1 << 16:
                    raise OverBudget("a product of more than 65,536 bits")
            elif op == "*":
                seq, n = (left, right) if isinstance(left, (str, bytes, list, tuple)) else (right, left)
                if isinstance(n, int) and isinstance(seq, (str, bytes)):
                    check_size(len(seq) * max(n, 0), "a repeated string")
                elif isinstance(n, int) and isinstance(seq, (list, tuple)):
                    check_size(text_size(seq) * max(n, 0), "a repeated list")
            elif op == "+" and not ints:
                check_size(text_size(left) + text_size(right), "a joined string or list")
            elif op == "**" and ints and abs(left) > 1 and right > 0:
                if right * abs(left).bit_length() > 1 << 16:
                    raise OverBudget("a power of more than 65,536 bits")
            elif op == "%" and isinstance(left, str):
                _check_format(left)
                check_size(text_size(left) + text_size(right), "a formatted string")
            return _checked_result(self.binop_table[op](left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
            step()
            if isinstance(__obj, LoopContext):  # a recursive loop's loop(children): its steps as a For's
                if args:
                    args = (metered(args[0]), *args[1:])
                elif "iterable" in kwargs:
                    kwargs = {**kwargs, "iterable": metered(kwargs["iterable"])}
            if getattr(__obj, "__name__", None) in WIDTH_METHODS and isinstance(getattr(__obj, "__self__", None), str):
                _check_widths([*args, *kwargs.values()])
            return _checked_result(super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value):  # 'text'.format / .format_map, looked up: its own widths, then its values
            if getattr(value, "__name__", None) not in ("format", "format_map"):
                return super().wrap_str_format(value)
            _check_format(getattr(value, "__self__", None))
            formatting = super().wrap_str_format(value)
            if formatting is None:
                return None
            size = len(value.__self__)

            def sized(*args, **kwargs):
                check_size(size + text_size(args) + text_size(kwargs), "a formatted string")
                return formatting(*args, **kwargs)
            return sized

    return BudgetedSandbox


@functools.cache
def budget_extension():
    """The extension whose methods the parsed template's For loops and ``~`` are routed through."""
    from jinja2.ext import Extension

    class Budget(Extension):
        def steps(self, iterable):
            return metered(iterable)

        def concat(self, *parts):
            check_size(sum(text_size(p) for p in parts), "a ~ joined string")
            return "".join(map(str, parts))

        def out(self, value):  # a value printed with {{ }}: its text checked before it is written
            if not isinstance(value, str):
                check_size(text_size(value), "a printed value")
            return value

    return Budget


def metered(iterable):
    """A loop's iterable, its steps counted: all at once where it has a length, else one per item."""
    try:
        n = len(iterable)
    except TypeError:  # a generator (a filter's |map, |select...): one step per item
        return _counted(iterable)
    step(max(n, 1))
    return iterable


def _counted(iterable):
    step()
    for x in iterable:
        step()
        yield x


def meter_template(env, source: str):
    """``source`` parsed in ``env`` (which has the ``Budget`` extension), its For loops' iterables and
    ``~`` joins routed through the extension, compiled."""
    from jinja2 import nodes

    tree = env.parse(source)
    budget = env.extensions[budget_extension().identifier]
    for loop in tree.find_all(nodes.For):
        loop.iter = budget.call_method("steps", [loop.iter], lineno=loop.lineno)
    for output in list(tree.find_all(nodes.Output)):  # {{ value }}: its text sized before it is written
        output.nodes = [n if isinstance(n, nodes.TemplateData) else budget.call_method("out", [n], lineno=n.lineno)
                        for n in output.nodes]
    for parent in tree.find_all(nodes.Node):  # ~ joins: replace each Concat where it sits
        for field in parent.fields:
            value = getattr(parent, field, None)
            if isinstance(value, nodes.Concat):
                setattr(parent, field, budget.call_method("concat", value.nodes, lineno=value.lineno))
            elif isinstance(value, list):
                setattr(parent, field, [budget.call_method("concat", v.nodes, lineno=v.lineno)
                                        if isinstance(v, nodes.Concat) else v for v in value])
    return env.from_string(tree)


def render(template, **context) -> str:
    """``template`` rendered within the budget; :class:`OverBudget` past it."""
    with Meter():
        out, size = [], 0
        for chunk in template.generate(**context):
            size += len(chunk)
            check_size(size, "rendered text")
            out.append(chunk)
            step(0)  # the deadline, between chunks
        return "".join(out)


__all__ = ["OverBudget", "RENDER_CHARS", "RENDER_SECONDS", "RENDER_STEPS", "budget_extension", "budgeted_filter",
           "meter_template", "render", "sandbox_class"]
