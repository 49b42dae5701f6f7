"""Ranks, devices and the device mesh of a job (the torchtitan `ParallelDims` idea).

The mesh always has the four dims (pp, dp_replicate, dp_shard, tp) in that order,
size-1 dims included, so every part of the worker can slice `mesh["tp"]` or
`mesh["dp_shard"]` without asking whether that kind of parallelism is on.
Rank layout follows from the order: tp is innermost, so a tensor-parallel group
is made of neighbouring ranks (the GPUs most likely to share NVLink).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.layout import MESH_DIMS, Layout

TIMEOUT_ENV = "RIGPILOT_COLLECTIVE_TIMEOUT_S"


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @classmethod
    def from_layout(cls, layout: Layout, world_size: int) -> ParallelDims:
        """The one way a Layout becomes the worker's dims: refused unless its degrees multiply to `world_size`."""
        layout.check_ranks(world_size)
        return cls(pp=layout.pp, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp,
                   world_size=world_size)  # fmt: skip

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_dp(self) -> int:
        """Ranks that share one model replica (and one batch)."""
        return self.pp * self.tp

    def coordinate(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dim (row-major over MESH_DIMS, as init_device_mesh lays it out)."""
        coord: dict[str, int] = {}
        rest = rank
        for name, size in reversed(list(zip(MESH_DIMS, self.shape, strict=True))):
            coord[name] = rest % size
            rest //= size
        return {name: coord[name] for name in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        c = self.coordinate(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]


@dataclass(frozen=True)
class Runtime:
    """What this process is: its rank, its device and the mesh it sits in."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    dims: ParallelDims
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def coord(self) -> dict[str, int]:
        return self.dims.coordinate(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.coord["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coord["tp"]


def choose_device(simulated: bool, local_rank: int) -> tuple[torch.device, str]:
    """cuda:<local_rank> with NCCL on real GPUs; the CPU with gloo for simulated jobs or CPU-only hosts.

    CUDA_VISIBLE_DEVICES (set by the service to the job's GPUs) makes local_rank
    index the job's own GPUs.
    """
    if not simulated and torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"rank with local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r})"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def init_runtime(spec: JobSpec) -> Runtime:
    """Join the process group torchrun set up and build the 4-D device mesh."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dims = ParallelDims.from_layout(spec.parallelism, world_size)
    device, backend = choose_device(spec.simulated, local_rank)
    if "MASTER_ADDR" not in os.environ:  # started without torchrun: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "1800")))
        # CPU offload keeps gradients (DTensors) in host memory: their norm and the final gather are
        # collectives on CPU tensors, which NCCL cannot run, so gloo serves the CPU side.
        offload_on_gpu = spec.parallelism.cpu_offload and device.type == "cuda"
        dist.init_process_group(
            backend="cuda:nccl,cpu:gloo" if offload_on_gpu else backend,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    mesh = init_device_mesh(device.type, dims.shape, mesh_dim_names=MESH_DIMS)
    return Runtime(rank, local_rank, world_size, device, backend, dims, mesh)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
