"""Conversion of one raw YAML or CLI value to a config field's type (engine/config.py), or a one-line
:class:`ConfigError` naming the key and the value."""

from __future__ import annotations

import math
import types
import typing

from engine.errors import ConfigError


def coerce(key: str, value, typ):
    """Convert a YAML or CLI value to the field type ``typ``, or raise ConfigError naming key and value."""
    origin = typing.get_origin(typ)
    if origin is types.UnionType:  # list[int] | str: a list, or a word in its place (which words: config_checks)
        (list_t,) = [t for t in typing.get_args(typ) if t is not str]
        if isinstance(value, str) and value.strip().isalpha():
            return value.strip()
        if not isinstance(value, (str, list, tuple)):
            raise ConfigError(f"{key}={value!r} is neither a list [a,b] nor a word such as auto")
        return coerce(key, value, list_t)
    if origin is list:
        (item_t,) = typing.get_args(typ)
        if isinstance(value, str):  # CLI form: [a,b] or a,b
            text = value.strip()
            if text.startswith("[") and text.endswith("]"):
                text = text[1:-1]
            value = [v.strip() for v in text.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} is not a list; write it as [a,b]")
        return [coerce(f"{key}[{i}]", v, item_t) for i, v in enumerate(value)]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}={value!r} is not a boolean; use true or false")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not an integer")
        if isinstance(value, int):  # exact, however large (float() of one past 1e308 overflows)
            return value
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not an integer") from None
        if not math.isfinite(as_float) or as_float != int(as_float):
            raise ConfigError(f"{key}={value!r} is not an integer")
        return int(as_float)
    if typ is float:
        try:
            number = float(value)
        except OverflowError:  # an integer past 1e308 (YAML reads `lr: 1000...0` as one)
            raise ConfigError(f"{key}={value} is not a finite number") from None
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not a number") from None
        if not math.isfinite(number):  # nan/inf are never a meaningful setting, and poison what they touch
            raise ConfigError(f"{key}={value!r} is not a finite number")
        return number
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}={value!r} is not a string")
        if isinstance(value, bool):  # YAML reads `true` as a bool; string fields with true/false choices want text
            return str(value).lower()
        return "" if value is None else str(value)
    raise TypeError(f"unsupported config field type {typ} for {key}")  # a bug in this file, not user input


class HeadDim:
    """``ModelConfig.head_dim``: one name for the key and its value. Set (YAML, CLI, constructor) it stores what was
    given, 0 meaning hidden_size // num_heads; read it gives the resolved width, so callers never see the 0. A
    dataclass field whose default is a descriptor (dataclasses docs, "Descriptor-typed fields"); ``explicit_head_dim``
    reads the stored value (the config check of >= 0). dataclasses.asdict/replace give the resolved width;
    Config.to_dict
    writes the stored one (a saved config keeps 0 where the width is derived); vars() shows it as ``_head_dim``."""

    def __get__(self, obj, owner=None) -> int:
        if obj is None:
            return 0  # the field's default
        return obj.__dict__.get("_head_dim", 0) or obj.hidden_size // obj.num_heads

    def __set__(self, obj, value) -> None:
        obj.__dict__["_head_dim"] = value


def explicit_head_dim(m) -> int:
    """model.head_dim as given (0: derived from hidden_size // num_heads)."""
    return m.__dict__.get("_head_dim", 0)
