"""Command-line flags written once, on the dataclass field they set: `field(default=...,
metadata=flag("--max-slots", "help ..."))`. `add_flags` gives an argparse group every flagged field
of a dataclass (nested dataclass fields too, their own fields flagged), `from_flags` builds the
dataclass back from the parsed arguments, and `to_argv` writes a value as the flags that give it
(a child process's command line). No imports beyond the standard library: config.py uses it."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


def flag(name: str, help: str, **argparse_options: Any) -> dict:
    """A field's metadata: its flag, its help (argparse's %(default)s works), and argparse's other
    options (type where the default is None, choices, metavar)."""
    return {"flag": name, "help": help, **argparse_options}


def _flagged(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata or _nested(f) is not None]


def _nested(f: dataclasses.Field):
    """The dataclass a field holds (its default's class), where that class flags its own fields."""
    default = f.default if f.default is not dataclasses.MISSING else None
    return type(default) if dataclasses.is_dataclass(default) and not isinstance(default, type) else None


def _dest(f: dataclasses.Field) -> str:
    return f.metadata["flag"].lstrip("-").replace("-", "_")


def add_flags(group, cls, skip: tuple[str, ...] = (), defaults: dict | None = None) -> None:
    """Every flagged field of `cls` (dataclass) as an argument of `group`, but those named in `skip`;
    `defaults`: field name -> a default of this command's own."""
    defaults = defaults or {}
    for f in _flagged(cls):
        if f.name in skip:
            continue
        inner = _nested(f)
        if inner is not None:
            add_flags(group, inner)
            continue
        options = {k: v for k, v in f.metadata.items() if k not in ("flag", "required")}
        default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else None)
        if isinstance(default, bool) and "action" not in options:
            options["action"] = "store_true"
        elif "type" not in options and default is not None and "choices" not in options:
            options["type"] = type(default)
        group.add_argument(f.metadata["flag"], default=default, **options)


def from_flags(cls, args: argparse.Namespace, **given: Any):
    """`cls` from the parsed flags (a flag this command does not have: the field's default) and `given`."""
    values = {}
    for f in _flagged(cls):
        if f.name in given:
            continue
        inner = _nested(f)
        if inner is not None:
            values[f.name] = from_flags(inner, args)
        elif hasattr(args, _dest(f)):
            values[f.name] = getattr(args, _dest(f))
    return cls(**values, **given)


def to_argv(value) -> list[str]:
    """The flags that give `value`'s flagged fields (its nested dataclasses' too)."""
    argv: list[str] = []
    for f in _flagged(type(value)):
        field_value = getattr(value, f.name)
        if _nested(f) is not None:
            argv += to_argv(field_value)
        elif isinstance(field_value, bool):
            argv += [f.metadata["flag"]] if field_value else []
        elif field_value is not None:
            argv += [f.metadata["flag"], str(field_value)]
    return argv
