"""Agreeing on one KV-cache config across workers (ranks of torch.distributed).

Each worker sizes its own cache from its own free memory, so the workers'
``num_blocks`` can differ; but a scheduler hands the same block ids to every
worker, so they must all use the same number of blocks and the same groups.
``reconcile_kv_cache_config`` gathers every rank's config and returns what
``gpukv.config.unify_kv_cache_configs`` makes of them: the same groups, the
smallest ``num_blocks``. It runs over any process group (gloo on CPUs, NCCL on
GPUs), so it works across processes and machines.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from gpukv.config import unify_kv_cache_configs
from gpukv.spec import KVCacheConfig

__all__ = ["reconcile_kv_cache_config"]

logger = logging.getLogger("gpukv")


def _rank_names(group: Any, world_size: int) -> list[str]:
    """Global rank names for the members of ``group``, in group-rank order."""
    if group is None:
        return [f"rank {i}" for i in range(world_size)]
    return [f"rank {dist.get_global_rank(group, i)}" for i in range(world_size)]


def reconcile_kv_cache_config(config: KVCacheConfig, group: Any = None) -> KVCacheConfig:
    """This rank's ``config`` made to agree with every other rank's.

    Single process (torch.distributed not initialized): ``config`` unchanged.
    Otherwise a collective over ``group`` (default: the world), so every rank
    of the group must call it. Every rank must have the same
    ``kv_cache_groups`` as the group's first rank, else every rank raises the
    same ValueError naming the first rank that differs and what differs (all
    ranks see all configs, so none is left waiting). The result has the
    smallest ``num_blocks`` of all ranks, each tensor ``page_size * num_blocks``
    bytes.

    With NCCL the objects travel through the current CUDA device: call
    ``torch.cuda.set_device(local_rank)`` first, as any NCCL program does.
    """
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        return config

    world_size = dist.get_world_size(group)
    gathered: list[Any] = [None] * world_size
    # Plain dicts, not the dataclasses: what crosses the wire is JSON-able data
    # (no torch.dtype pickling, no dependence on the peer's class versions).
    dist.all_gather_object(gathered, config.to_dict(), group=group)
    configs = [KVCacheConfig.from_dict(data) for data in gathered]

    unified = unify_kv_cache_configs(configs, names=_rank_names(group, world_size))
    mine = unified[dist.get_rank(group)]
    if mine.num_blocks != config.num_blocks:
        logger.info(
            "KV cache: %d blocks here, %d on the smallest rank; using %d",
            config.num_blocks,
            mine.num_blocks,
            mine.num_blocks,
        )
    return mine
