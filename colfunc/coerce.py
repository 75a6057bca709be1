"""Field values from text (``--set section.field=value``) or JSON, by the field's annotation."""

from __future__ import annotations

import types
import typing
from typing import Any

import torch

__all__ = ["coerce"]


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError


def coerce(value: Any, hint: Any, where: str) -> Any:
    """``value`` (text from ``--set``, or a JSON value) as the type ``hint`` of field ``where``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    wrong = ValueError(f"{where} must be {_type_name(hint)}, got {value!r}")
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or value in ("None", "none", "null")):
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return coerce(value, arg, where)
                except ValueError:
                    pass
        raise wrong
    if origin is typing.Literal:
        if value in args:
            return value
        raise ValueError(f"{where} must be one of {args}, got {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return _parse_bool(value)
            except ValueError:
                raise wrong from None
        raise wrong
    if hint is int or hint is float:
        if isinstance(value, bool):
            raise wrong
        if isinstance(value, str):
            try:
                value = hint(value.strip())
            except ValueError:
                raise wrong from None
        if hint is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, hint):
            raise wrong
        return value
    if hint is str:
        if not isinstance(value, str):
            raise wrong
        return value
    if hint is torch.dtype:
        dtype = getattr(torch, str(value).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise wrong
        return dtype
    if hint is tuple or origin is tuple:
        if isinstance(value, str):
            text = value.strip().removeprefix("(").removesuffix(")")
            text = text.removeprefix("[").removesuffix("]")
            items: list[Any] = [t for t in (s.strip() for s in text.split(",")) if t]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise wrong
        if not args:
            return tuple(items)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(x, args[0], where) for x in items)
        if len(items) != len(args):
            raise wrong
        return tuple(coerce(x, a, where) for x, a in zip(items, args))
    if hint is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise wrong
    raise ValueError(f"{where} has type {_type_name(hint)}, which cannot be set from text")


def _type_name(hint: Any) -> str:
    if isinstance(hint, type) and typing.get_origin(hint) is None:
        return {"int": "an int", "float": "a number", "bool": "true or false", "str": "text"}.get(
            hint.__name__, hint.__name__
        )
    return str(hint).replace("typing.", "")
