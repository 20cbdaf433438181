"""ParallelContext: the named rank mesh's process groups (axes and rank layout: engine/parallel/layout/mesh.py), and the
device and backend, built in one place.

The object is passed explicitly to whatever needs a group; there are no process-group globals. It also answers
DeepSpeed's ``mpu`` questions (``get_data_parallel_group`` and friends) so it can be given as ``mpu=ctx``.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.cluster.netcheck import check_addresses, init_checked
from engine.cluster.startup import connect_failed
from engine.config import Config, ConfigError
from engine.parallel.layout.checks import Layout, resolve_layout
from engine.parallel.layout.mesh import DATA_AXES, MODEL_PARALLEL, Mesh
from engine.parallel.layout.threads import local_world_size, set_threads

# Set to 1 by engine/parallel/layout/spawn.py in each forked gloo rank: that rank runs on the CPU whatever GPUs are
# visible (several forked ranks would all get cuda:0, which NCCL refuses as "Duplicate GPU detected", and a child must
# not touch CUDA at all if its parent initialised it before forking).
CPU_ONLY_ENV = "ENGINE_CPU_ONLY"


def pick_device_and_backend(requested: str = "auto", local_rank: int = 0) -> tuple[torch.device, str]:
    """The single place that chooses device and backend: nccl on CUDA, gloo on CPU (always under ENGINE_CPU_ONLY=1,
    without asking torch.cuda). More local ranks (LOCAL_WORLD_SIZE) than visible GPUs is a ConfigError under nccl:
    two ranks on one GPU would fail inside NCCL's set-up."""
    if requested not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"parallel.backend={requested!r} is not one of auto, gloo, nccl")
    cpu_only = os.environ.get(CPU_ONLY_ENV) == "1"
    cuda = not cpu_only and torch.cuda.is_available()
    if requested == "nccl" and not cuda:
        why = f"{CPU_ONLY_ENV}=1 (a forked gloo rank)" if cpu_only else "torch.cuda.is_available() is False"
        raise ConfigError(f"parallel.backend=nccl needs CUDA, but {why}; use auto or gloo")
    if cuda and requested != "gloo":
        devices, local_world = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        if local_world > devices:
            raise ConfigError(
                f"LOCAL_WORLD_SIZE={local_world} ranks on this node but {devices} GPU(s) visible; NCCL "
                f"needs one GPU per rank: start at most {devices} ranks per node, or set "
                f"parallel.backend=gloo to run on the CPU"
            )
        return torch.device("cuda", local_rank % devices), "nccl"
    return torch.device("cpu"), "gloo"


def apply_tf32(enabled: bool, device: torch.device) -> None:
    """train.tf32: fp32 matmuls on CUDA run on TF32 tensor cores (10-bit mantissa products, fp32 accumulation;
    NVIDIA's A100 whitepaper: 8x the fp32 rate) when enabled, full fp32 when not. Off CUDA there are no TF32
    units and the flag is left alone. The MFU peak follows the flag (engine/model/flops.py)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled


def group_options(backend: str, timeout: datetime.timedelta):
    """Backend options carrying ``timeout`` for the groups DeviceMesh creates. torch's ``new_group`` defaults to
    the backend's global timeout (gloo: 30 min), not the world group's, so without this a dead peer would hang a
    tp/dp/pp collective for half an hour whatever ``init_process_group`` was given."""
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


def env_rank_info() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) as set by torchrun or the deepspeed launcher; (0, 1, 0) under plain python."""

    def read(name: str, default: int) -> int:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None

    world = read("WORLD_SIZE", 1)
    rank, local = read("RANK", 0), read("LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise ConfigError(f"environment RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    return rank, world, local


def elastic_layout(cfg: Config, world: int) -> Layout:
    """resolve_layout; after a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) its refusal says the layout cannot
    follow the new world (README "Elastic restart"). torchrun restarts on any non-zero exit, whatever its code (its
    agent only tells FAILED from SUCCEEDED), so the line says how often the refusal will repeat."""
    try:
        return resolve_layout(cfg, world)
    except ConfigError as e:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if restart == 0:
            raise
        left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) - restart
        again = (
            f"; torchrun restarts whatever the exit code: this repeats on its {left} restart(s) left"
            if left > 0
            else ""
        )
        raise ConfigError(
            f"elastic restart {restart}: the layout cannot shrink to the {world} ranks left: {e}{again}"
        ) from None


class ParallelContext:
    """This rank's groups and coordinates in the named mesh (engine/parallel/layout/mesh.py), asked for by axis name:
    ``group("tp")``, ``axis_rank("pp")``, ``size("dp")``, ``ranks_along("pp")``; besides the axes, two derived
    groups: "mp" (Megatron's model-parallel group, every axis but dp and cp) and "embed" (first and last stage of
    each pipeline, which hold the two copies of a tied embedding / LM head; None when pp is 1), and "dp_cp" (the
    data axes together: the ranks holding the same weights, over which gradients are reduced)."""

    def __init__(
        self,
        layout: Layout,
        mesh: DeviceMesh,
        device: torch.device,
        backend: str,
        timeout: datetime.timedelta | None = None,
    ):
        self.layout, self.mesh, self.device, self.backend = layout, mesh, device, backend
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.named_mesh = Mesh(layout.axes)
        self._coords = self.named_mesh.coords(self.rank)
        self._groups = {name: mesh.get_group(name) for name in self.named_mesh.names}
        self._groups["mp"] = (
            _member_group(self.named_mesh.groups_spanning(MODEL_PARALLEL), self.rank, timeout)
            if self.world_size > 1
            else dist.group.WORLD
        )
        self._groups["embed"] = _member_group(self.named_mesh.ends_along("pp"), self.rank, timeout)
        # "dp_cp": the ranks holding the same weights (dp replicas x cp ranks of other tokens), over which gradients
        # are reduced and FSDP/ZeRO shard; its flattened mesh is FSDP's (ranks ordered dp-major, as ``grad_rank``).
        self.grad_mesh = mesh["dp", "cp"]._flatten(
            "dp_cp", backend_override=(backend, group_options(backend, timeout)) if timeout is not None else None
        )
        self._groups["dp_cp"] = self.grad_mesh.get_group()
        # Expert parallelism (engine/parallel/ep/): the data ranks dp x cp (dp-major, as grad_rank) split into ep
        # groups of consecutive ones and expert-dp groups (dp cp / ep ranks holding the same experts), Megatron's
        # expert-data-parallel layout. Their own groups even where one equals dp x cp: the all-to-all runs during
        # backward, beside DDP's asynchronous all-reduces, and two collectives in flight on one gloo group can pair
        # up in different orders on different ranks.
        ep = getattr(layout, "ep", 1)
        self._split = dict(zip(("ep", "edp"), self.named_mesh.split_along(DATA_AXES, ep, self.rank)))
        split = dict(zip(("ep", "edp"), self.named_mesh.split_groups(DATA_AXES, ep)))
        for name, lists in split.items():
            self._groups[name] = (
                self.group("dp_cp")
                if ep == 1 and name == "edp"
                else _member_group(lists, self.rank, timeout)
                if len(lists[0]) > 1
                else None
            )
        # Named DeviceMeshes besides grad_mesh: "edp", the expert-dp ranks FSDP shards the experts over (dp/fsdp.py),
        # one 1-D mesh per expert-dp group, built from the group's own rank list (whatever axes ep is carved from);
        # at expert-dp size 1 (ep = dp) a group of one, so that every expert unit has a mesh
        self._meshes = {"dp_cp": self.grad_mesh}
        if ep > 1:
            edp = self._groups["edp"] or _member_group(split["edp"], self.rank, timeout)
            self._meshes["edp"] = DeviceMesh.from_group(
                edp, device.type, mesh=self._split["edp"], mesh_dim_names=("edp",)
            )

    # ---- by name (every consumer; adding an axis adds a name, not a method) ------------------------------------
    def group(self, name: str):
        """The process group of axis ``name`` (pp, dp, cp, tp) or of a derived group (mp, embed, ep, edp; ep and edp
        are None at size 1)."""
        if name not in self._groups:
            raise KeyError(f"no group {name!r}; the groups are {', '.join(self._groups)}")
        return self._groups[name]

    def mesh_for(self, name: str) -> DeviceMesh:
        """The DeviceMesh of group ``name``: "dp_cp" (``grad_mesh``) or "edp" (the expert-dp group; ep > 1 only)."""
        if name not in self._meshes:
            raise KeyError(f"no mesh {name!r}; the meshes are {', '.join(self._meshes)}")
        return self._meshes[name]

    def axis_rank(self, axis: str) -> int:
        """This rank's index along ``axis`` (``ctx.rank`` stays the global rank), or in the ep / edp group."""
        if axis in self._split:
            return self._split[axis].index(self.rank)
        self.named_mesh.size(axis)  # an unknown name fails naming the valid ones
        return self._coords[axis]

    def size(self, axis: str) -> int:
        return len(self._split[axis]) if axis in self._split else self.named_mesh.size(axis)

    def coords(self) -> dict[str, int]:
        return dict(self._coords)

    def ranks_along(self, axis: str) -> list[int]:
        return list(self._split[axis]) if axis in self._split else self.named_mesh.ranks_along(axis, self.rank)

    def ranks_spanning(self, axes: tuple[str, ...]) -> list[int]:
        return self.named_mesh.ranks_spanning(axes, self.rank)

    # ---- read-only shortcuts over the by-name API, kept: 118 uses in 27 files of engine/, launch/, tests/ -------
    tp = property(lambda self: self.size("tp"))
    pp = property(lambda self: self.size("pp"))
    dp = property(lambda self: self.size("dp"))
    tp_rank = property(lambda self: self.axis_rank("tp"))
    pp_rank = property(lambda self: self.axis_rank("pp"))
    dp_rank = property(lambda self: self.axis_rank("dp"))
    tp_group = property(lambda self: self.group("tp"))
    pp_group = property(lambda self: self.group("pp"))
    dp_group = property(lambda self: self.group("dp"))
    mp_group = property(lambda self: self.group("mp"))
    embed_group = property(lambda self: self.group("embed"))
    stage_ranks = property(lambda self: self.ranks_along("pp"))  # global rank of each pp stage of this pipeline
    cp = property(lambda self: self.size("cp"))
    cp_rank = property(lambda self: self.axis_rank("cp"))
    cp_group = property(lambda self: self.group("cp"))
    # The gradient-reduction group dp x cp: its size, this rank's index in it (dp-major) and the group.
    grad_size = property(lambda self: self.dp * self.cp)
    grad_rank = property(lambda self: self.dp_rank * self.cp + self.cp_rank)
    grad_group = property(lambda self: self.group("dp_cp"))

    @classmethod
    def from_config(cls, cfg: Config, store=None) -> "ParallelContext":
        """Initialise torch.distributed from the launcher's environment (or a single process) and build the mesh.
        Every group gets cfg.parallel.timeout_s, so a dead peer fails the survivors' next collective in bounded time.
        ``store``: the job's store once every rank has joined it (engine/cluster/startup.py); the world group is
        then connected within parallel.startup_timeout_s (gloo's full mesh, NCCL's bootstrap) before its
        collectives get timeout_s."""
        rank, world, local_rank = env_rank_info()
        layout = elastic_layout(cfg, world)
        device, backend = pick_device_and_backend(cfg.parallel.backend, local_rank)
        apply_tf32(cfg.train.tf32, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # torch would take every core in every rank; the deepspeed launcher and plain python set no thread count.
        threads = set_threads(local_world_size())
        if rank == 0:
            print(threads, flush=True)
        timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
        if not dist.is_initialized():
            # device_id binds NCCL's communicators to this rank's GPU at once (eager init: no guessing the device
            # at the first collective, and new_group can split the world communicator instead of a new bootstrap)
            bound = {"device_id": device} if device.type == "cuda" else {}
            if world == 1 and "MASTER_ADDR" not in os.environ:
                # A plain `python launch/pretrain.py`: no rendezvous needed, an in-memory store will do.
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **bound)
            elif store is not None:
                check_addresses(store, rank, world)  # as init_checked does, on the store every rank joined
                startup = cfg.parallel.startup_timeout_s
                try:
                    dist.init_process_group(
                        backend,
                        store=store,
                        rank=rank,
                        world_size=world,
                        **bound,
                        timeout=datetime.timedelta(seconds=startup),
                    )
                except (RuntimeError, dist.DistError) as e:  # a peer that joined the store but never connected
                    raise connect_failed(e, rank, startup) from None
                dist.distributed_c10d._set_pg_timeout(timeout)
            else:
                # the hosts' addresses checked before gloo connects to them (engine/cluster/netcheck.py)
                init_checked(backend, rank, world, timeout, **bound)
        names, sizes = zip(*layout.axes)
        mesh = init_device_mesh(
            device.type,
            sizes,
            mesh_dim_names=names,
            backend_override={n: (backend, group_options(backend, timeout)) for n in names},
        )
        return cls(layout, mesh, device, backend, timeout)

    # ---- pipeline neighbours -------------------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_stage_rank(self) -> int | None:
        return None if self.is_first_stage else self.stage_ranks[self.pp_rank - 1]

    @property
    def next_stage_rank(self) -> int | None:
        return None if self.is_last_stage else self.stage_ranks[self.pp_rank + 1]

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={self.axis_rank(n)}/{self.size(n)}" for n in self.named_mesh.names)
        return (
            f"ParallelContext(rank={self.rank}/{self.world_size}, {axes}, device={self.device}, backend={self.backend})"
        )

    # ---- DeepSpeed / Megatron mpu interface ------------------------------------------------------------------
    # DeepSpeed's "data parallel" group is what it reduces gradients and partitions ZeRO state over: dp x cp (the cp
    # ranks hold the same weights), as Megatron-Core's get_data_parallel_group(with_context_parallel=True).
    def get_data_parallel_group(self):
        return self.grad_group

    def get_data_parallel_rank(self) -> int:
        return self.grad_rank

    def get_data_parallel_world_size(self) -> int:
        return self.grad_size

    def get_tensor_model_parallel_group(self):
        return self.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_pipeline_model_parallel_group(self):
        return self.pp_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size

    def get_model_parallel_group(self):
        return self.mp_group

    def get_model_parallel_rank(self) -> int:
        return self.ranks_spanning(MODEL_PARALLEL).index(self.rank)

    def get_model_parallel_world_size(self) -> int:
        return len(self.ranks_spanning(MODEL_PARALLEL))

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.ranks_spanning(("dp", "cp"))

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.ranks_along("tp")[0]


def _member_group(rank_lists: list[list[int]], rank: int, timeout: datetime.timedelta | None):
    """This rank's group among ``rank_lists`` (disjoint groups of one kind), or None, without a world-wide step per
    group. Under NCCL with a bound device (eager init), where every ``new_group`` would split the world
    communicator once, members or not: one ``split_group`` for the kind (one world-wide split, as DeviceMesh does).
    Otherwise (gloo) only the members create their group, synchronising among themselves; a rank in no group of
    the kind creates a group of itself, so that every rank holds as many groups, on which the names torch gives
    locally synchronised groups depend (members of a later group must agree on its name)."""
    if not rank_lists:
        return None
    if _splits_world():
        return dist.split_group(split_ranks=rank_lists, timeout=timeout)
    mine = next((ranks for ranks in rank_lists if rank in ranks), None)
    group = dist.new_group(mine or [rank], timeout=timeout, use_local_synchronization=True)
    return group if mine else None


def _splits_world() -> bool:
    """The default group holds an eagerly initialised NCCL communicator (``device_id`` bound at init), which
    ``split_group`` can split (DeviceMesh's own test, torch/distributed/device_mesh.py)."""
    default = dist.distributed_c10d._get_default_group()
    return getattr(default, "bound_device_id", None) is not None and dist.get_backend(default) == "nccl"


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
