"""Keyed SipHash-2-4 (128-bit output) block hashing as Triton kernels.

The scheme (DESIGN.md section 2, "Block hashing"; the host implementation in
``gpukv/hashing.py`` follows the same conventions bit for bit):

* Key: 16 bytes; ``k0`` = bytes 0..7 little-endian, ``k1`` = bytes 8..15 LE.
* Digest: 16 bytes LE, held as two 64-bit lanes ``lo`` = bytes 0..7 LE and
  ``hi`` = bytes 8..15 LE. On the device a lane is an ``int64`` holding the
  two's-complement view of the ``uint64``; (0, 0) means "no digest".
* Block digest = SipHash128(key, parent digest (16 bytes)
  || the block's ``block_size`` token ids, each as a little-endian ``uint32``
  || extra-key digest (16 bytes, zeros when none)).
  The message is ``32 + 4 * block_size`` bytes long; for an odd block size that
  is not a multiple of 8, so the last token shares a word with the low half of
  the extra digest's ``lo`` lane and SipHash's final partial word (with the
  length byte in its top byte) carries the top half of ``hi``.
* Token ids are stored as ``int32``; they are taken as ``uint32`` (ids >= 2**31
  appear as negative ``int32`` and hash as their unsigned value).

Device helpers (``@triton.jit``, usable from other kernels, e.g. lookup):

* ``rotl64(x, B)``, ``sipround(v0, v1, v2, v3)``, ``sip_init``,
  ``sip_absorb``, ``sip_final64``, ``sip_final128``: SipHash-2-4 on
  ``tl.uint64`` values (any shape, all arguments of one call broadcast
  together; the state lanes must already have the caller's lane shape, see
  ``siphash128_block``).
* ``to_u64(x)`` / ``to_i64(x)``: bitcasts between the stored ``int64`` view and
  the ``uint64`` arithmetic view.
* ``siphash128_block(k0, k1, p_lo, p_hi, tok_ptr, e_lo, e_hi, mask,
  BLOCK_SIZE)``: the digest of one block per lane, as ``(lo, hi)`` uint64.

Host launchers (no host synchronisation; they only enqueue work):

* ``hash_block_chains(key, parents, tokens, num_blocks, extras=None, out=None)``:
  chained block digests of a batch of requests (one lane per request, a tile
  of requests per program, block positions walked in order because each
  digest is the next block's parent).
* ``siphash_bytes(key, messages, lengths=None, out128=True)``: SipHash-2-4 of
  byte strings, 128-bit or 64-bit output; used to check the kernel core
  against the reference test vectors.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from gpukv import _runtime  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

import torch
import triton
import triton.language as tl

__all__ = [
    "rotl64",
    "sipround",
    "sip_init",
    "sip_absorb",
    "sip_final64",
    "sip_final128",
    "to_u64",
    "to_i64",
    "siphash128_block",
    "siphash_bytes_kernel",
    "hash_block_chains",
    "siphash_bytes",
    "key_lanes",
    "DEFAULT_TILE",
]

KeyLike = Union[torch.Tensor, bytes, bytearray, Sequence[int]]

#: Requests (or messages) per program: one lane (one thread) each, power of two.
#: The chain is sequential per request, so a step's latency is one request's
#: longest chain; smaller tiles only spread requests over more SMs.
DEFAULT_TILE = 64

_U64_MASK = (1 << 64) - 1


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
def rotl64(x, B: tl.constexpr):
    """Rotate the uint64 ``x`` left by the constant ``B`` (0 < B < 64)."""
    return (x << B) | (x >> (64 - B))


@triton.jit
def sipround(v0, v1, v2, v3):
    """One SipRound on uint64 state lanes; returns the new (v0, v1, v2, v3)."""
    v0 = v0 + v1
    v1 = rotl64(v1, 13)
    v1 = v1 ^ v0
    v0 = rotl64(v0, 32)
    v2 = v2 + v3
    v3 = rotl64(v3, 16)
    v3 = v3 ^ v2
    v0 = v0 + v3
    v3 = rotl64(v3, 21)
    v3 = v3 ^ v0
    v2 = v2 + v1
    v1 = rotl64(v1, 17)
    v1 = v1 ^ v2
    v2 = rotl64(v2, 32)
    return v0, v1, v2, v3


@triton.jit
def sip_init(k0, k1, OUT128: tl.constexpr):
    """Initial SipHash state from the uint64 key lanes.

    The state takes the shape of ``k0``/``k1``: broadcast them to the lane
    shape first (``k0 + tl.zeros([TILE], tl.uint64)``) when the state is
    carried through a loop together with per-lane values.
    """
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573
    if OUT128:
        v1 = v1 ^ 0xEE
    return v0, v1, v2, v3


@triton.jit
def sip_absorb(v0, v1, v2, v3, m):
    """Compress one 64-bit message word ``m`` (uint64) with c = 2 rounds."""
    v3 = v3 ^ m
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    v0 = v0 ^ m
    return v0, v1, v2, v3


@triton.jit
def sip_final64(v0, v1, v2, v3):
    """Finalise (d = 4 rounds) for 64-bit output; returns the uint64 digest.

    The final word (partial bytes + length byte) must already be absorbed.
    """
    v2 = v2 ^ 0xFF
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


@triton.jit
def sip_final128(v0, v1, v2, v3):
    """Finalise (d = 4 rounds per half) for 128-bit output; returns (lo, hi).

    The state must come from ``sip_init(..., OUT128=True)`` and the final
    word (partial bytes + length byte) must already be absorbed.
    """
    v2 = v2 ^ 0xEE
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    lo = v0 ^ v1 ^ v2 ^ v3
    v1 = v1 ^ 0xDD
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    hi = v0 ^ v1 ^ v2 ^ v3
    return lo, hi


@triton.jit
def _load_token_u64(ptr, mask):
    """Load int32 token ids and zero-extend them as uint32 -> uint64."""
    t = tl.load(ptr, mask=mask, other=0)
    return t.to(tl.uint32, bitcast=True).to(tl.uint64)


@triton.jit
def siphash128_block(k0, k1, p_lo, p_hi, tok_ptr, e_lo, e_hi, mask,
                     BLOCK_SIZE: tl.constexpr):
    """Digest of one block per lane; returns ``(lo, hi)`` as uint64.

    Arguments (one lane per block being hashed; all of one shape):
      k0, k1      uint64 key lanes (broadcast to the lane shape).
      p_lo, p_hi  uint64 parent digest lanes.
      tok_ptr     pointers (int32) to the block's first token; the block's
                  ``BLOCK_SIZE`` tokens are contiguous from there.
      e_lo, e_hi  uint64 extra-key digest lanes (zeros when none).
      mask        lanes to load tokens for; other lanes hash zeros (their
                  result is meaningless and must be discarded by the caller).
    Message: p_lo, p_hi, tokens as LE uint32, e_lo, e_hi;
    length 32 + 4 * BLOCK_SIZE bytes.
    """
    v0, v1, v2, v3 = sip_init(k0, k1, True)
    v0, v1, v2, v3 = sip_absorb(v0, v1, v2, v3, p_lo)
    v0, v1, v2, v3 = sip_absorb(v0, v1, v2, v3, p_hi)
    for j in range(BLOCK_SIZE // 2):
        a = _load_token_u64(tok_ptr + 2 * j, mask)
        b = _load_token_u64(tok_ptr + 2 * j + 1, mask)
        v0, v1, v2, v3 = sip_absorb(v0, v1, v2, v3, a | (b << 32))
    # SipHash's final word: leftover bytes, message length (mod 256) on top.
    len_byte = ((e_hi & 0) + ((32 + 4 * BLOCK_SIZE) % 256)) << 56
    if BLOCK_SIZE % 2 == 1:
        t = _load_token_u64(tok_ptr + (BLOCK_SIZE - 1), mask)
        v0, v1, v2, v3 = sip_absorb(v0, v1, v2, v3, t | (e_lo << 32))
        v0, v1, v2, v3 = sip_absorb(v0, v1, v2, v3, (e_lo >> 32) | (e_hi << 32))
        last = (e_hi >> 32) | len_byte
    else:
        v0, v1, v2, v3 = sip_absorb(v0, v1, v2, v3, e_lo)
        v0, v1, v2, v3 = sip_absorb(v0, v1, v2, v3, e_hi)
        last = len_byte
    v0, v1, v2, v3 = sip_absorb(v0, v1, v2, v3, last)
    return sip_final128(v0, v1, v2, v3)


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------


@triton.jit
def _hash_block_chains_kernel(
    key_ptr, parents_ptr, tokens_ptr, num_blocks_ptr, extras_ptr, out_ptr,
    R, max_blocks, block_cap,
    s_pr, s_pc, s_tr, s_er, s_eb, s_ec, s_or, s_ob, s_oc,
    BLOCK_SIZE: tl.constexpr, HAS_EXTRAS: tl.constexpr, TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * TILE + tl.arange(0, TILE)
    rmask = rows < R
    r64 = rows.to(tl.int64)

    zero = tl.zeros([TILE], dtype=tl.uint64)
    k0 = to_u64(tl.load(key_ptr)) + zero
    k1 = to_u64(tl.load(key_ptr + 1)) + zero

    nb = tl.load(num_blocks_ptr + rows, mask=rmask, other=0)
    nb = tl.minimum(tl.maximum(nb, 0), block_cap)
    p_lo = to_u64(tl.load(parents_ptr + r64 * s_pr, mask=rmask, other=0))
    p_hi = to_u64(tl.load(parents_ptr + r64 * s_pr + s_pc, mask=rmask, other=0))

    tok_row = tokens_ptr + r64 * s_tr
    ext_row = extras_ptr + r64 * s_er
    out_row = out_ptr + r64 * s_or

    n_hash = tl.max(nb, axis=0)
    for b in range(0, n_hash):
        active = rmask & (b < nb)
        if HAS_EXTRAS:
            e_lo = to_u64(tl.load(ext_row + b * s_eb, mask=active, other=0))
            e_hi = to_u64(tl.load(ext_row + b * s_eb + s_ec, mask=active, other=0))
        else:
            e_lo = zero
            e_hi = zero
        d_lo, d_hi = siphash128_block(k0, k1, p_lo, p_hi, tok_row + b * BLOCK_SIZE,
                                      e_lo, e_hi, active, BLOCK_SIZE)
        d_lo = tl.where(active, d_lo, zero)
        d_hi = tl.where(active, d_hi, zero)
        tl.store(out_row + b * s_ob, to_i64(d_lo), mask=rmask)
        tl.store(out_row + b * s_ob + s_oc, to_i64(d_hi), mask=rmask)
        p_lo = tl.where(active, d_lo, p_lo)
        p_hi = tl.where(active, d_hi, p_hi)
    zero_i = tl.zeros([TILE], dtype=tl.int64)
    for b in range(n_hash, max_blocks):
        tl.store(out_row + b * s_ob, zero_i, mask=rmask)
        tl.store(out_row + b * s_ob + s_oc, zero_i, mask=rmask)


@triton.jit
def siphash_bytes_kernel(
    key_ptr, msg_ptr, len_ptr, out_ptr,
    n, lmax, n_words, s_mr, s_or, s_oc,
    OUT128: tl.constexpr, TILE: tl.constexpr,
):
    """SipHash-2-4 of ``n`` byte strings, one lane each.

    Message ``i`` is ``msg[i, :len[i]]`` (uint8). ``n_words`` = (longest
    length) // 8 + 1 words are walked; a lane absorbs its full words and then
    its final word (leftover bytes + length byte) and stops there.
    Output: ``out[i, 0]``/``out[i, 1]`` = lo/hi lanes (128-bit), or
    ``out[i * s_or]`` (64-bit), as int64 views.
    """
    pid = tl.program_id(0)
    rows = pid * TILE + tl.arange(0, TILE)
    rmask = rows < n
    r64 = rows.to(tl.int64)
    zero = tl.zeros([TILE], dtype=tl.uint64)
    k0 = to_u64(tl.load(key_ptr)) + zero
    k1 = to_u64(tl.load(key_ptr + 1)) + zero
    length = tl.load(len_ptr + rows, mask=rmask, other=0)
    length = tl.minimum(tl.maximum(length, 0), lmax)
    full = length // 8

    v0, v1, v2, v3 = sip_init(k0, k1, OUT128)
    row_ptr = msg_ptr + r64 * s_mr
    for w in range(0, n_words):
        m = zero
        for i in tl.static_range(8):
            off = w * 8 + i
            byte = tl.load(row_ptr + off, mask=rmask & (off < length), other=0)
            m = m | (byte.to(tl.uint64) << (8 * i))
        len_byte = (length & 255).to(tl.uint64) << 56
        m = tl.where(w == full, m | len_byte, m)
        n0, n1, n2, n3 = sip_absorb(v0, v1, v2, v3, m)
        active = w <= full
        v0 = tl.where(active, n0, v0)
        v1 = tl.where(active, n1, v1)
        v2 = tl.where(active, n2, v2)
        v3 = tl.where(active, n3, v3)
    if OUT128:
        lo, hi = sip_final128(v0, v1, v2, v3)
        tl.store(out_ptr + r64 * s_or, to_i64(lo), mask=rmask)
        tl.store(out_ptr + r64 * s_or + s_oc, to_i64(hi), mask=rmask)
    else:
        h = sip_final64(v0, v1, v2, v3)
        tl.store(out_ptr + r64 * s_or, to_i64(h), mask=rmask)


# --------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------


def _signed64(x: int) -> int:
    x &= _U64_MASK
    return x - (1 << 64) if x >= (1 << 63) else x


def key_lanes(key: KeyLike, device: Union[torch.device, str]) -> torch.Tensor:
    """The key as an ``int64[2]`` tensor ``(k0, k1)`` on ``device``.

    ``key`` is 16 bytes, a pair of ints (each an unsigned 64-bit value or its
    signed int64 view), or an ``int64`` tensor of shape ``[2]`` already on
    ``device`` (returned as is, made contiguous).
    """
    device = torch.device(device)
    if isinstance(key, torch.Tensor):
        if key.dtype != torch.int64 or tuple(key.shape) != (2,):
            raise ValueError(
                f"key tensor must be int64 of shape [2] (k0, k1); got {key.dtype} "
                f"{tuple(key.shape)}")
        if key.device != device:
            raise ValueError(f"key tensor is on {key.device}, the data on {device}")
        return key.contiguous()
    if isinstance(key, (bytes, bytearray)):
        if len(key) != 16:
            raise ValueError(f"key must be 16 bytes; got {len(key)}")
        lanes = (int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little"))
    else:
        lanes = tuple(key)
        if len(lanes) != 2 or not all(isinstance(k, int) for k in lanes):
            raise ValueError("key must be 16 bytes, (k0, k1) ints or an int64[2] tensor")
        for k in lanes:
            if not -(1 << 63) <= k < (1 << 64):
                raise ValueError("key lanes must fit in 64 bits")
    return torch.tensor([_signed64(k) for k in lanes], dtype=torch.int64, device=device)


def _num_warps(tile: int) -> int:
    # one lane per thread: more warps than lanes would only duplicate work
    return max(1, min(4, tile // 32))


def _check_device(device: torch.device) -> None:
    if device.type != "cuda" and not _runtime.INTERPRETED:
        raise ValueError(
            f"Triton kernels need CUDA tensors, got {device}; to run on CPU set "
            "TRITON_INTERPRET=1 before triton is imported (import gpukv first)")


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple,
           device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all inputs on one device)")


def hash_block_chains(
    key: KeyLike,
    parents: torch.Tensor,
    tokens: torch.Tensor,
    num_blocks: torch.Tensor,
    extras: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    *,
    block_size: Optional[int] = None,
    max_blocks: Optional[int] = None,
    tile: int = DEFAULT_TILE,
) -> torch.Tensor:
    """Chained block digests of ``R`` requests; returns ``out`` int64[R, M, 2].

    Layout (``R`` requests, ``M`` = max blocks per request, ``bs`` = block size):
      key         16 bytes, (k0, k1) ints, or int64[2] tensor on the device.
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
    ``T`` is a multiple of it, and must be given otherwise; ``M`` defaults to ``extras``/``out``'s dim 1, else
    ``T // block_size``.

    Result: ``out[r, b]`` = digest of request r's block b for ``b <
    num_blocks[r]`` (block 0 chained from ``parents[r]``, block b from block
    b-1), and (0, 0) for every later position. Fully written; no host sync.
    """
    if not isinstance(parents, torch.Tensor):
        raise TypeError("parents must be a torch.Tensor")
    device = parents.device
    _check_device(device)
    _check(parents, "parents", torch.int64, (None, 2), device)
    R = parents.shape[0]
    _check(tokens, "tokens", torch.int32, (R, None), device)
    _check(num_blocks, "num_blocks", torch.int32, (R,), device)
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
        _check(extras, "extras", torch.int64, (R, max_blocks, 2), device)
    if out is None:
        out = torch.empty((R, max_blocks, 2), dtype=torch.int64, device=device)
    else:
        _check(out, "out", torch.int64, (R, max_blocks, 2), device)
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two, got {tile}")
    if R == 0 or max_blocks == 0:
        return out

    k = key_lanes(key, device)
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
        num_warps=_num_warps(tile),
    )
    return out


def siphash_bytes(
    key: KeyLike,
    messages: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    *,
    out128: bool = True,
    tile: int = DEFAULT_TILE,
) -> torch.Tensor:
    """SipHash-2-4 of ``n`` byte strings.

    ``messages`` is uint8[n, Lmax]; message i is ``messages[i, :lengths[i]]``
    (``lengths`` int32[n], clamped on the device to ``[0, Lmax]``; all
    ``Lmax`` when None). Returns int64[n, 2] (lo, hi) for 128-bit output or
    int64[n] for 64-bit output (``out128=False``); lanes are the
    little-endian halves of the reference byte output, as int64 views.
    """
    if not isinstance(messages, torch.Tensor):
        raise TypeError("messages must be a torch.Tensor")
    device = messages.device
    _check_device(device)
    _check(messages, "messages", torch.uint8, (None, None), device)
    n, lmax = messages.shape
    if lengths is None:
        lengths = torch.full((n,), lmax, dtype=torch.int32, device=device)
    else:
        _check(lengths, "lengths", torch.int32, (n,), device)
    out = torch.empty((n, 2) if out128 else (n,), dtype=torch.int64, device=device)
    if n == 0:
        return out
    if lmax == 0:  # keep a valid (never read) pointer for empty messages
        messages = torch.zeros((n, 1), dtype=torch.uint8, device=device)
    messages = messages.contiguous()
    k = key_lanes(key, device)
    grid = (triton.cdiv(n, tile),)
    siphash_bytes_kernel[grid](
        k, messages, lengths.contiguous(), out,
        n, lmax, lmax // 8 + 1, messages.stride(0), out.stride(0), out.stride(-1),
        OUT128=out128, TILE=tile, num_warps=_num_warps(tile),
    )
    return out
