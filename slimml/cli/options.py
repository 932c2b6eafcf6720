"""Command-line options made from config dataclasses: each flag, default and help text is declared
once, on the config's field (as vLLM's ``EngineArgs.add_cli_args`` does), never retyped in the CLI.

A field becomes an option when its metadata has ``"help"``::

    @dataclass
    class DistillConfig:
        layers: int | None = field(default=None, metadata={"help": "Distil into a student with this many layers."})
        checkpointing: bool = field(default=False, metadata={"help": "...", "flags": ("--checkpointing",)})

Field metadata:
    help: the option's help text (fields without it are not options).
    flags: the option's names. With a long name they replace the default (``("--eval",)``,
        ``("--checkpointing",)`` for a switch with no ``--no-`` form); short ones alone are added
        to it (``["-k"]``: ``--resident -k``). Default: ``--`` and the field's name dashed, after
        the group's prefix (``--distill-layers``); a bool gets ``--name/--no-name``.
    envvar: an environment variable that gives the value when the flag is absent (``SLIMML_API_KEY``).
    type: what the command line parses, where the annotation is a union it cannot take. Default:
        the one type beside ``None``; ``Path`` for ``str | os.PathLike``; ``str`` for ``int | str``;
        a repeated option (``list[int]``) for ``tuple[int, ...]``.

A command takes the options of one or more configs with :func:`config_options`. Each group
replaces the command's parameter of the same name (its options appear there in ``--help``)
and arrives as :class:`OptionValues`::

    @app.command()
    @config_options(distill=Options(DistillConfig, prefix="distill"))
    def convert(source: str, distill: OptionValues = None):
        config = distill.build() if distill.changed() else None
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer


@dataclass(frozen=True)
class Options:
    """Which fields of ``config`` become options of a command.

    Args:
        config: the config dataclass.
        prefix: put before a field's name in its default flag (``prefix="distill"``: ``--distill-layers``).
        only: these fields, in this order (default: every field with help, in the class's order).
        defaults: this command's default for a field where it differs from the field's own
            (``quantize``'s ``--quantize`` defaults to ``int8``, ``convert``'s to ``none``).
    """

    config: type
    prefix: str = ""
    only: tuple[str, ...] | None = None
    defaults: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> list[dataclasses.Field]:
        """The fields that are options (they have help), in order."""
        by_name = {f.name: f for f in dataclasses.fields(self.config) if "help" in f.metadata}
        names = self.only if self.only is not None else list(by_name)
        missing = [n for n in names if n not in by_name]
        if missing:
            raise TypeError(f"{self.config.__name__} has no field with help named {missing}")
        return [by_name[n] for n in names]

    def default(self, f: dataclasses.Field) -> Any:
        if f.name in self.defaults:
            return self.defaults[f.name]
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        raise TypeError(f"{self.config.__name__}.{f.name} has no default; a command-line option needs one")

    def flags(self, f: dataclasses.Field) -> tuple[str, ...]:
        given = f.metadata.get("flags") or ()
        given = (given,) if isinstance(given, str) else tuple(given)
        if any(g.startswith("--") for g in given):
            return given
        name = "-".join(p for p in (self.prefix, f.name) if p).replace("_", "-")
        long = f"--{name}/--no-{name}" if self.cli_type(f) is bool else f"--{name}"
        return (long, *given)

    def long_flag(self, f: dataclasses.Field) -> str:
        """The name messages use: ``--resident`` of ``("--resident", "-k")``, ``--verify`` of ``--verify/--no-verify``."""
        names = [n.split("/")[0] for n in self.flags(f)]
        return next((n for n in names if n.startswith("--")), names[0])

    def cli_type(self, f: dataclasses.Field) -> type:
        if "type" in f.metadata:
            return f.metadata["type"]
        return _cli_type(typing.get_type_hints(self.config)[f.name])


@dataclass
class OptionValues:
    """What the command line gave for one config's options."""

    config: type
    values: dict[str, Any]  # field name -> the value given, or the default
    defaults: dict[str, Any]
    flags: dict[str, str]  # field name -> its long flag, for messages

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def changed(self) -> list[str]:
        """The flags (``--grad-accum``) whose value differs from the default, in field order."""
        return [self.flags[n] for n, v in self.values.items() if v != self.defaults[n]]

    def build(self, **more: Any) -> Any:
        """The config from the values given (and ``more`` fields); it checks itself."""
        return self.config(**self.values, **more)


def config_options(**groups: Options) -> Callable[[Callable], Callable]:
    """Give a Typer command the options of config dataclasses.

    Each keyword names a parameter of the command; that parameter is replaced by the config's
    options (in its place, for ``--help``), and the command receives an :class:`OptionValues`
    under that name. Apply it below ``@app.command()``.
    """

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)
        missing = [g for g in groups if g not in sig.parameters]
        if missing:
            raise TypeError(f"{fn.__name__} has no parameter {missing} for config options")
        params: list[inspect.Parameter] = []
        for p in sig.parameters.values():
            if p.name in groups:
                params += _parameters(p.name, groups[p.name])
            else:
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            for dest, group in groups.items():
                values = {f.name: kwargs.pop(_param_name(dest, f)) for f in group.fields()}
                defaults = {f.name: group.default(f) for f in group.fields()}
                flags = {f.name: group.long_flag(f) for f in group.fields()}
                kwargs[dest] = OptionValues(group.config, values, defaults, flags)
            return fn(**kwargs)

        command.__signature__ = sig.replace(parameters=params)  # what Typer reads
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # Typer must see the new signature, not the function's own
        return command

    return wrap


def _parameters(dest: str, group: Options) -> list[inspect.Parameter]:
    out = []
    for f in group.fields():
        default = group.default(f)
        kind = group.cli_type(f)
        if default is None:
            kind = Optional[kind]
        env = {"envvar": f.metadata["envvar"], "show_envvar": True} if "envvar" in f.metadata else {}
        option = typer.Option(*group.flags(f), help=f.metadata["help"], **env)
        out.append(inspect.Parameter(_param_name(dest, f), inspect.Parameter.KEYWORD_ONLY, default=default,
                                     annotation=Annotated[kind, option]))
    return out


def _param_name(dest: str, f: dataclasses.Field) -> str:
    return f"{dest}__{f.name}"


def _cli_type(hint: Any) -> type:
    """The type the command line parses for a field's annotation."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(members) == 1:
            return _cli_type(members[0])
        if any(m in (Path, os.PathLike) or typing.get_origin(m) is os.PathLike for m in members):
            return Path
        if str in members:
            return str
        raise TypeError(f"no command-line type for {hint}; give metadata type=")
    if hint is os.PathLike or typing.get_origin(hint) is os.PathLike:
        return Path
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return list[args[0]]  # a repeated option; the config turns the list into its tuple
    return hint
