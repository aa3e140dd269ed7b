"""The device block manager: the reference's request-level calls and batched
step, with every piece of pool state and every block table on the device.

Plan on the host, run on the device: the host knows every request's token
count, so it lays out, with numpy, which (request, group, position) entries a
step touches, frees, allocates and caches. The device decides what only it can
know (hits, admission, whether a running update fits) and applies it. A step
reads the device at most once (a small status tensor, at the end); a step with
no new requests whose allocations fit the host's lower bound of free blocks
reads nothing.

Device tensors per request row (rows are recycled): ``tokens`` int32[R, T]
(T = ``max_model_len``), ``digests`` int64[R, M + 1, 2] (M = T / block size,
rounded up; the last column takes masked-off writes) and ``extras`` (same
layout) and the block tables ``block_table`` int32[G, R, M] that an
attention kernel can read directly (``block_table_for``).

Hybrid models: any mix of full-attention and sliding-window groups sharing
the pool, as the reference does them (a window group holds the null block
where its window no longer reaches).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from gpukv import _runtime, hashing
from gpukv.errors import InvalidInputError, InvalidTypeError, StaleComputedBlocksError, UnknownRequestError
from gpukv.kernels import blocks as block_ops
from gpukv.kernels import free_queue as fq_ops
from gpukv.kernels import hash_table as table_ops
from gpukv.kernels import lookup as lookup_ops
from gpukv.kernels.block_hash import hash_block_chains, hash_block_chains_host, key_lanes
from gpukv.failstop import FailStop, mutating, reading
from gpukv.metrics import PrefixCacheStats
from gpukv.pool import DevicePool
from gpukv.request import (
    MAX_NUM_BLOCKS,
    ComputedBlocks,
    ManagerLimits,
    NewRequest,
    RunningUpdate,
    Step,
    StepResult,
    check_memory,
    check_size,
    normalize_computed,
    normalize_device,
    normalize_step,
    normalize_token_ids,
    normalize_windows,
    resolve_key,
)

# Under Triton's interpreter (no CUDA) one BLAKE3 compression of the hashing
# kernel costs 0.1-0.3 s, which made a short replay take minutes; there the
# digests come from the same function on the host (the ``blake3`` package),
# held bit-identical to the kernel by tests/kernels/test_block_hash.py.
# GPUKV_HASH_KERNEL=1 forces the kernel (the compile and fault tests launch it).
_hash_chains = (hash_block_chains_host if _runtime.INTERPRETED and os.environ.get("GPUKV_HASH_KERNEL") != "1"
                else hash_block_chains)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _lanes(d: bytes) -> tuple[int, int]:
    return _signed(int.from_bytes(d[:8], "little")), _signed(int.from_bytes(d[8:], "little"))


def _as_int32_tokens(tokens: np.ndarray) -> np.ndarray:
    """uint32 token ids in the int32 bit pattern the device stores."""
    return tokens.astype(np.int64).astype(np.uint32).view(np.int32)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def device_bytes(num_blocks: int, block_size: int, num_groups: int, max_model_len: int,
                 max_num_reqs: int) -> dict[str, int]:
    """Bytes the device manager allocates at construction, by the argument
    that drives them (``gpukv.pool`` and the request rows below), so a size
    that cannot fit is refused before anything is allocated."""
    N, M = num_blocks, -(-max_model_len // block_size)
    cap = _pow2_at_least(2 * N)  # free-queue ring and hash-table slots
    pool = N * (4 + 4 * block_size + 32 + 16 + 8 + 4 + 8 + 8) + cap * (4 + 24)
    rows = max_num_reqs * (4 * max_model_len + 2 * 16 * (M + 1) + 4 * num_groups * M)
    return {"num_blocks": pool, "max_model_len": rows}  # rows: max_num_reqs of them, sized by max_model_len


def entry_layout(starts, stops, *, reverse: bool = False):
    """The host plan of a step phase: one entry per (request r, group g,
    position p) with ``starts[r, g] <= p < stops[r, g]``, ordered by request,
    then group, then position (descending with ``reverse``: a free call gives
    blocks back tail first). ``starts``/``stops`` are [R, G] (or [R], the same
    for every group of a one-group layout). Returns int64 arrays (request,
    group, position, call) where call = r * G + g: one free call per request
    and group. Vectorised: no Python loop over blocks."""
    starts = np.asarray(starts, dtype=np.int64)
    stops = np.asarray(stops, dtype=np.int64)
    if starts.ndim == 1:
        starts, stops = starts[:, None], stops[:, None]
    R, G = starts.shape
    counts = np.maximum(stops - starts, 0).ravel()
    call = np.repeat(np.arange(R * G, dtype=np.int64), counts)
    offs = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    pos = (stops.ravel()[call] - 1 - offs) if reverse else (starts.ravel()[call] + offs)
    return call // G, call % G, pos, call


@dataclass
class _Row:
    """What the host knows of a request without asking the device."""

    row: int
    num_tokens: int = 0
    num_blocks: int = 0  # per group
    num_cached: int = 0  # leading blocks cached (or hits), per group
    lora_id: int | None = None
    mm_items: tuple = ()
    cache_salt: str | None = None
    extras_known: int = 0  # extra-key digests written for blocks < this
    null_upto: list = field(default_factory=list)  # per group: positions below hold the null block

    @property
    def has_extra_keys(self) -> bool:
        return self.lora_id is not None or bool(self.mm_items) or self.cache_salt is not None


@dataclass
class StepCounters:
    """Per-step cost, for benchmarks: Triton kernel launches (the torch glue
    between them, gathers and prefix sums, is not counted) and device-to-host
    reads of the last step; ``history`` keeps (launches, reads) per step."""

    launches: int = 0
    syncs: int = 0
    history: list = field(default_factory=list)


class KVCacheManager(FailStop):
    """Device-resident manager with the reference's API (``gpukv.reference``)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        sliding_windows: Sequence[int | None] = (None,),
        enable_caching: bool = True,
        uncached_first: bool = True,
        hash_key: bytes | str | None = None,
        max_model_len: int = 8192,
        max_num_reqs: int = 64,
        device: torch.device | str | None = None,
    ) -> None:
        # Every argument is checked, and the memory it takes estimated, before
        # anything is allocated (numpy integers are accepted as sizes).
        block_size = check_size(block_size, "block_size", 1)
        windows = list(normalize_windows(sliding_windows))
        num_blocks = check_size(num_blocks, "num_blocks", 2, MAX_NUM_BLOCKS)
        if not enable_caching:
            raise InvalidInputError("the device manager always caches", argument="enable_caching",
                                    fix="use gpukv.reference.KVCacheManager with enable_caching=False")
        max_model_len = check_size(max_model_len, "max_model_len", 1, 2**31 - 1)
        max_num_reqs = check_size(max_num_reqs, "max_num_reqs", 1, 2**31 - 1)
        device = (normalize_device(device, _runtime.INTERPRETED, _runtime.CUDA_AVAILABLE) if device is not None
                  else _runtime.default_device())
        key = resolve_key(hash_key)
        check_memory(device_bytes(num_blocks, block_size, len(windows), max_model_len, max_num_reqs), device,
                     "the device manager", also="max_num_reqs")
        self.device = device
        self.block_size = block_size
        self.sliding_windows = windows
        self.num_groups = len(windows)
        # Blocks a window group must still see at a hit boundary; -1 = full attention.
        self._window_blocks = [-1 if w is None else -(-(w - 1) // block_size) for w in windows]
        self.max_model_len = max_model_len
        self.uncached_first = bool(uncached_first)
        self.pool = DevicePool(num_blocks, block_size, self.device, uncached_first=uncached_first)
        self._key = key
        self._limits = ManagerLimits(block_size, num_blocks, tuple(windows), max_model_len, True)
        self._root = hashing.root_digest(self._key)
        self._root_lanes = _lanes(self._root)
        self._key_dev = key_lanes(self._key, self.device)
        self._T = max_model_len
        self._M = -(-max_model_len // block_size)
        self._rows_cap = 0
        self.tokens = self.digests = self.extras = self.block_table = None
        # Request rows (tokens, digests, block tables) are sized for this many
        # requests at once (running ones and a step's candidates); past it they
        # double, between steps' kernels, never inside one.
        self._grow_rows(max_num_reqs)
        self._win_dev = torch.tensor(self._window_blocks, dtype=torch.int32, device=self.device)
        self._free_rows: list[int] = list(range(self._rows_cap))[::-1]
        self._reqs: dict[str, _Row] = {}
        self._stats_dev = torch.zeros(5, dtype=torch.int64, device=self.device)
        self._reset_flag = False
        self._stamp = 0
        self._free_lower_bound = num_blocks - 1
        self.counters = StepCounters()

    def __repr__(self) -> str:  # never show the key
        return (f"KVCacheManager(device={self.device}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size}, groups={self.sliding_windows})")

    # ------------------------------------------------------------ properties
    @property
    def hash_key(self) -> bytes:
        return self._key

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def limits(self) -> ManagerLimits:
        """What every call is checked against (block size, pool size, windows,
        ``max_model_len``): ``gpukv.request.min_blocks_to_admit(n, m.limits,
        can_hit)`` is the bound past which a new request is refused up front."""
        return self._limits

    @property
    def num_free_blocks(self) -> int:
        return int(self.pool.num_free.item())

    @property
    def num_evictions(self) -> int:
        return int(self.pool.evictions.item())

    @reading
    def free_queue(self) -> list[int]:
        return self.pool.free_queue_list()

    @reading
    def request_ids(self) -> list[str]:
        return list(self._reqs)

    @reading
    def get_block_ids(self, request_id: str) -> list[list[int]]:
        st = self._state(request_id)
        return self.block_table[:, st.row, : st.num_blocks].cpu().tolist()

    @reading
    def block_table_for(self, request_ids: Sequence[str]) -> torch.Tensor:
        """int32[G, len(request_ids), M] block tables of these requests (a
        device gather; rows past a request's blocks hold stale ids)."""
        rows = torch.tensor([self._state(r).row for r in request_ids], dtype=torch.long, device=self.device)
        return self.block_table[:, rows]

    @reading
    def num_computed_tokens(self, request_id: str) -> int:
        return self._state(request_id).num_tokens

    @reading
    def block_hashes(self, request_id: str) -> list[bytes]:
        st = self._state(request_id)
        n = st.num_tokens // self.block_size
        return hashing.lanes_to_digests(self.digests[st.row, :n].cpu().numpy())

    @mutating
    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        vals = self._stats_dev.cpu().tolist()
        self._stats_dev.zero_()
        stats = PrefixCacheStats(*vals, reset=self._reset_flag)
        self._reset_flag = False
        return stats

    @mutating
    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.pool.reset_prefix_cache()
        self._reset_flag = True
        return True

    def check_invariants(self, *, verify_digests: bool = True) -> None:
        """The pool's invariants (see ``DevicePool.check_invariants``), and each
        block's count equals the number of block-table rows that hold it."""
        self.pool.check_invariants(self._key, self._root, verify_digests=verify_digests)
        held = np.zeros(self.num_blocks, dtype=np.int64)
        bt = self.block_table.cpu().numpy()
        for st in self._reqs.values():
            for g in range(self.num_groups):
                for b in bt[g, st.row, : st.num_blocks]:
                    if b:
                        held[b] += 1
        assert held[1:].tolist() == self.pool.ref_counts()[1:], "reference counts disagree with the block tables"

    # ----------------------------------------------------- request-level API
    @mutating
    def get_computed_blocks(self, request: NewRequest) -> ComputedBlocks:
        """Look a new request up (counts in the stats); changes no block."""
        (request,) = self._normalize((), (), [request], single=True).new
        return self._lookup_only(request, count_stats=True)

    @mutating
    def allocate_slots(self, request: NewRequest | str, new_token_ids: Sequence[int] = (),
                       computed: ComputedBlocks | None = None) -> list[list[int]] | None:
        if isinstance(request, NewRequest):
            if len(normalize_token_ids(new_token_ids, "new_token_ids")):
                raise InvalidInputError("a new request brings its tokens in NewRequest.token_ids",
                                        argument="new_token_ids", fix="pass new_token_ids=() with a NewRequest")
            (request,) = self._normalize((), (), [request], single=True).new
            computed = normalize_computed(computed, self._limits)
            cap = 0
            if computed is not None:
                # Checked before anything changes: the given hit must still be
                # what a lookup finds now (a prefix of it may be taken).
                now = self._lookup_only(request, count_stats=False)
                cap = computed.num_tokens // self.block_size
                if (len(computed.block_ids) != self.num_groups or cap * self.block_size != computed.num_tokens
                        or cap > now.num_tokens // self.block_size
                        or any(list(computed.block_ids[g]) != now.block_ids[g][:cap] for g in range(self.num_groups))):
                    raise StaleComputedBlocksError("the computed blocks are stale (evicted since the lookup)",
                                                   argument="computed", fix="call get_computed_blocks again")
            res = self._step((), (), [request], count_stats=False, hit_caps=[cap])
            if res.num_admitted == 0:
                return None
            got = res.num_computed_tokens[0]
            blocks = self.get_block_ids(request.request_id)
            return [g[got // self.block_size:] for g in blocks]
        if not isinstance(request, str):
            raise InvalidTypeError(f"must be a NewRequest or a running request's id (str), got "
                                   f"{type(request).__name__}", argument="request",
                                   fix="pass a NewRequest to admit, or the id of a running request")
        if computed is not None:
            raise InvalidInputError("computed blocks are for new requests only", argument="computed",
                                    fix="pass computed=None with a running request's id")
        (update,) = self._normalize((), [RunningUpdate(request, new_token_ids)], (), single=True).running
        before = self._state(request).num_blocks
        res = self._step((), [update], ())
        if not res.ok:
            return None
        return [g[before:] for g in self.get_block_ids(request)]

    @mutating
    def free(self, request_id: str) -> None:
        (request_id,) = self._normalize([request_id], (), (), single=True).finished
        self._step([request_id], (), ())

    @mutating
    def step(self, finished: Sequence[str] = (), running: Sequence[RunningUpdate] = (),
             new: Sequence[NewRequest] = ()) -> StepResult:
        """The batched step; same phases and results as the reference's, and
        the same argument checks (``gpukv.request.normalize_step``): a refused
        call raises a ``gpukv.errors`` class and changes nothing."""
        step = self._normalize(finished, running, new)
        return self._step(list(step.finished), list(step.running), list(step.new))

    # -------------------------------------------------------------- internals
    def _state(self, request_id: str) -> _Row:
        try:
            return self._reqs[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"unknown request id {request_id!r}: it was never admitted or was already "
                                      "freed", argument="request_id",
                                      fix="pass the id of a request this manager holds") from None

    def _normalize(self, finished, running, new, *, single: bool = False) -> Step:
        """Every argument checked and normalised (``gpukv.request``), before anything changes."""
        return normalize_step(finished, running, new, known=self._reqs, limits=self._limits,
                              num_tokens=lambda rid: self._reqs[rid].num_tokens, single=single)

    def _grow_rows(self, need: int) -> None:
        if need <= self._rows_cap:
            return
        cap = max(need, 2 * self._rows_cap)
        dev, G, T, M = self.device, self.num_groups, self._T, self._M

        def grown(old, shape, dtype):
            t = torch.zeros(shape, dtype=dtype, device=dev)
            if old is not None:
                t[tuple(slice(0, s) for s in old.shape)] = old
            return t

        self.tokens = grown(self.tokens, (cap, T), torch.int32)
        self.digests = grown(self.digests, (cap, M + 1, 2), torch.int64)  # column M: a dump for masked writes
        self.extras = grown(self.extras, (cap, M + 1, 2), torch.int64)  # same layout as digests
        bt = torch.zeros((G, cap, M), dtype=torch.int32, device=dev)
        if self.block_table is not None:
            bt[:, : self._rows_cap] = self.block_table
        self.block_table = bt
        if self._rows_cap:
            self._free_rows = list(range(cap - 1, self._rows_cap - 1, -1)) + self._free_rows
        self._rows_cap = cap

    def _take_row(self) -> int:
        if not self._free_rows:
            self._grow_rows(self._rows_cap + 1)
        return self._free_rows.pop()

    def _i32(self, a) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a, dtype=np.int32), device=self.device)

    def _next_stamp(self, n: int) -> int:
        stamp = self._stamp
        self._stamp += n + 1
        return stamp

    def _launch(self, n: int = 1) -> None:
        self.counters.launches += n

    # The step ----------------------------------------------------------------
    def _step(self, finished, running, new, *, count_stats: bool = True, hit_caps=None) -> StepResult:
        """A step on normalised arguments (``_normalize``): nothing here refuses input."""
        self.counters.launches = 0
        self.counters.syncs = 0
        G, bs = self.num_groups, self.block_size
        dev = self.device
        pool = self.pool
        status_parts: list[torch.Tensor] = []

        # Phase 1: free the finished requests.
        if finished:
            self._release_requests(finished)
            for rid in finished:
                self._free_rows.append(self._reqs.pop(rid).row)

        # Phase 2: running updates.
        n_run = len(running)
        blocked = torch.zeros(1, dtype=torch.int32, device=dev)
        n_ok_dev = None
        needs = []
        if running:
            rows = [self._reqs[u.request_id] for u in running]
            self._release_behind_windows(rows)
            adds = [u.new_token_ids for u in running]
            new_totals = [st.num_tokens + len(a) for st, a in zip(rows, adds)]
            needs = [(-(-n // bs) - st.num_blocks) * G for st, n in zip(rows, new_totals)]
            self._write_tokens([st.row for st in rows], [st.num_tokens for st in rows], adds)
            cum = np.cumsum(needs)
            total = int(cum[-1])
            if total <= self._free_lower_bound:
                n_ok_dev = torch.full((1,), n_run, dtype=torch.int64, device=dev)
                count = torch.full((1,), total, dtype=torch.int64, device=dev)
                ok_known = True
            else:
                cum_dev = torch.as_tensor(cum, dtype=torch.int64, device=dev)
                n_ok_dev = (cum_dev <= pool.num_free).sum().reshape(1)
                count = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), cum_dev])[n_ok_dev]
                blocked = (n_ok_dev < n_run).to(torch.int32)
                ok_known = False
            rows_np = np.array([st.row for st in rows], dtype=np.int64)
            nb_new = np.array([-(-n // bs) for n in new_totals], dtype=np.int64)
            full_new = np.array([n // bs for n in new_totals], dtype=np.int64)
            n_ok_32 = n_ok_dev.to(torch.int32)
            # Entries: (update, group, position) in pop order.
            upd, grp, ps, _ = entry_layout(np.repeat([[st.num_blocks] for st in rows], G, 1),
                                           np.repeat(nb_new[:, None], G, 1))
            if len(upd):
                block_ops.allocate(count, self._i32(upd) < n_ok_32, self._i32(grp), self._i32(rows_np[upd]),
                                   self._i32(ps), block_table=self.block_table, ref_cnt=pool.ref_cnt,
                                   fq=pool.free_queue, table=pool.table, evictions=pool.evictions)
                self._launch(3)
            self._write_extras(rows, full_new.tolist())
            self._hash_rows(rows_np.tolist(), [st.num_cached for st in rows], full_new.tolist())
            # Cache the blocks that are full now.
            upd, grp, ps, _ = entry_layout(np.repeat([[st.num_cached] for st in rows], G, 1),
                                           np.repeat(full_new[:, None], G, 1))
            if len(upd):
                self._record(self._i32(grp), self._i32(rows_np[upd]), self._i32(ps), self._i32(upd) < n_ok_32)
            status_parts.append(n_ok_dev.to(torch.int64))

        # Phases 3-5: new requests.
        K = len(new)
        cand_rows: list[int] = []
        if new:
            cand_rows = [self._take_row() for _ in new]
            try:
                status, hits = self._admit_new(new, cand_rows, blocked, count_stats, hit_caps)
            except BaseException:
                self._free_rows.extend(reversed(cand_rows))  # no row leaks, whatever went wrong
                raise
            status_parts += [status[: lookup_ops.NUM_STATUS], hits.to(torch.int64)]

        # The one device-to-host read of the step (none when nothing is unknown).
        needs_read = bool(new) or (running and not ok_known)
        if needs_read:
            status_parts.append(pool.num_free.to(torch.int64))
            host = torch.cat(status_parts).cpu().tolist()
            self.counters.syncs += 1
            self._free_lower_bound = host[-1]
        else:
            host = None
        pos = 0
        n_ok = n_run
        if running:
            if host is not None:
                n_ok = int(host[0])
                pos = 1
            if host is None:  # a read already gave the exact count after this step
                self._free_lower_bound -= int(sum(needs[:n_ok]))
            for u, add in zip(running[:n_ok], adds[:n_ok]):
                st = self._reqs[u.request_id]
                st.num_tokens += len(add)
                st.num_blocks = -(-st.num_tokens // bs)
                st.num_cached = st.num_tokens // bs
        result = StepResult(running_failed_at=None if n_ok == n_run else n_ok)
        if new:
            stat = host[pos: pos + lookup_ops.NUM_STATUS]
            hits = host[pos + lookup_ops.NUM_STATUS: pos + lookup_ops.NUM_STATUS + K]
            admitted = int(stat[lookup_ops.ST_ADMITTED])
            result.num_admitted = admitted
            result.num_computed_tokens = [int(h) * bs for h in hits[:admitted]]
            for i, (req, row) in enumerate(zip(new, cand_rows)):
                if i < admitted:
                    n = len(req.token_ids)
                    h = int(hits[i])
                    self._reqs[req.request_id] = _Row(
                        row, n, -(-n // bs), n // bs, req.lora_id, tuple(req.mm_items), req.cache_salt,
                        extras_known=n // bs,
                        null_upto=[0 if w < 0 else max(0, h - w) for w in self._window_blocks],
                    )
                else:
                    self._free_rows.append(row)
        self.counters.history.append((self.counters.launches, self.counters.syncs))
        return result

    def _release_behind_windows(self, states: list[_Row]) -> None:
        """Window groups give back the blocks behind their window (tail first,
        one free call per request and group) and hold the null block there."""
        starts = np.array([st.null_upto for st in states], dtype=np.int64)
        stops = starts.copy()
        for g, w in enumerate(self.sliding_windows):
            if w is not None:
                skip = np.array([max(0, st.num_tokens - w + 1) // self.block_size for st in states])
                stops[:, g] = np.maximum(skip, starts[:, g])
        idx, grp, ps, call = entry_layout(starts, stops, reverse=True)
        for st, upto in zip(states, stops.tolist()):
            st.null_upto = upto
        if not len(idx):
            return
        rows_np = np.array([st.row for st in states], dtype=np.int64)
        g_t, r_t, p_t = self._i32(grp), self._i32(rows_np[idx]), self._i32(ps)
        block_ops.release(self.block_table, g_t, r_t, p_t, self._i32(call), ref_cnt=self.pool.ref_cnt,
                          last_seen=self.pool.last_seen, stamp=self._next_stamp(len(idx)), fq=self.pool.free_queue,
                          table=self.pool.table, uncached_first=self.uncached_first)
        self.block_table[g_t.long(), r_t.long(), p_t.long()] = 0
        self._launch(3)

    def _release_requests(self, request_ids: Sequence[str]) -> None:
        """Free whole requests: one free call per request and group, tail first."""
        states = [self._reqs[rid] for rid in request_ids]
        idx, grp, ps, call = entry_layout(np.zeros((len(states), self.num_groups), dtype=np.int64),
                                          np.repeat([[st.num_blocks] for st in states], self.num_groups, 1),
                                          reverse=True)
        if not len(idx):
            return
        rows_np = np.array([st.row for st in states], dtype=np.int64)
        block_ops.release(self.block_table, self._i32(grp), self._i32(rows_np[idx]), self._i32(ps), self._i32(call),
                          ref_cnt=self.pool.ref_cnt, last_seen=self.pool.last_seen, stamp=self._next_stamp(len(idx)),
                          fq=self.pool.free_queue, table=self.pool.table, uncached_first=self.uncached_first)
        self._launch(3)

    def _write_tokens(self, rows: list[int], starts: list[int], token_arrays: list) -> None:
        """Write tokens into request rows. Arrays come from the host; tensors
        already on the device (sampled tokens) are copied there, unread."""
        idx = [np.arange(s, s + len(a), dtype=np.int64) + r * self._T for r, s, a in zip(rows, starts, token_arrays)]
        if not idx or sum(len(i) for i in idx) == 0:
            return
        flat_idx = torch.as_tensor(np.concatenate(idx), device=self.device)
        if any(isinstance(a, torch.Tensor) for a in token_arrays):
            vals = torch.cat([a.to(self.device, torch.int64) if isinstance(a, torch.Tensor)
                              else torch.as_tensor(np.asarray(a, dtype=np.int64), device=self.device)
                              for a in token_arrays]).to(torch.int32)  # two's complement = the uint32 bits
        else:
            vals = torch.as_tensor(_as_int32_tokens(np.concatenate(token_arrays)), device=self.device)
        self.tokens.view(-1).index_copy_(0, flat_idx, vals)

    def _write_extras(self, states: list[_Row], num_full: list[int]) -> None:
        """Extra-key digests of blocks that became full (host side: they depend
        on the request's LoRA, multimodal items and salt, not on the device)."""
        idx, vals = [], []
        for st, n in zip(states, num_full):
            if n > st.extras_known and st.has_extra_keys:
                ds = hashing.extra_key_digests(self._key, n - st.extras_known, self.block_size, lora_id=st.lora_id,
                                               mm_items=st.mm_items, cache_salt=st.cache_salt,
                                               first_block=st.extras_known)
                idx.append(np.arange(st.extras_known, n) + st.row * (self._M + 1))
                vals.append(hashing.digests_to_lanes(ds).view(np.int64))
            st.extras_known = max(st.extras_known, n)
        if idx:
            flat = torch.as_tensor(np.concatenate(idx), device=self.device)
            self.extras.view(-1, 2).index_copy_(0, flat, torch.as_tensor(np.concatenate(vals), device=self.device))

    def _hash_rows(self, rows: list[int], starts: list[int], stops: list[int]) -> None:
        """Chained digests of blocks [start, stop) of each row, on the device,
        from the tokens already there."""
        work = [(r, s, e) for r, s, e in zip(rows, starts, stops) if e > s]
        if not work:
            return
        bs = self.block_size
        width = max(e - s for _, s, e in work)
        rows_t = torch.as_tensor([r for r, _, _ in work], dtype=torch.long, device=self.device)
        starts_t = torch.as_tensor([s for _, s, _ in work], dtype=torch.long, device=self.device)
        cols = starts_t[:, None] * bs + torch.arange(width * bs, device=self.device)[None, :]
        cols = cols.clamp(max=self._T - 1)
        toks = self.tokens[rows_t[:, None], cols].contiguous()
        bcols = (starts_t[:, None] + torch.arange(width, device=self.device)[None, :]).clamp(max=self._M - 1)
        extras = self.extras[rows_t[:, None], bcols].contiguous()
        root = torch.tensor(self._root_lanes, dtype=torch.int64, device=self.device)
        prev = self.digests[rows_t, (starts_t - 1).clamp(min=0)]
        parents = torch.where((starts_t > 0)[:, None], prev, root[None, :]).contiguous()
        nb = torch.as_tensor([e - s for _, s, e in work], dtype=torch.int32, device=self.device)
        out = _hash_chains(self._key_dev, parents, toks, nb, extras, block_size=bs, max_blocks=width)
        self._launch()
        # Positions past a row's last block go to the dump column M: a scatter
        # of fixed shape, not a boolean mask (which would read the device).
        mask = torch.arange(width, device=self.device)[None, :] < nb[:, None].long()
        cols_out = torch.where(mask, starts_t[:, None] + torch.arange(width, device=self.device)[None, :],
                               torch.full_like(bcols, self._M))
        self.digests[rows_t[:, None].expand(-1, width), cols_out] = out

    def _record(self, grp, rw, ps, valid) -> None:
        block_ops.record(grp, rw, ps, valid, block_table=self.block_table, tokens=self.tokens, digests=self.digests,
                         extras=self.extras, root=self._root_lanes, blk_tokens=self.pool.blk_tokens,
                         blk_parent=self.pool.blk_parent, blk_extra=self.pool.blk_extra, table=self.pool.table)
        table_ops.maybe_rebuild(self.pool.table)
        self._launch(5)  # record, insert (2), maybe_rebuild (2)

    def _prepare_new(self, new: Sequence[NewRequest], rows: list[int]) -> None:
        """Tokens, extra-key digests and digests of new requests into their rows.
        Every digest is computed here, on the device, from the tokens and
        extra keys: what a caller handed in as ``block_hashes`` decides nothing
        (``docs/design.md``)."""
        bs = self.block_size
        arrays = [r.token_ids for r in new]
        self._write_tokens(rows, [0] * len(rows), arrays)
        rows_t = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        self.extras[rows_t] = 0
        states = [_Row(row, 0, 0, 0, r.lora_id, tuple(r.mm_items), r.cache_salt) for r, row in zip(new, rows)]
        self._write_extras(states, [len(a) // bs for a in arrays])
        self._hash_rows(list(rows), [0] * len(rows), [len(a) // bs for a in arrays])

    def _pending_chains(self, K, rows_np, n_full, P, li, lp, lg):
        dev, bs = self.device, self.block_size
        ei, _, ep, _ = entry_layout(np.zeros(K, dtype=np.int64), n_full)
        if not len(ei):
            return None
        E = len(ei)
        ei_t, ep_t = self._i32(ei), self._i32(ep)
        e_rows = self._i32(rows_np[ei])
        lanes = self.digests[e_rows.long(), ep_t.long()]
        lo, hi = lanes[:, 0].contiguous(), lanes[:, 1].contiguous()
        scratch = table_ops.HashTable.create(E, dev)
        ones = torch.ones(E, dtype=torch.int32, device=dev)
        table_ops.insert(scratch, lo, hi, ep_t, self._i32(np.arange(E)), ones)
        head = table_ops.find_oldest(scratch, lo, hi, ep_t, ones)
        # Inputs equal to the chain head's (digests are the manager's own, so
        # only a hash collision could fail this; checked all the same).
        ok = lookup_ops.verify(e_rows[head.long()].contiguous(), e_rows, ep_t, tokens=self.tokens,
                               digests=self.digests, extras=self.extras, root=self._root_lanes, from_pool=False,
                               block_size=bs)
        ok = (ok >= 0).to(torch.int32)
        order = torch.argsort(head.long() * E + torch.arange(E, device=dev))
        nxt = torch.full((E,), -1, dtype=torch.int32, device=dev)
        same = head[order[1:]] == head[order[:-1]]
        nxt[order[:-1]] = torch.where(same, order[1:].to(torch.int32), torch.full_like(order[1:], -1).to(torch.int32))
        # Each lookup position starts at its own entry's chain head.
        offs = np.concatenate([[0], np.cumsum(n_full)[:-1]])
        heads = torch.full((K, P), -1, dtype=torch.int32, device=dev)
        q = lg == 0
        if q.any():
            qi, qp = li[q], lp[q]
            entry = torch.as_tensor(offs[qi] + qp, device=dev)
            h = head[entry]
            heads[torch.as_tensor(qi, device=dev), torch.as_tensor(qp, device=dev)] = torch.where(
                ok[entry] != 0, h, torch.full_like(h, -1))
        self._launch(4)  # insert (2), find, verify
        return heads, nxt, ei_t, ok

    def _lookup_tables(self, new, rows):
        """Host layout of the lookup: one entry per (request, position < max
        hit, group), and the per-request counts."""
        bs, G = self.block_size, self.num_groups
        n_tok = np.array([len(r.token_ids) for r in new], dtype=np.int64)
        n_full = n_tok // bs
        n_blocks = -(-n_tok // bs)
        skip = np.array([bool(r.skip_prefix_cache) for r in new], dtype=np.int32)
        max_hit = np.where(skip == 1, 0, (n_tok - 1) // bs)
        P = int(max(1, max_hit.max()))
        li, lg, lp, _ = entry_layout(np.zeros((len(new), G), dtype=np.int64), np.repeat(max_hit[:, None], G, 1))
        return n_tok, n_full, n_blocks, skip, max_hit, P, li, lp, lg

    def _lookup_only(self, request: NewRequest, count_stats: bool) -> ComputedBlocks:
        """The hit a step would give this request now, changing no block."""
        row = self._take_row()
        try:
            blocked = torch.zeros(1, dtype=torch.int32, device=self.device)
            _, hit, cache = self._admit_new([request], [row], blocked, count_stats, None, dry=True)
            n = int(hit[0].item())
            blocks = cache[0, :n].T.cpu().tolist() if n else [[] for _ in range(self.num_groups)]
        finally:
            self._free_rows.append(row)
        for g, w in enumerate(self._window_blocks):
            if w >= 0:  # a window group holds the null block before its last W hit positions
                blocks[g] = [0 if p < n - w else b for p, b in enumerate(blocks[g])]
        return ComputedBlocks(blocks, n * self.block_size)

    def _admit_new(self, new, rows, blocked, count_stats: bool, hit_caps=None, dry: bool = False):
        dev, bs, G = self.device, self.block_size, self.num_groups
        pool = self.pool
        K = len(new)
        self._prepare_new(new, rows)
        n_tok, n_full, n_blocks, skip, max_hit, P, li, lp, lg = self._lookup_tables(new, rows)
        if hit_caps is not None:
            max_hit = np.minimum(max_hit, np.asarray(hit_caps, dtype=np.int64))
            keep = lp < max_hit[li] if len(li) else np.zeros(0, bool)
            li, lp, lg = li[keep], lp[keep], lg[keep]
        rows_np = np.asarray(rows, dtype=np.int64)
        cache = torch.full((K, P, G), -1, dtype=torch.int32, device=dev)
        chains = None
        if len(li):
            li_t, lp_t, lg_t = self._i32(li), self._i32(lp), self._i32(lg)
            lrow_t = self._i32(rows_np[li])
            lanes = self.digests[lrow_t.long(), lp_t.long()]
            found = table_ops.find_oldest(pool.table, lanes[:, 0].contiguous(), lanes[:, 1].contiguous(), lg_t,
                                          torch.ones_like(lg_t))
            ok = lookup_ops.verify(found, lrow_t, lp_t, tokens=self.tokens, digests=self.digests, extras=self.extras,
                                   root=self._root_lanes, blk_tokens=pool.blk_tokens, blk_parent=pool.blk_parent,
                                   blk_extra=pool.blk_extra, from_pool=True, block_size=bs)
            cache[li_t.long(), lp_t.long(), lg_t.long()] = ok
            self._launch(2)
            # Blocks earlier requests of this step compute: every request's full
            # blocks are entries (request-major); a scratch multimap keyed by
            # (digest, position) names each entry's chain head (the earliest
            # entry with that key), a sort by (head, entry) links the chains in
            # request order, and the admission kernel walks them.
            chains = self._pending_chains(K, rows_np, n_full, P, li, lp, lg)
        hit = torch.full((K,), -1, dtype=torch.int32, device=dev)
        status = torch.zeros(lookup_ops.NUM_STATUS, dtype=torch.int64, device=dev)
        stamp = self._next_stamp(0)
        if chains is None:
            chains = (torch.full((K, P), -1, dtype=torch.int32, device=dev),) + tuple(
                torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(3))
        resolved = torch.full((K, P), -1, dtype=torch.int32, device=dev)
        lookup_ops.admit(cache, None, self._i32(max_hit), self._i32(n_blocks), self._i32(n_tok), self._i32(skip),
                         ref_cnt=pool.ref_cnt, touched=pool.touched, stamp=stamp, num_free=pool.num_free,
                         blocked=blocked, block_size=bs, hit_out=hit, status=status, window_blocks=self._win_dev,
                         chains=chains, resolved=resolved)
        self._launch()
        if count_stats:
            self._stats_dev += status[lookup_ops.ST_REQUESTS: lookup_ops.ST_HIT_TOKENS + 1]
        if dry:
            return status, hit, cache
        admitted = status[lookup_ops.ST_ADMITTED].to(torch.int32)
        hit_safe = hit.clamp(min=0)
        # Phase 5a: touch every admitted request's cache hits (a window group
        # holds real blocks only for the last W positions of its hit).
        if len(li):
            li_t, lp_t, lg_t = self._i32(li), self._i32(lp), self._i32(lg)
            c = cache[li_t.long(), lp_t.long(), lg_t.long()]
            h = hit_safe[li_t.long()]
            w = self._win_dev[lg_t.long()]
            first_real = torch.where(w < 0, torch.zeros_like(h), (h - w).clamp(min=0))
            in_hit = (li_t < admitted) & (lp_t < h)
            real = in_hit & (lp_t >= first_real)
            block_ops.touch(c, (real & (c >= 0)).to(torch.int32), ref_cnt=pool.ref_cnt, fq=pool.free_queue)
            self._launch(2)
        # Phase 5b: allocate, in (request, group, position) order.
        ai, ag, ap, _ = entry_layout(np.zeros((K, G), dtype=np.int64), np.repeat(n_blocks[:, None], G, 1))
        ai_t, ap_t = self._i32(ai), self._i32(ap)
        want = (ai_t < admitted) & (ap_t >= hit_safe[ai_t.long()])
        count = status[lookup_ops.ST_NEW_BLOCKS: lookup_ops.ST_NEW_BLOCKS + 1]
        block_ops.allocate(count, want, self._i32(ag), self._i32(rows_np[ai]), ap_t, block_table=self.block_table,
                           ref_cnt=pool.ref_cnt, fq=pool.free_queue, table=pool.table, evictions=pool.evictions)
        self._launch(3)
        # Phase 5c: hits into the block tables (pending hits take a reference).
        if len(li):
            li_l, lp_l, lg_l = li_t.long(), lp_t.long(), lg_t.long()
            c = cache[li_l, lp_l, lg_l]
            e = resolved[li_l, lp_l]
            e_row = self._i32(rows_np)[e.clamp(min=0).long()].long()
            from_pending = self.block_table[lg_l, e_row, lp_l]
            blk = torch.where(real, torch.where(c >= 0, c, from_pending), torch.zeros_like(c))
            r_l = self._i32(rows_np[li]).long()
            old = self.block_table[lg_l, r_l, lp_l]
            self.block_table[lg_l, r_l, lp_l] = torch.where(in_hit, blk, old)
            block_ops.touch(from_pending, (real & (c < 0)).to(torch.int32), ref_cnt=pool.ref_cnt, fq=pool.free_queue)
            self._launch(2)
        # Phase 5d: cache every block that is full, in (request, group, position) order.
        ci, cg, cp, _ = entry_layout(np.zeros((K, G), dtype=np.int64), np.repeat(n_full[:, None], G, 1))
        if len(ci):
            ci_t, cp_t = self._i32(ci), self._i32(cp)
            valid = (ci_t < admitted) & (cp_t >= hit_safe[ci_t.long()])
            self._record(self._i32(cg), self._i32(rows_np[ci]), cp_t, valid)
        return status, hit
