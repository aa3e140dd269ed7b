"""The device-resident block pool: the state the kernels change, and the
verbs that change it (``release``, ``allocate``, ``record``, as vLLM's
``BlockPool`` has them), each one launcher call with the pool's own
tensors, so the manager hands a kernel its entries and nothing of the pool.
vLLM's fourth verb, ``touch``, has no launch of its own: the admission's
launches that find its hits touch them (``gpukv.kernels.prefill``, through
``gpukv.kernels.blocks.add_references``), one launch fewer each.

One object owns every device tensor of the pool, sized once at construction:

* ``ref_cnt`` int32[N]: references per block (block 0, the null block, is never
  counted);
* ``free_queue``: the exact-order free queue (``gpukv.kernels.free_queue``);
* ``table``: the block-hash multimap (``gpukv.kernels.hash_table``); a block is
  cached exactly when ``table.block_slot[b] >= 0``;
* ``blk_tokens`` int32[N, block_size], ``blk_parent`` / ``blk_extra``
  int64[N, 2]: what each cached block was computed from, so a hit is verified
  against the request's own inputs;
* ``last_seen`` / ``touched`` int64[N]: per-step scratch stamps (which entry
  of a free batch is a block's last, which block a step already hit), and
  ``stamp`` int64[1], the admissions so far (each marks with its own);
* ``evictions`` int64[1].

The host-side views (``free_queue_list``, ``ref_counts``, ``table_entries``,
``check_invariants``) read the device and are for tests, reports and
debugging, never for the step itself.
"""

from __future__ import annotations

from typing import Any

import torch

from gpukv.core import hashing
from gpukv.kernels import blocks as block_ops
from gpukv.kernels import capture
from gpukv.kernels import free_queue as fq_ops
from gpukv.kernels import hash_table as table_ops


def _u64_bytes(lo: int, hi: int) -> bytes:
    return (lo & (2**64 - 1)).to_bytes(8, "little") + (hi & (2**64 - 1)).to_bytes(8, "little")


class DevicePool:
    def __init__(self, num_blocks: int, block_size: int, device: torch.device, *, uncached_first: bool = True):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {num_blocks!r}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.uncached_first = bool(uncached_first)
        i32: dict[str, Any] = dict(dtype=torch.int32, device=device)
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        self.ref_cnt = torch.zeros(num_blocks, **i32)
        self.free_queue = fq_ops.FreeQueue.create(num_blocks, device)
        self.table = table_ops.HashTable.create(num_blocks, device)
        self.blk_tokens = torch.zeros(num_blocks, block_size, **i32)
        self.blk_parent = torch.zeros(num_blocks, 2, **i64)
        self.blk_extra = torch.zeros(num_blocks, 2, **i64)
        self.last_seen = torch.full((num_blocks,), -1, **i64)
        self.touched = torch.full((num_blocks,), -1, **i64)
        self.evictions = torch.zeros(1, **i64)
        self.stamp = torch.zeros(1, **i64)  # admissions so far: each marks ``touched`` with its own
        # Host: at most this many tombstones in the table (``rebuild_if_due``).
        self.tombstone_bound = 0
        self._rebuild_launches: list | None = None  # the rebuild's two launches, kept by its first run

    # ------------------------------------------------------------- the verbs
    # What a step does to the pool, each one launcher call with the pool's
    # own tensors (``gpukv.kernels.blocks``); the entries (group, row,
    # position of a request's block table) come from the caller.
    def release(self, block_table, group, row, pos, call, *, valid=None, scratch=None, workspace=None) -> None:
        """Drop one reference per entry of ``block_table``, in free order (tail
        first, ``call`` per request and group); blocks reaching 0 go back to
        the free queue, uncached ones to the front when ``uncached_first``."""
        block_ops.release(block_table, group, row, pos, call, ref_cnt=self.ref_cnt, last_seen=self.last_seen,
                          fq=self.free_queue, table=self.table, uncached_first=self.uncached_first, valid=valid,
                          scratch=scratch, workspace=workspace)

    def allocate(self, count, want, group, row, pos, *, block_table, rank=None, popped=None,
                 on_popped=None) -> None:
        """Pop ``count`` blocks into the wanted entries of ``block_table``,
        evicting the hashes of cached ones (``on_popped`` sees them first)."""
        block_ops.allocate(count, want, group, row, pos, block_table=block_table, ref_cnt=self.ref_cnt,
                           fq=self.free_queue, table=self.table, evictions=self.evictions, rank=rank,
                           popped=popped, on_popped=on_popped)

    def record(self, group, row, pos, valid, *, block_table, tokens, digests, extras, root, scratch=None,
               seq=None):
        """Cache the blocks at the valid entries under their rows' digests,
        keeping their inputs for verification; returns the insert's inputs
        (``gpukv.kernels.blocks.record``)."""
        return block_ops.record(group, row, pos, valid, block_table=block_table, tokens=tokens, digests=digests,
                                extras=extras, root=root, blk_tokens=self.blk_tokens, blk_parent=self.blk_parent,
                                blk_extra=self.blk_extra, table=self.table, scratch=scratch, seq=seq)

    def rebuild_if_due(self, max_popped: int) -> None:
        """After a step that popped at most ``max_popped`` blocks: each popped
        block that was cached left at most one tombstone in the hash table,
        so the host keeps a bound on them and rebuilds the table (two
        launches) once the bound passes a quarter of its slots, the
        threshold ``maybe_rebuild`` checks on the device. Decided on the
        host, a step launches nothing for it until then, where a check on
        the device costs two launches every step; the rebuild keeps every
        lookup and order, so when it runs changes no result."""
        self.tombstone_bound += max_popped
        if self.tombstone_bound > self.table.capacity // 4:
            # (its arguments are the table's own tensors, which never move: kept once, then replayed)
            if self._rebuild_launches is None:
                with capture.preparing() as kept:
                    table_ops.rebuild(self.table)
                self._rebuild_launches = kept
            else:
                capture.run_prepared(self._rebuild_launches)
            self.tombstone_bound = 0

    @property
    def free_count(self) -> torch.Tensor:
        """The free count as a 1-element device tensor, a view kernels read
        (nothing waits: ``read_num_free_blocks`` on the manager reads it)."""
        return self.free_queue.counter("num_free")

    def reset_prefix_cache(self) -> None:
        table_ops.clear(self.table)
        self.tombstone_bound = 0

    # ------------------------------------------------------ host views (sync)
    def free_queue_list(self) -> list[int]:
        return self.free_queue.to_list()

    def ref_counts(self) -> list[int]:
        return self.ref_cnt.cpu().tolist()

    def table_entries(self) -> dict[tuple[bytes, int], list[int]]:
        """(digest, group) -> cached blocks oldest first, as the reference's
        ``BlockPool.table()``."""
        return {(_u64_bytes(lo, hi), g): blocks for (lo, hi, g), blocks in self.table.entries().items()}

    def check_invariants(self, key: bytes, *, verify_digests: bool = True) -> None:
        """Every block is exactly one of null / free / referenced; the free
        count is the queue's length; every cached block is in the table once,
        and (``verify_digests``) under the digest of what it was computed from
        (pass False when callers supply their own digests)."""
        self.free_queue.check_invariants()
        self.table.check_invariants()
        assert self.free_queue.read_error_flags() == 0, f"free-queue error flags {self.free_queue.read_error_flags()}"
        assert self.table.read_counters()["errors"] == 0, "hash-table error flags set"
        free = self.free_queue_list()
        ref = self.ref_counts()
        assert 0 not in free, "the null block is in the free queue"
        assert len(free) == len(set(free)), "a block is in the free queue twice"
        in_free = set(free)
        for b in range(1, self.num_blocks):
            assert ref[b] >= 0, f"block {b} has a negative count"
            assert (b in in_free) == (ref[b] == 0), f"block {b}: count {ref[b]}, in free queue: {b in in_free}"
        if not verify_digests:
            return
        tokens = self.blk_tokens.cpu().numpy()
        parent = self.blk_parent.cpu().tolist()
        extra = self.blk_extra.cpu().tolist()
        for (digest, _group), blocks in self.table_entries().items():
            for b in blocks:
                want = hashing.block_digest(key, _u64_bytes(*parent[b]), tokens[b].astype("uint32").tolist(),
                                            _u64_bytes(*extra[b]))
                assert want == digest, f"table entry for block {b} is not the digest of its contents"
