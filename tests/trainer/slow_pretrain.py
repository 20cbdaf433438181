"""Test-only fault injector: launch/pretrain.py, unchanged, with one rank's forward slowed.

    torchrun ... tests/trainer/slow_pretrain.py <launch/pretrain.py's arguments>

``SLOW_RANK=RANK`` (read here only): global rank RANK sleeps 15x each stage forward's own duration after it (16x
slower), as tests/trainer/test_stragglers.py does in-process; every rank is pinned to the first core it may use, so
another job's load on one core does not make a straggler of the rank on it. Then the launcher runs as
``python launch/pretrain.py`` would, its exit status included."""

import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import trainer as trainer_lib  # noqa: E402

RANK = int(os.environ["SLOW_RANK"])
_fit = trainer_lib.Trainer.fit


def fit(self):
    if self.ctx.rank == RANK:
        forward = self.stage_forward

        def slowed(*args, **kwargs):
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            time.sleep(15 * (time.perf_counter() - start))
            return out

        self.stage_forward = slowed
    return _fit(self)


os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
trainer_lib.Trainer.fit = fit
sys.argv = [str(ROOT / "launch" / "pretrain.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
