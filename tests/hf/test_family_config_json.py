"""Each family's config.json, in and out, without a model (engine/hf/families.py on engine/kinds/families.py's specs):
- the model cards' config.json of the families with a sliding-window key read as the shipped configs/*.yaml: Mistral
  v0.3's null window, Qwen2.5's window that use_sliding_window turns off, Mixtral's expert count and gating;
- every shipped family's config exported as config.json and imported again is the same model, with its sliding
  window where the family has one (what launch/convert.py export then import does, in milliseconds);
- a window turned on but null is no window.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from engine.config import load
from engine.hf import families
from engine.kinds.families import FAMILIES
from tests.hf.cards import PUBLISHED_JSON

# a shipped config of each family (configs/*.yaml)
SHIPPED = {
    "llama": "llama-3.2-1b",
    "qwen2": "qwen2.5-0.5b",
    "mistral": "mistral-7b-v0.3",
    "mixtral": "mixtral-8x7b",
    "qwen2_moe": "qwen1.5-moe-a2.7b",
    "olmoe": "olmoe-1b-7b",
    "qwen3": "qwen3-0.6b",
    "qwen3_moe": "qwen3-30b-a3b",
}
WINDOWED = ("qwen2", "mistral", "mixtral", "qwen2_moe")  # a window config.json says for every layer


def shipped(name: str):
    return load(["--config", f"configs/{name}.yaml"]).model


def model_fields(m) -> dict:
    return {k: v for k, v in dataclasses.asdict(m).items() if k != "name"}


@pytest.mark.parametrize("name", list(PUBLISHED_JSON))
def test_the_published_config_json_reads_as_the_shipped_config(name):
    m = families.model_config(PUBLISHED_JSON[name], Path(name))
    assert model_fields(m) == model_fields(shipped(name))


def test_every_family_exported_and_imported_again_is_the_same_model():
    assert sorted(SHIPPED) == sorted(FAMILIES)
    for family, name in SHIPPED.items():
        for window in (0, 4096) if family in WINDOWED else (0,):
            m = dataclasses.replace(shipped(name), sliding_window=window)
            written = json.loads(families.hf_config(m).to_json_string())  # as config.json holds it
            back = families.model_config(written, Path(name))
            assert (family, window, model_fields(back)) == (family, window, model_fields(m))


def test_a_window_turned_on_but_null_is_no_window():
    """Qwen2's use_sliding_window true with sliding_window null (a hand-edited config.json): no window, as a null
    window is for Mistral, not a window of 1 that would refuse every seq_len."""
    hf = {**PUBLISHED_JSON["qwen2.5-0.5b"], "use_sliding_window": True}
    assert families.model_config({**hf, "sliding_window": None}, Path("src")).sliding_window == 0
    assert families.model_config({**hf, "sliding_window": 4096}, Path("src")).sliding_window == 4096
