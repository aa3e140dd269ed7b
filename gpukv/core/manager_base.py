"""What both managers' request-level API does the same way, in one place.

``ReferenceManager`` (host lists) and ``DeviceManager`` (device tensors)
keep their state differently and answer every call alike
(``gpukv.core.protocol.BlockManager``). The calls whose rule does not depend on how
the state is kept live here, once: what a manager is (its key, its pool's
size, its limits), the reads that are arithmetic over other reads,
``allocate_slots``' two forms, and the checks of a step's arguments
(``gpukv.core.checks``, ``gpukv.core.running_batch``).

Each manager sets ``_key``, ``_limits``, ``pool`` (with ``num_blocks``) and
``_rows`` (``in_use``, ``num_tokens``, ``num_computed``: one entry per row,
``gpukv.device.rows``), and implements the abstract hooks below.
"""

from __future__ import annotations

import warnings
from abc import ABCMeta, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gpukv.core.blocks import ManagerLimits
from gpukv.core.checks import check_size, normalize_token_ids
from gpukv.core.failstop import FailStop, mutating, reading
from gpukv.core.limits import MAX_LOOKAHEAD
from gpukv.core.protocol import manager_args_from_config
from gpukv.core.requests import ComputedBlocks, NewRequest, PrefixHit, RunningUpdate, Step
from gpukv.core.running_batch import RunningBatch, RunningRows, normalize_rows, normalize_running, taken_as_checked
from gpukv.errors import InvalidInputError, InvalidTypeError


def _block_ids(value: Any, num_blocks: int) -> list[int]:
    """A sequence of block ids, each an int in ``[0, num_blocks)``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidTypeError(f"block_ids must be a sequence of ints, got {type(value).__name__}",
                               argument="block_ids", fix="pass a list of block ids")
    for b in value:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < num_blocks:
            raise InvalidInputError(f"block_ids holds {b!r}, not a block id in [0, {num_blocks})",
                                    argument="block_ids", fix="pass the ids of blocks of this manager's pool")
    return [int(b) for b in value]


#: A step's ``finished`` and ``new`` when both are empty: what ``_normalize`` makes of them.
_NO_REQUESTS = Step()


class SharedManagerAPI(FailStop, metaclass=ABCMeta):
    """The part of the request-level API both managers share (the module
    docstring); a manager subclasses it and adds how it keeps its state."""

    _key: bytes
    _limits: ManagerLimits
    pool: Any
    _rows: Any
    #: Whether the properties that read the pool wait for a GPU (then they
    #: are deprecated: ``gpukv.core.protocol``, "Naming rule").
    _PROPERTIES_WAIT = False

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> Any:
        """A manager for a ``KVCacheConfig`` (``gpukv.get_kv_cache_config``):
        one group per config group, ``kwargs`` as the constructor's."""
        num_blocks, block_size, windows = manager_args_from_config(config)
        return cls(num_blocks, block_size, sliding_windows=windows, **kwargs)  # type: ignore[call-arg]

    # ------------------------------------------------------ what it is
    @property
    def hash_key(self) -> bytes:
        """The 16-byte key of the block hash (never printed by ``repr``)."""
        return self._key

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block 0 included."""
        return self.pool.num_blocks

    @property
    def limits(self) -> ManagerLimits:
        """What every call is checked against (block size, pool size, windows,
        ``max_model_len``): ``gpukv.core.blocks.min_blocks_to_admit(n, m.limits,
        can_hit)`` is the bound past which a new request is refused up front."""
        return self._limits

    # ----------------------------------------- the pool's counts, read
    @abstractmethod
    def read_num_free_blocks(self) -> int:
        """Free blocks now (the device manager reads the device)."""

    @abstractmethod
    def read_num_evictions(self) -> int:
        """Cached blocks evicted so far (the device manager reads the device)."""

    @reading
    def read_usage(self) -> float:
        """Fraction of the pool (null block excluded) that is referenced, as
        vLLM's ``KVCacheManager.usage`` (on the device manager from the host
        mirror of the last step's free count: ``read_num_free_blocks``)."""
        return 1.0 - self.read_num_free_blocks() / (self.num_blocks - 1)

    @reading
    def read_num_unheld(self, block_ids: Sequence[int]) -> int:
        """How many of the distinct blocks ``block_ids`` (host ints; the
        null block 0 skipped) no request holds: the hit blocks an admission
        takes out of the free queue, which vLLM's fit check counts as blocks
        to take. One read on the device manager (none for no block)."""
        ids = sorted({b for b in _block_ids(block_ids, self.num_blocks) if b})
        return self._num_unheld(ids) if ids else 0

    @abstractmethod
    def _num_unheld(self, block_ids: list[int]) -> int:
        """``read_num_unheld`` on checked, distinct, non-null block ids."""

    @property
    def num_free_blocks(self) -> int:
        """Free blocks now: ``read_num_free_blocks()`` (deprecated on the
        device manager, where it waits for the GPU)."""
        self._warn_if_waiting("num_free_blocks")
        return self.read_num_free_blocks()

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted so far: ``read_num_evictions()`` (deprecated
        on the device manager)."""
        self._warn_if_waiting("num_evictions")
        return self.read_num_evictions()

    @property
    def usage(self) -> float:
        """``read_usage()`` (deprecated on the device manager)."""
        self._warn_if_waiting("usage")
        return self.read_usage()

    def _warn_if_waiting(self, name: str) -> None:
        if self._PROPERTIES_WAIT:
            warnings.warn(f"{type(self).__name__}.{name} waits for the GPU (a device read hidden in an "
                          f"attribute); call read_{name}() instead", DeprecationWarning, stacklevel=3)

    @reading
    def row_token_counts(self, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        """The known and the computed tokens of the requests at ``rows``
        (host ints, each a running request's), as int64 arrays; host only."""
        rows_np = normalize_rows(rows, self._rows.in_use, distinct=False)
        return self._rows.num_tokens[rows_np], self._rows.num_computed[rows_np]

    # ------------------------------------------------------ allocate_slots
    @mutating
    def allocate_slots(self, request: NewRequest | str, new_token_ids: Sequence[int] = (),
                       computed: ComputedBlocks | None = None, num_tokens: int | None = None,
                       num_lookahead_tokens: int | None = None, *,
                       num_processed_tokens: int | None = None) -> list[list[int]] | None:
        """Give a request the blocks for the tokens it computes now, as vLLM's
        ``allocate_slots(request, num_tokens, new_computed_blocks,
        num_lookahead_tokens)``.

        A ``NewRequest`` (with the ``computed`` that ``get_computed_blocks``
        returned for it, or none for no hit) is admitted; a request id is a
        running request, ``new_token_ids`` appended first. ``num_tokens``:
        tokens computed now beyond those computed (for a new request: beyond
        the hit), None for all known tokens (or a new request's own
        ``num_tokens_to_compute``); ``num_lookahead_tokens``: slots beyond
        them, never cached (None: 0, or a new request's own).
        ``num_processed_tokens`` (a running request with tokens in flight,
        vLLM 0.33's ``num_computed_tokens - num_in_flight_tokens``):
        sliding-window groups release the blocks behind these tokens' window
        rather than behind the computed tokens before the call (None), never
        past the blocks held; from 0 to the computed tokens after the call
        (``RunningUpdate.num_processed_tokens``). Returns the
        newly allocated block ids per group, or None when they do not fit, in
        which case nothing changed. The device manager reads the device (the
        step's status, then the new block ids).
        """
        if isinstance(request, NewRequest):
            if len(normalize_token_ids(new_token_ids, "new_token_ids")):
                raise InvalidInputError("a new request brings its tokens in NewRequest.token_ids",
                                        argument="new_token_ids", fix="pass new_token_ids=() with a NewRequest")
            if num_processed_tokens is not None:  # (vLLM's admission releases nothing: its null prefix is the hit's)
                raise InvalidInputError("a new request has no tokens in flight", argument="num_processed_tokens",
                                        fix="pass num_processed_tokens=None with a NewRequest")
            return self._allocate_new(request, computed, num_tokens, num_lookahead_tokens)
        if not isinstance(request, str):
            raise InvalidTypeError(f"must be a NewRequest or a running request's id (str), got "
                                   f"{type(request).__name__}", argument="request",
                                   fix="pass a NewRequest to admit, or the id of a running request")
        if computed is not None:
            raise InvalidInputError("computed blocks are for new requests only", argument="computed",
                                    fix="pass computed=None with a running request's id")
        lookahead = 0 if num_lookahead_tokens is None else num_lookahead_tokens  # (checked next, not truth-tested)
        update = RunningUpdate(request, new_token_ids, num_tokens, lookahead, num_processed_tokens)
        (update,) = self._normalize((), [update], (), single=True).running
        return self._allocate_running(update)

    @mutating
    def admit(self, request: NewRequest, hit: PrefixHit | None = None, *, num_tokens: int | None = None,
              num_lookahead_tokens: int | None = None) -> bool:
        """``allocate_slots`` for a new request whose hit is known by its size
        (``read_prefix_hit``), reading no block id: the request is admitted
        with exactly that hit, which must still be what a lookup capped at
        its length finds now (else ``StaleComputedBlocksError``, nothing
        changed); ``num_tokens`` and ``num_lookahead_tokens`` as in
        ``allocate_slots``. True when its blocks fit, False (nothing changed)
        when they do not. Its ids are in the manager's block table (for a
        model runner that reads it there) and ``get_block_ids``. The device
        manager reads the step's status, and the hit's size again only when
        something may have changed since ``read_prefix_hit`` looked it up
        (else that lookup is the check); never a block id."""
        if not isinstance(request, NewRequest):
            raise InvalidTypeError(f"must be a NewRequest, got {type(request).__name__}", argument="request",
                                   fix="pass the NewRequest read_prefix_hit looked up")
        return self._admit_sized(request, hit, num_tokens, num_lookahead_tokens)

    @mutating
    def prepare_admissions(self, max_prompt_len: int | None = None, *, num_lookahead_tokens: int = 0) -> int:
        """Before serving: what the first admission of each prompt length
        would otherwise do on the serving path, done now for every prompt up
        to ``max_prompt_len`` tokens (None: ``max_model_len``) with
        ``num_lookahead_tokens`` reserved (vLLM reserves none for a new
        prompt) and chunks up to ``max_num_batched_tokens``. The device
        manager makes each admission bucket's buffers and plan array and runs
        its launches once on a plan admitting no request, keeping them (the
        kernels compiled on a GPU), so each first admission replays them
        (``gpukv.device.admission_plan.single_prompt_buckets``: a step admitting
        several prompts, or a prompt that skips the prefix cache, can still
        meet a bucket of its own); likewise each release bucket the free of
        one request of up to ``max_prompt_len`` tokens and the lookahead can
        meet, with a release of no entry
        (``gpukv.device.releases.single_request_buckets``; a step finishing
        several requests at once can meet a larger one); the reference
        launches nothing. Changes nothing any other call reads or returns.
        Returns how many buckets it prepared, admission and release (0 on
        the reference, and for those prepared before)."""
        limit = self.limits.max_model_len
        if max_prompt_len is not None:
            max_prompt_len = check_size(max_prompt_len, "max_prompt_len", 1, limit)
        elif limit is not None:
            max_prompt_len = limit
        else:
            raise InvalidInputError("no max_model_len to take as the longest prompt", argument="max_prompt_len",
                                    fix="pass the longest prompt to prepare for")
        num_lookahead_tokens = check_size(num_lookahead_tokens, "num_lookahead_tokens", 0, MAX_LOOKAHEAD)
        self._begin_changes()  # (a fault past here, a launch or a compile failing, stops the manager)
        return self._prepare_admissions(max_prompt_len, num_lookahead_tokens)

    def _prepare_admissions(self, max_prompt_len: int, num_lookahead_tokens: int) -> int:  # noqa: ARG002
        """``prepare_admissions`` (its arguments checked): nothing to prepare
        for a manager that launches nothing."""
        return 0

    @abstractmethod
    def _admit_sized(self, request: NewRequest, hit: Any, num_tokens: int | None,
                     num_lookahead_tokens: int | None) -> bool:
        """``admit`` (its arguments not checked yet)."""

    @abstractmethod
    def _allocate_new(self, request: NewRequest, computed: ComputedBlocks | None, num_tokens: int | None,
                      num_lookahead_tokens: int | None) -> list[list[int]] | None:
        """``allocate_slots`` for a new request (its arguments not checked yet)."""

    @abstractmethod
    def _allocate_running(self, update: RunningUpdate) -> list[list[int]] | None:
        """A checked running update's blocks, or None (nothing changed) when they do not fit."""

    # ------------------------------------------------------------ checks
    @abstractmethod
    def _normalize(self, finished, running, new, *, single: bool = False, defer_admissible: bool = False) -> Step:
        """Every argument checked and normalised (``gpukv.core.checks``), before anything changes."""

    @abstractmethod
    def _row_of(self, request_id: str) -> int:
        """The row of a request the manager holds (its id checked)."""

    def _normalize_step(self, finished, running, new) -> tuple[Step, RunningRows | None]:
        """``step()``'s arguments checked; a ``RunningBatch`` apart."""
        if not isinstance(running, RunningBatch):
            return self._normalize(finished, running, new), None
        if type(finished) is tuple and type(new) is tuple and not finished and not new:
            return _NO_REQUESTS, self._normalize_running(running)  # (a decode's step: nothing else to check)
        step = self._normalize(finished, (), new)
        return step, self._normalize_running(running, [self._row_of(rid) for rid in step.finished])

    def _batch_device(self) -> torch.device | None:
        """Where a ``RunningBatch``'s token tensor may live besides the host
        (``gpukv.core.running_batch.normalize_running``): nowhere (the reference)."""
        return None

    def _normalize_running(self, batch: Any, finished_rows: Sequence[int] = ()) -> RunningRows:
        """A ``RunningBatch`` checked (``gpukv.core.running_batch.normalize_running``);
        ``finished_rows``: rows the same step frees first (not running then)."""
        rows = self._rows
        in_use = rows.in_use
        if finished_rows:
            in_use = in_use.copy()
            in_use[list(finished_rows)] = False
        run = taken_as_checked(batch, in_use, rows.num_tokens)
        if run is not None:
            return run
        return normalize_running(batch, in_use, rows.num_tokens.__getitem__, rows.num_computed.__getitem__,
                                 self._limits, self._batch_device())
