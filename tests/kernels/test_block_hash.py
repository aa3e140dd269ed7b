"""The Triton BLAKE3 block-hash kernels (gpukv/kernels/block_hash.py) against
the BLAKE3 team's published test vectors, a small pure-Python BLAKE3 written
here (single chunk, independent of the kernels and of gpukv.core.hashing), the
``blake3`` package, and the host scheme in gpukv.core.hashing (bit-identical).

Under Triton's interpreter a compression costs about 0.3 s whatever the
number of lanes, so the cases put many requests in one program and keep the
block positions few (the long block sizes cost 16 and 34 compressions each).
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import blake3
import pytest
import torch

import gpukv._runtime  # noqa: F401  (before triton: interpreter on CPU)
from gpukv.core import hashing as host
from gpukv.kernels import block_hash as kb

DEVICE = gpukv._runtime.default_device()
M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1
VECTORS = json.loads((Path(__file__).parents[1] / "data" / "blake3_test_vectors.json").read_text())


# --------------------------------------------------------------------------
# Pure-Python BLAKE3, one chunk (<= 1024 bytes), chunk counter 0
# --------------------------------------------------------------------------

IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
PERMUTATION = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
CHUNK_START, CHUNK_END, ROOT, KEYED_HASH, DERIVE_KEY_CONTEXT, DERIVE_KEY_MATERIAL = 1, 2, 8, 16, 32, 64


def _rotr(x: int, n: int) -> int:
    return ((x >> n) | (x << (32 - n))) & M32


def _g(v: list, a: int, b: int, c: int, d: int, x: int, y: int) -> None:
    v[a] = (v[a] + v[b] + x) & M32
    v[d] = _rotr(v[d] ^ v[a], 16)
    v[c] = (v[c] + v[d]) & M32
    v[b] = _rotr(v[b] ^ v[c], 12)
    v[a] = (v[a] + v[b] + y) & M32
    v[d] = _rotr(v[d] ^ v[a], 8)
    v[c] = (v[c] + v[d]) & M32
    v[b] = _rotr(v[b] ^ v[c], 7)


def py_compress(h, m, block_len: int, flags: int) -> list:
    v = list(h) + list(IV[:4]) + [0, 0, block_len, flags]
    m = list(m)
    for _ in range(7):
        _g(v, 0, 4, 8, 12, m[0], m[1])
        _g(v, 1, 5, 9, 13, m[2], m[3])
        _g(v, 2, 6, 10, 14, m[4], m[5])
        _g(v, 3, 7, 11, 15, m[6], m[7])
        _g(v, 0, 5, 10, 15, m[8], m[9])
        _g(v, 1, 6, 11, 12, m[10], m[11])
        _g(v, 2, 7, 8, 13, m[12], m[13])
        _g(v, 3, 4, 9, 14, m[14], m[15])
        m = [m[i] for i in PERMUTATION]
    return [v[i] ^ v[i + 8] for i in range(8)]


def py_blake3(key_words, data: bytes, mode_flags: int) -> bytes:
    """BLAKE3 (first 32 output bytes) of a one-chunk message."""
    assert len(data) <= 1024
    h = list(key_words)
    n = max(1, -(-len(data) // 64))
    for j in range(n):
        block = data[64 * j : 64 * j + 64]
        flags = mode_flags | (CHUNK_START if j == 0 else 0) | (CHUNK_END | ROOT if j == n - 1 else 0)
        h = py_compress(h, struct.unpack("<16I", block.ljust(64, b"\0")), len(block), flags)
    return struct.pack("<8I", *h)


def py_words(b: bytes) -> tuple:
    return struct.unpack(f"<{len(b) // 4}I", b)


def py_derive_key(context: str, material: bytes) -> bytes:
    context_key = py_blake3(IV, context.encode(), DERIVE_KEY_CONTEXT)
    return py_blake3(py_words(context_key), material, DERIVE_KEY_MATERIAL)


def py_H(key16: bytes, message: bytes) -> bytes:
    """The scheme's H with the pure-Python BLAKE3."""
    key32 = py_derive_key(host.KEY_CONTEXT, key16)
    return py_blake3(py_words(key32), message, KEYED_HASH)[:16]


def _vector_input(n: int) -> bytes:
    return bytes(i % 251 for i in range(n))


# --------------------------------------------------------------------------
# The references themselves, and the kernel's constants
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in VECTORS["cases"] if c["input_len"] <= 1024],
                         ids=lambda c: f"len{c['input_len']}")
def test_python_reference_passes_vectors(case):
    msg = _vector_input(case["input_len"])
    key = VECTORS["key"].encode()
    assert py_blake3(IV, msg, 0).hex() == case["hash"][:64]
    assert py_blake3(py_words(key), msg, KEYED_HASH).hex() == case["keyed_hash"][:64]
    assert py_derive_key(VECTORS["context_string"], msg).hex() == case["derive_key"][:64]


def test_context_key_constant():
    """CONTEXT_KEY is BLAKE3's context key of gpukv's context string."""
    ck = py_blake3(IV, host.KEY_CONTEXT.encode(), DERIVE_KEY_CONTEXT)
    assert tuple(py_words(ck)) == kb.CONTEXT_KEY
    key = bytes(range(16))
    assert py_derive_key(host.KEY_CONTEXT, key) == host.blake3_key(key)
    assert py_H(key, b"gpukv:root:v2") == host.root_digest(key)


# --------------------------------------------------------------------------
# The compression on the device: published vectors (all lengths <= 1024)
# --------------------------------------------------------------------------


def _messages(datas):
    lmax = max(len(d) for d in datas)
    t = torch.zeros((len(datas), lmax), dtype=torch.uint8)
    for r, d in enumerate(datas):
        t[r, : len(d)] = torch.tensor(list(d), dtype=torch.uint8)
    return t.to(DEVICE), torch.tensor([len(d) for d in datas], dtype=torch.int32, device=DEVICE)


def _out_bytes(out) -> list:
    return [struct.pack("<4q", *row) for row in out.cpu().tolist()]


def test_device_keyed_hash_vectors_and_all_block_boundaries():
    """keyed_hash on the device: the published vectors (0, 1, 1023, 1024
    bytes), and random messages at every block boundary against the blake3
    package, all lanes of one launch (each stops at its own length)."""
    key = VECTORS["key"].encode()
    cases = [c for c in VECTORS["cases"] if c["input_len"] <= 1024]
    rng = random.Random(3)
    extra_lengths = [2, 3, 4, 5, 31, 63, 64, 65, 127, 128, 129, 191, 192, 193, 640, 959, 960, 1000]
    randoms = [bytes(rng.getrandbits(8) for _ in range(n)) for n in extra_lengths]
    datas = [_vector_input(c["input_len"]) for c in cases] + randoms
    msgs, lengths = _messages(datas)
    msgs[0, :] = 0xAB  # bytes past a message's length are never read
    got = _out_bytes(kb.blake3_bytes(msgs, lengths, key=key, tile=32))
    for c, g in zip(cases, got, strict=False):  # got also holds the randoms' digests, checked next
        assert g.hex() == c["keyed_hash"][:64], c["input_len"]
    for d, g in zip(randoms, got[len(cases):], strict=True):
        assert g == blake3.blake3(d, key=key).digest(), len(d)
    # The key as int64 lanes on the device gives the same.
    lanes = torch.tensor(struct.unpack("<4q", key), dtype=torch.int64, device=DEVICE)
    assert _out_bytes(kb.blake3_bytes(msgs[:2, :1], lengths[:2].clamp(max=1), key=lanes)) == got[:2]


def test_device_derive_key_vectors():
    """derive_key mode (what the chain kernel uses for its key: one block of
    key material) on the device; the one-block published cases (the
    multi-block paths are the keyed test's)."""
    cases = [c for c in VECTORS["cases"] if c["input_len"] <= 64]
    msgs, lengths = _messages([_vector_input(c["input_len"]) for c in cases])
    got = _out_bytes(kb.blake3_bytes(msgs, lengths, derive_key_context=VECTORS["context_string"]))
    assert [g.hex() for g in got] == [c["derive_key"][:64] for c in cases]


def test_device_hash_vectors_one_block():
    cases = [c for c in VECTORS["cases"] if c["input_len"] <= 64]
    msgs, lengths = _messages([_vector_input(c["input_len"]) for c in cases])
    got = _out_bytes(kb.blake3_bytes(msgs, lengths))
    assert [g.hex() for g in got] == [c["hash"][:64] for c in cases]
    # lengths=None: every message is the full width; an empty width works too.
    one = next(r for r, c in enumerate(cases) if c["input_len"] == 1)
    assert _out_bytes(kb.blake3_bytes(msgs[one:one + 1, :1])) == [got[one]]
    empty = next(r for r, c in enumerate(cases) if c["input_len"] == 0)
    assert _out_bytes(kb.blake3_bytes(msgs[:2, :0])) == [got[empty]] * 2


def test_blake3_bytes_argument_errors():
    msgs = torch.zeros((1, 4), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="at most 1024 bytes"):
        kb.blake3_bytes(torch.zeros((1, 1025), dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="32 bytes"):
        kb.blake3_bytes(msgs, key=b"short")
    with pytest.raises(ValueError, match="not both"):
        kb.blake3_bytes(msgs, key=bytes(32), derive_key_context="x")
    with pytest.raises(ValueError, match="messages must be torch.uint8"):
        kb.blake3_bytes(msgs.int())
    assert kb.blake3_bytes(torch.zeros((0, 3), dtype=torch.uint8, device=DEVICE)).shape == (0, 4)


# --------------------------------------------------------------------------
# Chained block digests: bit-identical to gpukv.core.hashing
# --------------------------------------------------------------------------


def signed(x: int) -> int:
    x &= M64
    return x - (1 << 64) if x >> 63 else x


def lanes_to_bytes(lo: int, hi: int) -> bytes:
    return struct.pack("<QQ", lo & M64, hi & M64)


def _rand_i64(rng, *shape):
    n = 1
    for s in shape:
        n *= s
    return torch.tensor([signed(rng.getrandbits(64)) for _ in range(n)], dtype=torch.int64).reshape(shape)


def _case(rng, R, max_blocks, bs):
    """Random tokens (ids >= 2**31 included, stored as negative int32),
    parents and extras; request 0 has no extra keys."""
    vals = [rng.choice([rng.getrandbits(32), rng.getrandbits(31), 0xFFFFFFFF, 1 << 31, rng.randrange(50000)])
            for _ in range(R * max_blocks * bs)]
    tokens = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in vals],
                          dtype=torch.int32).reshape(R, max_blocks * bs)
    parents = _rand_i64(rng, R, 2)
    extras = _rand_i64(rng, R, max_blocks, 2)
    extras[0] = 0
    return tokens, parents, extras


def _expected(key, tokens, parents, extras, counts, max_blocks, bs):
    """The host's chains (gpukv.core.hashing.hash_block_chain from each parent),
    as the kernel's int64[R, M, 2] output: zeros past each count."""
    R = tokens.shape[0]
    exp = torch.zeros((R, max_blocks, 2), dtype=torch.int64)
    for r in range(R):
        n = counts[r]
        if n == 0:
            continue
        ids = [t & M32 for t in tokens[r, : n * bs].tolist()]
        ext = None if extras is None else [lanes_to_bytes(*extras[r, b].tolist()) for b in range(n)]
        chain = host.hash_block_chain(key, ids, bs, extras=ext, parent=lanes_to_bytes(*parents[r].tolist()))
        for b, d in enumerate(chain):
            lo, hi = struct.unpack("<qq", d)
            exp[r, b, 0], exp[r, b, 1] = lo, hi
    return exp


def _run(key, tokens, parents, counts, extras=None, **kw):
    """The kernel's result; asserts the host twin gives the same."""
    nb = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    ext = None if extras is None else extras.to(DEVICE)
    args = (key, parents.to(DEVICE), tokens.to(DEVICE), nb, ext)
    out = kb.hash_block_chains(*args, **kw).cpu()
    assert torch.equal(kb.hash_block_chains_host(*args, **kw).cpu(), out)
    return out


@pytest.mark.parametrize("bs", [1, 3, 16, 17])
def test_chains_match_host(bs):
    """Five requests in one program of 8 lanes (3 masked off), 3 block
    positions: full, zero-count, partial chains; with and without extras."""
    rng = random.Random(1000 + bs)
    key = bytes(rng.getrandbits(8) for _ in range(16))
    R, M = 5, 3
    tokens, parents, extras = _case(rng, R, M, bs)
    counts = [3, 0, 1, 2, 3]
    out = _run(key, tokens, parents, counts, extras, tile=8)
    assert torch.equal(out, _expected(key, tokens, parents, extras, counts, M, bs))
    assert (out[1] == 0).all()
    if bs == 16:
        plain = _run(key, tokens, parents, counts, block_size=bs, tile=8)
        assert torch.equal(plain, _expected(key, tokens, parents, None, counts, M, bs))


@pytest.mark.parametrize("bs", [248, 249, 512])
def test_long_blocks_match_host(bs):
    """Blocks of one full chunk (248 tokens), one chunk + 1 token (folded in
    two segments) and 512 tokens (248 + 248 + 16), with and without extras,
    from random parents, next to a zero-count row. One block position: each
    costs 16 to 34 compressions under the interpreter; the segments of a
    block chain like blocks do, and test_chains_match_host chains blocks."""
    rng = random.Random(bs)
    key = bytes(rng.getrandbits(8) for _ in range(16))
    M = 1
    tokens, parents, extras = _case(rng, 3, M, bs)
    counts = [1, 0, 1]
    out = _run(key, tokens, parents, counts, extras, tile=4)
    assert torch.equal(out, _expected(key, tokens, parents, extras, counts, M, bs))


def test_chains_from_the_root_match_hash_block_chain():
    """The manager's use: parents = the root digest; the result is the host's
    hash_block_chain, block by block (block_digest from the root)."""
    rng = random.Random(77)
    key = bytes(rng.getrandbits(8) for _ in range(16))
    bs, R, M = 16, 2, 2
    tokens, _, extras = _case(rng, R, M, bs)
    root = host.root_digest(key)
    parents = torch.tensor([list(struct.unpack("<qq", root))] * R, dtype=torch.int64)
    out = _run(host.resolve_hash_key(key), tokens, parents, [2, 1], extras)
    for r, n in enumerate([2, 1]):
        ids = [t & M32 for t in tokens[r, : n * bs].tolist()]
        ext = [lanes_to_bytes(*extras[r, b].tolist()) for b in range(n)]
        got = [lanes_to_bytes(*out[r, b].tolist()) for b in range(n)]
        assert got == host.hash_block_chain(key, ids, bs, extras=ext)
        assert got[0] == host.block_digest(key, root, ids[:bs], ext[0])
        assert got[0] == py_H(key, root + ext[0] + struct.pack(f"<{bs}I", *ids[:bs]))


def test_key_forms():
    """16 bytes, (k0, k1) unsigned or signed ints, and the int64[2] tensor of
    key_lanes: the same digests; key lanes >= 2**63 included."""
    key = bytes([0xFF] * 8 + [0x80] + [0] * 7)
    k0, k1 = struct.unpack("<QQ", key)
    assert k0 >= 1 << 63 and k1 < 1 << 63
    tokens = torch.tensor([[-1], [2**31 - 1]], dtype=torch.int32)
    parents = torch.tensor([[-5, 7], [0, 0]], dtype=torch.int64)
    exp = _expected(key, tokens, parents, None, [1, 1], 1, 1)
    for form in (key, (k0, k1), (signed(k0), signed(k1)), kb.key_lanes(key, DEVICE)):
        assert torch.equal(_run(form, tokens, parents, [1, 1], block_size=1), exp)
    assert torch.equal(kb.key_lanes(key, DEVICE).cpu(), torch.tensor([signed(k0), signed(k1)]))


def test_programs_counts_clamped_and_out_overwritten():
    """Three programs of two lanes (the last one half masked); counts below 0
    and above the capacity are clamped; every position of out is written."""
    rng = random.Random(11)
    bs, R, M = 1, 5, 3
    tokens, parents, extras = _case(rng, R, M, bs)
    out = torch.full((R, M, 2), 123, dtype=torch.int64, device=DEVICE)
    nb = torch.tensor([-2, 99, 2, 0, 1], dtype=torch.int32, device=DEVICE)
    res = kb.hash_block_chains(bytes(range(16)), parents.to(DEVICE), tokens.to(DEVICE), nb,
                               extras.to(DEVICE), out=out, tile=2)
    assert res is out
    exp = _expected(bytes(range(16)), tokens, parents, extras, [0, 3, 2, 0, 1], M, bs)
    assert torch.equal(out.cpu(), exp)
    out.fill_(123)
    res = kb.hash_block_chains_host(bytes(range(16)), parents.to(DEVICE), tokens.to(DEVICE), nb,
                                    extras.to(DEVICE), out=out, tile=2)
    assert res is out and torch.equal(out.cpu(), exp)


def test_fewer_positions_than_token_columns():
    """The manager's call: tokens wider than max_blocks blocks (and a width
    that is no multiple of the block size); positions past max_blocks are
    neither hashed nor written."""
    rng = random.Random(13)
    bs, R = 3, 2
    tokens, parents, extras = _case(rng, R, 4, bs)
    tokens = torch.cat([tokens, tokens[:, :2]], dim=1)  # 14 columns
    out = _run(bytes(range(16)), tokens, parents, [4, 2], extras[:, :2].contiguous(),
               block_size=bs, max_blocks=2)
    assert out.shape == (R, 2, 2)
    assert torch.equal(out, _expected(bytes(range(16)), tokens, parents, extras, [2, 2], 2, bs))


def test_chain_is_prefix_consistent():
    """Hashing a prefix, then the rest from its last digest, gives the same chain."""
    rng = random.Random(9)
    bs, M = 3, 4
    tokens, parents, extras = _case(rng, 2, M, bs)
    key = bytes(range(16))
    full = _run(key, tokens, parents, [4, 4], extras)
    tail = _run(key, tokens[:, 2 * bs:].contiguous(), full[:, 1].contiguous(), [2, 2],
                extras[:, 2:].contiguous())
    assert torch.equal(tail, full[:, 2:])


def test_empty_batches():
    z = kb.hash_block_chains(bytes(16), torch.zeros((0, 2), dtype=torch.int64, device=DEVICE),
                             torch.zeros((0, 6), dtype=torch.int32, device=DEVICE),
                             torch.zeros((0,), dtype=torch.int32, device=DEVICE), block_size=3)
    assert z.shape == (0, 2, 2)
    z = kb.hash_block_chains(bytes(16), torch.zeros((2, 2), dtype=torch.int64, device=DEVICE),
                             torch.zeros((2, 2), dtype=torch.int32, device=DEVICE),
                             torch.zeros((2,), dtype=torch.int32, device=DEVICE), block_size=3)
    assert z.shape == (2, 0, 2)


@pytest.mark.parametrize("launcher", [kb.hash_block_chains, kb.hash_block_chains_host])
def test_validation_errors(launcher):
    key = bytes(16)
    p = torch.zeros((2, 2), dtype=torch.int64, device=DEVICE)
    t = torch.zeros((2, 6), dtype=torch.int32, device=DEVICE)
    nb = torch.zeros((2,), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="parents must be torch.int64"):
        launcher(key, p.int(), t, nb, block_size=3)
    with pytest.raises(ValueError, match="tokens must be torch.int32"):
        launcher(key, p, t.long(), nb, block_size=3)
    with pytest.raises(ValueError, match="num_blocks must have shape"):
        launcher(key, p, t, nb[:1], block_size=3)
    with pytest.raises(ValueError, match="extras must have shape"):
        launcher(key, p, t, nb, torch.zeros((2, 3, 3), dtype=torch.int64, device=DEVICE),
                             block_size=2)
    with pytest.raises(ValueError, match="block_size is needed"):
        launcher(key, p, t, nb)
    with pytest.raises(ValueError, match="pass block_size"):
        launcher(key, p, t, nb, torch.zeros((2, 4, 2), dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="16 bytes"):
        launcher(b"short", p, t, nb, block_size=3)
    with pytest.raises(ValueError, match="key tensor"):
        launcher(torch.zeros(3, dtype=torch.int64), p, t, nb, block_size=3)
    with pytest.raises(ValueError, match="tile"):
        launcher(key, p, t, nb, block_size=3, tile=3)


def test_errors_never_show_the_key():
    secret = bytes(range(0xC0, 0xCF))  # 15 bytes: rejected
    with pytest.raises(ValueError) as info:
        kb.key_lanes(secret, DEVICE)
    assert secret.hex() not in str(info.value) and repr(secret) not in str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_many_requests_match_host():
    """On a GPU: 300 requests over several programs, block size 16, random
    counts and extras; every digest equals the host's."""
    rng = random.Random(21)
    key = bytes(rng.getrandbits(8) for _ in range(16))
    R, M, bs = 300, 8, 16
    tokens, parents, extras = _case(rng, R, M, bs)
    counts = [rng.randrange(0, M + 1) for _ in range(R)]
    out = _run(key, tokens, parents, counts, extras)
    assert torch.equal(out, _expected(key, tokens, parents, extras, counts, M, bs))


# --------------------------------------------------------------------------
# hash_rows: blocks of request rows hashed in place (the manager's path)
# --------------------------------------------------------------------------


def test_hash_rows_kernel_and_host_twin_equal_the_host_scheme_in_place():
    """Rows continue their chains from the digest already in the row (the
    root for block 0), read tokens >= 2**31 as uint32, use each block's extra
    digest, and leave every other position untouched; padding entries
    (count 0, row -1) do nothing."""
    key, bs, R, M = bytes(range(16)), 4, 4, 5
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(-2**31, 2**31 - 1, (R, M * bs), dtype=torch.int32, generator=gen)
    extras = torch.randint(-2**62, 2**62, (R, M + 1, 2), dtype=torch.int64, generator=gen)
    extras[1] = 0  # a row without extra keys
    root = host.root_digest(key)
    root_lanes = struct.unpack("<qq", root)
    sentinel = torch.full((R, M + 1, 2), 12345, dtype=torch.int64)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    first = (torch.tensor([2], **i32), torch.tensor([0], **i32), torch.tensor([1], **i32))
    rest = (torch.tensor([0, 2, 1, -1], **i32), torch.tensor([0, 1, 0, 0], **i32), torch.tensor([3, 2, 0, 0], **i32))
    results = []
    for fn in (kb.hash_rows, kb.hash_rows_host):
        digests = sentinel.clone().to(DEVICE)
        kw = dict(tokens=tokens.to(DEVICE), digests=digests, extras=extras.to(DEVICE), root=root_lanes, block_size=bs)
        fn(kb.key_lanes(key, DEVICE), *first, **kw)  # row 2's block 0, then its blocks 1-2 chain from it
        fn(kb.key_lanes(key, DEVICE), *rest, **kw)
        results.append(digests.cpu())
    assert torch.equal(results[0], results[1])
    out = results[0]

    def expected(r, n):
        ids = [t & M32 for t in tokens[r, : n * bs].tolist()]
        ext = [lanes_to_bytes(*extras[r, b].tolist()) for b in range(n)]
        return host.hash_block_chain(key, ids, bs, extras=ext, parent=root)

    assert host.lanes_to_digests(out[0, :3].numpy()) == expected(0, 3)
    assert host.lanes_to_digests(out[2, :3].numpy()) == expected(2, 3)
    assert torch.equal(out[0, 3:], sentinel[0, 3:]) and torch.equal(out[2, 3:], sentinel[2, 3:])
    assert torch.equal(out[1], sentinel[1]) and torch.equal(out[3], sentinel[3])
