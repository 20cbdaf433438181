"""Every dp mode's checkpoint state class follows engine/parallel/dp/state.py's CheckpointState protocol (issue 25):
the classes each DpModeSpec names (TorchState for ddp and fsdp, ZeRO's two) define all eight methods themselves
(an explicit subclass of a Protocol would otherwise inherit its empty bodies) with the protocol's parameters."""

from __future__ import annotations

import inspect

import pytest

from engine.kinds.dp_modes import MODES
from engine.parallel.dp import resolve
from engine.parallel.dp.state import CheckpointState

METHODS = ("held", "writes", "state_names", "get", "set", "prepare", "finish", "adam_step")
CLASSES = sorted({path for spec in MODES.values() for path in spec.state})


def test_protocol_declares_the_eight_methods():
    declared = [n for n, v in vars(CheckpointState).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert sorted(declared) == sorted(METHODS)


def test_each_mode_names_a_state_class():
    assert all(spec.state for spec in MODES.values())
    assert "state:TorchState" in CLASSES and len(CLASSES) >= 3  # TorchState, Zero12State, Zero3State


@pytest.mark.parametrize("path", CLASSES)
def test_state_class_follows_the_protocol(path):
    cls = resolve(path)
    assert issubclass(cls, CheckpointState)  # runtime_checkable: every method present
    for name in METHODS:
        owner = next(c for c in cls.__mro__ if name in vars(c))
        assert owner is not CheckpointState, f"{cls.__name__}.{name} is the protocol's empty body"
        want = list(inspect.signature(getattr(CheckpointState, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}{got} != protocol {want}"
