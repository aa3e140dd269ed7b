"""KV-cache events on the wire, in vLLM's format (the ``events`` extra:
``pip install -e '.[events]'`` in a clone: pyzmq and msgspec).

The format follows vLLM 0.33.0's (``vllm/distributed/kv_events.py`` and
``vllm/config/kv_events.py`` of that release; tested with 0.33.0 only, not
with later releases such as 0.34.0), which KV-aware routers (NVIDIA Dynamo,
llm-d) read:

* **Frames.** Each batch is one ZMQ multipart message on a PUB socket:
  ``(topic, seq, payload)``, ``topic`` the configured topic as UTF-8, ``seq``
  the batch's sequence number (from 0, one per batch) as 8 bytes big-endian,
  ``payload`` the batch in msgpack.
* **Payload.** A ``KVEventBatch`` is an array ``[ts, events,
  data_parallel_rank]`` (wall time in seconds; the rank, 0 without data
  parallelism). Each event is a map tagged with ``"type"``: ``BlockStored``
  (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
  ``lora_id``, ``medium``, ``lora_name``, then ``group_idx``,
  ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window`` and fields gpukv
  leaves out), ``BlockRemoved`` (``block_hashes``, ``medium``,
  ``group_idx``), ``AllBlocksCleared``. Fields equal to their default are
  omitted, as msgspec's ``omit_defaults`` does. The structs below are that
  schema; ``decode`` reads a payload with it.
* **Replay.** With a ``replay_endpoint``, a ROUTER socket answers a
  subscriber that missed batches: it sends ``(b"", start_seq as 8 bytes
  big-endian)`` (a DEALER; a REQ socket adds the empty frame itself) and
  receives ``(b"", topic, seq, payload)`` for every batch still buffered
  (the last ``buffer_steps``) from ``start_seq`` on, then ``(b"", b"",
  -1 as 8 bytes big-endian signed, b"")``.
* **Configuration.** ``KVEventsConfig`` has vLLM's fields and defaults (the
  JSON that ``vllm serve --kv-events-config`` takes): the PUB socket binds
  when the endpoint has ``*`` or ``::`` or is ``ipc://`` or ``inproc://``,
  and connects otherwise; the replay socket always binds; with a data-parallel
  rank, a TCP port is offset by the rank.

What gpukv puts in the fields: ``block_hashes`` and ``parent_block_hash`` are
gpukv's digests in vLLM's default int form (the last 8 bytes of the 16-byte
digest, big-endian, as vLLM turns its hashes into ints while
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on, its default), or the 16 bytes
themselves (``int_block_hashes=False``, or that variable set to 0); the 64-bit
form can collide, with odds of about ``n**2 / 2**65`` for ``n`` blocks.
``medium`` is ``"GPU"``; ``lora_name`` is None (gpukv has LoRA ids only);
``group_idx`` is the KV-cache group, with ``kv_cache_spec_kind``
(``"full_attention"`` or ``"sliding_window"``) and the window when the
publisher is given the manager's ``sliding_windows``. Where gpukv differs
from vLLM: ``extra_keys`` is never sent (gpukv's digests are keyed, so a
consumer cannot recompute them from extra keys anyway; ``RouterIndex`` takes
the key instead); ``tcp://*:0`` binds every interface on a port the OS
picks (vLLM binds the node's address), and ``endpoint`` then says which; an
``ipc://`` endpoint of a data-parallel rank gets ``_dp<rank>`` appended, as
``inproc://`` does (vLLM refuses one). A device batch that lost events to a
full buffer (``KVEventBatch.dropped``) is published with a warning: the wire
format has no field to say so, and a subscriber's index is stale after it.

Routers without gpukv's key. Each ``BlockStored`` carries the blocks' tokens
(``block_size`` per digest) and ``parent_block_hash``, the published digest
of the block before the first (None at a request's start), so a router can
hash ``token_ids`` itself and link blocks by parent, as NVIDIA Dynamo's
indexer does. ``published_hash="sha256_cbor"`` (a publisher option) makes
``block_hashes`` and ``parent_block_hash`` vLLM 0.33.0's own ``sha256_cbor``
hashes, which a router can compute from token ids alone
(``sha256_cbor_block_hashes``): NONE_HASH from ``PYTHONHASHSEED`` if set,
else ``"vllm-none-hash"``, as vLLM seeds it. They are computed without
extra keys: a block whose request had a ``cache_salt`` or multimodal items
gets its plain-text hash (the events do not say which blocks had them). The
publisher maps each gpukv digest to its hash and so must see every batch of
its manager from the first (a parent or removal it never saw is refused).
These hashes are for routers only: the manager's hit stays decided by its
own keyed digests of the request's tokens.

LoRA blocks under ``sha256_cbor``. vLLM's hash of a LoRA block covers the
adapter's name and path, which gpukv does not have, so a ``BlockStored``
with a ``lora_id`` is left out of its batch, and so is every block chained
to one (its children) and every removal of such a block; the rest of the
batch and every later batch are published as usual (a batch left empty is
still sent). Each publish that leaves blocks out warns
(``UnpublishedBlocksWarning``) and adds them to the publisher's
``unpublished_blocks``. Why left out rather than published with gpukv's
digest and a marker: a router that ignores the marker (Dynamo's indexer
keys blocks by their tokens) would then match a request without the
adapter, which the manager does not hit; a block a router never sees only
costs a LoRA request its predicted hit, and never makes a wrong one. A
deployment that routes LoRA requests by cache publishes
``published_hash="gpukv"`` (LoRA blocks carry their ``lora_id`` there).

Every input is checked, and a refusal is a typed error from ``gpukv.errors``
(``argument: problem; fix``) that leaves the publisher as it was: endpoints
(scheme, a port in 0..65535, ``*`` or 0 only where the socket binds, an ipc
path of at most 107 bytes), the sizes (at most ``MAX_BUFFER_STEPS`` and
``MAX_HWM``, what ZMQ's int options hold), the topic (text that is UTF-8),
every ``KVEventsConfig`` field, and every batch of a ``publish``, which is
all or nothing: each event's fields as a manager makes them (digests of 16
bytes, or vLLM's int form below ``2**64``; at least one per event;
``block_size`` >= 1 and ``block_size`` tokens per digest; token ids by the
managers' one rule, ``gpukv.core.checks``'s: ints, not bools, in ``[0, 2**32)``;
a LoRA id in ``[0, 2**64)`` or None; a group >= 0), and, under
``sha256_cbor``, a digest stored again as another block. A refused publish
queues nothing and leaves the chain's map as it was, so it never stands in
the way of the next one. ``sha256_cbor_block_hashes`` checks its token ids
by the same rule. An address another socket holds is refused
(``AddressInUseError``), an ipc path included: ZMQ itself would unlink the
path and bind anew, so subscribers connecting afterwards would reach the new
publisher and never the old one (``ZmqEventPublisher``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import queue
import socket
import stat
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpukv.errors import (
    AddressError,
    AddressInUseError,
    InvalidInputError,
    InvalidTypeError,
    PublisherClosedError,
)
from gpukv.events import schema as gk

if TYPE_CHECKING:
    from gpukv.core.protocol import BlockManager

try:
    import msgspec
except ImportError:
    raise ImportError("gpukv.events.wire needs the 'events' extra: pip install pyzmq msgspec "
                      "(or pip install -e '.[events]' in a gpukv clone)") from None

__all__ = [
    "VLLM_VERSION", "MEDIUM_GPU", "WireEventBatch", "WireKVCacheEvent", "WireBlockStored", "WireBlockRemoved",
    "WireAllBlocksCleared", "WireKVEventBatch", "KVEventsConfig", "EventPublisher", "NullEventPublisher",
    "ZmqEventPublisher", "make_publisher", "to_wire", "from_wire", "encode", "decode", "END_SEQ", "MAX_BUFFER_STEPS",
    "MAX_HWM", "PUBLISHED_HASHES", "VLLM_NONE_HASH_SEED", "sha256_cbor_block_hashes", "UnpublishedBlocksWarning",
]

logger = logging.getLogger(__name__)

#: The vLLM release whose wire format and configuration this module follows,
#: and the one it was tested with.
VLLM_VERSION = "0.33.0"
MEDIUM_GPU = "GPU"
#: The sequence number of the replay's closing message.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: The environment variable vLLM reads to choose int (default) or bytes hashes.
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
#: ZMQ's high-water marks are C ints: the largest ``hwm`` and ``max_queue_size``.
MAX_HWM = 2**31 - 1
#: The largest ``buffer_steps``: the replay socket's high-water mark,
#: ``2 * (buffer_steps + 1)``, must fit a C int too.
MAX_BUFFER_STEPS = (MAX_HWM - 1) // 2 - 1
#: What ``published_hash`` may be: gpukv's own digests (the default), or
#: vLLM's ``sha256_cbor`` block hashes, computed from the tokens alone.
PUBLISHED_HASHES = ("gpukv", "sha256_cbor")
#: The seed of vLLM's NONE_HASH (the parent of a chain's first block) when
#: ``PYTHONHASHSEED`` is not set (vLLM 0.33.0's ``DEFAULT_NONE_HASH_SEED``).
VLLM_NONE_HASH_SEED = "vllm-none-hash"
#: Digests of evicted blocks kept so that a later child (a sliding-window
#: request whose older blocks were freed and evicted) still finds its parent.
_RETIRED_HASHES = 1 << 16
_MAX_PORT = 65535
_MAX_IPC_PATH_BYTES = 107  # a Unix socket's sun_path holds 108 bytes, the last a NUL


# ---------------------------------------------------------------- the schema
# vLLM 0.33.0's structs, field for field, in its order (an array-like batch;
# events as maps tagged with vLLM's class name). Named Wire* so that they do
# not shadow ``gpukv.events.schema``'s events; each event names its tag, since
# msgspec would otherwise send the Python class name.

class WireEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class WireKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """An event: its vLLM class name is its ``"type"`` tag on the wire."""


class WireBlockStored(WireKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class WireBlockRemoved(WireKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireAllBlocksCleared(WireKVCacheEvent, tag="AllBlocksCleared"):
    pass


class WireKVEventBatch(WireEventBatch):
    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]  # type: ignore[assignment]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WireKVEventBatch)


def encode(batch: WireKVEventBatch) -> bytes:
    """A wire batch as its msgpack payload."""
    return _encoder.encode(batch)


def decode(payload: bytes) -> WireKVEventBatch:
    """A payload (the third frame of a published message) as a wire batch."""
    return _decoder.decode(payload)


def _int_hashes_default() -> bool:
    value = os.environ.get(INT_HASHES_ENV, "1")
    try:
        return bool(int(value))
    except ValueError:
        raise InvalidInputError(f"is {value!r}, not an int", argument=INT_HASHES_ENV,
                                fix="set it to 1 (int hashes, vLLM's default) or 0 (16-byte hashes)") from None


def to_wire(batch: gk.KVEventBatch, *, sliding_windows: Iterable[int | None] | None = None,
            int_block_hashes: bool | None = None, data_parallel_rank: int = 0,
            medium: str = MEDIUM_GPU) -> WireKVEventBatch:
    """A manager's batch in vLLM's schema. ``sliding_windows`` (the manager's,
    one entry per group) adds each stored block's ``kv_cache_spec_kind`` and
    window; ``int_block_hashes`` None follows ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
    (on unless set to 0), as vLLM does."""
    as_int = _int_hashes_default() if int_block_hashes is None else int_block_hashes
    windows = None if sliding_windows is None else list(sliding_windows)

    def h(d: gk.BlockHash) -> bytes | int:
        return gk.int_block_hash(d) if as_int and isinstance(d, bytes) else d

    out: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared] = []
    for e in batch.events:
        if isinstance(e, gk.BlockStored):
            kind = window = None
            if windows is not None and 0 <= e.group < len(windows):
                window = windows[e.group]
                kind = "full_attention" if window is None else "sliding_window"
            out.append(WireBlockStored(
                block_hashes=[h(d) for d in e.block_hashes],
                parent_block_hash=None if e.parent_block_hash is None else h(e.parent_block_hash),
                token_ids=list(e.token_ids), block_size=e.block_size, lora_id=e.lora_id, medium=medium,
                lora_name=None, group_idx=e.group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window))
        elif isinstance(e, gk.BlockRemoved):
            out.append(WireBlockRemoved(block_hashes=[h(d) for d in e.block_hashes], medium=medium,
                                        group_idx=e.group))
        else:
            out.append(WireAllBlocksCleared())
    return WireKVEventBatch(ts=batch.ts, events=out, data_parallel_rank=data_parallel_rank)


def from_wire(batch: WireKVEventBatch, seq: int) -> gk.KVEventBatch:
    """A received batch (and the sequence number of its frame) as
    ``gpukv.events.schema``' batch, for ``RouterIndex.apply``; a missing
    ``group_idx`` is group 0. Digests stay in the form they came in."""
    out: list[gk.KVCacheEvent] = []
    for e in batch.events:
        if isinstance(e, WireBlockStored):
            out.append(gk.BlockStored(list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size,
                                      e.lora_id, e.group_idx or 0))
        elif isinstance(e, WireBlockRemoved):
            out.append(gk.BlockRemoved(list(e.block_hashes), e.group_idx or 0))
        else:
            out.append(gk.AllBlocksCleared())
    return gk.KVEventBatch(seq, out, ts=batch.ts)


# --------------------------------------------------------------- validation
# Each check raises a gpukv.errors class naming the argument; nothing is
# changed before every check of a call has passed.

_ENDPOINT_FIX = "write tcp://HOST:PORT (HOST * to bind every interface), ipc://PATH or inproc://NAME"
_SCHEMES = ("tcp", "ipc", "inproc")


def _check_text(argument: str, value: Any, fix: str) -> None:
    """A str that encodes to UTF-8 (ZMQ takes bytes) and has no NUL (C strings end there)."""
    if not isinstance(value, str):
        raise InvalidTypeError(f"must be a str, got {type(value).__name__} {value!r}", argument=argument, fix=fix)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidInputError(f"is not UTF-8 text ({err.reason} at index {err.start})", argument=argument,
                                fix=fix) from None
    if "\0" in value:
        raise InvalidInputError(f"has a NUL character at index {value.index(chr(0))}", argument=argument, fix=fix)


def _check_int(argument: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"must be an int, got {type(value).__name__} {value!r}", argument=argument,
                               fix=f"pass a whole number from {low} to {high}")
    if not low <= value <= high:
        raise InvalidInputError(f"must be from {low} to {high}, got {value}", argument=argument,
                                fix=f"pass a whole number from {low} to {high}")


def _check_tcp(argument: str, endpoint: str, address: str, binds: bool) -> None:
    host, colon, port = address.rpartition(":")
    if not colon or not host or any(c.isspace() for c in host):
        raise InvalidInputError(f"{endpoint!r} has no HOST:PORT", argument=argument, fix=_ENDPOINT_FIX)
    if binds and port == "*":  # ZMQ's "any free port", as port 0
        return
    if not (port.isascii() and port.isdigit()) or int(port) > _MAX_PORT:
        raise InvalidInputError(f"{endpoint!r} has port {port!r}, not a number from 0 to {_MAX_PORT}",
                                argument=argument, fix=f"use a TCP port from 1 to {_MAX_PORT} (0: any free one)")
    if int(port) == 0 and not binds:
        raise InvalidInputError(f"{endpoint!r} connects to port 0", argument=argument,
                                fix="connect to the port the subscriber listens on (port 0 is only for binding)")


def _check_endpoint(argument: str, endpoint: Any, binds: bool | None = None) -> None:
    """A ZMQ endpoint gpukv can bind or connect (``binds`` None: vLLM's rule decides)."""
    _check_text(argument, endpoint, _ENDPOINT_FIX)
    scheme, sep, address = endpoint.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise InvalidInputError(f"{endpoint!r} is not a tcp://, ipc:// or inproc:// endpoint", argument=argument,
                                fix=_ENDPOINT_FIX)
    if not address:
        raise InvalidInputError(f"{endpoint!r} has no address after {scheme}://", argument=argument,
                                fix=_ENDPOINT_FIX)
    if scheme == "tcp":
        _check_tcp(argument, endpoint, address, _binds(endpoint) if binds is None else binds)
    elif scheme == "ipc" and len(address.encode("utf-8")) > _MAX_IPC_PATH_BYTES:
        raise InvalidInputError(f"the ipc path is {len(address.encode('utf-8'))} bytes, over the "
                                f"{_MAX_IPC_PATH_BYTES} a Unix socket path holds", argument=argument,
                                fix="use a shorter path (a directory such as /tmp)")


def _check_bool(argument: str, value: Any, *, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        raise InvalidTypeError(f"must be {'True, False or None' if optional else 'True or False'}, got "
                               f"{type(value).__name__} {value!r}", argument=argument, fix="pass a bool")


def _check_windows(sliding_windows: Any) -> list[int | None] | None:
    """The manager's ``sliding_windows`` as a list: None or a positive int per group."""
    if sliding_windows is None:
        return None
    fix = "pass the manager's sliding_windows (one entry per group: None, or the window in tokens)"
    if isinstance(sliding_windows, (str, bytes)) or not isinstance(sliding_windows, Iterable):
        raise InvalidTypeError(f"must be a list, got {type(sliding_windows).__name__}", argument="sliding_windows",
                               fix=fix)
    windows = list(sliding_windows)
    for i, w in enumerate(windows):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise InvalidInputError(f"must be None or a positive int, got {w!r}", argument=f"sliding_windows[{i}]",
                                    fix=fix)
    return windows


# ------------------------------------------------- vLLM's sha256_cbor hashes
# vLLM 0.33.0 (v1/core/kv_cache_utils.py, utils/hashing.py): block i's hash is
# SHA-256 of the canonical CBOR of (parent hash, tuple of block i's tokens,
# extra keys), the parent of the first block being NONE_HASH = SHA-256 of the
# CBOR of the seed (PYTHONHASHSEED if set, else "vllm-none-hash"). gpukv writes
# that small shape itself (canonical CBOR: shortest heads, definite lengths).

_SHA256_BYTES = 32


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
    raise OverflowError(f"{n} does not fit CBOR's 64-bit head")  # unreachable: lengths and tokens are checked


def _cbor_block(parent: bytes, tokens: list[int]) -> bytes:
    """Canonical CBOR of ``[parent, [tokens...], None]`` (no extra keys);
    ``tokens`` are checked ids (``_checked_tokens``), CBOR unsigned ints."""
    out = [_cbor_head(4, 3), _cbor_head(2, len(parent)), parent, _cbor_head(4, len(tokens))]
    out += [_cbor_head(0, t) for t in tokens]
    out.append(b"\xf6")
    return b"".join(out)


def _none_hash(seed: str) -> bytes:
    text = seed.encode("utf-8")
    return hashlib.sha256(_cbor_head(3, len(text)) + text).digest()


def _none_hash_seed() -> str:
    return os.environ.get("PYTHONHASHSEED", VLLM_NONE_HASH_SEED)


def sha256_cbor_block_hashes(token_ids: Iterable[int], block_size: int, parent: bytes | None = None, *,
                             seed: str | None = None) -> list[bytes]:
    """vLLM 0.33.0's ``sha256_cbor`` hashes (32 bytes each) of the full
    blocks of ``token_ids`` without extra keys, chained from ``parent`` (None:
    the start of a request, NONE_HASH from ``seed``, by default vLLM's:
    ``PYTHONHASHSEED`` if set, else ``"vllm-none-hash"``). What
    ``published_hash="sha256_cbor"`` publishes (as ints: ``int_block_hash``).

    The token ids are checked as the managers check theirs (``gpukv.core.checks``:
    ints, not bools, each in ``[0, 2**32)``; a list, tuple, 1-D integer array
    or tensor); ``parent`` is a 32-byte hash this function returned, not a
    published int; anything else raises ``InvalidTypeError`` or
    ``InvalidInputError`` naming the argument."""
    toks = _checked_tokens(token_ids, "token_ids")
    _check_int("block_size", block_size, 1, MAX_HWM)
    if parent is not None:
        _check_sha256("parent", parent)
    if seed is not None:
        _check_text("seed", seed, "pass the PYTHONHASHSEED the vLLM deployment runs with, or None for its default")
    h = parent if parent is not None else _none_hash(_none_hash_seed() if seed is None else seed)
    out = []
    for i in range(len(toks) // block_size):
        h = hashlib.sha256(_cbor_block(h, toks[i * block_size:(i + 1) * block_size])).digest()
        out.append(h)
    return out


def _check_sha256(argument: str, value: Any) -> None:
    fix = ("pass the 32-byte hash sha256_cbor_block_hashes returned for the block before (a published int "
           "is only its last 8 bytes), or None at a request's start")
    if not isinstance(value, bytes):
        raise InvalidTypeError(f"must be bytes, got {type(value).__name__} {value!r}", argument=argument, fix=fix)
    if len(value) != _SHA256_BYTES:
        raise InvalidInputError(f"is {len(value)} bytes, not {_SHA256_BYTES}", argument=argument, fix=fix)


class UnpublishedBlocksWarning(RuntimeWarning):
    """``published_hash="sha256_cbor"`` left stored blocks out of a publish:
    blocks of LoRA requests, whose vLLM hash covers the adapter's name and
    path (which gpukv does not have), and any block chained to one. The
    publisher counts them (``unpublished_blocks``)."""


class _Sha256CborChain:
    """The publisher's map from gpukv's digests to vLLM's ``sha256_cbor``
    hashes: a stored block's hash chains from its parent's (looked up by the
    parent's gpukv digest), so the publisher must see every batch of its
    manager from the first. A block it cannot hash (LoRA, or a child of one)
    is kept with hash None: left out of what is published, and so are its
    removals and children. ``rehash`` translates batches without changing
    the map; its ``_ChainUpdate.commit`` applies them, so a refused publish
    changes nothing."""

    def __init__(self, seed: str) -> None:
        self.none_hash = _none_hash(seed)
        self.live: dict[bytes, tuple[bytes | None, int]] = {}  # gpukv digest -> (sha or None, stored blocks)
        self.retired: OrderedDict[bytes, bytes | None] = OrderedDict()

    def rehash(self, items: list[gk.KVEventBatch]) -> tuple[list[gk.KVEventBatch], _ChainUpdate]:
        """``items`` with vLLM's hashes in place of gpukv's digests (the
        events it cannot hash left out), and the update that makes the map
        what publishing them leaves."""
        pending = _ChainUpdate(self)
        out = []
        for i, batch in enumerate(items):
            events = [pending.translate(e, f"batches[{i}].events[{j}]") for j, e in enumerate(batch.events)]
            out.append(gk.KVEventBatch(batch.seq, [e for e in events if e is not None], ts=batch.ts,
                                       dropped=batch.dropped))
        return out, pending


class _ChainUpdate:
    """One ``rehash``'s changes to a ``_Sha256CborChain``, kept apart from it
    until ``commit``: digests stored or removed (``over``: the new entry, None
    once removed), digests whose last stored block went (``retire``: their
    hash, still a parent's), whether the batches cleared everything, and the
    stored blocks left out (``unpublished``)."""

    def __init__(self, chain: _Sha256CborChain) -> None:
        self.chain = chain
        self.over: dict[bytes, tuple[bytes | None, int] | None] = {}
        self.retire: dict[bytes, bytes | None] = {}
        self.cleared = False
        self.unpublished = 0

    def translate(self, event: gk.KVCacheEvent, where: str) -> gk.KVCacheEvent | None:
        """``event`` (at ``where`` in the publish) with vLLM's hashes; None
        when none of its blocks is published."""
        if isinstance(event, gk.AllBlocksCleared):
            self.cleared, self.over = True, {}
            return event
        if isinstance(event, gk.BlockStored):
            return self._stored(event, where)
        return self._removed(event, where)

    def _live(self, d: bytes) -> tuple[bytes | None, int] | None:
        """``d``'s entry as this update leaves it so far."""
        if d in self.over:
            return self.over[d]
        return None if self.cleared else self.chain.live.get(d)

    def _stored(self, e: gk.BlockStored, where: str) -> gk.BlockStored | None:
        """Each stored block's hash, chained from its parent's; a LoRA
        block, or one whose parent was left out, is left out too."""
        h = self.chain.none_hash if e.parent_block_hash is None else self._parent_sha(e.parent_block_hash, where)
        parent_sha = None if e.parent_block_hash is None else h
        publish = h is not None and e.lora_id is None
        shas: list[gk.BlockHash] = []
        for k, d in enumerate(e.block_hashes):
            if publish:
                assert h is not None
                h = hashlib.sha256(_cbor_block(h, e.token_ids[k * e.block_size:(k + 1) * e.block_size])).digest()
                shas.append(h)
            self._store(_manager_digest(d, f"{where}.block_hashes[{k}]"), h if publish else None,
                        f"{where}.block_hashes[{k}]")
        if not publish:
            self.unpublished += len(e.block_hashes)
            return None
        return gk.BlockStored(shas, parent_sha, list(e.token_ids), e.block_size, e.lora_id, e.group)

    def _store(self, d: bytes, sha: bytes | None, where: str) -> None:
        """One more stored block of digest ``d``, whose hash is ``sha``."""
        entry = self._live(d)
        if entry is not None and entry[0] != sha:
            raise InvalidInputError("is stored already as another block (other tokens, parent or LoRA id)",
                                    argument=where, fix="publish the batches a manager hands out (take_events())")
        self.over[d] = (sha, 1 if entry is None else entry[1] + 1)

    def _parent_sha(self, parent: Any, where: str) -> bytes | None:
        """The hash of a stored block's parent (None: the parent was left
        out): live, retired in this update, or retired before (a parent
        outlives its blocks in the map)."""
        p = _manager_digest(parent, f"{where}.parent_block_hash")
        entry = self._live(p)
        if entry is not None:
            return entry[0]
        for retired in (self.retire, self.chain.retired):
            if p in retired:
                return retired[p]
        raise InvalidInputError(
            "has a parent this publisher never published", argument=where,
            fix="with published_hash='sha256_cbor' publish every batch of the manager from "
                "its first (make the publisher with the manager)")

    def _removed(self, e: gk.BlockRemoved, where: str) -> gk.BlockRemoved | None:
        """Each removed block's hash (those left out when stored are left
        out again); a digest whose last block goes retires."""
        shas: list[gk.BlockHash] = []
        for k, d in enumerate(e.block_hashes):
            d = _manager_digest(d, f"{where}.block_hashes[{k}]")
            entry = self._live(d)
            if entry is None:
                raise InvalidInputError("removes a block this publisher never published as stored",
                                        argument=f"{where}.block_hashes[{k}]",
                                        fix="with published_hash='sha256_cbor' publish every batch "
                                            "of the manager from its first")
            self.over[d] = (entry[0], entry[1] - 1) if entry[1] > 1 else None
            if entry[1] == 1:
                self.retire[d] = entry[0]
            if entry[0] is not None:
                shas.append(entry[0])
        return gk.BlockRemoved(shas, e.group) if shas else None

    def commit(self) -> None:
        """The chain's map as publishing the translated batches leaves it
        (the oldest retired hashes forgotten past ``_RETIRED_HASHES``)."""
        chain = self.chain
        if self.cleared:
            chain.live.clear()
        for d, v in self.over.items():
            if v is None:
                chain.live.pop(d, None)
            else:
                chain.live[d] = v
        for d, sha in self.retire.items():
            chain.retired[d] = sha
            chain.retired.move_to_end(d)
        while len(chain.retired) > _RETIRED_HASHES:
            chain.retired.popitem(last=False)


def _manager_digest(d: Any, argument: str) -> bytes:
    """``d``, a digest as a manager's batches carry it (bytes), or refused."""
    if not isinstance(d, bytes):
        raise InvalidInputError(f"is a {type(d).__name__}, not a manager's digest", argument=argument,
                                fix="publish the batches a manager hands out (take_events())")
    return d


# ------------------------------------------------------------ configuration

@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``: its fields, defaults and meaning.

    ``publisher`` None becomes ``"zmq"`` when ``enable_kv_cache_events`` is
    set, ``"null"`` (publish nothing) otherwise. ``buffer_steps``: batches
    kept for replay (1 to ``MAX_BUFFER_STEPS``); ``hwm``: the PUB socket's
    high-water mark (messages a slow subscriber may fall behind before ZMQ
    drops them); ``max_queue_size``: batches waiting to be sent before
    ``publish`` blocks (both 1 to ``MAX_HWM``). Every field is checked at
    construction (type and range; the endpoints' syntax; the topic is
    UTF-8 text), so a config that exists can be published with.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        _check_bool("enable_kv_cache_events", self.enable_kv_cache_events)
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        publisher_fix = "gpukv publishes over ZMQ ('zmq') or not at all ('null')"
        if not isinstance(self.publisher, str):
            raise InvalidTypeError(f"must be a str, got {type(self.publisher).__name__} {self.publisher!r}",
                                   argument="publisher", fix=publisher_fix)
        if self.publisher not in ("null", "zmq"):
            raise InvalidInputError(f"must be 'zmq' or 'null', got {self.publisher!r}", argument="publisher",
                                    fix=publisher_fix)
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint, binds=True)
        _check_int("buffer_steps", self.buffer_steps, 1, MAX_BUFFER_STEPS)
        _check_int("hwm", self.hwm, 1, MAX_HWM)
        _check_int("max_queue_size", self.max_queue_size, 1, MAX_HWM)
        _check_text("topic", self.topic, "pass the topic as text ('' for every subscriber)")

    @classmethod
    def from_json(cls, text: str | bytes) -> KVEventsConfig:
        """The config from the JSON ``vllm serve --kv-events-config`` takes
        (a JSON object of these fields); anything else raises a typed error."""
        fix = 'pass a JSON object such as {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
        if not isinstance(text, (str, bytes, bytearray)):
            raise InvalidTypeError(f"must be a str of JSON, got {type(text).__name__}", argument="text", fix=fix)
        try:
            data = json.loads(text)
        except RecursionError:
            raise InvalidInputError("is not JSON of a config (nested too deep)", argument="text", fix=fix) from None
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError of bytes
            raise InvalidInputError(f"is not JSON ({err})", argument="text", fix=fix) from None
        if not isinstance(data, dict):
            raise InvalidTypeError(f"must be a JSON object, got a JSON {type(data).__name__}", argument="text",
                                   fix=fix)
        fields = sorted(f.name for f in dataclasses.fields(cls))
        for name in data:
            if name not in fields:
                raise InvalidInputError("unknown KV-events config field", argument=name,
                                        fix=f"use the fields {', '.join(fields)}")
        return cls(**data)


def _offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """``endpoint`` for data-parallel rank ``rank``: a TCP port plus the rank
    (port 0 and ``*`` stay), an ipc or inproc name with ``_dp<rank>`` appended.
    ``endpoint`` has passed ``_check_endpoint``; a port pushed past 65535
    refuses ``data_parallel_rank``."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return endpoint
    if int(port) + rank > _MAX_PORT:
        raise InvalidInputError(f"{rank} puts the port of {endpoint!r} past {_MAX_PORT}",
                                argument="data_parallel_rank", fix="give the ranks a lower base port")
    return f"{base}:{int(port) + rank}"


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc endpoint; connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _check_ipc_free(argument: str, endpoint: str) -> None:
    """Refuse an ipc path a socket is listening on. ZMQ's bind unlinks the
    path first and binds anew, silently: subscribers connecting afterwards
    would reach the new socket and never the old one. A socket file nobody
    listens on (left by a process that died) is taken over, as ZMQ would;
    a path that is not a socket is refused (ZMQ would delete the file). The
    check and the bind are two steps: a socket bound between them is missed."""
    path = endpoint.removeprefix("ipc://")
    if path.startswith("@"):  # Linux's abstract namespace: the kernel refuses a second bind itself
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as err:
        raise AddressError(f"cannot look at {path} ({err.strerror})", argument=argument,
                           fix="use a path in a directory this process can read") from None
    if not stat.S_ISSOCK(mode):
        raise AddressError(f"{path} exists and is not a socket", argument=argument,
                           fix="use a path where no file is (binding would delete it)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return  # a stale file: nobody listens
    except OSError as err:  # a full backlog (timeout), or a socket we may not reach: someone holds it
        raise AddressInUseError(f"{path} is a socket this process cannot reach ({err.strerror or err})",
                                argument=argument, fix="use another path") from None
    finally:
        probe.close()
    raise AddressInUseError(f"another socket is listening on {path}", argument=argument,
                            fix="use another path, or close the publisher that holds this one")


def _socket_error(argument: str, endpoint: str, code: int, reason: str) -> AddressError:
    """A ZMQError (its errno and text) from bind or connect as gpukv's error
    (both are OSErrors)."""
    if code == errno.EADDRINUSE:
        return AddressInUseError(f"{endpoint!r} is in use ({reason})", argument=argument,
                                 fix="use another port or path (port 0: any free one)")
    return AddressError(f"cannot use {endpoint!r} ({reason})", argument=argument,
                        fix="use an address of this machine (tcp://*:PORT binds every interface)")


def _check_timeout(timeout: Any) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidTypeError(f"must be a number of seconds, got {type(timeout).__name__} {timeout!r}",
                               argument="timeout", fix="pass seconds as an int or float")
    if not (math.isfinite(timeout) and timeout >= 0):
        raise InvalidInputError(f"must be finite and >= 0, got {timeout}", argument="timeout",
                                fix="pass seconds as a finite number >= 0")


_BATCH_FIX = "pass a KVEventBatch or a list of them (manager.take_events())"
_EVENT_FIX = "publish the batches a manager hands out (take_events()), or build events as a manager does"
#: The largest int digest: vLLM's int form is 64 bits.
_MAX_INT_DIGEST = 2**64 - 1
_DIGEST_BYTES = 16  # a manager's digest
_MAX_GROUP = 2**31 - 1  # a KV-cache group index is an int32 on the device


def _batch_list(batches: Any) -> list[gk.KVEventBatch]:
    """``publish``'s argument as a list of checked batches: fresh copies
    whose events hold lists of plain ints and digests (``_checked_event``),
    so what is published is what was checked."""
    if isinstance(batches, gk.KVEventBatch):
        items = [batches]
    elif isinstance(batches, (str, bytes, dict)) or not isinstance(batches, Iterable):
        raise InvalidTypeError(f"must be a KVEventBatch or a list of them, got {type(batches).__name__}",
                               argument="batches", fix=_BATCH_FIX)
    else:
        try:
            items = list(batches)
        except Exception as err:  # a caller's iterator that failed
            raise InvalidInputError(f"raised while read ({type(err).__name__}: {err})", argument="batches",
                                    fix=_BATCH_FIX) from err
    return [_checked_batch(batch, f"batches[{i}]") for i, batch in enumerate(items)]


def _checked_batch(batch: Any, where: str) -> gk.KVEventBatch:
    if not isinstance(batch, gk.KVEventBatch):
        raise InvalidTypeError(f"must be a KVEventBatch, got {type(batch).__name__}", argument=where, fix=_BATCH_FIX)
    if not isinstance(batch.events, list):
        raise InvalidTypeError(f"must be a list, got {type(batch.events).__name__}", argument=f"{where}.events",
                               fix=_BATCH_FIX)
    events = [_checked_event(e, f"{where}.events[{j}]") for j, e in enumerate(batch.events)]
    if isinstance(batch.ts, bool) or not isinstance(batch.ts, (int, float)) or not math.isfinite(batch.ts):
        raise InvalidInputError(f"must be a finite number of seconds, got {batch.ts!r}", argument=f"{where}.ts",
                                fix=_BATCH_FIX)
    if isinstance(batch.dropped, bool) or not isinstance(batch.dropped, int) or batch.dropped < 0:
        raise InvalidInputError(f"must be an int >= 0, got {batch.dropped!r}", argument=f"{where}.dropped",
                                fix=_BATCH_FIX)
    if isinstance(batch.seq, bool) or not isinstance(batch.seq, int) or batch.seq < 0:
        raise InvalidInputError(f"must be an int >= 0, got {batch.seq!r}", argument=f"{where}.seq", fix=_BATCH_FIX)
    return gk.KVEventBatch(batch.seq, events, ts=batch.ts, dropped=batch.dropped)


def _checked_event(event: Any, where: str) -> gk.KVCacheEvent:
    """A copy of ``event`` with every field checked as a manager makes it:
    digests 16 bytes (or an int of vLLM's 64-bit form), ``block_size`` >= 1,
    ``block_size`` tokens per digest, each in the managers' token range,
    a LoRA id in ``[0, 2**64)`` or None, a group >= 0."""
    if isinstance(event, gk.AllBlocksCleared):
        return event
    if not isinstance(event, (gk.BlockStored, gk.BlockRemoved)):
        raise InvalidTypeError(f"must be a gpukv.events.schema event, got {type(event).__name__}", argument=where,
                               fix=_EVENT_FIX)
    digests = _checked_digests(event.block_hashes, f"{where}.block_hashes")
    _check_int(f"{where}.group", event.group, 0, _MAX_GROUP)
    if isinstance(event, gk.BlockRemoved):
        return gk.BlockRemoved(digests, event.group)
    parent = event.parent_block_hash
    if parent is not None:
        parent = _checked_digest(parent, f"{where}.parent_block_hash")
    _check_int(f"{where}.block_size", event.block_size, 1, MAX_HWM)
    tokens = _checked_tokens(event.token_ids, f"{where}.token_ids")
    if len(tokens) != len(digests) * event.block_size:
        raise InvalidInputError(
            f"has {len(tokens)} tokens for {len(digests)} digests of block_size {event.block_size} "
            f"(needs {len(digests) * event.block_size})", argument=f"{where}.token_ids",
            fix="give block_size tokens per digest, the blocks' tokens one block after another")
    if event.lora_id is not None:
        _check_int(f"{where}.lora_id", event.lora_id, 0, _MAX_INT_DIGEST)
    return gk.BlockStored(digests, parent, tokens, event.block_size, event.lora_id, event.group)


def _checked_digests(value: Any, argument: str) -> list[gk.BlockHash]:
    if not isinstance(value, (list, tuple)):
        raise InvalidTypeError(f"must be a list of digests, got {type(value).__name__}", argument=argument,
                               fix=_EVENT_FIX)
    if not value:
        raise InvalidInputError("is empty: an event names at least one block", argument=argument,
                                fix="leave out an event that stores or removes no block")
    return [_checked_digest(d, f"{argument}[{k}]") for k, d in enumerate(value)]


def _checked_digest(d: Any, argument: str) -> gk.BlockHash:
    """A manager's 16-byte digest, or an int of vLLM's 64-bit form (what ``from_wire`` gives)."""
    fix = f"pass a manager's digest ({_DIGEST_BYTES} bytes) or vLLM's int form (0 to 2**64 - 1)"
    if isinstance(d, bytes):
        if len(d) != _DIGEST_BYTES:
            raise InvalidInputError(f"is {len(d)} bytes, not {_DIGEST_BYTES}", argument=argument, fix=fix)
        return bytes(d)
    if isinstance(d, bool) or not isinstance(d, int):
        raise InvalidTypeError(f"must be bytes or an int, got {type(d).__name__} {d!r}", argument=argument, fix=fix)
    if not 0 <= d <= _MAX_INT_DIGEST:
        raise InvalidInputError(f"must be from 0 to 2**64 - 1, got {d}", argument=argument, fix=fix)
    return int(d)


def _checked_tokens(value: Any, argument: str) -> list[int]:
    """Token ids checked by the managers' one rule (``gpukv.core.checks``: ints,
    not bools, each in ``[0, 2**32)``), as a list of plain ints."""
    from gpukv.core.checks import normalize_token_ids  # torch: imported when first needed, so importing this is cheap

    return normalize_token_ids(value, argument, keep_device=False).tolist()


# --------------------------------------------------------------- publishers

class EventPublisher:
    """Publishes a manager's batches (``publish``, or ``publish_from(manager)``
    which takes them); ``close`` (or leaving a ``with`` block) stops it."""

    def publish(self, batches: gk.KVEventBatch | Iterable[gk.KVEventBatch]) -> None:
        raise NotImplementedError

    def publish_from(self, manager: BlockManager) -> int:
        """Publish what ``manager.take_events()`` hands out; how many batches."""
        if not callable(getattr(manager, "take_events", None)):
            raise InvalidTypeError(f"has no take_events(), got {type(manager).__name__}", argument="manager",
                                   fix="pass a manager built with enable_kv_cache_events=True")
        batches = manager.take_events()
        self.publish(batches)
        return len(batches)

    def close(self, timeout: float = 2.0) -> None:
        _check_timeout(timeout)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullEventPublisher(EventPublisher):
    """Publishes nothing (``publisher="null"``, or events off); it checks
    what it is given as the ZMQ publisher does, so switching events on
    brings no new refusals."""

    def publish(self, batches: gk.KVEventBatch | Iterable[gk.KVEventBatch]) -> None:
        _batch_list(batches)


class ZmqEventPublisher(EventPublisher):
    """vLLM's ZMQ publisher: a PUB socket and, with ``replay_endpoint``, a
    ROUTER socket that replays the last ``buffer_steps`` batches (module
    docstring). ``publish`` checks and encodes the batches and queues them;
    a thread of its own sends them and answers replay requests.
    ``endpoint`` and ``replay_endpoint`` are the addresses bound (with the
    port the OS picked for port 0).

    Every argument is checked before any socket exists (as ``KVEventsConfig``
    checks its fields); an address another socket is listening on, an ipc
    path included, raises ``AddressInUseError`` (a socket file nobody
    listens on, left by a dead process, is taken over), one that cannot be
    used here ``AddressError``. A refused constructor leaves no socket open.

    ``sliding_windows``: the manager's (``manager.sliding_windows``), for
    ``kv_cache_spec_kind``; ``int_block_hashes``: see ``to_wire``;
    ``published_hash``: ``"gpukv"`` (gpukv's digests) or ``"sha256_cbor"``
    (vLLM's, from the tokens alone; module docstring).
    """

    _POLL_S = 0.02  # how long the thread waits for a batch before it looks at the replay socket again

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000, topic: str = "", *,
                 data_parallel_rank: int = 0, sliding_windows: Iterable[int | None] | None = None,
                 int_block_hashes: bool | None = None, medium: str = MEDIUM_GPU,
                 published_hash: str = "gpukv") -> None:
        try:
            import zmq
        except ImportError:
            raise ImportError("ZmqEventPublisher needs the 'events' extra: pip install pyzmq msgspec "
                              "(or pip install -e '.[events]' in a gpukv clone)") from None
        KVEventsConfig(True, "zmq", endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic)  # checks
        _check_int("data_parallel_rank", data_parallel_rank, 0, _MAX_PORT)
        _check_bool("int_block_hashes", int_block_hashes, optional=True)
        _check_text("medium", medium, f"pass the medium's name ({MEDIUM_GPU!r})")
        _check_published_hash(published_hash)
        self.sliding_windows = _check_windows(sliding_windows)
        pub_endpoint = _offset_endpoint(endpoint, data_parallel_rank)
        replay = _offset_endpoint(replay_endpoint, data_parallel_rank)
        assert pub_endpoint is not None
        self._zmq = zmq
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.int_block_hashes = _int_hashes_default() if int_block_hashes is None else int_block_hashes
        self.medium = medium
        self.published_hash = published_hash
        self._chain = _Sha256CborChain(_none_hash_seed()) if published_hash == "sha256_cbor" else None
        self.unpublished_blocks = 0  # stored blocks left out by sha256_cbor (LoRA blocks and their children)
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0  # of the next batch sent (so: batches sent)
        self._queued = 0
        self._closed = False
        self._open_sockets(pub_endpoint, replay, hwm, buffer_steps)
        self._thread = threading.Thread(target=self._run, name="gpukv-kv-events", daemon=True)
        self._thread.start()

    def _open_sockets(self, endpoint: str, replay_endpoint: str | None, hwm: int, buffer_steps: int) -> None:
        """Bind (or connect) the PUB socket and bind the replay socket; on
        any failure close both and raise gpukv's error."""
        zmq = self._zmq
        self._ctx = zmq.Context()
        self._replay = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 1000)  # let queued batches leave when closed
            self.endpoint = self._attach(self._pub, "endpoint", endpoint, _binds(endpoint))
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # Room for a whole replay and its end marker, as vLLM sizes it.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._attach(self._replay, "replay_endpoint", replay_endpoint, True)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise

    def _attach(self, sock: Any, argument: str, endpoint: str, binds: bool) -> str:
        """Bind or connect ``sock``; the address bound (its port for port 0)."""
        if binds and endpoint.startswith("ipc://"):
            _check_ipc_free(argument, endpoint)
        try:
            if not binds:
                sock.connect(endpoint)
                return endpoint
            sock.bind(endpoint)
        except self._zmq.ZMQError as err:
            code = err.errno or 0
            raise _socket_error(argument, endpoint, code, self._zmq.strerror(code)) from None
        return sock.getsockopt_string(self._zmq.LAST_ENDPOINT)

    def _encode(self, batch: gk.KVEventBatch, argument: str) -> bytes:
        """A batch's payload, decoded again with the schema as a subscriber
        would: what cannot be sent or read is refused here, not in the thread."""
        try:
            payload = encode(to_wire(batch, sliding_windows=self.sliding_windows,
                                     int_block_hashes=self.int_block_hashes,
                                     data_parallel_rank=self.data_parallel_rank, medium=self.medium))
            decode(payload)
        except (TypeError, ValueError, OverflowError, msgspec.MsgspecError) as err:
            raise InvalidInputError(f"cannot be sent in vLLM's schema ({err})", argument=argument,
                                    fix="publish the batches a manager hands out (take_events())") from None
        return payload

    def publish(self, batches: gk.KVEventBatch | Iterable[gk.KVEventBatch]) -> None:
        """Queue batches to publish, in order (blocks while the queue is
        full). All or nothing: every batch is checked and encoded before any
        is queued, so a refused call queues none and changes nothing."""
        if self._closed:
            raise PublisherClosedError("the publisher is closed", fix="make a new publisher to publish more")
        items = _batch_list(batches)
        update = None
        if self._chain is not None:
            items, update = self._chain.rehash(items)
        payloads = [self._encode(batch, f"batches[{i}]") for i, batch in enumerate(items)]
        if update is not None:
            update.commit()
            self._count_unpublished(update.unpublished)
        for batch in items:
            if batch.dropped:
                warnings.warn(f"KV-cache batch {batch.seq} follows {batch.dropped} dropped events, and the wire "
                              "format cannot say so: subscribers' indexes are stale from here", RuntimeWarning,
                              stacklevel=2)
        for payload in payloads:
            self._queue.put(payload)
            self._queued += 1

    def _count_unpublished(self, blocks: int) -> None:
        """Count and announce stored blocks ``sha256_cbor`` left out."""
        if not blocks:
            return
        self.unpublished_blocks += blocks
        warnings.warn(f"published_hash='sha256_cbor' left {blocks} stored blocks of LoRA requests out of the "
                      f"batches ({self.unpublished_blocks} so far): vLLM's hash of a LoRA block covers the "
                      "adapter's name and path, which gpukv does not have. Routers see none of them and predict "
                      "no hit for them, never a wrong one; publish with published_hash='gpukv' to route LoRA "
                      "requests by their cache", UnpublishedBlocksWarning, stacklevel=3)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every batch queued so far is sent (False on timeout)."""
        _check_timeout(timeout)
        target = self._queued
        deadline = time.monotonic() + timeout
        while self._next_seq < target:
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(0.001)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets (waiting at most
        ``timeout`` seconds for the thread, and one more for ZMQ to send)."""
        _check_timeout(timeout)
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():
            warnings.warn("the KV-events publisher thread did not stop in time; batches may be lost",
                          RuntimeWarning, stacklevel=2)
            return
        self._ctx.term()

    # ------------------------------------------------------ the thread
    def _run(self) -> None:
        zmq = self._zmq
        try:
            while True:
                if self._replay is not None and self._replay.poll(0, zmq.POLLIN):
                    try:
                        self._serve_replay()
                    except Exception:
                        logger.exception("KV-events replay failed")
                try:
                    payload = self._queue.get(timeout=self._POLL_S)
                except queue.Empty:
                    continue
                if payload is None:
                    break
                try:
                    self._send(payload)
                except Exception:
                    logger.exception("publishing KV-cache batch %d failed", self._next_seq)
                    self._next_seq += 1  # lost: its number is skipped, so subscribers see the gap
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _send(self, payload: bytes) -> None:
        seq = self._next_seq
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        self._buffer.append((seq, payload))
        self._next_seq = seq + 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("ignoring a KV-events replay request of %d frames (expected 3)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", b"", END_SEQ, b""])


_PUBLISHER_OPTIONS = ("sliding_windows", "int_block_hashes", "medium", "published_hash")


def _check_published_hash(value: Any) -> None:
    fix = "pass 'gpukv' (gpukv's digests, the default) or 'sha256_cbor' (vLLM's, from the tokens)"
    if not isinstance(value, str):
        raise InvalidTypeError(f"must be a str, got {type(value).__name__} {value!r}", argument="published_hash",
                               fix=fix)
    if value not in PUBLISHED_HASHES:
        raise InvalidInputError(f"must be one of {PUBLISHED_HASHES}, got {value!r}", argument="published_hash",
                                fix=fix)


def make_publisher(config: KVEventsConfig | None, *, data_parallel_rank: int = 0, **kwargs: Any) -> EventPublisher:
    """The publisher ``config`` asks for (vLLM's ``EventPublisherFactory``):
    a ``ZmqEventPublisher`` when events are on and the publisher is
    ``"zmq"``, else one that publishes nothing. ``kwargs`` go to
    ``ZmqEventPublisher`` (``sliding_windows``, ``int_block_hashes``, ``medium``,
    ``published_hash``)."""
    if config is not None and not isinstance(config, KVEventsConfig):
        raise InvalidTypeError(f"must be a KVEventsConfig or None, got {type(config).__name__}", argument="config",
                               fix="build one with KVEventsConfig(...) or KVEventsConfig.from_json(text)")
    _check_int("data_parallel_rank", data_parallel_rank, 0, _MAX_PORT)
    for name in kwargs:
        if name not in _PUBLISHER_OPTIONS:
            raise InvalidTypeError("is not an option of the publisher", argument=name,
                                   fix=f"pass only {', '.join(_PUBLISHER_OPTIONS)}")
    if "published_hash" in kwargs:
        _check_published_hash(kwargs["published_hash"])
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config.endpoint, config.replay_endpoint, config.buffer_steps, config.hwm,
                             config.max_queue_size, config.topic, data_parallel_rank=data_parallel_rank, **kwargs)
