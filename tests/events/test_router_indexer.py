"""A KV-aware router that is not gpukv rebuilds the cache index from the
events a gpukv publisher sends (vLLM 0.33.0's wire format) and matches new
requests without gpukv's hash key:

* Dynamo-style: it hashes each block's ``token_ids`` itself and links blocks
  by ``parent_block_hash`` (a radix tree keyed by its own token hashes, the
  published hashes naming its nodes), as NVIDIA Dynamo's indexer does.
* With ``published_hash="sha256_cbor"``: it computes vLLM's ``sha256_cbor``
  chain from token ids alone (hashlib and a canonical CBOR encoder written
  here) and finds exactly the published ints.

Its prefix match for a new request equals the blocks the manager hits.
Everything here is independent of gpukv's decoders: plain pyzmq, and
msgspec structs of vLLM's schema (tests/helpers/vllm_event_schema.py). Loopback only: the
subscriber binds tcp://127.0.0.1 on a port the OS picks and the publisher
connects (vLLM's rule for a host address); every wait is bounded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq

from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.errors import InvalidInputError, InvalidTypeError
from gpukv.events import wire as kv_events
from gpukv.reference.manager import ReferenceManager
from vllm_event_schema import DECODER, AllBlocksCleared, BlockStored, VllmKVEventBatch

BS = 4
KEY = bytes(range(16))


# vLLM 0.33.0's schema, what a router decodes with: tests/helpers/vllm_event_schema.py


# ------------------------------------------------------------------ the router

def local_hash(tokens: list[int]) -> bytes:
    """The router's own hash of one block's tokens (no key: Dynamo hashes tokens)."""
    return hashlib.blake2b(b"".join(t.to_bytes(4, "little") for t in tokens), digest_size=8).digest()


@dataclass
class Node:
    parent: Node | None
    local: bytes
    count: int = 0  # blocks stored under this published hash
    children: dict[bytes, Node] = field(default_factory=dict)


class DynamoIndexer:
    """A radix tree of blocks keyed by the router's own token hashes, the
    published hashes only naming nodes (for parents and removals)."""

    def __init__(self) -> None:
        self.root = Node(None, b"")
        self.by_hash: dict[bytes | int, Node] = {}

    def apply(self, batch: VllmKVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                self.root, self.by_hash = Node(None, b""), {}
            elif isinstance(e, BlockStored):
                assert len(e.token_ids) == e.block_size * len(e.block_hashes)
                node = self.root if e.parent_block_hash is None else self.by_hash[e.parent_block_hash]
                for i, h in enumerate(e.block_hashes):
                    lh = local_hash(e.token_ids[i * e.block_size:(i + 1) * e.block_size])
                    child = node.children.setdefault(lh, Node(node, lh))
                    assert self.by_hash.setdefault(h, child) is child, "one published hash, two chains"
                    child.count += 1
                    node = child
            else:
                for h in e.block_hashes:
                    node = self.by_hash[h]
                    node.count -= 1
                    if node.count == 0:
                        del self.by_hash[h]
                        if node.parent is not None and not node.children:
                            del node.parent.children[node.local]

    def match(self, tokens: list[int]) -> int:
        node, n = self.root, 0
        for i in range(len(tokens) // BS):
            child = node.children.get(local_hash(tokens[i * BS:(i + 1) * BS]))
            if child is None or child.count == 0:
                break
            node, n = child, n + 1
        return n


def cbor(value: Any) -> bytes:
    """Canonical CBOR of the shapes vLLM hashes: uints, bytes, str, None, tuples."""
    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major << 5 | n])
        size = next(s for s in (1, 2, 4, 8) if n < 1 << (8 * s))
        return bytes([major << 5 | {1: 24, 2: 25, 4: 26, 8: 27}[size]]) + n.to_bytes(size, "big")
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return head(0, value)
    if isinstance(value, bytes):
        return head(2, len(value)) + value
    if isinstance(value, str):
        return head(3, len(value.encode())) + value.encode()
    return head(4, len(value)) + b"".join(cbor(v) for v in value)


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor(value)).digest()


def none_hash() -> bytes:
    return sha256_cbor(os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))


def as_int(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & (2**64 - 1)


def vllm_chain(tokens: list[int]) -> list[bytes]:
    parent, out = none_hash(), []
    for i in range(len(tokens) // BS):
        parent = sha256_cbor((parent, tuple(tokens[i * BS:(i + 1) * BS]), None))
        out.append(parent)
    return out


class VllmHashIndexer:
    """Keeps the published ints, checking each against the sha256_cbor chain it
    computes itself from the event's tokens and its parent's full digest."""

    def __init__(self) -> None:
        self.digest_of: dict[int, bytes] = {}  # published int -> the 32-byte digest
        self.count: dict[int, int] = {}

    def apply(self, batch: VllmKVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                self.digest_of, self.count = {}, {}
            elif isinstance(e, BlockStored):
                parent = none_hash() if e.parent_block_hash is None else self.digest_of[e.parent_block_hash]
                for i, h in enumerate(e.block_hashes):
                    parent = sha256_cbor((parent, tuple(e.token_ids[i * BS:(i + 1) * BS]), None))
                    assert h == as_int(parent), "a published hash that is not vLLM's sha256_cbor"
                    self.digest_of[h] = parent
                    self.count[h] = self.count.get(h, 0) + 1
            else:
                for h in e.block_hashes:
                    self.count[h] -= 1
                    if not self.count[h]:
                        del self.count[h]

    def match(self, tokens: list[int]) -> int:
        n = 0
        for d in vllm_chain(tokens):
            if as_int(d) not in self.count:
                break
            n += 1
        return n


# ------------------------------------------------------------------ the wire

class Feed:
    """A gpukv manager and publisher, and the router's SUB socket (bound;
    the publisher connects), a DEALER for replays filling any gap."""

    def __init__(self, ctx: zmq.Context, tmp: str, **options: Any) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.manager = ReferenceManager(8, BS, hash_key=KEY, enable_kv_cache_events=True)
        self.publisher = kv_events.ZmqEventPublisher(f"tcp://127.0.0.1:{port}", f"ipc://{tmp}/replay",
                                                     **options)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(self.publisher.replay_endpoint)
        self.payloads: list[bytes] = []

    def _take(self, seq: int, payload: bytes) -> None:
        if seq == len(self.payloads):
            self.payloads.append(payload)

    def sync(self, indexer: Any, timeout_s: float = 5.0) -> None:
        """Publish what the manager has, and apply every new batch in order."""
        self.publisher.publish_from(self.manager)
        assert self.publisher.flush(timeout_s)
        want = self.publisher._next_seq
        done = len(self.payloads)
        deadline = time.monotonic() + timeout_s
        while len(self.payloads) < want:
            assert time.monotonic() < deadline, "batches missing"
            while self.sub.poll(20):
                _, seq, payload = self.sub.recv_multipart()
                self._take(int.from_bytes(seq, "big"), payload)
            if len(self.payloads) < want:  # joined late or missed some: the replay has them
                self.dealer.send_multipart([b"", len(self.payloads).to_bytes(8, "big")])
                while True:
                    assert self.dealer.poll(int(timeout_s * 1000)), "no replay answer"
                    _, _, seq, payload = self.dealer.recv_multipart()
                    if int.from_bytes(seq, "big", signed=True) == -1:
                        break
                    self._take(int.from_bytes(seq, "big"), payload)
        for payload in self.payloads[done:]:
            indexer.apply(DECODER.decode(payload))

    def close(self) -> None:
        self.publisher.close()
        self.sub.close(linger=0)
        self.dealer.close(linger=0)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def tmp():
    path = tempfile.mkdtemp(prefix="gpukv-ri-", dir="/tmp")  # short: ipc paths hold ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


A = list(range(14))                                   # 3 full blocks
B = A[:8] + [100, 101, 102, 103, 104, 105]            # shares A's first 2 blocks
PROBES = {
    "A's 3 blocks": A[:12] + [1, 2, 3],
    "B's 3 blocks": B[:12] + [9],
    "A's 2, then new": A[:8] + [7] * 8,
    "nothing": [50] * 13,
}


def manager_hit(m: ReferenceManager, tokens: list[int]) -> int:
    return m.get_computed_blocks(NewRequest("probe", tokens)).num_tokens // BS


def run_steps(feed: Feed, indexer: Any) -> list[dict[str, int]]:
    """A, then B (a hit of 2 blocks), both freed, then C, which evicts; the
    router's matches and the manager's hits after each step."""
    m, seen = feed.manager, []

    def check() -> None:
        feed.sync(indexer)
        router = {name: indexer.match(t) for name, t in PROBES.items()}
        assert router == {name: manager_hit(m, t) for name, t in PROBES.items()}
        seen.append(router)

    m.step(new=[NewRequest("a", A)])
    check()
    res = m.step(new=[NewRequest("b", B)])
    assert res.num_computed_tokens == [8]
    check()
    m.step(finished=["a", "b"])
    check()
    m.step(new=[NewRequest("c", [200 + i for i in range(24)])])    # 6 of 8 blocks: evicts 2 of the 4 cached
    check()
    m.step(finished=["c"])
    m.reset_prefix_cache()
    check()
    return seen


EXPECTED = [
    {"A's 3 blocks": 3, "B's 3 blocks": 2, "A's 2, then new": 2, "nothing": 0},
    {"A's 3 blocks": 3, "B's 3 blocks": 3, "A's 2, then new": 2, "nothing": 0},
    {"A's 3 blocks": 3, "B's 3 blocks": 3, "A's 2, then new": 2, "nothing": 0},
    {"A's 3 blocks": 1, "B's 3 blocks": 1, "A's 2, then new": 1, "nothing": 0},
    {"A's 3 blocks": 0, "B's 3 blocks": 0, "A's 2, then new": 0, "nothing": 0},
]


def test_a_dynamo_style_indexer_matches_the_managers_hits(ctx, tmp):
    feed = Feed(ctx, tmp)
    try:
        indexer = DynamoIndexer()
        assert run_steps(feed, indexer) == EXPECTED
    finally:
        feed.close()


@pytest.mark.parametrize("int_block_hashes", [True, False])
def test_a_dynamo_style_indexer_works_on_sha256_cbor_hashes_too(ctx, tmp, int_block_hashes):
    feed = Feed(ctx, tmp, published_hash="sha256_cbor", int_block_hashes=int_block_hashes)
    try:
        indexer = DynamoIndexer()
        assert run_steps(feed, indexer) == EXPECTED
        hashes = [h for p in feed.payloads for e in DECODER.decode(p).events if isinstance(e, BlockStored)
                  for h in e.block_hashes]
        assert hashes and all(isinstance(h, int) if int_block_hashes else len(h) == 32 for h in hashes)
    finally:
        feed.close()


def test_published_sha256_cbor_hashes_are_vllms_from_the_tokens(ctx, tmp):
    feed = Feed(ctx, tmp, published_hash="sha256_cbor", int_block_hashes=True)
    try:
        indexer = VllmHashIndexer()
        assert run_steps(feed, indexer) == EXPECTED
        # Every published BlockStored hash was checked against the chain; the
        # first request's come out as vLLM's chain of A, from NONE_HASH.
        first = DECODER.decode(feed.payloads[0]).events[0]
        assert first.parent_block_hash is None
        assert first.block_hashes == [as_int(d) for d in vllm_chain(A)]
    finally:
        feed.close()


def test_the_module_helper_is_the_same_chain():
    tokens = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**31, 7, 8, 9]  # CBOR heads of 0, 1, 2 and 4 bytes
    assert kv_events.sha256_cbor_block_hashes(tokens, BS) == vllm_chain(tokens)
    if "PYTHONHASHSEED" not in os.environ:  # vLLM 0.33.0's own digest of these blocks (checked once against it)
        assert vllm_chain(list(range(8)))[1].hex() == (
            "9d0a7c928c548f9aeea31ae98471cf515045a206851732ac14cb3083c18d40f9")


TOKEN_FIX = "pass a 1-D sequence of int token ids in [0, 2**32)"
PARENT_FIX = ("pass the 32-byte hash sha256_cbor_block_hashes returned for the block before (a published int is "
              "only its last 8 bytes), or None at a request's start")
HELPER_REFUSALS = [
    # (token_ids, block_size, parent, class, message): the managers' token rule, and the parent's form
    ([1.5, 2, 3, 4], BS, None, InvalidTypeError,
     f"token_ids: token id at position 0 is 1.5 (float); token ids must be ints; {TOKEN_FIX}"),
    ("12", 1, None, InvalidTypeError, "token_ids: token ids must be a sequence of ints, got str; pass a list, tuple, "
                                      "1-D array or tensor of int token ids"),
    ([0, 1, 2, 2**64], BS, None, InvalidInputError,
     f"token_ids: token id at position 3 is 18446744073709551616, outside [0, 2**32); {TOKEN_FIX}"),
    ([0, 1, 2, 2**32], BS, None, InvalidInputError,
     f"token_ids: token id at position 3 is 4294967296, outside [0, 2**32); {TOKEN_FIX}"),
    ([0, -1, 2, 3], BS, None, InvalidInputError,
     f"token_ids: token id at position 1 is -1, outside [0, 2**32); {TOKEN_FIX}"),
    ([0, None, 2, 3], BS, None, InvalidTypeError,
     f"token_ids: token id at position 1 is None (NoneType); token ids must be ints; {TOKEN_FIX}"),
    ([0, True, 2, 3], BS, None, InvalidTypeError,
     f"token_ids: token id at position 1 is True (bool); token ids must be ints; {TOKEN_FIX}"),
    (None, BS, None, InvalidTypeError, "token_ids: token ids must be a sequence of ints, got NoneType; pass a list, "
                                       "tuple, 1-D array or tensor of int token ids"),
    ([0, 1, 2, 3], BS, 12345, InvalidTypeError, f"parent: must be bytes, got int 12345; {PARENT_FIX}"),
    ([0, 1, 2, 3], BS, b"\0" * 8, InvalidInputError, f"parent: is 8 bytes, not 32; {PARENT_FIX}"),
]


@pytest.mark.parametrize("tokens, block_size, parent, cls, message", HELPER_REFUSALS)
def test_the_module_helper_refuses_what_is_not_token_ids(tokens, block_size, parent, cls, message):
    """``1.5`` was hashed as 1, ``"12"`` as tokens 1 and 2; ``2**64`` and
    ``None`` raised OverflowError and TypeError."""
    with pytest.raises(cls) as info:
        kv_events.sha256_cbor_block_hashes(tokens, block_size, parent)
    assert str(info.value) == message


def test_vllm_033_hashes_the_same_when_installed():
    from importlib import metadata

    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pytest.skip("vLLM is not installed")
    if not version.startswith("0.33."):
        pytest.skip(f"vLLM {version}, not 0.33")  # before importing it: vLLM takes seconds to import
    from vllm.utils.hashing import sha256_cbor as vllm_sha256_cbor
    from vllm.v1.core import kv_cache_utils as utils
    utils.init_none_hash(vllm_sha256_cbor)
    parent, ints = None, []
    for i in range(len(A) // BS):
        parent = utils.hash_block_tokens(vllm_sha256_cbor, parent, A[i * BS:(i + 1) * BS], None)
        ints.append(utils.maybe_convert_block_hash(parent))
    assert ints == [as_int(d) for d in vllm_chain(A)]


def test_sha256_cbor_refusals_change_nothing(ctx, tmp):
    with pytest.raises(InvalidInputError, match="published_hash"):
        kv_events.make_publisher(None, published_hash="sha256")
    with pytest.raises(InvalidTypeError, match="published_hash"):
        kv_events.ZmqEventPublisher(f"ipc://{tmp}/x", published_hash=None)  # type: ignore[arg-type]
    feed = Feed(ctx, tmp, published_hash="sha256_cbor")
    try:
        m = feed.manager
        # A child whose parent this publisher never saw: refused, and nothing queued.
        m.step(new=[NewRequest("a", A[:8])])
        early = m.take_events()
        m.step(finished=["a"])
        m.step(new=[NewRequest("a2", A)])
        late = m.take_events()
        with pytest.raises(InvalidInputError, match="never published"):
            feed.publisher.publish(late)
        assert feed.publisher._queued == 0 and not feed.publisher._chain.live
        feed.publisher.publish(early + late)
        indexer = VllmHashIndexer()
        feed.sync(indexer)
        assert indexer.match(A) == 3
    finally:
        feed.close()


def test_a_child_whose_parent_was_evicted_first_still_chains(ctx, tmp):
    """A sliding-window request's older blocks may be evicted before its next
    block is stored: the publisher still knows the evicted parent's hash."""
    from gpukv.events import schema as gk

    feed = Feed(ctx, tmp, published_hash="sha256_cbor")
    try:
        p, c = b"p" * 16, b"c" * 16
        feed.publisher.publish([gk.KVEventBatch(0, [gk.BlockStored([p], None, A[:4], BS, None)]),
                                gk.KVEventBatch(1, [gk.BlockRemoved([p])]),
                                gk.KVEventBatch(2, [gk.BlockStored([c], p, A[4:8], BS, None)])])
        indexer = VllmHashIndexer()
        feed.sync(indexer)
        assert list(indexer.count) == [as_int(vllm_chain(A)[1])]
    finally:
        feed.close()


def test_a_lora_request_is_left_out_and_later_batches_index_exactly(ctx, tmp):
    """vLLM's sha256_cbor hash of a LoRA block covers the adapter's name and
    path, which gpukv does not have: its blocks, and the blocks chained to
    them, are left out (a counted warning), their evictions too, and every
    later batch is published, so the router's index stays exact: it never
    predicts a hit for the LoRA blocks (the plain-token hash would match a
    request without the adapter, which the manager does not hit)."""
    feed = Feed(ctx, tmp, published_hash="sha256_cbor", int_block_hashes=True)
    try:
        m, indexer = feed.manager, VllmHashIndexer()
        m.step(new=[NewRequest("lora", A, lora_id=3)])
        with pytest.warns(kv_events.UnpublishedBlocksWarning, match=r"left 3 stored blocks .* \(3 so far\)"):
            feed.sync(indexer)
        m.step(running=[RunningUpdate("lora", [14, 15])])  # a fourth block: a child of a LoRA block
        with pytest.warns(kv_events.UnpublishedBlocksWarning, match=r"left 1 stored blocks .* \(4 so far\)"):
            feed.sync(indexer)
        assert feed.publisher.unpublished_blocks == 4
        assert [DECODER.decode(p).events for p in feed.payloads] == [[], []]  # both batches sent, empty
        assert m.get_computed_blocks(NewRequest("probe", A + [1], lora_id=3)).num_tokens == 12
        assert indexer.match(A) == 0 == manager_hit(m, A)
        m.step(finished=["lora"])
        assert run_steps(feed, indexer) == EXPECTED  # each step: the router's matches are the manager's hits
        assert feed.publisher.unpublished_blocks == 4
        assert list(feed.publisher._chain.retired.values())[:4] == [None] * 4  # LoRA blocks evicted, unpublished
        dynamo = DynamoIndexer()  # the same wire, read by token hashes: parents and removals all resolve
        for payload in feed.payloads:
            dynamo.apply(DECODER.decode(payload))
        assert {name: dynamo.match(t) for name, t in PROBES.items()} == EXPECTED[4]
    finally:
        feed.close()
