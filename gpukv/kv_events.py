"""KV-cache events on the wire, as current vLLM publishes them (the
``events`` extra: ``pip install 'gpukv[events]'``, pyzmq and msgspec).

The format is vLLM 0.33.0's (``vllm/distributed/kv_events.py`` and
``vllm/config/kv_events.py`` of that release), which KV-aware routers (NVIDIA
Dynamo, llm-d) read:

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpukv import events as gk

try:
    import msgspec
except ImportError:
    raise ImportError("gpukv.kv_events needs the 'events' extra: pip install 'gpukv[events]' "
                      "(pyzmq and msgspec)") from None

__all__ = [
    "VLLM_VERSION", "MEDIUM_GPU", "EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared",
    "KVEventBatch", "KVEventsConfig", "EventPublisher", "NullEventPublisher", "ZmqEventPublisher", "make_publisher",
    "to_wire", "from_wire", "encode", "decode", "END_SEQ",
]

logger = logging.getLogger(__name__)

#: The vLLM release whose wire format and configuration this module follows.
VLLM_VERSION = "0.33.0"
MEDIUM_GPU = "GPU"
#: The sequence number of the replay's closing message.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: The environment variable vLLM reads to choose int (default) or bytes hashes.
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


# ---------------------------------------------------------------- the schema
# vLLM 0.33.0's structs, field for field, in its order (an array-like batch;
# events as maps tagged with their class name).

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """An event: its class name is its ``"type"`` tag on the wire."""


class BlockStored(KVCacheEvent):
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


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode(batch: KVEventBatch) -> bytes:
    """A wire batch as its msgpack payload."""
    return _encoder.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """A payload (the third frame of a published message) as a wire batch."""
    return _decoder.decode(payload)


def _int_hashes_default() -> bool:
    return bool(int(os.environ.get(INT_HASHES_ENV, "1")))


def to_wire(batch: gk.KVEventBatch, *, sliding_windows: Iterable[int | None] | None = None,
            int_block_hashes: bool | None = None, data_parallel_rank: int = 0,
            medium: str = MEDIUM_GPU) -> KVEventBatch:
    """A manager's batch in vLLM's schema. ``sliding_windows`` (the manager's,
    one entry per group) adds each stored block's ``kv_cache_spec_kind`` and
    window; ``int_block_hashes`` None follows ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
    (on unless set to 0), as vLLM does."""
    as_int = _int_hashes_default() if int_block_hashes is None else int_block_hashes
    windows = None if sliding_windows is None else list(sliding_windows)

    def h(d: gk.BlockHash) -> bytes | int:
        return gk.int_block_hash(d) if as_int and isinstance(d, bytes) else d

    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for e in batch.events:
        if isinstance(e, gk.BlockStored):
            kind = window = None
            if windows is not None and 0 <= e.group < len(windows):
                window = windows[e.group]
                kind = "full_attention" if window is None else "sliding_window"
            out.append(BlockStored(
                block_hashes=[h(d) for d in e.block_hashes],
                parent_block_hash=None if e.parent_block_hash is None else h(e.parent_block_hash),
                token_ids=list(e.token_ids), block_size=e.block_size, lora_id=e.lora_id, medium=medium,
                lora_name=None, group_idx=e.group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window))
        elif isinstance(e, gk.BlockRemoved):
            out.append(BlockRemoved(block_hashes=[h(d) for d in e.block_hashes], medium=medium, group_idx=e.group))
        else:
            out.append(AllBlocksCleared())
    return KVEventBatch(ts=batch.ts, events=out, data_parallel_rank=data_parallel_rank)


def from_wire(batch: KVEventBatch, seq: int) -> gk.KVEventBatch:
    """A received batch (and the sequence number of its frame) as
    ``gpukv.events``' batch, for ``RouterIndex.apply``; a missing
    ``group_idx`` is group 0. Digests stay in the form they came in."""
    out: list[gk.KVCacheEvent] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            out.append(gk.BlockStored(list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size,
                                      e.lora_id, e.group_idx or 0))
        elif isinstance(e, BlockRemoved):
            out.append(gk.BlockRemoved(list(e.block_hashes), e.group_idx or 0))
        else:
            out.append(gk.AllBlocksCleared())
    return gk.KVEventBatch(seq, out, ts=batch.ts)


# ------------------------------------------------------------ configuration

@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``: its fields, defaults and meaning.

    ``publisher`` None becomes ``"zmq"`` when ``enable_kv_cache_events`` is
    set, ``"null"`` (publish nothing) otherwise. ``buffer_steps``: batches
    kept for replay; ``hwm``: the PUB socket's high-water mark (messages a
    slow subscriber may fall behind before ZMQ drops them); ``max_queue_size``:
    batches waiting to be sent before ``publish`` blocks.
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
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """The config from the JSON ``vllm serve --kv-events-config`` takes."""
        fields = {f.name for f in dataclasses.fields(cls)}
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a KV-events config is a JSON object")
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown KV-events config field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(fields))}")
        return cls(**data)


def _offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """``endpoint`` for data-parallel rank ``rank``: a TCP port plus the rank
    (port 0 stays 0), an ipc or inproc name with ``_dp<rank>`` appended."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port.isdigit() and int(port) != 0:
            return f"{base}:{int(port) + rank}"
        return endpoint
    raise ValueError(f"endpoint {endpoint!r}: expected tcp://, ipc:// or inproc://")


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc endpoint; connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# --------------------------------------------------------------- publishers

class EventPublisher:
    """Publishes a manager's batches (``publish``, or ``publish_from(manager)``
    which takes them); ``close`` (or leaving a ``with`` block) stops it."""

    def publish(self, batches: gk.KVEventBatch | Iterable[gk.KVEventBatch]) -> None:
        raise NotImplementedError

    def publish_from(self, manager: Any) -> int:
        """Publish what ``manager.take_events()`` hands out; how many batches."""
        batches = manager.take_events()
        self.publish(batches)
        return len(batches)

    def close(self, timeout: float = 2.0) -> None:
        pass

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullEventPublisher(EventPublisher):
    """Publishes nothing (``publisher="null"``, or events off)."""

    def publish(self, batches: gk.KVEventBatch | Iterable[gk.KVEventBatch]) -> None:
        pass


class ZmqEventPublisher(EventPublisher):
    """vLLM's ZMQ publisher: a PUB socket and, with ``replay_endpoint``, a
    ROUTER socket that replays the last ``buffer_steps`` batches (module
    docstring). A thread of its own encodes and sends, and answers replay
    requests, so ``publish`` only queues. ``endpoint`` and ``replay_endpoint``
    are the addresses bound (with the port the OS picked for port 0).

    ``sliding_windows``: the manager's (``manager.sliding_windows``), for
    ``kv_cache_spec_kind``; ``int_block_hashes``: see ``to_wire``.
    """

    _POLL_S = 0.02  # how long the thread waits for a batch before it looks at the replay socket again

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000, topic: str = "", *,
                 data_parallel_rank: int = 0, sliding_windows: Iterable[int | None] | None = None,
                 int_block_hashes: bool | None = None, medium: str = MEDIUM_GPU) -> None:
        try:
            import zmq
        except ImportError:
            raise ImportError("ZmqEventPublisher needs the 'events' extra: pip install 'gpukv[events]' "
                              "(pyzmq and msgspec)") from None
        KVEventsConfig(True, "zmq", endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic)  # checks
        self._zmq = zmq
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.sliding_windows = None if sliding_windows is None else list(sliding_windows)
        self.int_block_hashes = _int_hashes_default() if int_block_hashes is None else bool(int_block_hashes)
        self.medium = medium
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[gk.KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0  # of the next batch sent (so: batches sent)
        self._queued = 0
        self._closed = False

        self._ctx = zmq.Context()
        self._replay = None
        try:
            pub_endpoint = _offset_endpoint(endpoint, data_parallel_rank)
            assert pub_endpoint is not None
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 1000)  # let queued batches leave when closed
            if _binds(pub_endpoint):
                self._pub.bind(pub_endpoint)
                pub_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(pub_endpoint)
            self.endpoint = pub_endpoint
            self.replay_endpoint = _offset_endpoint(replay_endpoint, data_parallel_rank)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # Room for a whole replay and its end marker, as vLLM sizes it.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="gpukv-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batches: gk.KVEventBatch | Iterable[gk.KVEventBatch]) -> None:
        """Queue batches to publish, in order (blocks while the queue is full)."""
        if self._closed:
            raise RuntimeError("the publisher is closed")
        for batch in [batches] if isinstance(batches, gk.KVEventBatch) else batches:
            if batch.dropped:
                warnings.warn(f"KV-cache batch {batch.seq} follows {batch.dropped} dropped events, and the wire "
                              "format cannot say so: subscribers' indexes are stale from here", RuntimeWarning,
                              stacklevel=2)
            self._queue.put(batch)
            self._queued += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every batch queued so far is sent (False on timeout)."""
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
                    batch = self._queue.get(timeout=self._POLL_S)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                try:
                    self._send(batch)
                except Exception:
                    logger.exception("publishing KV-cache batch %d failed", batch.seq)
                    self._next_seq += 1  # lost: its number is skipped, so subscribers see the gap
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _send(self, batch: gk.KVEventBatch) -> None:
        wire = to_wire(batch, sliding_windows=self.sliding_windows, int_block_hashes=self.int_block_hashes,
                       data_parallel_rank=self.data_parallel_rank, medium=self.medium)
        payload = encode(wire)
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


def make_publisher(config: KVEventsConfig | None, *, data_parallel_rank: int = 0, **kwargs: Any) -> EventPublisher:
    """The publisher ``config`` asks for (vLLM's ``EventPublisherFactory``):
    a ``ZmqEventPublisher`` when events are on and the publisher is
    ``"zmq"``, else one that publishes nothing. ``kwargs`` go to
    ``ZmqEventPublisher`` (``sliding_windows``, ``int_block_hashes``, ``medium``)."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config.endpoint, config.replay_endpoint, config.buffer_steps, config.hwm,
                             config.max_queue_size, config.topic, data_parallel_rank=data_parallel_rank, **kwargs)
