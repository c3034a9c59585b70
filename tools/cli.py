"""Command-line flags derived from a dataclass: each field is one ``--flag`` whose type, choices, default and help
come from the field (its annotation, its default, ``metadata["help"]``), so a tool states each default once.

* ``int``, ``float``, ``str`` (optionally ``| None``): ``--name-with-dashes VALUE``.
* ``Literal[...]``: ``choices``.
* ``bool`` defaulting to False: a switch.
* a field without a default: a required flag.
* ``metadata["parse"]``: a function from the flag's text to the value (``--levels 1-3``).
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal, TypeVar

__all__ = ["add_dataclass_arguments", "dataclass_from_args"]

T = TypeVar("T")


def _scalar(annotation: Any) -> Any:
    """The type of a field, Optional removed."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(arms) == 1:
            return arms[0]
    return annotation


def add_dataclass_arguments(parser: argparse.ArgumentParser | Any, cls: type, *,
                            only: typing.Iterable[str] | None = None) -> None:
    """One flag per field of dataclass ``cls`` (or of the fields named in ``only``) on ``parser`` (a parser or an
    argument group)."""
    hints = typing.get_type_hints(cls)
    wanted = set(only) if only is not None else None
    for field in dataclasses.fields(cls):
        if wanted is not None and field.name not in wanted:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = _scalar(hints[field.name])
        kw: dict[str, Any] = {"dest": field.name, "help": field.metadata.get("help", "")}
        has_default = field.default is not dataclasses.MISSING
        if kind is bool and has_default and field.default is False:
            parser.add_argument(flag, action="store_true", **kw)
            continue
        if not has_default:
            kw["required"] = True
        else:
            kw["default"] = field.default
        if "parse" in field.metadata:
            kw["type"] = field.metadata["parse"]
        elif typing.get_origin(kind) is Literal:
            kw["choices"] = typing.get_args(kind)
        elif kind in (int, float, str):
            kw["type"] = kind
        else:
            raise TypeError(f"{cls.__name__}.{field.name}: no flag for type {kind!r} (give metadata['parse'])")
        parser.add_argument(flag, **kw)


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The dataclass built from the parsed flags of :func:`add_dataclass_arguments`."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
