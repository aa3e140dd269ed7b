"""The Triton SipHash / block-hash kernels against the reference vectors and a
small pure-Python SipHash-2-4 written here (independent of gpukv.hashing)."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
import torch

import gpukv._runtime  # noqa: F401  (before triton: interpreter on CPU)
from gpukv.kernels import hashing as kh

from hypothesis import given, settings, strategies as st

M64 = (1 << 64) - 1
VECTORS = Path(__file__).parents[3] / "shared/data/siphash_vectors.json"
VKEY = bytes(range(16))
DEVICE = gpukv._runtime.default_device()


# --------------------------------------------------------------------------
# Pure-Python reference
# --------------------------------------------------------------------------


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & M64


def _round(v: list) -> None:
    v[0] = (v[0] + v[1]) & M64; v[1] = _rotl(v[1], 13); v[1] ^= v[0]; v[0] = _rotl(v[0], 32)
    v[2] = (v[2] + v[3]) & M64; v[3] = _rotl(v[3], 16); v[3] ^= v[2]
    v[0] = (v[0] + v[3]) & M64; v[3] = _rotl(v[3], 21); v[3] ^= v[0]
    v[2] = (v[2] + v[1]) & M64; v[1] = _rotl(v[1], 17); v[1] ^= v[2]; v[2] = _rotl(v[2], 32)


def py_siphash(key: bytes, msg: bytes, out128: bool = True) -> bytes:
    """SipHash-2-4 as the reference C code writes its output (LE bytes)."""
    k0, k1 = struct.unpack("<QQ", key)
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D,
         k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]
    if out128:
        v[1] ^= 0xEE
    n = len(msg) // 8
    words = list(struct.unpack(f"<{n}Q", msg[: 8 * n]))
    words.append(int.from_bytes(msg[8 * n:], "little") | ((len(msg) & 0xFF) << 56))
    for m in words:
        v[3] ^= m
        _round(v); _round(v)
        v[0] ^= m
    v[2] ^= 0xEE if out128 else 0xFF
    for _ in range(4):
        _round(v)
    lo = v[0] ^ v[1] ^ v[2] ^ v[3]
    if not out128:
        return struct.pack("<Q", lo)
    v[1] ^= 0xDD
    for _ in range(4):
        _round(v)
    return struct.pack("<QQ", lo, v[0] ^ v[1] ^ v[2] ^ v[3])


def py_block_digest(key: bytes, parent: bytes, tokens, extra: bytes) -> bytes:
    msg = parent + b"".join(struct.pack("<I", t & 0xFFFFFFFF) for t in tokens) + extra
    return py_siphash(key, msg)


def lanes_to_bytes(lo: int, hi: int) -> bytes:
    return struct.pack("<QQ", lo & M64, hi & M64)


def signed(x: int) -> int:
    x &= M64
    return x - (1 << 64) if x >> 63 else x


# --------------------------------------------------------------------------
# Reference vectors
# --------------------------------------------------------------------------

# (i, 64-bit hex, 128-bit hex) from the SipHash authors' vectors.h, key 00..0f,
# message = bytes 0..i-1. Kept inline so the test runs without shared/.
INLINE = [
    (0, "310e0edd47db6f72", "a3817f04ba25a8e66df67214c7550293"),
    (1, "fd67dc93c539f874", "da87c1d86b99af44347659119b22fc45"),
    (2, "5a4fa9d909806c0d", None),
    (8, "6224939a79f5f593", None),
    (15, "e545be4961ca29a1", None),
    (63, None, None),  # filled from the Python reference (checked by the file test)
]


def _run_vectors(idx, out128):
    lmax = max(idx) if idx else 0
    msgs = torch.zeros((len(idx), lmax), dtype=torch.uint8)
    for r, i in enumerate(idx):
        msgs[r, :i] = torch.arange(i, dtype=torch.uint8)
    lengths = torch.tensor(idx, dtype=torch.int32)
    out = kh.siphash_bytes(VKEY, msgs.to(DEVICE), lengths.to(DEVICE), out128=out128, tile=16)
    out = out.cpu()
    if out128:
        return [lanes_to_bytes(*row).hex() for row in out.tolist()]
    return [struct.pack("<Q", x & M64).hex() for x in out.tolist()]


def test_python_reference_inline_vectors():
    for i, h64, h128 in INLINE:
        if h64:
            assert py_siphash(VKEY, bytes(range(i)), out128=False).hex() == h64
        if h128:
            assert py_siphash(VKEY, bytes(range(i))).hex() == h128


@pytest.mark.parametrize("out128", [True, False])
def test_kernel_inline_vectors(out128):
    idx = [i for i, *_ in INLINE]
    got = _run_vectors(idx, out128)
    for (i, h64, h128), g in zip(INLINE, got):
        want = h128 if out128 else h64
        if want is None:
            want = py_siphash(VKEY, bytes(range(i)), out128).hex()
        assert g == want, i


@pytest.mark.skipif(not VECTORS.exists(), reason=f"reference vectors not found at {VECTORS}")
@pytest.mark.parametrize("out128", [True, False])
def test_kernel_all_reference_vectors(out128):
    data = json.loads(VECTORS.read_text())
    assert bytes.fromhex(data["key_hex"]) == VKEY
    want = data["siphash_2_4_128" if out128 else "siphash_2_4_64"]
    assert len(want) == 64
    # shuffled order: every lane stops at its own length
    idx = list(range(64))
    random.Random(7).shuffle(idx)
    got = _run_vectors(idx, out128)
    for i, g in zip(idx, got):
        assert g == want[i], f"vector {i}"
    for i in range(64):  # and the Python reference used below
        assert py_siphash(VKEY, bytes(range(i)), out128).hex() == want[i]


@settings(max_examples=15, deadline=None)
@given(key=st.binary(min_size=16, max_size=16),
       msgs=st.lists(st.binary(max_size=40), min_size=1, max_size=5),
       out128=st.booleans())
def test_kernel_bytes_random(key, msgs, out128):
    lmax = max(len(m) for m in msgs)
    t = torch.zeros((len(msgs), lmax), dtype=torch.uint8)
    for r, m in enumerate(msgs):
        t[r, : len(m)] = torch.tensor(list(m), dtype=torch.uint8)
    lengths = torch.tensor([len(m) for m in msgs], dtype=torch.int32)
    out = kh.siphash_bytes(key, t.to(DEVICE), lengths.to(DEVICE), out128=out128).cpu().tolist()
    for m, o in zip(msgs, out):
        got = lanes_to_bytes(*o) if out128 else struct.pack("<Q", o & M64)
        assert got == py_siphash(key, m, out128)


def test_bytes_equal_lengths_default():
    msgs = torch.arange(2 * 13, dtype=torch.uint8).reshape(2, 13)
    out = kh.siphash_bytes(VKEY, msgs.to(DEVICE)).cpu().tolist()
    for r in range(2):
        assert lanes_to_bytes(*out[r]) == py_siphash(VKEY, bytes(msgs[r].tolist()))
    empty = kh.siphash_bytes(VKEY, torch.zeros((3, 0), dtype=torch.uint8, device=DEVICE))
    assert all(lanes_to_bytes(*o) == py_siphash(VKEY, b"") for o in empty.cpu().tolist())


# --------------------------------------------------------------------------
# Chained block digests
# --------------------------------------------------------------------------


def _rand_i64(rng, *shape):
    n = 1
    for s in shape:
        n *= s
    return torch.tensor([signed(rng.getrandbits(64)) for _ in range(n)],
                        dtype=torch.int64).reshape(shape)


def _case(rng, R, max_blocks, bs):
    tokens = torch.tensor(
        [signed(rng.choice([rng.getrandbits(32), rng.getrandbits(31), 0xFFFFFFFF,
                            1 << 31, rng.randrange(50000)])) & 0xFFFFFFFF
         for _ in range(R * max_blocks * bs)], dtype=torch.int64)
    tokens = torch.where(tokens >= 1 << 31, tokens - (1 << 32), tokens).to(torch.int32)
    tokens = tokens.reshape(R, max_blocks * bs)
    assert (tokens < 0).any()  # ids >= 2**31 present
    parents = _rand_i64(rng, R, 2)
    extras = _rand_i64(rng, R, max_blocks, 2)
    extras[0] = 0  # a request without extra keys
    return tokens, parents, extras


def _expected(key, tokens, parents, extras, counts, max_blocks, bs):
    R = tokens.shape[0]
    exp = torch.zeros((R, max_blocks, 2), dtype=torch.int64)
    for r in range(R):
        parent = lanes_to_bytes(*parents[r].tolist())
        for b in range(counts[r]):
            extra = (lanes_to_bytes(*extras[r, b].tolist()) if extras is not None
                     else bytes(16))
            d = py_block_digest(key, parent, tokens[r, b * bs:(b + 1) * bs].tolist(), extra)
            lo, hi = struct.unpack("<QQ", d)
            exp[r, b, 0], exp[r, b, 1] = signed(lo), signed(hi)
            parent = d
    return exp


@pytest.mark.parametrize("bs", [1, 3, 16])
def test_chains_match_python_reference(bs):
    rng = random.Random(1000 + bs)
    key = bytes(rng.getrandbits(8) for _ in range(16))
    R, max_blocks = 5, 4
    tokens, parents, extras = _case(rng, R, max_blocks, bs)
    counts = [4, 0, 1, 3, 2]
    nb = torch.tensor(counts, dtype=torch.int32)
    out = kh.hash_block_chains(key, parents.to(DEVICE), tokens.to(DEVICE), nb.to(DEVICE),
                               extras.to(DEVICE), tile=2)  # 3 programs, last one partial
    exp = _expected(key, tokens, parents, extras, counts, max_blocks, bs)
    assert torch.equal(out.cpu(), exp)


def test_chains_without_extras_and_key_forms():
    rng = random.Random(5)
    bs, R, max_blocks = 3, 3, 3
    tokens, parents, _ = _case(rng, R, max_blocks, bs)
    key = bytes(range(100, 116))
    k0, k1 = struct.unpack("<QQ", key)
    counts = [3, 2, 3]
    nb = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    args = (parents.to(DEVICE), tokens.to(DEVICE), nb)
    exp = _expected(key, tokens, parents, None, counts, max_blocks, bs)
    a = kh.hash_block_chains(key, *args, block_size=bs)
    b = kh.hash_block_chains((k0, k1), *args, block_size=bs)
    c = kh.hash_block_chains((signed(k0), signed(k1)), *args, block_size=bs)
    d = kh.hash_block_chains(torch.tensor([signed(k0), signed(k1)], device=DEVICE), *args,
                             extras=torch.zeros((R, max_blocks, 2), dtype=torch.int64,
                                                device=DEVICE))
    for x in (a, b, c, d):
        assert torch.equal(x.cpu(), exp)


def test_chains_unsigned_key_lanes():
    # key lanes >= 2**63 given as unsigned ints
    key = bytes([0xFF] * 8 + [0x80] + [0] * 7)
    k0, k1 = struct.unpack("<QQ", key)
    assert k0 >= 1 << 63 and k1 < 1 << 63
    tokens = torch.tensor([[-1, 2**31 - 1]], dtype=torch.int32)
    parents = torch.tensor([[-5, 7]], dtype=torch.int64)
    nb = torch.tensor([2], dtype=torch.int32)
    out = kh.hash_block_chains((k0, k1), parents.to(DEVICE), tokens.to(DEVICE), nb.to(DEVICE),
                               block_size=1)
    assert torch.equal(out.cpu(), _expected(key, tokens, parents, None, [2], 2, 1))


def test_chain_is_prefix_consistent():
    """Hashing a prefix, then the rest from its last digest, gives the same chain."""
    rng = random.Random(9)
    bs, max_blocks = 3, 4
    tokens, parents, extras = _case(rng, 2, max_blocks, bs)
    key = VKEY
    full = kh.hash_block_chains(key, parents.to(DEVICE), tokens.to(DEVICE),
                                torch.tensor([4, 4], dtype=torch.int32, device=DEVICE),
                                extras.to(DEVICE)).cpu()
    tail = kh.hash_block_chains(key, full[:, 1].contiguous().to(DEVICE),
                                tokens[:, 2 * bs:].contiguous().to(DEVICE),
                                torch.tensor([2, 2], dtype=torch.int32, device=DEVICE),
                                extras[:, 2:].contiguous().to(DEVICE)).cpu()
    assert torch.equal(tail, full[:, 2:])


def test_counts_clamped_and_out_overwritten():
    rng = random.Random(11)
    bs, R, max_blocks = 1, 3, 3
    tokens, parents, extras = _case(rng, R, max_blocks, bs)
    out = torch.full((R, max_blocks, 2), 123, dtype=torch.int64, device=DEVICE)
    nb = torch.tensor([-2, 99, 2], dtype=torch.int32, device=DEVICE)
    res = kh.hash_block_chains(VKEY, parents.to(DEVICE), tokens.to(DEVICE), nb,
                               extras.to(DEVICE), out=out)
    assert res is out
    exp = _expected(VKEY, tokens, parents, extras, [0, 3, 2], max_blocks, bs)
    assert torch.equal(out.cpu(), exp)


def test_empty_batches():
    z = kh.hash_block_chains(VKEY, torch.zeros((0, 2), dtype=torch.int64, device=DEVICE),
                             torch.zeros((0, 6), dtype=torch.int32, device=DEVICE),
                             torch.zeros((0,), dtype=torch.int32, device=DEVICE),
                             block_size=3)
    assert z.shape == (0, 2, 2)


def test_validation_errors():
    p = torch.zeros((2, 2), dtype=torch.int64, device=DEVICE)
    t = torch.zeros((2, 6), dtype=torch.int32, device=DEVICE)
    nb = torch.zeros((2,), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="parents must be torch.int64"):
        kh.hash_block_chains(VKEY, p.int(), t, nb, block_size=3)
    with pytest.raises(ValueError, match="tokens must be torch.int32"):
        kh.hash_block_chains(VKEY, p, t.long(), nb, block_size=3)
    with pytest.raises(ValueError, match="num_blocks must have shape"):
        kh.hash_block_chains(VKEY, p, t, nb[:1], block_size=3)
    with pytest.raises(ValueError, match="extras must have shape"):
        kh.hash_block_chains(VKEY, p, t, nb, torch.zeros((2, 3, 3), dtype=torch.int64,
                                                         device=DEVICE), block_size=2)
    with pytest.raises(ValueError, match="block_size is needed"):
        kh.hash_block_chains(VKEY, p, t, nb)
    with pytest.raises(ValueError, match="pass block_size"):
        kh.hash_block_chains(VKEY, p, t, nb, torch.zeros((2, 4, 2), dtype=torch.int64,
                                                         device=DEVICE))
    with pytest.raises(ValueError, match="16 bytes"):
        kh.hash_block_chains(b"short", p, t, nb, block_size=3)
    with pytest.raises(ValueError, match="key tensor"):
        kh.hash_block_chains(torch.zeros(3, dtype=torch.int64), p, t, nb, block_size=3)
    with pytest.raises(ValueError, match="tile"):
        kh.hash_block_chains(VKEY, p, t, nb, block_size=3, tile=3)
    with pytest.raises(ValueError, match="messages must be torch.uint8"):
        kh.siphash_bytes(VKEY, t)


def _host_module():
    from gpukv import hashing

    return hashing


@pytest.mark.parametrize("bs", [1, 3, 16])
def test_chains_match_host_implementation(bs):
    """Bit-identical to gpukv.hashing (hash_block_chain from root_digest, block_digest)."""
    host = _host_module()
    rng = random.Random(77 + bs)
    key = bytes(rng.getrandbits(8) for _ in range(16))
    R, max_blocks = 3, 3
    tokens, _, extras = _case(rng, R, max_blocks, bs)
    root = host.root_digest(key)
    parents = torch.tensor([[signed(x) for x in struct.unpack("<QQ", root)]] * R,
                           dtype=torch.int64)
    counts = [3, 1, 2]
    out = kh.hash_block_chains(key, parents.to(DEVICE), tokens.to(DEVICE),
                               torch.tensor(counts, dtype=torch.int32, device=DEVICE),
                               extras.to(DEVICE)).cpu()
    for r in range(R):
        ids = [t & 0xFFFFFFFF for t in tokens[r].tolist()][: counts[r] * bs]
        ext = [lanes_to_bytes(*extras[r, b].tolist()) for b in range(counts[r])]
        want = host.hash_block_chain(key, ids, bs, extras=ext)
        got = [lanes_to_bytes(*out[r, b].tolist()) for b in range(counts[r])]
        assert got == want
        assert got[0] == host.block_digest(key, root, ids[:bs], ext[0])
