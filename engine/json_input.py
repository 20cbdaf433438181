"""A user's JSON file read strictly: one JSON object, no key given twice, nested at most ``MAX_DEPTH`` deep.

Python's json keeps the last of a repeated key silently (RFC 8259 section 4 leaves it to the reader), raises
RecursionError (a traceback) on input nested a few thousand deep, raises ValueError on an integer of more digits
than ``sys.get_int_max_str_digits()`` (4300; CVE-2020-10735's quadratic-time guard), and reads NaN and Infinity;
each of these is a one-line error here instead, in the caller's exception class (ConfigError for
parallel.ds_config, CheckpointError for a Hugging Face config.json or a checkpoint's index.json). No torch: the
config checks read the files before any rank starts.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator

# DeepSpeed's and Hugging Face's keys are at most 3 deep (zero_optimization.offload_param.device); 32 leaves room
MAX_DEPTH = 32


def load_object(text: str, where: str, error: type[Exception]) -> dict:
    """``text`` parsed as a JSON object, or ``error`` with one line starting with ``where`` (the file's name)."""

    def unique(pairs: list) -> dict:
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise error(
                    f"{where} gives the key '{key}' twice in one object; keep one (JSON readers differ in "
                    f"which they take)"
                )
            seen.add(key)
        return dict(pairs)

    try:
        data = json.loads(text, object_pairs_hook=unique)
    except RecursionError:
        raise error(
            f"{where} nests objects or lists too deep to read (more than {MAX_DEPTH} levels are never "
            f"needed); give a flat file"
        ) from None
    except error:  # the hook's key given twice (ConfigError is itself a ValueError)
        raise
    except json.JSONDecodeError as e:
        raise error(f"{where} is not valid JSON (line {e.lineno}: {e.msg})") from None
    except ValueError:  # an integer past Python's digit limit: the only other ValueError json.loads raises
        raise error(f"{where} holds {long_integer(text)}") from None
    if not isinstance(data, dict):
        raise error(f"{where} holds a JSON {type(data).__name__}, not an object of keys")
    deepest = max((len(path) for path, _ in leaves(data)), default=0)
    if deepest > MAX_DEPTH:
        raise error(
            f"{where} nests objects or lists {deepest} levels deep; at most {MAX_DEPTH} are read (its keys "
            f"are at most 3 deep)"
        )
    return data


def long_integer(text: str) -> str:
    """'an integer of 5000 digits at line 3, ...': the first run of digits longer than Python converts to an int
    (json and YAML readers raise ValueError on it), for a one-line refusal that says where it is."""
    limit = sys.get_int_max_str_digits()
    found = re.search(rf"\d{{{limit + 1},}}", text) if limit else None
    where = f" of {len(found.group())} digits at line {text.count(chr(10), 0, found.start()) + 1}" if found else ""
    return f"an integer{where}, longer than the {limit} digits Python reads (no real value has as many)"


def leaves(data) -> Iterator[tuple[tuple, object]]:
    """(path, value) of every value that is not a non-empty object or list, depth first, without recursion (so
    that a deep file cannot exhaust Python's stack); a path holds the keys and list indices leading to the value."""
    stack = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict) and value:
            stack.extend(((*path, k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list) and value:
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(value))))
        else:
            yield path, value


def dotted(path: tuple) -> str:
    """'zero_optimization.reduce_bucket_size', 'mlp_only_layers[2]'."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def not_finite(data: dict) -> tuple[str, object] | None:
    """The first number that is NaN or infinite (json reads NaN, Infinity, -Infinity), as (dotted key, value)."""
    for path, value in leaves(data):
        if isinstance(value, float) and not math.isfinite(value):
            return dotted(path), value
    return None


def shown(value, limit: int = 60) -> str:
    """``value`` as JSON writes it (NaN, "big", [1, 2]), cut to ``limit`` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
