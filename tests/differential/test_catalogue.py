"""A catalogue of bad inputs, each run on both managers.

For every entry: both managers raise the same ``gpukv.errors`` class with the
same message, which names the argument (``error.argument``, the message's
start) and says how to fix it (``error.fix``, its end); every piece of state
is bit-identical to before (each tensor of the device manager, its pool, free
queue and hash table, and every host structure: request rows, the row
allocator, counters, stats; the reference's pool, free queue, table, requests
and stats); and a good step still works afterwards, with the same result on
both.

The managers are built once per module (the device manager runs under
Triton's interpreter here, a step costs about a second) and share one
pre-populated scenario: "a" and "b" running, "c" finished with its blocks
cached. The good step after each entry finishes the previous probe request
and admits the next one, so the scenario stays as it was.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from gpukv.core.hashing import MMItem
from gpukv.core.limits import MAX_COUNT
from gpukv.core.requests import ComputedBlocks, NewRequest, RunningUpdate
from gpukv.core.running_batch import RunningBatch
from gpukv.device.manager import DeviceManager
from gpukv.errors import (
    CapacityError,
    DuplicateRequestError,
    GpukvError,
    GpukvInputError,
    InvalidInputError,
    InvalidTypeError,
    StaleComputedBlocksError,
    UnknownRequestError,
)
from gpukv.reference.manager import ReferenceManager
from workload import state_of

KEY = bytes(range(16))
NUM_BLOCKS, BLOCK_SIZE, WINDOWS, MAX_LEN = 24, 2, [None, 4], 32


# ---------------------------------------------------------------- snapshots

def tensors_of(m) -> int:
    """How many tensors the snapshot of a device manager compares (a guard
    that the walk reaches the pool, free queue and hash table)."""
    count = 0

    def walk(x):
        nonlocal count
        if isinstance(x, tuple) and x and x[0] == "tensor":
            count += 1
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(state_of(m))
    return count


# ----------------------------------------------------------------- scenario

class Scenario:
    def __init__(self) -> None:
        self.ref = ReferenceManager(NUM_BLOCKS, BLOCK_SIZE, sliding_windows=WINDOWS, hash_key=KEY,
                                    max_model_len=MAX_LEN)
        self.dev = DeviceManager(NUM_BLOCKS, BLOCK_SIZE, sliding_windows=WINDOWS, hash_key=KEY,
                                 max_model_len=MAX_LEN, max_num_reqs=4)
        self.probe = itertools.count()
        self.last_probe = None
        for m in self.managers():
            m.step(new=[NewRequest("a", [1, 2, 3, 4, 5]), NewRequest("b", [1, 2, 3, 4, 9, 9]),
                        NewRequest("c", [20, 21, 22, 23, 24])])
            m.step(finished=["c"], running=[RunningUpdate("a", [6])])

    def managers(self):
        return (self.ref, self.dev)

    def good_step(self):
        """Finish the last probe, admit the next: the same result on both."""
        k = next(self.probe)
        finished = [self.last_probe] if self.last_probe else []
        req = NewRequest(f"probe{k}", [40, 41, 42, 43, 44])
        results = [m.step(finished=finished, new=[req]) for m in self.managers()]
        self.last_probe = req.request_id
        assert results[0] == results[1]
        assert results[0].num_admitted == 1
        assert results[0].num_computed_tokens == ([0] if k == 0 else [4])
        for m in self.managers():
            assert m.get_block_ids(req.request_id) == self.ref.get_block_ids(req.request_id)
        assert self.dev.free_queue() == self.ref.free_queue()
        assert self.dev.pool.ref_counts() == self.ref.pool.ref_cnt


@pytest.fixture(scope="module")
def scenario():
    return Scenario()


# ---------------------------------------------------------------- the table

OK_NEW = dict(request_id="n", token_ids=[1, 2, 3, 4, 5])


#: "c"'s cached prompt [20, 21, 22, 23, 24] as a lookup of it finds it (both managers).
C_HIT = ComputedBlocks([[9, 10], [12, 13]], 4)


def new(**kw):
    """A step with one new request, ``kw`` overriding the good defaults."""
    return lambda m: m.step(new=[NewRequest(**{**OK_NEW, **kw})])


def tok(tokens):
    return new(token_ids=tokens)


def gen(*items):
    return (x for x in items)


class CallerBug(Exception):
    """What a caller's own iterator raises midway (never raised by gpukv)."""


def raising(*items):
    """A caller's generator that yields ``items`` and then fails."""
    yield from items
    raise CallerBug("the caller's generator failed midway")


class UnhashableId(str):
    """A request-id str subclass that cannot be hashed."""

    __hash__ = None  # type: ignore[assignment]


class OddId(str):
    """A request-id str subclass that hashes and compares like nothing else."""

    def __hash__(self):
        return 7

    def __eq__(self, other):
        return True


def raw_mm(offset, length, hash_):
    """An MMItem built without its own checks (a caller can always do this):
    the managers must check what they are handed, not trust the type."""
    item = object.__new__(MMItem)
    for k, v in (("offset", offset), ("length", length), ("hash", hash_)):
        object.__setattr__(item, k, v)
    return item


CASES = [
    # --- finished: the wrong kind of container, bad ids
    ("finished-str", lambda m: m.step(finished="a"), InvalidTypeError, "finished"),
    ("finished-str-ab", lambda m: m.step(finished="ab"), InvalidTypeError, "finished"),
    ("finished-bytes", lambda m: m.step(finished=b"a"), InvalidTypeError, "finished"),
    ("finished-none", lambda m: m.step(finished=None), InvalidTypeError, "finished"),
    ("finished-object", lambda m: m.step(finished=object()), InvalidTypeError, "finished"),
    ("finished-set", lambda m: m.step(finished={"a"}), InvalidTypeError, "finished"),
    ("finished-dict", lambda m: m.step(finished={"a": 1}), InvalidTypeError, "finished"),
    ("finished-array", lambda m: m.step(finished=np.array(["a"])), InvalidTypeError, "finished"),
    ("finished-int-id", lambda m: m.step(finished=[1]), InvalidTypeError, "finished[0]"),
    ("finished-unknown", lambda m: m.step(finished=["nope"]), UnknownRequestError, "finished[0]"),
    ("finished-generator-unknown", lambda m: m.step(finished=gen("a", "nope")), UnknownRequestError, "finished[1]"),
    ("finished-twice", lambda m: m.step(finished=["a", "a"]), DuplicateRequestError, "finished[1]"),
    # --- running
    ("running-str", lambda m: m.step(running="a"), InvalidTypeError, "running"),
    ("running-none", lambda m: m.step(running=None), InvalidTypeError, "running"),
    ("running-object", lambda m: m.step(running=object()), InvalidTypeError, "running"),
    ("running-bare-update", lambda m: m.step(running=RunningUpdate("a", [1])), InvalidTypeError, "running"),
    ("running-tuple-entry", lambda m: m.step(running=[("a", [1])]), InvalidTypeError, "running[0]"),
    ("running-unknown", lambda m: m.step(running=[RunningUpdate("zz", [1])]), UnknownRequestError,
     "running[0].request_id"),
    ("running-int-id", lambda m: m.step(running=[RunningUpdate(5, [1])]), InvalidTypeError, "running[0].request_id"),
    ("running-twice", lambda m: m.step(running=[RunningUpdate("a", [1]), RunningUpdate("a", [2])]),
     DuplicateRequestError, "running[1]"),
    ("finished-and-running", lambda m: m.step(finished=["a"], running=[RunningUpdate("a", [1])]),
     DuplicateRequestError, "running[0]"),
    ("running-float-token", lambda m: m.step(running=[RunningUpdate("a", [1.5])]), InvalidTypeError,
     "running[0].new_token_ids"),
    ("running-negative-token", lambda m: m.step(running=[RunningUpdate("a", [-1])]), InvalidInputError,
     "running[0].new_token_ids"),
    ("running-token-2**32", lambda m: m.step(running=[RunningUpdate("a", [2**32])]), InvalidInputError,
     "running[0].new_token_ids"),
    ("running-str-tokens", lambda m: m.step(running=[RunningUpdate("a", "xyz")]), InvalidTypeError,
     "running[0].new_token_ids"),
    ("running-past-max-model-len", lambda m: m.step(running=[RunningUpdate("a", list(range(40)))]), CapacityError,
     "running[0].new_token_ids"),
    ("running-2d-array", lambda m: m.step(running=[RunningUpdate("a", np.ones((1, 2), dtype=np.int64))]),
     InvalidInputError, "running[0].new_token_ids"),
    ("running-float-tensor", lambda m: m.step(running=[RunningUpdate("a", torch.tensor([1.0]))]), InvalidTypeError,
     "running[0].new_token_ids"),
    ("running-meta-tensor", lambda m: m.step(running=[RunningUpdate("a", torch.tensor([1], device="meta"))]),
     InvalidTypeError, "running[0].new_token_ids"),
    ("running-generator-then-bad-new",
     lambda m: m.step(running=gen(RunningUpdate("a", iter([7]))), new=[NewRequest("n", iter([1, 2]), lora_id=-1)]),
     InvalidInputError, "new[0].lora_id"),
    # --- new: containers and entries
    ("new-str", lambda m: m.step(new="n"), InvalidTypeError, "new"),
    ("new-none", lambda m: m.step(new=None), InvalidTypeError, "new"),
    ("new-object", lambda m: m.step(new=object()), InvalidTypeError, "new"),
    ("new-bare-request", lambda m: m.step(new=NewRequest("n", [1])), InvalidTypeError, "new"),
    ("new-set", lambda m: m.step(new={1, 2}), InvalidTypeError, "new"),
    ("new-tuple-entry", lambda m: m.step(new=[("n", [1])]), InvalidTypeError, "new[0]"),
    ("new-int-id", new(request_id=5), InvalidTypeError, "new[0].request_id"),
    ("new-empty-id", new(request_id=""), InvalidInputError, "new[0].request_id"),
    ("new-id-in-use", new(request_id="a"), DuplicateRequestError, "new[0].request_id"),
    ("new-id-twice", lambda m: m.step(new=[NewRequest("n", [1]), NewRequest("n", [2])]), DuplicateRequestError,
     "new[1].request_id"),
    # --- new: tokens
    ("tokens-empty", tok([]), InvalidInputError, "new[0].token_ids"),
    # Iterators are built inside the call: each manager gets a fresh one.
    ("tokens-empty-iterator", lambda m: m.step(new=[NewRequest("n", iter([]))]), InvalidInputError,
     "new[0].token_ids"),
    ("tokens-float", tok([1, 1.5]), InvalidTypeError, "new[0].token_ids"),
    ("tokens-bool", tok([True]), InvalidTypeError, "new[0].token_ids"),
    ("tokens-bool-among-ints", tok([1, 2, True, 4]), InvalidTypeError, "new[0].token_ids"),
    ("tokens-negative", tok([1, -2]), InvalidInputError, "new[0].token_ids"),
    ("tokens-2**32", tok([1, 2**32]), InvalidInputError, "new[0].token_ids"),
    ("tokens-2**70", tok([1, 2**70]), InvalidInputError, "new[0].token_ids"),
    ("tokens-negative-and-huge", tok([-1, 2**64]), InvalidInputError, "new[0].token_ids"),
    ("tokens-str-element", tok(["x"]), InvalidTypeError, "new[0].token_ids"),
    ("tokens-none-element", tok([1, None]), InvalidTypeError, "new[0].token_ids"),
    ("tokens-none", tok(None), InvalidTypeError, "new[0].token_ids"),
    ("tokens-str", tok("abc"), InvalidTypeError, "new[0].token_ids"),
    ("tokens-int", tok(5), InvalidTypeError, "new[0].token_ids"),
    ("tokens-set", tok({1, 2}), InvalidTypeError, "new[0].token_ids"),
    ("tokens-iterator-with-float", lambda m: m.step(new=[NewRequest("n", iter([1, 2.0]))]), InvalidTypeError,
     "new[0].token_ids"),
    ("tokens-0d-array", tok(np.array(5)), InvalidInputError, "new[0].token_ids"),
    ("tokens-2d-array", tok(np.array([[1, 2], [3, 4]])), InvalidInputError, "new[0].token_ids"),
    ("tokens-2d-list", tok([[1, 2], [3, 4]]), InvalidTypeError, "new[0].token_ids"),
    ("tokens-0d-tensor", tok(torch.tensor(3)), InvalidInputError, "new[0].token_ids"),
    ("tokens-2d-tensor", tok(torch.tensor([[1, 2], [3, 4]])), InvalidInputError, "new[0].token_ids"),
    ("tokens-float-array", tok(np.array([1.0, 2.0])), InvalidTypeError, "new[0].token_ids"),
    ("tokens-bool-array", tok(np.array([True, False])), InvalidTypeError, "new[0].token_ids"),
    ("tokens-negative-array", tok(np.array([1, -1])), InvalidInputError, "new[0].token_ids"),
    ("tokens-uint64-array-out-of-range", tok(np.array([1, 2**32], dtype=np.uint64)), InvalidInputError,
     "new[0].token_ids"),
    ("tokens-object-array-with-str", tok(np.array([1, "x"], dtype=object)), InvalidTypeError, "new[0].token_ids"),
    ("tokens-float-tensor", tok(torch.tensor([1.0, 2.0])), InvalidTypeError, "new[0].token_ids"),
    ("tokens-bool-tensor", tok(torch.tensor([True])), InvalidTypeError, "new[0].token_ids"),
    ("tokens-int16-tensor", tok(torch.tensor([1, 2], dtype=torch.int16)), InvalidTypeError, "new[0].token_ids"),
    ("tokens-negative-tensor", tok(torch.tensor([1, -1])), InvalidInputError, "new[0].token_ids"),
    ("tokens-meta-tensor", tok(torch.tensor([1, 2], device="meta")), InvalidTypeError, "new[0].token_ids"),
    ("tokens-past-max-model-len", tok(list(range(MAX_LEN + 1))), CapacityError, "new[0].token_ids"),
    # 32 tokens without a possible hit: 16 blocks per group, 32 > 23 in the pool.
    ("tokens-never-fit-the-pool", new(token_ids=list(range(MAX_LEN)), skip_prefix_cache=True), CapacityError,
     "new[0].token_ids"),
    # --- new: LoRA, salt, skip_prefix_cache
    ("lora-negative", new(lora_id=-1), InvalidInputError, "new[0].lora_id"),
    ("lora-2**64", new(lora_id=2**64), InvalidInputError, "new[0].lora_id"),
    ("lora-bool", new(lora_id=True), InvalidTypeError, "new[0].lora_id"),
    ("lora-float", new(lora_id=1.0), InvalidTypeError, "new[0].lora_id"),
    ("lora-str", new(lora_id="1"), InvalidTypeError, "new[0].lora_id"),
    ("salt-lone-surrogate", new(cache_salt="tenant-\ud800"), InvalidInputError, "new[0].cache_salt"),
    ("salt-bytes", new(cache_salt=b"tenant"), InvalidTypeError, "new[0].cache_salt"),
    ("salt-int", new(cache_salt=5), InvalidTypeError, "new[0].cache_salt"),
    ("skip-int", new(skip_prefix_cache=1), InvalidTypeError, "new[0].skip_prefix_cache"),
    ("skip-str", new(skip_prefix_cache="yes"), InvalidTypeError, "new[0].skip_prefix_cache"),
    ("skip-none", new(skip_prefix_cache=None), InvalidTypeError, "new[0].skip_prefix_cache"),
    # --- new: multimodal items
    ("mm-str", new(mm_items="img"), InvalidTypeError, "new[0].mm_items"),
    ("mm-none", new(mm_items=None), InvalidTypeError, "new[0].mm_items"),
    ("mm-object", new(mm_items=object()), InvalidTypeError, "new[0].mm_items"),
    ("mm-bare-item", new(mm_items=MMItem(0, 2, "img")), InvalidTypeError, "new[0].mm_items"),
    ("mm-set", new(mm_items={MMItem(0, 2, "img")}), InvalidTypeError, "new[0].mm_items"),
    ("mm-tuple-entry", new(mm_items=[(0, 2, "img")]), InvalidTypeError, "new[0].mm_items[0]"),
    ("mm-generator-with-bad-entry",
     lambda m: m.step(new=[NewRequest("n", [1, 2, 3], mm_items=gen(MMItem(0, 1, "img"), "x"))]), InvalidTypeError,
     "new[0].mm_items[1]"),
    ("mm-hash-lone-surrogate", new(mm_items=(raw_mm(0, 2, "img-\udc00"),)), InvalidInputError,
     "new[0].mm_items[0].hash"),
    ("mm-overlapping", new(mm_items=(MMItem(0, 2, "x"), MMItem(1, 2, "y"))), InvalidInputError, "new[0].mm_items"),
    ("mm-outside-prompt", new(mm_items=(MMItem(3, 5, "x"),)), InvalidInputError, "new[0].mm_items[0]"),
    ("mm-past-the-end", new(mm_items=(MMItem(5, 1, "x"),)), InvalidInputError, "new[0].mm_items[0]"),
    ("mm-raw-negative-offset", new(mm_items=(raw_mm(-1, 2, "x"),)), InvalidInputError, "new[0].mm_items[0].offset"),
    ("mm-raw-empty-hash", new(mm_items=(raw_mm(0, 2, ""),)), InvalidTypeError, "new[0].mm_items[0].hash"),
    # --- new: block_hashes (deprecated, ignored, but its form is checked)
    ("hashes-mixed-lengths", new(block_hashes=[bytes(16), bytes(15)]), InvalidInputError, "new[0].block_hashes"),
    ("hashes-wrong-count", new(block_hashes=[bytes(16)]), InvalidInputError, "new[0].block_hashes"),
    ("hashes-str-entries", new(block_hashes=["x" * 16, "y" * 16]), InvalidTypeError, "new[0].block_hashes"),
    ("hashes-str", new(block_hashes="abc"), InvalidTypeError, "new[0].block_hashes"),
    # --- a valid finish (or update) next to an invalid new request: nothing happens
    ("finish-then-lora-2**64", lambda m: m.step(finished=["a"], new=[NewRequest("n", [1], lora_id=2**64)]),
     InvalidInputError, "new[0].lora_id"),
    ("finish-then-surrogate-salt", lambda m: m.step(finished=["a"], new=[NewRequest("n", [1], cache_salt="\ud800")]),
     InvalidInputError, "new[0].cache_salt"),
    ("finish-then-surrogate-mm",
     lambda m: m.step(finished=["a"], new=[NewRequest("n", [1], mm_items=(raw_mm(0, 1, "\ud800"),))]),
     InvalidInputError, "new[0].mm_items[0].hash"),
    ("update-then-2d-tokens",
     lambda m: m.step(running=[RunningUpdate("a", [7])], new=[NewRequest("n", np.ones((2, 2), dtype=np.int64))]),
     InvalidInputError, "new[0].token_ids"),
    # --- the request-level calls
    ("free-unknown", lambda m: m.free("nope"), UnknownRequestError, "request_id"),
    ("free-int", lambda m: m.free(5), InvalidTypeError, "request_id"),
    ("free-list", lambda m: m.free(["a"]), InvalidTypeError, "request_id"),
    ("get-block-ids-unknown", lambda m: m.get_block_ids("nope"), UnknownRequestError, "request_id"),
    ("get-computed-blocks-str", lambda m: m.get_computed_blocks("a"), InvalidTypeError, "request"),
    ("get-computed-blocks-in-use", lambda m: m.get_computed_blocks(NewRequest("a", [1])), DuplicateRequestError,
     "request.request_id"),
    ("get-computed-blocks-bad-tokens", lambda m: m.get_computed_blocks(NewRequest("n", [-1])), InvalidInputError,
     "request.token_ids"),
    ("allocate-new-with-tokens", lambda m: m.allocate_slots(NewRequest("n", [1]), [5]), InvalidInputError,
     "new_token_ids"),
    ("allocate-computed-str", lambda m: m.allocate_slots(NewRequest("n", [1, 2, 3]), computed="x"),
     InvalidTypeError, "computed"),
    ("allocate-computed-odd-tokens",
     lambda m: m.allocate_slots(NewRequest("n", [1, 2, 3]), computed=ComputedBlocks([[1], [1]], 3)),
     InvalidInputError, "computed"),
    ("allocate-computed-one-group",
     lambda m: m.allocate_slots(NewRequest("n", [1, 2, 3]), computed=ComputedBlocks([[1]], 2)),
     InvalidInputError, "computed"),
    ("allocate-running-float", lambda m: m.allocate_slots("a", [1.5]), InvalidTypeError, "new_token_ids"),
    ("allocate-computed-covers-every-token",
     lambda m: m.allocate_slots(NewRequest("n", [1, 2, 3, 4]), computed=ComputedBlocks([[1, 2], [1, 2]], 4)),
     InvalidInputError, "computed"),
    ("allocate-computed-null-in-a-full-group",
     lambda m: m.allocate_slots(NewRequest("n", [1, 2, 3, 4, 5]), computed=ComputedBlocks([[0, 2], [1, 2]], 4)),
     InvalidInputError, "computed"),
    # --- chunked prefill and lookahead slots ("a" holds 6 tokens, all computed)
    ("new-chunk-0", lambda m: m.step(new=[NewRequest("n", [1, 2, 3], num_tokens_to_compute=0)]),
     InvalidInputError, "new[0].num_tokens_to_compute"),
    ("new-chunk-past-prompt", lambda m: m.step(new=[NewRequest("n", [1, 2, 3], num_tokens_to_compute=4)]),
     InvalidInputError, "new[0].num_tokens_to_compute"),
    ("new-chunk-float", lambda m: m.step(new=[NewRequest("n", [1, 2, 3], num_tokens_to_compute=1.0)]),
     InvalidTypeError, "new[0].num_tokens_to_compute"),
    ("new-chunk-bool", lambda m: m.step(new=[NewRequest("n", [1, 2, 3], num_tokens_to_compute=True)]),
     InvalidTypeError, "new[0].num_tokens_to_compute"),
    # --- the step's token budget (vLLM's waiting loop)
    ("budget-negative", lambda m: m.step(new=[NewRequest("n", [1, 2, 3])], token_budget=-1),
     InvalidInputError, "token_budget"),
    ("budget-float", lambda m: m.step(new=[NewRequest("n", [1, 2, 3])], token_budget=8.0),
     InvalidTypeError, "token_budget"),
    ("budget-bool", lambda m: m.step(new=[NewRequest("n", [1, 2, 3])], token_budget=True),
     InvalidTypeError, "token_budget"),
    ("budget-str", lambda m: m.step(new=[NewRequest("n", [1, 2, 3])], token_budget="512"),
     InvalidTypeError, "token_budget"),
    ("budget-tensor-on-a-bad-call", lambda m: m.step(finished=["zz"], token_budget=torch.tensor([4])),
     UnknownRequestError, "finished[0]"),
    ("new-lookahead-negative", lambda m: m.step(new=[NewRequest("n", [1, 2, 3], num_lookahead_tokens=-1)]),
     InvalidInputError, "new[0].num_lookahead_tokens"),
    ("new-lookahead-past-max-model-len",
     lambda m: m.step(new=[NewRequest("n", [1, 2, 3], num_lookahead_tokens=MAX_LEN - 2)]),
     CapacityError, "new[0].num_lookahead_tokens"),
    ("running-chunk-nothing-left", lambda m: m.step(running=[RunningUpdate("a", [], 1)]),
     InvalidInputError, "running[0].num_tokens_to_compute"),
    ("running-chunk-0", lambda m: m.step(running=[RunningUpdate("a", [7], 0)]),
     InvalidInputError, "running[0].num_tokens_to_compute"),
    ("running-chunk-past-known", lambda m: m.step(running=[RunningUpdate("a", [7], 2)]),
     InvalidInputError, "running[0].num_tokens_to_compute"),
    ("running-lookahead-past-max-model-len",
     lambda m: m.step(running=[RunningUpdate("a", [7], None, MAX_LEN - 6)]),
     CapacityError, "running[0].num_lookahead_tokens"),
    ("running-lookahead-str", lambda m: m.step(running=[RunningUpdate("a", [7], None, "2")]),
     InvalidTypeError, "running[0].num_lookahead_tokens"),
    ("allocate-running-num-tokens-0", lambda m: m.allocate_slots("a", [7], num_tokens=0), InvalidInputError,
     "num_tokens"),
    ("allocate-running-nothing-left", lambda m: m.allocate_slots("a", num_tokens=1), InvalidInputError,
     "num_tokens"),
    ("allocate-new-num-tokens-past-prompt", lambda m: m.allocate_slots(NewRequest("n", [1, 2, 3]), num_tokens=4),
     InvalidInputError, "num_tokens"),
    ("allocate-new-lookahead-past-max-model-len",
     lambda m: m.allocate_slots(NewRequest("n", [1, 2, 3]), num_lookahead_tokens=MAX_LEN),
     CapacityError, "num_lookahead_tokens"),
    ("decode-chunk-nothing-left", lambda m: m.decode([m.row_of("a")], None, num_tokens_to_compute=[1]),
     InvalidInputError, "num_tokens_to_compute"),
    ("decode-chunk-0-with-tokens-left", lambda m: m.decode([m.row_of("a")], [7], num_tokens_to_compute=[0]),
     InvalidInputError, "num_tokens_to_compute"),
    ("decode-chunk-past-known", lambda m: m.decode([m.row_of("a")], [7], num_tokens_to_compute=[2]),
     InvalidInputError, "num_tokens_to_compute"),
    ("decode-chunks-wrong-length", lambda m: m.decode([m.row_of("a")], [7], num_tokens_to_compute=[1, 1]),
     InvalidTypeError, "num_tokens_to_compute"),
    ("decode-lookahead-past-max-model-len",
     lambda m: m.decode([m.row_of("a")], [7], num_lookahead_tokens=MAX_LEN - 6), CapacityError,
     "num_lookahead_tokens"),
    ("allocate-running-unknown", lambda m: m.allocate_slots("zz", [1]), UnknownRequestError, "request"),
    ("allocate-int-request", lambda m: m.allocate_slots(5), InvalidTypeError, "request"),
    ("allocate-running-with-computed", lambda m: m.allocate_slots("a", [1], computed=ComputedBlocks([[], []], 0)),
     InvalidInputError, "computed"),
    # --- the processed tokens window groups release behind (vLLM
    # 0.33 with tokens in flight): an int from 0 to the computed tokens after
    # the call ("a" computes 6, 7 once it appends a token), for running requests only
    ("allocate-processed-negative", lambda m: m.allocate_slots("a", [7], num_processed_tokens=-1),
     InvalidInputError, "num_processed_tokens"),
    ("allocate-processed-past-computed", lambda m: m.allocate_slots("a", [7], num_processed_tokens=8),
     InvalidInputError, "num_processed_tokens"),
    ("allocate-processed-past-chunk", lambda m: m.allocate_slots("a", [7, 8], num_tokens=1, num_processed_tokens=8),
     InvalidInputError, "num_processed_tokens"),
    ("allocate-processed-bool", lambda m: m.allocate_slots("a", [7], num_processed_tokens=True),
     InvalidTypeError, "num_processed_tokens"),
    ("allocate-processed-float", lambda m: m.allocate_slots("a", [7], num_processed_tokens=2.0),
     InvalidTypeError, "num_processed_tokens"),
    ("allocate-new-with-processed", lambda m: m.allocate_slots(NewRequest("n", [1, 2, 3]), num_processed_tokens=0),
     InvalidInputError, "num_processed_tokens"),
    ("running-processed-negative", lambda m: m.step(running=[RunningUpdate("a", [7], None, 0, -1)]),
     InvalidInputError, "running[0].num_processed_tokens"),
    ("running-processed-past-computed", lambda m: m.step(running=[RunningUpdate("a", [7], None, 0, 8)]),
     InvalidInputError, "running[0].num_processed_tokens"),
    ("running-processed-str", lambda m: m.step(running=[RunningUpdate("a", [7], None, 0, "3")]),
     InvalidTypeError, "running[0].num_processed_tokens"),
    ("running-second-processed-past-computed",
     lambda m: m.step(running=[RunningUpdate("a", [7], None, 0, 7), RunningUpdate("b", [7], None, 0, 99)]),
     InvalidInputError, "running[1].num_processed_tokens"),
    # --- the decode entry checks host tokens as step() does (a host tensor's
    # 2**32 + 5 hashed as 5 on the device would be a false hit)
    ("decode-host-tensor-2**32+5", lambda m: m.decode([m.row_of("a")], torch.tensor([2**32 + 5])),
     InvalidInputError, "new_token_ids"),
    ("decode-host-tensor-negative", lambda m: m.decode([m.row_of("a")], torch.tensor([-1])),
     InvalidInputError, "new_token_ids"),
    ("decode-host-tensor-2**40", lambda m: m.decode([m.row_of("a")], torch.tensor([2**40])),
     InvalidInputError, "new_token_ids"),
    ("decode-host-int32-tensor-negative", lambda m: m.decode([m.row_of("a")], torch.tensor([-5], dtype=torch.int32)),
     InvalidInputError, "new_token_ids"),
    ("decode-host-2d-tensor-one-bad", lambda m: m.decode([m.row_of("a"), m.row_of("b")], torch.tensor([[7], [2**32]])),
     InvalidInputError, "new_token_ids"),
    ("decode-numpy-2**40", lambda m: m.decode([m.row_of("a")], np.array([2**40])), InvalidInputError,
     "new_token_ids"),
    ("decode-list-2**32", lambda m: m.decode([m.row_of("a")], [2**32]), InvalidInputError, "new_token_ids"),
    ("decode-list-2**70", lambda m: m.decode([m.row_of("a")], [2**70]), InvalidInputError, "new_token_ids"),
    ("decode-list-str-token", lambda m: m.decode([m.row_of("a")], ["x"]), InvalidTypeError, "new_token_ids"),
    ("decode-float-tensor", lambda m: m.decode([m.row_of("a")], torch.tensor([1.0])), InvalidTypeError,
     "new_token_ids"),
    ("decode-meta-tensor", lambda m: m.decode([m.row_of("a")], torch.tensor([1], device="meta")),
     InvalidTypeError, "new_token_ids"),
    # --- a mistake in a call is a refusal, not a fault
    ("step-unknown-keyword", lambda m: m.step(bogus=1), InvalidTypeError, "bogus"),
    ("step-fourth-positional", lambda m: m.step((), (), (), ()), InvalidTypeError, "step"),
    ("step-finished-twice-by-keyword", lambda m: m.step((), finished=()), InvalidTypeError, "finished"),
    ("free-no-argument", lambda m: m.free(), InvalidTypeError, "request_id"),
    ("decode-without-tokens", lambda m: m.decode([m.row_of("a")]), InvalidTypeError, "new_token_ids"),
    ("decode-chunks-by-position", lambda m: m.decode([m.row_of("a")], [7], [1]), InvalidTypeError, "decode"),
    ("take-events-argument", lambda m: m.take_events(1), InvalidTypeError, "take_events"),
    ("allocate-unknown-keyword", lambda m: m.allocate_slots("a", tokens=[7]), InvalidTypeError, "tokens"),
    ("get-computed-blocks-no-argument", lambda m: m.get_computed_blocks(), InvalidTypeError, "request"),
    ("reset-prefix-cache-argument", lambda m: m.reset_prefix_cache(True), InvalidTypeError, "reset_prefix_cache"),
    ("stats-keyword", lambda m: m.make_prefix_cache_stats(reset=True), InvalidTypeError, "reset"),
    ("get-block-ids-no-argument", lambda m: m.get_block_ids(), InvalidTypeError, "request_id"),
    ("row-of-two-arguments", lambda m: m.row_of("a", "b"), InvalidTypeError, "row_of"),
    # ragged containers
    ("decode-ragged-tokens", lambda m: m.decode([m.row_of("a"), m.row_of("b")], [[8, 9], [10]]),
     InvalidInputError, "new_token_ids"),
    ("decode-ragged-mixed-tokens", lambda m: m.decode([m.row_of("a"), m.row_of("b")], [[8], 9]),
     InvalidInputError, "new_token_ids"),
    ("decode-ragged-chunks",
     lambda m: m.decode([m.row_of("a"), m.row_of("b")], [[8], [9]], num_tokens_to_compute=[[1], [2, 3]]),
     InvalidTypeError, "num_tokens_to_compute"),
    ("decode-rows-past-int64", lambda m: m.decode([2**70], [7]), InvalidInputError, "rows"),
    # counts handed as arrays (once truth-tested before being checked: numpy's ValueError, a fault)
    ("allocate-lookahead-array", lambda m: m.allocate_slots("a", [7], num_lookahead_tokens=np.array([1, 2])),
     InvalidTypeError, "num_lookahead_tokens"),
    ("decode-lookahead-array", lambda m: m.decode([m.row_of("a")], [7], num_lookahead_tokens=np.array([1, 2])),
     InvalidTypeError, "num_lookahead_tokens"),
    ("running-lookahead-array", lambda m: m.step(running=[RunningUpdate("a", [7], None, np.array([1, 2]))]),
     InvalidTypeError, "running[0].num_lookahead_tokens"),
    ("tokens-nested-ragged", tok([[1, 2], [3]]), InvalidTypeError, "new[0].token_ids"),
    # unhashable or odd request ids
    ("new-unhashable-id", new(request_id=UnhashableId("u")), InvalidTypeError, "new[0].request_id"),
    ("new-odd-id", new(request_id=OddId("u")), InvalidTypeError, "new[0].request_id"),
    ("finished-unhashable-id", lambda m: m.step(finished=[UnhashableId("a")]), InvalidTypeError, "finished[0]"),
    ("finished-odd-id", lambda m: m.step(finished=[OddId("zz")]), InvalidTypeError, "finished[0]"),
    ("running-unhashable-id", lambda m: m.step(running=[RunningUpdate(UnhashableId("a"), [7])]), InvalidTypeError,
     "running[0].request_id"),
    ("free-unhashable-id", lambda m: m.free(UnhashableId("a")), InvalidTypeError, "request_id"),
    ("allocate-unhashable-id", lambda m: m.allocate_slots(UnhashableId("a"), [7]), InvalidTypeError, "request"),
    ("get-block-ids-unhashable-id", lambda m: m.get_block_ids(UnhashableId("a")), InvalidTypeError, "request_id"),
    ("row-of-odd-id", lambda m: m.row_of(OddId("zz")), InvalidTypeError, "request_id"),
    ("row-of-int-id", lambda m: m.row_of(0), InvalidTypeError, "request_id"),
    ("request-counts-int-id", lambda m: m.request_counts(0), InvalidTypeError, "request_id"),
    ("request-counts-unknown", lambda m: m.request_counts("zz"), UnknownRequestError, "request_id"),
    ("num-null-blocks-int-id", lambda m: m.num_null_blocks(0), InvalidTypeError, "request_id"),
    ("num-null-blocks-unknown", lambda m: m.num_null_blocks("zz"), UnknownRequestError, "request_id"),
    ("num-computed-unhashable-id", lambda m: m.num_computed_tokens(UnhashableId("a")), InvalidTypeError,
     "request_id"),
    ("block-hashes-list-id", lambda m: m.block_hashes(["a"]), InvalidTypeError, "request_id"),
    # a caller's iterator that raises midway
    ("finished-generator-raises", lambda m: m.step(finished=raising("a")), InvalidInputError, "finished"),
    ("running-generator-raises", lambda m: m.step(running=raising(RunningUpdate("a", [7]))), InvalidInputError,
     "running"),
    ("new-generator-raises", lambda m: m.step(new=raising(NewRequest("n", [1, 2]))), InvalidInputError, "new"),
    ("tokens-generator-raises", lambda m: m.step(new=[NewRequest("n", raising(1, 2, 3))]), InvalidInputError,
     "new[0].token_ids"),
    ("running-tokens-generator-raises", lambda m: m.step(running=[RunningUpdate("a", raising(7))]),
     InvalidInputError, "running[0].new_token_ids"),
    ("finish-then-tokens-generator-raises",
     lambda m: m.step(finished=["a"], new=[NewRequest("n", raising(1, 2, 3))]), InvalidInputError,
     "new[0].token_ids"),
    ("mm-generator-raises", lambda m: m.step(new=[NewRequest("n", [1, 2, 3], mm_items=raising())]),
     InvalidInputError, "new[0].mm_items"),
    ("decode-rows-generator-raises", lambda m: m.decode(raising(m.row_of("a")), [7]), InvalidInputError, "rows"),
    ("decode-tokens-generator-raises", lambda m: m.decode([m.row_of("a")], raising(7)), InvalidInputError,
     "new_token_ids"),
    ("decode-chunks-generator-raises",
     lambda m: m.decode([m.row_of("a")], [7], num_tokens_to_compute=raising(1)), InvalidInputError,
     "num_tokens_to_compute"),
    ("allocate-tokens-generator-raises", lambda m: m.allocate_slots("a", raising(7)), InvalidInputError,
     "new_token_ids"),
    ("get-computed-blocks-tokens-generator-raises",
     lambda m: m.get_computed_blocks(NewRequest("n", raising(1, 2, 3))), InvalidInputError, "request.token_ids"),
    ("block-table-for-generator-raises", lambda m: m.block_table_for(raising("a")), InvalidInputError,
     "request_ids"),
    # where the two managers disagreed
    ("common-prefix-str-count", lambda m: m.get_num_common_prefix_blocks("a", "2"), InvalidTypeError,
     "num_running_requests"),
    ("common-prefix-float-count", lambda m: m.get_num_common_prefix_blocks("a", 2.0), InvalidTypeError,
     "num_running_requests"),
    ("common-prefix-bool-count", lambda m: m.get_num_common_prefix_blocks("a", True), InvalidTypeError,
     "num_running_requests"),
    ("common-prefix-negative-count", lambda m: m.get_num_common_prefix_blocks("a", -1), InvalidInputError,
     "num_running_requests"),
    ("common-prefix-unknown", lambda m: m.get_num_common_prefix_blocks("zz", 1), UnknownRequestError, "request_id"),
    ("block-table-for-str", lambda m: m.block_table_for("ab"), InvalidTypeError, "request_ids"),
    ("block-table-for-bare-id", lambda m: m.block_table_for("a"), InvalidTypeError, "request_ids"),
    ("block-table-for-int-id", lambda m: m.block_table_for([1]), InvalidTypeError, "request_ids[0]"),
    ("block-table-for-unknown", lambda m: m.block_table_for(["a", "zz"]), UnknownRequestError, "request_ids[1]"),
    ("block-table-for-set", lambda m: m.block_table_for({"a"}), InvalidTypeError, "request_ids"),
    # --- a running batch as arrays (gpukv.RunningBatch) and the step's outputs
    ("batch-counts-wrong-length", lambda m: m.step(running=RunningBatch([m.row_of("a")], [7], num_new_tokens=[1, 1])),
     InvalidTypeError, "num_new_tokens"),
    ("batch-counts-negative",
     lambda m: m.step(running=RunningBatch([m.row_of("a"), m.row_of("b")], [7], num_new_tokens=[2, -1])),
     InvalidInputError, "num_new_tokens"),
    ("batch-counts-floats", lambda m: m.step(running=RunningBatch([m.row_of("a")], [7], num_new_tokens=[1.0])),
     InvalidTypeError, "num_new_tokens"),
    ("batch-flat-tokens-short",
     lambda m: m.step(running=RunningBatch([m.row_of("a"), m.row_of("b")], [7], num_new_tokens=[1, 1])),
     InvalidInputError, "new_token_ids"),
    ("batch-flat-token-2**32", lambda m: m.step(running=RunningBatch([m.row_of("a")], [2**32], num_new_tokens=[1])),
     InvalidInputError, "new_token_ids"),
    ("batch-flat-tokens-2d",
     lambda m: m.step(running=RunningBatch([m.row_of("a")], np.array([[7]]), num_new_tokens=[1])),
     InvalidTypeError, "new_token_ids"),
    ("batch-row-finished-in-the-step", lambda m: m.step(finished=["b"], running=RunningBatch([m.row_of("b")], [7])),
     InvalidInputError, "rows"),
    ("batch-row-twice", lambda m: m.step(running=RunningBatch([m.row_of("a"), m.row_of("a")], [7, 8])),
     InvalidInputError, "rows"),
    ("batch-lookahead-negative",
     lambda m: m.step(running=RunningBatch([m.row_of("a")], [7], num_lookahead_tokens=[-1])),
     InvalidInputError, "num_lookahead_tokens"),
    ("batch-lookahead-past-max-model-len",
     lambda m: m.step(running=RunningBatch([m.row_of("a")], [7], num_lookahead_tokens=[MAX_LEN])),
     CapacityError, "num_lookahead_tokens"),
    ("batch-past-max-model-len",
     lambda m: m.step(running=RunningBatch([m.row_of("a")], [7] * MAX_LEN, num_new_tokens=[MAX_LEN])),
     CapacityError, "new_token_ids"),
    ("decode-ragged-counts-and-rows-disagree", lambda m: m.decode([m.row_of("a")], [7, 8], num_new_tokens=[1]),
     InvalidInputError, "new_token_ids"),
    ("step-block-ids-not-bool", lambda m: m.step(block_ids=1), InvalidTypeError, "block_ids"),
    ("common-prefix-count-10**30", lambda m: m.get_num_common_prefix_blocks("a", 10**30), CapacityError,
     "num_running_requests"),
    ("step-prefix-of-unknown", lambda m: m.step(prefix_of="zz"), UnknownRequestError, "prefix_of"),
    ("step-prefix-of-int", lambda m: m.step(prefix_of=3), InvalidTypeError, "prefix_of"),
    ("step-prefix-of-finished", lambda m: m.step(finished=["a"], prefix_of="a"), InvalidInputError, "prefix_of"),
    ("row-counts-unknown-row", lambda m: m.row_token_counts([m.row_of("a"), 99]), InvalidInputError, "rows"),
    # --- hostile integers, range-checked before numpy sees them
    # (a row of 2**63 - 1 once overflowed np.bincount and corrupted the
    # heap; 2**40 raised a MemoryError that stopped the manager)
    *[(f"{where}-row-{label}", call, exc, "rows")
      for label, row, exc in (("2**63-1", 2**63 - 1, InvalidInputError), ("2**40", 2**40, InvalidInputError),
                              ("2**31", 2**31, InvalidInputError), ("-1", -1, InvalidInputError),
                              ("-2**63", -2**63, InvalidInputError), ("bool", True, InvalidTypeError),
                              ("float", 0.0, InvalidTypeError))
      for where, call in (("decode", lambda m, r=row: m.decode([r], [8])),
                          ("batch", lambda m, r=row: m.step(running=RunningBatch([r], [8]))),
                          ("row-counts", lambda m, r=row: m.row_token_counts([r])))],
    ("decode-row-uint64-2**64-1", lambda m: m.decode(np.array([2**64 - 1], dtype=np.uint64), [8]),
     InvalidInputError, "rows"),
    ("decode-row-after-a-good-one-2**63-1", lambda m: m.decode([m.row_of("a"), 2**63 - 1], [8, 9]),
     InvalidInputError, "rows"),
    *[(f"decode-counts-{label}", lambda m, c=count: m.decode([m.row_of("a")], [8], num_new_tokens=[c]), exc,
       "num_new_tokens")
      for label, count, exc in (("2**63-1", 2**63 - 1, CapacityError), ("2**40", 2**40, CapacityError),
                                ("2**31", 2**31, CapacityError), ("2**64", 2**64, CapacityError),
                                ("-2**64", -2**64, InvalidInputError), ("bool", True, InvalidTypeError),
                                ("float", 1.0, InvalidTypeError))],
    ("decode-counts-uint64-2**64-1",
     lambda m: m.decode([m.row_of("a")], [8], num_new_tokens=np.array([2**64 - 1], dtype=np.uint64)),
     CapacityError, "num_new_tokens"),
    # (their int64 sum wraps to 0, what the flat tokens hold: once taken, then a 2**62-wide array)
    ("decode-counts-summing-past-int64",
     lambda m: m.decode([m.row_of("a"), m.row_of("b")], [], num_new_tokens=[2**62, 2**62 * 3]),
     CapacityError, "num_new_tokens"),
    *[(f"decode-lookahead-{label}", lambda m, la=la: m.decode([m.row_of("a")], [8], num_lookahead_tokens=la), exc,
       "num_lookahead_tokens")
      for label, la, exc in (("2**63-1", 2**63 - 1, CapacityError), ("2**40", 2**40, CapacityError),
                             ("list-2**63-1", [2**63 - 1], CapacityError), ("list-2**40", [2**40], CapacityError),
                             ("list-bool", [True], InvalidTypeError), ("float", 1.0, InvalidTypeError),
                             ("-1", -1, InvalidInputError))],
    ("running-lookahead-2**63-1", lambda m: m.step(running=[RunningUpdate("a", [8], None, 2**63 - 1)]),
     CapacityError, "running[0].num_lookahead_tokens"),
    ("new-lookahead-2**40", new(num_lookahead_tokens=2**40), CapacityError, "new[0].num_lookahead_tokens"),
    ("allocate-lookahead-2**63-1", lambda m: m.allocate_slots("a", [8], num_lookahead_tokens=2**63 - 1),
     CapacityError, "num_lookahead_tokens"),
    *[(f"decode-chunk-{label}", lambda m, c=c: m.decode([m.row_of("a")], [8], num_tokens_to_compute=[c]), exc,
       "num_tokens_to_compute")
      for label, c, exc in (("2**63-1", 2**63 - 1, InvalidInputError), ("2**40", 2**40, InvalidInputError),
                            ("-1", -1, InvalidInputError), ("bool", True, InvalidTypeError),
                            ("float", 1.0, InvalidTypeError))],
    *[(f"budget-{label}", lambda m, b=b: m.step(new=[NewRequest("n", [1, 2, 3])], token_budget=b), CapacityError,
       "token_budget")
      for label, b in (("2**63", 2**63), ("2**63-1", 2**63 - 1), ("2**40", 2**40), ("2**31", 2**31))],
    ("budget-2**63-on-a-graphless-step-of-nothing", lambda m: m.step(token_budget=2**63), CapacityError,
     "token_budget"),
    ("common-prefix-count-2**63-1", lambda m: m.get_num_common_prefix_blocks("a", 2**63 - 1), CapacityError,
     "num_running_requests"),
    ("read-block-ids-end-2**63-1", lambda m: m.read_block_ids([("a", 0, 2**63 - 1)]), InvalidInputError, "spans"),
    ("read-block-ids-group-2**40", lambda m: m.read_block_ids([("a", 0, 1)], 2**40), InvalidInputError, "group"),
    ("new-chunk-2**63-1", new(num_tokens_to_compute=2**63 - 1), InvalidInputError, "new[0].num_tokens_to_compute"),
    # --- signature mistakes, in gpukv's own words
    ("lower-bound-argument", lambda m: m.free_blocks_lower_bound(1), InvalidTypeError, "free_blocks_lower_bound"),
    ("row-counts-no-argument", lambda m: m.row_token_counts(), InvalidTypeError, "rows"),
    ("decode-rows-twice", lambda m: m.decode([0], [8], rows=[0]), InvalidTypeError, "rows"),
    ("decode-unknown-keyword", lambda m: m.decode([0], [8], lookahead=1), InvalidTypeError, "lookahead"),
]


# Computed blocks that are not the request's own (the hit of "c"'s
# cached prompt handed in with another salt, LoRA id or tokens, or forged ids)
# are refused after the device manager's dry lookup (a lookup capped at the
# hit, to tell), which uses a free row and the admission's scratch buffers:
# what a refusal must leave as it was is the rest, the row allocator included
# (it once kept the row the lookup took).
STALE_CASES = [
    ("allocate-computed-of-another-salt",
     lambda m: m.allocate_slots(NewRequest("n", [20, 21, 22, 23, 24], cache_salt="s"), computed=C_HIT),
     StaleComputedBlocksError, "computed"),
    ("allocate-computed-of-another-lora",
     lambda m: m.allocate_slots(NewRequest("n", [20, 21, 22, 23, 24], lora_id=3), computed=C_HIT),
     StaleComputedBlocksError, "computed"),
    ("allocate-computed-of-other-tokens",
     lambda m: m.allocate_slots(NewRequest("n", [20, 21, 99, 23, 24]), computed=C_HIT),
     StaleComputedBlocksError, "computed"),
    ("allocate-computed-forged-ids",
     lambda m: m.allocate_slots(NewRequest("n", [20, 21, 22, 23, 24]), computed=ComputedBlocks([[9, 11], [12, 13]], 4)),
     StaleComputedBlocksError, "computed"),
]


def logical_state_of(m) -> tuple:
    """A manager's state without what a call may use as scratch: the step
    buffers and plans of each bucket, the staging buffers, the step counters,
    the pool's per-step stamps (``last_seen``, ``touched``, ``stamp``: scratch
    by design, ``gpukv/device/pool.py``), the host mirror of the free count (a cache
    of the device's: a refused step marks it stale, and the next read reads
    the device), and the contents of rows no request holds."""
    # (the device manager's parts that hold only per-bucket buffers and plans,
    # and the manager they belong to: ``gpukv.device``)
    scratch = {"_admission", "_decode", "_releases", "_reads", "_gather", "_launches", "_staging", "counters",
               "_mirror"}
    fields = {k: v for k, v in vars(m).items() if k not in scratch and k not in ("pool", "_rows", "_shared")}
    out = [state_of(fields)]
    if isinstance(m, DeviceManager):  # (the parts' typed state holds the same scratch, and the pool and rows)
        shared = {k: v for k, v in vars(m._shared).items()
                  if k not in ("counters", "mirror", "staging", "pool", "rows")}
        out.append(state_of(shared))
    else:
        out.append(state_of(m._shared))
    if isinstance(m, DeviceManager):
        pool = {k: v for k, v in vars(m.pool).items() if k not in ("stamp", "touched", "last_seen")}
        held = sorted(m._reqs.values())
        rows = m._rows
        out += [state_of(pool), rows.state(), [state_of(t[held]) for t in (rows.tokens, rows.digests, rows.extras,
                                                                           rows.lora)],
                state_of(rows.block_table[:, held]),
                [a[held].tolist() for a in (rows.num_tokens, rows.num_computed, rows.num_held, rows.null_until)]]
    else:
        out += [state_of(m.pool), state_of(m._rows)]
    return tuple(out)


def test_the_catalogue_is_large_enough():
    assert len(CASES) >= 200
    assert len({c[0] for c in CASES}) == len(CASES)


def test_the_snapshot_reaches_every_device_tensor(scenario):
    # ref_cnt, free queue (ring, pos, counters), hash table (7), blk_* (3),
    # last_seen, touched, evictions, rows (4), windows, stats, key: >= 20.
    assert tensors_of(scenario.dev) >= 20


# Every case of both tables, each with the state a refusal must leave as it
# was: the whole state for CASES, the logical state for STALE_CASES.
REFUSALS = ([pytest.param(state_of, *c, id=c[0]) for c in CASES]
            + [pytest.param(logical_state_of, *c, id=c[0]) for c in STALE_CASES])


@pytest.mark.parametrize("snapshot, _name, call, exc, argument", REFUSALS)
def test_bad_input_is_refused_by_both_with_nothing_changed(scenario, snapshot, _name, call, exc, argument):
    errors = []
    for m in scenario.managers():
        before = snapshot(m)
        with pytest.raises(GpukvInputError) as info:
            call(m)
        err = info.value
        assert type(err) is exc, f"{type(m).__module__}: {type(err).__name__}: {err}"
        assert isinstance(err, GpukvError)
        assert err.argument == argument, str(err)
        assert str(err).startswith(argument + ":"), str(err)
        assert err.fix and str(err).endswith(err.fix), str(err)
        after = snapshot(m)
        assert after == before, f"{type(m).__module__} changed state on a refused call"
        errors.append((type(err), str(err)))
    assert errors[0] == errors[1], "the managers refuse differently"
    scenario.good_step()
    for m in scenario.managers():
        m.check_invariants()


def test_a_refusal_keeps_what_went_wrong_as_its_cause(scenario):
    for m in scenario.managers():
        with pytest.raises(InvalidInputError) as info:
            m.step(new=[NewRequest("n", raising(1, 2))])
        assert isinstance(info.value.__cause__, CallerBug)
        with pytest.raises(InvalidTypeError) as call:
            m.step(bogus=1)
        assert type(call.value.__cause__) is TypeError and "'bogus'" in str(call.value.__cause__)
        assert isinstance(call.value, TypeError)  # except TypeError still catches it
        assert not m.failed
    scenario.good_step()


def test_signature_mistakes_read_in_gpukvs_own_words(scenario):
    # Typed, and in gpukv's words rather than Python's ("takes 1 positional
    # argument but 2 were given"): the argument, what is wrong, and the
    # signature of gpukv.core.protocol.BlockManager (the device's extra graphs= left
    # out, so both say the same).
    expected = {
        lambda m: m.free_blocks_lower_bound(1):
            "free_blocks_lower_bound: free_blocks_lower_bound() takes no positional argument, got 1; call "
            "free_blocks_lower_bound() (see its docstring)",
        lambda m: m.step(bogus=1):
            "bogus: step() has no argument 'bogus'; call step(finished=(), running=(), new=(), *, token_budget=None, "
            "block_ids=False, prefix_of=None) (see its docstring)",
        lambda m: m.step((), finished=()):
            "finished: step() got 'finished' twice, by position and by keyword; call step(finished=(), running=(), "
            "new=(), *, token_budget=None, block_ids=False, prefix_of=None) (see its docstring)",
        lambda m: m.decode([0]):
            "new_token_ids: decode() needs 'new_token_ids', which was not given; call decode(rows, new_token_ids, *, "
            "num_new_tokens=None, num_tokens_to_compute=None, num_lookahead_tokens=0) (see its docstring)",
        lambda m: m.row_of("a", "b"):
            "row_of: row_of() takes 1 positional argument, got 2; call row_of(request_id) (see its docstring)",
    }
    for call, message in expected.items():
        for m in scenario.managers():
            with pytest.raises(InvalidTypeError) as info:
                call(m)
            assert str(info.value) == message
            assert type(info.value.__cause__) is TypeError and not m.failed


def test_counts_and_id_lists_are_answered_alike(scenario):
    # Once: "2" was answered by the reference and crashed the device manager
    # (AttributeError); 10**30 overflowed on the device, then both answered it
    # (a count is at most MAX_COUNT on both, CASES refuses more).
    for count in (0, 1, 2, np.int64(2), MAX_COUNT):
        answers = [m.get_num_common_prefix_blocks("a", count) for m in scenario.managers()]
        assert answers[0] == answers[1], count
    assert [m.get_num_common_prefix_blocks("a", 2) for m in scenario.managers()][0][0] == 2  # a and b share 2
    for make in (lambda: ["a", "b"], lambda: ("b",), lambda: iter(["a"]), lambda: []):
        tables = [m.block_table_for(make()).cpu() for m in scenario.managers()]
        assert tables[0].shape == tables[1].shape
        for i, rid in enumerate(list(make())):  # (past a request's blocks a table holds no block of it)
            for g, blocks in enumerate(scenario.ref.get_block_ids(rid)):
                assert tables[0][g, i, : len(blocks)].tolist() == tables[1][g, i, : len(blocks)].tolist() == blocks


# ------------------------------------------- what both accept, and alike

ACCEPTED = [
    ("generators-everywhere", lambda rid: dict(
        finished=gen(), running=gen(RunningUpdate("a", iter([]))),
        new=gen(NewRequest(rid, iter([50, 51, 52]), mm_items=gen(MMItem(0, 1, "img")))))),
    ("tuple-range-and-numpy-ints", lambda rid: dict(
        new=(NewRequest(rid, range(60, 63), lora_id=np.int64(3)),))),
    ("array-and-tensor-tokens", lambda rid: dict(
        new=[NewRequest(rid, np.array([70, 71, 72], dtype=np.uint32)),
             NewRequest(rid + "t", torch.tensor([70, 71, 72, 73], dtype=torch.int32))])),
    ("numpy-bool-skip", lambda rid: dict(new=[NewRequest(rid, [80, 81, 82], skip_prefix_cache=np.bool_(True))])),
]


@pytest.mark.parametrize("name, make", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_unusual_but_valid_inputs_are_accepted_alike(scenario, name, make):
    # Each call gets fresh iterators: a generator can be consumed once.
    results = [m.step(**make(f"acc-{name}")) for m in scenario.managers()]
    assert results[0] == results[1] and results[0].num_admitted >= 1
    for m in scenario.managers():
        m.check_invariants()
    ids = [r.request_id for r in make(f"acc-{name}").get("new", ())][: results[0].num_admitted]
    for rid in ids:
        assert scenario.dev.get_block_ids(rid) == scenario.ref.get_block_ids(rid)
    for m in scenario.managers():
        m.step(finished=ids)
    assert scenario.dev.free_queue() == scenario.ref.free_queue()


def test_a_running_update_and_a_new_request_with_iterator_tokens_keep_counts_right():
    # Once, the device manager's checks consumed the iterators and its ref
    # counts went out of step with its block tables.
    for m in (ReferenceManager(16, 2, hash_key=KEY, max_model_len=32),
              DeviceManager(16, 2, hash_key=KEY, max_model_len=32, max_num_reqs=2)):
        m.step(new=[NewRequest("a", [1, 2, 3])])
        res = m.step(running=[RunningUpdate("a", iter([4, 5]))], new=[NewRequest("b", iter([1, 2, 3, 4, 6]))])
        assert res.ok and res.num_computed_tokens == [4]
        assert m.get_block_ids("a") == [[1, 2, 3]] and m.get_block_ids("b") == [[1, 2, 4]]
        m.check_invariants()


def test_refusals_do_not_leak_device_rows():
    dev = DeviceManager(8, 2, hash_key=KEY, max_model_len=16, max_num_reqs=4)
    generation = dev.rows_generation
    for k in range(40):
        with pytest.raises(InvalidInputError):
            dev.step(new=[NewRequest(f"n{k}", [1, 2], lora_id=2**64)])
    # rows are handed out from 0 and grow past max_num_reqs only when needed:
    # a leaked row would shift these or reallocate the row tensors
    res = dev.step(new=[NewRequest(f"a{i}", [1, 2]) for i in range(4)])
    assert res.rows == [0, 1, 2, 3] and dev.rows_generation == generation


# ------------------------------------------------------------ constructors

def build(kind, **kw):
    args = dict(num_blocks=8, block_size=2, hash_key=KEY, max_model_len=16)
    args.update(kw)
    if kind == "ref":
        args.pop("device", None)
        return ReferenceManager(args.pop("num_blocks"), args.pop("block_size"), **args)
    return DeviceManager(args.pop("num_blocks"), args.pop("block_size"), **args)


CONSTRUCTOR_CASES = [
    ("num-blocks-1", dict(num_blocks=1), InvalidInputError, "num_blocks"),
    ("num-blocks-float", dict(num_blocks=2.5), InvalidTypeError, "num_blocks"),
    ("num-blocks-bool", dict(num_blocks=True), InvalidTypeError, "num_blocks"),
    ("num-blocks-past-the-table", dict(num_blocks=2**40), CapacityError, "num_blocks"),
    ("block-size-0", dict(block_size=0), InvalidInputError, "block_size"),
    ("block-size-str", dict(block_size="16"), InvalidTypeError, "block_size"),
    ("windows-str", dict(sliding_windows="4"), InvalidTypeError, "sliding_windows"),
    ("windows-empty", dict(sliding_windows=[]), InvalidInputError, "sliding_windows"),
    ("windows-zero", dict(sliding_windows=[None, 0]), InvalidInputError, "sliding_windows[1]"),
    ("windows-bool", dict(sliding_windows=[True]), InvalidTypeError, "sliding_windows[0]"),
    ("max-model-len-0", dict(max_model_len=0), InvalidInputError, "max_model_len"),
    # both refuse these (the reference once accepted what the device manager refused)
    ("max-model-len-2**40", dict(max_model_len=2**40), CapacityError, "max_model_len"),
    ("max-num-reqs-2**31", dict(max_num_reqs=2**31), CapacityError, "max_num_reqs"),
    ("hash-key-short", dict(hash_key=b"short"), InvalidInputError, "hash_key"),
    ("hash-key-int", dict(hash_key=5), InvalidTypeError, "hash_key"),
    ("max-num-batched-tokens-0", dict(max_num_batched_tokens=0), InvalidInputError, "max_num_batched_tokens"),
    ("max-num-batched-tokens-bool", dict(max_num_batched_tokens=True), InvalidTypeError, "max_num_batched_tokens"),
    ("max-num-batched-tokens-float", dict(max_num_batched_tokens=8192.0), InvalidTypeError,
     "max_num_batched_tokens"),
    ("max-num-batched-tokens-2**31", dict(max_num_batched_tokens=2**31), CapacityError, "max_num_batched_tokens"),
]


@pytest.mark.parametrize("_name, kw, exc, argument", CONSTRUCTOR_CASES, ids=[c[0] for c in CONSTRUCTOR_CASES])
@pytest.mark.parametrize("kind", ["ref", "dev"])
def test_bad_constructor_arguments(kind, _name, kw, exc, argument):
    with pytest.raises(GpukvInputError) as info:
        build(kind, **kw)
    assert type(info.value) is exc and info.value.argument == argument, str(info.value)
    assert info.value.fix and str(info.value).startswith(argument)


@pytest.mark.parametrize("kw, exc", [
    (dict(device="nonsense"), InvalidInputError),
    (dict(device="meta"), InvalidInputError),
    (dict(device="cuda:99"), InvalidInputError),
    (dict(max_num_reqs=0), InvalidInputError),
    (dict(max_num_reqs=2.0), InvalidTypeError),
])
def test_bad_device_manager_arguments(kw, exc):
    with pytest.raises(exc) as info:
        build("dev", **kw)
    assert info.value.argument == next(iter(kw)), str(info.value)


def test_sizes_too_large_to_allocate_are_refused_before_allocating(monkeypatch):
    import gpukv.device.manager
    import gpukv.reference.pool

    def no_allocation(*_args, **_kwargs):
        raise AssertionError("allocated before refusing")

    monkeypatch.setattr(gpukv.device.manager, "DevicePool", no_allocation)
    # Rows for 2**20 requests of 2**31 - 1 tokens: petabytes.
    with pytest.raises(CapacityError, match="GiB") as info:
        DeviceManager(8, 16, max_model_len=2**31 - 1, max_num_reqs=2**20, hash_key=KEY)
    assert info.value.argument == "max_model_len" and "max_num_reqs" in info.value.fix
    with pytest.raises(CapacityError):
        DeviceManager(2**29, 4096, hash_key=KEY)  # 2**29 blocks of 4096 tokens: 8 TiB of token records
    # The reference: 2**29 blocks of host records (hundreds of GiB), refused
    # before the pool's lists are built.
    monkeypatch.setattr(gpukv.reference.pool, "OrderedDict", no_allocation)
    with pytest.raises(CapacityError, match="GiB") as info:
        ReferenceManager(2**29, 16, hash_key=KEY)
    assert info.value.argument == "num_blocks"


def test_numpy_integers_are_accepted_as_sizes_by_both():
    kw = dict(sliding_windows=[None, np.int64(4)], hash_key=KEY, max_model_len=np.int32(16))
    ref = ReferenceManager(np.int64(12), np.int32(2), **kw)
    dev = DeviceManager(np.int64(12), np.int32(2), max_num_reqs=np.int16(2), **kw)
    for m in (ref, dev):
        assert type(m.num_blocks) is int and type(m.block_size) is int
        assert m.step(new=[NewRequest("a", [1, 2, 3])]).num_admitted == 1
    assert dev.get_block_ids("a") == ref.get_block_ids("a")


def test_errors_pickle_and_read_as_their_builtins():
    import pickle

    err = UnknownRequestError("unknown request id 'x'", argument="finished[0]", fix="pass a live id")
    assert str(err) == "finished[0]: unknown request id 'x'; pass a live id"  # no KeyError quoting
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is UnknownRequestError and back.argument == "finished[0]" and str(back) == str(err)
    assert isinstance(err, KeyError) and isinstance(InvalidTypeError(), TypeError)
    assert isinstance(CapacityError(), ValueError) and isinstance(DuplicateRequestError(), ValueError)
    assert dataclasses.is_dataclass(ComputedBlocks)


# ------------------------- "can never be admitted" is judged on the best case

@pytest.mark.parametrize("kind", ["ref", "dev"])
def test_a_window_request_that_fits_with_its_hit_is_not_refused(kind):
    # Window 3, block size 1: a hit needs the last ceil(2/1) = 2 blocks. Pool
    # of 7 = 6 usable blocks.
    m = (ReferenceManager(7, 1, sliding_windows=[3], hash_key=KEY) if kind == "ref"
         else DeviceManager(7, 1, sliding_windows=[3], hash_key=KEY, max_model_len=16, max_num_reqs=2))
    assert m.step(new=[NewRequest("a", [1, 2, 3, 4, 5, 6])]).num_computed_tokens == [0]
    assert m.get_block_ids("a") == [[1, 2, 3, 4, 5, 6]]  # all full, all cached
    m.step(finished=["a"])
    assert m.free_queue() == [6, 5, 4, 3, 2, 1]  # cached: to the back, tail first
    # b needs 7 blocks by the old bound (7 > 6: refused up front). Its best
    # case is a hit of 6 blocks: the window's run of 2 (blocks 5, 6) plus one
    # new block = 3 blocks. Admitted: positions 0..3 null, 4..5 hit, 6 popped.
    res = m.step(new=[NewRequest("b", [1, 2, 3, 4, 5, 6, 7])])
    assert res.num_admitted == 1 and res.num_computed_tokens == [6]
    assert m.get_block_ids("b") == [[0, 0, 0, 0, 5, 6, 4]]
    assert m.free_queue() == [3, 2, 1]
    m.check_invariants()
    # The same length with nothing to hit fits the bound (it could hit) but
    # not the pool: it is not admitted, and nothing is raised.
    assert m.step(new=[NewRequest("c", [9, 9, 9, 9, 9, 9, 9])]).num_admitted == 0
    m.step(finished=["b"])
    assert m.step(new=[NewRequest("c", [9, 9, 9, 9, 9, 9, 9])]).num_admitted == 0  # not even in an empty pool
    # Without a possible hit the best case is the worst: refused up front.
    with pytest.raises(CapacityError, match="needs 7 blocks even with the best possible cache hit") as info:
        m.step(new=[NewRequest("d", [1, 2, 3, 4, 5, 6, 7], skip_prefix_cache=True)])
    assert info.value.argument == "new[0].token_ids" and "can never be admitted" in str(info.value)
    m.check_invariants()


def test_min_blocks_to_admit():
    from gpukv.core.blocks import ManagerLimits, min_blocks_to_admit

    full = ManagerLimits(1, 7, (None,))
    window = ManagerLimits(1, 7, (3,))
    hybrid = ManagerLimits(2, 64, (None, 4))
    assert min_blocks_to_admit(7, full, True) == 7
    assert min_blocks_to_admit(7, window, True) == 3  # run of 2 + 1 new
    assert min_blocks_to_admit(7, window, False) == 7
    assert min_blocks_to_admit(1, window, True) == 1  # no full block before the last token: no hit
    # 9 tokens, block size 2: 5 blocks, a hit of at most 4; window 4 needs 2.
    assert min_blocks_to_admit(9, hybrid, True) == 5 + (2 + 1)
