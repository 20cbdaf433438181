"""The one way multi-rank tests start ranks: forked gloo processes (engine/parallel/spawn.py)."""
from engine.parallel.spawn import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
