"""Pretraining entry point for ``python``, ``torchrun`` and the ``deepspeed`` launcher.

    python launch/pretrain.py --config configs/tiny.yaml [--section.key value ...]
    torchrun --nproc-per-node 4 launch/pretrain.py --config configs/tiny.yaml --parallel.tp 2
    deepspeed --hostfile hostfile launch/pretrain.py --config configs/tiny.yaml

A bad configuration or input exits with status 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from engine.checkpoint.signals import watch_agent_sigterm  # noqa: E402  (the standard library only)

# Under torchrun, SIGTERM is taken by a thread that tells the agent's restart from a user's stop: it must be blocked
# before numpy or torch start their threads, which would inherit it unblocked.
watch_agent_sigterm()

from engine.checkpoint.format import CheckpointError  # noqa: E402
from engine.cluster.report import report_once  # noqa: E402
from engine.cluster.startup import StartupError  # noqa: E402
from engine.config import ConfigError, load  # noqa: E402
from engine.data.dataset import DataError  # noqa: E402
from engine.storage import EXIT_STATUS, StorageError  # noqa: E402


def start_cluster(cfg):
    """Multi-rank: a host whose ranks are not whole tp groups warns; every rank joins the job's store within
    parallel.startup_timeout_s (StartupError naming the missing ones), checks that every host runs the same
    packages, engine code and config (ConfigError naming the first host and key that differ) and starts its
    heartbeat; (store, heartbeat), each None where there is nothing to do."""
    import torch.distributed as dist

    from engine.cluster.drift import check_same
    from engine.cluster.heartbeat import Heartbeat
    from engine.cluster.startup import default_store, join
    from engine.parallel.layout.checks import tp_across_hosts
    from engine.parallel.layout.context import env_rank_info
    from engine.parallel.layout.threads import local_world_size

    rank, world, local_rank = env_rank_info()
    if world == 1 or dist.is_initialized():
        return None, None
    warning = tp_across_hosts(cfg.parallel.tp, rank, local_rank, local_world_size(), world)
    if warning and local_rank == 0:
        print(warning, flush=True)  # once per host
    joined = join(rank, world, cfg.parallel.startup_timeout_s)
    check_same(joined, rank, world, cfg.to_dict(), cfg.parallel.startup_timeout_s)
    store = default_store(joined)
    beat = cfg.parallel.heartbeat_timeout_s
    startup = cfg.parallel.startup_timeout_s  # a peer's first beat: engine/cluster/heartbeat.py _limit
    return store, Heartbeat(rank, world, beat, startup_s=startup).start() if beat > 0 else None


def main(argv: list[str]) -> int:
    cfg = load(argv)  # before the trainer's imports (torch._dynamo among them): a bad config is one line in ~2 s
    from engine.hf.init import adopt_shape
    from engine.parallel.layout.context import ParallelContext, destroy
    from engine.trainer import Trainer, TrainingAborted
    from engine.trust.replicas import EXIT_STATUS as DISAGREE_STATUS
    from engine.trust.replicas import ReplicasDisagree

    adopt_shape(cfg)  # --model.init_from HF_DIR: the folder's model shape, before the layout is checked
    store, heartbeat = start_cluster(cfg)
    finished = False
    try:
        ctx = ParallelContext.from_config(cfg, store)
        trainer = Trainer(cfg, ctx)
        if heartbeat is not None:
            heartbeat.step_of = lambda: trainer.step
        if ctx.rank == 0:
            cp = f" cp={ctx.size('cp')} ({cfg.parallel.cp_mode})" if ctx.size("cp") > 1 else ""
            cp += f" ep={ctx.size('ep')}" if ctx.size("ep") > 1 else ""  # experts spread over dp x cp
            print(
                f"layout tp={ctx.tp} pp={ctx.pp} dp={ctx.dp}{cp} on {ctx.world_size} x {ctx.device} ({ctx.backend}); "
                f"{trainer.micro_batches} micro-batches of {cfg.train.micro_batch_size} per step",
                flush=True,
            )
        trainer.fit()
        finished = True
    except TrainingAborted as e:  # every rank takes the same decision (the loss is all-reduced)
        report_once(f"error: training aborted: {e}")
        finished = True
        return 1
    except ReplicasDisagree as e:  # every rank raises the same line (engine/trust/replicas.py), before any save of it
        report_once(f"error: {e}; the run stopped before saving this step (exit status {DISAGREE_STATUS})")
        finished = True
        return DISAGREE_STATUS
    except (ConfigError, DataError, CheckpointError):
        finished = True  # every rank refuses alike: one line, no peer to blame
        raise
    except Exception:
        if heartbeat is not None:  # a dead or failed peer: the watchdog prints its one line and ends this rank
            heartbeat.explain()
        raise  # no peer to blame: this rank's own error, with its traceback
    finally:
        if heartbeat is not None:
            heartbeat.stop("done" if finished else "failed")
        destroy()
    # Stopped by SIGTERM/SIGINT with no checkpoint.dir: the work is lost, which must not look like success; stopped
    # by the torchrun agent for a restart: an agent that sees exit 0 would take the job as finished.
    stopped = trainer.checkpointer
    return 1 if stopped.stopped_unsaved or stopped.stop.restart else 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except StorageError as e:  # a write refused mid-run (disk full, read-only): engine/storage.py
        report_once(
            f"error: {e}; the run stopped (exit status {EXIT_STATUS}): make room and rerun the same "
            f"command to resume from the latest checkpoint"
        )
        code = EXIT_STATUS
    except KeyboardInterrupt as e:  # a second SIGINT (engine/checkpoint/signals.py): out now, one line
        report_once(f"error: interrupted: {e or 'SIGINT'}")
        code = 130
    except (ConfigError, DataError, CheckpointError) as e:
        report_once(f"error: {e}")  # every rank may report: the first to fail prints, once per host
        code = 2
    except StartupError as e:  # a host missing at start-up: every rank that came names the ones that did not
        report_once(f"error: {e}")
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a terminal that is gone (SIGHUP from a dropped ssh session)
            pass
    # Skip interpreter teardown: the deepspeed launcher's workers can abort in C++ destructors at exit.
    os._exit(code)
