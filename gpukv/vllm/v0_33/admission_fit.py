"""vLLM's fit rules at admission, on a gpukv manager: the watermark's
blocks, the fit check (the free blocks' host lower bound first, the device's
count only past it) and the blocks a hit takes out of the free queue."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpukv.core.protocol import BlockManager
from gpukv.core.requests import ComputedBlocks, PrefixHit
from gpukv.errors import InvalidInputError


def watermark_blocks(watermark: Any, num_blocks: int) -> int:
    """The blocks vLLM's watermark (a fraction of the pool) keeps free at admission."""
    if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or watermark < 0:
        raise InvalidInputError(f"watermark must be a number >= 0, got {watermark!r}", argument="watermark",
                                fix="pass the scheduler config's watermark (0.0 by default)")
    return int(watermark * num_blocks)


class HitTouches:
    """The blocks an admission's hit takes out of the free queue (its blocks
    no request holds), for vLLM's fit checks (``RequestAdmission.admission_fits``): a
    ``PrefixHit`` carries them; a ``ComputedBlocks`` hit's are read from the
    device (``num_evictable``) only where the fit turns on them, once. Where
    the blocks to take plus every block of the hit fit within the free
    blocks' lower bound (a host count), the fit holds whatever that read
    would give, so the decision is the read's."""

    __slots__ = ("manager", "computed", "count")

    def __init__(self, manager: BlockManager, computed: ComputedBlocks | PrefixHit | None) -> None:
        self.manager, self.computed = manager, computed
        self.count: int | None = 0
        if isinstance(computed, PrefixHit):
            self.count = computed.num_unheld_blocks
        elif computed is not None and computed.num_tokens:
            self.count = None  # (read when needed)

    def fit(self, num_blocks: int, watermark: int, reserved: int) -> bool:
        """``blocks_fit`` of ``num_blocks`` plus the hit's touches."""
        manager = self.manager
        if self.count is None:
            assert isinstance(self.computed, ComputedBlocks)
            most = sum(len(g) for g in self.computed.block_ids)  # (at least the blocks it touches)
            if num_blocks + most + watermark + reserved <= manager.free_blocks_lower_bound():
                return True
            self.count = num_evictable(manager, self.computed.block_ids)
        return blocks_fit(manager, num_blocks + self.count, watermark, reserved)


def blocks_fit(manager: BlockManager, num_blocks: int, watermark: int, reserved: int) -> bool:
    """vLLM's fit check: the blocks to take plus the watermark within the
    free blocks less ``reserved`` (past the manager's lower bound, its free
    count: the device manager's host mirror, no device read)."""
    need = num_blocks + watermark + reserved
    return need <= manager.free_blocks_lower_bound() or need <= manager.read_num_free_blocks()


def num_evictable(manager: BlockManager, hit_ids: Sequence[Sequence[int]]) -> int:
    """Hit blocks no request holds: a hit takes them out of the free queue,
    so they count as blocks to take (vLLM's fit check); one device read."""
    return manager.read_num_unheld([b for group in hit_ids for b in group])
