"""Command-line options made from a config dataclass's fields (slimml.cli.options)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from slimml.cli.options import Options, OptionValues, config_options


@dataclass
class TrainConfig:
    """A config as slimml's are: help in the metadata, checks in __post_init__."""

    layers: int | None = field(default=None, metadata={"help": "Layers to keep."})
    data: str | os.PathLike | None = field(default=None, metadata={"help": "Texts to train on."})
    budget: int | str | None = field(default=None, metadata={"help": "Memory, e.g. 2GB.", "flags": ("--budget",)})
    batch_size: int = field(default=32, metadata={"help": "Texts per batch."})
    fast: bool = field(default=False, metadata={"help": "Go fast.", "flags": ("--fast", "-f")})
    pin: tuple[int, ...] | None = field(default=None, metadata={"help": "A shard to keep (repeat)."})
    resident: int | None = field(default=None, metadata={"help": "Shards at once.", "flags": ["-k"]})  # a short form added
    verify: bool = field(default=True, metadata={"help": "Check the result."})
    seed: int = 0  # no help: not an option

    def __post_init__(self):
        if self.batch_size < 2:
            raise ValueError(f"batch size {self.batch_size} must be >= 2")


def _app(**groups: Options):
    app = typer.Typer()
    seen = {}

    @app.command()
    @config_options(**groups)
    def run(name: Annotated[str, typer.Argument()], train: OptionValues = None):
        seen["values"] = train
        seen["name"] = name

    return app, seen


def test_fields_with_help_become_options_with_their_defaults_and_help():
    app, seen = _app(train=Options(TrainConfig, prefix="train"))
    r = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for flag, help_text in (("--train-layers", "Layers to keep."), ("--train-data", "Texts to train on."),
                            ("--budget", "Memory, e.g. 2GB."), ("--train-batch-size", "Texts per batch."),
                            ("--fast", "Go fast."), ("--train-verify", "Check the result.")):
        assert flag in r.output and help_text in r.output
    assert "--no-train-verify" in r.output and "--no-fast" not in r.output and "seed" not in r.output
    assert "[default: 32]" in r.output

    r = CliRunner().invoke(app, ["x", "--train-layers", "3", "--train-data", "t.txt", "--budget", "2GB", "-f",
                                 "--train-pin", "1", "--train-pin", "-1", "-k", "2"])
    assert r.exit_code == 0, r.output
    got = seen["values"]
    assert got["layers"] == 3 and got["data"] == Path("t.txt") and got["budget"] == "2GB" and got["fast"] is True
    assert got["pin"] == [1, -1] and got["resident"] == 2
    assert got.changed() == ["--train-layers", "--train-data", "--budget", "--fast", "--train-pin", "--train-resident"]
    config = got.build(seed=7)
    assert isinstance(config, TrainConfig) and config.seed == 7 and config.batch_size == 32


def test_a_command_can_pick_fields_and_change_a_default():
    app, seen = _app(train=Options(TrainConfig, only=("batch_size", "layers"), defaults={"batch_size": 8}))
    r = CliRunner().invoke(app, ["x"])
    assert r.exit_code == 0, r.output
    assert seen["values"].values == {"batch_size": 8, "layers": None} and seen["values"].changed() == []
    r = CliRunner().invoke(app, ["x", "--batch-size", "1"])
    assert r.exit_code == 0 and seen["values"]["batch_size"] == 1
    with pytest.raises(ValueError, match="must be >= 2"):  # the config checks itself when built
        seen["values"].build()


def test_mistakes_in_the_declaration_fail_at_import():
    with pytest.raises(TypeError, match="no field with help"):
        _app(train=Options(TrainConfig, only=("seed",)))
    with pytest.raises(TypeError, match="no parameter"):
        _app(other=Options(TrainConfig))
