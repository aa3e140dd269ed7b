"""The launches the device manager's parts share: the kept-launch replay,
the chained-digest hashing of rows, the blocks' caching with their events,
and the hash table's rebuild when it is due.

The decode (``gpukv.device.decode``), the admission
(``gpukv.device.admission``), the releases and the output gather each run
their bucket's launches through ``replayed`` (FlashInfer's plan/run split:
the first run keeps the launches, later runs replay them without the
launchers' Python); the decode and the admission both hash and cache.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from gpukv import _runtime
from gpukv.kernels import capture
from gpukv.kernels.block_hash import hash_rows, hash_rows_host

if TYPE_CHECKING:
    from gpukv.device.state import DeviceState

# Under Triton's interpreter (no CUDA) one BLAKE3 compression of the hashing
# kernel costs 0.1-0.3 s, which made a short replay take minutes; there the
# digests come from the same function on the host (the ``blake3`` package),
# held bit-identical to the kernel by tests/kernels/test_block_hash.py.
# GPUKV_HASH_KERNEL=1 forces the kernel (the compile and fault tests launch it).
# (Read at each launch from this module: tests and ``tests/kernels/aot.py`` swap it.)
_hash_rows = (hash_rows_host if _runtime.INTERPRETED and os.environ.get("GPUKV_HASH_KERNEL") != "1"
              else hash_rows)


class SharedLaunches:
    """The launches of one device manager (``state``: its pool, rows, key
    and events) that more than one of its parts runs."""

    def __init__(self, state: DeviceState) -> None:
        self._s = state

    def replayed(self, prepared: dict, part: str, launch) -> None:
        """Run ``launch`` (a fixed sequence of launches on fixed buffers) the
        first time, keeping its launches in ``prepared[part]``; later, replay
        them, skipping the launchers' Python (the plan/run split). Not with
        KV-cache events (their launches are not all Triton's), and anew once
        the row tensors were reallocated."""
        s = self._s
        if s.events.log is not None:
            launch()
            return
        if self.is_kept(prepared, part):
            capture.run_prepared(prepared[part][1])
            return
        with capture.preparing() as launches:
            launch()
        prepared[part] = (s.rows.generation, launches)

    def is_kept(self, prepared: dict, part: str) -> bool:
        """Whether ``prepared[part]`` holds launches ``replayed`` replays:
        kept since the row tensors were last reallocated."""
        kept = prepared.get(part)
        return kept is not None and kept[0] == self._s.rows.generation

    def hash_rows(self, rows_t, starts_t, counts_t) -> None:
        """Chained digests of blocks ``[start, start + count)`` of each row, on
        the device, from the tokens and extra digests already there."""
        s = self._s
        rows = s.rows
        args = (s.key_dev, rows_t, starts_t, counts_t)
        kw: dict[str, Any] = dict(tokens=rows.tokens, digests=rows.digests, extras=rows.extras,
                                  root=s.root_lanes, block_size=s.block_size)
        if _hash_rows is hash_rows_host:  # the interpreter's host stand-in: counted and timed as a kernel
            capture.host_launch("block_hash._hash_rows_kernel", hash_rows_host, *args, **kw)
        else:
            _hash_rows(*args, **kw)

    def rebuild_if_due(self, max_popped: int) -> None:
        """The hash table's rebuild, when the host's bound on its tombstones
        says it is due (``DevicePool.rebuild_if_due``); a step calls it after
        its pops and outside its prepared launches and graphs, which are the
        same every step."""
        s = self._s
        if s.enable_caching and max_popped:  # (no cached block, no tombstone)
            s.pool.rebuild_if_due(max_popped)

    def cache_blocks(self, grp, rw, ps, valid, *, scratch=None, seq=None) -> None:
        """Cache the blocks at the valid (group, row, position) entries (the
        pool's ``record``), with their stored-block events."""
        s = self._s
        if not s.enable_caching:
            return
        rows, pool = s.rows, s.pool
        inserted = pool.record(grp, rw, ps, valid, block_table=rows.block_table, tokens=rows.tokens,
                               digests=rows.digests, extras=rows.extras, root=s.root_lanes, scratch=scratch, seq=seq)
        log = s.events.log
        if log is not None and inserted is not None:
            blk, ok, key = inserted
            log.stores(ok, blk, key, grp, rw, ps, blk_parent=pool.blk_parent, blk_tokens=pool.blk_tokens,
                       row_lora=rows.lora)
