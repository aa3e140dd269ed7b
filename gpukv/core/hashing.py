"""The block-hash scheme (v2, keyed BLAKE3), host implementation.

A KV block is identified by a chained, keyed 128-bit digest (docs/design.md,
"Hashing")::

    H(m)             = the first 16 bytes of BLAKE3 keyed_hash(key32, m)
    digest(block j)  = H(parent || extra || tokens)

    parent = digest(block j-1), or root_digest(key) for block 0   (16 bytes)
    extra  = the block's extra-key digest (16 bytes), NO_EXTRA (zeros) when none
    tokens = the block's token ids, each as a little-endian uint32 (4*block_size bytes)

so two blocks share a digest only if their whole prefixes (and extra keys)
agree. Every message stays within one BLAKE3 chunk (<= 1024 bytes), so the
device kernel (``gpukv/kernels/block_hash.py``) needs no tree hashing: a block
of more than ``SEGMENT_TOKENS`` (248) tokens is folded in segments of at most
248 tokens, ``s = parent; for each segment: s = H(s || extra || segment)``,
and its digest is the last ``s`` (a block of <= 248 tokens is one call).
Everything here is deterministic given the key; the device kernel reproduces
it bit for bit.

Keys. The gpukv key is 16 bytes (:func:`resolve_hash_key`). BLAKE3's keyed
mode takes 32, derived with BLAKE3's own key-derivation mode::

    key32 = BLAKE3 derive_key(context=KEY_CONTEXT, key_material=key)   (32 bytes)

Conventions shared with the device:

* A digest is 16 bytes. Its two 64-bit *lanes* are
  ``lo = int.from_bytes(d[0:8], "little")`` and ``hi = int.from_bytes(d[8:16],
  "little")``; numpy arrays of lanes here are uint64 ``[n, 2]`` (``[:, 0]`` = lo),
  the device stores the same bits as int64.
* The key is 16 bytes: ``k0`` = bytes 0..7 little-endian, ``k1`` = bytes 8..15.

Byte layouts fixed by this module (changing any of them changes every digest,
so each carries a version tag):

* root digest  = ``H(b"gpukv:root:v2")``
* extra keys   = ``H(b"gpukv:extra:v3" + fields)``, see
  :func:`encode_extra_keys` for the fields.
* key from ``PYTHONHASHSEED`` = first 16 bytes of
  ``sha256(b"gpukv:hash-key:PYTHONHASHSEED:v1\\x00" + str(int(seed)).encode())``,
  see :func:`resolve_hash_key` (unchanged from v1: the same seed gives the
  same 16-byte key; only the digests built from it changed).

The hashing itself is the ``blake3`` package (the BLAKE3 team's Rust
implementation). :func:`keyed_digest` is H; :func:`block_digest` and
:func:`hash_block_chain` hash one block / one request; :func:`hash_requests`
and :func:`block_digests_lanes` take many requests or blocks at once,
building their token bytes with numpy in one go. All of them loop over
prebuilt bytes with no per-token Python, and the tests hold them equal.
"""

from __future__ import annotations

import array
import functools
import hashlib
import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from gpukv.errors import GpukvInputError, InvalidInputError, InvalidTypeError, check_int, check_lora_id, type_name

__all__ = [
    "DIGEST_SIZE",
    "KEY_SIZE",
    "NO_EXTRA",
    "HASH_KEY_ENV",
    "KEY_CONTEXT",
    "SEGMENT_TOKENS",
    "MMItem",
    "blake3_key",
    "keyed_digest",
    "resolve_hash_key",
    "root_digest",
    "block_digest",
    "encode_extra_keys",
    "extra_key_digests",
    "hash_block_chain",
    "block_digests_lanes",
    "hash_requests",
    "extend_chains",
    "digests_to_lanes",
    "lanes_to_digests",
]

logger = logging.getLogger(__name__)

DIGEST_SIZE = 16
KEY_SIZE = 16
#: The extra-key digest of a block that has no extra keys.
NO_EXTRA = bytes(DIGEST_SIZE)
#: Environment variable holding an explicit key as 32 hex characters.
HASH_KEY_ENV = "GPUKV_HASH_KEY"

#: BLAKE3 derive_key context turning the 16-byte gpukv key into the 32-byte
#: BLAKE3 key (hard-coded, globally unique and application-specific, as BLAKE3
#: asks of a context string).
KEY_CONTEXT = "gpukv 2026-12-01 block hash key v2"
ROOT_MESSAGE = b"gpukv:root:v2"
EXTRA_PREFIX = b"gpukv:extra:v3"
SEED_KEY_PREFIX = b"gpukv:hash-key:PYTHONHASHSEED:v1\x00"

#: Most tokens hashed in one BLAKE3 call: 16 + 16 + 4 * 248 = 1024 bytes, one
#: BLAKE3 chunk. Longer blocks are folded in segments of this many tokens.
SEGMENT_TOKENS = 248
#: Bytes of one BLAKE3 chunk, the longest message the scheme hashes.
CHUNK_BYTES = 1024

# Extra-key field tags (see encode_extra_keys).
TAG_LORA = 0x01
TAG_MM = 0x02
TAG_SALT = 0x03

TOKEN_LIMIT = 1 << 32  # token ids are stored as uint32

# array.array type code for a 4-byte unsigned int (it is "I" on every common
# platform, but the C standard only promises "at least 2 bytes").
_U32_CODE = next(c for c in "IL" if array.array(c).itemsize == 4)


# --------------------------------------------------------------------------
# Argument checking
# --------------------------------------------------------------------------


def _check_key(key: Any) -> bytes:
    """Return ``key`` as bytes, or raise if it is not a 16-byte key.

    The key is a secret: messages give its type and length, never its value.
    """
    if isinstance(key, str):
        raise InvalidTypeError(
            "the hash key must be 16 bytes, not str", argument="key",
            fix="use resolve_hash_key(hex_string) to turn 32 hex characters into a key",
        )
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"the hash key must be 16 bytes, not {type_name(key)}", argument="key",
                               fix="get one from resolve_hash_key()")
    key = bytes(key)
    if len(key) != KEY_SIZE:
        raise InvalidInputError(f"the hash key must be {KEY_SIZE} bytes, got {len(key)}", argument="key",
                                fix="get one from resolve_hash_key()")
    return key


def _check_digest(value: Any, what: str) -> bytes:
    """Return ``value`` as 16 bytes, or raise naming ``what``."""
    fix = f"pass the {DIGEST_SIZE} bytes a digest function of this module returned"
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"must be a {DIGEST_SIZE}-byte digest, not {type_name(value)}", argument=what, fix=fix)
    value = bytes(value)
    if len(value) != DIGEST_SIZE:
        raise InvalidInputError(f"must be a {DIGEST_SIZE}-byte digest, got {len(value)} bytes", argument=what,
                                fix=fix)
    return value


_TOKEN_FIX = "pass token ids as ints (Python or numpy integers) in [0, 2**32)"


def _bad_token(value: Any, where: str) -> GpukvInputError:
    """The error for one bad token id at position ``where``."""
    if isinstance(value, (bool, np.bool_)):
        return InvalidTypeError(f"is a bool ({value}), not a token id", argument=where, fix=_TOKEN_FIX)
    if isinstance(value, (int, np.integer)):
        return InvalidInputError(f"= {int(value)} is out of range [0, 2**32)", argument=where, fix=_TOKEN_FIX)
    return InvalidTypeError(f"has type {type_name(value)}, not a token id", argument=where, fix=_TOKEN_FIX)


def _not_token_sequence(tokens: Any, name: str) -> InvalidTypeError:
    return InvalidTypeError(f"must be a sequence of int token ids, not {type_name(tokens)}", argument=name,
                            fix="pass a list, tuple or 1-D integer array of token ids")


def _token_array(tokens: Any, name: str = "token_ids", base: int = 0) -> np.ndarray:
    """Validate token ids and return them as a 1-D uint32 array.

    Accepts a list/tuple/sequence of ints (numpy integer scalars too) or a
    1-D integer array. Errors name the first bad position as
    ``name[base + i]``.
    """
    return _checked_tokens(tokens, name, base).astype(np.uint32, copy=False)


def _checked_tokens(tokens: Any, name: str, base: int = 0) -> np.ndarray:
    """Like :func:`_token_array`, but an integer array comes back in its own dtype.

    Every value is in [0, 2**32), so a later cast to uint32 is exact; skipping
    the cast here saves a copy of every request's tokens in hash_requests.
    """
    if isinstance(tokens, (str, bytes, bytearray)) or not hasattr(tokens, "__len__"):
        raise _not_token_sequence(tokens, name)
    if isinstance(tokens, np.ndarray) or (
        not isinstance(tokens, (list, tuple)) and hasattr(tokens, "__array__")
    ):
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise InvalidInputError(f"must be 1-D, got an array of shape {arr.shape}", argument=name,
                                    fix="pass one request's token ids as a 1-D array")
        if arr.dtype.kind in "iu":
            bad = _out_of_range(arr)
            if bad is not None:
                raise _bad_token(arr[bad], f"{name}[{base + bad}]")
            return arr
        if arr.dtype != object:
            if arr.size == 0:
                return np.zeros(0, np.uint32)
            raise _bad_token(arr[0], f"{name}[{base}]")
        tokens = arr.tolist()
    try:
        # Fast path: array.array rejects floats, strings, negatives and values
        # >= 2**32 itself, at C speed. It accepts bools (bool is an int), so
        # those are looked for below among the positions holding 0 or 1.
        fast: np.ndarray | None = np.frombuffer(array.array(_U32_CODE, tokens), dtype=np.uint32)
    except (TypeError, OverflowError, ValueError):
        fast = None
    if fast is not None:
        for i in np.flatnonzero(fast <= 1).tolist():
            if isinstance(tokens[i], (bool, np.bool_)):
                raise _bad_token(tokens[i], f"{name}[{base + i}]")
        return fast
    # Slow path, only to say which position is bad.
    for i, t in enumerate(tokens):
        if (
            isinstance(t, (bool, np.bool_))
            or not isinstance(t, (int, np.integer))
            or not 0 <= int(t) < TOKEN_LIMIT
        ):
            raise _bad_token(t, f"{name}[{base + i}]")
    # Every element is a valid int; what failed was the sequence itself.
    raise _not_token_sequence(tokens, name)


def _flat_tokens(token_lists: Sequence[Any], name: str) -> tuple[np.ndarray, list[int]]:
    """Validate many requests' token ids; return them concatenated (uint32)
    and each request's length.

    A list is converted by ``array.array`` (which refuses floats, strings,
    negatives and values >= 2**32 at C speed); one numpy pass over all of
    them then looks for bools (which ``array.array`` takes as 0 and 1).
    Anything else, or a list that fails, goes through :func:`_checked_tokens`,
    which names the bad position. Errors name ``name[r][i]``; a bool is
    reported after every other kind of error.
    """
    parts: list[Any] = []
    lengths: list[int] = []
    listed: list[int] = []
    arrays: list[int] = []  # 1-D integer arrays, range-checked together below
    for r, t in enumerate(token_lists):
        part: array.array | np.ndarray | None = None
        if type(t) is list:
            try:
                part = array.array(_U32_CODE, t)
                listed.append(r)
            except (TypeError, OverflowError, ValueError):
                part = None
        elif isinstance(t, np.ndarray) and t.ndim == 1 and t.dtype.kind in "iu":
            part = t
            arrays.append(r)
        if part is None:  # checked (and refused, if bad) with the position named
            part = _checked_tokens(t, f"{name}[{r}]").astype(np.uint32, copy=False)
        parts.append(part)
        lengths.append(len(part))
    if not parts:
        return np.zeros(0, dtype=np.uint32), lengths
    if arrays:
        _arrays_to_uint32(parts, arrays, name)
    flat = np.frombuffer(b"".join(parts), dtype=np.uint32)
    if listed:
        _refuse_listed_bools(token_lists, flat, lengths, listed, name)
    return flat, lengths


def _arrays_to_uint32(parts: list[Any], arrays: list[int], name: str) -> None:
    """Range-check the integer arrays ``parts[r]`` (``r`` in ``arrays``) and
    replace each with its uint32 copy."""
    # One range check for all of them (int64 wraps values >= 2**63 to
    # negatives, which fail too); if one fails, find it and name it.
    joined = np.concatenate([parts[r] for r in arrays], dtype=np.int64, casting="unsafe")
    if joined.size and (joined.min() < 0 or joined.max() >= TOKEN_LIMIT):
        for r in arrays:
            _checked_tokens(parts[r], f"{name}[{r}]")
    for r in arrays:
        parts[r] = parts[r].astype(np.uint32)  # exact: checked above


def _refuse_listed_bools(
    token_lists: Sequence[Any], flat: np.ndarray, lengths: list[int], listed: list[int], name: str
) -> None:
    """Refuse the first bool among the lists ``array.array`` converted (rows
    ``listed``), which it took as 0 or 1: only positions holding those can be one."""
    low = np.flatnonzero(flat <= 1)
    if low.size:
        starts = np.cumsum([0] + lengths)
        rows = np.searchsorted(starts, low, side="right") - 1
        listed_set = set(listed)
        for pos, r in zip(low.tolist(), rows.tolist(), strict=True):
            if r in listed_set:
                i = pos - int(starts[r])
                if isinstance(token_lists[r][i], (bool, np.bool_)):
                    raise _bad_token(token_lists[r][i], f"{name}[{r}][{i}]")


def _out_of_range(arr: np.ndarray) -> int | None:
    """Flat index of the first element of integer ``arr`` outside [0, 2**32), or None."""
    if arr.size == 0:
        return None
    bits = 8 * arr.dtype.itemsize
    if arr.dtype.kind == "u":
        if bits <= 32:
            return None  # the dtype cannot hold a bad value
        limit = TOKEN_LIMIT
    else:
        # In the same-width unsigned view a negative value is >= 2**(bits-1),
        # so one comparison catches both ends of the range in one pass.
        limit = min(TOKEN_LIMIT, 1 << (bits - 1))
    unsigned = arr.view(arr.dtype.str.replace("i", "u"))
    if unsigned.max() < limit:
        return None
    return int(np.argmax(unsigned.ravel() >= limit))


def _token_matrix(tokens: Any, n: int) -> np.ndarray:
    """Validate an ``[n, block_size]`` integer array of token ids; return it as uint32."""
    arr = np.asarray(tokens)
    if arr.ndim != 2 or arr.shape[0] != n or arr.shape[1] < 1:
        raise InvalidInputError(f"must have shape [n={n}, block_size>=1], got {arr.shape}", argument="tokens",
                                fix="pass one row of token ids per block, as many rows as parents")
    if arr.dtype.kind not in "iu":
        raise InvalidTypeError(f"must be an integer array, got dtype {arr.dtype}", argument="tokens",
                               fix=_TOKEN_FIX)
    bad = _out_of_range(arr)
    if bad is not None:
        r, c = divmod(bad, arr.shape[1])
        raise _bad_token(arr[r, c], f"tokens[{r}, {c}]")
    return arr.astype(np.uint32, copy=False)


def _check_lanes(lanes: Any, what: str, n: int | None = None) -> np.ndarray:
    """Return ``lanes`` as a uint64 ``[n, 2]`` array (int64 input is reinterpreted)."""
    arr = np.asarray(lanes)
    if arr.dtype == np.int64:
        arr = arr.view(np.uint64)  # the device's int64 view of the same bits
    fix = "pass digests as lanes (digests_to_lanes)"
    if arr.dtype != np.uint64:
        raise InvalidTypeError(f"must be a uint64 (or int64) array of lanes, got dtype {arr.dtype}", argument=what,
                               fix=fix)
    if arr.ndim != 2 or arr.shape[1] != 2 or (n is not None and arr.shape[0] != n):
        want = "n" if n is None else str(n)
        raise InvalidInputError(f"must have shape [{want}, 2], got {arr.shape}", argument=what, fix=fix)
    return arr


# --------------------------------------------------------------------------
# BLAKE3 primitives
# --------------------------------------------------------------------------


def blake3_key(key: bytes) -> bytes:
    """The 32-byte BLAKE3 key of a 16-byte gpukv key:
    ``BLAKE3 derive_key(KEY_CONTEXT, key)``. It is as secret as ``key``."""
    return blake3.blake3(_check_key(key), derive_key_context=KEY_CONTEXT).digest()


@functools.lru_cache(maxsize=16)
def _hasher(key: bytes) -> Any:
    """A BLAKE3 hasher keyed with ``blake3_key(key)`` that has absorbed
    nothing. Callers hash with a ``copy()`` of it (never with it: it is shared),
    which skips the key derivation. Cached per key (``key`` is checked bytes):
    the cache holds the key, as any caller of this module does; it shows only
    counts."""
    return blake3.blake3(key=blake3_key(key))


def keyed_digest(key: bytes, data: Any) -> bytes:
    """H: the first 16 bytes of BLAKE3 ``keyed_hash(blake3_key(key), data)``.

    ``data`` is any bytes-like object. Messages of the scheme are at most one
    chunk (1024 bytes) long; this function hashes any length.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"must be bytes, not {type_name(data)}", argument="data",
                               fix="pass the message as bytes, bytearray or memoryview")
    h = _hasher(_check_key(key)).copy()
    h.update(data)
    return h.digest(DIGEST_SIZE)


# --------------------------------------------------------------------------
# Key handling
# --------------------------------------------------------------------------


def _parse_hex_key(text: str, source: str) -> bytes:
    """Parse 32 hex characters (surrounding whitespace ignored) into a key."""
    text = text.strip()
    fix = "give 32 hex characters (16 bytes), e.g. os.urandom(16).hex()"
    if len(text) != 2 * KEY_SIZE:
        raise InvalidInputError(f"must be {2 * KEY_SIZE} hex characters ({KEY_SIZE} bytes), got {len(text)} "
                                "characters", argument=source, fix=fix)
    if any(c not in "0123456789abcdefABCDEF" for c in text):
        raise InvalidInputError("must contain only hex digits 0-9, a-f", argument=source, fix=fix)
    return bytes.fromhex(text)


def _key_from_hash_seed(seed: str) -> bytes:
    """The key derived from a ``PYTHONHASHSEED`` value (an integer, as Python requires).

    The seed is normalised through ``int`` (so "007" and "7", which Python
    treats alike, give the same key) and domain-separated, so the key is
    not a value any other component derives from the same seed.
    """
    try:
        value = int(seed.strip(), 10)
    except ValueError:
        value = -1
    if not 0 <= value <= 4294967295:
        # Do not echo the seed: the key is derived from it.
        raise InvalidInputError(
            "must be 'random' or an integer in [0, 4294967295] to derive a gpukv hash key from it",
            argument="PYTHONHASHSEED", fix=f"fix it, or set {HASH_KEY_ENV}",
        )
    return hashlib.sha256(SEED_KEY_PREFIX + str(value).encode("ascii")).digest()[:KEY_SIZE]


def resolve_hash_key(key: bytes | str | None = None) -> bytes:
    """Return the 16-byte hash key, from the first source that gives one.

    1. ``key``: 16 bytes, or a string of 32 hex characters.
    2. env ``GPUKV_HASH_KEY``: 32 hex characters (empty counts as unset).
    3. env ``PYTHONHASHSEED``, when set, non-empty and not ``"random"``:
       ``sha256(b"gpukv:hash-key:PYTHONHASHSEED:v1\\x00" + str(int(seed)).encode())[:16]``.
       Processes started with the same seed share digests (needed to move KV
       between instances); such a key is only as secret as the seed.
    4. ``os.urandom(16)``: a fresh key on every call, so call this once per
       process and keep the result.

    Raises ``InvalidInputError`` (a ``ValueError``; saying what is expected,
    never the value) for a key of the wrong length or with non-hex
    characters, naming its source (``key``, ``GPUKV_HASH_KEY``,
    ``PYTHONHASHSEED``); ``InvalidTypeError`` for a key that is neither bytes
    nor str.
    """
    if key is not None:
        if isinstance(key, str):
            return _parse_hex_key(key, "key")
        return _check_key(key)
    env_key = os.environ.get(HASH_KEY_ENV)
    if env_key is not None and env_key != "":  # set but blank is malformed, not "unset"
        logger.debug("gpukv hash key taken from %s", HASH_KEY_ENV)
        return _parse_hex_key(env_key, HASH_KEY_ENV)
    seed = os.environ.get("PYTHONHASHSEED", "")
    if seed.strip() and seed.strip() != "random":
        logger.debug("gpukv hash key derived from PYTHONHASHSEED")
        return _key_from_hash_seed(seed)
    logger.debug("gpukv hash key drawn at random (os.urandom)")
    return os.urandom(KEY_SIZE)


# --------------------------------------------------------------------------
# Block digests
# --------------------------------------------------------------------------


def root_digest(key: bytes) -> bytes:
    """The parent digest of every request's first block: ``H(b"gpukv:root:v2")``."""
    return keyed_digest(key, ROOT_MESSAGE)


def _le32_bytes(tokens: np.ndarray) -> bytes:
    """Validated token ids (any integer dtype, values in [0, 2**32)) as
    little-endian uint32 bytes."""
    return tokens.astype("<u4", copy=False).tobytes()


def _digest_list(values: Sequence[Any], count: int, what: str) -> list[bytes]:
    """The first ``count`` entries of ``values`` as checked 16-byte digests."""
    out = list(values[:count])
    for i, v in enumerate(out):
        if type(v) is not bytes or len(v) != DIGEST_SIZE:
            out[i] = _check_digest(v, f"{what}[{i}]")
    return out


def _chain(hasher: Any, parent: bytes, tok: bytes, start: int, count: int,
           block_size: int, extras: Sequence[bytes] | None) -> list[bytes]:
    """The chained digests of ``count`` consecutive blocks.

    ``tok`` holds little-endian uint32 token ids; block ``i`` is the
    ``4 * block_size`` bytes at ``start + i * 4 * block_size``. ``parent``
    is the digest the first block chains from, ``extras[i]`` block i's
    checked extra-key digest (None: NO_EXTRA). ``hasher`` is the caller's own
    copy of ``_hasher(key)``, reset before every message (cheaper than a new
    hasher per message). The loop does one slice, one concatenation and one
    BLAKE3 call per block (per segment of a block over SEGMENT_TOKENS tokens).
    """
    reset, update, digest = hasher.reset, hasher.update, hasher.digest
    step = 4 * block_size
    stop = start + count * step
    out: list[bytes] = []
    append = out.append
    if block_size <= SEGMENT_TOKENS:
        if extras is None:
            for i in range(start, stop, step):
                reset()
                update(parent + NO_EXTRA + tok[i : i + step])
                parent = digest(DIGEST_SIZE)
                append(parent)
        else:
            for i, extra in zip(range(start, stop, step), extras, strict=True):
                reset()
                update(parent + extra + tok[i : i + step])
                parent = digest(DIGEST_SIZE)
                append(parent)
        return out
    # A long block: fold its segments, each one chunk-sized message.
    seg = 4 * SEGMENT_TOKENS
    for b, i in enumerate(range(start, stop, step)):
        extra = NO_EXTRA if extras is None else extras[b]
        end = i + step
        for j in range(i, end, seg):
            reset()
            update(parent + extra + tok[j : min(j + seg, end)])
            parent = digest(DIGEST_SIZE)
        append(parent)
    return out


def _tails(tokens: np.ndarray, extras: np.ndarray | None) -> tuple[bytes, list[int]]:
    """Every message of many blocks but its parent, laid out by numpy at once.

    ``tokens`` is ``[n, block_size]`` (values in [0, 2**32)), ``extras`` uint64
    ``[n, 2]`` lanes or None (NO_EXTRA). Block i's messages are, for each of
    its segments, ``extra || segment tokens (LE u32)``; they follow each
    other in the result, block after block. Also returns the segments'
    lengths in bytes (one entry for a block of <= SEGMENT_TOKENS tokens).
    """
    n, block_size = tokens.shape
    cuts = list(range(0, block_size, SEGMENT_TOKENS)) + [block_size]
    seg_lens = [DIGEST_SIZE + 4 * (hi - lo) for lo, hi in zip(cuts, cuts[1:], strict=False)]
    buf = np.zeros((n, sum(seg_lens)), dtype=np.uint8)
    tok = np.ascontiguousarray(tokens, dtype="<u4").view(np.uint8)  # [n, 4 * block_size]
    ext = None if extras is None else np.ascontiguousarray(extras, dtype="<u8").view(np.uint8)
    at = 0
    for lo, hi, length in zip(cuts, cuts[1:], seg_lens, strict=False):
        if ext is not None:
            buf[:, at : at + DIGEST_SIZE] = ext
        buf[:, at + DIGEST_SIZE : at + length] = tok[:, 4 * lo : 4 * hi]
        at += length
    return buf.tobytes(), seg_lens


def _chain_tails(hasher: Any, parent: bytes, tails: bytes, start: int, count: int,
                 seg_lens: list[int]) -> list[bytes]:
    """The chained digests of ``count`` blocks whose messages, less their
    parents, are laid out in ``tails`` from byte ``start`` (see :func:`_tails`):
    one concatenation and one BLAKE3 call per segment."""
    reset, update, digest = hasher.reset, hasher.update, hasher.digest
    out: list[bytes] = []
    append = out.append
    if len(seg_lens) == 1:
        step = seg_lens[0]
        for i in range(start, start + count * step, step):
            reset()
            update(parent + tails[i : i + step])
            parent = digest(DIGEST_SIZE)
            append(parent)
        return out
    at = start
    for _ in range(count):
        for length in seg_lens:
            reset()
            update(parent + tails[at : at + length])
            parent = digest(DIGEST_SIZE)
            at += length
        append(parent)
    return out


def block_digest(
    key: bytes, parent: bytes, token_ids: Sequence[int] | np.ndarray, extra: bytes = NO_EXTRA
) -> bytes:
    """The digest of one block: ``H(parent || extra || tokens as LE uint32)``.

    ``parent`` is the previous block's digest (``root_digest(key)`` for the
    first block), ``extra`` the block's extra-key digest (``NO_EXTRA`` if none).
    Token ids must be ints in [0, 2**32); bools are not token ids. A block of
    more than ``SEGMENT_TOKENS`` tokens is folded segment by segment (module
    docstring).
    """
    key = _check_key(key)
    parent = _check_digest(parent, "parent")
    extra = _check_digest(extra, "extra")
    tokens = _token_array(token_ids)
    if tokens.size == 0:
        raise InvalidInputError("is empty; a block needs at least one token id", argument="token_ids",
                                fix="pass the block's token ids")
    return _chain(_hasher(key).copy(), parent, _le32_bytes(tokens), 0, 1, tokens.size, [extra])[0]


def hash_block_chain(
    key: bytes,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    extras: Sequence[bytes] | None = None,
    parent: bytes | None = None,
    start_block: int = 0,
) -> list[bytes]:
    """The chained digests of the full blocks of ``token_ids`` from ``start_block`` on.

    Block ``b`` covers ``token_ids[b*block_size : (b+1)*block_size]``; a
    trailing partial block is not hashed. ``parent`` is the digest of block
    ``start_block - 1`` (required when ``start_block > 0``; defaults to
    ``root_digest(key)`` when ``start_block == 0``), so a growing request is
    hashed incrementally by passing its last digest and the next block index.
    ``extras[i]`` is the extra-key digest of block ``start_block + i`` (e.g.
    from :func:`extra_key_digests` with the same ``first_block``); it must cover
    every block hashed, further entries are ignored; None means NO_EXTRA.

    Invariant: the result has ``max(0, len(token_ids)//block_size - start_block)``
    entries and ``result[i] == block_digest(key, result[i-1], block i tokens, extras[i])``.
    """
    key = _check_key(key)
    block_size = check_int(block_size, "block_size", minimum=1)
    start_block = check_int(start_block, "start_block", minimum=0)
    if parent is None:
        if start_block > 0:
            raise InvalidInputError("is required when start_block > 0", argument="parent",
                                    fix="pass the digest of block start_block-1")
        parent = root_digest(key)
    parent = _check_digest(parent, "parent")
    num_full = len(token_ids) // block_size
    count = max(0, num_full - start_block)
    if extras is not None and len(extras) < count:
        raise InvalidInputError(
            f"has {len(extras)} entries but {count} blocks are hashed (blocks {start_block}..{num_full - 1})",
            argument="extras", fix="give one extra-key digest per block",
        )
    if count == 0:
        return []
    lo = start_block * block_size
    tokens = _token_array(token_ids[lo : num_full * block_size], "token_ids", lo)
    ext = None if extras is None else _digest_list(extras, count, "extras")
    return _chain(_hasher(key).copy(), parent, _le32_bytes(tokens), 0, count, block_size, ext)


# --------------------------------------------------------------------------
# Extra keys
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class MMItem:
    """A multimodal item occupying token positions ``[offset, offset + length)``.

    ``hash`` is the item's content hash (any non-empty string, e.g. a hex
    digest of the image). ``offset >= 0`` and ``length >= 1``.
    """

    offset: int
    length: int
    hash: str

    def __post_init__(self) -> None:
        check_int(self.offset, "MMItem.offset", minimum=0)
        check_int(self.length, "MMItem.length", minimum=1)
        fix = "pass the item's content hash (e.g. a hex digest of the image) as a str"
        if not isinstance(self.hash, str):
            raise InvalidTypeError(f"must be a str, not {type_name(self.hash)}", argument="MMItem.hash", fix=fix)
        if not self.hash:
            raise InvalidInputError("must be a non-empty str", argument="MMItem.hash", fix=fix)


def _field(tag: int, payload: bytes) -> bytes:
    """One tagged, length-prefixed field: tag (1 byte) || len(payload) (uint32 LE) || payload."""
    if len(payload) >= 1 << 32:
        raise InvalidInputError("a field is longer than 2**32 - 1 bytes", argument="extra keys",
                                fix="give a shorter cache salt or multimodal hash")
    return struct.pack("<BI", tag, len(payload)) + payload


def encode_extra_keys(
    *, lora_id: int | None = None, mm_items: Sequence[MMItem] = (), cache_salt: str | None = None
) -> bytes:
    """The canonical byte encoding of one block's extra keys (b"" when there are none).

    A concatenation of tagged, length-prefixed fields
    ``tag (uint8) || payload length (uint32 LE) || payload``, in this order:

    * ``0x01`` LoRA, if ``lora_id`` is not None: ``lora_id`` as uint64 LE.
    * ``0x02`` one per multimodal item, sorted by (offset, length, hash):
      ``offset`` uint64 LE || ``hash`` UTF-8. Not its length: an item is its
      content (the hash) at a position, as vLLM keys it (the identifier and
      its offset from the block's start), and the length follows from the
      content. So the blocks two ranges of one item both overlap agree, and a
      lookup on a prefix of the prompt may cut an item at its end without
      changing the keys of the blocks before the cut.
    * ``0x03`` cache salt, if ``cache_salt`` is non-empty: the salt UTF-8
      (an empty salt is no salt, as in vLLM).

    The length prefixes make the encoding injective: different extra keys
    never encode to the same bytes.
    """
    fields = []
    if lora_id is not None:
        lora_id = check_lora_id(lora_id, "lora_id")
        fields.append(_field(TAG_LORA, struct.pack("<Q", lora_id)))
    for item in sorted(_check_mm_items(mm_items), key=_mm_sort_key):
        payload = struct.pack("<Q", item.offset) + item.hash.encode("utf-8")
        fields.append(_field(TAG_MM, payload))
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidTypeError(f"must be a str or None, not {type_name(cache_salt)}", argument="cache_salt",
                               fix="pass the salt as a str")
    if cache_salt:
        fields.append(_field(TAG_SALT, cache_salt.encode("utf-8")))
    return b"".join(fields)


def _mm_sort_key(item: MMItem) -> tuple[int, int, str]:
    return (item.offset, item.length, item.hash)


def _check_mm_items(mm_items: Sequence[MMItem]) -> list[MMItem]:
    fix = "pass a list of gpukv.MMItem(offset, length, hash)"
    if isinstance(mm_items, (str, bytes, MMItem)):
        raise InvalidTypeError(f"must be a sequence of MMItem, not {type_name(mm_items)}", argument="mm_items",
                               fix=fix)
    items = list(mm_items)
    for i, item in enumerate(items):
        if not isinstance(item, MMItem):
            raise InvalidTypeError(f"must be an MMItem, not {type_name(item)}", argument=f"mm_items[{i}]", fix=fix)
    return items


def extra_key_digests(
    key: bytes,
    num_blocks: int,
    block_size: int,
    *,
    lora_id: int | None = None,
    mm_items: Sequence[MMItem] = (),
    cache_salt: str | None = None,
    first_block: int = 0,
) -> list[bytes]:
    """The extra-key digests of blocks ``first_block .. first_block + num_blocks - 1``.

    Block ``b`` (tokens ``[b*block_size, (b+1)*block_size)``) has as extra keys
    the LoRA id (every block), each mm item overlapping its token range, and the
    cache salt (block 0 only, so requests with different salts share no block).
    Its digest is ``H(b"gpukv:extra:v3" + encode_extra_keys(...))`` (:func:`keyed_digest`),
    or ``NO_EXTRA`` when it has no extra keys.
    """
    key = _check_key(key)
    num_blocks = check_int(num_blocks, "num_blocks", minimum=0)
    block_size = check_int(block_size, "block_size", minimum=1)
    first_block = check_int(first_block, "first_block", minimum=0)
    items = _check_mm_items(mm_items)
    # Each item lands in the blocks its token range touches: O(items + blocks).
    per_block: list[list[MMItem]] = [[] for _ in range(num_blocks)]
    for item in items:
        lo = max(item.offset // block_size, first_block)
        hi = min((item.offset + item.length - 1) // block_size, first_block + num_blocks - 1)
        for b in range(lo, hi + 1):
            per_block[b - first_block].append(item)
    out = []
    memo: dict[bytes, bytes] = {}  # blocks with equal extra keys (e.g. LoRA only) share a digest
    for i in range(num_blocks):
        salt = cache_salt if first_block + i == 0 else None
        encoded = encode_extra_keys(lora_id=lora_id, mm_items=per_block[i], cache_salt=salt)
        if not encoded:
            out.append(NO_EXTRA)
        else:
            if encoded not in memo:
                memo[encoded] = keyed_digest(key, EXTRA_PREFIX + encoded)
            out.append(memo[encoded])
    return out


# --------------------------------------------------------------------------
# Lanes, and many blocks or requests at once
# --------------------------------------------------------------------------


def digests_to_lanes(digests: Sequence[bytes]) -> np.ndarray:
    """16-byte digests -> uint64 ``[n, 2]`` lanes (``[:, 0]`` = bytes 0..7 LE)."""
    joined = b"".join(_check_digest(d, f"digests[{i}]") for i, d in enumerate(digests))
    return np.frombuffer(joined, dtype="<u8").astype(np.uint64).reshape(-1, 2)


def lanes_to_digests(lanes: np.ndarray) -> list[bytes]:
    """uint64 (or int64) ``[n, 2]`` lanes -> 16-byte digests; undoes :func:`digests_to_lanes`."""
    raw = _check_lanes(lanes, "lanes").astype("<u8").tobytes()
    return [raw[i : i + DIGEST_SIZE] for i in range(0, len(raw), DIGEST_SIZE)]


def _joined_lanes(digests: list[bytes]) -> np.ndarray:
    """Checked 16-byte digests -> uint64 ``[n, 2]`` lanes, in one copy."""
    return np.frombuffer(b"".join(digests), dtype="<u8").astype(np.uint64).reshape(-1, 2)


def block_digests_lanes(
    key: bytes, parents: np.ndarray, tokens: np.ndarray, extras: np.ndarray
) -> np.ndarray:
    """The digests of n independent blocks at once, as lanes.

    ``parents`` and ``extras`` are uint64 (or int64) ``[n, 2]`` lanes, ``tokens``
    an integer ``[n, block_size]`` array of ids in [0, 2**32). Row i of the
    result equals ``block_digest(key, parents[i], tokens[i], extras[i])`` as lanes.
    All n messages are laid out by numpy in one buffer, then hashed in one loop.
    """
    key = _check_key(key)
    parents = _check_lanes(parents, "parents")
    n = parents.shape[0]
    extras = _check_lanes(extras, "extras", n)
    toks = _token_matrix(tokens, n)
    block_size = toks.shape[1]
    if n == 0:
        return np.zeros((0, 2), dtype=np.uint64)
    hasher = _hasher(key).copy()
    if block_size > SEGMENT_TOKENS:  # folded: each row is a chain of segments
        tails, seg_lens = _tails(toks, extras)
        width = sum(seg_lens)
        out = [
            _chain_tails(hasher, p, tails, r * width, 1, seg_lens)[0]
            for r, p in enumerate(lanes_to_digests(parents))
        ]
        return _joined_lanes(out)
    # Message layout of block_digest: parent(16) || extra(16) || tokens (LE u32).
    length = 2 * DIGEST_SIZE + 4 * block_size
    buf = np.empty((n, length), dtype=np.uint8)
    # ascontiguousarray: a byte view needs C order (inputs may be slices or fancy-indexed).
    buf[:, :DIGEST_SIZE] = np.ascontiguousarray(parents, dtype="<u8").view(np.uint8)
    buf[:, DIGEST_SIZE : 2 * DIGEST_SIZE] = np.ascontiguousarray(extras, dtype="<u8").view(np.uint8)
    buf[:, 2 * DIGEST_SIZE :] = np.ascontiguousarray(toks, dtype="<u4").view(np.uint8)
    raw = buf.data.cast("B")  # memoryview(buf); numpy's stubs give ndarray __buffer__ on py>=3.12 only
    reset, update, digest = hasher.reset, hasher.update, hasher.digest
    out = []
    append = out.append
    for i in range(0, n * length, length):
        reset()
        update(raw[i : i + length])
        append(digest(DIGEST_SIZE))
    return _joined_lanes(out)


def hash_requests(
    key: bytes,
    token_lists: Sequence[Sequence[int] | np.ndarray],
    block_size: int,
    extras: Sequence[Sequence[bytes]] | None = None,
) -> list[list[bytes]]:
    """The full-block digest chains of many requests.

    Equals ``[hash_block_chain(key, t, block_size, extras=e) for t, e in ...]``.
    ``extras[r][b]`` is the extra-key digest of block b of request r (at least
    one per full block, further entries ignored; None means NO_EXTRA
    everywhere). The messages of every block of every request, less their
    parents, are laid out by numpy in one go; then each chain is one loop
    over them (one concatenation and one BLAKE3 call per block). Token lists
    may be lists (checked all at once) or 1-D integer arrays.
    """
    key = _check_key(key)
    block_size = check_int(block_size, "block_size", minimum=1)
    num_req = len(token_lists)
    if extras is not None and len(extras) != num_req:
        raise InvalidInputError(f"has {len(extras)} entries, token_lists {num_req}", argument="extras",
                                fix="give one list of extra-key digests per request")
    flat, lengths = _flat_tokens(token_lists, "token_lists")
    nblocks = [n // block_size for n in lengths]
    ext: list[list[bytes]] | None = None
    if extras is not None:
        ext = []
        for r in range(num_req):
            if len(extras[r]) < nblocks[r]:
                raise InvalidInputError(
                    f"has {len(extras[r])} entries but request {r} has {nblocks[r]} full blocks",
                    argument=f"extras[{r}]", fix="give one extra-key digest per full block",
                )
            ext.append(_digest_list(extras[r], nblocks[r], f"extras[{r}]"))
    starts = np.cumsum([0] + lengths)[:-1].tolist()
    blocks = [flat[s0: s0 + nb * block_size] for s0, nb in zip(starts, nblocks, strict=True)]
    return extend_chains(key, [root_digest(key)] * num_req, blocks, block_size, ext)


def extend_chains(key: bytes, parents: Sequence[bytes], blocks: Sequence[np.ndarray], block_size: int,
                  extras: Sequence[Sequence[bytes]] | None = None) -> list[list[bytes]]:
    """The one chain-hashing driver (``hash_requests`` and the reference
    manager's digests both run it): chain r continues from ``parents[r]``
    (the root digest for a new chain) over the full blocks of ``blocks[r]``
    (token ids, a whole number of blocks), with ``extras[r][b]`` the
    extra-key digest of its block b (None: NO_EXTRA everywhere). Arguments
    are taken as checked. The messages of every block of every chain, less
    their parents, are laid out by numpy in one go; then each chain is one
    loop over them (one concatenation and one BLAKE3 call per block and
    segment), so the cost per block is the same for one chain as for many."""
    nblocks = [len(b) // block_size for b in blocks]
    total = sum(nblocks)
    if total == 0:
        return [[] for _ in blocks]
    rows = np.concatenate([np.asarray(b[: nb * block_size]) for b, nb in zip(blocks, nblocks, strict=True)])
    ext_lanes = None
    if extras is not None:
        ext_lanes = _joined_lanes([d for e, nb in zip(extras, nblocks, strict=True) for d in e[:nb]])
    tails, seg_lens = _tails(rows.reshape(total, block_size), ext_lanes)
    width = sum(seg_lens)
    hasher = _hasher(key).copy()
    result: list[list[bytes]] = []
    at = 0
    for parent, nb in zip(parents, nblocks, strict=True):
        result.append(_chain_tails(hasher, parent, tails, at, nb, seg_lens))
        at += nb * width
    return result
