"""The one way multi-rank tests start ranks: forked gloo processes (engine/parallel/layout/spawn.py), under NCCL rules.

Every rank started here runs with tests/nccl_shim.py installed: ``batch_isend_irecv`` returns one Work per batch,
sends are rendezvous and a rank's batches run in order, as under NCCL, so a pipeline bug that only NCCL exposes
(issue 24: Works zipped with ops; a schedule that deadlocks on rendezvous sends) fails on CPU too, a deadlock
within seconds ("NCCL rules: deadlock ..."). Turn it off with ``run_ranks(..., nccl_rules=False)`` or, for a
whole run, ``ENGINE_NCCL_SHIM=0`` in the environment (e.g. to tell a shim problem from an engine one).

Ranks that need no collective, only the job's store (the heartbeat's and the drift check's tests), run as threads of
this process instead: ``run_threads``.
"""

import functools
import os
import threading
from unittest import mock

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
    _warm_for_ranks()
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
    nothing here starts a thread, so forking stays safe (tests/conftest.py). The costlier part that only forked
    ranks need waits for the first spawn (``_warm_for_ranks``)."""
    from engine.config import ModelConfig
    from engine.data.dataset import load_tokenizer
    from engine.model import transformer as model_lib
    from tests import nccl_shim  # noqa: F401 - imported by every rank

    load_tokenizer("")  # imports transformers' tokenizer classes
    model_lib.build(
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=2),
        device="meta",
    )


@functools.cache
def _warm_for_ranks() -> None:
    """Once per test process, before its first spawn: what every forked rank's first Trainer would otherwise do for
    itself. DeepSpeed with the Muon module its ZeRO optimizer check imports at every initialize
    (deepspeed/runtime/zero/utils.py is_zero_supported_optimizer; its torch.compile decorators import all of
    torch._inductor), DeepSpeed's op probe (compiles test programs at its first comm init), and the bundled corpus's
    tokens. Measured on the parity runner's first ZeRO run, one rank of two: 24.7 s -> 4.5 s (the second run in the
    same ranks: 2-3 s). Not at start-up: a pytest run that forks no ranks (a mutant's tests) does not pay ~8 s.
    Nothing here starts a thread or leaves a child process (checked: /proc/self/task, ps --ppid)."""
    _warm_bundled_tokens()
    try:
        import deepspeed.ops
        from deepspeed.runtime.zero.muon import muon_optimizer  # noqa: F401 - imports deepspeed, then torch._inductor
    except ImportError:  # DeepSpeed absent or without Muon: its tests skip or pay for their own imports
        return
    deepspeed.ops.__compatible_ops__  # noqa: B018 - the probe's result is cached in the module, inherited by forks


def _warm_bundled_tokens() -> None:
    """The bundled corpus under the default tokenizer (engine/data/dataset.py caches it in-process): every rank's
    first Trainer tokenizes it otherwise (1-3 s a rank). Encoded with the tokenizers library's thread pool off, so
    that the parent has used no threads when it forks (the library would warn in every child and go serial)."""
    from engine.data.dataset import load_tokenizer, load_train_tokens

    with mock.patch.dict(os.environ, {"TOKENIZERS_PARALLELISM": "false"}):
        load_train_tokens([], load_tokenizer(""))
