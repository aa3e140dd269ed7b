"""The running requests' work in a step as arrays: ``RunningBatch`` (rows,
new tokens, chunks, lookahead slots), the batched form of ``RunningUpdate``
that ``decode`` and ``step(running=...)`` take, and its one normalisation,
shared by both managers.

A serving loop addresses its running requests by row (``StepResult.rows``,
``row_of``), so a step over hundreds of them builds no object per request:
the rows, the new tokens (``[B]``, ``[B, k]``, or ragged: a flat list with
``num_new_tokens`` per row), the chunk each row computes and the slots it
reserves are arrays, checked in a few vectorised passes
(``normalize_running``) before anything changes, with the same errors on
both managers. A caller that already holds the manager's counts (gpukv's
vLLM adapter) hands a ``PrecheckedRunningBatch`` instead, taken after a
check that its rows and known tokens are the manager's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpukv.core.blocks import ManagerLimits
from gpukv.core.checks import _checked_int_array, _ids_in_range, _tokens_from_list, as_list, check_lookahead
from gpukv.core.limits import MAX_LOOKAHEAD, MAX_NEW_TOKENS
from gpukv.errors import CapacityError, InvalidInputError, InvalidTypeError

#: The largest element of a non-empty array (the ufunc's reduce, without
#: ``ndarray.max``'s Python wrapper: a decode's rows take one).
_max = np.maximum.reduce
_min = np.minimum.reduce
_any = np.logical_or.reduce


def largest_element(a: np.ndarray) -> int:
    """The largest element of a non-empty int array, as an int: ``argmax``
    and one read, a quarter of ``np.maximum.reduce``'s cost on the tens of
    rows of a decode (a ufunc's reduction costs about a microsecond a call)."""
    return a.item(a.argmax())


def any_set(a: np.ndarray) -> bool:
    """Whether a bool array holds a True: ``count_nonzero``, a quarter of
    ``np.logical_or.reduce``'s cost on the tens of rows of a decode."""
    return bool(np.count_nonzero(a))


@dataclass(frozen=True)
class RunningBatch:
    """Running requests' work this step, one entry per request, in order
    (the batched ``RunningUpdate``: the first that does not fit and the later
    ones get nothing, as in ``step``).

    ``rows``: the requests' rows (host ints, distinct). ``new_token_ids``:
    the tokens each appends first: ``[B]`` (one each), ``[B, k]``, None (none),
    or, with ``num_new_tokens`` (``[B]`` ints >= 0), all of them flat in row
    order (``sum(num_new_tokens)`` ids on the host: a ragged batch, e.g.
    decodes beside chunked prefills). ``num_tokens_to_compute``: None (each
    computes every known token) or one chunk per row (0 for a row with no
    token left to compute). ``num_lookahead_tokens``:
    slots reserved beyond the computed tokens, never cached: one int for
    every row, or one per row."""

    rows: Any
    new_token_ids: Any = None
    num_new_tokens: Any = None
    num_tokens_to_compute: Any = None
    num_lookahead_tokens: Any = 0


@dataclass(slots=True)
class RunningRows:
    """A ``RunningBatch`` normalised: ``rows`` int64[B]; ``tokens`` [B, K]
    (int64 on the host, or a tensor on the manager's device); ``counts``
    int64[B] new tokens per row (row i's are ``tokens[i, :counts[i]]``), or
    None when every row has K; ``num_tokens`` the rows' known tokens before
    the append; ``chunks`` None or int64[B]; ``lookahead`` an int or int64[B];
    ``processed`` None (window groups release behind the computed tokens) or
    int64[B], the tokens they release behind (``RunningUpdate``s'
    ``num_processed_tokens``, or a prechecked batch's; a ``RunningBatch``
    has none). Built once per
    step and read, never changed: not frozen, because a frozen dataclass's
    construction costs about 0.6 us more (every field set through
    ``object.__setattr__``)."""

    rows: np.ndarray
    tokens: Any
    counts: np.ndarray | None
    num_tokens: np.ndarray
    chunks: np.ndarray | None
    lookahead: int | np.ndarray
    processed: np.ndarray | None = None

    @property
    def num_new(self) -> int | np.ndarray:
        """New tokens per row: an array, or K for every row."""
        return self.tokens.shape[1] if self.counts is None else self.counts


@dataclass(frozen=True)
class PrecheckedRunningBatch(RunningBatch):
    """A ``RunningBatch`` its caller built already normalised
    (``prechecked_batch``), from rows it holds and the manager's own token
    counts: gpukv's vLLM adapter, whose records follow each request's row,
    known and computed tokens call by call. A manager's ``step`` takes
    ``normalized`` as it is once its rows are held and their known tokens
    are the manager's (``taken_as_checked``: a few vectorised compares, not
    ``normalize_running``'s passes); one that is not (built from stale
    counts) is refused, nothing changed; so is one naming a row twice or
    bringing a token id outside ``[0, 2**32)``. What it skips (the chunks
    and lookahead within the rows' limits) is its builder's to hold: not
    for other callers. Without ``normalized`` it is
    checked as any ``RunningBatch``."""

    normalized: RunningRows | None = None


def prechecked_batch(rows: np.ndarray, new_token_ids: np.ndarray, counts: np.ndarray | None, num_tokens: np.ndarray,
                     chunks: np.ndarray, lookahead: int | np.ndarray,
                     processed: np.ndarray | None = None) -> PrecheckedRunningBatch:
    """A ``PrecheckedRunningBatch`` of int64 arrays: ``rows``, the flat
    ``new_token_ids`` (``counts`` per row, in row order; None: one per row,
    a decode), the rows' known tokens before the append, their chunks and
    lookahead slots (one int for every row, or one per row), and the tokens
    window groups release behind (``RunningRows.processed``; None: the
    computed ones)."""
    tokens = new_token_ids.reshape(len(rows), 1) if counts is None else _ragged_layout(new_token_ids, counts)
    run = RunningRows(rows, tokens, counts, num_tokens, chunks, lookahead, processed)
    return PrecheckedRunningBatch(rows, new_token_ids, counts, chunks, lookahead, normalized=run)


def taken_as_checked(batch: Any, in_use: np.ndarray, num_tokens: np.ndarray) -> RunningRows | None:
    """A ``PrecheckedRunningBatch``'s normalised rows, once its rows are
    held (``in_use``) and its known tokens are ``num_tokens`` at them (else
    ``InvalidInputError``); None for any other batch (``normalize_running``
    checks it)."""
    run = batch.normalized if isinstance(batch, PrecheckedRunningBatch) else None
    if run is None:
        return None
    rows = run.rows
    fix = "build a prechecked batch from the rows and known tokens the manager holds now, or pass a RunningBatch"
    if (not isinstance(rows, np.ndarray) or rows.dtype != np.int64 or rows.ndim != 1
            or not isinstance(run.num_tokens, np.ndarray) or run.num_tokens.shape != rows.shape):
        raise InvalidTypeError("a prechecked batch's rows and known tokens must be int64[B] arrays",
                               argument="running", fix=fix)
    if not len(rows):
        return run
    # (one count per row, in a few whole-array passes: a row past the last makes the counts longer, one named
    # twice counts 2, one not held counts above its in_use)
    try:
        named = np.bincount(rows, minlength=len(in_use))
    except ValueError:  # (a negative row: numpy's refusal is the check, with no reduction before it)
        named = None
    # (B rows name B distinct rows when B counts are set, and are held when B of them are in use: two counts,
    # cheaper than comparing the int counts with the bool in_use)
    if (named is None or len(named) > len(in_use) or np.count_nonzero(named) != len(rows)
            or np.count_nonzero(in_use[rows]) != len(rows)):
        twice = named is not None and len(named) == len(in_use) and not any_set((named > 0) & ~in_use)
        raise InvalidInputError("a prechecked batch names a row twice" if twice else
                                "a prechecked batch names a row no running request holds", argument="running",
                                fix=fix)
    if any_set(num_tokens[rows] != run.num_tokens):
        raise InvalidInputError("a prechecked batch's known tokens are not the manager's (built from stale "
                                "counts)", argument="running", fix=fix)
    processed = run.processed
    if processed is not None and (not isinstance(processed, np.ndarray) or processed.dtype != np.int64
                                  or processed.shape != rows.shape or any_set(processed < 0)
                                  or any_set(processed > run.num_tokens + run.num_new)):
        # (a release behind tokens no row will know would free blocks its window still reads)
        raise InvalidInputError("a prechecked batch's processed tokens must be int64[B], each from 0 to its row's "
                                "known tokens after the append", argument="running", fix=fix)
    # (the token ids stay checked here whoever built the batch: a hit is exact whatever tokens arrive)
    tokens = run.tokens
    if isinstance(tokens, np.ndarray) and tokens.size and not _ids_in_range(tokens):  # (one reduction when all
        # are in range; a token tensor on the device is checked there, as any)
        _checked_int_array(tokens.ravel(), "new_token_ids", "a prechecked batch's rows (zero-padded): ",
                           copy=False)  # (names the first id outside the range and raises)
    return run


def normalize_running(batch: Any, in_use: np.ndarray, num_tokens_of, computed_of, limits: ManagerLimits,
                      device: torch.device | None) -> RunningRows:
    """``batch`` (a ``RunningBatch``) checked against a manager whose held
    rows are ``in_use`` (``num_tokens_of(rows)``, ``computed_of(rows)``: their
    known and computed tokens, int64 arrays): every array in a few vectorised
    passes, the errors those of ``decode``'s arguments. ``device``: the
    manager's (a token tensor there is kept unread), None for the host."""
    if not isinstance(batch, RunningBatch):
        raise InvalidTypeError(f"running must be a sequence of RunningUpdate or a RunningBatch, got "
                               f"{type(batch).__name__}", argument="running",
                               fix="pass [RunningUpdate(...), ...] or gpukv.RunningBatch(rows, new_token_ids)")
    rows = normalize_rows(batch.rows, in_use)
    num_tokens = num_tokens_of(rows)
    counts = None
    if batch.num_new_tokens is None:
        tokens = normalize_decode_tokens(batch.new_token_ids, len(rows), device)
        k = tokens.shape[1]
        check_decode_lengths(num_tokens, k, limits)
    else:
        counts = k = normalize_new_token_counts(batch.num_new_tokens, len(rows))
        check_decode_lengths(num_tokens, counts, limits)  # (before the padded rows are sized by the counts)
        tokens = ragged_token_rows(batch.new_token_ids, counts)
    chunks, lookahead = None, batch.num_lookahead_tokens
    if batch.num_tokens_to_compute is not None or type(lookahead) is not int or lookahead != 0:
        computed = computed_of(rows)
        chunks, lookahead = normalize_decode_chunks(batch.num_tokens_to_compute, num_tokens + k - computed,
                                                    computed, lookahead, limits)
    return RunningRows(rows, tokens, counts, num_tokens, chunks, lookahead)


def normalize_new_token_counts(value: Any, num_rows: int) -> np.ndarray:
    """``num_new_tokens``: ``num_rows`` host ints >= 0, as a fresh int64 array."""
    fix = (f"pass {num_rows} ints from 0 to {MAX_NEW_TOKENS}: how many of the flat new_token_ids each row "
           "appends, in row order")
    arr = _host_int_array(value, "num_new_tokens", fix)
    if arr.shape != (num_rows,):
        raise InvalidTypeError(f"must be {num_rows} ints, got shape {arr.shape}", argument="num_new_tokens", fix=fix)
    _check_each_in_range(arr, "num_new_tokens", MAX_NEW_TOKENS, fix)
    return arr


def _check_each_in_range(arr: np.ndarray, argument: str, most: int, fix: str) -> None:
    """Refuse an int64 array holding a value below 0 (``InvalidInputError``)
    or above ``most`` (``CapacityError``, the limit from ``gpukv.core.limits``):
    checked before any sum or size is taken of it, which numpy would wrap."""
    if not arr.size:
        return
    if int(_min(arr)) < 0:
        i = int(np.argmin(arr))
        raise InvalidInputError(f"{argument}[{i}] = {int(arr[i])} is negative", argument=argument, fix=fix)
    if int(_max(arr)) > most:
        i = int(np.argmax(arr))
        raise CapacityError(f"{argument}[{i}] = {int(arr[i])} is more than {most}", argument=argument, fix=fix)


def _host_int_array(value: Any, argument: str, fix: str) -> np.ndarray:
    """A 1-D host array of ints (a list, tuple, numpy array or CPU tensor),
    as a fresh int64 array."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise InvalidTypeError(f"must be on the host, got a tensor on {value.device}", argument=argument,
                                   fix=fix)
        value = value.numpy()
    if not isinstance(value, np.ndarray):
        items = as_list(value, argument, "ints")
        if any(type(x) is not int and not isinstance(x, np.integer) for x in items):
            raise InvalidTypeError("must be ints", argument=argument, fix=fix)
        try:
            value = np.array(items, dtype=np.int64).reshape(-1)
        except OverflowError:  # (only on this error path: find it)
            i = next(i for i, x in enumerate(items) if not -2**63 <= int(x) < 2**63)
            cls = InvalidInputError if items[i] < 0 else CapacityError
            raise cls(f"{argument}[{i}] = {int(items[i])} is beyond int64", argument=argument, fix=fix) from None
    if value.dtype.kind not in "iu":
        raise InvalidTypeError(f"must be ints, got {value.dtype}", argument=argument, fix=fix)
    if value.dtype == np.uint64 and value.size and int(value.max()) >= 2**63:  # (as int64 it would wrap negative)
        i = int(np.argmax(value))
        raise CapacityError(f"{argument}[{i}] = {int(value[i])} is beyond int64", argument=argument, fix=fix)
    return np.array(value, dtype=np.int64)


def ragged_token_rows(value: Any, counts: np.ndarray) -> np.ndarray:
    """Flat host token ids (``sum(counts)`` of them, row order) as
    ``[B, max(counts)]`` int64 rows, each row's ids first, then zeros
    (padding the kernels never read: ``kernels/decode.py``'s ``nnew``)."""
    fix = "pass every row's new token ids flat, in row order, sum(num_new_tokens) of them, on the host"
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise InvalidTypeError(f"new_token_ids with num_new_tokens must be on the host, got a tensor on "
                                   f"{value.device}", argument="new_token_ids", fix=fix)
        value = value.numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu" or value.ndim != 1:
            raise InvalidTypeError(f"new_token_ids must be a 1-D integer array, got {value.dtype} of shape "
                                   f"{value.shape}", argument="new_token_ids", fix=fix)
        flat = _checked_int_array(value, "new_token_ids", "")
    elif value is None:
        flat = np.zeros(0, dtype=np.int64)
    else:
        flat = _tokens_from_list(as_list(value, "new_token_ids", "token ids"), "new_token_ids", "")
    total = int(counts.sum())
    if len(flat) != total:
        raise InvalidInputError(f"holds {len(flat)} token ids, num_new_tokens adds up to {total}",
                                argument="new_token_ids", fix=fix)
    return _ragged_layout(flat, counts)


def _ragged_layout(flat: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Checked flat token ids (``sum(counts)``, row order) as ``[B,
    max(counts)]`` rows, zero-padded."""
    width = largest_element(counts) if len(counts) else 0
    if len(flat) == width * len(counts):  # every row appends width tokens (a decode): no padding to place
        return flat.reshape(len(counts), width)
    out = np.zeros((len(counts), width), dtype=np.int64)
    out[np.arange(width)[None, :] < counts[:, None]] = flat
    return out


def normalize_lookahead(value: Any, num_rows: int) -> int | np.ndarray:
    """``num_lookahead_tokens``: an int >= 0 for every row, or ``num_rows``
    of them (a list, numpy array or CPU tensor) as an int64 array."""
    if isinstance(value, (list, tuple, np.ndarray, torch.Tensor)):
        fix = f"pass one int from 0 to {MAX_LOOKAHEAD}, or {num_rows} of them (one per row)"
        arr = _host_int_array(value, "num_lookahead_tokens", fix)
        if arr.shape != (num_rows,):
            raise InvalidTypeError(f"must be {num_rows} ints, got shape {arr.shape}",
                                   argument="num_lookahead_tokens", fix=fix)
        _check_each_in_range(arr, "num_lookahead_tokens", MAX_LOOKAHEAD, fix)
        return arr
    return check_lookahead(value, "num_lookahead_tokens")


def normalize_rows(value: Any, in_use: np.ndarray, *, distinct: bool = True) -> np.ndarray:
    """The rows of a batched decode as a fresh 1-D int64 array: a list, tuple,
    1-D int array or CPU tensor of rows that requests hold, each once unless
    ``distinct`` is False."""
    fix = "pass the rows StepResult.rows (or row_of) gave, each once"
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise InvalidTypeError(f"rows must be on the host, got a tensor on {value.device}", argument="rows",
                                   fix="pass a list, a numpy array or a CPU tensor (the manager stages them)")
        value = value.numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu" or value.ndim != 1:
            raise InvalidTypeError(f"rows must be a 1-D integer array, got {value.dtype} of shape {value.shape}",
                                   argument="rows", fix=fix)
        if value.dtype == np.uint64 and value.size and int(value.max()) >= 2**63:  # (as int64: wrapped negative)
            i = int(np.argmax(value))
            raise InvalidInputError(f"rows[{i}] = {int(value[i])} is not the row of a running request",
                                    argument="rows", fix=fix)
        rows = np.array(value, dtype=np.int64)
    else:
        items = as_list(value, "rows", "rows")
        if any(type(x) is not int and not isinstance(x, np.integer) for x in items):
            raise InvalidTypeError("rows must be ints", argument="rows", fix=fix)
        try:
            rows = np.array(items, dtype=np.int64).reshape(-1)
        except OverflowError:  # an int beyond int64 (only on this error path: find it)
            i = next(i for i, x in enumerate(items) if not -2**63 <= int(x) < 2**63)
            raise InvalidInputError(f"rows[{i}] = {int(items[i])} is not the row of a running request",
                                    argument="rows", fix=fix) from None
    if rows.size:
        # Every row inside the manager's rows first, in one reduction (read
        # as unsigned, a negative row is past the end): bincount sizes its
        # output by the largest row, so a hostile one (2**40, 2**63 - 1)
        # would ask for terabytes, or overflow and write out of bounds.
        # Then the common case in one count: each row at most once, and only
        # where a request is held (a count of 1 where in_use is 0, or of 2,
        # fails); the slow path only finds what to report.
        inside = int(_max(rows.view(np.uint64))) < len(in_use)
        if inside:
            counts = np.bincount(rows, minlength=len(in_use))
            if not _any(counts > in_use if distinct else (counts > 0) > in_use):
                return rows
        bad = np.flatnonzero((rows < 0) | (rows >= len(in_use)))
        if bad.size == 0:
            bad = np.flatnonzero(~in_use[rows])
        if bad.size:
            i = int(bad[0])
            raise InvalidInputError(f"rows[{i}] = {int(rows[i])} is not the row of a running request",
                                    argument="rows", fix=fix)
        raise InvalidInputError("a row appears twice", argument="rows", fix=fix)
    return rows


def normalize_decode_tokens(value: Any, num_rows: int, device: torch.device | None) -> np.ndarray | torch.Tensor:
    """A decode's new tokens as ``[num_rows, k]`` (k >= 0 tokens per row;
    None is ``k = 0``: the rows only continue a chunked prefill).

    Tokens on the host (a list, a numpy array, a CPU tensor) are checked here
    as ``step()``'s are (ints, each in ``[0, 2**32)``) and become a fresh int64
    array. A tensor on the manager's CUDA device (``device``; a model
    runner's sampled tokens) is kept unread: reading it would stop the host
    until the GPU catches up; the decode kernel checks its range on the
    device (``DeviceManager.decode``). Under Triton's interpreter the
    manager's device is the CPU: a CPU tensor is checked here and also kept
    as a tensor (it needs no upload). A tensor on another CUDA device is read
    and checked here; on any other device it is refused."""
    fix = "pass one row of new token ids per request, as a [B] or [B, k] tensor or array (None: no new token)"
    if value is None:
        return np.zeros((num_rows, 0), dtype=np.int64)
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int32, torch.int64):
            raise InvalidTypeError(f"new_token_ids must be int32 or int64, got {value.dtype}",
                                   argument="new_token_ids", fix=fix)
        kind = value.device.type
        if device is not None and value.device == device:
            if kind == "cpu":  # the interpreter's device is the host: check it here, keep the tensor
                checked = _decode_token_rows(value.numpy(), num_rows, fix, copy=False)  # (ints: no autograd)
                return value.reshape(checked.shape)
            tokens = value if value.dim() == 2 else value.reshape(-1, 1) if value.dim() == 1 else None
            if tokens is None or tokens.shape[0] != num_rows:
                raise InvalidInputError(f"new_token_ids has shape {tuple(value.shape)}, want [{num_rows}] or "
                                        f"[{num_rows}, k]", argument="new_token_ids", fix=fix)
            return tokens  # range-checked by the decode kernel, on the device
        if kind not in ("cpu", "cuda"):
            raise InvalidTypeError(f"new_token_ids on device {value.device} cannot be read",
                                   argument="new_token_ids", fix="pass them on the CPU or the manager's device")
        return _decode_token_rows(value.detach().cpu().numpy(), num_rows, fix)
    if isinstance(value, np.ndarray):
        return _decode_token_rows(value, num_rows, fix)
    items = as_list(value, "new_token_ids", "token ids")
    try:
        arr = np.asarray(items)
    except (ValueError, TypeError, OverflowError):  # numpy refuses ragged rows ([[8, 9], [10]])
        raise InvalidInputError("is ragged: its rows hold different numbers of token ids",
                                argument="new_token_ids", fix=fix) from None
    if arr.dtype.kind == "O" and arr.ndim in (1, 2):  # ints beyond int64, or not ints: find and name one
        flat = _tokens_from_list(arr.ravel().tolist(), "new_token_ids", "")
        arr = flat.reshape(arr.shape)
    elif arr.size == 0:  # ``[]`` or ``[[], []]``: no token, whatever dtype numpy guessed for nothing
        arr = arr.astype(np.int64)
    return _decode_token_rows(arr, num_rows, fix)


def _decode_token_rows(arr: np.ndarray, num_rows: int, fix: str, copy: bool = True) -> np.ndarray:
    """A host array of a decode's new tokens, checked (integer, ``[B]`` or
    ``[B, k]``, ids in ``[0, 2**32)``) and as ``[num_rows, k]`` int64 (a
    fresh copy unless ``copy`` is False)."""
    if arr.dtype.kind not in "iu":
        raise InvalidTypeError(f"new_token_ids must be ints, got {arr.dtype}", argument="new_token_ids", fix=fix)
    tokens: np.ndarray | None = arr if arr.ndim == 2 else arr.reshape(-1, 1) if arr.ndim == 1 else None
    if tokens is not None:
        tokens = _checked_int_array(tokens.reshape(-1), "new_token_ids", "", copy=copy).reshape(tokens.shape)
    if tokens is None or len(tokens) != num_rows:
        raise InvalidInputError(f"new_token_ids has shape {tuple(arr.shape)}, want [{num_rows}] or [{num_rows}, k]",
                                argument="new_token_ids", fix=fix)
    return tokens



def normalize_decode_chunks(value: Any, remaining: np.ndarray, computed: np.ndarray, lookahead: Any,
                            limits: ManagerLimits) -> tuple[np.ndarray | None, int | np.ndarray]:
    """A decode's ``num_tokens_to_compute`` (None, or one int per row, each
    in ``[1, remaining]``, or 0 where ``remaining`` is 0: a row with nothing
    to compute that only reserves lookahead slots, as an async scheduler's
    row whose sampled token is still in flight) and ``num_lookahead_tokens``
    (an int >= 0, or one per row), checked in one vectorised pass:
    ``remaining`` are the rows' known tokens not computed yet after the
    append, ``computed`` their computed tokens."""
    la = normalize_lookahead(lookahead, len(remaining))
    chunks = None
    fix = ("pass None to compute every known token, or one int per row from 1 to its tokens not computed yet "
           "(0 for a row with none left)")
    if value is not None:
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise InvalidTypeError(f"num_tokens_to_compute must be on the host, got a tensor on {value.device}",
                                       argument="num_tokens_to_compute", fix=fix)
            value = value.numpy()
        if isinstance(value, np.ndarray):
            arr = value
        else:
            items = as_list(value, "num_tokens_to_compute", "ints")
            try:
                arr = np.asarray(items) if items else np.zeros(0, dtype=np.int64)  # ([] is no float array)
            except (ValueError, TypeError, OverflowError):  # ragged ([[1], [2, 3]])
                raise InvalidTypeError(f"num_tokens_to_compute must be {len(remaining)} ints, got a ragged list",
                                       argument="num_tokens_to_compute", fix=fix) from None
        if arr.dtype.kind not in "iu" or arr.shape != remaining.shape:
            raise InvalidTypeError(f"num_tokens_to_compute must be {len(remaining)} ints, got {arr.dtype} of shape "
                                   f"{arr.shape}", argument="num_tokens_to_compute", fix=fix)
        chunks = arr.astype(np.int64)
        wrong = (chunks < np.minimum(remaining, 1)) | (chunks > remaining)
        if _any(wrong):
            i = int(np.flatnonzero(wrong)[0])
            what = ("has no token left to compute (0 is its only chunk)" if remaining[i] == 0
                    else f"must compute 1 to {int(remaining[i])} tokens")
            raise InvalidInputError(f"rows[{i}] {what}, got num_tokens_to_compute[{i}] = {int(chunks[i])}",
                                    argument="num_tokens_to_compute", fix=fix)
    after = computed + (remaining if chunks is None else chunks) + la
    if limits.max_model_len is not None and after.size and int(after.max()) > limits.max_model_len:
        i = int(np.argmax(after))
        ahead = la if isinstance(la, int) else int(la[i])
        raise CapacityError(f"rows[{i}] would need slots for {int(after[i]) - ahead} computed and {ahead} lookahead "
                            f"tokens, more than max_model_len {limits.max_model_len}", argument="num_lookahead_tokens",
                            fix="reserve fewer lookahead tokens, or raise max_model_len")
    return chunks, la



def check_decode_lengths(num_tokens: np.ndarray, k: int | np.ndarray, limits: ManagerLimits) -> None:
    """Refuse a decode that takes a request past ``max_model_len`` (``k``:
    the new tokens, per row or for every row)."""
    after = num_tokens + k
    if limits.max_model_len is not None and after.size and int(after.max()) > limits.max_model_len:
        i = int(np.argmax(after))
        raise CapacityError(f"rows[{i}] would hold {int(after[i])} tokens, over max_model_len "
                            f"{limits.max_model_len}", argument="new_token_ids",
                            fix="finish the request, or raise max_model_len")
