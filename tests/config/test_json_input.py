"""The strict JSON reader's boundaries (engine/json_input.py), which every user's JSON file goes through
(parallel.ds_config, a Hugging Face config.json, a checkpoint's index.json): found by mutation testing
(python -m tests.mutation engine/json_input.py), where an off-by-one in each survived the file-level tests.
"""

from __future__ import annotations

import json
import sys

import pytest

from engine.json_input import load_object, long_integer, shown


class Refused(ValueError):
    pass


def nested(depth: int) -> str:
    """An object whose one value sits ``depth`` keys deep."""
    return '{"a": ' * depth + "1" + "}" * depth


def test_a_file_32_deep_is_read_and_33_deep_is_refused():
    """32, as the refusal and the module say (DeepSpeed's and HF's keys are at most 3 deep)."""
    data = load_object(nested(32), "f.json", Refused)
    for _ in range(32):
        data = data["a"]
    assert data == 1
    with pytest.raises(Refused, match=r"^f\.json nests objects or lists 33 levels deep; at most 32 are read "):
        load_object(nested(33), "f.json", Refused)


def test_a_too_long_integer_is_named_by_its_own_length_and_line():
    """The first integer Python refuses (one digit over its limit), not an earlier one at the limit, and the line
    counted from the file's first character (which here is a newline)."""
    limit = sys.get_int_max_str_digits()
    text = '\n{"a": ' + "7" * limit + ',\n"b":\n' + "7" * (limit + 1) + "}"
    with pytest.raises(Refused) as caught:
        load_object(text, "config.json", Refused)
    assert str(caught.value) == (
        f"config.json holds an integer of {limit + 1} digits at line 4, longer than the {limit} digits Python reads "
        f"(no real value has as many)"
    )
    assert load_object('{"a": ' + "7" * limit + "}", "config.json", Refused)["a"] == int("7" * limit)
    assert long_integer("\n\n" + "7" * (limit + 1)).startswith(f"an integer of {limit + 1} digits at line 3,")


def test_shown_keeps_sixty_characters_whole_and_cuts_longer_to_sixty():
    exactly = "x" * 58  # json.dumps adds the two quotes: 60 characters
    assert shown(exactly) == json.dumps(exactly)
    longer = shown("x" * 59)  # 61 written
    assert len(longer) == 60 and longer == json.dumps("x" * 59)[:57] + "..."
    assert shown([1, 2], limit=6) == "[1, 2]" and shown([1, 2, 3], limit=6) == "[1,..."
