"""The one place where every argument a manager takes is checked and
normalised (the types are ``gpukv.core.requests``'; the block arithmetic
``gpukv.core.blocks``').

Both managers (the reference and the device one) take these same types, so a
serving loop can switch backends without touching its own code, and both
normalise their arguments through the functions below before changing
anything: they accept and refuse exactly the same inputs, with the same
``gpukv.errors`` classes, and after a refusal nothing has changed.

Normalisation, done once per call:

* Containers (``finished``, ``running``, ``new``, ``mm_items``,
  ``block_hashes``, ``sliding_windows``) must be ordered collections: a list,
  tuple, range or other ``Sequence``, or an iterator (a generator, ``map``,
  ``iter(...)``), which is materialised once, before anything is checked, so
  nothing is consumed twice or dropped. A str or bytes (``finished="ab"`` is
  not the ids "a" and "b"), None, a set or dict (their order is not the
  caller's), an array or tensor, or any other object is refused. An exception
  a caller's iterator raises while it is read is an ``InvalidInputError``
  (``__cause__``: what it raised); ragged rows of token ids are refused.
* Request ids are plain ``str``: a subclass (whose own hashing and equality
  would decide which request it names) is refused.
* Token ids become a fresh 1-D int64 numpy array (a copy: a caller that
  changes its list or array afterwards changes nothing in the manager), checked
  for kind, rank and range in one vectorised pass: a list goes through
  ``np.asarray`` once (its element types are read in one C-level pass, so bools
  and floats hidden in a list of ints are found); arrays and CPU tensors must
  be 1-D, integer (not bool), each id in ``[0, 2**32)``. A tensor on a CUDA
  device (tokens a sampler just produced) must be 1-D int32 or int64 and is
  kept as it is, unread: reading it would stop the host until the GPU catches
  up; the device manager checks its ids on the device (an id outside
  ``[0, 2**32)`` is never cached and stops the manager at the step's read:
  ``docs/design.md``, "Errors and fail-stop"), the reference reads it and
  checks it here (``keep_device_tokens=False``). Tensors on any other device
  (``meta``, ...) are refused.
* Everything a ``NewRequest`` carries is checked (request id, LoRA id in
  ``[0, 2**64)``, salt and multimodal hashes encodable as UTF-8, multimodal
  items inside the prompt and not overlapping, ``skip_prefix_cache`` a bool)
  and comes back as a new ``NewRequest`` whose ``token_ids`` is the int64 array
  (or the CUDA tensor), ``mm_items`` a tuple sorted by offset and
  ``block_hashes`` None.
* ``NewRequest.block_hashes`` is deprecated and ignored: its form is still
  checked (one 16-byte digest per full block), a ``DeprecationWarning`` is
  emitted, and the manager computes every digest itself (``docs/design.md``
  says why that is what makes hits exact).
"""

from __future__ import annotations

import array
import os
import warnings
from collections.abc import Callable, Container, Iterator, Mapping, Sequence, Set
from typing import Any

import numpy as np
import torch

from gpukv.core.blocks import ManagerLimits, check_computed_length, min_blocks_to_admit, new_tokens_at_admission
from gpukv.core.hashing import MMItem
from gpukv.core.limits import MAX_LOOKAHEAD, MAX_TOKEN_BUDGET, MAX_TOKEN_ID
from gpukv.core.requests import ComputedBlocks, NewRequest, PrefixHit, RunningUpdate, Step, StepOutputs
from gpukv.errors import (
    CapacityError,
    DuplicateRequestError,
    GpukvInputError,
    InvalidInputError,
    InvalidTypeError,
    StaleComputedBlocksError,
    UnknownRequestError,
    check_int,
    check_lora_id,
    check_utf8,
)
from gpukv.errors import short_repr as _short
from gpukv.errors import type_name as _type_name

_INTS = (int, np.integer)
_BOOLS = (bool, np.bool_)


_NO_OUTPUTS = StepOutputs()


def check_step_outputs(block_ids: Any, prefix_of: Any, known: Container[str], finished: Sequence[str],
                       new: Sequence[NewRequest] = ()) -> StepOutputs:
    """``step``'s ``block_ids`` (a bool) and ``prefix_of`` (None, a request
    held before the step and not finished in it, or one of its new requests:
    its counts come back if it is admitted)."""
    if prefix_of is None and block_ids is False:
        return _NO_OUTPUTS  # (a decode's step: nothing asked besides the decisions)
    if type(block_ids) is not bool:
        raise InvalidTypeError(f"must be a bool, got {_type_name(block_ids)}", argument="block_ids",
                               fix="pass True to get the step's new block ids back, False for none")
    if prefix_of is not None:
        if type(prefix_of) is str and any(r.request_id == prefix_of for r in new):
            return StepOutputs(block_ids, prefix_of)
        check_request_id(prefix_of, "prefix_of", known)
        if prefix_of in finished:
            raise InvalidInputError(f"request {prefix_of!r} is finished in this step", argument="prefix_of",
                                    fix="name a request that runs on (vLLM: the first running request)")
    return StepOutputs(block_ids, prefix_of)


# ------------------------------------------------------------------ scalars

# check_int, check_lora_id and check_utf8 live in gpukv.errors (hashing refuses
# through them too).


# --------------------------------------------------------------- containers

def as_list(value: Any, argument: str, items: str) -> list:
    """An ordered collection (list, tuple, range, other Sequence) or an
    iterator (materialised once) as a new list; anything else is refused with
    an ``InvalidTypeError`` naming ``argument``. ``items`` says what the
    collection holds, for the message."""
    if isinstance(value, (list, tuple)):  # (the common cases first: each abc check below costs a few us)
        return list(value)
    fix = f"pass a list of {items} (an empty list for none)"
    if value is None:
        raise InvalidTypeError(f"got None, expected a list of {items}", argument=argument, fix=fix)
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"got {_type_name(value)} {_short(value)}; a string is not a list of {items}",
                               argument=argument, fix=f"wrap it in a list, e.g. [{_short(value)}]")
    if isinstance(value, (Set, Mapping)):
        raise InvalidTypeError(f"got a {_type_name(value)}, whose order is not yours; the order of {items} matters",
                               argument=argument, fix=f"pass a list of {items} in the order you mean")
    if isinstance(value, (np.ndarray, torch.Tensor)):
        raise InvalidTypeError(f"got a {_type_name(value)}, expected a list of {items}", argument=argument, fix=fix)
    if isinstance(value, (Sequence, Iterator)):
        return read_all(value, argument, items)
    raise InvalidTypeError(f"got {_type_name(value)} {_short(value)}, expected a list of {items}",
                           argument=argument, fix=fix)


def read_all(value: Any, argument: str, items: str) -> list:
    """``list(value)`` for a caller's sequence or iterator; an exception its
    own code raises while being read (a generator that fails midway) is an
    ``InvalidInputError`` naming ``argument``, with that exception as
    ``__cause__`` (a ``KeyboardInterrupt`` is not caught)."""
    try:
        return list(value)
    except Exception as e:
        raise InvalidInputError(f"reading it raised {type(e).__name__}: {_short_text(e)}", argument=argument,
                                fix=f"pass a list of {items}, or an iterator that does not raise") from e


def _short_text(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else "(no message)"
    return text if len(text) <= 80 else text[:77] + "..."


# ------------------------------------------------------------------- tokens

def _token_error(problem: str, argument: str, type_error: bool):
    cls = InvalidTypeError if type_error else InvalidInputError
    return cls(problem, argument=argument, fix="pass a 1-D sequence of int token ids in [0, 2**32)")


def _ids_in_range(arr: np.ndarray) -> bool:
    """Whether every id of a non-empty integer array is in ``[0, 2**32)``: one
    reduction (read as unsigned, a negative id is above the range), where
    finding the bad one takes four."""
    if arr.dtype.itemsize == 8:
        unsigned = arr.view(np.uint64)  # (its largest by argmax: a quarter of a ufunc reduction's cost)
        return unsigned.item(unsigned.argmax()) <= MAX_TOKEN_ID
    return arr.dtype.kind == "u" or int(np.minimum.reduce(arr, axis=None)) >= 0  # (narrower: never above)


def _checked_int_array(arr: np.ndarray, argument: str, label: str, copy: bool = True) -> np.ndarray:
    """An integer array's values checked in one vectorised pass; as int64, a
    fresh copy unless ``copy`` is False (the array is already the manager's)."""
    if arr.size and not _ids_in_range(arr):
        bad = np.flatnonzero((arr > MAX_TOKEN_ID) | (arr < 0)) if arr.dtype.kind == "i" else \
            np.flatnonzero(arr > MAX_TOKEN_ID)
        if bad.size:
            i = int(bad[0])
            raise _token_error(f"{label}token id at position {i} is {int(arr[i])}, outside [0, 2**32)", argument, False)
    return np.array(arr, dtype=np.int64, copy=True) if copy else arr.astype(np.int64, copy=False)


def _tokens_from_list(seq: list, argument: str, label: str) -> np.ndarray:
    if not seq:
        return np.zeros(0, dtype=np.int64)
    types = set(map(type, seq))  # one C-level pass over the elements
    bad_types = {t for t in types if not issubclass(t, _INTS) or issubclass(t, _BOOLS)}
    if bad_types:
        i = next(i for i, t in enumerate(map(type, seq)) if t in bad_types)  # only on the error path
        raise _token_error(f"{label}token id at position {i} is {_short(seq[i])} ({_type_name(seq[i])}); "
                           "token ids must be ints", argument, True)
    try:
        arr = np.asarray(seq, dtype=np.int64)
    except OverflowError:  # an id beyond int64: find it (vectorised on the object array)
        obj = np.asarray(seq, dtype=object)
        i = int(np.flatnonzero((obj < 0) | (obj > MAX_TOKEN_ID))[0])
        raise _token_error(f"{label}token id at position {i} is {int(seq[i])}, outside [0, 2**32)",
                           argument, False) from None
    return _checked_int_array(arr, argument, label, copy=False)


# Token lists up to this long are checked element by element in Python (a few
# ints are checked faster in a loop than by a numpy pass); longer ones, and any list
# holding something other than an int in range, take the vectorised path.
_SHORT_TOKENS = 16
_INT64 = np.dtype(np.int64)  # a dtype object: np.array resolves it faster than the np.int64 type


def _short_int_tokens(value: Any) -> np.ndarray | None:
    """A list or tuple of plain ints, each in ``[0, 2**32)``, as a fresh int64
    array; None for anything else (the caller then takes the general path,
    which gives the same array or raises the same error). Short ones are
    checked in a loop; longer ones by one pass over the element types and
    one conversion to C unsigned 32-bit ints, which checks the range (no
    label or argument name is built)."""
    kind = type(value)
    if kind is not list and kind is not tuple:
        return None
    if len(value) <= _SHORT_TOKENS:
        for x in value:
            if type(x) is not int or not 0 <= x <= MAX_TOKEN_ID:
                return None
        return np.array(value, _INT64)
    if list(map(type, value)).count(int) != len(value):  # plain ints only (a bool is an int to array)
        return None
    try:  # C unsigned 32-bit: it raises OverflowError for an id outside [0, 2**32)
        packed = array.array(_U32_CODE, value)
    except OverflowError:
        return None
    return np.frombuffer(packed, _UINT32).astype(_INT64)


_UINT32 = np.dtype(np.uint32)
# The array module's code for a 32-bit unsigned C int ("I" on every platform
# torch supports; checked, since C only promises 16 bits).
_U32_CODE = next(c for c in "IL" if array.array(c).itemsize == 4)


def normalize_token_ids(value: Any, argument: str, request_id: str | None = None, *,
                        keep_device: bool = True) -> np.ndarray | torch.Tensor:
    """Token ids as a fresh 1-D int64 array (a CUDA tensor is kept, unread,
    unless ``keep_device`` is False: the host manager reads and checks it),
    or an ``InvalidTypeError``/``InvalidInputError`` naming ``argument``."""
    fast = _short_int_tokens(value)
    if fast is not None:
        return fast
    label = f"(request {request_id!r}) " if request_id is not None else ""
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int32, torch.int64):
            raise InvalidTypeError(f"{label}a token tensor must be 1-D int32 or int64, got {value.dtype} "
                                   f"of shape {tuple(value.shape)}", argument=argument,
                                   fix="convert it with .to(torch.int64)")
        if value.dim() != 1:
            raise InvalidInputError(f"{label}a token tensor must be 1-D int32 or int64, got shape "
                                    f"{tuple(value.shape)}", argument=argument,
                                    fix="pass one request's tokens as a 1-D tensor (one request per row)")
        if value.device.type == "cuda":
            if keep_device:
                return value  # checked on the device (``DeviceManager``: a fault at the step's read)
            value = value.cpu()  # the reference reads it (it runs on the host anyway)
        if value.device.type != "cpu":
            raise InvalidTypeError(f"{label}a token tensor on device {value.device} cannot be read",
                                   argument=argument, fix="pass it on the CPU or a CUDA device")
        value = value.numpy()
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise InvalidInputError(f"{label}token ids must be 1-D, got an array of shape {value.shape}",
                                    argument=argument,
                                    fix="pass one request's tokens as a 1-D array (one request per row)")
        if value.dtype.kind == "O":
            return _tokens_from_list(value.tolist(), argument, label)
        if value.dtype.kind not in "iu":
            raise _token_error(f"{label}token ids must be ints, got an array of {value.dtype}", argument, True)
        return _checked_int_array(value, argument, label)
    if isinstance(value, (str, bytes, bytearray, memoryview, Set, Mapping)) or value is None:
        raise InvalidTypeError(f"{label}token ids must be a sequence of ints, got {_type_name(value)}",
                               argument=argument, fix="pass a list, tuple, 1-D array or tensor of int token ids")
    if isinstance(value, (Sequence, Iterator)):
        return _tokens_from_list(read_all(value, argument, "int token ids"), argument, label)
    raise InvalidTypeError(f"{label}token ids must be a sequence of ints, got {_type_name(value)}",
                           argument=argument, fix="pass a list, tuple, 1-D array or tensor of int token ids")


def check_token_ids(token_ids: Any, what: str) -> np.ndarray | torch.Tensor:
    """``normalize_token_ids`` under its older name: ``token_ids`` as a fresh
    int64 array (a CUDA tensor as it is), errors naming ``what``."""
    return normalize_token_ids(token_ids, what)


def token_array_for_host(tokens: np.ndarray | torch.Tensor) -> np.ndarray:
    """Normalised token ids as an int64 host array: a CUDA tensor is read here
    (its ids taken modulo 2**32, as the device manager stores them)."""
    if isinstance(tokens, torch.Tensor):
        return tokens.to("cpu", torch.int64).numpy() & MAX_TOKEN_ID
    return tokens


# ------------------------------------------------------------- new requests

def normalize_mm_items(value: Any, argument: str, label: str, num_tokens: int) -> tuple[MMItem, ...]:
    """``value``'s multimodal items, checked (each an ``MMItem`` inside the
    first ``num_tokens`` tokens, none overlapping another) and sorted."""
    items = as_list(value, argument, "MMItem")
    out = []
    for i, item in enumerate(items):
        where = f"{argument}[{i}]"
        if not isinstance(item, MMItem):
            raise InvalidTypeError(f"{label}must be an MMItem, got {_type_name(item)}", argument=where,
                                   fix="pass gpukv.MMItem(offset, length, hash) items")
        offset = check_int(item.offset, f"{where}.offset", minimum=0)
        length = check_int(item.length, f"{where}.length", minimum=1)
        if not isinstance(item.hash, str) or not item.hash:
            raise InvalidTypeError(f"{label}the item's hash must be a non-empty str", argument=f"{where}.hash",
                                   fix="pass the item's content hash as a str")
        check_utf8(item.hash, f"{where}.hash")
        if offset + length > num_tokens:
            raise InvalidInputError(f"{label}the item covers tokens [{offset}, {offset + length}), outside the "
                                    f"prompt's {num_tokens} tokens", argument=where,
                                    fix="give items that lie inside the request's tokens")
        out.append(MMItem(offset, length, item.hash))
    out.sort(key=lambda m: (m.offset, m.length, m.hash))
    for a, b in zip(out, out[1:], strict=False):  # neighbours
        if b.offset < a.offset + a.length:
            raise InvalidInputError(f"{label}items [{a.offset}, {a.offset + a.length}) and [{b.offset}, "
                                    f"{b.offset + b.length}) overlap", argument=argument,
                                    fix="give each token position to at most one multimodal item")
    return tuple(out)


def _check_block_hashes(value: Any, argument: str, label: str, num_full: int) -> None:
    """The deprecated digests' form: one 16-byte digest per full block (the
    element types and lengths are read in C-level passes, not a Python loop)."""
    digests = as_list(value, argument, "16-byte digests")
    fix = "drop block_hashes (deprecated and ignored: the manager computes every digest itself)"
    bad_types = {t for t in set(map(type, digests)) if not issubclass(t, (bytes, bytearray, memoryview))}
    if bad_types:
        i = next(i for i, d in enumerate(digests) if type(d) in bad_types)  # only on the error path
        raise InvalidTypeError(f"{label}block_hashes[{i}] is {_type_name(digests[i])}, not a 16-byte digest",
                               argument=argument, fix=fix)
    lengths = set(map(len, digests))
    if len(digests) != num_full or lengths - {16}:
        raise InvalidInputError(f"{label}must be {num_full} digests of 16 bytes (one per full block), got "
                                f"{len(digests)} of lengths {sorted(lengths)}", argument=argument, fix=fix)


def normalize_new_request(r: Any, argument: str, block_size: int, *,
                          keep_device: bool = True) -> tuple[NewRequest, bool]:
    """A ``NewRequest`` checked on its own (no manager state) and normalised
    (see the module docstring); also whether it carried ``block_hashes``."""
    if not isinstance(r, NewRequest):
        raise InvalidTypeError(f"must be a NewRequest, got {_type_name(r)}", argument=argument,
                               fix="wrap each request in gpukv.NewRequest(request_id, token_ids, ...)")
    rid = r.request_id
    if type(rid) is not str:
        raise request_id_type_error(rid, f"{argument}.request_id")
    if not rid:
        raise InvalidInputError("request ids are non-empty strings, got ''", argument=f"{argument}.request_id",
                                fix="pass a non-empty str request id")
    label = f"(request {rid!r}) "
    tokens: Any = _short_int_tokens(r.token_ids)  # the common case, without building the argument's name
    if tokens is None:
        tokens = normalize_token_ids(r.token_ids, f"{argument}.token_ids", rid, keep_device=keep_device)
    n = len(tokens)
    if n == 0:
        raise InvalidInputError(f"{label}new request has no tokens", argument=f"{argument}.token_ids",
                                fix="give a new request at least one token")
    lora = r.lora_id
    if lora is not None:
        lora = check_lora_id(lora, f"{argument}.lora_id", label)
    salt = r.cache_salt
    if salt is not None:
        if not isinstance(salt, str):
            raise InvalidTypeError(f"{label}cache_salt must be a str or None, got {_type_name(salt)}",
                                   argument=f"{argument}.cache_salt", fix="pass the salt as a str")
        check_utf8(salt, f"{argument}.cache_salt")
    skip = r.skip_prefix_cache
    if not isinstance(skip, _BOOLS):
        raise InvalidTypeError(f"{label}skip_prefix_cache must be a bool, got {_type_name(skip)} {_short(skip)}",
                               argument=f"{argument}.skip_prefix_cache", fix="pass True or False")
    mm: tuple[MMItem, ...] = ()
    if type(r.mm_items) is not tuple or r.mm_items:  # () is the default: nothing to check
        mm = normalize_mm_items(r.mm_items, f"{argument}.mm_items", label, n)
    if r.block_hashes is not None:
        _check_block_hashes(r.block_hashes, f"{argument}.block_hashes", label, n // block_size)
    chunk = None
    if r.num_tokens_to_compute is not None:
        chunk = check_chunk(r.num_tokens_to_compute, f"{argument}.num_tokens_to_compute", n, label)
    lookahead = r.num_lookahead_tokens
    if type(lookahead) is not int or lookahead != 0:  # 0, the default, needs no check
        lookahead = check_lookahead(lookahead, f"{argument}.num_lookahead_tokens")
    preemptions = r.num_preemptions
    if type(preemptions) is not int or preemptions != 0:
        preemptions = check_int(preemptions, f"{argument}.num_preemptions", minimum=0,
                                fix="pass how often the request was preempted before, 0 for a new one")
    return (NewRequest(rid, tokens, lora, mm, salt, bool(skip), None, chunk, lookahead, preemptions),  # type: ignore[arg-type]  # normalised: an int64 array (or a CUDA tensor), not a list
            r.block_hashes is not None)


def check_chunk(value: Any, argument: str, remaining: int, label: str) -> int:
    """A chunk size: an int in ``[1, remaining]`` (``remaining``: the
    request's known tokens not computed yet)."""
    fix = "pass None to compute every known token, or an int from 1 to the tokens not computed yet"
    k = check_int(value, argument, fix=fix)
    if remaining == 0:
        raise InvalidInputError(f"{label}has no token left to compute (every known token is computed), "
                                f"got num_tokens_to_compute={k}", argument=argument,
                                fix="append new tokens first, or leave num_tokens_to_compute=None")
    if not 1 <= k <= remaining:
        raise InvalidInputError(f"{label}num_tokens_to_compute must be in [1, {remaining}] (its known tokens not "
                                f"computed yet), got {k}", argument=argument, fix=fix)
    return k


def check_token_budget(value: Any) -> int | None:
    """A step's ``token_budget``: None (no budget) or an int >= 0, the tokens
    its new requests may compute beyond their hits (vLLM's ``token_budget``
    as its waiting loop starts, after the running requests took theirs)."""
    if value is None:
        return None
    return check_int(value, "token_budget", minimum=0, maximum=MAX_TOKEN_BUDGET,
                     fix=f"pass the tokens left for new requests this step, from 0 (admit none) to "
                         f"{MAX_TOKEN_BUDGET}, or None for no budget")


def check_lookahead(value: Any, argument: str) -> int:
    """A lookahead slot count: an int from 0 to ``MAX_LOOKAHEAD``."""
    return check_int(value, argument, minimum=0, maximum=MAX_LOOKAHEAD,
                     fix=f"pass how many speculative tokens to reserve slots for, from 0 (none) to {MAX_LOOKAHEAD}")


# -------------------------------------------------------------- whole calls

def stale_computed_blocks() -> StaleComputedBlocksError:
    """``allocate_slots``' refusal of computed blocks that a lookup of the
    request does not find now (both managers)."""
    return StaleComputedBlocksError("the computed blocks are not what a lookup of this request finds now (evicted "
                                    "since the lookup, or another request's: other tokens, salt, LoRA id or "
                                    "multimodal items)", argument="computed",
                                    fix="call get_computed_blocks(request) for this request and pass its result")


def unknown_request(rid: Any, argument: str = "request_id") -> UnknownRequestError:
    """The one error for a request id a manager does not hold."""
    return UnknownRequestError(f"unknown request id {rid!r}: it was never admitted or was already freed",
                               argument=argument, fix="pass the id of a request this manager holds")


def request_id_type_error(rid: Any, argument: str) -> InvalidTypeError:
    """The one error for a request id that is not a plain ``str``: another
    type, or a ``str`` subclass (its own hashing and equality, which may
    fail or disagree with the str's, would decide which request it names)."""
    if isinstance(rid, str):
        return InvalidTypeError(f"request ids are plain str, got an instance of the str subclass {_type_name(rid)}",
                                argument=argument, fix="pass a plain str id (e.g. str.__str__(request_id))")
    return InvalidTypeError(f"request ids are str, got {_type_name(rid)} {_short(rid)}", argument=argument,
                            fix="pass the request's str id")


def check_request_id(rid: Any, argument: str, known: Container[str]) -> str:
    """A request id (a plain ``str``) the manager holds, or raise naming ``argument``."""
    if type(rid) is not str:
        raise request_id_type_error(rid, argument)
    if rid not in known:
        raise unknown_request(rid, argument)
    return rid


def check_request_ids(value: Any, argument: str, known: Container[str]) -> list[str]:
    """A list of request ids the manager holds (a sequence or iterator, not
    a str), each checked as ``check_request_id`` does."""
    ids = as_list(value, argument, "request ids (str)")
    for i, rid in enumerate(ids):
        check_request_id(rid, f"{argument}[{i}]", known)
    return ids


def check_group(value: Any, num_groups: int) -> int:
    """A KV-cache group's index, ``0 <= group < num_groups``."""
    group = check_int(value, "group", minimum=0, fix="pass a KV-cache group's index (0 for the first)")
    if group >= num_groups:
        raise InvalidInputError(f"group {group} does not exist: the manager has {num_groups} KV-cache groups",
                                argument="group", fix=f"pass 0 to {num_groups - 1}")
    return group


def check_block_spans(value: Any, argument: str, num_blocks_of: Callable[[str], int]) -> list[tuple[str, int, int]]:
    """``(request_id, start, end)`` spans of block positions, each inside the
    request's blocks: ``0 <= start <= end <= num_blocks_of(request_id)``
    (``num_blocks_of`` raises for a request the manager does not hold)."""
    spans = as_list(value, argument, "(request_id, start, end) tuples")
    out = []
    for i, span in enumerate(spans):
        if not isinstance(span, tuple) or len(span) != 3:
            raise InvalidTypeError(f"{argument}[{i}] must be a (request_id, start, end) tuple, got {_short(span)}",
                                   argument=argument, fix="pass one (request_id, start, end) tuple per request")
        rid, start, end = span
        n = num_blocks_of(rid)
        start = check_int(start, f"{argument}[{i}][1]", minimum=0, fix="pass a block position >= 0")
        end = check_int(end, f"{argument}[{i}][2]", minimum=0, fix="pass a block position >= 0")
        if not start <= end <= n:
            raise InvalidInputError(f"{argument}[{i}]: positions [{start}, {end}) are not inside request {rid!r}'s "
                                    f"{n} blocks", argument=argument,
                                    fix="pass 0 <= start <= end <= the request's blocks (len(get_block_ids(id)[g]))")
        out.append((rid, start, end))
    return out


def _warn_block_hashes() -> None:
    warnings.warn(
        "NewRequest.block_hashes is deprecated and ignored: the manager computes every digest itself from the "
        "tokens and extra keys (caller-supplied digests could poison the cache); stop passing it",
        DeprecationWarning, stacklevel=_caller_stacklevel(),
    )


# gpukv's root folder: the layers' modules are in its subfolders.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _caller_stacklevel() -> int:
    """The stack level of the first frame outside gpukv's own modules (so the
    warning points at the caller's line)."""
    import sys

    level, frame = 1, sys._getframe(1)
    frame_or_none: Any = frame
    while frame_or_none is not None and \
            os.path.abspath(frame_or_none.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame_or_none = frame_or_none.f_back
        level += 1
    return level


def normalize_step(
    finished: Any,
    running: Any,
    new: Any,
    *,
    known: Container[str],
    limits: ManagerLimits,
    num_tokens: Callable[[str], int] | None = None,
    num_computed: Callable[[str], int] | None = None,
    single: bool = False,
    defer_admissible: bool = False,
    keep_device_tokens: bool = True,
) -> Step:
    """Check and normalise one call's arguments against a manager that holds
    the requests ``known`` (``num_tokens(rid)``: how many tokens one holds, for
    the ``max_model_len`` check of running updates; ``num_computed(rid)``: how
    many of them are computed, for chunk sizes). Raises a ``gpukv.errors``
    class naming the argument; changes nothing anywhere.

    ``single``: the call is ``free(request_id)``, ``allocate_slots(request,
    new_token_ids)`` or ``get_computed_blocks(request)``, one request handed in
    as a one-element ``finished``/``running``/``new``; messages then name
    those arguments (``request_id``, ``request``, ``new_token_ids``).
    ``defer_admissible``: leave ``check_admissible`` to the caller
    (``allocate_slots`` first applies its own chunk and lookahead).
    ``keep_device_tokens``: keep token tensors on a CUDA device unread (the
    device manager checks them on the device); False reads and checks them
    here (the reference)."""
    name = _SingleCallNames() if single else _batch_name
    fin = as_list(finished, "finished", "request ids (str)")
    run = as_list(running, "running", "RunningUpdate")
    nw = as_list(new, "new", "NewRequest")
    done = _checked_finished(fin, known, name)
    updates = _checked_updates(run, done, known, limits, num_tokens, num_computed, name, keep_device_tokens)
    requests = _checked_new_requests(nw, known, limits, defer_admissible, name, keep_device_tokens)
    return Step(tuple(fin), tuple(updates), tuple(requests))


def _batch_name(kind: str, i: int, attr: str = "") -> str:
    """The argument a message names in a batched call: ``running[3].new_token_ids``."""
    return f"{kind}[{i}]" + (f".{attr}" if attr else "")


class _SingleCallNames:
    """The argument a message names in a one-request call (``free``,
    ``allocate_slots``, ``get_computed_blocks``): its own parameters."""

    _RUNNING = {"new_token_ids": "new_token_ids", "num_tokens_to_compute": "num_tokens",
                "num_lookahead_tokens": "num_lookahead_tokens", "num_processed_tokens": "num_processed_tokens"}

    def __call__(self, kind: str, i: int, attr: str = "") -> str:  # noqa: ARG002  (as _batch_name)
        if kind == "finished":
            return "request_id"
        if kind == "running":
            return self._RUNNING.get(attr, "request")
        return "request" + (f".{attr}" if attr else "")


def _checked_finished(fin: list, known: Container[str], name: Callable[..., str]) -> set[str]:
    """Finished ids: each held, none twice (a double free)."""
    done: set[str] = set()
    for i, rid in enumerate(fin):
        check_request_id(rid, name("finished", i), known)
        if rid in done:
            raise DuplicateRequestError(f"request {rid!r} is finished twice in one step (double free)",
                                        argument=name("finished", i), fix="list each finished request once")
        done.add(rid)
    return done


def _checked_updates(run: list, done: set[str], known: Container[str], limits: ManagerLimits,
                     num_tokens: Callable[[str], int] | None, num_computed: Callable[[str], int] | None,
                     name: Callable[..., str], keep_device: bool = True) -> list[RunningUpdate]:
    """Running updates: each a held request's, not finished, once per step,
    its tokens checked and within ``max_model_len``, its chunk and lookahead
    checked."""
    updates = []
    seen: set[str] = set()
    max_model_len = limits.max_model_len if num_tokens is not None else None
    for i, u in enumerate(run):
        if type(u) is not RunningUpdate and not isinstance(u, RunningUpdate):
            raise InvalidTypeError(f"running entries must be RunningUpdate, got {_type_name(u)}",
                                   argument=name("running", i),
                                   fix="wrap each update in gpukv.RunningUpdate(request_id, new_token_ids)")
        rid = u.request_id
        if type(rid) is not str or rid not in known:  # the names are built on the error path only
            check_request_id(rid, name("running", i, "request_id"), known)
        if rid in done:
            raise DuplicateRequestError(f"request {rid!r} is both finished and running in one step",
                                        argument=name("running", i), fix="either finish it or run it")
        if rid in seen:
            raise DuplicateRequestError(f"request {rid!r} has two running updates in one step",
                                        argument=name("running", i), fix="merge its tokens into one RunningUpdate")
        seen.add(rid)
        tokens = _update_tokens(u.new_token_ids, rid, name, i, keep_device)
        if max_model_len is not None and num_tokens is not None:
            total = num_tokens(rid) + len(tokens)
            if total > max_model_len:
                raise CapacityError(f"running request {rid!r} would hold {total} tokens, more than max_model_len "
                                    f"{max_model_len}", argument=name("running", i, "new_token_ids"),
                                    fix="finish the request instead")
        chunk, lookahead = u.num_tokens_to_compute, u.num_lookahead_tokens
        if chunk is not None or type(lookahead) is not int or lookahead != 0:  # (an array is no int: checked)
            chunk, lookahead = _check_running_chunk(u, rid, len(tokens), limits, num_tokens, num_computed,
                                                    name("running", i, "num_tokens_to_compute"),
                                                    name("running", i, "num_lookahead_tokens"))
        processed = u.num_processed_tokens
        if processed is not None:
            processed = _check_processed(processed, rid, len(tokens), chunk, num_tokens, num_computed,
                                         name("running", i, "num_processed_tokens"))
        updates.append(RunningUpdate(rid, tokens, chunk, lookahead, processed))
    return updates


def _check_processed(processed: Any, rid: str, num_new: int, chunk: int | None, num_tokens, num_computed,
                     argument: str) -> int:
    """A running update's ``num_processed_tokens``: an int from 0 to the
    request's computed tokens after the update (its known tokens after the
    append when ``chunk`` is None); the form only without manager state."""
    processed = check_int(processed, argument, minimum=0, fix="pass None, or an int from 0 to the request's "
                          "computed tokens after the update")
    if num_tokens is None or num_computed is None:
        return processed
    after = num_tokens(rid) + num_new if chunk is None else num_computed(rid) + chunk
    if processed > after:
        raise InvalidInputError(f"must be <= {after}, the computed tokens of request {rid!r} after the update, "
                                f"got {processed}", argument=argument,
                                fix=f"pass at most {after} (tokens processed cannot outrun those computed)")
    return processed


def _update_tokens(tokens: Any, rid: str, name: Callable[..., str], i: int, keep_device: bool = True) -> Any:
    """Update ``i``'s new tokens, normalised (a short list of plain ints in
    range, a decode step's usual case, takes a loop, not the general path)."""
    if type(tokens) is list and len(tokens) <= _SHORT_TOKENS:  # _short_int_tokens, inlined for decode steps
        for x in tokens:
            if type(x) is not int or not 0 <= x <= MAX_TOKEN_ID:
                break
        else:
            return np.array(tokens, _INT64)
    return normalize_token_ids(tokens, name("running", i, "new_token_ids"), rid, keep_device=keep_device)


def _checked_new_requests(nw: list, known: Container[str], limits: ManagerLimits, defer_admissible: bool,
                          name: Callable[..., str], keep_device: bool = True) -> list[NewRequest]:
    """New requests: each normalised, its id new, within ``max_model_len``,
    admissible (unless deferred); warns once for deprecated digests."""
    requests = []
    seen: set[str] = set()
    warn = False
    for i, r in enumerate(nw):
        req, given = normalize_new_request(r, name("new", i), limits.block_size, keep_device=keep_device)
        warn |= given
        rid = req.request_id
        if rid in known or rid in seen:
            raise DuplicateRequestError(f"request id {rid!r} is already in use",
                                        argument=name("new", i, "request_id"),
                                        fix="give every live request its own id")
        seen.add(rid)
        n = len(req.token_ids)
        if limits.max_model_len is not None and n > limits.max_model_len:
            raise CapacityError(f"new request {rid!r} has {n} tokens, more than max_model_len "
                                f"{limits.max_model_len}", argument=name("new", i, "token_ids"),
                                fix="shorten the prompt or build the manager with a larger max_model_len")
        if not defer_admissible and not fits_with_no_hit(req, limits):  # (the names are built when it matters)
            check_admissible(req, limits, name("new", i, "num_lookahead_tokens"), name("new", i, "token_ids"))
        requests.append(req)
    if warn:
        _warn_block_hashes()
    return requests


def fits_with_no_hit(req: NewRequest, limits: ManagerLimits) -> bool:
    """Whether a normalised new request with no lookahead fits the pool even
    with no cache hit (every group then holds at most its prompt's blocks)."""
    return req.num_lookahead_tokens == 0 and \
        len(limits.sliding_windows) * -(-len(req.token_ids) // limits.block_size) < limits.num_blocks


def check_admissible(req: NewRequest, limits: ManagerLimits, lookahead_arg: str, tokens_arg: str) -> None:
    """Refuse a normalised new request that could never be admitted: its
    computed tokens plus lookahead slots past ``max_model_len``, or more
    blocks than the whole pool even with the best cache hit."""
    if fits_with_no_hit(req, limits):
        return  # so with any hit
    n, rid = len(req.token_ids), req.request_id
    can_hit = limits.caching and not req.skip_prefix_cache
    if req.num_lookahead_tokens:
        best_hit = (n - 1) // limits.block_size if can_hit else 0
        longest = best_hit * limits.block_size + new_tokens_at_admission(best_hit, n, req.num_tokens_to_compute,
                                                                          limits.block_size)
        check_computed_length(longest, req.num_lookahead_tokens, limits, lookahead_arg, rid, with_best_hit=True)
    need = min_blocks_to_admit(n, limits, can_hit, req.num_tokens_to_compute, req.num_lookahead_tokens)
    if need > limits.num_blocks - 1:
        raise CapacityError(f"new request {rid!r} needs {need} blocks even with the best possible cache hit, "
                            f"more than the whole pool ({limits.num_blocks - 1}); it can never be admitted",
                            argument=tokens_arg, fix="shorten the request or build a larger pool")


def _check_running_chunk(u: RunningUpdate, rid: str, num_new: int, limits: ManagerLimits, num_tokens, num_computed,
                         chunk_arg: str, lookahead_arg: str) -> tuple[int | None, int]:
    """A running update's chunk and lookahead, checked against what the
    request holds: the chunk within its known tokens not computed yet, the
    computed tokens plus lookahead within ``max_model_len``."""
    label = f"(request {rid!r}) "
    lookahead = check_lookahead(u.num_lookahead_tokens, lookahead_arg)
    if num_tokens is None or num_computed is None:  # no manager state: the form only
        chunk = None if u.num_tokens_to_compute is None else check_int(u.num_tokens_to_compute, chunk_arg, minimum=1)
        return chunk, lookahead
    computed = num_computed(rid)
    remaining = num_tokens(rid) + num_new - computed
    chunk = u.num_tokens_to_compute
    if chunk is not None:
        chunk = check_chunk(chunk, chunk_arg, remaining, label)
    check_computed_length(computed + (remaining if chunk is None else chunk), lookahead, limits, lookahead_arg, rid)
    return chunk, lookahead


def check_step_inputs(finished, running, new, *, known: Container[str], block_size: int, num_blocks: int,
                      num_groups: int, max_tokens: int | None = None) -> None:
    """Raise unless a step's inputs make sense for a full-attention manager
    with ``num_groups`` groups holding ``known``; changes nothing. Kept for
    callers of the older API: managers use ``normalize_step``."""
    limits = ManagerLimits(block_size, num_blocks, (None,) * num_groups, max_tokens)
    normalize_step(finished, running, new, known=known, limits=limits)


def normalize_computed(computed: Any, limits: ManagerLimits) -> ComputedBlocks | None:
    """``allocate_slots``' ``computed``: None or a ``ComputedBlocks`` of this
    manager's shape (one list per group, ``num_tokens / block_size`` ints in
    each); whether the blocks are still valid is the manager's to check."""
    if computed is None:
        return None
    fix = "pass what get_computed_blocks returned for this request, or None"
    if not isinstance(computed, ComputedBlocks):
        raise InvalidTypeError(f"must be a ComputedBlocks or None, got {_type_name(computed)}", argument="computed",
                               fix=fix)
    bs, G = limits.block_size, len(limits.sliding_windows)
    num = check_int(computed.num_tokens, "computed.num_tokens", minimum=0, fix=fix)
    groups = as_list(computed.block_ids, "computed.block_ids", "per-group lists of block ids")
    groups = [as_list(g, f"computed.block_ids[{k}]", "block ids") for k, g in enumerate(groups)]
    if num % bs or len(groups) != G or any(len(g) != num // bs for g in groups):
        raise InvalidInputError("the computed blocks do not match this manager's groups and block size",
                                argument="computed", fix=fix)
    top = limits.num_blocks - 1
    for k, g in enumerate(groups):
        if _plain_ids_within(g, top):  # (the common case: no Python per block; the loop gives the same ints)
            continue
        for p, b in enumerate(g):
            groups[k][p] = check_int(b, f"computed.block_ids[{k}][{p}]", minimum=0, maximum=top, fix=fix)
    return ComputedBlocks(groups, num)


def _plain_ids_within(ids: list, top: int) -> bool:
    """Whether every item of ``ids`` is a plain int in ``[0, top]`` (what
    ``check_int`` passes unchanged), in C-level passes."""
    return not ids or (list(map(type, ids)).count(int) == len(ids) and min(ids) >= 0 and max(ids) <= top)


# ------------------------------------------------------------ construction

def normalize_windows(sliding_windows: Any) -> tuple[int | None, ...]:
    windows = as_list(sliding_windows, "sliding_windows", "windows (None for full attention)")
    if not windows:
        raise InvalidInputError("needs one entry per KV-cache group (None = full attention)",
                                argument="sliding_windows", fix="pass e.g. [None] for one full-attention group")
    out: list[int | None] = []
    for i, w in enumerate(windows):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, _BOOLS) or not isinstance(w, _INTS):
            raise InvalidTypeError(f"sliding window must be >= 1 tokens or None, got {_type_name(w)} {_short(w)}",
                                   argument=f"sliding_windows[{i}]", fix="pass an int window or None")
        if w < 1:
            raise InvalidInputError(f"sliding window must be >= 1, got {int(w)}", argument=f"sliding_windows[{i}]",
                                    fix="pass a window of at least one token, or None for full attention")
        out.append(int(w))
    return tuple(out)


def check_size(value: Any, name: str, minimum: int, maximum: int | None = None) -> int:
    """A constructor size: an int (numpy integers accepted), not a bool, in
    ``[minimum, maximum]``; the message keeps the "<name> must be >= <minimum>"
    wording."""
    if isinstance(value, _BOOLS) or not isinstance(value, _INTS):
        raise InvalidTypeError(f"{name} must be an int, got {_type_name(value)} {_short(value)}", argument=name,
                               fix="pass a Python or numpy integer")
    if value < minimum:
        raise InvalidInputError(f"{name} must be >= {minimum}, got {int(value)}", argument=name,
                                fix=f"pass {name} >= {minimum}")
    if maximum is not None and value > maximum:
        raise CapacityError(f"{name} must be <= {maximum}, got {int(value)}", argument=name,
                            fix=f"pass {name} <= {maximum}")
    return int(value)


def check_max_num_batched_tokens(value: Any) -> int | None:
    """The constructors' ``max_num_batched_tokens``: None (no bound) or a
    size in ``[1, MAX_TOKEN_BUDGET]`` (the engine's most tokens a step
    computes; the device manager sizes its admission buffers by it)."""
    return None if value is None else check_size(value, "max_num_batched_tokens", 1, MAX_TOKEN_BUDGET)


def resolve_key(hash_key: Any) -> bytes:
    """``gpukv.core.hashing.resolve_hash_key`` with its errors as ``gpukv.errors``
    classes naming ``hash_key`` (the messages never show the key)."""
    from gpukv.core.hashing import resolve_hash_key

    try:
        return resolve_hash_key(hash_key)
    except GpukvInputError as e:  # renamed: the key was the managers' hash_key, the environment keeps its name
        problem = e.problem if e.argument == "key" else f"{e.argument} {e.problem}"
        raise type(e)(problem, argument="hash_key", fix="pass 16 bytes, 32 hex characters or None") from None


def normalize_device(device: Any, interpreted: bool, cuda_available: bool) -> torch.device:
    """The device a device manager lives on: a CUDA device that exists, or the
    CPU under Triton's interpreter."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidInputError(f"{_short(device)} is not a device torch knows ({str(e).splitlines()[0][:80]})",
                                argument="device", fix="pass 'cuda', 'cuda:N' or, without CUDA, 'cpu' (or None)"
                                ) from None
    if dev.type == "cuda":
        if not cuda_available:
            raise InvalidInputError(f"{dev} was asked for, but CUDA is not available here", argument="device",
                                    fix="pass 'cpu' or None on a machine without CUDA")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidInputError(f"{dev} does not exist ({torch.cuda.device_count()} CUDA devices)",
                                    argument="device", fix="pass a device index below the device count")
        return dev
    if dev.type == "cpu":
        if not interpreted:
            raise InvalidInputError("the kernels run on the CPU only under Triton's interpreter, which is off",
                                    argument="device", fix="pass 'cuda' (or set TRITON_INTERPRET=1 before import)")
        return dev
    raise InvalidInputError(f"device type {dev.type!r} is not supported", argument="device",
                            fix="pass 'cuda', 'cuda:N' or, without CUDA, 'cpu' (or None)")


def check_computed_for(request: NewRequest, computed: ComputedBlocks | None, limits: ManagerLimits) -> None:
    """A hit handed to ``allocate_slots`` has the form a lookup of this
    request gives: at most ``floor((n - 1) / block_size)`` blocks (its last
    token is always computed) and, per group, the null block exactly where a
    sliding window drops blocks (before the window's run at the end of the
    hit). Whether the blocks are still cached is the manager's to check."""
    if computed is None:
        return
    fix = "pass what get_computed_blocks returned for this request"
    n, bs = len(request.token_ids), limits.block_size
    hit = computed.num_tokens // bs
    max_hit = (n - 1) // bs if limits.caching and not request.skip_prefix_cache else 0
    if hit > max_hit:
        raise InvalidInputError(f"the computed blocks cover {computed.num_tokens} tokens; a lookup of this "
                                f"{n}-token request hits at most {max_hit * bs} (its last token is always computed)",
                                argument="computed", fix=fix)
    for g, window in enumerate(limits.sliding_windows):
        first_real = 0 if window is None else max(0, hit - -(-(window - 1) // bs))
        ids = computed.block_ids[g]
        if ids[:first_real].count(0) == first_real and 0 not in ids[first_real:]:  # (C-level: the common case)
            continue
        for p, b in enumerate(ids):
            if (b == 0) != (p < first_real):
                where = "the null block" if b == 0 else f"block {b}"
                raise InvalidInputError(f"computed.block_ids[{g}][{p}] is {where}; a lookup gives the null block "
                                        f"exactly at positions below {first_real} in this group", argument="computed",
                                        fix=fix)


def check_prefix_hit(hit: Any, request: NewRequest, limits: ManagerLimits) -> int:
    """``admit``'s ``hit``: None (no hit) or a ``PrefixHit`` of whole blocks,
    at most what a lookup of this request can find (its last token is always
    computed); its size in tokens. Whether it is still cached is the
    manager's to check."""
    if hit is None:
        return 0
    fix = "pass what read_prefix_hit returned for this request, or None"
    if not isinstance(hit, PrefixHit):
        raise InvalidTypeError(f"must be a PrefixHit or None, got {_type_name(hit)}", argument="hit", fix=fix)
    num = check_int(hit.num_tokens, "hit.num_tokens", minimum=0, fix=fix)
    bs, n = limits.block_size, len(request.token_ids)
    max_hit = (n - 1) // bs if limits.caching and not request.skip_prefix_cache else 0
    if num % bs or num // bs > max_hit:
        raise InvalidInputError(f"the hit covers {num} tokens; a lookup of this {n}-token request hits whole blocks "
                                f"of {bs} tokens, at most {max_hit * bs} (its last token is always computed)",
                                argument="hit", fix=fix)
    return num


def apply_allocate_args(request: NewRequest, hit_tokens: int, num_tokens: Any, num_lookahead_tokens: Any,
                        limits: ManagerLimits) -> NewRequest:
    """A normalised new request with ``allocate_slots``' ``num_tokens`` and
    ``num_lookahead_tokens`` applied, as vLLM counts them: ``num_tokens``
    tokens computed beyond the ``hit_tokens`` of the computed blocks (None:
    the request's own ``num_tokens_to_compute``), lookahead slots beyond
    those (None: the request's own)."""
    n = len(request.token_ids)
    chunk, lookahead = request.num_tokens_to_compute, request.num_lookahead_tokens
    if num_tokens is not None:
        fix = f"pass an int from 1 to the {n - hit_tokens} tokens the hit leaves, or None for all"
        chunk = check_int(num_tokens, "num_tokens", minimum=1, fix=fix)
        if hit_tokens + chunk > n:
            raise InvalidInputError(f"{hit_tokens} hit tokens plus num_tokens={chunk} is more than the request's "
                                    f"{n} tokens", argument="num_tokens", fix=fix)
    if num_lookahead_tokens is not None:
        lookahead = check_lookahead(num_lookahead_tokens, "num_lookahead_tokens")
        hit = hit_tokens // limits.block_size
        computed = hit_tokens + new_tokens_at_admission(hit, n, chunk, limits.block_size)
        check_computed_length(computed, lookahead, limits, "num_lookahead_tokens", request.request_id)
    if (chunk, lookahead) != (request.num_tokens_to_compute, request.num_lookahead_tokens):
        r = request  # (one copy, field by field: ``dataclasses.replace`` costs several times more)
        request = NewRequest(r.request_id, r.token_ids, lora_id=r.lora_id, mm_items=r.mm_items,
                             cache_salt=r.cache_salt, skip_prefix_cache=r.skip_prefix_cache,
                             block_hashes=r.block_hashes, num_tokens_to_compute=chunk,
                             num_lookahead_tokens=lookahead, num_preemptions=r.num_preemptions)
    check_admissible(request, limits, "num_lookahead_tokens", "request.token_ids")
    return request
