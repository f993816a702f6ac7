"""A pydantic model's fields as command-line flags, with no second declaration. Torch-free.

Runs in the CLI of a router or worker process (and `pdserve`'s dotted overrides).

- `add_model_flags(parser, model)` adds one flag per field, named after it (``worker_id`` ->
  ``--worker-id``), with the field's description and default in its help. A flag's own
  default is "not given": a field whose flag is left out gets the model's default when the
  model validates, never a second one kept here. A ``bool`` field is ``--x`` / ``--no-x``; a
  `Literal` field lists its choices; an optional field takes ``none``; a field that is itself a
  model takes its whole value as JSON (``--engine-json '{"block_size": 8}'``). `names` keeps a
  command line's established flag for a field (``model_dir`` -> ``--model``), `skip` leaves
  fields to flags of the caller's own.
- ``--set KEY=VALUE`` (repeatable, `add_set_flag`) sets any key, nested ones by a dotted path
  (``--set engine.block_size=8``); VALUE is JSON when it parses as JSON, else a string.
- `model_values(args, flags)` turns what was given into the dict the model validates;
  `apply_sets` lays the ``--set`` pairs over it (`set_dotted`).
- ``--config FILE`` (a process's whole model as JSON, what the launchers write):
  `load_document` reads it with the ``--set`` pairs laid over it, and `flags_beside_config`
  names the flags a command line gave beside it that it must not have.

Values are passed to the model as given (strings, JSON): pydantic converts and validates
them, so a bad value fails naming its field, as in a config document.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

UNSET: Any = object()
"""A dotted override value that removes the key (so its default applies)."""


@dataclass(frozen=True)
class ModelFlag:
    """One field's flag: its `dest` on the parsed namespace, and how its value is read."""

    field: str
    dest: str
    json: bool  # the value is JSON (a nested model)
    optional: bool  # "none" means None


def _flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without None, whether None was allowed)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) < len(typing.get_args(annotation)):
            return (args[0] if len(args) == 1 else annotation), True
    return annotation, False


def _is_model(annotation: Any) -> bool:
    """A nested model, or a union of them (a `kind`-discriminated section)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _is_model(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return all(_is_model(a) for a in typing.get_args(annotation))
    return False


def add_model_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    *,
    names: Mapping[str, str] | None = None,
    skip: Iterable[str] = (),
) -> list[ModelFlag]:
    """One flag per field of `model` (module docstring); returns them for `model_values`."""
    names = names or {}
    skipped = set(skip)
    flags: list[ModelFlag] = []
    for field, info in model.model_fields.items():
        if field in skipped:
            continue
        annotation, optional = _unwrap_optional(info.annotation)
        nested = _is_model(annotation)
        flag = names.get(field) or _flag_name(field) + ("-json" if nested else "")
        dest = "model_" + field
        default = info.get_default(call_default_factory=False)
        if info.is_required():
            shown = "required"
        elif info.default_factory is not None or nested:
            shown = "default: the model's"
        else:
            shown = f"default: {default!r}"
        help_text = f"{info.description or field} ({shown})"
        kw: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": help_text}
        if annotation is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is typing.Literal and not optional:
            kw["choices"] = [str(c) for c in typing.get_args(annotation)]
        else:
            kw["metavar"] = "JSON" if nested else field.upper()
        parser.add_argument(flag, **kw)
        flags.append(ModelFlag(field, dest, nested, optional))
    return flags


def add_set_flag(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE``, repeatable (module docstring)."""
    parser.add_argument(
        "--set",
        dest="model_sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any config key, nested ones by a dotted path (engine.block_size=8); VALUE "
        "is JSON when it parses as JSON, else a string; repeatable, applied after the flags",
    )


def model_values(args: argparse.Namespace, flags: Sequence[ModelFlag]) -> dict[str, Any]:
    """The fields whose flags were given, as the model validates them. ValueError naming the
    flag for JSON that does not parse."""
    out: dict[str, Any] = {}
    for flag in flags:
        if not hasattr(args, flag.dest):
            continue
        value = getattr(args, flag.dest)
        if flag.optional and isinstance(value, str) and value.lower() == "none":
            value = None
        elif flag.json and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{flag.field}: not JSON ({exc}): {value!r}") from None
        out[flag.field] = value
    return out


def parse_set(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value): JSON when VALUE parses as JSON, else the string.
    ValueError without ``=`` or with an empty key."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def apply_sets(data: dict[str, Any], items: Iterable[str]) -> dict[str, Any]:
    """`data` with every ``--set`` pair laid over it (dotted keys create tables)."""
    for item in items:
        key, value = parse_set(item)
        set_dotted(data, key, value)
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """`data["a"]["b"] = value` for `key` "a.b", creating tables on the way; `UNSET` removes
    the key instead. ValueError when a table on the way is a plain value."""
    *tables, last = key.split(".")
    node = data
    for name in tables:
        child = node.setdefault(name, {})
        if not isinstance(child, dict):
            raise ValueError(f"{key}: {name!r} is not a table")
        node = child
    if value is UNSET:
        node.pop(last, None)
    else:
        node[last] = value


def load_document(model: type[M], path: str | Path, sets: Iterable[str] = ()) -> M:
    """The `model` a JSON document at `path` holds, with the ``--set`` pairs `sets` laid over
    it. OSError for an unreadable file, ValueError (pydantic.ValidationError included) for a
    bad document or pair."""
    raw = Path(path).read_bytes()
    sets = list(sets)
    if not sets:
        return model.model_validate_json(raw)
    return model.model_validate(apply_sets(json.loads(raw), sets))


def flags_beside_config(argv: Sequence[str], allowed: Iterable[str]) -> list[str]:
    """The flags of `argv` (``--name`` or ``--name=value``) other than `allowed`: what a
    command line with ``--config`` must not carry besides it."""
    ok = set(allowed)
    return [a for a in argv if a.startswith("--") and a.split("=")[0] not in ok]
