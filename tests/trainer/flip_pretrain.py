"""Test-only fault injector: launch/pretrain.py, unchanged, with one bit of one rank's weight flipped in one step.

    torchrun ... tests/trainer/flip_pretrain.py <launch/pretrain.py's arguments>

``FLIP_AT=RANK:STEP:NAME`` (read here only): at step STEP's update, after the gradients are reduced and before the
optimizer step, global rank RANK flips a mantissa bit of element 0 of the first parameter whose name contains NAME
(through the trainer's observers, as tests/trainer/test_replicas.py does in-process). Then the launcher runs as
``python launch/pretrain.py`` would, its exit status included."""

import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine import trainer as trainer_lib  # noqa: E402

RANK, STEP, NAME = os.environ["FLIP_AT"].split(":")
_fit = trainer_lib.Trainer.fit


def fit(self):
    param = next(p for n, p in self.model.named_parameters() if NAME in n)

    def inject(event: str) -> None:
        if event == "update" and self.step + 1 == int(STEP) and self.ctx.rank == int(RANK):
            param.data.view(-1).view(torch.int32)[0] ^= 1 << 20

    self.observers.append(inject)
    return _fit(self)


trainer_lib.Trainer.fit = fit
sys.argv = [str(ROOT / "launch" / "pretrain.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
