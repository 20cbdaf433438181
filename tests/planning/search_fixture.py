"""Writes tests/planning/data/search_best.json: the best layouts (those fitting, fastest first, as
launch/plan.py's table lists them) of today's exhaustive search for the cases below, from the checkout this file is
run in. Made once with the search before issue 43's pruning (commit d940f07):

    git archive d940f07 | tar -x -C /tmp/base && cp tests/planning/search_fixture.py /tmp/base/tests/planning/
    cd /tmp/base && python tests/planning/search_fixture.py > <worktree>/tests/planning/data/search_best.json

(or one process per case, ``search_fixture.py 4`` for the fifth, its lists merged: how this file was made).
Remade from its own checkout's exhaustive search (``search`` without ``top``) when the planner's figures change:
issue 46 (fsdp reduce-scatters every micro-batch, its gradients sharded), cases 0-3 (case 4's rows were unchanged).

Remade (issue 46: FSDP's reduce-scatter every micro-batch and overlapped with the backward, sequence parallelism
searched, uneven virtual stages, the leaner activation ledger) from the exhaustive search (``search(..., top=0)``)
of the checkout that made those changes, one process per case.

Remade (issue 46: AdamW fused on CPU and CUDA, the planner pricing no foreach temporaries, and the embedding's / LM
head's weight gradient before it is added into a held one) the same way, one process per case.

Remade (ddp at dp x cp 1 frees its gradients after the update; a chunk's gradients counted from its own first
backward, B under zero bubble, not the whole stage's from the rank's first) the same way: cases 0 and 1 moved.

Remade (full recomputation re-runs every matmul but a dense block's down_proj, as torch's checkpoint does) the same
way: case 0 (two full rows moved).

Remade (fsdp's no-sync trade, parallel.fsdp_grad_accumulation=unsharded, searched and listed only where it plans
faster than sharded) the same way: every case but case 2 moved (3669 -> 4491 valid layouts for case 0).

Remade (the blocking tp collectives priced as the model runs them: under sequence parallelism each column linear's
input re-gathered in backward; a recomputation re-running only what torch's checkpoint re-runs) the same way.

tests/planning/test_search_scale.py checks that the pruned search finds the same rows, bit for bit.
"""

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.config import load  # noqa: E402
from engine.model.flops import peak_tflops  # noqa: E402
from engine.planning.schedules import SEARCHED  # noqa: E402
from engine.planning.search import Hardware, search  # noqa: E402

TOP = 15
# (config, world size, device memory GB, overrides): plan.py's defaults otherwise (every schedule searched)
CASES = [
    ("configs/tiny.yaml", 8, 1.0, []),
    ("configs/tiny-moe.yaml", 8, 1.0, []),
    ("configs/llama-3.2-1b.yaml", 8, 80.0, ["--parallel.pp_layers", "auto"]),
    ("configs/llama-3.2-1b.yaml", 8, 16.0, []),
    ("configs/llama-3.2-1b.yaml", 64, 80.0, []),
]


def case_config(config: str, overrides: list[str]):
    """The config launch/plan.py plans: the file, the overrides, its attention planned for CUDA devices."""
    cfg = load(["--config", config, *overrides])
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, backend="nccl"))


def case_hardware(cfg, memory_gb: float) -> Hardware:
    """launch/plan.py's default device (an H100 at its peak in the config's dtype) with ``memory_gb``."""
    dtype = "bf16" if cfg.train.dtype == "bf16" else "fp32"
    return Hardware(peak_tflops=peak_tflops("NVIDIA H100 80GB HBM3", dtype), memory_gb=memory_gb)


def best_rows(config: str, world: int, memory_gb: float, overrides: list[str]) -> list[dict]:
    cfg = case_config(config, overrides)
    plans = search(cfg, world, case_hardware(cfg, memory_gb), SEARCHED)
    return [p.describe() for p in plans if p.fits][:TOP]


if __name__ == "__main__":  # all cases, or those whose indices are given (one process each: they are slow)
    chosen = [CASES[int(i)] for i in sys.argv[1:]] or CASES
    print(json.dumps([{"case": list(case), "best": best_rows(*case)} for case in chosen], indent=1))
