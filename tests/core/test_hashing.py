"""Tests of gpukv.core.hashing (block-hash scheme v2, keyed BLAKE3): the BLAKE3
team's published test vectors, the message layouts, segment folding of long
blocks, chains, extra keys, key resolution, token validation, and the batch
paths equal to the one-request ones."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpukv.core import hashing
from gpukv.core.hashing import (
    NO_EXTRA,
    MMItem,
    blake3_key,
    block_digest,
    block_digests_lanes,
    digests_to_lanes,
    encode_extra_keys,
    extra_key_digests,
    hash_block_chain,
    hash_requests,
    keyed_digest,
    lanes_to_digests,
    resolve_hash_key,
    root_digest,
)
from gpukv.errors import InvalidInputError, InvalidTypeError

REPO = Path(__file__).resolve().parents[2]
# The BLAKE3 team's test vectors (lengths 0, 1, 1023, 1024, 1025), with attribution.
VECTORS_FILE = Path(__file__).resolve().parents[1] / "data" / "blake3_test_vectors.json"

KEY = bytes.fromhex("0f1e2d3c4b5a69788796a5b4c3d2e1f0")
OTHER_KEY = bytes(16)
CONTEXT = "gpukv 2026-12-01 block hash key v2"


@contextlib.contextmanager
def refused(cls, argument: str, match: str | None = None):
    """Expect exactly a ``cls`` naming ``argument`` (and a message matching ``match``)."""
    with pytest.raises(cls, match=match) as info:
        yield info
    assert type(info.value) is cls
    assert info.value.argument == argument
    assert info.value.fix


def _vectors() -> dict:
    return json.loads(VECTORS_FILE.read_text())


def _vector_input(n: int) -> bytes:
    return bytes(i % 251 for i in range(n))


def H(key: bytes, message: bytes) -> bytes:
    """The scheme's H, written out with the blake3 package alone."""
    key32 = blake3.blake3(key, derive_key_context=CONTEXT).digest()
    return blake3.blake3(message, key=key32).digest(16)


def _le32(tokens) -> bytes:
    return b"".join(struct.pack("<I", t) for t in tokens)


# ---------------------------------------------------------------- BLAKE3 vectors


@pytest.mark.parametrize("case", _vectors()["cases"], ids=lambda c: f"len{c['input_len']}")
def test_blake3_package_passes_published_vectors(case):
    """The host hashes with the blake3 package: it must give the published
    outputs (default 32-byte output = prefix of the extended one)."""
    data = _vectors()
    msg = _vector_input(case["input_len"])
    key = data["key"].encode("ascii")
    assert len(key) == 32
    for mode, hasher in [
        ("hash", blake3.blake3(msg)),
        ("keyed_hash", blake3.blake3(msg, key=key)),
        ("derive_key", blake3.blake3(msg, derive_key_context=data["context_string"])),
    ]:
        assert hasher.digest(131).hex() == case[mode]
        assert hasher.digest().hex() == case[mode][:64]


def test_keyed_digest_is_truncated_keyed_blake3():
    """H = the first 16 bytes of keyed BLAKE3 under the derived key, for the
    lengths around BLAKE3's 64-byte block and the 1024-byte chunk."""
    key32 = blake3.blake3(KEY, derive_key_context=CONTEXT).digest()
    assert blake3_key(KEY) == key32
    for n in (0, 1, 63, 64, 65, 96, 1023, 1024, 1025):
        msg = _vector_input(n)
        assert keyed_digest(KEY, msg) == blake3.blake3(msg, key=key32).digest()[:16]
    assert keyed_digest(KEY, bytearray(b"ab")) == keyed_digest(KEY, memoryview(b"ab"))
    assert keyed_digest(KEY, b"") != keyed_digest(OTHER_KEY, b"")


def test_key_derivation():
    """key32 = BLAKE3 derive_key(KEY_CONTEXT, key): 32 bytes, one per key,
    specific to the context (tests/kernels/test_block_hash.py also writes the
    two derive-key steps out by hand)."""
    assert blake3_key(KEY) == blake3.blake3(KEY, derive_key_context=CONTEXT).digest()
    assert len(blake3_key(KEY)) == 32
    assert blake3_key(KEY) != blake3_key(OTHER_KEY)
    assert blake3_key(KEY) != blake3.blake3(KEY, derive_key_context="gpukv").digest()
    assert hashing.KEY_CONTEXT == CONTEXT


@pytest.mark.parametrize(
    "key, exc",
    [(bytes(15), InvalidInputError), (bytes(17), InvalidInputError), ("00" * 16, InvalidTypeError),
     (12345, InvalidTypeError)],
)
def test_rejects_bad_key(key, exc):
    with refused(exc, "key", "16 bytes"):
        keyed_digest(key, b"")
    with refused(exc, "key", "16 bytes"):
        blake3_key(key)
    with refused(exc, "key", "16 bytes"):
        block_digests_lanes(key, np.zeros((1, 2), np.uint64), np.zeros((1, 3), np.int64),
                            np.zeros((1, 2), np.uint64))
    with refused(exc, "key", "16 bytes"):
        hash_requests(key, [[1, 2]], 1)


def test_keyed_digest_rejects_non_bytes():
    with refused(InvalidTypeError, "data", "^data: must be bytes, not str; "):
        keyed_digest(KEY, "abc")


def test_key_never_shown():
    """No repr or message this module makes shows the key or the derived key."""
    secret = bytes(range(0xA0, 0xB0))
    derived = blake3_key(secret)
    block_digest(secret, bytes(16), [1, 2, 3])  # puts the key in the hasher cache
    shown = [repr(hashing._hasher), repr(hashing._hasher.cache_info()), repr(hashing._hasher(secret))]
    for bad in (secret[:15], secret + b"x"):
        with refused(InvalidInputError, "key") as info:
            keyed_digest(bad, b"")
        shown.append(str(info.value))
    for text in shown:
        for value in (secret, derived):
            assert value.hex() not in text.lower()
            assert repr(value) not in text


# ---------------------------------------------------------------- digest layout


def test_root_digest_is_keyed_constant():
    assert root_digest(KEY) == H(KEY, b"gpukv:root:v2")
    assert root_digest(KEY) != root_digest(OTHER_KEY)


def test_block_digest_layout_by_hand():
    parent = bytes(range(100, 116))
    extra = bytes(range(200, 216))
    tokens = [1, 0x01020304, 2**32 - 1]
    # parent(16) || extra(16) || tokens as little-endian uint32
    message = (
        parent
        + extra
        + b"\x01\x00\x00\x00"
        + b"\x04\x03\x02\x01"
        + b"\xff\xff\xff\xff"
    )
    assert block_digest(KEY, parent, tokens, extra) == H(KEY, message)
    assert block_digest(KEY, parent, tokens) == H(KEY, parent + bytes(16) + message[32:])


@pytest.mark.parametrize("n", [247, 248, 249, 496, 497, 512, 1000])
def test_long_blocks_fold_in_segments(n):
    """A block of more than 248 tokens (a message over one 1024-byte chunk)
    is folded: s = parent; s = H(s || extra || segment) per segment of at
    most 248 tokens. Up to 248 tokens it is one message of <= 1024 bytes."""
    rng = np.random.default_rng(n)
    tokens = rng.integers(0, 2**32, size=n, dtype=np.int64).tolist()
    parent, extra = bytes(range(16)), bytes(range(16, 32))
    s = parent
    for lo in range(0, n, 248):
        message = s + extra + _le32(tokens[lo : lo + 248])
        assert len(message) <= 1024
        s = H(KEY, message)
    assert block_digest(KEY, parent, tokens, extra) == s
    if n <= 248:
        assert s == H(KEY, parent + extra + _le32(tokens))
    # The chain and the batch paths fold the same way.
    assert hash_block_chain(KEY, tokens * 2, n, extras=[extra, extra], parent=parent) == [
        s, block_digest(KEY, s, tokens, extra)]
    lanes = block_digests_lanes(KEY, digests_to_lanes([parent]), np.array([tokens]),
                                digests_to_lanes([extra]))
    assert lanes_to_digests(lanes) == [s]
    assert hash_requests(KEY, [tokens], n, [[extra]]) == [
        hash_block_chain(KEY, tokens, n, extras=[extra])]


def test_lanes_convention():
    digest = bytes(range(16))
    lanes = digests_to_lanes([digest])
    assert lanes.dtype == np.uint64 and lanes.shape == (1, 2)
    assert int(lanes[0, 0]) == int.from_bytes(digest[:8], "little")
    assert int(lanes[0, 1]) == int.from_bytes(digest[8:], "little")
    assert lanes_to_digests(lanes) == [digest]
    # The device stores the same bits as int64.
    assert lanes_to_digests(lanes.view(np.int64)) == [digest]
    assert digests_to_lanes([]).shape == (0, 2)


VECTOR_KEY = bytes(range(16))


def test_chain_golden_values():
    """Pinned digests for a fixed key: any change of layout or scheme shows here
    (and they are a cross-check for the device kernels)."""
    assert root_digest(VECTOR_KEY).hex() == "0436b386d03969616c68293db6e9d083"
    assert [d.hex() for d in hash_block_chain(VECTOR_KEY, list(range(8)), 4)] == [
        "8ffe57595c47c3a4d33e2495f71dbc97",
        "37b5a2ed83c39791e84708535e86f159",
    ]
    extras = extra_key_digests(VECTOR_KEY, 3, 3, lora_id=7, cache_salt="s")
    assert [d.hex() for d in hash_block_chain(VECTOR_KEY, list(range(9)), 3, extras=extras)] == [
        "58e1bdf699b8f45acad91cb450ee895c",
        "ec36c3aac31fe9f1b0987225759d75fd",
        "71e64c790133a1592dc0777ccbafb808",
    ]


# ---------------------------------------------------------------- chains


def test_chain_parent_linkage():
    bs = 4
    tokens = list(range(50, 50 + 4 * bs + 3))  # 4 full blocks and a partial one
    extras = [bytes([i]) * 16 for i in range(4)]
    chain = hash_block_chain(KEY, tokens, bs, extras=extras)
    assert len(chain) == 4
    parent = root_digest(KEY)
    for b, digest in enumerate(chain):
        assert digest == block_digest(KEY, parent, tokens[b * bs : (b + 1) * bs], extras[b])
        parent = digest
    # Incremental: resuming from block k with its parent gives the rest of the chain.
    for k in range(1, 5):
        rest = hash_block_chain(
            KEY, tokens, bs, extras=extras[k:], parent=chain[k - 1], start_block=k
        )
        assert rest == chain[k:]
    # Extras beyond the hashed blocks are ignored; too few is an error.
    assert hash_block_chain(KEY, tokens, bs, extras=extras + [NO_EXTRA]) == chain
    with refused(InvalidInputError, "extras", "extras: has 3 entries but 4 blocks"):
        hash_block_chain(KEY, tokens, bs, extras=extras[:3])
    with refused(InvalidInputError, "parent", "parent: is required"):
        hash_block_chain(KEY, tokens, bs, start_block=1)


def test_chain_depends_on_parent_and_prefix():
    tokens = [7, 8, 9, 10]
    assert block_digest(KEY, root_digest(KEY), tokens) != block_digest(KEY, bytes(16), tokens)
    a = hash_block_chain(KEY, [1, 2, 3, 4, 5, 6, 7, 8, 9], 3)
    b = hash_block_chain(KEY, [1, 2, 0, 4, 5, 6, 7, 8, 9], 3)
    # A change in block 0 changes every later digest, though their tokens agree.
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert hash_block_chain(OTHER_KEY, [1, 2, 3, 4, 5, 6, 7, 8, 9], 3) != a
    assert hash_block_chain(KEY, [1, 2], 3) == []


def test_block_digest_rejects_bad_arguments():
    with refused(InvalidInputError, "parent", "16-byte digest, got 15 bytes"):
        block_digest(KEY, bytes(15), [1])
    with refused(InvalidTypeError, "parent", "16-byte digest, not str"):
        block_digest(KEY, "0" * 16, [1])
    with refused(InvalidInputError, "extra", "extra: must be a 16-byte"):
        block_digest(KEY, bytes(16), [1], extra=b"x")
    with refused(InvalidInputError, "token_ids", "at least one token"):
        block_digest(KEY, bytes(16), [])
    with refused(InvalidInputError, "block_size", "block_size: must be >= 1"):
        hash_block_chain(KEY, [1, 2], 0)
    with refused(InvalidTypeError, "block_size", "block_size: must be an int"):
        hash_block_chain(KEY, [1, 2], 2.0)
    with refused(InvalidInputError, "start_block", "start_block: must be >= 0"):
        hash_block_chain(KEY, [1, 2], 1, parent=bytes(16), start_block=-1)


# ---------------------------------------------------------------- token validation

BAD_TOKENS = [
    (-1, InvalidInputError, "out of range"),
    (2**32, InvalidInputError, "out of range"),
    (2**70, InvalidInputError, "out of range"),
    (1.0, InvalidTypeError, "float"),
    ("5", InvalidTypeError, "str"),
    (True, InvalidTypeError, "bool"),
    (False, InvalidTypeError, "bool"),
    (None, InvalidTypeError, "NoneType"),
]


@pytest.mark.parametrize("bad, exc, what", BAD_TOKENS)
def test_bad_token_ids_name_the_position(bad, exc, what):
    tokens = [3, 1, bad, 4]
    with refused(exc, "token_ids[2]") as info:
        block_digest(KEY, bytes(16), tokens)
    assert what in str(info.value)
    # Positions are absolute within the request, also when hashing from a later block.
    long = [5, 6, 7, 8] + tokens
    with refused(exc, "token_ids[6]"):
        hash_block_chain(KEY, long, 4, parent=bytes(16), start_block=1)
    with refused(exc, "token_lists[1][6]"):
        hash_requests(KEY, [[1, 2, 3, 4], long], 4)


ZERO_LANES_2 = np.zeros((2, 2), np.uint64)


def test_bad_token_arrays():
    with refused(InvalidInputError, "token_ids[1]", "= -3 is out of range"):
        block_digest(KEY, bytes(16), np.array([1, -3, 2]))
    with refused(InvalidInputError, "token_ids[0]", "= 4294967296 is out of range"):
        block_digest(KEY, bytes(16), np.array([2**32], dtype=np.uint64))
    with refused(InvalidTypeError, "token_ids[0]", "bool"):
        block_digest(KEY, bytes(16), np.array([True, False]))
    with refused(InvalidTypeError, "token_ids[0]", "float64"):
        block_digest(KEY, bytes(16), np.array([1.0, 2.0]))
    with refused(InvalidTypeError, "token_ids", "sequence of int token ids"):
        block_digest(KEY, bytes(16), "abc")
    with refused(InvalidInputError, "token_ids", "must be 1-D"):
        block_digest(KEY, bytes(16), np.ones((2, 2), np.int64))
    with refused(InvalidInputError, "tokens[1, 0]", "= -1 is out of range"):
        block_digests_lanes(KEY, ZERO_LANES_2, np.array([[1, 2], [-1, 3]]), ZERO_LANES_2)
    with refused(InvalidTypeError, "tokens", "integer array"):
        block_digests_lanes(KEY, ZERO_LANES_2, np.ones((2, 2)), ZERO_LANES_2)
    with refused(InvalidInputError, "tokens", "must have shape"):
        block_digests_lanes(KEY, ZERO_LANES_2, np.ones((3, 2), np.int64), ZERO_LANES_2)


def test_bad_lanes():
    with refused(InvalidTypeError, "parents", "uint64"):
        block_digests_lanes(KEY, np.zeros((2, 2), np.float64), np.ones((2, 2), np.int64), ZERO_LANES_2)
    with refused(InvalidInputError, "extras", r"must have shape \[2, 2\]"):
        block_digests_lanes(KEY, ZERO_LANES_2, np.ones((2, 2), np.int64), np.zeros((3, 2), np.uint64))
    with refused(InvalidInputError, "lanes", r"must have shape \[n, 2\]"):
        lanes_to_digests(np.zeros(4, np.uint64))
    with refused(InvalidInputError, "digests[1]", "16-byte digest, got 3 bytes"):
        digests_to_lanes([bytes(16), b"abc"])


def test_numpy_integer_tokens_accepted():
    ref = block_digest(KEY, bytes(16), [1, 2, 70000])
    assert block_digest(KEY, bytes(16), [np.int64(1), np.uint8(2), np.uint32(70000)]) == ref
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        assert block_digest(KEY, bytes(16), np.array([1, 2, 70000], dtype=dtype)) == ref
    assert block_digest(KEY, bytes(16), (1, 2, 70000)) == ref


# ---------------------------------------------------------------- batches == one at a time


@settings(max_examples=40, deadline=None)
@given(block_size=st.integers(1, 9), n=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_block_digests_lanes_equals_pure(block_size, n, seed):
    # Odd block sizes give messages that are not a multiple of 8 bytes.
    rng = np.random.default_rng(seed)
    key = rng.bytes(16)
    parents = [rng.bytes(16) for _ in range(n)]
    extras = [rng.bytes(16) if rng.random() < 0.5 else NO_EXTRA for _ in range(n)]
    tokens = rng.integers(0, 2**32, size=(n, block_size), dtype=np.int64)
    tokens[0, 0] = 2**32 - 1  # the top of the range
    got = block_digests_lanes(key, digests_to_lanes(parents), tokens, digests_to_lanes(extras))
    want = [block_digest(key, p, t.tolist(), e) for p, t, e in zip(parents, tokens, extras, strict=True)]
    assert lanes_to_digests(got) == want
    # int64 lanes (the device's view) give the same result.
    parents64 = digests_to_lanes(parents).view(np.int64)
    got64 = block_digests_lanes(key, parents64, tokens, digests_to_lanes(extras).view(np.int64))
    assert np.array_equal(got64, got)


@settings(max_examples=30, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 3, 5, 16]),
    lengths=st.lists(st.integers(0, 40), min_size=0, max_size=6),
    with_extras=st.booleans(),
    as_arrays=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_hash_requests_equals_chains(block_size, lengths, with_extras, as_arrays, seed):
    rng = np.random.default_rng(seed)
    token_lists = [rng.integers(0, 2**32, size=n, dtype=np.int64) for n in lengths]
    if not as_arrays:
        token_lists = [t.tolist() for t in token_lists]
    extras = None
    if with_extras:
        # One more entry than needed: extras past the last full block are ignored.
        extras = [[rng.bytes(16) for _ in range(n // block_size + 1)] for n in lengths]
    got = hash_requests(KEY, token_lists, block_size, extras)
    want = [
        hash_block_chain(KEY, t, block_size, extras=None if extras is None else extras[r])
        for r, t in enumerate(token_lists)
    ]
    assert got == want


def test_hash_requests_edge_cases():
    assert hash_requests(KEY, [], 4) == []
    assert hash_requests(KEY, [[1, 2], []], 4) == [[], []]
    with refused(InvalidInputError, "extras", "extras: has 1 entries, token_lists 2"):
        hash_requests(KEY, [[1], [2]], 1, extras=[[NO_EXTRA]])
    with refused(InvalidInputError, "extras[0]", r"extras\[0\]: has 1 entries but request 0 has 2"):
        hash_requests(KEY, [[1, 2]], 1, extras=[[NO_EXTRA]])


def test_hash_requests_token_checks_in_batch():
    """The batch path checks every request's tokens (lists all at once) and
    names the bad position; lists, tuples and arrays may be mixed."""
    with refused(InvalidTypeError, "token_lists[1][2]", r"token_lists\[1\]\[2\]: is a bool"):
        hash_requests(KEY, [[0, 1, 2], [1, 0, True, 5]], 2)
    with refused(InvalidInputError, "token_lists[0][1]", r"token_lists\[0\]\[1\]: = -1"):
        hash_requests(KEY, [[0, -1], [1, 2]], 2)
    with refused(InvalidTypeError, "token_lists[1][0]", r"token_lists\[1\]\[0\]: has type float"):
        hash_requests(KEY, [[0, 1], [1.0, 2]], 2)
    with refused(InvalidInputError, "token_lists[2][1]", r"token_lists\[2\]\[1\]: = 4294967296"):
        hash_requests(KEY, [np.array([0, 1]), [1, 2], np.array([3, 2**32], dtype=np.uint64)], 2)
    with refused(InvalidInputError, "token_lists[0][0]", r"token_lists\[0\]\[0\]: = -5"):
        hash_requests(KEY, [np.array([-5, 1], dtype=np.int8)], 2)
    mixed = [[0, 1, 2, 3], (4, 5, 6), np.array([7, 8, 9, 2**32 - 1], dtype=np.uint64),
             np.arange(10, dtype=np.int16)[::2]]
    assert hash_requests(KEY, mixed, 2) == [hash_block_chain(KEY, list(t), 2) for t in mixed]
    # 0 and 1 are token ids like any other (only bools are refused).
    assert hash_requests(KEY, [[0, 1, 1, 0]], 2) == [hash_block_chain(KEY, [0, 1, 1, 0], 2)]


# ---------------------------------------------------------------- extra keys


def test_no_extra_keys_give_no_extra():
    assert extra_key_digests(KEY, 3, 4) == [NO_EXTRA] * 3
    assert extra_key_digests(KEY, 0, 4, lora_id=1) == []
    assert encode_extra_keys() == b""


def test_extra_key_encoding_by_hand():
    lora = encode_extra_keys(lora_id=7)
    assert lora == b"\x01" + struct.pack("<I", 8) + struct.pack("<Q", 7)
    mm = encode_extra_keys(mm_items=[MMItem(5, 10, "ab")])
    assert mm == b"\x02" + struct.pack("<I", 10) + struct.pack("<Q", 5) + b"ab"  # (offset and hash: no length)
    salt = encode_extra_keys(cache_salt="é")
    assert salt == b"\x03" + struct.pack("<I", 2) + "é".encode()
    both = encode_extra_keys(lora_id=7, mm_items=[MMItem(5, 10, "ab")], cache_salt="é")
    assert both == lora + mm + salt
    [digest] = extra_key_digests(
        KEY, 1, 16, lora_id=7, mm_items=[MMItem(5, 10, "ab")], cache_salt="é"
    )
    assert digest == H(KEY, b"gpukv:extra:v3" + both)


def test_lora_changes_every_block():
    tokens = list(range(20))
    plain = hash_block_chain(KEY, tokens, 4)
    for lora in (0, 1, 2):
        extras = extra_key_digests(KEY, 5, 4, lora_id=lora)
        assert all(e != NO_EXTRA for e in extras)
        chain = hash_block_chain(KEY, tokens, 4, extras=extras)
        assert all(x != y for x, y in zip(chain, plain, strict=True))
    assert extra_key_digests(KEY, 2, 4, lora_id=1) != extra_key_digests(KEY, 2, 4, lora_id=2)


def test_mm_item_changes_exactly_the_blocks_it_overlaps():
    bs = 4
    # Tokens 5..14 touch blocks 1 (4-7), 2 (8-11) and 3 (12-15).
    extras = extra_key_digests(KEY, 6, bs, mm_items=[MMItem(offset=5, length=10, hash="img")])
    assert [e != NO_EXTRA for e in extras] == [False, True, True, True, False, False]
    # Exactly one block's range [4, 8).
    extras = extra_key_digests(KEY, 3, bs, mm_items=[MMItem(4, 4, "img")])
    assert [e != NO_EXTRA for e in extras] == [False, True, False]
    # With a LoRA id, the overlapped blocks still differ from the others.
    base = extra_key_digests(KEY, 6, bs, lora_id=3)
    with_mm = extra_key_digests(KEY, 6, bs, lora_id=3, mm_items=[MMItem(5, 10, "img")])
    assert [a != b for a, b in zip(base, with_mm, strict=True)] == [False, True, True, True, False, False]


def test_mm_items_are_canonical_and_distinguishing():
    a, b = MMItem(2, 3, "x"), MMItem(9, 2, "y")
    in_order = extra_key_digests(KEY, 4, 4, mm_items=[a, b])
    assert extra_key_digests(KEY, 4, 4, mm_items=[b, a]) == in_order
    one = extra_key_digests(KEY, 1, 8, mm_items=[MMItem(2, 3, "x")])
    assert one != extra_key_digests(KEY, 1, 8, mm_items=[MMItem(2, 3, "z")])  # other content
    assert one != extra_key_digests(KEY, 1, 8, mm_items=[MMItem(3, 3, "x")])  # other offset
    # another length: the blocks both ranges overlap agree (vLLM keys an item by its identifier and offset), the
    # others do not
    assert one == extra_key_digests(KEY, 1, 8, mm_items=[MMItem(2, 4, "x")])
    longer = extra_key_digests(KEY, 2, 8, mm_items=[MMItem(2, 10, "x")])  # (tokens 2..11: blocks 0 and 1)
    assert longer[0] == one[0] and longer[1] != NO_EXTRA
    assert extra_key_digests(KEY, 2, 8, mm_items=[MMItem(2, 5, "x")])[1] == NO_EXTRA


def test_salt_changes_block_zero_only_and_the_whole_chain():
    tokens = list(range(16))
    none = extra_key_digests(KEY, 4, 4)
    salted = extra_key_digests(KEY, 4, 4, cache_salt="tenant-a")
    assert salted[0] != NO_EXTRA and salted[1:] == none[1:]
    other = extra_key_digests(KEY, 4, 4, cache_salt="tenant-b")
    chains = [hash_block_chain(KEY, tokens, 4, extras=e) for e in (none, salted, other)]
    # Only block 0's extra keys differ, yet no two chains share any digest.
    all_digests = [d for chain in chains for d in chain]
    assert len(set(all_digests)) == len(all_digests)
    # An empty salt is no salt (as in vLLM); the salt never reaches later blocks.
    assert extra_key_digests(KEY, 4, 4, cache_salt="") == none
    assert extra_key_digests(KEY, 2, 4, cache_salt="tenant-a", first_block=1) == none[1:3]


def test_first_block_window():
    kw = dict(lora_id=5, mm_items=[MMItem(3, 9, "a"), MMItem(14, 1, "b")], cache_salt="s")
    full = extra_key_digests(KEY, 6, 4, **kw)
    for first in range(6):
        assert extra_key_digests(KEY, 6 - first, 4, first_block=first, **kw) == full[first:]


def test_extra_key_argument_errors():
    with refused(InvalidInputError, "MMItem.length", "MMItem.length: must be >= 1"):
        MMItem(0, 0, "h")
    with refused(InvalidInputError, "MMItem.offset", "MMItem.offset: must be >= 0"):
        MMItem(-1, 2, "h")
    with refused(InvalidTypeError, "MMItem.offset", "must be an int"):
        MMItem(1.5, 2, "h")
    with refused(InvalidTypeError, "MMItem.hash", "MMItem.hash: must be a str"):
        MMItem(0, 2, b"h")
    with refused(InvalidInputError, "MMItem.hash", "non-empty"):
        MMItem(0, 2, "")
    with refused(InvalidTypeError, "mm_items[0]", r"mm_items\[0\]: must be an MMItem"):
        extra_key_digests(KEY, 1, 4, mm_items=[(0, 2, "h")])
    with refused(InvalidTypeError, "mm_items", "must be a sequence of MMItem"):
        extra_key_digests(KEY, 1, 4, mm_items=MMItem(0, 2, "h"))
    with refused(InvalidTypeError, "lora_id", "lora_id: must be an int"):
        extra_key_digests(KEY, 1, 4, lora_id=True)
    with refused(InvalidInputError, "lora_id", "lora_id: must be >= 0"):
        extra_key_digests(KEY, 1, 4, lora_id=-1)
    with refused(InvalidInputError, "lora_id", "must be < 2"):
        encode_extra_keys(lora_id=2**64)
    with refused(InvalidTypeError, "cache_salt", "cache_salt: must be a str"):
        extra_key_digests(KEY, 1, 4, cache_salt=b"s")
    with refused(InvalidInputError, "num_blocks", "must be >= 0"):
        extra_key_digests(KEY, -1, 4)
    with refused(InvalidInputError, "first_block", "must be >= 0"):
        extra_key_digests(KEY, 1, 4, first_block=-1)


# ---------------------------------------------------------------- key resolution


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("GPUKV_HASH_KEY", raising=False)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    return monkeypatch


def _seed_key(seed: int) -> bytes:
    """The documented derivation, written out independently of the module."""
    message = b"gpukv:hash-key:PYTHONHASHSEED:v1\x00" + str(seed).encode("ascii")
    return hashlib.sha256(message).digest()[:16]


def test_key_precedence(clean_env):
    explicit = bytes(range(16, 32))
    env_key = bytes(range(32, 48))
    clean_env.setenv("GPUKV_HASH_KEY", env_key.hex())
    clean_env.setenv("PYTHONHASHSEED", "42")
    assert resolve_hash_key(explicit) == explicit
    assert resolve_hash_key(explicit.hex()) == explicit
    assert resolve_hash_key(explicit.hex().upper()) == explicit
    assert resolve_hash_key() == env_key
    clean_env.delenv("GPUKV_HASH_KEY")
    assert resolve_hash_key() == _seed_key(42)
    clean_env.setenv("PYTHONHASHSEED", "042")  # Python reads this as 42 too
    assert resolve_hash_key() == _seed_key(42)
    clean_env.setenv("PYTHONHASHSEED", "43")
    assert resolve_hash_key() != _seed_key(42)


@pytest.mark.parametrize("seed", [None, "random", ""])
def test_random_key_without_seed(clean_env, seed):
    if seed is not None:
        clean_env.setenv("PYTHONHASHSEED", seed)
    a, b = resolve_hash_key(), resolve_hash_key()
    assert len(a) == len(b) == 16 and a != b


SECRET_HEX = "5ec2e75ec2e75ec2e75ec2e75ec2e7"  # 30 hex chars: wrong length


@pytest.mark.parametrize(
    "key, match",
    [
        (bytes(8), "16 bytes, got 8"),
        (SECRET_HEX, "32 hex characters"),
        ("zz" + SECRET_HEX, "only hex digits"),
    ],
)
@pytest.mark.usefixtures("clean_env")  # for its side effect: no hash key in the environment
def test_bad_explicit_keys(key, match):
    with refused(InvalidInputError, "key", match) as info:
        resolve_hash_key(key)
    assert SECRET_HEX not in str(info.value)


def test_bad_env_keys_do_not_echo(clean_env):
    for value, match in [(SECRET_HEX, "32 hex characters"), ("zz" + SECRET_HEX, "only hex digits"),
                         ("   ", "got 0 characters")]:  # set but blank: an error, not silently "unset"
        clean_env.setenv("GPUKV_HASH_KEY", value)
        with refused(InvalidInputError, "GPUKV_HASH_KEY", f"GPUKV_HASH_KEY: must.*{match}") as info:
            resolve_hash_key()
        assert SECRET_HEX not in str(info.value)
    clean_env.delenv("GPUKV_HASH_KEY")
    clean_env.setenv("PYTHONHASHSEED", "not-a-number-5ec2e7")
    with refused(InvalidInputError, "PYTHONHASHSEED", "PYTHONHASHSEED: must be") as info:
        resolve_hash_key()
    assert "5ec2e7" not in str(info.value)


def test_processes_sharing_pythonhashseed_share_digests():
    """Real processes: the same PYTHONHASHSEED gives the same root digest
    (KV can move between instances); without it each process draws its own key."""
    code = (
        "from gpukv.core.hashing import resolve_hash_key, root_digest; "
        "print(root_digest(resolve_hash_key()).hex())"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("GPUKV_HASH_KEY", "PYTHONHASHSEED")}
    base["PYTHONPATH"] = str(REPO)
    seeded = dict(base, PYTHONHASHSEED="1234")
    # Started together: each one imports the package (and torch), so this halves the wait.
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in (seeded, seeded, base, base)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip())
    assert all(len(o) == 32 for o in outs)
    assert outs[0] == outs[1] == root_digest(_seed_key(1234)).hex()
    assert outs[2] != outs[3]
    assert outs[0] not in outs[2:]
