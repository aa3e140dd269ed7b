"""The one table of limits both managers check every integer against.

Every integer a caller hands either manager (sizes, rows, token ids, counts,
budgets, lookahead slots) is range-checked against this table before it
reaches numpy or a kernel, on every entry point, by the checks of
``gpukv.core.checks`` and ``gpukv.core.running_batch``: a value past a limit is refused with
a ``gpukv.errors`` class naming the argument (a ``CapacityError`` above a
maximum), and nothing changed. Both managers take their limits from here
alone, so they accept and refuse the same values (docs/design.md, "Limits").

Why each limit is what it is: the device keeps token positions, request rows,
counts and the step's token budget in int32, so each is at most ``2**31 - 1``;
its hash table holds two int32 slots a block (``2**30`` at most), so a pool
has at most ``2**29`` blocks; token ids are uint32, LoRA ids uint64. A
lookahead or a row's new tokens past the longest ``max_model_len`` could
never fit a request, and capping them keeps every sum the host computes over
a batch inside int64 (numpy would wrap it silently).

No torch and no numpy here: the command line reads the table without
importing either (``gpukv.tools.defaults``).
"""

from __future__ import annotations

#: The largest token id (token ids are uint32 on the device).
MAX_TOKEN_ID = 2**32 - 1
#: The largest LoRA id (uint64, two int64 lanes on the device).
MAX_LORA_ID = 2**64 - 1
#: Blocks in a pool, the null block included: the device hash table holds
#: at most 2**30 int32 slots, two per block.
MAX_NUM_BLOCKS = 2**29
#: ``max_model_len``: token positions are int32 on the device.
MAX_MODEL_LEN = 2**31 - 1
#: ``max_num_reqs``: request rows are int32 on the device.
MAX_NUM_REQS = 2**31 - 1
#: A count of requests (``get_num_common_prefix_blocks``' running requests).
MAX_COUNT = 2**31 - 1
#: A step's ``token_budget`` (int32 on the device; None is no budget).
MAX_TOKEN_BUDGET = 2**31 - 1
#: Lookahead slots of one request (``num_lookahead_tokens``): no request
#: holds more tokens than the largest ``max_model_len``.
MAX_LOOKAHEAD = MAX_MODEL_LEN
#: New tokens one row appends in a step (``num_new_tokens``): as many.
MAX_NEW_TOKENS = MAX_MODEL_LEN

#: The table, by what is limited: (smallest, largest) value accepted. The
#: checks read the constants above; this mapping is what the docs and the
#: tests read (one place, the same numbers).
LIMITS: dict[str, tuple[int, int]] = {
    "token_id": (0, MAX_TOKEN_ID),
    "lora_id": (0, MAX_LORA_ID),
    "num_blocks": (2, MAX_NUM_BLOCKS),
    "max_model_len": (1, MAX_MODEL_LEN),
    "max_num_reqs": (1, MAX_NUM_REQS),
    "num_running_requests": (0, MAX_COUNT),
    "token_budget": (0, MAX_TOKEN_BUDGET),
    "num_lookahead_tokens": (0, MAX_LOOKAHEAD),
    "num_new_tokens": (0, MAX_NEW_TOKENS),
}
