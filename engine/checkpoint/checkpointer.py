"""Sharded checkpoints: every rank writes its own pieces, a checkpoint appears atomically, resumes at any layout.

Layout (docs/architecture.md "Checkpoints"): ``<checkpoint.dir>/step_NNNNNN/`` holds ``rank_NNNNN.safetensors`` (one
per rank: the parameter and Adam-moment pieces it owns, and its RNG states) with its ``part_NNNNN.json``, a
``locator.jsonl`` and ``index.json`` (engine/checkpoint/format.py).
``<checkpoint.dir>/latest`` names the newest complete one.

Save (collective): each rank copies its pieces of the explicit parts (engine/checkpoint/parts.py: the stage, the
dp mode's state access, config, context) to CPU with the run position it is given (engine/checkpoint/contents.py),
then writes ``step_N.tmp-<run token>/rank_R.safetensors`` and its part of the index, ``part_R.json`` (its pieces,
shard size and CRC, RNG: engine/checkpoint/format.py ``write_part``); the ranks send small plans (the ranges each
holds, no pieces) to rank 0 through the job's store (engine/cluster/exchange.py: O(1) requests per rank, no
world-sized gloo group); rank 0 publishes the directory (engine/checkpoint/publish.py: the locator and the
top-level index, the rename to ``step_N``, only then ``latest``, then pruning to ``checkpoint.keep``, never the new
one or a step above it).
With ``checkpoint.async_save`` the writing and committing run in a background thread while training goes on
(the writer thread exchanges over a store connection of its own, made at its first save); the next save or the
end of fit waits for it.

Resume (collective, end of Trainer.__init__): ``checkpoint.resume`` = ``auto`` tries ``latest`` and then older
``step_*`` directories, newest first (engine/checkpoint/choose.py), skipping (with a line naming the step and
why) any whose index is missing, unreadable or not of the format's fields (engine/checkpoint/schema.py), a shard
missing, unreadable, outside the step directory or of the wrong size, a CRC that fails, a piece the index lists
but the shard lacks, or a NaN/inf piece (engine/checkpoint/format.py ``verify_shard``: resuming it would train on
garbage, so ``auto`` takes the older step);
``none`` starts fresh; a PATH (a ``step_*`` directory or a checkpoint directory with ``latest``) must be valid.
Then the steps of ``checkpoint.dir`` above the one the run starts from are set aside (unusable) or refused (valid:
another run's), engine/checkpoint/lineage.py, so that every later save and prune sees only this run's lineage.
Each rank reads only the pieces overlapping what it holds at the new layout (engine/parallel/dp/state.py), so tp,
pp, dp and dp_mode may all change; ``resume`` returns the saved run position, which the trainer applies itself.
A model-only checkpoint (``launch/convert.py import``) starts at step 0 with a fresh optimizer and the data from
the beginning.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from engine.checkpoint.choose import resolve, to_try
from engine.checkpoint.contents import check_model, contents, data_changes, layout_change, load_into
from engine.checkpoint.format import (
    CheckpointError,
    merge_index,
    read_index,
    verify_shard,
    write_part,
    write_shard,
)
from engine.checkpoint.lineage import set_aside, settle
from engine.checkpoint.lock import CheckpointLock, claim_run_directories
from engine.checkpoint.parts import CheckpointParts, RunPosition
from engine.checkpoint.publish import (
    discard,
    latest_name,
    list_checkpoints,
    publish,
    staging_dir,
    staging_path,
    step_name,
)
from engine.checkpoint.signals import Interrupted, StopSignal
from engine.cluster.exchange import StoreExchange
from engine.cluster.shared import check_shared, describe_hosts, run_directories
from engine.storage import StorageError, describe, say
from engine.trust import saved

__all__ = ["Checkpointer", "CheckpointError", "list_checkpoints", "resolve"]


class Checkpointer:
    """One per Trainer: resume at start, save every ``checkpoint.every`` steps, at the last step and on a stop
    signal. Every method that saves or loads is collective (all ranks call it)."""

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx, c = cfg, ctx, cfg.checkpoint
        self.root = Path(c.dir) if c.dir else None
        self.stop = StopSignal()
        self.pending: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_saved = None
        self.resumed_from: Path | None = None
        self.timings: dict[str, float] = {}  # seconds of the latest save/load (launch/bench/checkpoint.py)
        self.skipped: list[str] = []  # why resume: auto passed over each damaged checkpoint
        # checkpoint.verify: the trainer's loss of the fixed probe batch (collective), recorded at each save and
        # compared after a load with the digests of the state (engine/trust/saved.py)
        self.probe = None
        self.stopped_unsaved = False  # a stop signal ended training with nothing saved (no checkpoint.dir)
        self.locks: list[CheckpointLock] = []  # train.out_dir's, and checkpoint.dir's unless it is the same
        # Metadata travels through the job's store, gathered to rank 0 (engine/cluster/exchange.py): usable from the
        # async thread and under nccl, O(1) requests per rank. It also carries rank 0's verdict on train.out_dir,
        # which every run writes. With parallel.timeout_s, a rank that dies or hangs during a save fails the
        # others' exchange in bounded time.
        self.exchange = self.stop_exchange = None
        if ctx.world_size > 1:
            store, n = dist.distributed_c10d._get_default_store(), next(_INSTANCES)  # n: the same on every rank
            self._stores = {"main": store}
            self.exchange, self.stop_exchange = (
                StoreExchange(store, ctx.rank, ctx.world_size, cfg.parallel.timeout_s, f"engine/{what}/{n}")
                for what in ("checkpoint", "stop")
            )
        status = [uuid.uuid4().hex[:8], None]  # the run's token, and rank 0's verdict on the directories
        if ctx.rank == 0:
            self.locks, status[1] = claim_run_directories(cfg, self.root, status[0])
        if self.exchange is not None:
            status = self.exchange.broadcast(status)
        self.token, error = status
        if error is None and self.exchange is not None:  # every host sees the same directories (cluster/shared.py)
            directories = run_directories(Path(cfg.train.out_dir), self.root)
            hosts, error = check_shared(directories, self.token, self.exchange)
            if ctx.rank == 0 and describe_hosts(hosts):
                print(describe_hosts(hosts), flush=True)
        if error is not None:
            self.release()
            raise CheckpointError(error)

    def release(self) -> None:
        """Give back the directory locks and the signals (the end of fit; a failed start-up or save)."""
        self.stop.uninstall()
        for lock in self.locks:
            lock.release()
        self.locks = []

    # ---- exchanges through the store --------------------------------------------------------------------------
    def _first(self, obj):
        """The first not-None ``obj`` by rank, on every rank (a rank's error, rank 0's verdict)."""
        if self.exchange is None:
            return obj
        self.exchange.store = self._store()
        return self.exchange.first(obj)

    def _store(self):
        """The main thread's store client, or (the async writer) a connection of its own, made once."""
        name = "main" if threading.current_thread() is threading.main_thread() else "writer"
        if name not in self._stores:
            self._stores[name] = self._stores["main"].clone()
        return self._stores[name]

    # ---- save ----------------------------------------------------------------------------------------------------
    def save(self, parts: CheckpointParts, position: RunPosition, prune: bool = True) -> Path | None:
        """Write the parts as checkpoint ``position.step``; returns its final path (committed on return unless
        async_save), None when a rank holds non-finite values (nothing written). ``prune``: then delete the steps
        beyond checkpoint.keep (not for a save inside a streak of skipped steps: ``after_step``)."""
        if self.root is None:
            raise CheckpointError("checkpoint.dir is empty; set it to save checkpoints")
        self.wait()
        start = time.perf_counter()
        tensors, meta, header = contents(parts, position)
        if not self._all_finite(tensors, position.step):
            return None
        self.timings = {"snapshot_s": time.perf_counter() - start}
        if self.cfg.checkpoint.verify:  # what a resume will be checked against (engine/trust/saved.py)
            probe = self.probe() if self.probe else None
            header[saved.FIELD] = saved.record(position, probe, saved.probe_shape(self.cfg))  # the digests: writer
            self.timings["probe_s"] = time.perf_counter() - start - self.timings["snapshot_s"]
        args = (position.step, tensors, meta, header, self.cfg.checkpoint.keep if prune else 0)
        if self.cfg.checkpoint.async_save:
            self.pending = threading.Thread(
                target=self._write_and_commit, args=args, name="checkpoint-writer", daemon=True
            )
            self.pending.start()
        else:
            try:
                self._write_and_commit(*args)
            except KeyboardInterrupt:  # a second SIGINT (signals.py): drop this save, `latest` stays the last good
                discard(self.root, position.step, self.token)
                raise Interrupted(
                    f"a second SIGINT during the save of step {position.step}: that save was dropped, "
                    f"the latest checkpoint stays {latest_name(self.root)}"
                ) from None
            self._raise_pending_error()
        self.last_saved = position.step
        return self.root / step_name(position.step)

    def _all_finite(self, tensors: dict, step: int) -> bool:
        """Collective: False (and one line on rank 0) when any rank holds a NaN/inf weight or Adam moment. Such
        a checkpoint would pass its CRC and poison every resume; the previous one stays `latest` instead."""
        bad = next((k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
        found = [(self.ctx.rank, bad, 1)] if bad is not None else []
        if self.exchange is not None:
            self.exchange.store = self._store()
            found = self.exchange.reduce(bad, _non_finite)
        if found and self.ctx.rank == 0:
            (rank, key, count) = found[0]
            more = f" (and on {count - 1} more ranks)" if count > 1 else ""
            say(
                f"checkpoint: not saving step {step}: rank {rank} holds NaN/inf values in {key.split('/tp')[0]}"
                f"{more}; the latest checkpoint stays {latest_name(self.root)}"
            )
        return not found

    def _write_and_commit(self, step: int, tensors: dict, meta: dict, header: dict, keep: int) -> None:
        """Collective; a failed write on any rank fails it on all (StorageError), `latest` stays the last good."""
        start, tmp = time.perf_counter(), staging_path(self.root, step, self.token)
        try:
            staging_dir(self.root, step, self.token)
            meta.update(write_shard(tmp / meta["file"], tensors))
            digests = None
            if saved.FIELD in header:  # the digests of what was written (engine/trust/saved.py), rank 0 adds them
                digested = time.perf_counter()
                digests = saved.written(tensors, meta["params"])
                self.timings["digest_s"] = time.perf_counter() - digested
            plan = write_part(tmp, meta["rank"], meta)  # this rank's part of the index, written by itself
            if digests is not None:
                plan["digests"] = digests  # to rank 0 with the plan, not into the part
        except Exception as e:  # the others must not wait forever for this rank's metadata
            plan = {"error": f"rank {meta['rank']} could not save step {step}: {describe(tmp / meta['file'], e)}"}
        if self.exchange is not None:
            self.exchange.store = self._store()
        plans = self.exchange.gather(plan) if self.exchange is not None else [plan]  # to rank 0 only
        errors = [m["error"] for m in plans or [] if "error" in m]
        if not errors and self.ctx.rank == 0:
            try:
                steps = [m.pop("adam_step") for m in plans]
                header["adam_step"] = max((s for s in steps if s is not None), default=None)
                saved.at_commit(header, plans)
                index, locator = merge_index(plans, header)
                publish(self.root, step, self.token, index, keep, locator)
                say(f"checkpoint: saved {self.root / step_name(step)}")  # where to export it from
            except Exception as e:  # reported on every rank: none may wait for a commit that never comes
                errors.append(f"rank 0 could not commit step {step}: {describe(self.root, e)}")
        # Also the barrier after which every rank sees the committed directory and `latest`.
        error = self._first(errors[0] if errors else None)
        if error is not None:
            if self.ctx.rank == 0:
                discard(self.root, step, self.token)
            self.error = StorageError(f"checkpoint: {error}; the latest checkpoint stays {latest_name(self.root)}")
        self.timings["write_commit_s"] = time.perf_counter() - start

    def wait(self) -> None:
        """Block until an async save has committed; re-raise its error."""
        if self.pending is not None:
            self.pending.join()
            self.pending = None
        self._raise_pending_error()

    def _raise_pending_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    # ---- the training loop's hooks ---------------------------------------------------------------------------
    def start(self) -> None:
        self.stop.install()

    def after_step(
        self, parts: CheckpointParts, position: RunPosition, streak: int = 0, agreed: bool | None = None
    ) -> bool:
        """Save when due (every N steps, the last step, a stop signal); True when training must stop now.
        ``agreed``: the stop decision the step's agreement already took (engine/trainer.py ``agree``); None: ask
        the ranks now (``StopSignal.agreed``, one all-reduce).
        ``streak``: the steps skipped in a row so far for a NaN/inf loss or gradient (the trainer's count). Inside
        one the weights are those that diverged: a periodic save is skipped, and the last step's or a stop's
        is saved without pruning, so the checkpoints from before the streak, which the abort tells the user to
        resume from, are never pruned for it."""
        stop = self.stop.agreed(self.ctx, self.stop_exchange) if agreed is None else agreed
        c, step = self.cfg.checkpoint, position.step
        final = step == self.cfg.train.steps or stop
        due = (c.every and step % c.every == 0) or final
        if self.root is not None and due and self.last_saved != step:
            if streak and self.ctx.rank == 0:
                say(
                    f"checkpoint: step {step} is skipped step {streak} of a streak (NaN/inf loss or gradient): "
                    + ("saved without pruning" if final else "not saved")
                    + f", so the earlier checkpoints stay (latest: {latest_name(self.root)})"
                )
            if streak and not final:
                return stop
            try:
                self.save(parts, position, prune=not streak)
            except BaseException as e:  # the run ends here: give the directories back
                self.release()
                if self.stop.failed and isinstance(e, CheckpointError):
                    raise StorageError(f"{self.stop.failure}; and {e}") from None
                raise
        if stop and not self.stop.failed and self.ctx.rank == 0:
            say(self._stop_line(step))
        self.stopped_unsaved = stop and self.root is None
        return stop

    def _stop_line(self, step: int) -> str:
        saved = (
            f", checkpoint saved in {self.root}"
            if self.root is not None
            else "; nothing saved (checkpoint.dir is empty)"
        )
        if self.stop.restart:  # engine/checkpoint/signals.py: the agent's SIGTERM, not a user's
            return (
                "restart: the torchrun agent stopped its workers (a host joined the job, a worker failed, or the "
                f"agent got a signal): stopping after step {step}{saved}, exit status 1 so that no agent takes the job "
                "as finished"
            )
        name = self.stop.signal_name or "on another rank"
        return f"stop signal ({name}): stopping after step {step}{saved}" + (
            ", exit status 1" if self.root is None else ""
        )

    def finish(self) -> None:
        """The end of fit: an async save commits; a stop for a failed metrics write raises it (after the save)."""
        try:
            self.wait()
        finally:
            self.release()
        if self.stop.failed:
            raise StorageError(
                f"{self.stop.failure}; "
                + (
                    f"checkpoint {step_name(self.last_saved)} saved in {self.root}"
                    if self.last_saved is not None
                    else "no checkpoint saved"
                )
            )

    # ---- resume ----------------------------------------------------------------------------------------------
    def _validate(self, path: Path) -> tuple[dict | None, str | None]:
        """Collective: every rank checks the index, and the sizes and CRCs of its share of the shards."""
        index, error = None, None
        try:
            index = read_index(path, share=(self.ctx.rank, self.ctx.world_size))
            for file in index["_share"]:
                verify_shard(path, index, file)
        except CheckpointError as e:
            error = str(e)
        error = self._first(error)
        return (None, error) if error is not None else (index, None)

    def resume(self, parts: CheckpointParts) -> RunPosition | None:
        """Load the checkpoint that checkpoint.resume selects into ``parts``; returns the position to continue
        from (None: a fresh start; the path loaded is ``self.resumed_from``)."""
        candidates = to_try(self.cfg.checkpoint.resume, self.root, self.ctx.rank == 0)
        explicit = self.cfg.checkpoint.resume not in ("auto", "none")
        bad: dict[Path, str] = {}
        for path in candidates:
            start = time.perf_counter()
            index, error = self._validate(path)
            if error is not None:
                if explicit:
                    raise CheckpointError(error)
                self.skipped.append(error)
                bad[path] = error
                if self.ctx.rank == 0:
                    print(f"checkpoint: skipping {path}: {error}", flush=True)
                continue
            check_model(path, index, self.cfg.model)
            validated = time.perf_counter()
            position = load_into(parts, path, index)
            loaded = time.perf_counter()
            self._check_loaded(parts, path, index, position)
            self._settle(position.step, bad)
            self.timings = {"validate_s": validated - start, "load_s": loaded - start}
            self.timings["verify_s"] = time.perf_counter() - loaded
            if self.ctx.rank == 0:
                print(f"resumed from {path} (step {index['step']}, saved at {index['layout']})", flush=True)
                change = layout_change(index, self.cfg, self.ctx)
                if change:
                    print(change, flush=True)
                for note in data_changes(index, self.cfg):
                    print(f"notice: {note}", flush=True)
            self.resumed_from = path
            return position
        if candidates:
            raise CheckpointError(
                f"no usable checkpoint among {[str(p) for p in candidates]}; fix or remove them, "
                f"or set checkpoint.resume=none to start fresh"
            )
        self._settle(0, bad)
        return None

    def _check_loaded(self, parts: CheckpointParts, path: Path, index: dict, position: RunPosition) -> None:
        """Collective (checkpoint.verify): the loaded state's digests and probe loss against those saved with it
        (engine/trust/saved.py); a mismatch is a CheckpointError naming what differs. An older checkpoint without
        them resumes unchecked, said once."""
        record = index.get(saved.FIELD)
        if not self.cfg.checkpoint.verify or index.get("model_only"):
            return
        if record is None:
            if self.ctx.rank == 0:
                say(
                    f"notice: {path} holds no digests (an older engine's, or checkpoint.verify=false): "
                    "resumed unchecked"
                )
            return
        # a resume with another global batch or sequence length (said by the resume notices) has another probe
        same_probe = record.get("probe_batch") == saved.probe_shape(self.cfg)
        mine, loss = saved.digests(parts), self.probe() if self.probe and same_probe else None
        adam_step = parts.state().adam_step()  # on every rank: a dp mode's state() may be collective (fsdp)
        if self.exchange is not None:
            self.exchange.store = self._store()
        everyone = self.exchange.gather(mine) if self.exchange is not None else [mine]  # to rank 0 only
        error = None
        if self.ctx.rank == 0:
            # the probe's bound follows the dtype it computes in: bf16 under train.dtype bf16 also where the
            # weights stay fp32 (fsdp's and autocast's bf16 compute; a zero1 bf16 save resumed under fsdp
            # moved its probe by 2.3e-5, over fp32's 2e-5)
            bf16 = self.cfg.train.dtype == "bf16"
            dtype = torch.bfloat16 if bf16 else next(parts.model.parameters()).dtype
            found = saved.compare(record, saved.combine(everyone), position, adam_step, (loss, dtype))
            error = saved.verdict(path, found)
        error = self._first(error)
        if error is not None:
            raise CheckpointError(error)

    def _settle(self, start: int, bad: dict[Path, str]) -> None:
        """Collective: the steps of checkpoint.dir above ``start`` are refused or set aside (engine/checkpoint/
        lineage.py); ends with an exchange, after which every rank sees the directory as rank 0 left it."""
        error = None
        if self.root is not None:
            unusable = settle(self.root, start, self.cfg.checkpoint.resume, lambda p: self._validate(p)[1], bad)
            if unusable and self.ctx.rank == 0:
                try:
                    set_aside(self.root, start, unusable, self.token)
                except OSError as e:  # reported on every rank: none may wait for rank 0
                    error = f"cannot set aside the unusable steps above step {start} in {self.root}: {e}"
        error = self._first(error)
        if error is not None:
            raise CheckpointError(error)


_INSTANCES = itertools.count()  # Checkpointers made in this process: their exchanges' keys never meet


def _non_finite(bad: list) -> list[tuple[int, str, int]]:
    """Rank 0, from every rank's first non-finite key (or None): [(first such rank, its key, how many ranks)]."""
    found = [(rank, key) for rank, key in enumerate(bad) if key is not None]
    return [(*found[0], len(found))] if found else []
