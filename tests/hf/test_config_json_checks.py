"""Each value config.json may hold, at its bounds, through engine/hf/config_json.py's ``checked`` and
engine/hf/families.py's ``model_config`` (what ``launch/convert.py import`` and ``--model.init_from`` read; their
one ``error:`` line and exit 2 are tests/hf/test_hf_input.py's): the least value of every key is read, the one below
is refused naming the key, the value and the range; a RoPE key's refusal names its object; the heads, the RoPE
factors, ``mlp_only_layers`` and the experts agree. In-process, no model: milliseconds each.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import CheckpointError
from engine.hf import families
from engine.hf.config_json import check_family, checked
from tests.hf.cards import PUBLISHED_JSON, TINY

SRC = Path("src")
BASE = TINY  # 4 heads of 8 (2 key/value heads) on hidden 32, 2 layers
# Each whole-number key, its least value as written here (not read from the module: a changed bound must show), and
# what else the config needs for that least value to be a valid model (one head of 32 for one query head, a head_dim
# for a hidden_size the heads do not divide)
LEAST = {
    "vocab_size": (1, {}),
    "hidden_size": (1, {"head_dim": 8}),
    "intermediate_size": (1, {}),
    "num_hidden_layers": (1, {}),
    "num_attention_heads": (1, {"num_key_value_heads": 1}),
    "num_key_value_heads": (1, {}),
    "max_position_embeddings": (1, {}),
    "sliding_window": (0, {}),  # 0: no window
    "num_experts": (0, {}),
    "num_local_experts": (0, {}),
    "num_experts_per_tok": (1, {}),
    "moe_intermediate_size": (1, {}),
    "shared_expert_intermediate_size": (0, {}),  # 0: no shared expert
    "decoder_sparse_step": (1, {}),
    "original_max_position_embeddings": (1, {}),
}
MAX_INT = "2147483647"


def refused(hf: dict, *words: str) -> str:
    with pytest.raises(CheckpointError) as e:
        checked(hf, SRC)
    assert all(w in str(e.value) for w in words), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("key", list(LEAST))
def test_every_whole_number_key_reads_its_least_value_and_refuses_the_one_below(key):
    """A bound off by one either refuses a valid config.json (a model of one layer, no window, no shared expert)
    or reads a zero count the model cannot be built of; the refusal names the key, the value and the range."""
    least, needs = LEAST[key]
    assert checked({**BASE, **needs, key: least}, SRC)[key] == least
    refused(
        {**BASE, **needs, key: least - 1},
        f"src: config.json {key}={least - 1} is not valid; use a whole number in [{least}, {MAX_INT}]",
    )


def test_head_dim_reads_from_2_and_refuses_0_as_out_of_range_and_1_as_odd():
    """0 is no width (it would fall back to hidden_size / heads); 1 is refused for RoPE's pairs, not its range."""
    assert checked({**BASE, "head_dim": 2}, SRC)["head_dim"] == 2
    refused({**BASE, "head_dim": 0}, f"head_dim=0 is not valid; use a whole number in [1, {MAX_INT}]")
    refused({**BASE, "head_dim": 1}, "config.json gives heads 1 wide", "RoPE needs an even width")


def test_the_largest_whole_number_is_2_to_the_31_less_1():
    """Every tensor size stays an int64; the message says the largest value."""
    assert checked({**BASE, "max_position_embeddings": 2**31 - 1}, SRC)["max_position_embeddings"] == 2**31 - 1
    refused(
        {**BASE, "max_position_embeddings": 2**31},
        f"max_position_embeddings=2147483648 is not valid; use a whole number in [1, {MAX_INT}]",
    )


@pytest.mark.parametrize("key", ["vocab_size", "num_experts", "sliding_window"])
def test_a_boolean_is_not_a_whole_number(key):
    """JSON true is Python's 1 (and false 0): both in range, neither a count."""
    refused({**BASE, key: True}, f"{key}=true is not valid; use a whole number")


# number key: (values refused, values read), written here; a bound of 0 that is allowed has 0.0 among those read
# (the message then says ">= 0")
NUMBERS = {
    "rms_norm_eps": ([0.0, -1e-6, True], [1e-12, 0.5]),
    "initializer_range": ([-0.5, -1e-3], [0.0, 0.02]),
    "router_jitter_noise": ([-0.5, -1e-3], [0.0, 0.01]),
    "rope_theta": ([0.0, -0.5], [0.5, 500000.0]),
}


@pytest.mark.parametrize("key", list(NUMBERS))
def test_every_number_key_refuses_below_its_bound(key):
    """A zero epsilon divides by zero in every norm, a zero RoPE base makes every frequency 0, a negative
    initialisation or jitter has no meaning; 0 itself is allowed where it means none."""
    bad, good = NUMBERS[key]
    sign = ">=" if 0.0 in good else ">"
    for value in good:
        assert checked({**BASE, key: value}, SRC)[key] == value
    for value in bad:
        refused({**BASE, key: value}, f"config.json {key}=", f"is not valid; use a finite number {sign} 0")


def rope(**keys) -> dict:
    """A config.json with a rope_parameters object (transformers 5's)."""
    return {**BASE, "rope_parameters": keys}


LLAMA3 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)


def test_a_rope_factor_reads_from_1_and_is_named_by_its_object():
    """A factor of 1 is no scaling (allowed); below 1 the positions would stretch past what was trained."""
    for factor in (1.0, 1.5, 32.0):
        assert checked(rope(rope_type="linear", factor=factor), SRC)["rope_parameters"]["factor"] == factor
    for factor in (0.5, 0.0, -1.0):
        refused(
            rope(rope_type="linear", factor=factor),
            f"src: config.json rope_parameters.factor={factor} is not valid; use a finite number >= 1",
        )


def test_llama3_frequency_factors_are_positive_and_low_below_high():
    """engine/model/rope.py divides by high - low: equal factors would divide by zero."""
    small = dict(LLAMA3, low_freq_factor=0.25, high_freq_factor=0.75)
    assert checked(rope(**small), SRC)["rope_parameters"] == small
    refused(
        rope(**dict(LLAMA3, low_freq_factor=0.0)),
        "rope_parameters.low_freq_factor=0.0 is not valid; use a finite number > 0",
    )
    refused(
        rope(**dict(LLAMA3, high_freq_factor=0)),
        "rope_parameters.high_freq_factor=0 is not valid; use a finite number > 0",
    )
    refused(
        rope(**dict(LLAMA3, high_freq_factor=1.0)),
        "src: config.json rope_parameters.high_freq_factor=1.0 is not valid; it must exceed low_freq_factor=1.0",
    )


def test_a_rope_value_is_named_by_its_object():
    """rope_theta is both a top-level key (transformers 4) and rope_parameters' (5): the message says which."""
    refused(rope(rope_type="default", rope_theta=0), "src: config.json rope_parameters.rope_theta=0 is not valid")
    hf = {**BASE, "rope_scaling": {"type": "linear", "factor": 0.5}}
    refused(hf, "src: config.json rope_scaling.factor=0.5 is not valid")


def test_a_rope_object_is_read_without_its_nulls():
    """Its values reach the model; a null one is absent (the top-level rope_theta then applies)."""
    mistral = PUBLISHED_JSON["mistral-7b-v0.3"]  # rope_theta 1000000.0, rope_scaling null
    m = families.model_config({**mistral, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, SRC)
    assert m.rope_theta == 500000.0
    m = families.model_config({**mistral, "rope_parameters": {"rope_type": None, "rope_theta": None}}, SRC)
    assert (m.rope_theta, m.rope_scaling) == (1000000.0, "none")
    m = families.model_config({**mistral, "rope_parameters": dict(LLAMA3, rope_theta=None)}, SRC)
    assert (m.rope_scaling, m.rope_low_freq_factor, m.rope_high_freq_factor) == ("llama3", 1.0, 4.0)


@pytest.mark.parametrize(
    "key", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
)
def test_a_required_key_missing_or_null_is_named(key):
    """Unchecked, a missing key would be a KeyError's traceback further on (families.py reads them as hf[key])."""
    refused({k: v for k, v in BASE.items() if k != key}, f"src: config.json has no '{key}'")
    refused({**BASE, key: None}, f"src: config.json {key}=null is not valid; use a whole number in [1, {MAX_INT}]")


def test_mlp_only_layers_are_indices_of_the_layers():
    """Qwen2-MoE's and Qwen3-MoE's dense layers: an index past the last layer (or a bool, a negative) would leave
    a layer's MLP other than config.json says."""
    assert checked({**BASE, "mlp_only_layers": [0, 1]}, SRC)["mlp_only_layers"] == [0, 1]
    for layers in ([2], [-1], [True], [0.0], "0", 1):
        refused(
            {**BASE, "mlp_only_layers": layers}, "config.json mlp_only_layers=", "use a list of layer indices in [0, 2)"
        )


def test_heads_divide_and_are_an_even_width():
    """Without head_dim the width is hidden_size / heads and must be whole; with it (Qwen3: 16 heads of 128 on
    1024) hidden_size need not divide; either way RoPE rotates pairs."""
    assert "head_dim" not in checked({**BASE, "hidden_size": 48}, SRC)  # 12 wide
    assert checked({**BASE, "hidden_size": 30, "head_dim": 8}, SRC)["head_dim"] == 8
    assert checked({**BASE, "hidden_size": 36, "head_dim": 8}, SRC)["hidden_size"] == 36  # 36 / 4 = 9 unused
    refused(
        {**BASE, "hidden_size": 30},
        "hidden_size=30 is not valid; without head_dim it must be divisible by num_attention_heads=4",
    )
    refused({**BASE, "hidden_size": 36}, "config.json gives heads 9 wide", "RoPE needs an even width")
    refused(
        {**BASE, "num_key_value_heads": 3}, "num_key_value_heads=3 is not valid; it must divide num_attention_heads=4"
    )


def test_architectures_is_a_list_of_names():
    """Unchecked, a string is read letter by letter, and either is named an unsupported architecture."""
    for archs in (["LlamaForCausalLM", 1], "LlamaForCausalLM"):
        with pytest.raises(
            CheckpointError, match="config.json architectures=.* is not valid; use a list of one class name"
        ):
            families.model_config({**PUBLISHED_JSON["mistral-7b-v0.3"], "architectures": archs}, SRC)


def moe(**keys) -> dict:
    """Mixtral-8x7B's config.json with ``keys`` changed, checked."""
    return checked({**PUBLISHED_JSON["mixtral-8x7b"], **keys}, SRC)


def test_experts_per_token_at_most_the_experts_its_default_2_included():
    """k = the expert count is every expert (allowed); an absent k is 2 (engine/hf/moe_families.py reads it so)."""
    check_family(moe(num_local_experts=2, num_experts_per_tok=2), "mixtral", SRC)
    check_family(moe(num_local_experts=2, num_experts_per_tok=None), "mixtral", SRC)
    with pytest.raises(
        CheckpointError, match=r"num_experts_per_tok=2 is not valid; it must be at most num_local_experts=1$"
    ):
        check_family(moe(num_local_experts=1, num_experts_per_tok=None), "mixtral", SRC)


def test_mixtral_needs_no_moe_intermediate_size():
    """Its experts are intermediate_size wide; only the families with dense layers (Qwen2-MoE, Qwen3-MoE) need it."""
    m = families.model_config(PUBLISHED_JSON["mixtral-8x7b"], SRC)
    assert (m.num_experts, m.experts_per_token) == (8, 2)
    with pytest.raises(CheckpointError, match="config.json of qwen3_moe has no 'moe_intermediate_size'"):
        check_family(moe(), "qwen3_moe", SRC)
