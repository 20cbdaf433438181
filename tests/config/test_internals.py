"""engine/internals.py: an undocumented DeepSpeed / FSDP2 attribute that a release renamed fails with one line
naming the attribute, the installed version and the tested one (ConfigError: exit 2), not an AttributeError deep
inside a save or a step; the call sites in ckpt_state.py and memory.py go through it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn
from torch.distributed.fsdp import FSDPModule

from engine.config import ConfigError
from engine.internals import TESTED, UnsupportedVersion, installed_version, private
from engine.metrics.memory import fsdp_params
from engine.parallel.dp.zero_state import Zero12State


def test_missing_attribute_names_it_and_both_versions():
    with pytest.raises(UnsupportedVersion) as e:
        private(SimpleNamespace(other=1), "deepspeed", "_hp_mapping")
    message = str(e.value)
    assert isinstance(e.value, ConfigError) and "\n" not in message
    assert "SimpleNamespace._hp_mapping" in message and f"deepspeed {TESTED['deepspeed']}" in message
    assert f"installed deepspeed {installed_version('deepspeed')}" in message and "torch 2.13.0" in message


def test_present_attribute_is_returned_even_if_none_and_the_first_name_found_wins():
    obj = SimpleNamespace(_hp_mapping=None, b=2, c=3)
    assert private(obj, "deepspeed", "_hp_mapping") is None
    assert private(obj, "deepspeed", "a", "b", "c") == 2


def test_zero_checkpoint_state_with_a_renamed_master_partition_fails_clearly():
    # A ZeRO optimizer of a release with neither known name for its fp32 master partitions.
    zero = SimpleNamespace(engine=SimpleNamespace(optimizer=SimpleNamespace(optimizer=object())))
    with pytest.raises(UnsupportedVersion, match="single_partition_of_fp32_groups or .*fp32_groups_flat_partition"):
        Zero12State(zero)


def test_fsdp_module_without_its_state_internals_fails_clearly():
    class Renamed(FSDPModule, nn.Linear):  # an FSDP2 module of a torch whose state lost _fsdp_param_groups
        def _get_fsdp_state(self):
            return SimpleNamespace()

    module = nn.Linear(2, 2)
    module.__class__ = Renamed  # as fully_shard swaps the class (FSDPModule.__new__ would build a plain Linear)
    with pytest.raises(UnsupportedVersion, match=r"_fsdp_param_groups .* torch .*tested with torch 2\.13\.0"):
        fsdp_params(nn.Sequential(module))
    assert fsdp_params(nn.Sequential(nn.Linear(2, 2))) == []  # no FSDP: nothing to read
