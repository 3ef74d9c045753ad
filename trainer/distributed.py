"""torch.distributed setup: one process per device under `torchrun`, FSDP2 sharding of the policy."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from protocol.errors import PrimeError
from trainer.source import Batch, RolloutSource


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> DistInfo:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); gloo on CPU, nccl on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2: shard every decoder layer, then the root (embeddings, final norm, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = getattr(getattr(model, "model", model), "layers", None)
    for layer in layers or []:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class RankZeroSource(RolloutSource):
    """Every rank trains on rank 0's batches: only rank 0 reads the inner source, the others receive.

    For sources whose answer depends on timing (a network feed), where ranks reading on their own
    would get different groups. A failure on rank 0 (e.g. `DataStarvedError`) is raised on every rank.
    """

    def __init__(self, inner: RolloutSource | None, device: torch.device) -> None:
        self.inner = inner  # None on ranks other than 0
        self.device = device

    def next_batch(self, step: int, n_groups: int, async_level: int, *, min_groups: int | None = None,
                   fill_timeout_s: float | None = None, expected: int | None = None) -> Batch:
        box: list[object] = [None]
        if self.inner is not None:
            try:
                box[0] = self.inner.next_batch(step, n_groups, async_level, min_groups=min_groups,
                                               fill_timeout_s=fill_timeout_s, expected=expected)
            except Exception as exc:
                # PrimeErrors are plain message exceptions (they pickle); anything else goes as its repr.
                box[0] = exc if isinstance(exc, PrimeError) else RuntimeError(f"rank 0: {exc!r}")
                dist.broadcast_object_list(box, src=0, device=self.device)
                raise
        dist.broadcast_object_list(box, src=0, device=self.device)
        if isinstance(box[0], Exception):
            raise box[0]
        assert isinstance(box[0], Batch)
        return box[0]

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict() if self.inner is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
