"""A rotating slice of the mutation run in CI (issue 45): each day one module of ROTATION and TURN_SIZE of its
mutants, the next ones in the file's order after the last turn's (``python -m tests.mutation --turn N MODULE``), must
all be killed. The modules are those whose every mutant is killed or listed equivalent (docs/mutation.md) and whose
tests run in-process in seconds, so a turn costs a clean run and TURN_SIZE failing ones (~30 s on 2 cores): a
change that lets one of their mutants survive fails CI within days, not at the next contributor's whole run. The
whole run stays the contributors' command (docs/mutation.md). ``MUTATION_DAY=N`` reruns day N's turn."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys

from tests.cli import ROOT
from tests.mutation.__main__ import targets

ROTATION = (
    "engine/cluster/hostfile.py",
    "engine/hf/config_json.py",
    "engine/kinds/offload.py",
    "engine/kinds/cp_modes.py",
    "engine/kinds/families.py",
    "engine/kinds/recompute.py",
)


def test_the_rotation_names_mapped_modules():
    assert set(ROTATION) <= set(targets()), set(ROTATION) - set(targets())


def test_todays_turn_of_mutants_is_killed():
    day = int(os.environ.get("MUTATION_DAY") or datetime.date.today().toordinal())
    module = ROTATION[day % len(ROTATION)]
    argv = [sys.executable, "-m", "tests.mutation", "--turn", str(day // len(ROTATION)), module]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    score = re.search(rf"^{re.escape(module)}: (\d+) of (\d+) killed", out.stdout, re.M)
    assert score and score[1] == score[2], f"MUTATION_DAY={day}: a mutant survived\n{out.stdout[-3000:]}"
