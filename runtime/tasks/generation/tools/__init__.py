"""Tool calls: the functions a chat may call, how a model family's chat template writes a call,
the grammar that holds each call to its function's parameters, and the calls read back out.

A request gives ``tools`` (OpenAI's ``[{"type": "function", "function": {"name", "description",
"parameters"}}]``) and ``tool_choice`` (``"auto"``, ``"required"``, ``"none"``, or one function by
name). The chat template gets ``tools`` as transformers passes them; what the model writes is then
read by its family's :class:`ToolFormat`, chosen from the template itself (as llama.cpp's server
chooses): ``<tool_call>`` in the template is the Hermes format (Qwen 2.5 and 3, Hermes, SmolLM3),
``<|python_tag|>`` or a "JSON for a function call" instruction is Llama 3.1-3.3's, ``[TOOL_CALLS]``
is Mistral's (a list of calls, or ``NAME[ARGS]{...}`` where the template writes ``[ARGS]``),
harmony's ``<|call|>`` is gpt-oss's, and a template
that knows no tools gets the generic format, where slimml describes the tools in a system message
and the answer is one JSON object, ``{"tool_calls": [...]}`` or ``{"response": "..."}``.

Every format is held by a grammar (:mod:`~slimml.runtime.tasks.generation.structured`): with
``auto`` the model may write text freely, and once it begins a call, the call must name one of
the functions and give arguments its JSON Schema allows; with ``required`` or a named function
the answer is calls only. So a call that comes back always parses and always fits its schema (one
cut by ``max_new_tokens`` excepted: it stays text).

The package, one job a module: :mod:`.calls` (the tools checked, the calls made, earlier calls as
templates take them), :mod:`.formats` (the families' formats, behind :func:`register_format`),
:mod:`.scan` (an answer's JSON read as it streams), :mod:`.text` (:class:`ToolText`, the reader of
one answer) and :mod:`.use` (:class:`ToolUse`, a chat with tools for one model's template).
"""

from slimml.runtime.tasks.generation.tools.calls import (MAX_DEPTH, NAME, CallDelta, ToolCall, Tools, call_arguments,
                                                         finish_reason, template_messages)
from slimml.runtime.tasks.generation.tools.formats import (FORMATS, Generic, Harmony, Hermes, Llama3, MistralArgs,
                                                           MistralJSON, ToolFormat, register_format, tool_format)
from slimml.runtime.tasks.generation.tools.scan import CallSpan
from slimml.runtime.tasks.generation.tools.text import ToolText
from slimml.runtime.tasks.generation.tools.use import ToolUse

__all__ = ["CallDelta", "CallSpan", "FORMATS", "Generic", "Harmony", "Hermes", "Llama3", "MAX_DEPTH", "MistralArgs",
           "MistralJSON", "NAME", "ToolCall", "ToolFormat", "ToolText", "ToolUse", "Tools", "call_arguments",
           "finish_reason", "register_format", "template_messages", "tool_format"]
