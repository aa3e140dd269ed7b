"""The block-hash scheme, host implementation.

A KV block is identified by a chained, keyed 128-bit digest (DESIGN.md §2,
"Block hashing")::

    digest(block j) = SipHash-2-4-128(key, parent || tokens || extra)

    parent = digest(block j-1), or root_digest(key) for block 0   (16 bytes)
    tokens = the block's token ids, each as a little-endian uint32 (4*block_size bytes)
    extra  = the block's extra-key digest (16 bytes), NO_EXTRA (zeros) when none

so two blocks share a digest only if their whole prefixes (and extra keys)
agree. Everything here is deterministic given the key; the device kernels must
reproduce it bit for bit.

Conventions shared with the device:

* A digest is 16 bytes: the SipHash-2-4 128-bit output as the reference C
  implementation writes it. Its two 64-bit *lanes* are
  ``lo = int.from_bytes(d[0:8], "little")`` and ``hi = int.from_bytes(d[8:16],
  "little")``; numpy arrays of lanes here are uint64 ``[n, 2]`` (``[:, 0]`` = lo),
  the device stores the same bits as int64.
* The key is 16 bytes: ``k0`` = bytes 0..7 little-endian, ``k1`` = bytes 8..15.

Byte layouts fixed by this module (changing any of them changes every digest,
so each carries a version tag):

* root digest  = ``siphash128(key, b"gpukv:root:v1")``
* extra keys   = ``siphash128(key, b"gpukv:extra:v1" + fields)``, see
  :func:`encode_extra_keys` for the fields.
* key from ``PYTHONHASHSEED`` = first 16 bytes of
  ``sha256(b"gpukv:hash-key:PYTHONHASHSEED:v1\\x00" + str(int(seed)).encode())``,
  see :func:`resolve_hash_key`.

Two implementations compute the same digests: a pure-Python one
(:func:`siphash128`, :func:`block_digest`, :func:`hash_block_chain`), readable
and used as the specification, and a numpy one vectorised across messages
(:func:`siphash128_lanes`, :func:`block_digests_lanes`, :func:`hash_requests`)
for hashing many requests at once. The tests hold them equal.
"""

from __future__ import annotations

import array
import hashlib
import logging
import os
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = [
    "DIGEST_SIZE",
    "KEY_SIZE",
    "NO_EXTRA",
    "HASH_KEY_ENV",
    "MMItem",
    "siphash64",
    "siphash128",
    "resolve_hash_key",
    "root_digest",
    "block_digest",
    "encode_extra_keys",
    "extra_key_digests",
    "hash_block_chain",
    "siphash128_lanes",
    "block_digests_lanes",
    "hash_requests",
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

ROOT_MESSAGE = b"gpukv:root:v1"
EXTRA_PREFIX = b"gpukv:extra:v1"
SEED_KEY_PREFIX = b"gpukv:hash-key:PYTHONHASHSEED:v1\x00"

# Extra-key field tags (see encode_extra_keys).
TAG_LORA = 0x01
TAG_MM = 0x02
TAG_SALT = 0x03

TOKEN_LIMIT = 1 << 32  # token ids are stored as uint32
_MASK64 = (1 << 64) - 1

# SipHash initial state constants: "somepseudorandomlygeneratedbytes".
_C0 = 0x736F6D6570736575
_C1 = 0x646F72616E646F6D
_C2 = 0x6C7967656E657261
_C3 = 0x7465646279746573

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
        raise TypeError(
            "hash key must be 16 bytes, not str; "
            "use resolve_hash_key(hex_string) to turn 32 hex characters into a key"
        )
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"hash key must be 16 bytes, not {type(key).__name__}; "
            "get one from resolve_hash_key()"
        )
    key = bytes(key)
    if len(key) != KEY_SIZE:
        raise ValueError(
            f"hash key must be {KEY_SIZE} bytes, got {len(key)}; "
            "get one from resolve_hash_key()"
        )
    return key


def _check_digest(value: Any, what: str) -> bytes:
    """Return ``value`` as 16 bytes, or raise naming ``what``."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be a {DIGEST_SIZE}-byte digest, not {type(value).__name__}")
    value = bytes(value)
    if len(value) != DIGEST_SIZE:
        raise ValueError(f"{what} must be a {DIGEST_SIZE}-byte digest, got {len(value)} bytes")
    return value


def _check_int(value: Any, what: str, *, minimum: int) -> int:
    """Return ``value`` as int if it is an integer (not bool) >= ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def _bad_token(value: Any, where: str) -> Exception:
    """The exception for one bad token id at position ``where``."""
    if isinstance(value, (bool, np.bool_)):
        return TypeError(f"{where} is a bool ({value}); token ids must be ints")
    if isinstance(value, (int, np.integer)):
        return ValueError(
            f"{where} = {int(value)} is out of range; token ids must be in [0, 2**32)"
        )
    return TypeError(
        f"{where} has type {type(value).__name__}; token ids must be ints "
        "(Python or numpy integers) in [0, 2**32)"
    )


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
        raise TypeError(f"{name} must be a sequence of int token ids, not {type(tokens).__name__}")
    if isinstance(tokens, np.ndarray) or (
        not isinstance(tokens, (list, tuple)) and hasattr(tokens, "__array__")
    ):
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got an array of shape {arr.shape}")
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
        arr = np.frombuffer(array.array(_U32_CODE, tokens), dtype=np.uint32)
    except (TypeError, OverflowError, ValueError):
        arr = None
    if arr is not None:
        for i in np.flatnonzero(arr <= 1).tolist():
            if isinstance(tokens[i], (bool, np.bool_)):
                raise _bad_token(tokens[i], f"{name}[{base + i}]")
        return arr
    # Slow path, only to say which position is bad.
    for i, t in enumerate(tokens):
        if (
            isinstance(t, (bool, np.bool_))
            or not isinstance(t, (int, np.integer))
            or not 0 <= int(t) < TOKEN_LIMIT
        ):
            raise _bad_token(t, f"{name}[{base + i}]")
    # Every element is a valid int; what failed was the sequence itself.
    raise TypeError(f"{name} must be a sequence of int token ids, not {type(tokens).__name__}")


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
        raise ValueError(
            f"tokens must have shape [n={n}, block_size>=1], got {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        raise TypeError(f"tokens must be an integer array, got dtype {arr.dtype}")
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
    if arr.dtype != np.uint64:
        raise TypeError(f"{what} must be a uint64 (or int64) array of lanes, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != 2 or (n is not None and arr.shape[0] != n):
        want = "n" if n is None else str(n)
        raise ValueError(f"{what} must have shape [{want}, 2], got {arr.shape}")
    return arr


# --------------------------------------------------------------------------
# SipHash-2-4, pure Python (the specification)
# --------------------------------------------------------------------------


def _sipround(v0: int, v1: int, v2: int, v3: int) -> tuple[int, int, int, int]:
    """One SipRound on 64-bit words (Python ints kept in [0, 2**64))."""
    # Rotations are written out inline: this is the hot loop of the pure path.
    v0 = (v0 + v1) & _MASK64
    v1 = ((v1 << 13) | (v1 >> 51)) & _MASK64
    v1 ^= v0
    v0 = ((v0 << 32) | (v0 >> 32)) & _MASK64
    v2 = (v2 + v3) & _MASK64
    v3 = ((v3 << 16) | (v3 >> 48)) & _MASK64
    v3 ^= v2
    v0 = (v0 + v3) & _MASK64
    v3 = ((v3 << 21) | (v3 >> 43)) & _MASK64
    v3 ^= v0
    v2 = (v2 + v1) & _MASK64
    v1 = ((v1 << 17) | (v1 >> 47)) & _MASK64
    v1 ^= v2
    v2 = ((v2 << 32) | (v2 >> 32)) & _MASK64
    return v0, v1, v2, v3


def _siphash(key: Any, data: Any, wide: bool) -> bytes:
    """SipHash-2-4 of ``data`` under ``key``: 8 bytes, or 16 when ``wide``."""
    k0, k1 = struct.unpack("<QQ", _check_key(key))
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, not {type(data).__name__}")
    data = bytes(data)
    v0, v1, v2, v3 = k0 ^ _C0, k1 ^ _C1, k0 ^ _C2, k1 ^ _C3
    if wide:
        v1 ^= 0xEE  # the 128-bit variant's tweak of the initial state
    # Compression: the message as little-endian 64-bit words, the last one
    # holding the leftover bytes and (length mod 256) in its top byte.
    nfull = len(data) // 8
    words = list(struct.unpack_from(f"<{nfull}Q", data))
    words.append(((len(data) & 0xFF) << 56) | int.from_bytes(data[8 * nfull :], "little"))
    for m in words:
        v3 ^= m
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0 ^= m
    # Finalisation: 4 rounds per 64-bit output word.
    v2 ^= 0xEE if wide else 0xFF
    for _ in range(4):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    out = (v0 ^ v1 ^ v2 ^ v3).to_bytes(8, "little")
    if wide:
        v1 ^= 0xDD
        for _ in range(4):
            v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        out += (v0 ^ v1 ^ v2 ^ v3).to_bytes(8, "little")
    return out


def siphash64(key: bytes, data: bytes) -> bytes:
    """SipHash-2-4 with 64-bit output: 8 bytes, little-endian as the reference writes them."""
    return _siphash(key, data, wide=False)


def siphash128(key: bytes, data: bytes) -> bytes:
    """SipHash-2-4 with 128-bit output: 16 bytes, as the reference implementation writes them.

    Bytes 0..7 are the first output word (lane ``lo``), bytes 8..15 the second
    (lane ``hi``), each little-endian.
    """
    return _siphash(key, data, wide=True)


# --------------------------------------------------------------------------
# Key handling
# --------------------------------------------------------------------------


def _parse_hex_key(text: str, source: str) -> bytes:
    """Parse 32 hex characters (surrounding whitespace ignored) into a key."""
    text = text.strip()
    if len(text) != 2 * KEY_SIZE:
        raise ValueError(
            f"{source} must be {2 * KEY_SIZE} hex characters ({KEY_SIZE} bytes), "
            f"got {len(text)} characters"
        )
    if any(c not in "0123456789abcdefABCDEF" for c in text):
        raise ValueError(f"{source} must contain only hex digits 0-9, a-f")
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
        raise ValueError(
            "PYTHONHASHSEED must be 'random' or an integer in [0, 4294967295] "
            f"to derive a gpukv hash key from it; or set {HASH_KEY_ENV}"
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

    Raises ValueError (saying what is expected, never the value) for a key of
    the wrong length or with non-hex characters.
    """
    if key is not None:
        if isinstance(key, str):
            return _parse_hex_key(key, "hash key string")
        return _check_key(key)
    env_key = os.environ.get(HASH_KEY_ENV, "")
    if env_key.strip():
        logger.debug("gpukv hash key taken from %s", HASH_KEY_ENV)
        return _parse_hex_key(env_key, HASH_KEY_ENV)
    seed = os.environ.get("PYTHONHASHSEED", "")
    if seed.strip() and seed.strip() != "random":
        logger.debug("gpukv hash key derived from PYTHONHASHSEED")
        return _key_from_hash_seed(seed)
    logger.debug("gpukv hash key drawn at random (os.urandom)")
    return os.urandom(KEY_SIZE)


# --------------------------------------------------------------------------
# Block digests, pure Python
# --------------------------------------------------------------------------


def root_digest(key: bytes) -> bytes:
    """The parent digest of every request's first block: ``siphash128(key, b"gpukv:root:v1")``."""
    return siphash128(key, ROOT_MESSAGE)


def _tokens_le32(tokens: np.ndarray) -> bytes:
    """Token ids (validated uint32) as little-endian uint32 bytes."""
    return tokens.astype("<u4", copy=False).tobytes()


def block_digest(
    key: bytes, parent: bytes, token_ids: Sequence[int], extra: bytes = NO_EXTRA
) -> bytes:
    """The digest of one block: ``siphash128(key, parent || tokens as LE uint32 || extra)``.

    ``parent`` is the previous block's digest (``root_digest(key)`` for the
    first block), ``extra`` the block's extra-key digest (``NO_EXTRA`` if none).
    Token ids must be ints in [0, 2**32); bools are not token ids.
    """
    parent = _check_digest(parent, "parent")
    extra = _check_digest(extra, "extra")
    tokens = _token_array(token_ids)
    if tokens.size == 0:
        raise ValueError("a block needs at least one token id; token_ids is empty")
    return siphash128(key, parent + _tokens_le32(tokens) + extra)


def hash_block_chain(
    key: bytes,
    token_ids: Sequence[int],
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
    block_size = _check_int(block_size, "block_size", minimum=1)
    start_block = _check_int(start_block, "start_block", minimum=0)
    if parent is None:
        if start_block > 0:
            raise ValueError(
                "parent is required when start_block > 0: pass the digest of block start_block-1"
            )
        parent = root_digest(key)
    parent = _check_digest(parent, "parent")
    num_full = len(token_ids) // block_size
    count = max(0, num_full - start_block)
    if extras is not None and len(extras) < count:
        raise ValueError(
            f"extras has {len(extras)} entries but {count} blocks are hashed "
            f"(blocks {start_block}..{num_full - 1}); give one extra-key digest per block"
        )
    if count == 0:
        return []
    lo = start_block * block_size
    tokens = _tokens_le32(_token_array(token_ids[lo : num_full * block_size], "token_ids", lo))
    step = 4 * block_size
    out = []
    for i in range(count):
        extra = NO_EXTRA if extras is None else _check_digest(extras[i], f"extras[{i}]")
        parent = siphash128(key, parent + tokens[i * step : (i + 1) * step] + extra)
        out.append(parent)
    return out


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
        _check_int(self.offset, "MMItem.offset", minimum=0)
        _check_int(self.length, "MMItem.length", minimum=1)
        if not isinstance(self.hash, str):
            raise TypeError(f"MMItem.hash must be a str, not {type(self.hash).__name__}")
        if not self.hash:
            raise ValueError("MMItem.hash must be a non-empty string (the item's content hash)")


def _field(tag: int, payload: bytes) -> bytes:
    """One tagged, length-prefixed field: tag (1 byte) || len(payload) (uint32 LE) || payload."""
    if len(payload) >= 1 << 32:
        raise ValueError("an extra-key field is longer than 2**32 - 1 bytes")
    return struct.pack("<BI", tag, len(payload)) + payload


def encode_extra_keys(
    *, lora_id: int | None = None, mm_items: Sequence[MMItem] = (), cache_salt: str | None = None
) -> bytes:
    """The canonical byte encoding of one block's extra keys (b"" when there are none).

    A concatenation of tagged, length-prefixed fields
    ``tag (uint8) || payload length (uint32 LE) || payload``, in this order:

    * ``0x01`` LoRA, if ``lora_id`` is not None: ``lora_id`` as uint64 LE.
    * ``0x02`` one per multimodal item, sorted by (offset, length, hash):
      ``offset`` uint64 LE || ``length`` uint64 LE || ``hash`` UTF-8.
    * ``0x03`` cache salt, if ``cache_salt`` is non-empty: the salt UTF-8
      (an empty salt is no salt, as in vLLM).

    The length prefixes make the encoding injective: different extra keys
    never encode to the same bytes.
    """
    fields = []
    if lora_id is not None:
        lora_id = _check_int(lora_id, "lora_id", minimum=0)
        if lora_id > _MASK64:
            raise ValueError(f"lora_id must be < 2**64, got {lora_id}")
        fields.append(_field(TAG_LORA, struct.pack("<Q", lora_id)))
    for item in sorted(_check_mm_items(mm_items), key=_mm_sort_key):
        payload = struct.pack("<QQ", item.offset, item.length) + item.hash.encode("utf-8")
        fields.append(_field(TAG_MM, payload))
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str or None, not {type(cache_salt).__name__}")
    if cache_salt:
        fields.append(_field(TAG_SALT, cache_salt.encode("utf-8")))
    return b"".join(fields)


def _mm_sort_key(item: MMItem) -> tuple[int, int, str]:
    return (item.offset, item.length, item.hash)


def _check_mm_items(mm_items: Sequence[MMItem]) -> list[MMItem]:
    if isinstance(mm_items, (str, bytes, MMItem)):
        raise TypeError("mm_items must be a sequence of MMItem")
    items = list(mm_items)
    for i, item in enumerate(items):
        if not isinstance(item, MMItem):
            raise TypeError(f"mm_items[{i}] must be an MMItem, not {type(item).__name__}")
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
    Its digest is ``siphash128(key, b"gpukv:extra:v1" + encode_extra_keys(...))``,
    or ``NO_EXTRA`` when it has no extra keys.
    """
    key = _check_key(key)
    num_blocks = _check_int(num_blocks, "num_blocks", minimum=0)
    block_size = _check_int(block_size, "block_size", minimum=1)
    first_block = _check_int(first_block, "first_block", minimum=0)
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
                memo[encoded] = siphash128(key, EXTRA_PREFIX + encoded)
            out.append(memo[encoded])
    return out


# --------------------------------------------------------------------------
# numpy implementation, vectorised across messages
# --------------------------------------------------------------------------


def digests_to_lanes(digests: Sequence[bytes]) -> np.ndarray:
    """16-byte digests -> uint64 ``[n, 2]`` lanes (``[:, 0]`` = bytes 0..7 LE)."""
    joined = b"".join(_check_digest(d, f"digests[{i}]") for i, d in enumerate(digests))
    return np.frombuffer(joined, dtype="<u8").astype(np.uint64).reshape(-1, 2)


def lanes_to_digests(lanes: np.ndarray) -> list[bytes]:
    """uint64 (or int64) ``[n, 2]`` lanes -> 16-byte digests; undoes :func:`digests_to_lanes`."""
    raw = _check_lanes(lanes, "lanes").astype("<u8").tobytes()
    return [raw[i : i + DIGEST_SIZE] for i in range(0, len(raw), DIGEST_SIZE)]


# numpy scalars for the shift amounts, so no per-call conversion of Python ints.
_ROTATIONS = {b: (np.uint64(b), np.uint64(64 - b)) for b in (13, 16, 17, 21, 32)}
_U64_EE = np.uint64(0xEE)
_U64_DD = np.uint64(0xDD)


def _np_rotl(x: np.ndarray, b: int, t: np.ndarray) -> None:
    """``x = rotl(x, b)`` in place on uint64 ``x``; ``t`` is scratch of the same shape."""
    left, right = _ROTATIONS[b]
    np.left_shift(x, left, out=t)
    np.right_shift(x, right, out=x)
    np.bitwise_or(x, t, out=x)


def _np_sipround(v0, v1, v2, v3, t) -> None:
    """One SipRound in place on uint64 arrays (the steps of :func:`_sipround`).

    uint64 array arithmetic wraps modulo 2**64, which is what SipHash wants;
    every step writes into an existing array, so a round allocates nothing.
    """
    v0 += v1
    _np_rotl(v1, 13, t)
    v1 ^= v0
    _np_rotl(v0, 32, t)
    v2 += v3
    _np_rotl(v3, 16, t)
    v3 ^= v2
    v0 += v3
    _np_rotl(v3, 21, t)
    v3 ^= v0
    v2 += v1
    _np_rotl(v1, 17, t)
    v1 ^= v2
    _np_rotl(v2, 32, t)


def _message_buffer(n: int, length: int) -> np.ndarray:
    """A uint8 ``[n, 8*(length//8 + 1)]`` buffer for n messages of ``length`` bytes.

    The caller writes the messages into ``[:, :length]``. The bytes after them
    already hold SipHash's padding: zeros, and ``length mod 256`` in the very
    last byte, so the buffer read as little-endian 64-bit words is exactly the
    word sequence SipHash compresses.
    """
    buf = np.empty((n, 8 * (length // 8 + 1)), dtype=np.uint8)
    buf[:, length:] = 0
    buf[:, -1] = length & 0xFF
    return buf


def _buffer_words(buf: np.ndarray) -> np.ndarray:
    """A filled :func:`_message_buffer` -> native uint64 words ``[W, n]``.

    Word-major, so each compression step reads one contiguous row.
    """
    return np.ascontiguousarray(buf.view("<u8").T).astype(np.uint64, copy=False)


def _siphash128_words(key: bytes, words: np.ndarray) -> np.ndarray:
    """SipHash-2-4-128 of n messages given as ``[W, n]`` words -> uint64 ``[n, 2]`` lanes."""
    k0, k1 = struct.unpack("<QQ", key)
    n = words.shape[1]
    v0 = np.full(n, k0 ^ _C0, dtype=np.uint64)
    v1 = np.full(n, k1 ^ _C1 ^ 0xEE, dtype=np.uint64)
    v2 = np.full(n, k0 ^ _C2, dtype=np.uint64)
    v3 = np.full(n, k1 ^ _C3, dtype=np.uint64)
    t = np.empty(n, dtype=np.uint64)
    out = np.empty((n, 2), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for m in words:  # a Python loop over word positions, never over messages
            v3 ^= m
            _np_sipround(v0, v1, v2, v3, t)
            _np_sipround(v0, v1, v2, v3, t)
            v0 ^= m
        v2 ^= _U64_EE
        for _ in range(4):
            _np_sipround(v0, v1, v2, v3, t)
        out[:, 0] = v0 ^ v1 ^ v2 ^ v3
        v1 ^= _U64_DD
        for _ in range(4):
            _np_sipround(v0, v1, v2, v3, t)
        out[:, 1] = v0 ^ v1 ^ v2 ^ v3
    return out


def siphash128_lanes(key: bytes, messages: np.ndarray) -> np.ndarray:
    """SipHash-2-4-128 of n messages of equal length at once.

    ``messages`` is a uint8 array ``[n, L]`` (row i = message i). Returns uint64
    ``[n, 2]`` lanes; ``lanes_to_digests(result)[i] == siphash128(key, bytes(messages[i]))``.
    """
    key = _check_key(key)
    msgs = np.asarray(messages)
    if msgs.dtype != np.uint8:
        raise TypeError(f"messages must be a uint8 array, got dtype {msgs.dtype}")
    if msgs.ndim != 2:
        raise ValueError(f"messages must have shape [n, L] (one message per row), got {msgs.shape}")
    n, length = msgs.shape
    buf = _message_buffer(n, length)
    buf[:, :length] = msgs
    return _siphash128_words(key, _buffer_words(buf))


def block_digests_lanes(
    key: bytes, parents: np.ndarray, tokens: np.ndarray, extras: np.ndarray
) -> np.ndarray:
    """The digests of n blocks at once, as lanes.

    ``parents`` and ``extras`` are uint64 (or int64) ``[n, 2]`` lanes, ``tokens``
    an integer ``[n, block_size]`` array of ids in [0, 2**32). Row i of the
    result equals ``block_digest(key, parents[i], tokens[i], extras[i])`` as lanes.
    """
    key = _check_key(key)
    parents = _check_lanes(parents, "parents")
    n = parents.shape[0]
    extras = _check_lanes(extras, "extras", n)
    toks = _token_matrix(tokens, n)
    tok_bytes = 4 * toks.shape[1]
    # The message layout of block_digest: parent(16) || tokens(LE u32) || extra(16).
    buf = _message_buffer(n, 2 * DIGEST_SIZE + tok_bytes)
    # ascontiguousarray: a byte view needs C order (inputs may be slices or fancy-indexed).
    buf[:, :DIGEST_SIZE] = np.ascontiguousarray(parents, dtype="<u8").view(np.uint8)
    buf[:, DIGEST_SIZE : DIGEST_SIZE + tok_bytes] = np.ascontiguousarray(toks, dtype="<u4").view(np.uint8)
    end = 2 * DIGEST_SIZE + tok_bytes
    buf[:, DIGEST_SIZE + tok_bytes : end] = np.ascontiguousarray(extras, dtype="<u8").view(np.uint8)
    return _siphash128_words(key, _buffer_words(buf))


def hash_requests(
    key: bytes,
    token_lists: Sequence[Sequence[int]],
    block_size: int,
    extras: Sequence[Sequence[bytes]] | None = None,
) -> list[list[bytes]]:
    """The full-block digest chains of many requests, vectorised across requests.

    Equals ``[hash_block_chain(key, t, block_size, extras=e) for t, e in ...]``.
    ``extras[r][b]`` is the extra-key digest of block b of request r (at least
    one per full block, further entries ignored; None means NO_EXTRA
    everywhere). Block j of every request that has one is hashed in one numpy
    call, so the cost is about (longest chain) calls of width (number of
    requests). Token lists may be lists or 1-D integer arrays; arrays skip the
    per-element Python checks and are much faster to take in.
    """
    key = _check_key(key)
    block_size = _check_int(block_size, "block_size", minimum=1)
    num_req = len(token_lists)
    if extras is not None and len(extras) != num_req:
        raise ValueError(
            f"extras has {len(extras)} entries, token_lists {num_req}: give one list per request"
        )
    tokens = [_checked_tokens(t, f"token_lists[{r}]") for r, t in enumerate(token_lists)]
    nblocks = [len(t) // block_size for t in tokens]
    # Longest chain first, so the requests still active at block j are a prefix
    # of `order`; request order[i]'s block j is row start[i] + j of the flat output.
    order = sorted(range(num_req), key=lambda r: -nblocks[r])
    counts = np.array([nblocks[r] for r in order], dtype=np.int64)
    start = np.zeros(num_req, dtype=np.int64)
    np.cumsum(counts[:-1], out=start[1:])
    total = int(counts.sum())
    extra = np.zeros((total, 2), dtype=np.uint64)
    if extras is not None:
        for i, r in enumerate(order):
            if len(extras[r]) < nblocks[r]:
                raise ValueError(
                    f"extras[{r}] has {len(extras[r])} entries but request {r} has "
                    f"{nblocks[r]} full blocks; give one extra-key digest per full block"
                )
            extra[start[i] : start[i] + nblocks[r]] = digests_to_lanes(extras[r][: nblocks[r]])
    sorted_tokens = [tokens[r] for r in order]
    out = np.empty((total, 2), dtype=np.uint64)
    parents = np.tile(digests_to_lanes([root_digest(key)]), (num_req, 1))
    for j in range(int(counts[0]) if num_req else 0):
        m = int(np.count_nonzero(counts > j))
        lo, hi = j * block_size, (j + 1) * block_size
        # Gathering slices costs no copy of whole requests; the values were
        # range-checked on the way in, so the unsafe cast to uint32 is exact.
        block = np.concatenate(
            [t[lo:hi] for t in sorted_tokens[:m]], dtype=np.uint32, casting="unsafe"
        ).reshape(m, block_size)
        rows = start[:m] + j
        lanes = block_digests_lanes(key, parents[:m], block, extra[rows])
        out[rows] = lanes
        parents[:m] = lanes
    digests = lanes_to_digests(out)
    result: list[list[bytes]] = [[] for _ in range(num_req)]
    for i, r in enumerate(order):
        result[r] = digests[start[i] : start[i] + nblocks[r]]
    return result
