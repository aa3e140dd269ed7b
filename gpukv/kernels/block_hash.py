"""Keyed BLAKE3 block hashing (scheme v2) as Triton kernels, on 32-bit words.

The scheme (docs/design.md, "Hashing"; the host implementation in
``gpukv/core/hashing.py`` follows the same conventions bit for bit):

* Key: the 16-byte gpukv key, as two int64 lanes ``k0`` = bytes 0..7 LE and
  ``k1`` = bytes 8..15 LE (``key_lanes``). The BLAKE3 key is derived from it
  on the device, once per program: ``key32 = BLAKE3 derive_key(KEY_CONTEXT,
  key)``, i.e. one compression of the 16 key bytes chained from the context
  key (``CONTEXT_KEY``, the BLAKE3 hash of ``hashing.KEY_CONTEXT`` in
  derive-key-context mode, precomputed; a test recomputes it).
* H(m) = the first 16 bytes of BLAKE3 ``keyed_hash(key32, m)``; every message
  is at most one 1024-byte chunk (chunk counter 0), so H is at most 16
  compressions chained, with flags ``CHUNK_START`` on the first block,
  ``CHUNK_END | ROOT`` on the last, ``KEYED_HASH`` on all, and a partial last
  block zero-padded with its true ``block_len``. No tree hashing.
* Block digest = H(parent (16 bytes) || extra-key digest (16 bytes, zeros
  when none) || the block's token ids, each as a little-endian ``uint32``).
  A block of more than ``SEGMENT_TOKENS`` = 248 tokens (a 1024-byte message)
  is folded in segments of at most 248 tokens: ``s = parent; for each
  segment: s = H(s || extra || segment)``; the digest is the last ``s``.
* Digest: 16 bytes, as BLAKE3 output words ``w0..w3`` (little-endian), held
  as two 64-bit lanes ``lo = w0 | w1 << 32`` (bytes 0..7 LE) and ``hi = w2 |
  w3 << 32`` (bytes 8..15 LE). On the device a lane is an ``int64`` holding
  the two's-complement view of the ``uint64``; (0, 0) means "no digest".
* Token ids are stored as ``int32``; they are taken as ``uint32`` (ids >= 2**31
  appear as negative ``int32`` and hash as their unsigned value).

All arithmetic is on ``tl.uint32`` (additions wrap modulo 2**32, rotations
are two shifts): one 32-bit register per word on a GPU, no 64-bit emulation.
The seven rounds and the blocks of a message are loops, not unrolled, so a
kernel holds two copies of the round (key derivation and message
compression) and the real compiler builds it in about a second (unrolled,
its Coalesce pass, quadratic in the kernel's size, took minutes).
Results are deterministic: every lane's digest depends only on its own
inputs (no atomics, no cross-lane reduction other than the loop bound).

Device helpers (``@triton.jit``, usable from other kernels):

* ``rotr32(x, N)``, ``g(a, b, c, d, x, y)``, ``blake3_round(v0..v15,
  m0..m15)``, ``blake3_compress(h0..h7, m0..m15, block_len, flags)``: the
  BLAKE3 compression function (counter 0) on uint32 lanes, returning the 8
  chaining-value words.
* ``derive_block_key(k0, k1)``: the 8 BLAKE3 key words from the int64 key
  lanes (shape of ``k0``).
* ``segment_digest(K0..K7, p0..p3, e0..e3, tok_ptr, n_tok, mask)``: the first
  4 output words of H(p || e || tokens[0:n_tok]) for ``1 <= n_tok <= 248``
  tokens at ``tok_ptr`` (int32 pointers per lane).
* ``to_u64(x)`` / ``to_i64(x)``: bitcasts between the stored ``int64`` view
  and the ``uint64`` arithmetic view.
* ``parent_digest(digests_ptr, r, p, M, mask, root_lo, root_hi)``: the parent
  of block ``p`` of request row ``r`` (block ``p - 1``'s digest, else the
  root), the one place that rule is written (``blocks`` and ``lookup`` read
  it here too).

Host launchers (``hash_block_chains`` and ``blake3_bytes`` never
synchronise with the host; they only enqueue work):

* ``hash_block_chains(key, parents, tokens, num_blocks, extras=None,
  out=None)``: chained block digests of a batch of requests (one lane per
  request, a tile of requests per program, block positions walked in order
  because each digest is the next block's parent). Same signature and
  semantics as the SipHash kernel it replaces: ``out[r, b]`` for ``b <
  num_blocks[r]`` (clamped to ``[0, min(M, T // bs)]``) is the digest, every
  later position is (0, 0); lanes past ``R`` are masked and store nothing.
* ``hash_block_chains_host(...)``: the same signature and result computed on
  the host with ``gpukv.core.hashing`` (reads the tensors back; for runs under
  Triton's interpreter, where the kernel is slow).
* ``key_lanes(key, device)``: the 16-byte key as the ``int64[2]`` tensor the
  launcher takes.
* ``blake3_bytes(messages, lengths=None, *, key=None, derive_key_context=None)``:
  BLAKE3 (hash, keyed_hash or derive_key mode, 32-byte output) of byte
  strings of at most 1024 bytes; used to check the compression against the
  BLAKE3 team's test vectors.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpukv import _runtime  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

import torch
import triton
import triton.language as tl

from gpukv.kernels.toolkit import HASH_TILE, INT32, INT64, check_device, check_tensor, check_tile, num_warps

__all__ = [
    "rotr32",
    "g",
    "blake3_round",
    "blake3_compress",
    "derive_block_key",
    "segment_digest",
    "to_u64",
    "to_i64",
    "parent_digest",
    "hash_block_chains",
    "hash_block_chains_host",
    "hash_rows",
    "hash_rows_host",
    "key_lanes",
    "blake3_bytes",
    "DEFAULT_TILE",
    "SEGMENT_TOKENS",
    "CONTEXT_KEY",
    "MAX_MESSAGE",
]

KeyLike = torch.Tensor | bytes | bytearray | Sequence[int]

#: Requests (or messages) per program: one lane (one thread) each, power of two.
#: The chain is sequential per request, so a step's latency is one request's
#: longest chain; smaller tiles only spread requests over more SMs
#: (``toolkit.HASH_TILE``).
DEFAULT_TILE = HASH_TILE

#: Longest message hashed in one piece: one BLAKE3 chunk.
MAX_MESSAGE = 1024

_U64_MASK = (1 << 64) - 1

# Constants the kernels read are constexpr globals: the real compiler reads
# only constexpr globals in a kernel (the interpreter reads any).

#: Tokens per segment: 16 + 16 + 4 * 248 = 1024 bytes, one chunk.
SEGMENT_TOKENS: tl.constexpr = tl.constexpr(248)

# BLAKE3 IV (the SHA-256 IV).
_IV0: tl.constexpr = tl.constexpr(0x6A09E667)
_IV1: tl.constexpr = tl.constexpr(0xBB67AE85)
_IV2: tl.constexpr = tl.constexpr(0x3C6EF372)
_IV3: tl.constexpr = tl.constexpr(0xA54FF53A)
_IV4: tl.constexpr = tl.constexpr(0x510E527F)
_IV5: tl.constexpr = tl.constexpr(0x9B05688C)
_IV6: tl.constexpr = tl.constexpr(0x1F83D9AB)
_IV7: tl.constexpr = tl.constexpr(0x5BE0CD19)

# Domain flags.
CHUNK_START: tl.constexpr = tl.constexpr(1)
CHUNK_END: tl.constexpr = tl.constexpr(2)
ROOT: tl.constexpr = tl.constexpr(8)
KEYED_HASH: tl.constexpr = tl.constexpr(16)
DERIVE_KEY_CONTEXT: tl.constexpr = tl.constexpr(32)
DERIVE_KEY_MATERIAL: tl.constexpr = tl.constexpr(64)

#: The context key of ``gpukv.core.hashing.KEY_CONTEXT`` ("gpukv 2026-12-01 block
#: hash key v2"): BLAKE3 of the context string in derive-key-context mode, as
#: 8 little-endian words. Derive-key mode hashes the key material keyed with
#: it. tests/kernels/test_block_hash.py recomputes it.
CONTEXT_KEY = (0xBC1B9217, 0x22D0854F, 0x4D53BC51, 0x8A143C2C,
               0x64494011, 0x20814813, 0xC3896ECD, 0x462E20C5)
_CK0: tl.constexpr = tl.constexpr(CONTEXT_KEY[0])
_CK1: tl.constexpr = tl.constexpr(CONTEXT_KEY[1])
_CK2: tl.constexpr = tl.constexpr(CONTEXT_KEY[2])
_CK3: tl.constexpr = tl.constexpr(CONTEXT_KEY[3])
_CK4: tl.constexpr = tl.constexpr(CONTEXT_KEY[4])
_CK5: tl.constexpr = tl.constexpr(CONTEXT_KEY[5])
_CK6: tl.constexpr = tl.constexpr(CONTEXT_KEY[6])
_CK7: tl.constexpr = tl.constexpr(CONTEXT_KEY[7])


# --------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------


@triton.jit
def to_u64(x):
    """Bitcast an int64 lane (stored view) to uint64 (arithmetic view)."""
    return x.to(tl.uint64, bitcast=True)


@triton.jit
def to_i64(x):
    """Bitcast a uint64 lane (arithmetic view) to int64 (stored view)."""
    return x.to(tl.int64, bitcast=True)


@triton.jit
def parent_digest(digests_ptr, r, p, M, mask, root_lo, root_hi):
    """The parent digest of block ``p`` of request row ``r`` (int64 lanes;
    ``digests`` int64[R, M, 2]) as its (lo, hi) int64 lanes: the digest of
    block ``p - 1`` of the row, else the root for block 0. Lanes off ``mask``
    load nothing (and get the root). The chain's one parent rule: the hash
    (``_hash_rows_kernel``), the inputs a cached block keeps
    (``blocks.record``) and the verify that compares them (``lookup``) must
    all read the same parent, so they all read it here."""
    has_parent = mask & (p > 0)
    prev = (r * M + p - 1) * 2
    lo = tl.where(has_parent, tl.load(digests_ptr + prev, mask=has_parent, other=0), root_lo)
    hi = tl.where(has_parent, tl.load(digests_ptr + prev + 1, mask=has_parent, other=0), root_hi)
    return lo, hi


@triton.jit
def rotr32(x, N: tl.constexpr):
    """Rotate the uint32 ``x`` right by the constant ``N`` (0 < N < 32)."""
    return (x >> N) | (x << (32 - N))


@triton.jit
def g(a, b, c, d, x, y):
    """BLAKE3's quarter-round G on uint32 lanes; returns the new (a, b, c, d)."""
    # Rotations written out (rotr32 inline): under the interpreter every
    # nested jit call costs more than the arithmetic.
    a = a + b + x
    d = d ^ a
    d = (d >> 16) | (d << 16)
    c = c + d
    b = b ^ c
    b = (b >> 12) | (b << 20)
    a = a + b + y
    d = d ^ a
    d = (d >> 8) | (d << 24)
    c = c + d
    b = b ^ c
    b = (b >> 7) | (b << 25)
    return a, b, c, d


@triton.jit
def blake3_round(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
                 m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15):
    """One round: G on the columns, then on the diagonals; returns v0..v15."""
    v0, v4, v8, v12 = g(v0, v4, v8, v12, m0, m1)
    v1, v5, v9, v13 = g(v1, v5, v9, v13, m2, m3)
    v2, v6, v10, v14 = g(v2, v6, v10, v14, m4, m5)
    v3, v7, v11, v15 = g(v3, v7, v11, v15, m6, m7)
    v0, v5, v10, v15 = g(v0, v5, v10, v15, m8, m9)
    v1, v6, v11, v12 = g(v1, v6, v11, v12, m10, m11)
    v2, v7, v8, v13 = g(v2, v7, v8, v13, m12, m13)
    v3, v4, v9, v14 = g(v3, v4, v9, v14, m14, m15)
    return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15


@triton.jit
def blake3_compress(h0, h1, h2, h3, h4, h5, h6, h7,
                    m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
                    block_len, flags):
    """BLAKE3 compression with block counter 0; returns the 8 chaining-value
    words (``v[i] ^ v[i + 8]``), which for a ROOT block are the first 32
    output bytes. ``h*`` and ``m*`` are uint32 lanes of one shape;
    ``block_len`` and ``flags`` are ints or int32/uint32 lanes."""
    zero = tl.zeros_like(h0)
    v0, v1, v2, v3, v4, v5, v6, v7 = h0, h1, h2, h3, h4, h5, h6, h7
    v8 = zero + _IV0
    v9 = zero + _IV1
    v10 = zero + _IV2
    v11 = zero + _IV3
    v12 = zero  # counter, low word
    v13 = zero  # counter, high word
    v14 = zero + block_len
    v15 = zero + flags
    # A loop, not unrolled: the real compiler's Coalesce pass takes time
    # quadratic in a kernel's size, and seven copies of the round made a
    # chain kernel take minutes to build. The permutation is a register rename.
    for _round in range(7):
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = blake3_round(
            v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
            m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15)
        # BLAKE3's message permutation (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8).
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = (
            m2, m6, m3, m10, m7, m0, m4, m13, m1, m11, m12, m5, m9, m14, m15, m8)
    return v0 ^ v8, v1 ^ v9, v2 ^ v10, v3 ^ v11, v4 ^ v12, v5 ^ v13, v6 ^ v14, v7 ^ v15


@triton.jit
def _lo32(x):
    """Low 32 bits of a uint64 lane, as uint32."""
    return (x & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def _hi32(x):
    """High 32 bits of a uint64 lane, as uint32."""
    return (x >> 32).to(tl.uint32)


@triton.jit
def _pack64(lo, hi):
    """Two uint32 words -> the int64 lane ``lo | hi << 32``."""
    return to_i64(lo.to(tl.uint64) | (hi.to(tl.uint64) << 32))


@triton.jit
def derive_block_key(k0, k1):
    """The BLAKE3 key ``derive_key(KEY_CONTEXT, key)`` from the int64 key
    lanes (bytes 0..7 and 8..15 LE): one compression of the 16 key bytes
    chained from the constant context key. Returns 8 uint32 words."""
    u0 = to_u64(k0)
    u1 = to_u64(k1)
    w0 = _lo32(u0)
    zero = tl.zeros_like(w0)
    return blake3_compress(
        zero + _CK0, zero + _CK1, zero + _CK2, zero + _CK3,
        zero + _CK4, zero + _CK5, zero + _CK6, zero + _CK7,
        w0, _hi32(u0), _lo32(u1), _hi32(u1), zero, zero, zero, zero,
        zero, zero, zero, zero, zero, zero, zero, zero,
        16, CHUNK_START | CHUNK_END | ROOT | DERIVE_KEY_MATERIAL)


@triton.jit
def _tok_at(ptr, idx, lo, lim):
    """Token ``idx`` at ``ptr`` as uint32 where ``lo <= idx < lim``, else 0.

    ``lo`` (zeros) and ``lim`` are int32 lanes, so both tests are lane
    tensors whatever ``idx`` is (the interpreter mis-types a Python bool
    combined with a mask)."""
    ok = (idx >= lo) & (idx < lim)
    return tl.load(ptr + idx, mask=ok, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def segment_digest(K0, K1, K2, K3, K4, K5, K6, K7, p0, p1, p2, p3, e0, e1, e2, e3,
                   tok_ptr, n_tok, mask):
    """The first 4 output words of H(p || e || tokens[0:n_tok]) per lane.

    ``K*`` are the BLAKE3 key words, ``p*``/``e*`` the parent and extra
    digests as uint32 words (LE), ``tok_ptr`` int32 pointers to the tokens
    (``1 <= n_tok <= 248`` of them, contiguous; an int or a scalar), ``mask``
    the lanes to load (other lanes hash zeros; the caller discards their
    result).

    The message is ``W = 8 + n_tok`` words in ``ceil(W / 16)`` blocks: block
    ``j`` holds message words ``16j .. 16j + 15``, i.e. tokens ``16j - 8 ..
    16j + 7``, with p and e in place of the (negative) first eight of block 0;
    the last block is zero-padded and its ``block_len`` is its true length.
    One loop over the blocks, with its flags computed per block, so the
    compression is inlined once (the real compiler's time grows fast with
    the size of a kernel).
    """
    n_words = n_tok + 8
    n_blk = (n_words + 15) // 16
    lo = tl.zeros(p0.shape, dtype=tl.int32)
    lim = tl.where(mask, n_tok, 0)  # tokens a lane may load: none where masked off
    h0, h1, h2, h3, h4, h5, h6, h7 = K0, K1, K2, K3, K4, K5, K6, K7
    for j in range(0, n_blk):
        t = 16 * j - 8  # token index of message word 16j
        m0 = _tok_at(tok_ptr, t, lo, lim)
        m1 = _tok_at(tok_ptr, t + 1, lo, lim)
        m2 = _tok_at(tok_ptr, t + 2, lo, lim)
        m3 = _tok_at(tok_ptr, t + 3, lo, lim)
        m4 = _tok_at(tok_ptr, t + 4, lo, lim)
        m5 = _tok_at(tok_ptr, t + 5, lo, lim)
        m6 = _tok_at(tok_ptr, t + 6, lo, lim)
        m7 = _tok_at(tok_ptr, t + 7, lo, lim)
        m8 = _tok_at(tok_ptr, t + 8, lo, lim)
        m9 = _tok_at(tok_ptr, t + 9, lo, lim)
        m10 = _tok_at(tok_ptr, t + 10, lo, lim)
        m11 = _tok_at(tok_ptr, t + 11, lo, lim)
        m12 = _tok_at(tok_ptr, t + 12, lo, lim)
        m13 = _tok_at(tok_ptr, t + 13, lo, lim)
        m14 = _tok_at(tok_ptr, t + 14, lo, lim)
        m15 = _tok_at(tok_ptr, t + 15, lo, lim)
        first = j == 0
        m0 = tl.where(first, p0, m0)
        m1 = tl.where(first, p1, m1)
        m2 = tl.where(first, p2, m2)
        m3 = tl.where(first, p3, m3)
        m4 = tl.where(first, e0, m4)
        m5 = tl.where(first, e1, m5)
        m6 = tl.where(first, e2, m6)
        m7 = tl.where(first, e3, m7)
        block_len = tl.minimum(4 * n_words - 64 * j, 64)
        flags = (KEYED_HASH | tl.where(first, CHUNK_START, 0)
                 | tl.where(j == n_blk - 1, CHUNK_END | ROOT, 0))
        h0, h1, h2, h3, h4, h5, h6, h7 = blake3_compress(
            h0, h1, h2, h3, h4, h5, h6, h7,
            m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
            block_len, flags)
    return h0, h1, h2, h3


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------


@triton.jit
def _block_digest(K0, K1, K2, K3, K4, K5, K6, K7, p0, p1, p2, p3, e0, e1, e2, e3, blk, active,
                  BLOCK_SIZE: tl.constexpr):
    """The chained digest (four 32-bit words per lane) of the BLOCK_SIZE
    tokens at ``blk``, from the parent digest ``p`` and extra digest ``e``:
    NSEG - 1 full segments of SEGMENT_TOKENS, then the LAST tokens."""
    NSEG: tl.constexpr = (BLOCK_SIZE + SEGMENT_TOKENS - 1) // SEGMENT_TOKENS
    LAST: tl.constexpr = BLOCK_SIZE - (NSEG - 1) * SEGMENT_TOKENS
    s0, s1, s2, s3 = p0, p1, p2, p3
    for s in range(0, NSEG):
        n_tok = tl.where(s == NSEG - 1, LAST, SEGMENT_TOKENS)
        s0, s1, s2, s3 = segment_digest(
            K0, K1, K2, K3, K4, K5, K6, K7, s0, s1, s2, s3, e0, e1, e2, e3,
            blk + s * SEGMENT_TOKENS, n_tok, active)
    return s0, s1, s2, s3


@triton.jit
def _extra_words(ext_ptr, s_ec, active, zero, HAS_EXTRAS: tl.constexpr):
    """A block's extra-key digest as four 32-bit words per lane (lanes
    ``lo``, ``hi`` at ``ext_ptr`` and ``ext_ptr + s_ec``); zeros without
    ``HAS_EXTRAS``."""
    if HAS_EXTRAS:
        e_lo = to_u64(tl.load(ext_ptr, mask=active, other=0))
        e_hi = to_u64(tl.load(ext_ptr + s_ec, mask=active, other=0))
        e0 = _lo32(e_lo)
        e1 = _hi32(e_lo)
        e2 = _lo32(e_hi)
        e3 = _hi32(e_hi)
    else:
        e0 = zero
        e1 = zero
        e2 = zero
        e3 = zero
    return e0, e1, e2, e3


@triton.jit(do_not_specialize=["R", "max_blocks", "block_cap", "s_tr", "s_er", "s_or"])
def _hash_block_chains_kernel(
    key_ptr,                   # int64[2]: the gpukv key lanes (k0, k1)
    parents_ptr,               # int64[R, 2] each request's parent digest (lo, hi), strides (s_pr, s_pc)
    tokens_ptr,                # int32[R, T] each request's tokens, row stride s_tr (contiguous rows)
    num_blocks_ptr,            # int32[R] leading full blocks to hash per request (clamped to [0, block_cap])
    extras_ptr,                # int64[R, M, 2] extra-key digests, strides (s_er, s_eb, s_ec) (HAS_EXTRAS)
    out_ptr,                   # int64[R, M, 2] out: the digests, then (0, 0), strides (s_or, s_ob, s_oc)
    R,                         # requests
    max_blocks,                # M: block positions per request in out (and extras)
    block_cap,                 # min(M, T // BLOCK_SIZE): the most blocks a request can hash
    s_pr, s_pc,                # parents' strides
    s_tr,                      # tokens' row stride
    s_er, s_eb, s_ec,          # extras' strides
    s_or, s_ob, s_oc,          # out's strides
    BLOCK_SIZE: tl.constexpr,  # tokens per block
    HAS_EXTRAS: tl.constexpr,  # whether extras_ptr is read (else zero extra digests)
    TILE: tl.constexpr,        # requests per program, one lane each (a power of two)
):
    """The chained digests of the leading ``num_blocks[r]`` full blocks of
    each request, one lane per request (deterministic: no lane reads
    another's output); positions past them get (0, 0)."""
    pid = tl.program_id(0)
    rows = pid * TILE + tl.arange(0, TILE)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    zero_i = tl.zeros([TILE], dtype=tl.int64)
    K0, K1, K2, K3, K4, K5, K6, K7 = derive_block_key(
        tl.load(key_ptr) + zero_i, tl.load(key_ptr + 1) + zero_i)
    nb = tl.load(num_blocks_ptr + rows, mask=rmask, other=0)
    nb = tl.minimum(tl.maximum(nb, 0), block_cap)
    p_lo = to_u64(tl.load(parents_ptr + r64 * s_pr, mask=rmask, other=0))
    p_hi = to_u64(tl.load(parents_ptr + r64 * s_pr + s_pc, mask=rmask, other=0))
    p0, p1, p2, p3 = _lo32(p_lo), _hi32(p_lo), _lo32(p_hi), _hi32(p_hi)
    zero = tl.zeros_like(p0)
    tok_row = tokens_ptr + r64 * s_tr
    ext_row = extras_ptr + r64 * s_er
    out_row = out_ptr + r64 * s_or
    n_hash = tl.max(nb, axis=0)
    for b in range(0, n_hash):
        active = rmask & (b < nb)
        e0, e1, e2, e3 = _extra_words(ext_row + b * s_eb, s_ec, active, zero, HAS_EXTRAS)
        s0, s1, s2, s3 = _block_digest(K0, K1, K2, K3, K4, K5, K6, K7, p0, p1, p2, p3, e0, e1, e2, e3,
                                       tok_row + b * BLOCK_SIZE, active, BLOCK_SIZE)
        s0 = tl.where(active, s0, zero)
        s1 = tl.where(active, s1, zero)
        s2 = tl.where(active, s2, zero)
        s3 = tl.where(active, s3, zero)
        tl.store(out_row + b * s_ob, _pack64(s0, s1), mask=rmask)
        tl.store(out_row + b * s_ob + s_oc, _pack64(s2, s3), mask=rmask)
        p0 = tl.where(active, s0, p0)
        p1 = tl.where(active, s1, p1)
        p2 = tl.where(active, s2, p2)
        p3 = tl.where(active, s3, p3)
    for b in range(n_hash, max_blocks):
        tl.store(out_row + b * s_ob, zero_i, mask=rmask)
        tl.store(out_row + b * s_ob + s_oc, zero_i, mask=rmask)


@triton.jit(do_not_specialize=["E", "T", "M", "root_lo", "root_hi"])
def _hash_rows_kernel(
    key_ptr,        # int64[2]: the gpukv key lanes (k0, k1)
    row_ptr,        # int32[E]: entry i hashes request row row[i]
    start_ptr,      # int32[E]: ... from block start[i] (its parent: block start - 1, or the root)
    count_ptr,      # int32[E]: ... this many blocks (0: the entry is padding)
    tokens_ptr,     # int32[R, T] request rows' tokens
    digests_ptr,    # int64[R, M, 2] request rows' digests (read: parents; written: the result)
    extras_ptr,     # int64[R, M, 2] request rows' extra-key digests
    E,              # entries
    T,              # tokens per request row
    M,              # block positions per request row (of digests and extras)
    root_lo: tl.int64, root_hi: tl.int64,  # the root digest lanes (block 0's parent)
    BLOCK_SIZE: tl.constexpr,  # tokens per block
    TILE: tl.constexpr,        # entries per program, one lane each (a power of two)
):
    """The chained digests of blocks ``[start, start + count)`` of each
    entry's row, read from and written to the request rows in place (one
    lane per entry; entries are distinct rows)."""
    lanes = tl.program_id(0) * TILE + tl.arange(0, TILE)
    emask = lanes < E
    zero_i = tl.zeros([TILE], dtype=tl.int64)
    K0, K1, K2, K3, K4, K5, K6, K7 = derive_block_key(
        tl.load(key_ptr) + zero_i, tl.load(key_ptr + 1) + zero_i)
    r = tl.load(row_ptr + lanes, mask=emask, other=0).to(tl.int64)
    st = tl.load(start_ptr + lanes, mask=emask, other=0).to(tl.int64)
    nb = tl.load(count_ptr + lanes, mask=emask, other=0)
    nb = tl.where(emask & (r >= 0) & (st >= 0), tl.maximum(nb, 0), 0)
    r = tl.where(nb > 0, r, 0)
    p_lo, p_hi = parent_digest(digests_ptr, r, st, M, nb > 0, root_lo, root_hi)
    p_lo = to_u64(p_lo)
    p_hi = to_u64(p_hi)
    p0 = _lo32(p_lo)
    p1 = _hi32(p_lo)
    p2 = _lo32(p_hi)
    p3 = _hi32(p_hi)
    NSEG: tl.constexpr = (BLOCK_SIZE + SEGMENT_TOKENS - 1) // SEGMENT_TOKENS
    LAST: tl.constexpr = BLOCK_SIZE - (NSEG - 1) * SEGMENT_TOKENS
    n_hash = tl.max(nb, axis=0)
    for b in range(0, n_hash):
        active = b < nb
        at = (r * M + st + b) * 2
        e_lo = to_u64(tl.load(extras_ptr + at, mask=active, other=0))
        e_hi = to_u64(tl.load(extras_ptr + at + 1, mask=active, other=0))
        blk = tokens_ptr + r * T + (st + b) * BLOCK_SIZE
        s0, s1, s2, s3 = p0, p1, p2, p3
        for s in range(0, NSEG):
            n_tok = tl.where(s == NSEG - 1, LAST, SEGMENT_TOKENS)
            s0, s1, s2, s3 = segment_digest(
                K0, K1, K2, K3, K4, K5, K6, K7, s0, s1, s2, s3,
                _lo32(e_lo), _hi32(e_lo), _lo32(e_hi), _hi32(e_hi),
                blk + s * SEGMENT_TOKENS, n_tok, active)
        tl.store(digests_ptr + at, _pack64(s0, s1), mask=active)
        tl.store(digests_ptr + at + 1, _pack64(s2, s3), mask=active)
        p0 = tl.where(active, s0, p0)
        p1 = tl.where(active, s1, p1)
        p2 = tl.where(active, s2, p2)
        p3 = tl.where(active, s3, p3)


@triton.jit
def _msg_word(row_ptr, w, length, lo):
    """Message word ``w`` (bytes ``4w .. 4w + 3``, little-endian) of a row of
    int32 words, with the bytes at or past ``length`` zeroed."""
    keep = tl.minimum(tl.maximum(length - 4 * w, 0), 4)  # bytes of this word in the message
    x = tl.load(row_ptr + w, mask=keep > lo, other=0).to(tl.uint32, bitcast=True)
    bits = (8 * keep).to(tl.uint32)
    part = (tl.full(keep.shape, 1, tl.uint32) << (bits & 31)) - 1  # shift < 32: defined
    return tl.where(keep >= 4, x, x & part)


@triton.jit
def _key_words(key_ptr, zero_i):
    """The 32-byte key (int64[4] LE lanes at ``key_ptr``) as eight 32-bit
    words in every lane of ``zero_i``'s shape."""
    k0 = to_u64(tl.load(key_ptr) + zero_i)
    k1 = to_u64(tl.load(key_ptr + 1) + zero_i)
    k2 = to_u64(tl.load(key_ptr + 2) + zero_i)
    k3 = to_u64(tl.load(key_ptr + 3) + zero_i)
    return _lo32(k0), _hi32(k0), _lo32(k1), _hi32(k1), _lo32(k2), _hi32(k2), _lo32(k3), _hi32(k3)


@triton.jit
def _msg_block(row_ptr, w, length, lo):
    """The 16 message words ``w .. w + 15`` of a 64-byte block (``_msg_word``)."""
    return (_msg_word(row_ptr, w, length, lo), _msg_word(row_ptr, w + 1, length, lo),
            _msg_word(row_ptr, w + 2, length, lo), _msg_word(row_ptr, w + 3, length, lo),
            _msg_word(row_ptr, w + 4, length, lo), _msg_word(row_ptr, w + 5, length, lo),
            _msg_word(row_ptr, w + 6, length, lo), _msg_word(row_ptr, w + 7, length, lo),
            _msg_word(row_ptr, w + 8, length, lo), _msg_word(row_ptr, w + 9, length, lo),
            _msg_word(row_ptr, w + 10, length, lo), _msg_word(row_ptr, w + 11, length, lo),
            _msg_word(row_ptr, w + 12, length, lo), _msg_word(row_ptr, w + 13, length, lo),
            _msg_word(row_ptr, w + 14, length, lo), _msg_word(row_ptr, w + 15, length, lo))


@triton.jit
def _where8(live, n0, n1, n2, n3, n4, n5, n6, n7, h0, h1, h2, h3, h4, h5, h6, h7):
    """A chaining value of eight words per lane: ``n`` where ``live``, else ``h``."""
    return (tl.where(live, n0, h0), tl.where(live, n1, h1), tl.where(live, n2, h2), tl.where(live, n3, h3),
            tl.where(live, n4, h4), tl.where(live, n5, h5), tl.where(live, n6, h6), tl.where(live, n7, h7))


@triton.jit(do_not_specialize=["n", "lmax", "n_chunk_blocks"])
def _blake3_bytes_kernel(
    key_ptr,              # int64[4] the 32-byte key as LE lanes (the IV for the unkeyed modes)
    msg_ptr,              # int32[n, *] the messages as little-endian words, s_mr words per row
    len_ptr,              # int32[n] each message's length in bytes (clamped to [0, lmax])
    out_ptr,              # int64[n, 4] out: the first 32 output bytes as LE lanes, row stride s_or
    n,                    # messages
    lmax,                 # the longest message's bytes (<= 1024)
    n_chunk_blocks,       # 64-byte blocks walked: max(1, ceil(lmax / 64))
    s_mr,                 # msg's row stride (words)
    s_or,                 # out's row stride
    MODE: tl.constexpr,   # 0 (hash), KEYED_HASH, DERIVE_KEY_CONTEXT or DERIVE_KEY_MATERIAL
    TILE: tl.constexpr,   # messages per program, one lane each (a power of two)
):
    """BLAKE3 of ``n`` byte strings of at most 1024 bytes, one lane each.

    Message ``i`` is the first ``len[i]`` bytes of row ``i`` of ``msg``, an
    int32 array of little-endian words (``s_mr`` words per row); ``key_ptr``
    holds the 32-byte key as int64[4] lanes (the IV for the unkeyed modes);
    ``MODE`` is the mode flag (0 hash, KEYED_HASH, DERIVE_KEY_CONTEXT,
    DERIVE_KEY_MATERIAL). ``n_chunk_blocks`` 64-byte blocks are walked; a
    lane compresses its own ``max(1, ceil(len / 64))`` and keeps its
    chaining value after that. Output: ``out[i, 0..3]`` = the first 32
    output bytes as int64 LE lanes.
    """
    pid = tl.program_id(0)
    rows = pid * TILE + tl.arange(0, TILE)
    rmask = rows < n
    r64 = rows.to(tl.int64)
    h0, h1, h2, h3, h4, h5, h6, h7 = _key_words(key_ptr, tl.zeros([TILE], dtype=tl.int64))
    length = tl.load(len_ptr + rows, mask=rmask, other=0)
    length = tl.where(rmask, tl.minimum(tl.maximum(length, 0), lmax), 0)
    last = tl.maximum((length + 63) // 64, 1) - 1  # index of the lane's last block
    lo = tl.zeros([TILE], dtype=tl.int32)
    row_ptr = msg_ptr + r64 * s_mr
    for blk in range(0, n_chunk_blocks):
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = _msg_block(row_ptr, blk * 16,
                                                                                        length, lo)
        block_len = tl.minimum(tl.maximum(length - 64 * blk, 0), 64)
        flags = (tl.where(blk == 0, CHUNK_START, 0) | tl.where(blk == last, CHUNK_END | ROOT, 0)
                 | MODE)
        n0, n1, n2, n3, n4, n5, n6, n7 = blake3_compress(
            h0, h1, h2, h3, h4, h5, h6, h7,
            m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
            block_len, flags)
        h0, h1, h2, h3, h4, h5, h6, h7 = _where8(blk <= last, n0, n1, n2, n3, n4, n5, n6, n7,
                                                 h0, h1, h2, h3, h4, h5, h6, h7)
    out_row = out_ptr + r64 * s_or
    tl.store(out_row, _pack64(h0, h1), mask=rmask)
    tl.store(out_row + 1, _pack64(h2, h3), mask=rmask)
    tl.store(out_row + 2, _pack64(h4, h5), mask=rmask)
    tl.store(out_row + 3, _pack64(h6, h7), mask=rmask)


# --------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------


def _signed64(x: int) -> int:
    x &= _U64_MASK
    return x - (1 << 64) if x >= (1 << 63) else x


def key_lanes(key: KeyLike, device: torch.device | str) -> torch.Tensor:
    """The key as an ``int64[2]`` tensor ``(k0, k1)`` on ``device``.

    ``key`` is 16 bytes, a pair of ints (each an unsigned 64-bit value or its
    signed int64 view), or an ``int64`` tensor of shape ``[2]`` already on
    ``device`` (returned as is, made contiguous). Errors never show the key.
    """
    device = torch.device(device)
    if isinstance(key, torch.Tensor):  # (the checks' messages name dtypes, shapes and devices, never values)
        return check_tensor(key, "key tensor", dtypes=INT64, shape=(2,), device=device).contiguous()
    if isinstance(key, (bytes, bytearray)):
        if len(key) != 16:
            raise ValueError(f"key must be 16 bytes; got {len(key)}")
        lanes: tuple[int, ...] = (int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little"))
    else:
        lanes = tuple(key)
        if len(lanes) != 2 or not all(isinstance(k, int) for k in lanes):
            raise ValueError("key must be 16 bytes, (k0, k1) ints or an int64[2] tensor")
        for k in lanes:
            if not -(1 << 63) <= k < (1 << 64):
                raise ValueError("key lanes must fit in 64 bits")
    return torch.tensor([_signed64(k) for k in lanes], dtype=torch.int64, device=device)


def _chain_args(parents, tokens, num_blocks, extras, out, block_size, max_blocks, tile,
                kernel=True):
    """Check ``hash_block_chains``'s arguments; return ``(R, T, block_size,
    max_blocks, out)`` with ``out`` allocated when None. ``kernel``: the
    tensors must be where a Triton kernel can run."""
    if not isinstance(parents, torch.Tensor):
        raise TypeError("parents must be a torch.Tensor")
    device = parents.device
    if kernel:
        check_device(device)
    check_tensor(parents, "parents", dtypes=INT64, shape=(None, 2), device=device)
    R = parents.shape[0]
    check_tensor(tokens, "tokens", dtypes=INT32, shape=(R, None), device=device)
    check_tensor(num_blocks, "num_blocks", dtypes=INT32, shape=(R,), device=device)
    T = tokens.shape[1]

    if max_blocks is None:
        for t in (extras, out):
            if t is not None and isinstance(t, torch.Tensor) and t.dim() == 3:
                max_blocks = t.shape[1]
                break
    if block_size is None:
        if max_blocks is None or max_blocks == 0:
            raise ValueError("block_size is needed when neither extras nor out give the "
                             "number of blocks per request")
        if T % max_blocks:
            raise ValueError(f"tokens have {T} columns, not a multiple of {max_blocks} "
                             "blocks: pass block_size")
        block_size = T // max_blocks
    block_size = int(block_size)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size} "
                         f"(tokens have {T} columns for {max_blocks} blocks)")
    if max_blocks is None:
        max_blocks = T // block_size
    max_blocks = int(max_blocks)
    if max_blocks < 0:
        raise ValueError("max_blocks must be >= 0")
    if extras is not None:
        check_tensor(extras, "extras", dtypes=INT64, shape=(R, max_blocks, 2), device=device)
    if out is None:
        out = torch.empty((R, max_blocks, 2), dtype=torch.int64, device=device)
    else:
        check_tensor(out, "out", dtypes=INT64, shape=(R, max_blocks, 2), device=device)
    check_tile(tile)
    return R, T, block_size, max_blocks, out


def hash_block_chains(
    key: KeyLike,
    parents: torch.Tensor,
    tokens: torch.Tensor,
    num_blocks: torch.Tensor,
    extras: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    block_size: int | None = None,
    max_blocks: int | None = None,
    tile: int = DEFAULT_TILE,
) -> torch.Tensor:
    """Chained block digests of ``R`` requests; returns ``out`` int64[R, M, 2].

    Layout (``R`` requests, ``M`` = max blocks per request, ``bs`` = block size):
      key         the 16-byte gpukv key: bytes, (k0, k1) ints, or the int64[2]
                  tensor ``key_lanes`` gives, on the device. The BLAKE3 key is
                  derived from it on the device (no host work per call).
      parents     int64[R, 2]: digest (lo, hi) that request r's first hashed
                  block chains from (the root digest, or the digest of the
                  last block already hashed).
      tokens      int32[R, T]: request r's block b is ``tokens[r, b*bs:(b+1)*bs]``;
                  ids >= 2**31 are stored as negative int32 and hashed as uint32.
                  Rows must be contiguous (``tokens.stride(1) == 1``).
      num_blocks  int32[R]: how many leading full blocks of request r to hash.
                  Clamped on the device to ``[0, min(M, T // bs)]`` (no host
                  sync is spent checking it).
      extras      int64[R, M, 2] extra-key digests per block, or None (zeros).
      out         optional int64[R, M, 2] to write into; allocated when None.
    ``block_size`` defaults to ``T // M`` when extras or out give ``M`` and
    ``T`` is a multiple of it, and must be given otherwise; ``M`` defaults to
    ``extras``/``out``'s dim 1, else ``T // block_size``. Any block size >= 1
    works; over 248 tokens a block is folded in segments (module docstring).

    Result: ``out[r, b]`` = digest of request r's block b for ``b <
    num_blocks[r]`` (block 0 chained from ``parents[r]``, block b from block
    b-1), and (0, 0) for every later position. Fully written; no host sync.
    """
    R, T, block_size, max_blocks, out = _chain_args(
        parents, tokens, num_blocks, extras, out, block_size, max_blocks, tile)
    if R == 0 or max_blocks == 0:
        return out

    k = key_lanes(key, parents.device)
    if tokens.stride(1) != 1:
        tokens = tokens.contiguous()
    num_blocks = num_blocks.contiguous()
    ext = extras if extras is not None else out  # placeholder pointer, never read
    grid = (triton.cdiv(R, tile),)
    _hash_block_chains_kernel[grid](
        k, parents, tokens, num_blocks, ext, out,
        R, max_blocks, min(max_blocks, T // block_size),
        parents.stride(0), parents.stride(1), tokens.stride(0),
        ext.stride(0), ext.stride(1), ext.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_SIZE=block_size, HAS_EXTRAS=extras is not None, TILE=tile,
        num_warps=num_warps(tile),
    )
    return out


def hash_block_chains_host(
    key: KeyLike,
    parents: torch.Tensor,
    tokens: torch.Tensor,
    num_blocks: torch.Tensor,
    extras: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    block_size: int | None = None,
    max_blocks: int | None = None,
    tile: int = DEFAULT_TILE,
) -> torch.Tensor:
    """``hash_block_chains`` computed on the host with ``gpukv.core.hashing`` (the
    ``blake3`` package): the same signature, checks and result, on tensors of
    any device; it reads them to the host (a sync on a GPU). For runs under
    Triton's interpreter, where the kernel costs about 0.3 s per BLAKE3
    compression (a 16-token block is 2, a 256-token block 17) and this
    costs about a microsecond per block; ``tile`` is checked and unused.
    tests/kernels/test_block_hash.py holds the two equal.
    """
    from gpukv.core import hashing  # the host scheme (imports blake3)

    R, T, block_size, max_blocks, out = _chain_args(
        parents, tokens, num_blocks, extras, out, block_size, max_blocks, tile, kernel=False)
    if R == 0 or max_blocks == 0:
        return out
    if isinstance(key, torch.Tensor):
        lanes = key_lanes(key, key.device).tolist()
    else:
        lanes = key_lanes(key, "cpu").tolist()
    key16 = b"".join((k & _U64_MASK).to_bytes(8, "little") for k in lanes)
    cap = min(max_blocks, T // block_size)
    counts = num_blocks.detach().cpu().clamp(0, cap).tolist()
    toks = tokens.detach().cpu().numpy().view("<u4")
    par = hashing.lanes_to_digests(parents.detach().cpu().numpy())
    ext = None if extras is None else extras.detach().cpu().numpy()
    result = torch.zeros((R, max_blocks, 2), dtype=torch.int64)
    for r, n in enumerate(counts):
        if n == 0:
            continue
        row_extras = None if ext is None else hashing.lanes_to_digests(ext[r, :n])
        chain = hashing.hash_block_chain(key16, toks[r, : n * block_size], block_size,
                                         extras=row_extras, parent=par[r])
        result[r, :n] = torch.from_numpy(hashing.digests_to_lanes(chain).view("<i8"))
    out.copy_(result)
    return out


def _rows_args(rows, starts, counts, tokens, digests, extras):
    dev = tokens.device
    E = rows.shape[0]
    for t, name in ((rows, "rows"), (starts, "starts"), (counts, "counts")):
        check_tensor(t, name, dtypes=INT32, shape=(E,), device=dev)
    R, T = tokens.shape
    check_tensor(digests, "digests", dtypes=INT64, shape=(R, None, 2), device=dev)
    check_tensor(extras, "extras", dtypes=INT64, shape=tuple(digests.shape), device=dev)
    if not (tokens.is_contiguous() and digests.is_contiguous() and extras.is_contiguous()):
        raise ValueError("tokens, digests and extras must be contiguous")
    return E, T, digests.shape[1]


def hash_rows(key: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, *,
              tokens: torch.Tensor, digests: torch.Tensor, extras: torch.Tensor, root: tuple[int, int],
              block_size: int, tile: int = DEFAULT_TILE) -> None:
    """Chained digests of blocks ``[starts[i], starts[i] + counts[i])`` of
    request row ``rows[i]``, in place: ``digests[row, b]`` from the row's
    tokens ``tokens[row, b*bs:(b+1)*bs]``, its extra digest ``extras[row,
    b]`` and the parent ``digests[row, b - 1]`` (``root`` for block 0).
    ``key`` is ``key_lanes``'s int64[2]; ``rows``/``starts``/``counts``
    int32[E], distinct rows, ``counts[i] == 0`` for padding. The caller keeps
    ``(starts + counts) * block_size <= T`` and ``starts + counts <= M``.
    One launch, no host sync; the grid depends only on E."""
    E, T, M = _rows_args(rows, starts, counts, tokens, digests, extras)
    check_device(tokens.device)
    if E == 0:
        return
    _hash_rows_kernel[(triton.cdiv(E, tile),)](
        key, rows, starts, counts, tokens, digests, extras, E, T, M, int(root[0]), int(root[1]),
        BLOCK_SIZE=int(block_size), TILE=tile, num_warps=num_warps(tile))


def hash_rows_host(key: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, *,
                   tokens: torch.Tensor, digests: torch.Tensor, extras: torch.Tensor, root: tuple[int, int],
                   block_size: int, tile: int = DEFAULT_TILE) -> None:  # noqa: ARG001 (hash_rows's signature)
    """``hash_rows`` computed on the host with ``gpukv.core.hashing`` (reads the
    tensors: a sync on a GPU); for runs under Triton's interpreter.
    tests/kernels/test_block_hash.py holds the two equal (and both equal to
    ``gpukv.core.hashing.hash_block_chain``)."""
    from gpukv.core import hashing

    _rows_args(rows, starts, counts, tokens, digests, extras)
    work = [(r, s, n) for r, s, n in zip(rows.tolist(), starts.tolist(), counts.tolist(), strict=True)
            if n > 0 and r >= 0]
    if not work:
        return
    key16 = b"".join((k & _U64_MASK).to_bytes(8, "little") for k in key.tolist())
    root16 = b"".join((int(k) & _U64_MASK).to_bytes(8, "little") for k in root)
    toks = tokens.numpy().view("<u4") if tokens.device.type == "cpu" else tokens.cpu().numpy().view("<u4")
    dig = digests if digests.device.type == "cpu" else digests.cpu()
    ext = extras if extras.device.type == "cpu" else extras.cpu()
    bs = int(block_size)
    for r, s, n in work:
        parent = root16 if s == 0 else hashing.lanes_to_digests(dig[r, s - 1: s].numpy())[0]
        row_extras = hashing.lanes_to_digests(ext[r, s: s + n].numpy())
        chain = hashing.hash_block_chain(key16, toks[r, s * bs: (s + n) * bs], bs, extras=row_extras, parent=parent)
        lanes = torch.from_numpy(hashing.digests_to_lanes(chain).view("<i8"))
        digests[r, s: s + n] = lanes.to(digests.device)


_IV_WORDS = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
             0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)


def _words_to_lanes(words: Sequence[int], device: torch.device) -> torch.Tensor:
    """8 uint32 words -> the int64[4] lane tensor ``w[2i] | w[2i+1] << 32``."""
    return torch.tensor([_signed64(words[2 * i] | words[2 * i + 1] << 32) for i in range(4)],
                        dtype=torch.int64, device=device)


def _launch_bytes(key: torch.Tensor, messages: torch.Tensor, lengths: torch.Tensor,
                  mode: int, tile: int) -> torch.Tensor:
    n, lmax = messages.shape
    out = torch.empty((n, 4), dtype=torch.int64, device=messages.device)
    if n == 0:
        return out
    # Rows of little-endian int32 words: pad to a whole word (at least one,
    # so the pointer is valid for empty messages) and reinterpret.
    width = max(4, -(-lmax // 4) * 4)
    padded = torch.zeros((n, width), dtype=torch.uint8, device=messages.device)
    padded[:, :lmax] = messages
    words = padded.view(torch.int32)
    grid = (triton.cdiv(n, tile),)
    _blake3_bytes_kernel[grid](
        key, words, lengths.contiguous(), out,
        n, lmax, max(1, -(-lmax // 64)), words.stride(0), out.stride(0),
        MODE=mode, TILE=tile, num_warps=num_warps(tile),
    )
    return out


def blake3_bytes(
    messages: torch.Tensor,
    lengths: torch.Tensor | None = None,
    *,
    key: bytes | torch.Tensor | None = None,
    derive_key_context: str | None = None,
    tile: int = DEFAULT_TILE,
) -> torch.Tensor:
    """BLAKE3 of ``n`` byte strings of at most 1024 bytes (one chunk) each.

    ``messages`` is uint8[n, Lmax] (``Lmax <= 1024``); message i is
    ``messages[i, :lengths[i]]`` (``lengths`` int32[n], clamped on the device
    to ``[0, Lmax]``; all ``Lmax`` when None). The mode follows the
    ``blake3`` package: ``hash`` by default, ``keyed_hash`` with ``key`` (32
    bytes, or its int64[4] lanes on the device), ``derive_key`` with
    ``derive_key_context`` (the messages are the key material; the context
    string, at most 1024 UTF-8 bytes, is hashed on the device first).
    Returns int64[n, 4]: the first 32 output bytes as little-endian lanes.
    """
    if not isinstance(messages, torch.Tensor):
        raise TypeError("messages must be a torch.Tensor")
    device = messages.device
    check_device(device)
    check_tensor(messages, "messages", dtypes=(torch.uint8,), shape=(None, None), device=device)
    n, lmax = messages.shape
    if lmax > MAX_MESSAGE:
        raise ValueError(f"messages must be at most {MAX_MESSAGE} bytes (one chunk), got {lmax}")
    if lengths is None:
        lengths = torch.full((n,), lmax, dtype=torch.int32, device=device)
    else:
        check_tensor(lengths, "lengths", dtypes=INT32, shape=(n,), device=device)
    check_tile(tile)
    if key is not None and derive_key_context is not None:
        raise ValueError("give key or derive_key_context, not both")
    if derive_key_context is not None:
        ctx = derive_key_context.encode("utf-8")
        if len(ctx) > MAX_MESSAGE:
            raise ValueError(f"derive_key_context must be at most {MAX_MESSAGE} bytes")
        ctx_msg = torch.tensor([list(ctx)], dtype=torch.uint8, device=device).reshape(1, len(ctx))
        ctx_key = _launch_bytes(_words_to_lanes(_IV_WORDS, device), ctx_msg,
                                torch.tensor([len(ctx)], dtype=torch.int32, device=device),
                                DERIVE_KEY_CONTEXT.value, tile)
        return _launch_bytes(ctx_key.reshape(4), messages, lengths, DERIVE_KEY_MATERIAL.value, tile)
    if key is None:
        return _launch_bytes(_words_to_lanes(_IV_WORDS, device), messages, lengths, 0, tile)
    if isinstance(key, torch.Tensor):
        lanes = check_tensor(key, "key tensor", dtypes=INT64, shape=(4,), device=device).contiguous()
    else:
        if not isinstance(key, (bytes, bytearray)) or len(key) != 32:
            raise ValueError("key must be 32 bytes (or its int64[4] lanes)")
        lanes = torch.tensor([_signed64(int.from_bytes(key[8 * i: 8 * i + 8], "little"))
                              for i in range(4)], dtype=torch.int64, device=device)
    return _launch_bytes(lanes, messages, lengths, KEYED_HASH.value, tile)


from gpukv.kernels import capture  # noqa: E402

capture.count_launches(globals())
