"""Command-line flags generated from dataclass fields, as vLLM builds its parser from its configs.

A field whose metadata holds a ``Flag`` (``field(metadata=flag(...))``) is one
option: its default is the field's, written once, and ``from_flags`` builds the
dataclass back from the parsed options. A field marked ``group()`` holds a
dataclass whose own flagged fields are options of the same parser (the
placement's knobs, the image quota). The option's name is the field's, dashed
(``max_num_seqs`` is ``--max-num-seqs``), unless ``names`` says otherwise; its
``dest``, and so its ``SLUICE_<DEST>`` variable (``shared.flag_environment``),
follows the first name.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

_FLAG = "flag"
_GROUP = "flag_group"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Flag:
    """How one field is spelled and read on the command line.

    ``parse`` reads one value (argparse's ``type``); ``choices`` are parsed
    values. ``repeat`` takes the option several times, ``several`` several
    values after one option; either way the field gets the values through
    ``into`` (default ``tuple``). ``switch`` is ``--x``/``--no-x``, parsed as
    None when neither is given (the field then gets its default). ``into``
    turns what was parsed into the field's value (a ``Path``, a policy).
    """

    help: str
    names: tuple[str, ...] = ()
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    repeat: bool = False
    several: bool = False
    switch: bool = False
    into: Callable[[Any], Any] | None = None


def flag(help: str, **options: Any) -> dict[str, Flag]:
    """Field metadata that makes the field an option (``Flag``'s arguments)."""
    return {_FLAG: Flag(help, **options)}


def group() -> dict[str, bool]:
    """Field metadata for a dataclass-valued field whose fields are options too."""
    return {_GROUP: True}


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add an option for every flagged field of ``cls`` and of its groups."""
    for spec, default in _flagged(cls):
        options: dict[str, Any] = {"help": _with_default(spec.help, default), "dest": _dest(spec)}
        if spec.switch:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options.update(type=spec.parse, choices=spec.choices, metavar=spec.metavar)
        if spec.repeat:
            options["action"] = "append"
        elif spec.several:
            options["nargs"] = "+"
        # A list starts empty; a switch's None tells a flag given from its default.
        options["default"] = None if spec.repeat or spec.several or spec.switch else default
        parser.add_argument(*spec.names, **options)


def from_flags(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """``cls`` with every flagged field (and group) from ``args``; ``values`` set the rest."""
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.metadata.get(_GROUP):
            values[field.name] = from_flags(_group_type(field), args)
        elif _FLAG in field.metadata:
            spec = _named(field)
            value = getattr(args, _dest(spec))
            if spec.repeat or spec.several:
                values[field.name] = (spec.into or tuple)(list(value or ()))
            elif spec.switch and value is None:
                values[field.name] = _default(field)
            else:
                values[field.name] = spec.into(value) if spec.into else value
    return cls(**values)


def _flagged(cls: type) -> Iterator[tuple[Flag, Any]]:
    """(flag, default) of each flagged field, groups' fields in place of the group."""
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.metadata.get(_GROUP):
            yield from _flagged(_group_type(field))
        elif _FLAG in field.metadata:
            yield _named(field), _default(field)


def _with_default(help: str, default: Any) -> str:
    """The help, naming a plain default (a number or a word) it does not name already."""
    if "default" in help or type(default) not in (int, float, str) or default == "":
        return help
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    return f"{help} (default: {shown})"


def _named(field: dataclasses.Field[Any]) -> Flag:
    """The field's flag, its names filled in: the field's name, dashed, by default."""
    spec: Flag = field.metadata[_FLAG]
    return spec if spec.names else dataclasses.replace(spec, names=(_dashed(field.name),))


def _dashed(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise TypeError(f"flagged field {field.name!r} has no default")


def _group_type(field: dataclasses.Field[Any]) -> type:
    """A group field's dataclass, read from its default (annotations may be strings)."""
    return type(_default(field))


def _dest(spec: Flag) -> str:
    return spec.names[0].lstrip("-").replace("-", "_")


def at_least_one(text: str) -> int:
    """A ``parse`` for counts: a whole number of at least 1 (0 would not mean "unbounded")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def true_or_false(text: str) -> bool:
    """A ``parse`` for a flag that takes ``true`` or ``false`` as its value."""
    if text not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text == "true"


def optional_path(value: str | None) -> Path | None:
    """An ``into`` for a file flag that may be left out."""
    return Path(value) if value else None
