"""A stateful fuzzer: a serving loop driving the block managers, step by step.

A hypothesis ``RuleBasedStateMachine`` plays a serving engine against the
reference manager (the model) and, with the device backend, the device
manager (the system under test) in lockstep. Rules: admit batches of new
requests (shared prefixes, LoRA ids, salts, multimodal items,
``skip_prefix_cache``), decode, finish, preempt and resume, a whole
scheduling step at once (under a token budget or none: vLLM's waiting
loop), reset the prefix cache, evict under pressure (tiny pools), look a
request up, and an adversarial caller handing in forged,
copied, random or honest ``block_hashes``. Refused steps are handled as a
serving loop does: a running update that does not fit preempts the most
recently admitted request (its tokens, including the ones its update brought,
come back later as a new request) and the remaining updates are retried; new
requests past ``num_admitted`` keep waiting, in order.

The newer entries have rules of their own:

* ``decode_batched``: ``decode(rows, new_token_ids, num_tokens_to_compute=,
  num_lookahead_tokens=)`` for 1-4 running requests' rows (``row_of``, in any
  order; as a list, a numpy array or a CPU tensor), each appending the same
  0-2 tokens (``[B, k]`` lists, ``[B]`` for one token, numpy, int64 or int32
  CPU tensors: the device's tensor path under the interpreter; None or
  ``[B, 0]`` to only continue chunked prefills), sometimes one chunk per
  row and a lookahead. Its result must be the reference's and the model
  moves as for ``step(running=[RunningUpdate(...)])`` in row order; a
  ``running_failed_at`` (which indexes ``rows``) preempts the most recent
  request and the rest is retried through ``decode``, as ``serve`` does.
* ``allocate_new``: vLLM's pair for a waiting request (or a fresh one):
  ``c = get_computed_blocks(r)`` (the same on both; its hit blocks checked
  against the ground truth, the stats counted), then ``allocate_slots(r,
  computed=c or None, num_tokens=k or None, num_lookahead_tokens=...)``,
  ``k`` counting tokens past the hit (vLLM's count; None: the request's own
  chunk, else all). The same new block ids on both, which must be the
  request's blocks past its hit; the hit is checked as a step's is, the
  computed positions recorded. Refused (None): nothing changed (free queue,
  counts, table, evictions, every request's blocks) and the request waits.
* ``allocate_running``: ``allocate_slots(request_id, new_token_ids,
  num_tokens=, num_lookahead_tokens=)`` for a running request, the model's
  one-update step; refused, the window groups released what they would
  have (as a step's refused update), the most recent request is preempted
  and it is retried.
* KV-cache events: three examples in four build both managers with
  ``enable_kv_cache_events=True``. After every call ``take_events()`` on
  both says the same, block by block (the device cuts batches at its
  reads); a ``gpukv.events.router.RouterIndex`` kept from each manager's events
  (no gap, nothing dropped, no removal of a block never stored) holds the
  reference's table, block counts per ``(digest, group)``; each stored block
  still cached carries its ground truth's tokens and LoRA id (and, with
  honest digests, the digest before it); a successful ``reset`` yields
  exactly ``AllBlocksCleared``, a refused one nothing.

After every manager call:

* both managers returned the same ``StepResult`` and agree on block tables,
  reference counts, free-queue order, table contents, stats, evictions,
  computed tokens and digests; ``check_invariants()`` holds on both;
* ground truth, kept by the machine and not by any manager: for every block id,
  the group and the exact inputs it was last computed from (the token prefix up
  to the block's end, LoRA id, cache salt and the multimodal items in that
  prefix). A hit must be a block computed from exactly the request's own
  prefix, every block a live request holds must hold what that request's
  prefix says, every cached block must be full and (unless
  ``GPUKV_FUZZ_CHECK_DIGESTS=0``) cached under the honest digest of what it
  was computed from;
* the window groups hold the null block exactly where the design says, and
  the stats count what the step looked up.

Environment (see ``docs/fuzzing.md``):

* ``GPUKV_FUZZ_BACKEND`` = ``reference`` | ``device``: a long run of that
  backend only (the reference alone against its invariants and the ground
  truth, or the device against the reference). Unset: the CI run, both, a
  few examples each.
* ``GPUKV_FUZZ_STEPS``: total rule steps of a long run (split between the
  full-attention and the sliding-window layouts).
* ``GPUKV_FUZZ_CHECK_DIGESTS=0``: do not require cached blocks to sit under
  honest digests (to see what a forged digest does beyond that).
* ``GPUKV_FUZZ_ADVERSARIAL=0``: no adversarial rule.
* ``GPUKV_FUZZ_REPORT=path``: write the run's counters there as JSON.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.control import current_build_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from gpukv.core import hashing
from gpukv.core.hashing import MMItem
from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.events.router import RouterIndex
from gpukv.reference.manager import ReferenceManager
from workload import event_atoms

KEY = bytes(range(16))
ROOT = hashing.root_digest(KEY)
MAX_TOKENS = 40  # per request (and the device's max_model_len)

BACKEND = os.environ.get("GPUKV_FUZZ_BACKEND") or None
if BACKEND not in (None, "reference", "device"):
    raise ValueError(f"GPUKV_FUZZ_BACKEND must be 'reference' or 'device', got {BACKEND!r}")
FUZZ_STEPS = int(os.environ.get("GPUKV_FUZZ_STEPS", "0") or 0)
CHECK_DIGESTS = os.environ.get("GPUKV_FUZZ_CHECK_DIGESTS", "1") != "0"
ADVERSARIAL = os.environ.get("GPUKV_FUZZ_ADVERSARIAL", "1") != "0"

LAYOUTS = {
    "full": [[None], [None, None]],
    "window": [[None, 3], [3], [None, 5], [2, None]],
}

# Two settings profiles: CI (derandomised; on a 2-core CPU machine with the
# device kernels interpreted, about 20 s per layout for the reference and
# 2.5 minutes per layout for the device, whose step costs about a second)
# and long fuzz runs (docs/fuzzing.md).
settings.register_profile(
    "gpukv-fuzz-ci", deadline=None, suppress_health_check=list(HealthCheck), database=None,
    derandomize=True, print_blob=True, report_multiple_bugs=False,
)
settings.register_profile(
    "gpukv-fuzz-long", deadline=None, suppress_health_check=list(HealthCheck), database=None,
    print_blob=True, report_multiple_bugs=False,
)
# (examples, steps per example) of the CI run, per layout.
CI_SIZES = {"reference": (300, 30), "device": (10, 15)}
LONG_STEPS_PER_EXAMPLE = {"reference": 30, "device": 20}

COUNTS: Counter = Counter()

# Caller digests are deprecated (and ignored); the fuzzer hands them in on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:NewRequest.block_hashes is deprecated:DeprecationWarning")

TOKEN = st.sampled_from([0, 1, 2, 3] * 3 + [4, 5, 2**32 - 1])


# ---------------------------------------------------------------- the model
@dataclass
class Req:
    """What the serving loop knows of a request (the managers are not asked)."""

    rid: str
    tokens: list[int]
    lora: int | None
    salt: str | None
    mm: tuple[MMItem, ...]
    skip: bool
    null_upto: list[int] = field(default_factory=list)  # per group: positions below hold the null block
    computed: int = 0  # tokens computed (chunked prefill leaves known ones uncomputed)
    held: int = 0  # block positions held per group (lookahead slots may hold more)
    _idents: list = field(default_factory=list, repr=False)

    def ident(self, p: int, bs: int) -> tuple:
        """What block ``p`` of this request is computed from: the computed
        token prefix up to the block's end, the LoRA id, the salt and the
        multimodal items starting in that prefix. Cached per position until
        more tokens are computed."""
        while len(self._idents) <= p:
            end = min(self.computed, (len(self._idents) + 1) * bs)
            self._idents.append(ident_of(self.tokens[:end], self.lora, self.salt, self.mm))
        return self._idents[p]

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def advance(self, computed: int, lookahead: int, bs: int) -> range:
        """``computed`` tokens are computed now, with ``lookahead`` slots; the
        block positions whose KV this step computed (or completed)."""
        before = self.computed
        del self._idents[before // bs:]  # the partial block's inputs change
        self.computed = computed
        self.held = max(self.held, -(-(computed + lookahead) // bs))
        return range(before // bs, -(-computed // bs))


def ident_of(tokens, lora, salt, mm) -> tuple:
    end = len(tokens)
    return (tuple(tokens), lora, salt or None, tuple(sorted((i for i in mm if i.offset < end),
                                                            key=lambda i: (i.offset, i.length, i.hash))))


def show_ident(ident) -> str:
    tokens, lora, salt, mm = ident
    return f"tokens={list(tokens)} lora={lora} salt={salt!r} mm={list(mm)}"


def to_ints(tokens) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        return [int(t) % 2**32 for t in tokens.tolist()]
    return [int(t) for t in (tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)]


def fmt_tokens(tokens) -> str:
    if isinstance(tokens, torch.Tensor):
        return f"torch.tensor({tokens.tolist()}, dtype={tokens.dtype})"
    if isinstance(tokens, np.ndarray):
        return f"np.array({tokens.tolist()}, dtype=np.{tokens.dtype})"
    return repr(list(tokens))


def fmt_new(r: NewRequest) -> str:
    args = [repr(r.request_id), fmt_tokens(r.token_ids)]
    if r.lora_id is not None:
        args.append(f"lora_id={r.lora_id}")
    if r.mm_items:
        args.append(f"mm_items={tuple(r.mm_items)!r}")
    if r.cache_salt is not None:
        args.append(f"cache_salt={r.cache_salt!r}")
    if r.skip_prefix_cache:
        args.append("skip_prefix_cache=True")
    if r.num_tokens_to_compute is not None:
        args.append(f"num_tokens_to_compute={r.num_tokens_to_compute}")
    if r.num_lookahead_tokens:
        args.append(f"num_lookahead_tokens={r.num_lookahead_tokens}")
    if r.num_preemptions:
        args.append(f"num_preemptions={r.num_preemptions}")
    if r.block_hashes is not None:
        args.append("block_hashes=[" + ", ".join(f"bytes.fromhex('{d.hex()}')" for d in r.block_hashes) + "]")
    return f"NewRequest({', '.join(args)})"


def fmt_step(finished, running, new) -> str:
    parts = []
    if finished:
        parts.append(f"finished={list(finished)!r}")
    if running:
        parts.append("running=[" + ", ".join(
            f"RunningUpdate({u.request_id!r}, {fmt_tokens(u.new_token_ids)}, {u.num_tokens_to_compute}, "
            f"{u.num_lookahead_tokens})" for u in running) + "]")
    if new:
        parts.append("new=[" + ", ".join(fmt_new(r) for r in new) + "]")
    return f"step({', '.join(parts)})"


def trace(line: str) -> None:
    """A line of the replayable trace, printed with a failing example."""
    if current_build_context().is_final:
        note(line)


# ---------------------------------------------------------------- the machine
class ServingLoop(RuleBasedStateMachine):
    BACKEND = "reference"
    LAYOUT = "full"

    def __init__(self):
        super().__init__()
        self.ref = None
        self.dev = None
        COUNTS["examples"] += 1

    # ------------------------------------------------------------ setup
    @initialize(data=st.data())
    def setup(self, data):
        windows = data.draw(st.sampled_from(LAYOUTS[self.LAYOUT]), label="sliding_windows")
        bs = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
        per_group = data.draw(st.integers(3, 16), label="blocks per group")
        uncached_first = data.draw(st.booleans(), label="uncached_first")
        # KV-cache events on most examples: checked after every call (check_events).
        self.events = data.draw(st.sampled_from([True, True, True, False]), label="enable_kv_cache_events")
        self.G = len(windows)
        self.bs = bs
        self.windows = windows
        # Blocks a window group keeps at a hit boundary (design.md).
        self.W = [None if w is None else -(-(w - 1) // bs) for w in windows]
        self.N = per_group * self.G + 1
        self.cap = min(MAX_TOKENS, ((self.N - 1) // self.G) * bs)  # never "can never be admitted"
        self.ref = ReferenceManager(self.N, bs, sliding_windows=windows, uncached_first=uncached_first, hash_key=KEY,
                                    enable_kv_cache_events=self.events)
        trace(f"m = ReferenceManager({self.N}, {bs}, sliding_windows={windows}, uncached_first={uncached_first}, "
              f"hash_key=bytes(range(16)){', enable_kv_cache_events=True' if self.events else ''})")
        if self.BACKEND == "device":
            from gpukv.device.manager import DeviceManager

            rows = data.draw(st.sampled_from([2, 64]), label="max_num_reqs")
            self.dev = DeviceManager(self.N, bs, sliding_windows=windows, uncached_first=uncached_first,
                                     hash_key=KEY, max_model_len=MAX_TOKENS, max_num_reqs=rows,
                                     enable_kv_cache_events=self.events)
        # What a KV-aware router keeps from each manager's events.
        self.indexes = [RouterIndex() for _ in self.managers()] if self.events else []
        self.last_events: list[tuple] = []  # the atoms of the last call's events
        self.reqs: dict[str, Req] = {}
        self.order: list[str] = []  # running, oldest admission first
        self.waiting: list[NewRequest] = []
        self.truth: dict[int, tuple] = {}  # block id -> (group, ident) it was last computed from
        self.honest_memo: dict[tuple, bytes] = {}
        self.docs: list[list[int]] = []
        self.next_id = 0
        self.check_all(expect={"requests": 0})

    # ------------------------------------------------------------ drawing
    def fresh_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def draw_tokens(self, data, *, min_len: int = 1) -> list[int]:
        # Earlier prompts, and running requests' tokens so far (a conversation
        # going on from a previous answer).
        docs = self.docs[-12:] + [list(self.reqs[rid].tokens) for rid in self.order[-4:]]
        if docs and data.draw(st.booleans(), label="share a prefix"):
            doc = data.draw(st.sampled_from(docs), label="doc")
            cut = data.draw(st.integers(0, len(doc)), label="cut")
            tokens = doc[:cut] + data.draw(st.lists(TOKEN, min_size=0 if cut else 1, max_size=6), label="tail")
        else:
            tokens = data.draw(st.lists(TOKEN, min_size=1, max_size=12), label="tokens")
        tokens = tokens[: self.cap]
        while len(tokens) < min_len:
            tokens.append(0)
        return tokens

    def draw_extras(self, data, n_tokens: int) -> dict:
        kw = {}
        lora = data.draw(st.sampled_from([None, None, None, 1, 2]), label="lora_id")
        if lora is not None:
            kw["lora_id"] = lora
        salt = data.draw(st.sampled_from([None, None, None, "s1", "s2", ""]), label="cache_salt")
        if salt is not None:
            kw["cache_salt"] = salt
        if data.draw(st.sampled_from([False, False, False, True]), label="multimodal"):
            offset = data.draw(st.integers(0, n_tokens - 1), label="mm offset")
            length = data.draw(st.integers(1, n_tokens - offset), label="mm length")
            items = [MMItem(offset, length, data.draw(st.sampled_from(["img-a", "img-b"]), label="mm hash"))]
            if offset + length < n_tokens and data.draw(st.booleans(), label="second item"):
                o2 = data.draw(st.integers(offset + length, n_tokens - 1), label="mm offset 2")
                items.append(MMItem(o2, data.draw(st.integers(1, n_tokens - o2), label="mm length 2"), "img-c"))
            kw["mm_items"] = tuple(items)
        if data.draw(st.sampled_from([False] * 7 + [True]), label="skip_prefix_cache"):
            kw["skip_prefix_cache"] = True
        return kw

    def draw_new(self, data) -> NewRequest:
        tokens = self.draw_tokens(data)
        kw = self.draw_extras(data, len(tokens))
        self.docs.append(tokens)
        form = data.draw(st.sampled_from(["list"] * 6 + ["numpy"]), label="token container")
        token_ids = np.array(tokens, dtype=np.int64) if form == "numpy" else list(tokens)
        n = len(tokens)
        chunk = None
        if data.draw(st.sampled_from([False] * 3 + [True]), label="chunked prefill"):
            chunk = data.draw(st.integers(1, n), label="num_tokens_to_compute")
        lookahead = self.draw_lookahead(data, self.cap - n)
        return NewRequest(self.fresh_id(), token_ids, num_tokens_to_compute=chunk, num_lookahead_tokens=lookahead,
                          **kw)

    def draw_lookahead(self, data, room: int) -> int:
        """Lookahead slots within ``room`` tokens (so a request never outgrows
        the pool or max_model_len): mostly none."""
        if room <= 0 or not data.draw(st.sampled_from([False] * 4 + [True]), label="lookahead"):
            return 0
        return data.draw(st.integers(1, min(3, room)), label="num_lookahead_tokens")

    def draw_update(self, data, rid: str) -> RunningUpdate:
        req = self.reqs[rid]
        room = self.cap - len(req.tokens)
        tokens = data.draw(st.lists(TOKEN, min_size=0, max_size=min(3, room)), label=f"decode {rid}")
        left = len(req.tokens) + len(tokens) - req.computed
        chunk = None
        if left and data.draw(st.sampled_from([False] * 2 + [True]), label="a chunk"):
            chunk = data.draw(st.integers(1, left), label="num_tokens_to_compute")
        lookahead = self.draw_lookahead(data, room - len(tokens))
        form = data.draw(st.sampled_from(["list"] * 6 + ["numpy", "torch"]), label="token container")
        if form == "numpy":
            tokens = np.array(tokens, dtype=np.int64)
        elif form == "torch":
            tokens = torch.tensor(tokens, dtype=torch.int64)
        return RunningUpdate(rid, tokens, chunk, lookahead)

    def draw_updates(self, data, rids) -> list[RunningUpdate]:
        return [self.draw_update(data, rid) for rid in rids
                if data.draw(st.booleans(), label=f"update {rid}")]

    def honest_chain(self, tokens, lora=None, salt=None, mm=()) -> list[bytes]:
        n = len(tokens) // self.bs
        extras = hashing.extra_key_digests(KEY, n, self.bs, lora_id=lora, mm_items=mm, cache_salt=salt)
        return hashing.hash_block_chain(KEY, tokens, self.bs, extras=extras)

    def honest_digest(self, ident) -> bytes:
        """The digest an honest caller (or the manager) gives a full block
        computed from ``ident`` (memoised along the chain)."""
        d = self.honest_memo.get(ident)
        if d is None:
            tokens, lora, salt, mm = ident
            bs = self.bs
            n = len(tokens) // bs
            prev = (n - 1) * bs
            parent = ROOT if n == 1 else self.honest_digest(ident_of(tokens[:prev], lora, salt, mm))
            extra = hashing.extra_key_digests(KEY, 1, bs, lora_id=lora, mm_items=mm, cache_salt=salt,
                                              first_block=n - 1)[0]
            d = hashing.block_digest(KEY, parent, list(tokens[prev:]), extra)
            self.honest_memo[ident] = d
        return d

    # ------------------------------------------------------------ manager calls
    def managers(self):
        return [self.ref] if self.dev is None else [self.ref, self.dev]

    def call_step(self, finished, updates, new, token_budget=None):
        """One manager step on every backend, then the model, the ground truth
        and every check."""
        finished, updates, new = list(finished), list(updates), list(new)
        line = fmt_step(finished, updates, new) if current_build_context().is_final else ""
        if token_budget is not None:
            line = line[:-1] + f", token_budget={token_budget})"
        old_computed = {u.request_id: self.reqs[u.request_id].computed for u in updates}
        res = self.ref.step(finished, updates, new, token_budget=token_budget)
        trace(f"m.{line}  # -> {res}")
        COUNTS["manager_steps"] += 1
        if self.dev is not None:
            res_dev = self.dev.step(finished, updates, new, token_budget=token_budget)
            assert res_dev == res, f"device {res_dev} != reference {res}"
        self.account(finished, updates, new, res, token_budget, old_computed)
        return res

    def call_decode(self, updates, form: str):
        """``decode(rows, new_token_ids, ...)`` on every backend for running
        updates that share their token count and lookahead (the chunks, one
        per row or none): the same result as ``step(running=updates)``, so
        the model, the ground truth and the checks are the step's.
        ``form``: how the arguments are handed in (lists, numpy arrays, CPU
        tensors: the device's tensor path under the interpreter; ``[B]`` for
        one token each; None or ``[B, 0]`` to only continue chunks)."""
        updates = list(updates)
        B = len(updates)
        k, la = len(updates[0].new_token_ids), updates[0].num_lookahead_tokens
        assert all(len(u.new_token_ids) == k and u.num_lookahead_tokens == la for u in updates), updates
        chunks = [u.num_tokens_to_compute for u in updates]
        assert all(c is None for c in chunks) or all(c is not None for c in chunks), chunks
        mat = [to_ints(u.new_token_ids) for u in updates]
        row_ids = [self.ref.row_of(u.request_id) for u in updates]
        if form in ("torch", "torch32"):
            dtype = torch.int32 if form == "torch32" and all(t < 2**31 for r in mat for t in r) else torch.int64
            rows, tokens = torch.tensor(row_ids, dtype=torch.int64), torch.tensor(mat, dtype=dtype).reshape(B, k)
            chunk_arg = None if chunks[0] is None else torch.tensor(chunks, dtype=torch.int64)
        elif form == "numpy":
            rows, tokens = np.array(row_ids, dtype=np.int64), np.array(mat, dtype=np.int64).reshape(B, k)
            chunk_arg = None if chunks[0] is None else np.array(chunks, dtype=np.int64)
        else:
            rows, chunk_arg = list(row_ids), None if chunks[0] is None else list(chunks)
            # (a list of B empty lists is not a [B, 0] form: numpy makes it float)
            tokens = None if k == 0 else [t[0] for t in mat] if k == 1 and form == "flat" else mat
        kw = {}
        if chunk_arg is not None:
            kw["num_tokens_to_compute"] = chunk_arg
        if la:
            kw["num_lookahead_tokens"] = la
        line = ""
        if current_build_context().is_final:
            args = [fmt_tokens(rows) if not isinstance(rows, list) else repr(rows),
                    fmt_tokens(tokens) if tokens is not None and not isinstance(tokens, list) else repr(tokens)]
            args += [f"{a}={fmt_tokens(v) if not isinstance(v, int | list) else v!r}" for a, v in kw.items()]
            line = f"decode({', '.join(args)})"
        old_computed = {u.request_id: self.reqs[u.request_id].computed for u in updates}
        res = self.ref.decode(rows, tokens, **kw)
        trace(f"m.{line}  # -> {res}")
        COUNTS["decode_calls"] += 1
        COUNTS[f"decode_{form}"] += 1
        COUNTS["decode_chunked"] += chunk_arg is not None
        COUNTS["decode_lookahead"] += la > 0
        COUNTS["decode_rows"] += B
        if self.dev is not None:
            res_dev = self.dev.decode(rows, tokens, **kw)
            assert res_dev == res, f"device {res_dev} != reference {res}"
        assert res.num_admitted == 0 and res.rows == [], res
        if res.running_failed_at is not None:
            COUNTS["decode_refused"] += 1
        self.account((), updates, (), res, None, old_computed)
        return res

    def account(self, finished, updates, new, res, token_budget, old_computed) -> None:
        """A step's result (or a decode's, the step of its running updates)
        against the model; then the model, the ground truth and every check."""
        bs = self.bs
        # The result makes sense.
        k = res.running_failed_at
        assert k is None or 0 <= k < len(updates), res
        if k is not None:
            COUNTS["running_refused"] += 1
            assert res.num_admitted == 0 and res.num_computed_tokens == [], res
        assert 0 <= res.num_admitted <= len(new) and len(res.num_computed_tokens) == res.num_admitted, res
        if k is None:
            COUNTS["new_refused"] += len(new) - res.num_admitted
        # Model: finished requests go; applied updates grow; admitted requests join.
        for rid in finished:
            self.forget(rid)
        self.apply_updates(updates if k is None else updates[:k], updates, old_computed)
        # vLLM's waiting loop: each admitted request computes min(tokens - hit,
        # chunk, budget left) past its hit and is charged only those.
        assert len(res.num_new_tokens) == res.num_admitted, res
        budget_left = token_budget
        for r, hit_tokens, got in zip(new, res.num_computed_tokens, res.num_new_tokens, strict=False):
            want = len(r.token_ids) - hit_tokens
            if r.num_tokens_to_compute is not None:
                want = min(want, r.num_tokens_to_compute)
            if budget_left is not None:
                assert budget_left > 0, (r.request_id, "admitted with the budget spent")
                want = min(want, budget_left)
                budget_left -= got
            assert got == want >= 1, (r.request_id, got, want)
        # Stats count the new requests looked up: up to the first refused one,
        # not one the spent budget stopped before. Re-admissions after a
        # preemption count apart (``preempted_*``).
        expected_stats = {"requests": 0, "preempted_requests": 0}
        if new and k is None:
            stopped_by_budget = budget_left is not None and budget_left <= 0
            looked = new[: min(len(new), res.num_admitted + (0 if stopped_by_budget else 1))]
            expected_stats = {"requests": sum(r.num_preemptions == 0 for r in looked),
                              "preempted_requests": sum(r.num_preemptions > 0 for r in looked)}
            if res.num_admitted == len(new):
                live = [(r, h) for r, h in zip(new, res.num_computed_tokens, strict=True)
                        if not r.skip_prefix_cache and r.num_preemptions == 0]
                expected_stats.update(
                    query_blocks=sum(-(-len(r.token_ids) // bs) for r, _ in live),
                    queries=sum(len(r.token_ids) for r, _ in live),
                    hits=sum(h for _, h in live),
                )
        for i, r in enumerate(new[: res.num_admitted]):
            self.admitted(r, res.num_computed_tokens[i], res.num_new_tokens[i], r.num_lookahead_tokens)
        self.check_all(expect=expected_stats)

    def apply_updates(self, applied, updates, old_computed) -> None:
        """The model of phase 2: every update's window groups release what
        their window left behind (before any fit check), then the
        ``applied`` ones (those that fit) append and compute."""
        bs = self.bs
        for u in updates:
            st_ = self.reqs[u.request_id]
            for g, w in enumerate(self.windows):
                if w is not None:
                    st_.null_upto[g] = max(st_.null_upto[g], max(0, old_computed[u.request_id] - w + 1) // bs)
        for u in applied:
            req = self.reqs[u.request_id]
            req.extend(to_ints(u.new_token_ids))
            chunk = u.num_tokens_to_compute
            computed = len(req.tokens) if chunk is None else req.computed + chunk
            blocks = self.ref.get_block_ids(req.rid)
            for p in req.advance(computed, u.num_lookahead_tokens, bs):
                for g in range(self.G):
                    self.compute(blocks[g][p], g, req, p)

    def admitted(self, r: NewRequest, hit_tokens: int, new_tokens: int, lookahead: int) -> Req:
        """The model of an admission: ``r`` hit ``hit_tokens`` (each hit block
        must hold exactly what ``r``'s prefix says) and computes ``new_tokens``
        past them, with ``lookahead`` slots."""
        bs = self.bs
        n = len(r.token_ids)
        assert hit_tokens % bs == 0 and 0 <= hit_tokens <= (n - 1) // bs * bs, (r.request_id, hit_tokens)
        if r.skip_prefix_cache:
            assert hit_tokens == 0, r.request_id
        h = hit_tokens // bs
        COUNTS["hit_blocks"] += h
        COUNTS["admitted"] += 1
        if r.block_hashes is not None:
            COUNTS["admitted_with_caller_digests"] += 1
        req = Req(r.request_id, to_ints(r.token_ids), r.lora_id, r.cache_salt, tuple(r.mm_items),
                  bool(r.skip_prefix_cache),
                  null_upto=[0 if W is None else max(0, h - W) for W in self.W])
        self.reqs[req.rid] = req
        self.order.append(req.rid)
        blocks = self.ref.get_block_ids(req.rid)
        req.advance(hit_tokens, 0, bs)  # the hit is computed
        for g in range(self.G):
            for p in range(h):
                b = blocks[g][p]
                if b != 0:
                    self.check_hit(b, g, req, p)
        for p in req.advance(hit_tokens + new_tokens, lookahead, bs):
            if p >= h:
                for g in range(self.G):
                    self.compute(blocks[g][p], g, req, p)
        return req

    def snapshot(self) -> tuple:
        """What a refused call must leave as it was."""
        ref = self.ref
        return (ref.free_queue(), list(ref.pool.ref_cnt), ref.pool.table(), ref.num_evictions,
                {rid: (ref.get_block_ids(rid), ref.num_computed_tokens(rid)) for rid in ref.request_ids()})

    def compute(self, b: int, g: int, req: Req, p: int) -> None:
        """Block ``b`` now holds group ``g``'s KV of request ``req``'s block ``p``."""
        assert b != 0, f"{req.rid}: the null block at computed position {p} of group {g}"
        self.truth[b] = (g, req.ident(p, self.bs))

    def check_hit(self, b: int, g: int, req: Req, p: int) -> None:
        want = req.ident(p, self.bs)
        got = self.truth.get(b)
        if got != (g, want):
            COUNTS["false_hits"] += 1
            raise AssertionError(
                f"FALSE HIT: {req.rid} got block {b} at position {p} of group {g}; the block was computed "
                + ("never" if got is None else f"for group {got[0]} from {show_ident(got[1])}")
                + f", the request's prefix is {show_ident(want)}"
            )

    def forget(self, rid: str) -> None:
        del self.reqs[rid]
        self.order.remove(rid)

    # ------------------------------------------------------------ the serving loop
    def serve(self, finished=(), updates=(), fresh=(), *, admit_waiting=True, token_budget=None, decode_form=None):
        """A scheduling step as a serving loop makes it, refusals included
        (``decode_form``: running updates only, through ``decode``, the
        retries too)."""
        new = (self.waiting if admit_waiting else []) + list(fresh)
        if admit_waiting:
            self.waiting = []
        if decode_form is not None:
            assert not finished and not new, (finished, new)
            res = self.call_decode(updates, decode_form)
        else:
            res = self.call_step(finished, updates, new, token_budget)
        if res.ok:
            self.waiting = new[res.num_admitted:] + self.waiting
            return
        self.waiting = new + self.waiting  # none was looked at
        pending = list(updates[res.running_failed_at:])
        while pending:
            victim = self.order[-1]  # the most recently admitted request goes first
            extra = next((to_ints(u.new_token_ids) for u in pending if u.request_id == victim), [])
            self.preempt([victim], extra={victim: extra})
            pending = [u for u in pending if u.request_id != victim]
            if not pending:
                break
            res = self.call_step((), pending, ()) if decode_form is None else self.call_decode(pending, decode_form)
            if res.ok:
                break
            pending = pending[res.running_failed_at:]

    def preempt(self, rids, *, extra=None, carry=False):
        """Free running requests and queue them, first in line, to resume with
        every token they have (plus the ones an unapplied update brought)."""
        extra = extra or {}
        resumed = []
        carried = {}
        for rid in rids:
            req = self.reqs[rid]
            if carry and not extra.get(rid):
                carried[rid] = self.ref.block_hashes(rid)
                if self.dev is not None:
                    assert self.dev.block_hashes(rid) == carried[rid], rid
            tokens = req.tokens + list(extra.get(rid, []))
            kw = dict(lora_id=req.lora, cache_salt=req.salt, mm_items=req.mm, skip_prefix_cache=req.skip,
                      block_hashes=carried.get(rid), num_preemptions=1)
            resumed.append(NewRequest(rid, tokens, **kw))
        self.call_step(rids, (), ())
        COUNTS["preemptions"] += len(rids)
        self.waiting = resumed + self.waiting

    # ------------------------------------------------------------ rules
    @rule(data=st.data())
    def admit(self, data):
        """New requests (and the waiting ones, first) in one batch."""
        k = data.draw(st.integers(1, 3), label="new requests") if len(self.waiting) < 5 else 0
        self.serve(fresh=[self.draw_new(data) for _ in range(k)])
        COUNTS["rule_admit"] += 1

    @rule(data=st.data())
    def schedule(self, data):
        """A whole scheduling step: finish some, decode others, admit new."""
        finished = [rid for rid in self.order
                    if data.draw(st.sampled_from([False, False, True]), label=f"finish {rid}")]
        updates = self.draw_updates(data, [rid for rid in self.order if rid not in finished])
        k = data.draw(st.integers(0, 2), label="new requests") if len(self.waiting) < 5 else 0
        fresh = [self.draw_new(data) for _ in range(k)]
        budget = data.draw(st.one_of(st.none(), st.integers(0, 24)), label="token_budget")
        self.serve(finished, updates, fresh, token_budget=budget)
        COUNTS["rule_schedule"] += 1
        COUNTS["budgeted_steps"] += budget is not None

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def decode(self, data):
        """Running updates only (no new request is looked at)."""
        updates = self.draw_updates(data, self.order) or [self.draw_update(data, self.order[-1])]
        self.serve(updates=updates, admit_waiting=False)
        COUNTS["rule_decode"] += 1

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def decode_batched(self, data):
        """The batched decode entry: running requests, by row and in any
        order, each append the same number of tokens (none: chunk
        continuations only) with one lookahead, and sometimes one chunk
        each; refusals as a serving loop handles them, retried through
        decode."""
        rids = data.draw(st.lists(st.sampled_from(self.order), min_size=1, max_size=4, unique=True),
                         label="decode rows")
        room = min(self.cap - len(self.reqs[rid].tokens) for rid in rids)
        k = data.draw(st.integers(0, min(2, room)), label="tokens per row")
        lookahead = self.draw_lookahead(data, room - k)
        tokens = [data.draw(st.lists(TOKEN, min_size=k, max_size=k), label=f"tokens of {rid}") for rid in rids]
        left = [len(self.reqs[rid].tokens) + k - self.reqs[rid].computed for rid in rids]
        chunks: list = [None] * len(rids)
        if min(left) > 0 and data.draw(st.sampled_from([False, True, True]), label="chunks"):
            chunks = [data.draw(st.integers(1, n), label=f"chunk of {rid}") for rid, n in zip(rids, left, strict=True)]
        form = data.draw(st.sampled_from(["list", "list", "flat", "numpy", "torch", "torch32", "none"]),
                         label="argument form")
        if form == "flat" and k != 1 or form == "none" and k != 0:
            form = "list"
        updates = [RunningUpdate(rid, t, c, lookahead) for rid, t, c in zip(rids, tokens, chunks, strict=True)]
        self.serve(updates=updates, admit_waiting=False, decode_form=form)
        COUNTS["rule_decode_batched"] += 1

    @rule(data=st.data())
    def allocate_new(self, data):
        """vLLM's per-request admission: ``get_computed_blocks`` of a waiting
        request (or a fresh one), then ``allocate_slots(request,
        computed=..., num_tokens=k, num_lookahead_tokens=...)``, ``k`` tokens
        past the hit (or None: the request's own chunk, else all). The same
        blocks on both managers; refused (None): nothing changed and the
        request waits."""
        pos = None
        if self.waiting and data.draw(st.booleans(), label="a waiting request"):
            pos = data.draw(st.sampled_from([0, 0, len(self.waiting) - 1]), label="which waiting request")
            r = self.waiting.pop(pos)
        else:
            r = self.draw_new(data)
        sized = data.draw(st.booleans(), label="the hit by its size (read_prefix_hit, admit)")
        c = self.size_up(r) if sized else self.look_up(r, "c = ")
        pre = r.num_preemptions > 0
        hits = 0 if r.skip_prefix_cache else c.num_tokens
        self.check_all(expect={"requests": int(not pre), "preempted_requests": int(pre),
                               "preempted_hits" if pre else "hits": hits})
        computed = c if data.draw(st.sampled_from([True] * 4 + [False]), label="pass the hit") else None
        hit = computed.num_tokens if computed is not None else 0
        n = len(r.token_ids)
        num_tokens = None
        if data.draw(st.sampled_from([False, True, True]), label="num_tokens"):
            num_tokens = data.draw(st.integers(1, n - hit), label="tokens past the hit")
        la = None
        if data.draw(st.booleans(), label="num_lookahead_tokens"):
            la = self.draw_lookahead(data, self.cap - n)
        chunk = num_tokens if num_tokens is not None else r.num_tokens_to_compute
        new_tokens = n - hit if chunk is None else min(n - hit, chunk)
        before = self.snapshot()
        counts = {"num_tokens": num_tokens, "num_lookahead_tokens": la}
        res = [m.admit(r, computed, **counts) if sized else m.allocate_slots(r, computed=computed, **counts)
               for m in self.managers()]
        trace(f"m.{'admit' if sized else 'allocate_slots'}({fmt_new(r)}, "
              f"{'computed=' if not sized else ''}{'c' if computed is not None else None}, "
              f"num_tokens={num_tokens}, num_lookahead_tokens={la})  # -> {res[0]}")
        assert all(x == res[0] for x in res), res
        COUNTS["allocate_new_calls"] += 1
        COUNTS["admit_sized"] += sized
        if res[0] is None or res[0] is False:
            assert self.snapshot() == before, "allocate_slots refused a new request but changed the pool"
            COUNTS["allocate_new_refused"] += 1
            if pos is None:
                self.waiting.append(r)
            else:
                self.waiting.insert(pos, r)
        else:
            COUNTS["allocate_new_admitted"] += 1
            COUNTS["allocate_new_partial"] += hit + new_tokens < n
            self.admitted(r, hit, new_tokens, r.num_lookahead_tokens if la is None else la)
            h = hit // self.bs
            blocks = self.ref.get_block_ids(r.request_id)
            if sized:  # (no ids came back: every manager holds the same, and the hit's unheld count was right)
                assert all(m.get_block_ids(r.request_id) == blocks for m in self.managers()), r.request_id
                unheld = sum(1 for g in blocks for b in g[:h] if b and before[1][b] == 0)
                assert computed is None or computed.num_unheld_blocks == unheld, (computed, unheld)
            else:
                assert res[0] == [g[h:] for g in blocks], (res[0], blocks, h)
        self.check_all(expect={"requests": 0, "preempted_requests": 0})
        COUNTS["rule_allocate_new"] += 1

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def allocate_running(self, data):
        """``allocate_slots(request_id, new_token_ids, num_tokens=...,
        num_lookahead_tokens=...)`` for a running request: append, then
        compute (all, or a chunk), as a one-update step; the newly allocated
        blocks on both. Refused (None): the window release happened, nothing
        else; the most recent request is preempted and it is retried."""
        rid = data.draw(st.sampled_from(self.order), label="allocate for")
        u = self.draw_update(data, rid)
        la = u.num_lookahead_tokens
        la_arg = None if not la and data.draw(st.booleans(), label="lookahead None") else la
        while True:
            req = self.reqs[rid]
            held, old_computed = req.held, {rid: req.computed}
            res = [m.allocate_slots(rid, u.new_token_ids, num_tokens=u.num_tokens_to_compute,
                                    num_lookahead_tokens=la_arg) for m in self.managers()]
            trace(f"m.allocate_slots({rid!r}, {fmt_tokens(u.new_token_ids)}, num_tokens={u.num_tokens_to_compute}, "
                  f"num_lookahead_tokens={la_arg})  # -> {res[0]}")
            assert all(x == res[0] for x in res), res
            COUNTS["allocate_running_calls"] += 1
            self.apply_updates([] if res[0] is None else [u], [u], old_computed)
            if res[0] is not None:
                blocks = self.ref.get_block_ids(rid)
                assert res[0] == [g[held:] for g in blocks], (res[0], blocks, held)
                self.check_all(expect={"requests": 0, "preempted_requests": 0})
                break
            COUNTS["allocate_running_refused"] += 1
            self.check_all(expect={"requests": 0, "preempted_requests": 0})
            victim = self.order[-1]
            self.preempt([victim], extra={victim: to_ints(u.new_token_ids) if victim == rid else []})
            if victim == rid:
                break
        COUNTS["rule_allocate_running"] += 1

    @precondition(lambda self: self.order or self.waiting)
    @rule(data=st.data())
    def finish(self, data):
        """Requests finish (or a waiting one is aborted: no manager call)."""
        if self.waiting and (not self.order or data.draw(st.booleans(), label="abort a waiting request")):
            self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1), label="which"))
            COUNTS["rule_finish"] += 1
            return
        rids = data.draw(st.lists(st.sampled_from(self.order), min_size=1, max_size=3, unique=True), label="finish")
        self.call_step(rids, (), ())
        COUNTS["rule_finish"] += 1

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def preempt_one(self, data):
        """A running request is preempted; it resumes later with its tokens
        (and, sometimes, the digests the manager computed for it)."""
        rid = data.draw(st.sampled_from(self.order), label="preempt")
        self.preempt([rid], carry=data.draw(st.booleans(), label="carry block_hashes"))
        COUNTS["rule_preempt"] += 1

    @rule(drain=st.booleans())
    def reset(self, drain):
        """Reset the prefix cache: refused while any block is held; drained
        first (everything preempted), it must succeed."""
        if drain and self.order:
            self.preempt(list(reversed(self.order)))
        expected = not self.reqs
        got = [m.reset_prefix_cache() for m in self.managers()]
        trace(f"m.reset_prefix_cache()  # -> {got[0]}")
        assert got == [expected] * len(got), (got, expected)
        COUNTS["resets"] += expected
        self.check_all(expect={"requests": 0, "reset": expected})
        if self.events:  # everything before was taken after the call before
            assert self.last_events == ([("cleared",)] if expected else []), self.last_events
        COUNTS["rule_reset"] += 1

    @rule(data=st.data())
    def evict_pressure(self, data):
        """Requests of never-seen tokens sized to fill the free pool, served
        ahead of the waiting queue (and dropped if refused): allocation has to
        evict cached blocks."""
        k = data.draw(st.integers(1, 3), label="pressure requests")
        free = self.ref.num_free_blocks
        per = max(1, min(self.cap // self.bs, free // (k * self.G) + data.draw(st.integers(0, 1), label="over")))
        fresh = []
        for _ in range(k):
            base = 1000 + 64 * self.next_id
            n = max(1, per * self.bs - data.draw(st.integers(0, self.bs - 1), label="short by"))
            fresh.append(NewRequest(self.fresh_id(), [base + i for i in range(n)]))
        before = self.ref.num_evictions
        self.call_step((), (), fresh)
        COUNTS["evictions"] += self.ref.num_evictions - before
        COUNTS["rule_evict"] += 1

    def size_up(self, r: NewRequest):
        """``read_prefix_hit(r)`` on every manager: the same size on all
        (whether each hit block is exact is checked once admitted:
        ``admitted``). Returns it."""
        got = [m.read_prefix_hit(r) for m in self.managers()]
        trace(f"c = m.read_prefix_hit({fmt_new(r)})  # -> {got[0]}")
        assert all(p == got[0] for p in got), got
        return got[0]

    def look_up(self, r: NewRequest, assign: str = ""):
        """``get_computed_blocks(r)`` on every manager: the same blocks on
        all, each computed from exactly ``r``'s prefix. Returns the hit."""
        got = [m.get_computed_blocks(r) for m in self.managers()]
        trace(f"{assign}m.get_computed_blocks({fmt_new(r)})  # -> {got[0]}")
        assert all(c == got[0] for c in got), got
        self.check_computed(r, got[0])
        return got[0]

    @rule(data=st.data())
    def lookup(self, data):
        """get_computed_blocks on a candidate: the same blocks on both, each
        computed from exactly the candidate's prefix; only stats change."""
        r = self.draw_new(data)
        c = self.look_up(r)
        self.check_all(expect={"requests": 1, "hit_tokens": 0 if r.skip_prefix_cache else c.num_tokens})
        COUNTS["rule_lookup"] += 1

    @precondition(lambda _self: ADVERSARIAL)
    @rule(data=st.data())
    def adversarial(self, data):
        """Callers hand in digests: forged (another prefix's honest chain on
        other tokens, LoRA, salt or images), copied, random, mixed or honest;
        honest victims asking for the prefix follow, in the same batch or the
        next step. No victim may hit a block computed from anything else."""
        bs = self.bs
        if (self.order or self.waiting) and data.draw(st.booleans(), label="clear the stage"):
            self.waiting = []  # aborted
            if self.order:
                self.call_step(list(self.order), (), ())
        victim_tokens = self.draw_tokens(data, min_len=min(self.cap, 2 * bs + 1))  # long enough to hit a forgery
        v_kw = self.draw_extras(data, len(victim_tokens))
        v_kw.pop("skip_prefix_cache", None)
        v_chain = self.honest_chain(victim_tokens, v_kw.get("lora_id"), v_kw.get("cache_salt"),
                                    v_kw.get("mm_items", ()))
        liars = []
        for _ in range(data.draw(st.integers(1, 2), label="liars")):
            mode = data.draw(st.sampled_from(["forged", "forged", "copied", "random", "mixed", "honest"]),
                             label="digest mode")
            tokens = list(victim_tokens)
            kw = dict(v_kw)
            if mode in ("forged", "mixed"):
                # The victim's honest chain on other inputs: other tokens in
                # some block, or another LoRA, salt or image.
                what = data.draw(st.sampled_from(["tokens", "tokens", "lora", "salt", "mm"]), label="forge")
                if what == "tokens":
                    j = data.draw(st.integers(0, len(tokens) - 1), label="changed position")
                    tokens[j] = data.draw(st.sampled_from([t for t in (0, 1, 2, 3, 7) if t != tokens[j]]),
                                          label="new token")
                elif what == "lora":
                    kw["lora_id"] = 3 if kw.get("lora_id") is None else None
                elif what == "salt":
                    kw["cache_salt"] = "evil" if not kw.get("cache_salt") else None
                else:
                    kw["mm_items"] = (MMItem(0, len(tokens), "img-evil"),) if not kw.get("mm_items") else ()
                kw = {a: v for a, v in kw.items() if v not in (None, ())}
                if data.draw(st.booleans(), label="extend"):
                    tokens += data.draw(st.lists(TOKEN, max_size=bs + 1), label="liar tail")
                    tokens = tokens[: self.cap]
                n = len(tokens) // bs
                digests = (v_chain + [bytes(16)] * n)[:n]
                if mode == "mixed":  # honest up to a point, forged after it
                    own = self.honest_chain(tokens, kw.get("lora_id"), kw.get("cache_salt"), kw.get("mm_items", ()))
                    cut = data.draw(st.integers(0, n), label="honest up to")
                    digests = own[:cut] + digests[cut:]
            else:
                if mode != "honest" and data.draw(st.booleans(), label="other tokens"):
                    tokens = self.draw_tokens(data)
                    kw = self.draw_extras(data, len(tokens))
                n = len(tokens) // bs
                if mode == "honest":
                    digests = self.honest_chain(tokens, kw.get("lora_id"), kw.get("cache_salt"),
                                                kw.get("mm_items", ()))
                elif mode == "copied":
                    sources = [self.ref.block_hashes(rid) for rid in self.order] + [v_chain]
                    src = data.draw(st.sampled_from(sources), label="copied from")
                    digests = (src + [data.draw(st.binary(min_size=16, max_size=16), label="pad")] * n)[:n]
                else:
                    pool = [bytes(16), v_chain[0] if v_chain else bytes(16)]
                    digests = [data.draw(st.sampled_from(pool) | st.binary(min_size=16, max_size=16),
                                         label="random digest") for _ in range(n)]
            self.docs.append(tokens)
            liars.append(NewRequest(self.fresh_id(), tokens, block_hashes=digests, **kw))
            COUNTS[f"adversarial_{mode}"] += 1
        if data.draw(st.booleans(), label="an honest prefix first"):
            # The victim's honest prefix cached before the liars come: the
            # blocks a liar's forged chain hangs from (the cache poisoning of
            # docs/fuzzing.md).
            cut = data.draw(st.integers(bs, len(victim_tokens)), label="honest prefix length")
            kw = {a: v for a, v in v_kw.items() if a != "mm_items"}
            kw["mm_items"] = tuple(i for i in v_kw.get("mm_items", ()) if i.offset + i.length <= cut)
            self.serve(fresh=[NewRequest(self.fresh_id(), list(victim_tokens[:cut]), **kw)])
        victims = [NewRequest(self.fresh_id(), list(victim_tokens), **v_kw)]
        if data.draw(st.booleans(), label="a longer victim"):
            longer = (victim_tokens + data.draw(st.lists(TOKEN, min_size=1, max_size=bs + 1), label="more"))[: self.cap]
            victims.append(NewRequest(self.fresh_id(), longer, **v_kw))
        if data.draw(st.booleans(), label="victim digests too"):
            victims[0] = NewRequest(victims[0].request_id, victims[0].token_ids, block_hashes=v_chain, **v_kw)
        if data.draw(st.booleans(), label="same batch"):
            order = data.draw(st.permutations(liars + victims), label="batch order")
            self.serve(fresh=order)
        else:
            self.serve(fresh=liars)
            self.serve(fresh=victims)
        COUNTS["rule_adversarial"] += 1

    # ------------------------------------------------------------ checks
    def check_computed(self, r: NewRequest, c) -> None:
        """``get_computed_blocks(r)``'s answer: whole blocks, short of the last
        token, each hit block computed from exactly ``r``'s prefix (the null
        block only where a window no longer reaches)."""
        h = c.num_tokens // self.bs
        assert c.num_tokens % self.bs == 0 and 0 <= h <= (len(r.token_ids) - 1) // self.bs, c
        if r.skip_prefix_cache:
            assert h == 0, c
        probe = Req(r.request_id, to_ints(r.token_ids), r.lora_id, r.cache_salt, tuple(r.mm_items), False)
        probe.advance(c.num_tokens, 0, self.bs)  # what the hit blocks were computed from
        for g in range(self.G):
            assert len(c.block_ids[g]) == h
            for p, b in enumerate(c.block_ids[g]):
                if b != 0:
                    self.check_hit(b, g, probe, p)
                else:
                    assert self.W[g] is not None and p < h - self.W[g], (g, p, c)

    def check_all(self, expect=None) -> None:
        """Everything the managers hold against the model, the ground truth and
        each other."""
        COUNTS["checks"] += 1
        ref, bs = self.ref, self.bs
        ref.check_invariants()
        assert sorted(ref.request_ids()) == sorted(self.reqs), (ref.request_ids(), list(self.reqs))
        assert len(set(ref.free_queue())) == ref.num_free_blocks == len(ref.free_queue())
        for rid, req in self.reqs.items():
            assert ref.num_computed_tokens(rid) == req.computed, rid
            blocks = ref.get_block_ids(rid)
            assert len(blocks) == self.G and all(len(g) == req.held for g in blocks), (rid, blocks, req.held)
            computed_blocks = -(-req.computed // bs)
            for g in range(self.G):
                for p, b in enumerate(blocks[g]):
                    if p >= computed_blocks:  # allocated for later chunks or lookahead: nothing computed yet
                        assert b != 0, f"{rid}: group {g} position {p} holds the null block"
                        continue
                    if p < req.null_upto[g]:
                        assert b == 0, f"{rid}: group {g} (window {self.windows[g]}) position {p} holds block {b}, " \
                                       f"not the null block (null below {req.null_upto[g]})"
                        continue
                    assert b != 0, f"{rid}: group {g} position {p} holds the null block"
                    want = (g, req.ident(p, bs))
                    have = self.truth.get(b)
                    assert have == want, (
                        f"{rid} holds block {b} at position {p} of group {g}, but the block was last computed "
                        + ("never" if have is None else f"for group {have[0]} from {show_ident(have[1])}")
                        + f"; the request needs {show_ident(want[1])}"
                    )
        for (digest, g), blocks in ref.pool.table().items():
            for b in blocks:
                have = self.truth.get(b)
                assert have is not None and have[0] == g, f"cached block {b} (group {g}) was never computed there"
                assert len(have[1][0]) % bs == 0 and have[1][0], f"cached block {b} is not full: {show_ident(have[1])}"
                if CHECK_DIGESTS:
                    assert self.honest_digest(have[1]) == digest, (
                        f"block {b} is cached under a digest that is not the digest of what it was computed from "
                        f"({show_ident(have[1])}): a caller-supplied digest was trusted"
                    )
        stats = ref.make_prefix_cache_stats()
        assert stats.hits <= stats.queries and stats.hit_tokens <= stats.query_tokens, stats
        for name, value in (expect or {}).items():
            assert getattr(stats, name) == value, f"stats.{name} = {getattr(stats, name)}, expected {value}: {stats}"
        COUNTS["lookups"] += stats.requests
        if self.dev is not None:
            self.compare_device(stats)
        if self.events:
            self.last_events = self.check_events()

    def check_events(self) -> list[tuple]:
        """The KV-cache events of the last call: the same on both managers
        (block by block: the device cuts batches at its reads), without gaps
        or drops; an index kept from each manager's events (what a router
        keeps) holds exactly the reference's table; and each stored block
        still cached says what its ground truth says (its tokens and LoRA id,
        and, with honest digests, the digest before it). Returns the atoms."""
        batches = [m.take_events() for m in self.managers()]
        got = event_atoms(batches[0])
        if self.dev is not None:
            dev_got = event_atoms(batches[1])
            assert dev_got == got, f"device events {dev_got} != reference events {got}"
        for index, bs_ in zip(self.indexes, batches, strict=True):
            for batch in bs_:
                assert batch.dropped == 0, batch
                index.apply(batch)  # in sequence; a removal of a block never stored raises
        table = self.ref.pool.table()
        want = {key: len(blocks) for key, blocks in table.items()}
        for index in self.indexes:
            have = index.blocks
            assert have == want, ("the index kept from the events is not the table: "
                                  f"extra {set(have.items()) - set(want.items())}, "
                                  f"missing {set(want.items()) - set(have.items())}")
        bs = self.bs
        for a in got:
            COUNTS[f"events_{a[0]}"] += 1
            if a[0] != "stored":
                continue
            _, d, parent, tokens, lora, g = a
            assert 0 <= g < self.G and len(tokens) == bs, a
            blocks = table.get((d, g))
            if not blocks:  # stored, then evicted in the same call
                continue
            ident = self.truth[blocks[0]][1]
            assert (tokens, lora) == (ident[0][-bs:], ident[1]), (
                f"event {a} for block {blocks[0]}, which was computed from {show_ident(ident)}")
            if CHECK_DIGESTS:
                n = len(ident[0])
                want_parent = None if n == bs else self.honest_digest(ident_of(ident[0][:n - bs], *ident[1:]))
                assert parent == want_parent, (a, show_ident(ident))
        COUNTS["events_checked"] += 1
        return got

    def compare_device(self, ref_stats) -> None:
        ref, dev = self.ref, self.dev
        dev.check_invariants(verify_digests=CHECK_DIGESTS)
        assert dev.make_prefix_cache_stats() == ref_stats
        assert dev.free_queue() == ref.free_queue()
        assert dev.read_num_free_blocks() == ref.num_free_blocks
        assert dev.pool.ref_counts() == ref.pool.ref_cnt
        assert dev.pool.table_entries() == ref.pool.table()
        assert dev.read_num_evictions() == ref.num_evictions
        assert sorted(dev.request_ids()) == sorted(ref.request_ids())
        for rid in ref.request_ids():
            assert dev.get_block_ids(rid) == ref.get_block_ids(rid), rid
            assert dev.num_computed_tokens(rid) == ref.num_computed_tokens(rid), rid
            assert dev.block_hashes(rid) == ref.block_hashes(rid), rid
            # (the adapter's record of a request, in one call: the four calls it stands for)
            row = ref.row_of(rid)
            assert dev.request_counts(rid) == ref.request_counts(rid) == (
                row, ref.num_blocks_held(rid), ref.num_computed_tokens(rid),
                int(ref.row_token_counts([row])[0][0])), rid
            # (a window's released blocks and a hit's blocks before its window: the null block leads)
            nulls = tuple(next((i for i, b in enumerate(g) if b != 0), len(g)) for g in ref.get_block_ids(rid))
            assert dev.num_null_blocks(rid) == ref.num_null_blocks(rid) == nulls, rid
        # Both hand out the same rows (gpukv.device.rows); check_invariants finds leaks.
        assert {r: dev.row_of(r) for r in ref.request_ids()} == {r: ref.row_of(r) for r in ref.request_ids()}


# ---------------------------------------------------------------- the tests
def machine(backend: str, layout: str):
    return type(f"ServingLoop_{backend}_{layout}", (ServingLoop,), {"BACKEND": backend, "LAYOUT": layout})


def rules_run(counts) -> int:
    return sum(v for k, v in counts.items() if k.startswith("rule_"))


def run(backend: str, layout: str) -> None:
    """One layout family on one backend: the CI sizes, or (long runs) batches
    of examples until ``GPUKV_FUZZ_STEPS / len(LAYOUTS)`` rules have run (an
    example can end before its last step when hypothesis' buffer fills, so the
    example count alone does not fix the number of steps)."""
    if BACKEND is None:
        examples, steps = CI_SIZES[backend]
        target = None
        profile = "gpukv-fuzz-ci"
    else:
        steps = LONG_STEPS_PER_EXAMPLE[backend]
        target = math.ceil((FUZZ_STEPS or 1000) / len(LAYOUTS))
        profile = "gpukv-fuzz-long"
    before = Counter(COUNTS)
    start = time.perf_counter()
    failure = None
    batches = 0
    try:
        while True:
            if target is not None:
                remaining = target - rules_run(COUNTS - before)
                if remaining <= 0:
                    break
                examples = max(1, math.ceil(remaining / steps))
            conf = settings(settings.get_profile(profile), max_examples=examples, stateful_step_count=steps)
            run_state_machine_as_test(machine(backend, layout), settings=conf)
            batches += 1
            if target is None:
                break
    except BaseException as exc:
        failure = exc
        raise
    finally:
        counts = dict(COUNTS - before)
        counts["rules"] = rules_run(counts)
        summary = {"backend": backend, "layout": layout, "profile": profile, "target_rules": target,
                   "batches": batches, "steps_per_example": steps, "wall_s": round(time.perf_counter() - start, 1),
                   "failed": failure is not None, **counts}
        print("\nfuzz summary:", json.dumps(summary, sort_keys=True))
        path = os.environ.get("GPUKV_FUZZ_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(summary, sort_keys=True) + "\n")
    if BACKEND is None and backend == "reference" and CHECK_DIGESTS and ADVERSARIAL:
        # The CI run exercised what it is for.
        for what in ("hit_blocks", "preemptions", "evictions", "running_refused", "new_refused", "resets",
                     "admitted_with_caller_digests", "decode_calls", "decode_refused", "decode_chunked",
                     "decode_lookahead", "decode_torch", "decode_none", "allocate_new_admitted", "allocate_new_refused",
                     "allocate_new_partial", "admit_sized", "allocate_running_calls", "allocate_running_refused",
                     "events_checked", "events_stored", "events_removed", "events_cleared"):
            assert counts.get(what, 0) > 0, (what, counts)


@pytest.mark.skipif(BACKEND == "device", reason="GPUKV_FUZZ_BACKEND=device: the device run only")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fuzz_reference_alone(layout):
    """The reference in a serving loop: its invariants, the model and the ground truth."""
    run("reference", layout)


@pytest.mark.skipif(BACKEND == "reference", reason="GPUKV_FUZZ_BACKEND=reference: the reference run only")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fuzz_device_against_reference(layout):
    """The device manager and the reference in lockstep: the same everything after every call."""
    run("device", layout)
