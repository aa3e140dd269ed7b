"""Agreeing on one KV-cache config across workers (ranks of torch.distributed).

Each worker sizes its own cache from its own free memory, so the workers'
``num_blocks`` can differ; but a scheduler hands the same block ids to every
worker, so they must all use the same number of blocks and the same groups.
``reconcile_kv_cache_config`` gathers every rank's config and returns what
``gpukv.sizing.config.unify_kv_cache_configs`` makes of them: the same groups, the
smallest ``num_blocks``. It runs over any process group (gloo on CPUs, NCCL on
GPUs), so it works across processes and machines.

No rank trusts another: what crosses the wire is plain data, never a pickle
(``all_gather_object`` unpickles what peers send, so a peer could run code
here). The protocol, in two all-gathers of tensors:

1. **Header.** Every rank sends three int64: ``PROTOCOL`` (which says the
   peer speaks this protocol), a status (``STATUS_OK``, or ``STATUS_NOT_A_CONFIG``
   when its caller passed something else) and the length of its config's JSON
   in bytes. Every rank checks its own input before this, and a rank whose
   input is bad still sends its header, so no rank is left waiting.
2. **Payload.** Only when every header is good (known protocol, status OK,
   a length from 1 to ``MAX_CONFIG_BYTES``): every rank sends its config's
   UTF-8 JSON (``KVCacheConfig.to_dict``), zero-padded to the longest length.
   Each payload is parsed with ``json.loads`` and ``KVCacheConfig.from_dict``,
   which refuses anything not of ``to_dict``'s shape.

Every rank sees the same headers and payloads and decides the same way, so on
a bad one every rank raises the same ``ReconcileError`` naming the first rank
at fault, and the group stays usable (all ranks ran the same collectives). A
length is checked before anything is allocated for it: a peer that claims
10 GB makes no rank allocate it. What this cannot defend against: a peer that
leaves the protocol altogether (sends tensors of another size, or never
calls), which stalls the collective until the group's timeout, and a peer
that sends a well-formed config with a small ``num_blocks`` (every rank then
takes it: the smallest wins by design).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
import torch.distributed as dist

from gpukv.errors import InvalidInputError, InvalidTypeError, ReconcileError
from gpukv.sizing.config import unify_kv_cache_configs
from gpukv.sizing.spec import KVCacheConfig

__all__ = ["MAX_CONFIG_BYTES", "PROTOCOL", "STATUS_NOT_A_CONFIG", "STATUS_OK", "reconcile_kv_cache_config"]

logger = logging.getLogger("gpukv")

#: The first word of every header: "gpkv" and version 1 of this protocol.
PROTOCOL = 0x67706B76_0001
STATUS_OK = 0
STATUS_NOT_A_CONFIG = 1
#: The longest config JSON a rank accepts from a peer, in bytes (4 MiB: a
#: model of thousands of layers needs well under a tenth of it); every rank
#: allocates at most ``world_size`` times this for the payloads.
MAX_CONFIG_BYTES = 1 << 22
# How much of a parse error (which may quote a peer's text) goes in a message.
_MAX_REASON_CHARS = 300
_FIX = "run the same gpukv on every rank and pass each one's KVCacheConfig (from get_kv_cache_config)"


def _global_ranks(group: Any, world_size: int) -> list[int]:
    """Global ranks of the members of ``group``, in group-rank order."""
    if group is None:
        return list(range(world_size))
    return [dist.get_global_rank(group, i) for i in range(world_size)]


def _wire_device(group: Any) -> torch.device:
    """Where the tensors of the collectives live: NCCL moves only CUDA
    tensors, on the current device; every other backend takes CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(tensor: torch.Tensor, group: Any, world_size: int) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(out, tensor, group=group)
    return out


def _local_payload(config: Any) -> tuple[int, bytes]:
    """This rank's status and JSON bytes (none when ``config`` is not a config)."""
    if not isinstance(config, KVCacheConfig):
        return STATUS_NOT_A_CONFIG, b""
    return STATUS_OK, json.dumps(config.to_dict(), separators=(",", ":")).encode("utf-8")


def _header_problem(header: list[int]) -> str | None:
    """What is wrong with one rank's header (None: it is good)."""
    protocol, status, length = header
    if protocol != PROTOCOL:
        return f"speaks another reconciliation protocol (header {protocol:#x}, expected {PROTOCOL:#x})"
    if status == STATUS_NOT_A_CONFIG:
        return "did not pass a KVCacheConfig"
    if status != STATUS_OK:
        return f"sent an unknown status {status}"
    if not 1 <= length <= MAX_CONFIG_BYTES:
        return f"announced a config of {length} bytes (the limit is 1 to {MAX_CONFIG_BYTES})"
    return None


def _short(text: str) -> str:
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + "..."


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _parse_config(payload: bytes) -> KVCacheConfig:
    """One peer's payload as a config; ValueError (or a subclass) says why not."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 ({err.reason} at byte {err.start})") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:  # nesting deeper than the parser's stack
        raise ValueError("not JSON of a config (nested too deep)") from None
    except ValueError as err:  # JSONDecodeError, or an int of too many digits
        raise ValueError(f"not JSON ({err})") from None
    try:
        return KVCacheConfig.from_dict(data)
    except (TypeError, ValueError) as err:  # from_dict's typed errors derive from these
        raise ValueError(f"not a KV cache config ({err})") from None


def _exchange(config: Any, group: Any, ranks: list[int]) -> list[KVCacheConfig]:
    """Every rank's config, after both collectives; ReconcileError (the same
    on every rank) at the first bad header or payload."""
    world_size, device = len(ranks), _wire_device(group)
    status, payload = _local_payload(config)
    header = torch.tensor([PROTOCOL, status, len(payload)], dtype=torch.int64, device=device)
    headers = [h.tolist() for h in _all_gather(header, group, world_size)]
    for i, peer_header in enumerate(headers):
        problem = _header_problem(peer_header)
        if problem is not None:
            cause = None
            if i == dist.get_rank(group) and status == STATUS_NOT_A_CONFIG:  # say what this rank passed
                cause = InvalidTypeError(f"must be a KVCacheConfig, got {type(config).__name__}",
                                         argument="config", fix=_FIX)
            raise ReconcileError(f"rank {ranks[i]} {problem}", fix=_FIX, rank=ranks[i]) from cause

    lengths = [h[2] for h in headers]
    mine = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = _all_gather(mine, group, world_size)
    configs = []
    for i, (data, length) in enumerate(zip(gathered, lengths, strict=True)):
        try:
            configs.append(_parse_config(data[:length].cpu().numpy().tobytes()))
        except ValueError as err:
            raise ReconcileError(f"rank {ranks[i]} sent {length} bytes that are {_short(str(err))}",
                                 fix=_FIX, rank=ranks[i]) from None
    return configs


def _unify(configs: list[KVCacheConfig], ranks: list[int]) -> list[KVCacheConfig]:
    """``unify_kv_cache_configs`` with rank names; its refusal as a
    ReconcileError with the same message and the rank that differs."""
    names = [f"rank {r}" for r in ranks]
    try:
        return unify_kv_cache_configs(configs, names=names)
    except ValueError as err:
        # unify compares each config with the first, in order: the first
        # pair it refuses names the rank at fault.
        for i in range(1, len(configs)):
            try:
                unify_kv_cache_configs([configs[0], configs[i]], names=[names[0], names[i]])
            except ValueError:
                raise ReconcileError(str(err), rank=ranks[i]) from err
        raise


def reconcile_kv_cache_config(config: KVCacheConfig, group: Any = None) -> KVCacheConfig:
    """This rank's ``config`` made to agree with every other rank's.

    Single process (torch.distributed not initialized): ``config`` unchanged
    (``InvalidTypeError`` if it is not a ``KVCacheConfig``). Otherwise a
    collective over ``group`` (default: the world), so every rank of the
    group must call it, even one whose ``config`` is wrong. Every rank raises
    the same ``ReconcileError`` (``rank``: the global rank at fault) when a
    rank passed no ``KVCacheConfig`` or sent what is not one (module
    docstring), or has other ``kv_cache_groups`` than the group's first rank
    (the message names the first rank that differs and what differs); none
    is left waiting. The result has the smallest ``num_blocks`` of all
    ranks, each tensor ``page_size * num_blocks`` bytes.

    With NCCL the tensors travel through the current CUDA device: call
    ``torch.cuda.set_device(local_rank)`` first, as any NCCL program does.
    """
    if not dist.is_available() or not dist.is_initialized():
        if not isinstance(config, KVCacheConfig):
            raise InvalidTypeError(f"must be a KVCacheConfig, got {type(config).__name__}",
                                   argument="config", fix=_FIX)
        return config
    if dist.get_rank(group) < 0:  # not a member: it would take no part in the collectives
        raise InvalidInputError("this rank is not a member of the group", argument="group",
                               fix="call reconcile_kv_cache_config on the group's members only")
    ranks = _global_ranks(group, dist.get_world_size(group))
    configs = _exchange(config, group, ranks)
    mine = _unify(configs, ranks)[dist.get_rank(group)]
    if mine.num_blocks != config.num_blocks:
        logger.info(
            "KV cache: %d blocks here, %d on the smallest rank; using %d",
            config.num_blocks,
            mine.num_blocks,
            mine.num_blocks,
        )
    return mine
