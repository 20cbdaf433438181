"""ParallelContext: the rank grid (pp, dp, tp), its process groups, and the device, built in one place.

Rank layout (Megatron / DeepSpeed order, tp fastest-varying so TP peers share a node):
    rank = (pp_rank * dp + dp_rank) * tp + tp_rank
The object is passed explicitly to whatever needs a group; there are no process-group globals. It also answers
DeepSpeed's ``mpu`` questions (``get_data_parallel_group`` and friends) so it can be given as ``mpu=ctx``.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.config import Config, ConfigError
from engine.parallel.support import Layout, resolve_layout


# Set to 1 by engine/cluster/spawn.py in each forked gloo rank: that rank runs on the CPU whatever GPUs are visible
# (several forked ranks would all get cuda:0, which NCCL refuses as "Duplicate GPU detected", and a child must not
# touch CUDA at all if its parent initialised it before forking).
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
            raise ConfigError(f"LOCAL_WORLD_SIZE={local_world} ranks on this node but {devices} GPU(s) visible; NCCL "
                              f"needs one GPU per rank: start at most {devices} ranks per node, or set "
                              f"parallel.backend=gloo to run on the CPU")
        return torch.device("cuda", local_rank % devices), "nccl"
    return torch.device("cpu"), "gloo"


def apply_tf32(enabled: bool, device: torch.device) -> None:
    """train.tf32: fp32 matmuls on CUDA run on TF32 tensor cores (10-bit mantissa products, fp32 accumulation;
    NVIDIA's A100 whitepaper: 8x the fp32 rate) when enabled, full fp32 when not. Off CUDA there are no TF32
    units and the flag is left alone. The MFU peak follows the flag (engine/planning/flops.py)."""
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


class ParallelContext:
    """Groups and coordinates of this rank in the (pp, dp, tp) grid."""

    def __init__(self, layout: Layout, mesh: DeviceMesh, device: torch.device, backend: str,
                 timeout: datetime.timedelta | None = None):
        self.layout, self.mesh, self.device, self.backend = layout, mesh, device, backend
        self.tp, self.pp, self.dp = layout.tp, layout.pp, layout.dp
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.tp_group = mesh.get_group("tp")
        self.pp_group = mesh.get_group("pp")
        self.dp_group = mesh.get_group("dp")
        self.tp_rank = mesh.get_local_rank("tp")
        self.pp_rank = mesh.get_local_rank("pp")
        self.dp_rank = mesh.get_local_rank("dp")
        grid = mesh.mesh  # (pp, dp, tp) tensor of global ranks
        # Model-parallel group (tp x pp, one per dp index), as Megatron's mpu defines it. Every rank must create
        # every group in the same order, so loop over all dp indices.
        self.mp_group = None
        for d in range(self.dp):
            ranks = grid[:, d, :].flatten().tolist()
            group = dist.new_group(ranks, timeout=timeout) if self.world_size > 1 else dist.group.WORLD
            if self.rank in ranks:
                self.mp_group = group
        self.stage_ranks = grid[:, self.dp_rank, self.tp_rank].tolist()  # global rank of each pp stage
        # Embedding group: first and last stage of each (dp, tp) pipeline, which hold the two copies of a tied
        # embedding / LM head weight and all-reduce their gradients (Megatron's embedding group).
        self.embed_group = None
        if self.pp > 1:
            for d in range(self.dp):
                for t in range(self.tp):
                    ranks = [grid[0, d, t].item(), grid[-1, d, t].item()]
                    group = dist.new_group(ranks, timeout=timeout)
                    if self.rank in ranks:
                        self.embed_group = group

    @classmethod
    def from_config(cls, cfg: Config) -> "ParallelContext":
        """Initialise torch.distributed from the launcher's environment (or a single process) and build the mesh.
        Every group gets cfg.parallel.timeout_s, so a dead peer fails the survivors' next collective in bounded time."""
        rank, world, local_rank = env_rank_info()
        layout = resolve_layout(cfg, world)
        device, backend = pick_device_and_backend(cfg.parallel.backend, local_rank)
        apply_tf32(cfg.train.tf32, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif "OMP_NUM_THREADS" not in os.environ:
            # The deepspeed launcher sets no thread count: share the cores among this node's ranks.
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")) or 1)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
        timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
        if not dist.is_initialized():
            # device_id binds NCCL's communicators to this rank's GPU at once (eager init: no guessing the device
            # at the first collective, and new_group can split the world communicator instead of a new bootstrap)
            bound = {"device_id": device} if device.type == "cuda" else {}
            if world == 1 and "MASTER_ADDR" not in os.environ:
                # A plain `python launch/pretrain.py`: no rendezvous needed, an in-memory store will do.
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                        **bound)
            else:
                dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **bound)
        names = ("pp", "dp", "tp")
        mesh = init_device_mesh(device.type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=names,
                                backend_override={n: (backend, group_options(backend, timeout)) for n in names})
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
        return (f"ParallelContext(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp}, "
                f"pp={self.pp_rank}/{self.pp}, dp={self.dp_rank}/{self.dp}, device={self.device}, "
                f"backend={self.backend})")

    # ---- DeepSpeed / Megatron mpu interface ------------------------------------------------------------------
    def get_data_parallel_group(self): return self.dp_group
    def get_data_parallel_rank(self) -> int: return self.dp_rank
    def get_data_parallel_world_size(self) -> int: return self.dp
    def get_tensor_model_parallel_group(self): return self.tp_group
    def get_tensor_model_parallel_rank(self) -> int: return self.tp_rank
    def get_tensor_model_parallel_world_size(self) -> int: return self.tp
    def get_pipeline_model_parallel_group(self): return self.pp_group
    def get_pipeline_model_parallel_rank(self) -> int: return self.pp_rank
    def get_pipeline_model_parallel_world_size(self) -> int: return self.pp
    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    def get_model_parallel_group(self): return self.mp_group
    def get_model_parallel_rank(self) -> int: return self.pp_rank * self.tp + self.tp_rank
    def get_model_parallel_world_size(self) -> int: return self.tp * self.pp
    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.mesh.mesh[self.pp_rank, :, self.tp_rank].tolist()
    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.mesh.mesh[self.pp_rank, self.dp_rank, 0].item()


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
