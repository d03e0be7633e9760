"""This process's tensor-parallel rank and world size, and the collectives layers use.

Models are built after `set_rank` (the converter sets it per rank to shard weights; engine ranks
after joining the process group), so their parallel layers size themselves for this rank.
"""
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    # Whether a process group exists: the converter shards without one, collectives need one.
    connected: bool = False


_state = TensorParallel()


def current() -> TensorParallel:
    return _state


def set_rank(rank: int, world_size: int, connected: bool = False) -> None:
    global _state
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    _state = TensorParallel(rank, world_size, connected)


@contextlib.contextmanager
def as_rank(rank: int, world_size: int):
    """Build models as `rank` of `world_size` (for sharding), then restore the previous state."""
    global _state
    previous = _state
    set_rank(rank, world_size)
    try:
        yield
    finally:
        _state = previous


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks (x itself with one rank)."""
    if _state.world_size > 1:
        if not _state.connected:
            raise RuntimeError("tensor-parallel collectives need the ranks' process group")
        dist.all_reduce(x)
    return x
