"""gpukv's managers against vLLM 0.8.5's own ``KVCacheManager`` under chunked
prefill and lookahead slots: the same cache hits and the same block ids, call
by call.

vLLM comes from the driver ``vllm_kv.py`` in ``../shared/tools/vllm085/``
(or the folder named by ``GPUKV_VLLM085``); build its venv with ``setup.sh DIR``
there and run these tests with that venv's python::

    PYTHONPATH=.:DIR DIR/venv/bin/python -m pytest -q tests/test_vllm/test_vllm_chunked.py

Without vLLM the module is skipped.

How the two map (checked by every test below, not assumed):

* Block ids are compared directly, with the same ``num_blocks`` on both sides.
  vLLM 0.8.5's ``BlockPool`` pops block 0 off its free queue at construction
  as its null block, so its queue starts as ``1..N-1``, exactly as gpukv's
  (block 0 is gpukv's null block, never handed out).
* vLLM's ``free_blocks`` sends every block whose count drops to 0 to the back
  of the queue, in the order given (a request's blocks tail first). gpukv with
  ``uncached_first=False`` does the same; its default ``uncached_first=True``
  sends uncached blocks to the front instead, so ids part from vLLM's after the
  first free of an uncached block (the hand-worked case shows where).
* Calls: vLLM's ``allocate_slots(req, k, blocks, la)`` for a new request is
  gpukv's ``allocate_slots(NewRequest(...), computed=..., num_tokens=k,
  num_lookahead_tokens=la)``. For a running request vLLM's caller appends the
  sampled tokens to the ``Request`` and advances ``req.num_computed_tokens`` by
  what the previous call computed (hit + k after admission, + k after a running
  call), as the scheduler does; gpukv takes the sampled tokens as
  ``new_token_ids`` and counts its computed tokens itself.
* A refused running call (None): vLLM's scheduler preempts the request (frees
  it, computed tokens back to 0, the tokens it was given kept) and later
  admits it again under the same id; so do these tests. gpukv's refused call
  appended nothing, so its resumed ``NewRequest`` carries vLLM's token list.
* vLLM hashes with Python's ``hash``, gpukv with keyed BLAKE3: only hits (in
  tokens and block ids) and block ids are compared, never digests.
"""

from __future__ import annotations

import os
import pathlib
import random
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from gpukv.core.requests import NewRequest
from gpukv.device.manager import DeviceManager
from gpukv.reference.manager import ReferenceManager

ROOT = pathlib.Path(__file__).resolve().parents[2]
SKIP_REASON = "vLLM 0.8.5 not importable (see ../shared/tools/vllm085/setup.sh)"


def _import_vllm_kv() -> Any:
    """The vLLM driver module, or skip this whole module saying why."""
    chosen = os.environ.get("GPUKV_VLLM085")
    if chosen and chosen not in sys.path:
        sys.path.insert(0, chosen)  # named by the caller: it wins
    shared = str(ROOT.parent / "shared" / "tools" / "vllm085")
    if os.path.isdir(shared) and shared not in sys.path:
        sys.path.append(shared)
    try:
        import vllm_kv  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 (any import failure means: no vLLM here)
        pytest.skip(f"{SKIP_REASON}: {type(exc).__name__}: {exc}", allow_module_level=True)
    return vllm_kv


vllm_kv = _import_vllm_kv()

KEY = bytes(range(16))
MAX_MODEL_LEN = 128  # far above every request here: vLLM silently caps blocks at cdiv(max_model_len, block_size)
Manager = ReferenceManager | DeviceManager


# ------------------------------------------------------------------ drivers

class Vllm:
    """vLLM's manager, driven as its scheduler drives it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.m = vllm_kv.make_manager(num_blocks=num_blocks, block_size=block_size, max_model_len=MAX_MODEL_LEN)
        self.reqs: dict[str, Any] = {}

    def lookup(self, rid: str, tokens: list[int]) -> tuple[list[int], int]:
        """Hit block ids and hit tokens of a new (or resumed) request."""
        req = self.reqs.get(rid)
        if req is None:
            req = self.reqs[rid] = vllm_kv.make_request(rid, tokens)
        assert list(req.all_token_ids) == tokens
        self._hit, n_hit = self.m.get_computed_blocks(req)
        return [b.block_id for b in self._hit], n_hit

    def admit(self, rid: str, k: int, la: int) -> list[int] | None:
        """Admit the request just looked up, computing k tokens beyond its hit."""
        req = self.reqs[rid]
        got = self.m.allocate_slots(req, k, self._hit, la)
        if got is None:
            return None
        req.num_computed_tokens = len(self._hit) * self.m.block_size + k
        return [b.block_id for b in got]

    def run(self, rid: str, new_tokens: list[int], k: int, la: int) -> list[int] | None:
        req = self.reqs[rid]
        if new_tokens:
            req.append_output_token_ids(new_tokens)
        got = self.m.allocate_slots(req, k, num_lookahead_tokens=la)
        if got is None:
            return None
        req.num_computed_tokens += k
        return [b.block_id for b in got]

    def preempt(self, rid: str) -> None:
        req = self.reqs[rid]
        self.m.free(req)
        req.num_computed_tokens = 0

    def finish(self, rid: str) -> None:
        req = self.reqs.pop(rid)
        self.m.free(req)
        self.m.free_block_hashes(req)

    def block_ids(self, rid: str) -> list[int]:
        return [b.block_id for b in self.m.req_to_blocks[rid]]

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.m.block_pool.free_block_queue.get_all_free_blocks()]


class Gpukv:
    """A gpukv manager (one full-attention group) behind the same calls."""

    def __init__(self, m: Manager) -> None:
        self.m = m

    def lookup(self, rid: str, tokens: list[int]) -> tuple[list[int], int]:
        self._req = NewRequest(rid, list(tokens))
        self._computed = self.m.get_computed_blocks(self._req)
        return self._computed.block_ids[0], self._computed.num_tokens

    def admit(self, rid: str, k: int, la: int) -> list[int] | None:  # noqa: ARG002  (Vllm.admit's signature; lookup named it)
        got = self.m.allocate_slots(self._req, computed=self._computed, num_tokens=k, num_lookahead_tokens=la)
        return None if got is None else got[0]

    def run(self, rid: str, new_tokens: list[int], k: int, la: int) -> list[int] | None:
        got = self.m.allocate_slots(rid, new_tokens, num_tokens=k, num_lookahead_tokens=la)
        return None if got is None else got[0]

    def preempt(self, rid: str) -> None:
        self.m.free(rid)

    def finish(self, rid: str) -> None:
        self.m.free(rid)

    def block_ids(self, rid: str) -> list[int]:
        (ids,) = self.m.get_block_ids(rid)
        return ids

    def free_queue(self) -> list[int]:
        return self.m.free_queue()


def gpukv_managers(num_blocks: int, block_size: int, device: bool, uncached_first: bool = False) -> list[Gpukv]:
    """The reference, and with ``device`` the device manager on its default
    device (CUDA if present, else the CPU under Triton's interpreter)."""
    kw = dict(hash_key=KEY, max_model_len=MAX_MODEL_LEN, uncached_first=uncached_first)
    ms: list[Manager] = [ReferenceManager(num_blocks, block_size, **kw)]
    if device:
        ms.append(DeviceManager(num_blocks, block_size, max_num_reqs=8, **kw))
    return [Gpukv(m) for m in ms]


# --------------------------------------------------------- hand-worked case

@dataclass(frozen=True)
class Order:
    """An expected value that depends on the free-queue order."""

    vllm: Any  # vLLM's order, = gpukv's uncached_first=False
    uncached_first: Any  # gpukv's default


A = list(range(100, 110))  # the 10-token prompt
SCRIPT: list[tuple] = [
    # ("admit", rid, tokens, k, la, hit ids, hit tokens, new ids)
    # ("run", rid, new tokens, k, la, new ids) / ("free", rid); then the free queue.
    # Block size 4, 10 blocks: the free queue starts 1..9. "a" in chunks 4, 4, 2;
    # each full computed block is cached as its chunk lands (blocks 1, 2).
    ("admit", "a", A, 4, 0, [], 0, [1]), [2, 3, 4, 5, 6, 7, 8, 9],
    ("run", "a", [], 4, 0, [2]), [3, 4, 5, 6, 7, 8, 9],
    ("run", "a", [], 2, 0, [3]), [4, 5, 6, 7, 8, 9],
    # "b" shares a's first 8 tokens: hits blocks 1, 2; its 3 other tokens need one block.
    ("admit", "b", A[:8] + [200, 201, 202], 3, 0, [1, 2], 8, [4]), [5, 6, 7, 8, 9],
    # a decodes with lookahead 2: 11 computed + 2 slots = 13 -> 4 blocks (block 5).
    ("run", "a", [300], 1, 2, [5]), [6, 7, 8, 9],
    ("run", "a", [301], 1, 2, []), [6, 7, 8, 9],  # 12 + 2 -> 4 blocks; block 3 full: cached
    ("run", "a", [302], 1, 2, []), [6, 7, 8, 9],  # 13 + 2
    ("run", "a", [303], 1, 2, []), [6, 7, 8, 9],  # 14 + 2
    ("run", "a", [304], 1, 2, [6]), [7, 8, 9],  # 15 + 2 = 17 -> 5 blocks
    ("run", "a", [305], 1, 2, []), [7, 8, 9],  # 16 computed: lookahead block 5 now full, cached
    # "c" = a's 16 tokens + 1: hits 1, 2, 3 and the former lookahead block 5.
    ("admit", "c", A + [300, 301, 302, 303, 304, 305, 400], 1, 0, [1, 2, 3, 5], 16, [7]), [8, 9],
    # Freed tail first. Uncached 4, 6, 7 go to the back in vLLM, to the front by default.
    ("free", "b"), Order([8, 9, 4], [4, 8, 9]),
    ("free", "a"), Order([8, 9, 4, 6], [6, 4, 8, 9]),
    ("free", "c"), Order([8, 9, 4, 6, 7, 5, 3, 2, 1], [7, 6, 4, 8, 9, 5, 3, 2, 1]),
    # "d" hits block 1 (out of the queue's end); 4 + 4 computed + 3 slots = 11 -> 2 new blocks.
    ("admit", "d", A[:4] + list(range(500, 508)), 4, 3, [1], 4, Order([8, 9], [7, 6])),
    Order([4, 6, 7, 5, 3, 2], [4, 8, 9, 5, 3, 2]),
    ("run", "d", [], 4, 3, [4]), Order([6, 7, 5, 3, 2], [8, 9, 5, 3, 2]),  # 12 + 3 -> 4 blocks
    ("run", "d", [600], 1, 3, []), Order([6, 7, 5, 3, 2], [8, 9, 5, 3, 2]),  # 13 + 3 -> 4 blocks
    ("run", "d", [601], 1, 3, Order([6], [8])), Order([7, 5, 3, 2], [9, 5, 3, 2]),  # 14 + 3 -> 5
    # "e" (no hit) takes two blocks; the second, 5, is evicted (a's tokens 12..15).
    ("admit", "e", list(range(800, 808)), 8, 0, [], 0, Order([7, 5], [9, 5])), [3, 2],
    # "f" = a's 16 tokens + 1 hits 1, 2, 3 only; with 2 and 3 taken off the queue nothing
    # is left for its 2 new blocks: refused, nothing changes.
    ("admit", "f", A + [300, 301, 302, 303, 304, 305, 900], 5, 0, [1, 2, 3], 12, None), [3, 2],
    ("free", "e"), Order([3, 2, 5, 7], [3, 2, 5, 9]),  # both of e's blocks cached: to the back
    ("admit", "f", A + [300, 301, 302, 303, 304, 305, 900], 5, 0, [1, 2, 3], 12, Order([5, 7], [5, 9])), [],
]

FINAL_BLOCKS = {"d": Order([1, 8, 9, 4, 6], [1, 7, 6, 4, 8]), "f": Order([1, 2, 3, 5, 7], [1, 2, 3, 5, 9])}


def _pick(value: Any, uncached_first: bool) -> Any:
    if isinstance(value, Order):
        return value.uncached_first if uncached_first else value.vllm
    return value


def _play_script(side: Vllm | Gpukv, uncached_first: bool) -> None:
    """Run SCRIPT on one side, checking every result and the free queue after every step."""
    steps = iter(SCRIPT)
    for n, (step, queue) in enumerate(zip(steps, steps, strict=True)):  # (step, queue) pairs
        where = f"step {n}: {step[:2]}"
        if step[0] == "admit":
            _, rid, tokens, k, la, hit_ids, hit_tokens, new_ids = step
            assert side.lookup(rid, tokens) == (hit_ids, hit_tokens), where
            assert side.admit(rid, k, la) == _pick(new_ids, uncached_first), where
        elif step[0] == "run":
            _, rid, new_tokens, k, la, new_ids = step
            assert side.run(rid, new_tokens, k, la) == _pick(new_ids, uncached_first), where
        else:
            side.finish(step[1])
        assert side.free_queue() == _pick(queue, uncached_first), where
    for rid, ids in FINAL_BLOCKS.items():
        assert side.block_ids(rid) == _pick(ids, uncached_first), rid


def test_hand_worked_chunks_and_lookahead_match_vllm():
    """vLLM's manager gives the hand-worked ids and hits: chunks 4, 4, 2, a
    shared 8-token prefix, decode with lookahead 2 (lookahead blocks reused and
    cached once filled), frees, an eviction and a refusal."""
    _play_script(Vllm(10, 4), uncached_first=False)


@pytest.mark.parametrize("uncached_first", [False, True])
@pytest.mark.parametrize("device", [False, True], ids=["reference", "device"])
def test_hand_worked_chunks_and_lookahead_on_gpukv(device: bool, uncached_first: bool):
    """gpukv's managers give the same hand-worked ids and hits as vLLM with
    ``uncached_first=False``, and the documented other order by default."""
    side = gpukv_managers(10, 4, device=device, uncached_first=uncached_first)[-1]  # the device's, or the reference
    _play_script(side, uncached_first)
    assert side.m.num_computed_tokens("d") == 14 and side.m.num_computed_tokens("f") == 17
    side.m.check_invariants()


# ---------------------------------------------------------- random sequences

@dataclass
class Tally:
    """What the random sequences exercised, so they cannot pass vacuously."""

    calls: int = 0
    hits: int = 0
    refused_new: int = 0
    preempted: int = 0
    lookahead_reused: int = 0
    evictions: int = 0


def _compare_sequence(seed: int, steps: int, device: bool, tally: Tally) -> None:
    """One random sequence of vLLM-style calls, vLLM and gpukv compared after
    every call: the call's result, the hit, every running request's block ids
    and computed tokens, and the free queue."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4]) if not device else 2
    num_blocks = rng.randint(8, 20) if not device else rng.randint(6, 10)
    # Every request, with 3 lookahead slots, fits the whole pool: gpukv raises
    # CapacityError for one that never can (vLLM would return None forever).
    max_tokens = min(10 * block_size if not device else 12, (num_blocks - 1) * block_size - 3)
    vllm = Vllm(num_blocks, block_size)
    sides = gpukv_managers(num_blocks, block_size, device=device)
    bases = [[rng.randrange(40) for _ in range(3 * block_size)] for _ in range(3)]
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    running: list[str] = []
    waiting: list[str] = []  # refused or preempted, to be admitted again under the same id

    def call(method: str, *args: Any) -> Any:
        want = getattr(vllm, method)(*args)
        for side in sides:
            assert getattr(side, method)(*args) == want, f"seed {seed} step {step}: {method}{args[:2]}"
        tally.calls += 1
        return want

    for step in range(steps):
        r = rng.random()
        if waiting and r < 0.15 or len(running) < 4 and r < 0.4:
            if waiting and r < 0.15:
                rid = waiting.pop(rng.randrange(len(waiting)))
            else:
                rid = f"r{step}"
                prefix = rng.choice(bases)[: rng.randint(0, 3 * block_size)]
                suffix = [rng.randrange(40) for _ in range(rng.randint(1, 2 * block_size))]
                tokens[rid] = (prefix + suffix)[:max_tokens]
            _, hit = call("lookup", rid, tokens[rid])
            tally.hits += hit > 0
            left = len(tokens[rid]) - hit
            k = left if rng.random() < 0.3 else rng.randint(1, left)
            if call("admit", rid, k, rng.choice([0, 1, 3])) is None:
                tally.refused_new += 1
                waiting.append(rid)
            else:
                computed[rid] = hit + k
                running.append(rid)
        elif running and r < 0.9:
            rid = rng.choice(running)
            new = []
            if computed[rid] == len(tokens[rid]) and len(tokens[rid]) >= max_tokens:
                call("finish", rid)
                running.remove(rid)
            else:
                if computed[rid] == len(tokens[rid]):  # prefill done: the sampled token(s), 2 with a draft accepted
                    n_new = min(rng.choice([1, 1, 1, 2]), max_tokens - len(tokens[rid]))
                    new = [rng.randrange(40) for _ in range(n_new)]
                    tokens[rid] = tokens[rid] + new
                left = len(tokens[rid]) - computed[rid]
                k = left if new or rng.random() < 0.3 else rng.randint(1, left)
                got = call("run", rid, new, k, rng.choice([0, 1, 3]))
                if got is None:  # the scheduler preempts it
                    call("preempt", rid)
                    tally.preempted += 1
                    running.remove(rid)
                    waiting.append(rid)
                else:
                    # No block came, yet the computed tokens entered a new one: a lookahead block.
                    entered = -(-(computed[rid] + k) // block_size) > -(-computed[rid] // block_size)
                    tally.lookahead_reused += entered and not got
                    computed[rid] += k
        elif running:
            rid = running.pop(rng.randrange(len(running)))
            call("finish", rid)
        where = f"seed {seed} step {step}"
        queue = vllm.free_queue()
        for side in sides:
            assert side.free_queue() == queue, where
            for rid in running:
                assert side.block_ids(rid) == vllm.block_ids(rid), f"{where}: {rid}"
                assert side.m.num_computed_tokens(rid) == computed[rid], f"{where}: {rid}"
    for side in sides:
        side.m.check_invariants()
    tally.evictions += sides[0].m.read_num_evictions()


def test_random_chunked_sequences_match_vllm_on_the_reference():
    """Many random sequences (chunk sizes, lookahead 0/1/3, shared prefixes,
    finishes, refusals, preemptions, evictions): the reference agrees with
    vLLM after every call, and each of those things happened."""
    tally = Tally()
    for seed in range(300):
        _compare_sequence(seed, 80, device=False, tally=tally)
    assert tally.hits > 1000 and tally.refused_new > 100 and tally.preempted > 100, tally
    assert tally.lookahead_reused > 100 and tally.evictions > 1000, tally


def test_random_chunked_sequences_match_vllm_on_the_device():
    """A few short random sequences: the device manager (on its default
    device; without CUDA, the CPU under Triton's interpreter) and the reference
    agree with vLLM after every call."""
    tally = Tally()
    for seed in range(1000, 1005):
        _compare_sequence(seed, 30, device=True, tally=tally)
    assert tally.hits > 0 and tally.refused_new > 0 and tally.preempted > 0, tally
    assert tally.lookahead_reused > 0 and tally.evictions > 0, tally
