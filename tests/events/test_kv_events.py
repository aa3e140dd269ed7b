"""KV events on the wire (``gpukv.events.wire``, the ``events`` extra): a
plain ZMQ client, decoding with vLLM's schema as a router does, rebuilds
each manager's cache index exactly (live messages, and the replay socket for
what it missed); a router keeps ``RouterIndex`` from the wire and ``match``
answers as the managers' lookups do; vLLM's configuration rules.

Everything runs on loopback: ipc:// sockets in a temporary directory (and
one tcp://127.0.0.1 socket on a port the OS picks); every wait is bounded.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import tempfile
import time

import msgspec
import pytest
import zmq

from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.errors import AddressError, AddressInUseError, InvalidInputError, InvalidTypeError, PublisherClosedError
from gpukv.events import schema as gk
from gpukv.events import wire as kv_events
from gpukv.events.router import RouterIndex
from gpukv.events.schema import KVEventBatch, int_block_hash
from gpukv.reference.manager import ReferenceManager
from vllm_event_schema import DECODER, AllBlocksCleared, BlockRemoved, BlockStored

KEY = bytes(range(16))
TOPIC = "kv-events"


# vLLM 0.33.0's KV-event schema, written independently of gpukv.events.wire: tests/helpers/vllm_event_schema.py


@pytest.fixture
def sockdir():
    path = tempfile.mkdtemp(prefix="gpukv-ev-", dir="/tmp")  # short: ipc paths are limited to ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Subscriber:
    """A router's plain ZMQ client: SUB for the stream, DEALER for replays;
    keeps every batch in order, filling gaps from the replay socket."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sub.connect(endpoint)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(replay_endpoint)
        self.payloads: list[bytes] = []  # by sequence number
        self.live = self.replayed = 0

    def _take(self, seq: int, payload: bytes) -> bool:
        if seq != len(self.payloads):
            return False  # a duplicate (replayed, then live), or past a gap
        self.payloads.append(payload)
        return True

    def replay(self) -> None:
        self.dealer.send_multipart([b"", len(self.payloads).to_bytes(8, "big")])
        while True:
            assert self.dealer.poll(5000), "no answer from the replay socket"
            empty, topic, seq, payload = self.dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert (empty, topic, payload) == (b"", b"", b"")
                return
            assert (empty, topic) == (b"", TOPIC.encode())
            self.replayed += self._take(int.from_bytes(seq, "big"), payload)

    def poll(self, timeout_ms: int) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode() and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            if seq > len(self.payloads):
                self.replay()  # missed some: the replay brings them (and this one)
            self.live += self._take(seq, payload)
            timeout_ms = 0

    def wait_for(self, count: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.payloads) < count:
            assert time.monotonic() < deadline, f"{len(self.payloads)} of {count} batches after {timeout_s} s"
            self.poll(100)
            if len(self.payloads) < count:
                self.replay()


def table_of(m) -> dict:
    return {key: len(blocks) for key, blocks in m.pool.table().items()}


def rebuilt_index(payloads: list[bytes]) -> dict:
    """What a router keeps, from the payloads alone, with vLLM's schema."""
    index: dict = {}
    for payload in payloads:
        batch = DECODER.decode(payload)
        assert batch.data_parallel_rank == 0
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                index.clear()
            elif isinstance(e, BlockStored):
                assert e.medium == "GPU" and len(e.token_ids) == e.block_size * len(e.block_hashes)
                assert e.kv_cache_spec_kind == ("full_attention" if e.group_idx == 0 else "sliding_window")
                for d in e.block_hashes:
                    index[(d, e.group_idx)] = index.get((d, e.group_idx), 0) + 1
            else:
                for d in e.block_hashes:
                    index[(d, e.group_idx)] -= 1
                    if not index[(d, e.group_idx)]:
                        del index[(d, e.group_idx)]
    return index


def _step(m, rng: random.Random, step: int) -> None:
    ids = m.request_ids()
    finished = [r for r in ids if rng.random() < 0.3]
    running = [RunningUpdate(r, [rng.randint(0, 2)]) for r in ids if r not in finished and rng.random() < 0.5]
    new = [NewRequest(f"r{step}.{i}", [rng.randint(0, 2) for _ in range(rng.randint(1, 9))],
                      lora_id=rng.choice([None, 3])) for i in range(rng.randint(0, 2))]
    m.step(finished, running, new)
    if step % 17 == 16:
        m.step(finished=m.request_ids())
        assert m.reset_prefix_cache()


@pytest.mark.parametrize("int_block_hashes", [True, False])
def test_a_plain_zmq_client_rebuilds_the_index_exactly(sockdir, int_block_hashes):
    m = ReferenceManager(16, 2, sliding_windows=[None, 4], hash_key=KEY, max_model_len=64,
                         enable_kv_cache_events=True)
    rng = random.Random(3)
    config = kv_events.KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{sockdir}/pub",
                                      replay_endpoint=f"ipc://{sockdir}/replay", topic=TOPIC)
    ctx = zmq.Context()
    publisher = kv_events.make_publisher(config, sliding_windows=m.sliding_windows, int_block_hashes=int_block_hashes)
    try:
        published = 0
        for step in range(10):  # before anyone listens: only the replay has these
            _step(m, rng, step)
            published += publisher.publish_from(m)
        assert publisher.flush()  # sent, to no one
        client = Subscriber(ctx, config.endpoint, config.replay_endpoint)
        step, deadline, last = 10, time.monotonic() + 10, None
        while last is None or step < last:  # 30 steps past the first live batch (within 10 s)
            _step(m, rng, step)
            published += publisher.publish_from(m)
            client.poll(50 if client.live == 0 else 0)  # until the subscription is through, give it time
            if last is None and (client.live or time.monotonic() > deadline):
                last = step + 30
            step += 1
        client.wait_for(published)
        assert client.replayed > 0 and client.live > 0 and len(client.payloads) == published >= 20
        key = int_block_hash if int_block_hashes else (lambda d: d)
        assert rebuilt_index(client.payloads) == {(key(d), g): n for (d, g), n in table_of(m).items()}
        kinds = {type(e) for p in client.payloads for e in DECODER.decode(p).events}
        assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
        stamps = [DECODER.decode(p).ts for p in client.payloads]
        assert stamps == sorted(stamps) and abs(stamps[-1] - time.time()) < 60
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_a_router_keeps_a_router_index_from_the_wire_and_matches(sockdir):
    """Two workers (data-parallel ranks 0 and 1 of one config: the second's
    endpoint gets ``_dp1``); the router applies ``from_wire`` batches to a
    ``RouterIndex`` and ``match`` finds what each manager's lookup hits."""
    workers = [ReferenceManager(12, 2, hash_key=KEY, max_model_len=64, enable_kv_cache_events=True)
               for _ in range(2)]
    config = kv_events.KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{sockdir}/ev",
                                      replay_endpoint=f"ipc://{sockdir}/rp", topic=TOPIC)
    pubs = [kv_events.make_publisher(config, data_parallel_rank=r) for r in range(2)]
    ctx = zmq.Context()
    try:
        assert [p.endpoint for p in pubs] == [f"ipc://{sockdir}/ev", f"ipc://{sockdir}/ev_dp1"]
        clients = [Subscriber(ctx, p.endpoint, p.replay_endpoint) for p in pubs]
        prompts = {0: [[1, 2, 3, 4, 5, 6, 7], [8, 8, 8]], 1: [[1, 2, 3, 9, 9], [8, 8, 8, 8, 8]]}
        counts = [0, 0]
        for r, m in enumerate(workers):
            m.step(new=[NewRequest(f"{r}.{i}", p) for i, p in enumerate(prompts[r])])
            counts[r] += pubs[r].publish_from(m)
        index = RouterIndex.for_manager(workers[0], int_block_hashes=True)
        for r, client in enumerate(clients):
            client.wait_for(counts[r])
            for seq, payload in enumerate(client.payloads):
                index.apply(kv_events.from_wire(kv_events.decode(payload), seq), worker=f"dp{r}")
        assert index.match([1, 2, 3, 4, 5, 6, 0]) == {"dp0": 3, "dp1": 1}
        assert index.match([8, 8, 8, 8, 8, 8]) == {"dp0": 1, "dp1": 2}
        for tokens in ([1, 2, 3, 4, 5, 6, 0], [8, 8, 8, 8, 8, 8], [5, 5]):
            for r, m in enumerate(workers):
                hit = m.get_computed_blocks(NewRequest("probe", tokens)).num_tokens // m.block_size
                assert min(index.match(tokens)[f"dp{r}"], (len(tokens) - 1) // 2) == hit
    finally:
        for p in pubs:
            p.close()
        ctx.destroy(linger=0)


def test_a_connecting_publisher_reaches_a_bound_subscriber():
    """Without a wildcard the PUB socket connects (vLLM's rule): here to a
    subscriber bound on 127.0.0.1, on a port the OS picked."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    publisher = kv_events.ZmqEventPublisher(f"tcp://127.0.0.1:{port}")
    try:
        assert publisher.endpoint == f"tcp://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while not sub.poll(50):  # a connecting PUB joins late: publish until one arrives
            assert time.monotonic() < deadline
            publisher.publish(KVEventBatch(0, [gk.AllBlocksCleared()]))
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"" and DECODER.decode(payload).events == [AllBlocksCleared()]
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_wire_forms(monkeypatch):
    d0, d1 = bytes(range(16)), bytes(range(16, 32))
    batch = KVEventBatch(0, [gk.BlockStored([d0, d1], None, [1, 2, 3, 4], 2, 7, 1), gk.BlockRemoved([d0], 1)],
                         ts=12.5)
    wire = kv_events.to_wire(batch, sliding_windows=[None, 64])
    assert int_block_hash(d0) == int.from_bytes(d0[8:], "big")  # vLLM's int form: the last 8 bytes
    assert msgspec.msgpack.decode(kv_events.encode(wire)) == [12.5, [
        {"type": "BlockStored", "block_hashes": [int_block_hash(d0), int_block_hash(d1)], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": 7, "medium": "GPU", "lora_name": None,
         "group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 64},
        {"type": "BlockRemoved", "block_hashes": [int_block_hash(d0)], "medium": "GPU", "group_idx": 1}], 0]
    monkeypatch.setenv(kv_events.INT_HASHES_ENV, "0")  # vLLM's switch to bytes
    back = kv_events.from_wire(kv_events.decode(kv_events.encode(kv_events.to_wire(batch))), 5)
    assert back == KVEventBatch(5, batch.events, ts=12.5)


def test_config_follows_vllm():
    c = kv_events.KVEventsConfig()
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.max_queue_size, c.topic) == (
        "null", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    c = kv_events.KVEventsConfig.from_json('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert (c.publisher, c.topic) == ("zmq", "kv")
    assert isinstance(kv_events.make_publisher(None), kv_events.NullEventPublisher)
    assert isinstance(kv_events.make_publisher(kv_events.KVEventsConfig(True, "null")), kv_events.NullEventPublisher)
    with pytest.raises(InvalidInputError) as info:
        kv_events.KVEventsConfig.from_json('{"enable_kv_cache_events": true, "port": 1}')
    assert str(info.value) == ("port: unknown KV-events config field; use the fields buffer_steps, "
                               "enable_kv_cache_events, endpoint, hwm, max_queue_size, publisher, replay_endpoint, "
                               "topic")
    with pytest.raises(InvalidInputError) as info:
        kv_events.KVEventsConfig(True, "nats")
    assert str(info.value) == ("publisher: must be 'zmq' or 'null', got 'nats'; gpukv publishes over ZMQ ('zmq') "
                               "or not at all ('null')")
    offset = kv_events._offset_endpoint
    assert offset("tcp://*:5557", 2) == "tcp://*:5559" and offset("tcp://*:0", 2) == "tcp://*:0"
    assert offset("tcp://*:*", 2) == "tcp://*:*" and offset("ipc:///tmp/e", 2) == "ipc:///tmp/e_dp2"
    assert offset("inproc://ev", 1) == "inproc://ev_dp1" and offset("tcp://*:5557", 0) == "tcp://*:5557"
    assert kv_events._binds("tcp://*:5557") and kv_events._binds("ipc:///tmp/x")
    assert not kv_events._binds("tcp://127.0.0.1:5557")


def test_a_batch_after_dropped_events_is_published_with_a_warning(sockdir):
    publisher = kv_events.ZmqEventPublisher(f"ipc://{sockdir}/pub")
    try:
        with pytest.warns(RuntimeWarning, match="3 dropped events"):
            publisher.publish(KVEventBatch(0, [], dropped=3))
    finally:
        publisher.close()
    with pytest.raises(PublisherClosedError) as info:
        publisher.publish([])
    assert str(info.value) == "the publisher is closed; make a new publisher to publish more"
    assert isinstance(info.value, RuntimeError)


def test_without_the_extra_the_error_names_it(monkeypatch):
    import importlib.util
    import sys

    monkeypatch.setitem(sys.modules, "zmq", None)  # imports fail as if not installed
    with pytest.raises(ImportError, match=r"pip install pyzmq msgspec \(or pip install -e '\.\[events\]' in a gpukv"):
        kv_events.ZmqEventPublisher("ipc:///nonexistent/x")
    monkeypatch.setitem(sys.modules, "msgspec", None)
    spec = importlib.util.spec_from_file_location("kv_events_without_msgspec", kv_events.__file__)
    with pytest.raises(ImportError, match=r"needs the 'events' extra: pip install pyzmq msgspec"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


# --------------------------------------------------------------- refusals

def _replayed(ctx: zmq.Context, replay_endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    """Every (seq, payload) the replay socket holds from ``start`` on."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        assert dealer.poll(5000), "no answer from the replay socket"
        _, _, seq, payload = dealer.recv_multipart()
        if seq == kv_events.END_SEQ:
            dealer.close(linger=0)
            return out
        out.append((int.from_bytes(seq, "big"), payload))


def _received(sub: zmq.Socket, publisher, ts: float) -> bool:
    """Publish batches stamped ``ts`` until ``sub`` gets one (a subscription
    takes a moment to reach a PUB socket); False if none comes in 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        publisher.publish(KVEventBatch(0, [], ts=ts))
        if sub.poll(50):
            return DECODER.decode(sub.recv_multipart()[2]).ts == ts
    return False


def test_a_second_publisher_on_a_live_ipc_path_is_refused(sockdir):
    """ZMQ alone would let the second bind take the path over (shown first,
    with raw sockets): a subscriber connecting afterwards reaches only the
    newcomer. gpukv refuses the second publisher, and the first stays
    reachable by subscribers that connect after the refusal."""
    ctx = zmq.Context()
    try:
        raw_first, raw_second = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB)
        raw_first.bind(f"ipc://{sockdir}/raw")
        raw_second.bind(f"ipc://{sockdir}/raw")  # ZMQ says nothing: the path is the second's now
        raw_sub = ctx.socket(zmq.SUB)
        raw_sub.setsockopt(zmq.SUBSCRIBE, b"")
        raw_sub.connect(f"ipc://{sockdir}/raw")
        time.sleep(0.2)
        raw_first.send(b"first")
        assert not raw_sub.poll(300)  # the first one is unreachable: the hazard is real

        first = kv_events.ZmqEventPublisher(f"ipc://{sockdir}/ev")
        try:
            with pytest.raises(AddressInUseError) as info:
                kv_events.ZmqEventPublisher(f"ipc://{sockdir}/ev")
            assert str(info.value) == (f"endpoint: another socket is listening on {sockdir}/ev; use another path, "
                                       "or close the publisher that holds this one")
            assert isinstance(info.value, OSError)
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"ipc://{sockdir}/ev")
            assert _received(sub, first, 7.0)
        finally:
            first.close()
    finally:
        ctx.destroy(linger=0)


def test_a_stale_ipc_socket_file_is_taken_over(sockdir):
    """A socket file nobody listens on (its process died, or a closed
    publisher left it: ZMQ does not remove it) is bound anew."""
    path = f"{sockdir}/stale"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens
    assert os.path.exists(path)
    ctx = zmq.Context()
    publisher = kv_events.ZmqEventPublisher(f"ipc://{path}")
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{path}")
        assert _received(sub, publisher, 3.0)
    finally:
        publisher.close()
        ctx.destroy(linger=0)
    again = kv_events.ZmqEventPublisher(f"ipc://{path}")  # the file a closed publisher left
    again.close()


def test_an_ipc_path_that_is_a_file_is_refused_and_kept(sockdir):
    path = f"{sockdir}/notes.txt"
    with open(path, "w") as f:
        f.write("mine")
    with pytest.raises(AddressError) as info:
        kv_events.ZmqEventPublisher(f"ipc://{path}")
    assert type(info.value) is AddressError
    assert str(info.value) == (f"endpoint: {path} exists and is not a socket; use a path where no file is "
                               "(binding would delete it)")
    with open(path) as f:
        assert f.read() == "mine"


def test_a_publish_is_all_or_nothing(sockdir):
    """``publish([batch, "x"])`` used to queue the first batch and then
    raise; now it queues neither, and the next batch is number 0."""
    ctx = zmq.Context()
    publisher = kv_events.ZmqEventPublisher(f"ipc://{sockdir}/pub", f"ipc://{sockdir}/replay")
    try:
        with pytest.raises(InvalidTypeError) as info:
            publisher.publish([KVEventBatch(0, [gk.AllBlocksCleared()], ts=1.0), "x"])
        assert str(info.value) == ("batches[1]: must be a KVEventBatch, got str; pass a KVEventBatch or a list of "
                                   "them (manager.take_events())")
        with pytest.raises(InvalidInputError) as info:  # a token id msgpack cannot carry: refused, not lost
            publisher.publish([KVEventBatch(0, [], ts=1.5),
                               KVEventBatch(0, [gk.BlockStored([KEY], None, [2**64, 1], 2, None)], ts=1.75)])
        assert str(info.value) == ("batches[1].events[0].token_ids: token id at position 0 is 18446744073709551616, "
                                   "outside [0, 2**32); pass a 1-D sequence of int token ids in [0, 2**32)")
        publisher.publish(KVEventBatch(0, [gk.AllBlocksCleared()], ts=2.0))
        assert publisher.flush()
        assert [(seq, DECODER.decode(p).ts) for seq, p in _replayed(ctx, publisher.replay_endpoint)] == [(0, 2.0)]
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_a_bad_hash_form_variable_is_refused(monkeypatch, sockdir):
    monkeypatch.setenv(kv_events.INT_HASHES_ENV, "yes")
    with pytest.raises(InvalidInputError) as info:
        kv_events.ZmqEventPublisher(f"ipc://{sockdir}/pub")
    assert str(info.value) == ("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: is 'yes', not an int; set it to 1 (int hashes, "
                               "vLLM's default) or 0 (16-byte hashes)")
    kv_events.ZmqEventPublisher(f"ipc://{sockdir}/pub", int_block_hashes=False).close()  # given: the variable unread


def test_the_wording_says_which_release_was_tested():
    assert kv_events.VLLM_VERSION == "0.33.0"
    doc = kv_events.__doc__
    assert "current" not in doc and "tested with 0.33.0 only" in doc


# ------------------------------------------ hand-built events

D0, D1, D2 = bytes(range(16)), bytes(range(16, 32)), bytes(range(32, 48))
RANGE = "pass a whole number from {} to {}"
DIGEST_FIX = "pass a manager's digest (16 bytes) or vLLM's int form (0 to 2**64 - 1)"
TOKEN_FIX = "pass a 1-D sequence of int token ids in [0, 2**32)"
E0 = "batches[0].events[0]"
MALFORMED = [
    # (name, batch, class, message): each was published (as hashes of empty or partial token lists,
    # or with a negative group) or raised an untyped error
    ("block-size-0", KVEventBatch(0, [gk.BlockStored([D1], D0, [], 0, None)]), InvalidInputError,
     f"{E0}.block_size: must be from 1 to 2147483647, got 0; " + RANGE.format(1, 2147483647)),
    ("block-size--2", KVEventBatch(0, [gk.BlockStored([D1], D0, [1, 2], -2, None)]), InvalidInputError,
     f"{E0}.block_size: must be from 1 to 2147483647, got -2; " + RANGE.format(1, 2147483647)),
    ("block-size-bool", KVEventBatch(0, [gk.BlockStored([D1], D0, [1], True, None)]), InvalidTypeError,
     f"{E0}.block_size: must be an int, got bool True; " + RANGE.format(1, 2147483647)),
    ("fewer-tokens", KVEventBatch(0, [gk.BlockStored([D1, D2], D0, [1, 2], 2, None)]), InvalidInputError,
     f"{E0}.token_ids: has 2 tokens for 2 digests of block_size 2 (needs 4); give block_size tokens per digest, "
     "the blocks' tokens one block after another"),
    ("more-tokens", KVEventBatch(0, [gk.BlockStored([D1], D0, [1, 2, 3], 2, None)]), InvalidInputError,
     f"{E0}.token_ids: has 3 tokens for 1 digests of block_size 2 (needs 2); give block_size tokens per digest, "
     "the blocks' tokens one block after another"),
    ("stored-group--1", KVEventBatch(0, [gk.BlockStored([D1], D0, [1, 2], 2, None, -1)]), InvalidInputError,
     f"{E0}.group: must be from 0 to 2147483647, got -1; " + RANGE.format(0, 2147483647)),
    ("removed-group--1", KVEventBatch(0, [gk.BlockRemoved([D0], -1)]), InvalidInputError,
     f"{E0}.group: must be from 0 to 2147483647, got -1; " + RANGE.format(0, 2147483647)),
    ("no-digests", KVEventBatch(0, [gk.BlockRemoved([])]), InvalidInputError,
     f"{E0}.block_hashes: is empty: an event names at least one block; leave out an event that stores or "
     "removes no block"),
    ("short-digest", KVEventBatch(0, [gk.BlockStored([D1[:15]], D0, [1, 2], 2, None)]), InvalidInputError,
     f"{E0}.block_hashes[0]: is 15 bytes, not 16; {DIGEST_FIX}"),
    ("int-digest-2**64", KVEventBatch(0, [gk.BlockRemoved([2**64])]), InvalidInputError,
     f"{E0}.block_hashes[0]: must be from 0 to 2**64 - 1, got 18446744073709551616; {DIGEST_FIX}"),
    ("parent-str", KVEventBatch(0, [gk.BlockStored([D1], "D0", [1, 2], 2, None)]), InvalidTypeError,
     f"{E0}.parent_block_hash: must be bytes or an int, got str 'D0'; {DIGEST_FIX}"),
    ("token-float", KVEventBatch(0, [gk.BlockStored([D1], D0, [1.5, 2], 2, None)]), InvalidTypeError,
     f"{E0}.token_ids: token id at position 0 is 1.5 (float); token ids must be ints; {TOKEN_FIX}"),
    ("token-none", KVEventBatch(0, [gk.BlockStored([D1], D0, [1, None], 2, None)]), InvalidTypeError,
     f"{E0}.token_ids: token id at position 1 is None (NoneType); token ids must be ints; {TOKEN_FIX}"),
    ("token-2**64", KVEventBatch(0, [gk.BlockStored([D1], D0, [1, 2**64], 2, None)]), InvalidInputError,
     f"{E0}.token_ids: token id at position 1 is 18446744073709551616, outside [0, 2**32); {TOKEN_FIX}"),
    ("lora--1", KVEventBatch(0, [gk.BlockStored([D1], D0, [1, 2], 2, -1)]), InvalidInputError,
     f"{E0}.lora_id: must be from 0 to 18446744073709551615, got -1; " + RANGE.format(0, 18446744073709551615)),
    ("seq--1", KVEventBatch(-1, []), InvalidInputError,
     "batches[0].seq: must be an int >= 0, got -1; pass a KVEventBatch or a list of them (manager.take_events())"),
]


def _state(publisher) -> tuple:
    """What a publish may change: batches queued, the chain's map, what it left out."""
    chain = publisher._chain
    maps = None if chain is None else (dict(chain.live), list(chain.retired.items()))
    return publisher._queued, maps, publisher.unpublished_blocks


@pytest.mark.parametrize("published_hash", ["gpukv", "sha256_cbor"])
def test_malformed_events_are_refused_and_change_nothing(sockdir, published_hash):
    """Each case alone in a publish, then after a good batch in the same
    publish: refused with its argument named, nothing queued, the chain as it
    was; a good child of the first batch's block is then published."""
    ctx = zmq.Context()
    publisher = kv_events.ZmqEventPublisher(f"ipc://{sockdir}/pub", f"ipc://{sockdir}/replay",
                                            published_hash=published_hash, int_block_hashes=False)
    null = kv_events.NullEventPublisher()
    try:
        publisher.publish(KVEventBatch(0, [gk.BlockStored([D0], None, [7, 8], 2, None)]))
        for name, bad, cls, message in MALFORMED:
            before = _state(publisher)
            for batches, where in ((bad, "batches[0]"), ([KVEventBatch(0, [gk.BlockRemoved([D0])]), bad],
                                                         "batches[1]")):
                for pub in (publisher, null):
                    with pytest.raises(cls) as info:
                        pub.publish(batches)
                    assert str(info.value) == message.replace("batches[0]", where, 1), name
                assert _state(publisher) == before, name
        publisher.publish(KVEventBatch(1, [gk.BlockStored([D1], D0, [9, 10], 2, None)]))
        assert publisher.flush()
        events = [DECODER.decode(p).events for _, p in _replayed(ctx, publisher.replay_endpoint)]
        chain = [D0, D1] if published_hash == "gpukv" else kv_events.sha256_cbor_block_hashes([7, 8, 9, 10], 2)
        assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for [e] in events] == [
            ([chain[0]], None, [7, 8]), ([chain[1]], chain[0], [9, 10])]
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_a_lora_block_and_its_children_are_left_out_of_sha256_cbor(sockdir):
    """A LoRA block, a child of it without a LoRA id, and their removals are
    left out; the plain block beside them and its removal are published, and
    the count says how many stored blocks were left out."""
    ctx = zmq.Context()
    publisher = kv_events.ZmqEventPublisher(f"ipc://{sockdir}/pub", f"ipc://{sockdir}/replay",
                                            published_hash="sha256_cbor", int_block_hashes=False)
    try:
        batch = KVEventBatch(0, [gk.BlockStored([D0], None, [1, 2], 2, 5), gk.BlockStored([D1], D0, [3, 4], 2, None),
                                 gk.BlockStored([D2], None, [1, 2], 2, None), gk.BlockRemoved([D0, D2, D1])])
        with pytest.warns(kv_events.UnpublishedBlocksWarning) as record:
            publisher.publish(batch)
        assert str(record[0].message) == (
            "published_hash='sha256_cbor' left 2 stored blocks of LoRA requests out of the batches (2 so far): "
            "vLLM's hash of a LoRA block covers the adapter's name and path, which gpukv does not have. Routers "
            "see none of them and predict no hit for them, never a wrong one; publish with published_hash='gpukv' "
            "to route LoRA requests by their cache")
        assert publisher.unpublished_blocks == 2
        # A live digest stored again as another block (here a LoRA one): refused, nothing changed.
        before = _state(publisher)
        with pytest.raises(InvalidInputError) as info:
            publisher.publish(KVEventBatch(1, [gk.BlockStored([D2], None, [1, 2], 2, None),
                                               gk.BlockStored([D2], None, [1, 2], 2, 5)]))
        assert str(info.value) == ("batches[0].events[1].block_hashes[0]: is stored already as another block "
                                   "(other tokens, parent or LoRA id); publish the batches a manager hands out "
                                   "(take_events())")
        assert _state(publisher) == before
        assert publisher.flush()
        [(_, payload)] = _replayed(ctx, publisher.replay_endpoint)
        [h] = kv_events.sha256_cbor_block_hashes([1, 2], 2)
        assert DECODER.decode(payload).events == [
            BlockStored([h], None, [1, 2], 2, None, "GPU", None, group_idx=0),
            BlockRemoved([h], "GPU", group_idx=0)]
    finally:
        publisher.close()
        ctx.destroy(linger=0)
