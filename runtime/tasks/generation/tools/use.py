"""A chat with tools as one model's template has them: what the template gets, the grammar
that holds the answer, and its reader."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slimml.errors import ConfigError
from slimml.runtime.tasks.generation.tools.calls import Tools
from slimml.runtime.tasks.generation.tools.formats import ToolFormat, tool_format
from slimml.runtime.tasks.generation.tools.text import ToolText


@dataclass(frozen=True)
class ToolUse:
    """A chat with tools, as one model's template has them written: what the template gets,
    what the answer is held to, and how it is read back.

    Example:
        >>> use = ToolUse.of(Tools.of([weather]), template_source)
        >>> prompt = template.render(use.messages(messages), **use.variables())
        >>> reader = use.text(); reader.feed(answer_text); rest, content, calls = reader.finish()
    """

    tools: Tools
    format: ToolFormat
    specials: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, tools: Tools, template: str, specials: dict[str, int] | None = None) -> ToolUse:
        """The use of ``tools`` with the chat template whose source is ``template`` (an unset
        ``parallel`` becomes the format's default); ``specials``: the model's special tokens by
        text, those of the format's markers kept."""
        from dataclasses import replace

        format = tool_format(template)
        marks = {m: specials[m] for m in format.used_markers(template) if specials and m in specials}
        return cls(tools if tools.parallel is not None else replace(tools, parallel=format.parallel), format, marks)

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.format.messages(messages, self.tools)

    def variables(self) -> dict[str, Any]:
        """The template's variables: ``tools`` as transformers passes them."""
        return {"tools": [dict(f) for f in self.tools.functions]}

    def config(self, config: Any, **changes: Any) -> Any:
        """``config`` (a GenerationConfig) with the answer held to the format's grammar (and
        ``changes`` to its other fields, in the same ``replace``)."""
        from dataclasses import replace

        if config.response_format is not None:
            raise ConfigError("tools and response_format both shape the answer, and only one can; leave response_format "
                              'out (a call\'s arguments already fit its schema), or pass tool_choice="none".')
        if self.specials:  # the calls' markers are special tokens, which the text must keep to be read
            changes = {**changes, "skip_special_tokens": False}
        if config.num_beams > 1:  # beam search takes no format: the calls' grammar holds the answer token by token
            changes = {**changes, "num_beams": 1}
        try:
            grammar = self.format.grammar(self.tools, self.specials)
            return replace(config, response_format={"type": "grammar", "grammar": grammar}, **changes)
        except ConfigError as e:  # a parameters schema llguidance cannot use: its words, not the grammar's listing
            detail = getattr(e, "detail", str(e)).split(" 1 | ")[0].strip()
            raise ConfigError(f"the tools' parameters cannot be used ({detail}); fix the function's parameters "
                              "JSON Schema.") from None

    def text(self) -> ToolText:
        """The reader of one answer as it streams."""
        return ToolText(self.format, self.tools)
