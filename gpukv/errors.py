"""The errors gpukv raises on purpose: refused arguments, and a stopped manager;
and the scalar checks that raise them, shared by ``gpukv.core.checks`` and
``gpukv.core.hashing`` so each rule is written once.

Every class derives from ``GpukvError`` and from the builtin exception a
Python caller would expect (``ValueError``, ``TypeError``, ``KeyError``), so
``except ValueError`` keeps working. Each error says which argument is wrong
(``argument``, e.g. ``"new[0].token_ids"``), what is wrong with it, and how to
fix it (``fix``); ``str(error)`` is ``"<argument>: <problem>; <fix>"``.

Both managers (``gpukv.reference.manager`` and ``gpukv.device.manager``) check every argument
before changing anything, through the one normalisation in
``gpukv.core.checks``: a ``GpukvInputError`` (every class below but
``NoFreeBlocksError``, ``ManagerFailedError`` and ``PublisherClosedError``)
from a manager call means the call was refused and changed nothing, and the
manager can be used on as before. A call that does not fit the method's
signature (an unknown keyword, a missing or extra argument) is refused the
same way, as an ``InvalidTypeError`` whose ``__cause__`` is Python's
``TypeError``. What is refused is decided by where it is raised: each call
marks its point of first change, and anything raised after it is a fault,
whatever its class (``gpukv.core.failstop``), so an input error class from a
manager whose ``failed`` is then True was a fault, not a refusal (the one
such input error gpukv raises: token ids handed over on the device out of
range, which only the step's read can find; ``docs/design.md``).

| class | builtin | meaning |
| --- | --- | --- |
| ``InvalidTypeError`` | ``TypeError`` | an argument of the wrong kind: a str where a list of ids goes, a float token id, a tensor of the wrong dtype or on the wrong device, ``None`` where a container goes, a request id that is not a plain str (a subclass included), a call that does not fit the signature (``step(bogus=1)``, ``free()``) |
| ``InvalidInputError`` | ``ValueError`` | the right kind but a value the manager cannot take: a negative token id, a 2-D token array, ragged rows of token ids, a LoRA id >= 2**64, a salt that is not valid UTF-8, multimodal items that overlap or leave the prompt, a block size < 1, a caller's iterator that raised while read (its exception is the ``__cause__``) |
| ``DuplicateRequestError`` | ``ValueError`` | a request id used twice: finished twice in a step (double free), a new id already in use, finished and running in one step |
| ``CapacityError`` | ``ValueError`` | too large for this manager: a request longer than ``max_model_len`` or one that cannot fit the whole pool even with the best possible cache hit; constructor sizes that cannot be allocated (raised before anything is allocated) |
| ``StaleComputedBlocksError`` | ``ValueError`` | ``allocate_slots`` got computed blocks that a lookup of the request does not find now (evicted since ``get_computed_blocks``, or another request's) |
| ``ConcurrentCallError`` | ``RuntimeError`` | a manager called from a second thread while a call of another thread is under way: refused at once, nothing changed (a manager is used from one thread at a time) |
| ``UnknownRequestError`` | ``KeyError`` | a request id the manager does not hold (never admitted, or already freed) |
| ``NoFreeBlocksError`` | ``RuntimeError`` | ``BlockPool.allocate`` (the reference's low-level pool) asked for more blocks than are free; manager calls report a lack of blocks in their result instead, so inside one it is a fault |
| ``ManagerFailedError`` | ``RuntimeError`` | the manager stopped after a fault inside an earlier call and refuses every call (``gpukv.core.failstop``) |
| ``ReconcileError`` | ``ValueError`` | ``reconcile_kv_cache_config``: a rank passed no config, sent bytes that are not one, or has other groups; every rank raises the same one, naming the rank (``rank``) |
| ``AddressError`` | ``OSError`` | a KV-events endpoint or metrics address that cannot be bound or reached here |
| ``AddressInUseError`` | ``OSError`` | an endpoint, port or ipc socket path another socket is listening on |
| ``PublisherClosedError`` | ``RuntimeError`` | a KV-events publisher used after ``close`` |
"""  # noqa: E501  (a Markdown table: its rows cannot wrap)

from __future__ import annotations

from typing import Any

import numpy as np

from gpukv.core.limits import MAX_LORA_ID

__all__ = [
    "AddressError",
    "AddressInUseError",
    "CapacityError",
    "ConcurrentCallError",
    "DuplicateRequestError",
    "GpukvError",
    "GpukvInputError",
    "InvalidInputError",
    "InvalidTypeError",
    "ManagerFailedError",
    "NoFreeBlocksError",
    "PublisherClosedError",
    "ReconcileError",
    "StaleComputedBlocksError",
    "UnknownRequestError",
]


class GpukvError(Exception):
    """Base class of every error gpukv raises on purpose.

    ``argument`` names the offending argument (``"finished"``,
    ``"new[2].lora_id"``, ``"num_blocks"``...), ``problem`` says what is wrong
    and ``fix`` what to do instead; any of them may be empty for errors that
    are not about one argument.
    """

    def __init__(self, problem: str = "", *, argument: str = "", fix: str = "") -> None:
        self.argument = argument
        self.problem = problem
        self.fix = fix
        text = problem
        if argument:
            text = f"{argument}: {text}" if text else argument
        if fix:
            text = f"{text}; {fix}"
        super().__init__(text)

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):
        return (_rebuild, (type(self), self.problem, self.argument, self.fix))


def _rebuild(cls, problem, argument, fix):
    return cls(problem, argument=argument, fix=fix)


class GpukvInputError(GpukvError):
    """A call refused because of its arguments, before anything changed."""


class InvalidTypeError(GpukvInputError, TypeError):
    """An argument of the wrong kind (wrong Python type, dtype, rank of
    container, or device)."""


class InvalidInputError(GpukvInputError, ValueError):
    """An argument of the right kind whose value cannot be accepted."""


class DuplicateRequestError(InvalidInputError):
    """A request id used twice where once is the rule (double free, an id
    already in use, finished and running in one step)."""


class CapacityError(InvalidInputError):
    """Too large for this manager: a request that can never be admitted or is
    longer than ``max_model_len``, or constructor sizes that cannot be
    allocated (checked before allocating anything)."""


class StaleComputedBlocksError(InvalidInputError):
    """``allocate_slots`` was handed a cache hit that is no longer valid."""


class UnknownRequestError(GpukvInputError, KeyError):
    """A request id the manager does not hold."""


class NoFreeBlocksError(GpukvError, RuntimeError):
    """The reference ``BlockPool.allocate`` asked for more blocks than the free
    queue holds (a programming error in a caller of the low-level pool)."""


class ConcurrentCallError(GpukvInputError, RuntimeError):
    """A call made while another thread's call of the same manager is under
    way: refused before it touches anything (a refusal: nothing changed,
    nothing stopped). A manager is used from one thread at a time; a caller
    serialises its calls (a lock around them) or keeps one manager per
    thread."""


class ManagerFailedError(GpukvError, RuntimeError):
    """The manager stopped after a fault inside an earlier call (its state may
    be half updated) and refuses every call; the message names the fault."""


class ReconcileError(InvalidInputError):
    """``reconcile_kv_cache_config`` cannot agree on one config: a rank passed
    no ``KVCacheConfig``, sent what is not a config (bytes that are not UTF-8
    JSON of ``KVCacheConfig.to_dict``'s shape, a size over the limit, another
    protocol), or has other KV-cache groups. Every rank of the group raises
    the same one; ``rank`` is the global rank at fault (the first one)."""

    def __init__(self, problem: str = "", *, argument: str = "", fix: str = "", rank: int = -1) -> None:
        super().__init__(problem, argument=argument, fix=fix)
        self.rank = rank

    def __reduce__(self):
        return (_rebuild_reconcile, (self.problem, self.argument, self.fix, self.rank))


def _rebuild_reconcile(problem, argument, fix, rank):
    return ReconcileError(problem, argument=argument, fix=fix, rank=rank)


class AddressError(GpukvInputError, OSError):
    """An address gpukv cannot listen on or send to (an ipc path that is a
    file, a host that is not this machine's, a port not allowed); also an
    ``OSError``, as the socket's own error was."""


class AddressInUseError(AddressError):
    """An address, TCP port or ipc socket path that another socket holds
    (one that is listening: a dead process's leftover socket file is not)."""


class PublisherClosedError(GpukvError, RuntimeError):
    """A KV-events publisher used after ``close``."""


# ------------------------------------------------------ shared scalar checks
# Here, beside the classes, because both gpukv.core.checks and gpukv.core.hashing
# refuse through them and hashing must not import request (request imports
# hashing, and torch, which the command line does not load).

_INTS = (int, np.integer)
_BOOLS = (bool, np.bool_)


def type_name(value: Any) -> str:
    return type(value).__name__


def short_repr(value: Any) -> str:
    """A short repr for messages; objects without a plain value (whose repr
    would show a memory address) are shown by their type only."""
    if value is None or isinstance(value, (str, bytes, bytearray, int, float, complex, np.generic)):
        text = repr(value)
    else:
        text = f"<{type_name(value)}>"
    return text if len(text) <= 60 else text[:57] + "..."


def check_int(value: Any, argument: str, *, minimum: int | None = None, maximum: int | None = None,
              fix: str = "") -> int:
    """``value`` as a Python int, or raise: a bool or non-integer is an
    ``InvalidTypeError``; below ``minimum`` an ``InvalidInputError``; above
    ``maximum`` a ``CapacityError`` (numpy integers are accepted)."""
    if isinstance(value, _BOOLS) or not isinstance(value, _INTS):
        raise InvalidTypeError(f"must be an int, got {type_name(value)} {short_repr(value)}", argument=argument,
                               fix=fix or "pass a Python or numpy integer")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidInputError(f"must be >= {minimum}, got {value}", argument=argument,
                                fix=fix or f"pass an int >= {minimum}")
    if maximum is not None and value > maximum:
        raise CapacityError(f"must be <= {maximum}, got {value}", argument=argument,
                            fix=fix or f"pass an int <= {maximum}")
    return value


def check_lora_id(value: Any, argument: str, label: str = "") -> int:
    """A LoRA id: an int in ``[0, 2**64)``; one past the range is an
    ``InvalidInputError`` (a value no LoRA can have, not a capacity)."""
    fix = "pass None or an int in [0, 2**64)"
    value = check_int(value, argument, minimum=0, fix=fix)
    if value > MAX_LORA_ID:
        raise InvalidInputError(f"{label}lora_id must be < 2**64, got {value}", argument=argument, fix=fix)
    return value


def check_utf8(text: str, argument: str) -> None:
    """Raise unless ``text`` can be encoded as UTF-8 (a lone surrogate cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInputError(f"is not valid UTF-8 ({e.reason} at index {e.start})", argument=argument,
                                fix="pass a str without lone surrogates (e.g. decode bytes with errors='replace')"
                                ) from None
