"""An environment variable for every flag: ``SLUICE_<DEST>`` sets the flag's default.

``--max-num-seqs`` is ``SLUICE_MAX_NUM_SEQS``, ``--api-key`` ``SLUICE_API_KEY``
(several: comma-separated), a switch such as ``--enforce-eager`` takes 1/0,
true/false, yes/no or on/off. A value given on the command line wins; a list
flag adds its values to the variable's. Each flag's help names its variable.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

PREFIX = "SLUICE_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
_SKIPPED = frozenset({"help", "version"})
# Flags whose default already reads its variable (shared.precision, shared.execution): a value
# there is not a flag given, which ``sluice serve --redis`` would refuse as this process's.
READ_BY_DEFAULT = frozenset({"dtype", "enforce_eager"})


def apply_environment(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> None:
    """Name each flag's variable in its help and take the defaults ``environ`` sets; a
    value the flag would refuse is refused here, naming the variable."""
    environ = os.environ if environ is None else environ
    defaults: dict[str, Any] = {}
    for action in parser._actions:  # argparse keeps no public list of its actions
        if not action.option_strings or action.dest in _SKIPPED:
            continue
        name = PREFIX + action.dest.upper()
        action.help = f"{action.help or ''} [env {name}]".strip()
        if name in environ and action.dest not in READ_BY_DEFAULT:
            defaults[action.dest] = _value(parser, action, name, environ[name])
    parser.set_defaults(**defaults)


def _value(parser: argparse.ArgumentParser, action: argparse.Action, name: str, text: str) -> Any:
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
        lowered = text.strip().lower()
        if lowered not in _TRUE | _FALSE:
            parser.error(f"{name}={text!r}: expected 1 or 0, true or false")
        return lowered in _TRUE
    several = action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)
    parts = [part.strip() for part in text.split(",") if part.strip()] if several else [text]
    values = []
    for part in parts:
        try:
            value = action.type(part) if callable(action.type) else part
        except (argparse.ArgumentTypeError, ValueError) as exc:
            parser.error(f"{name}={part!r}: {exc}")
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            parser.error(f"{name}={part!r}: expected one of {choices}")
        values.append(value)
    return values if several else values[0]
