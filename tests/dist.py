"""The one way multi-rank tests start ranks: forked gloo processes (engine/parallel/layout/spawn.py), under NCCL rules.

Every rank started here runs with tests/nccl_shim.py installed: ``batch_isend_irecv`` returns one Work per batch,
sends are rendezvous and a rank's batches run in order, as under NCCL, so a pipeline bug that only NCCL exposes
(issue 24: Works zipped with ops; a schedule that deadlocks on rendezvous sends) fails on CPU too, a deadlock
within seconds ("NCCL rules: deadlock ..."). Turn it off with ``run_ranks(..., nccl_rules=False)`` or, for a
whole run, ``ENGINE_NCCL_SHIM=0`` in the environment (e.g. to tell a shim problem from an engine one).

Ranks that need no collective, only the job's store (the heartbeat's and the drift check's tests), run as threads of
this process instead: ``run_threads``.
"""

import os
import threading

from engine.parallel.layout import spawn
from engine.parallel.layout.spawn import free_port

__all__ = ["free_port", "run_ranks", "run_threads", "warm_imports"]


def _under_nccl_rules(fn, *args):
    from tests import nccl_shim

    nccl_shim.install()
    return fn(*args)


def run_ranks(
    fn, world_size: int, *args, timeout_s: float = 120.0, threads: int | None = None, nccl_rules: bool | None = None
) -> list:
    """engine.parallel.layout.spawn.run_ranks with NCCL's point-to-point rules in every rank (tests/nccl_shim.py) unless
    ``nccl_rules`` is False (None: on unless ENGINE_NCCL_SHIM=0)."""
    if nccl_rules is None:
        nccl_rules = os.environ.get("ENGINE_NCCL_SHIM", "1") != "0"
    if nccl_rules:
        return spawn.run_ranks(_under_nccl_rules, world_size, fn, *args, timeout_s=timeout_s, threads=threads)
    return spawn.run_ranks(fn, world_size, *args, timeout_s=timeout_s, threads=threads)


def run_threads(calls) -> None:
    """Each of ``calls`` (no arguments) on a thread of its own, all started before any is joined (ranks that wait
    for each other through a store); returns when every one has ended."""
    threads = [threading.Thread(target=call) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def warm_imports() -> None:
    """Import, once in the parent, what every forked rank would otherwise import for itself: transformers (the
    tokenizer loader) and the torch modules that the first meta-device initialisation pulls in (torch._refs,
    torch._dynamo). Measured: 6-9 s and 3.6 s per rank, paid by 8 ranks on 2 cores at every spawn. Only imports:
    nothing here starts a thread, so forking stays safe (tests/conftest.py)."""
    from engine.config import ModelConfig
    from engine.data.dataset import load_tokenizer
    from engine.model import transformer as model_lib
    from tests import nccl_shim  # noqa: F401 - imported by every rank

    load_tokenizer("")  # imports transformers' tokenizer classes
    model_lib.build(
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=2),
        device="meta",
    )
