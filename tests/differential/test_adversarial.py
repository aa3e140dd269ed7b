"""No false hit, whatever callers hand in.

An adversarial caller mixes honest requests with forged ones (digests computed
with the manager's key for other tokens or extra keys, digests copied from
live requests, random bytes), shared prefixes, LoRA ids, salts and multimodal
items, in sequential and batched steps. The test keeps its own ground truth:
for every block id, what it was computed from when it was last allocated (the
token prefix through the block, the LoRA id, the salt, the multimodal items
that start before the block's end, and the KV-cache group). Every hit a
manager hands out (``num_computed_tokens`` and the block ids the request got
at the hit positions) must be a block computed from exactly the request's own
prefix and extras; a window group may hold the null block only before the
last ``ceil((window - 1) / block_size)`` hit positions.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpukv.core import hashing
from gpukv.core.hashing import MMItem
from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.reference.manager import ReferenceManager

KEY = bytes(range(16))


def make(kind, num_blocks, block_size, windows, max_model_len=32):
    if kind == "ref":
        return ReferenceManager(num_blocks, block_size, sliding_windows=windows, hash_key=KEY,
                                max_model_len=max_model_len)
    return DeviceManager(num_blocks, block_size, sliding_windows=windows, hash_key=KEY,
                         max_model_len=max_model_len, max_num_reqs=4)


def step(m, **kw):
    """A step whose block_hashes DeprecationWarnings are expected."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return m.step(**kw)


# ------------------------------------------------------------- ground truth

@dataclass
class Rec:
    """What the test knows a request's KV was computed from."""

    tokens: list[int]
    lora: int | None
    salt: str | None
    mm: tuple
    blocks: list[list[int]] = field(default_factory=list)


class Truth:
    def __init__(self, block_size: int, windows) -> None:
        self.bs = block_size
        self.windows = list(windows)
        self.owner: dict[int, tuple[Rec, int, int]] = {}  # block -> (request, position, group)
        self.live: dict[str, Rec] = {}  # the requests the manager holds
        self.checked_hits = 0

    def sig(self, rec: Rec, p: int, g: int):
        end = (p + 1) * self.bs
        if len(rec.tokens) < end:
            return ("partial block", id(rec), p, g)  # never equal to a full block's signature
        return (g, tuple(rec.tokens[:end]), rec.lora, rec.salt or None,
                tuple(sorted((m.offset, m.length, m.hash) for m in rec.mm if m.offset < end)))

    def computed(self, rec: Rec, g: int, first: int, blocks: list[int]) -> None:
        for p in range(first, len(blocks)):
            if blocks[p]:
                self.owner[blocks[p]] = (rec, p, g)

    def check_hit(self, rec: Rec, hit_tokens: int, blocks: list[list[int]]) -> None:
        assert hit_tokens % self.bs == 0
        hit = hit_tokens // self.bs
        assert hit <= (len(rec.tokens) - 1) // self.bs, "a hit covering the last token"
        for g, w in enumerate(self.windows):
            run = 0 if w is None else -(-(w - 1) // self.bs)
            for p in range(hit):
                b = blocks[g][p]
                if b == 0:
                    assert w is not None and p < hit - run, f"null block at hit position {p} of group {g}"
                    continue
                assert b in self.owner, f"hit on block {b}, which was never computed"
                o_rec, o_p, o_g = self.owner[b]
                assert self.sig(o_rec, o_p, o_g) == self.sig(rec, p, g), (
                    f"false hit: block {b} (group {g}, position {p}) was computed from another prefix/extra")
                self.checked_hits += 1


def play(m, truth: Truth, steps) -> None:
    """Run ``steps`` ([(finish ids, running updates, new requests, batched?)])
    on ``m``, checking every hit against the truth."""
    live = truth.live
    for finish, updates, new, batched in steps:
        finish = [r for r in finish if r in live]
        updates = [u for u in updates if u.request_id in live and u.request_id not in finish
                   and len(live[u.request_id].tokens) + len(u.new_token_ids) <= 24]
        before = {u.request_id: [len(g) for g in m.get_block_ids(u.request_id)] for u in updates}
        batches = [new] if batched else [[r] for r in new] or [[]]
        for k, batch in enumerate(batches):
            res = step(m, finished=finish if k == 0 else [], running=updates if k == 0 else [], new=batch)
            if k == 0:
                for rid in finish:
                    del live[rid]
                done = updates if res.ok else updates[: res.running_failed_at]
                for u in done:
                    rec = live[u.request_id]
                    rec.tokens.extend(u.new_token_ids)
                    blocks = m.get_block_ids(u.request_id)
                    for g in range(len(truth.windows)):
                        truth.computed(rec, g, before[u.request_id][g], blocks[g])
                if not res.ok:  # preempt the update that did not fit, as a serving loop would
                    victim = updates[res.running_failed_at].request_id
                    step(m, finished=[victim])
                    del live[victim]
                    break
            for i, r in enumerate(batch[: res.num_admitted]):
                rec = Rec(list(r.token_ids), r.lora_id, r.cache_salt, tuple(r.mm_items))
                blocks = m.get_block_ids(r.request_id)
                truth.check_hit(rec, res.num_computed_tokens[i], blocks)
                hit = res.num_computed_tokens[i] // truth.bs
                for g in range(len(truth.windows)):
                    truth.computed(rec, g, hit, blocks[g])
                live[r.request_id] = rec
    m.check_invariants()


# --------------------------------------------------------- the adversary

BASES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 1, 2, 3, 4]]
MM_CHOICES = [(), (), (), (MMItem(0, 2, "img-A"),), (MMItem(0, 2, "img-B"),), (MMItem(1, 3, "img-A"),)]


@st.composite
def request_specs(draw, counter, max_len: int):
    base = draw(st.sampled_from(BASES))
    cut = draw(st.integers(0, min(len(base), max_len - 1)))
    tail = draw(st.lists(st.integers(0, 9), min_size=0 if cut else 1, max_size=max_len - cut))
    tokens = base[:cut] + tail
    mm = draw(st.sampled_from(MM_CHOICES))
    mm = tuple(x for x in mm if x.offset + x.length <= len(tokens))
    spec = dict(tokens=tokens, lora=draw(st.sampled_from([None, None, None, 1, 2])),
                salt=draw(st.sampled_from([None, None, None, "", "s1", "s2"])), mm=mm,
                forge=draw(st.sampled_from(["honest", "none", "other-chain", "other-extras", "random", "copy"])),
                other=draw(st.sampled_from(BASES)), random=draw(st.binary(min_size=16, max_size=16)))
    counter[0] += 1
    return f"r{counter[0]}", spec


def forged_hashes(spec, block_size: int, live_digests: list[list[bytes]]):
    """The block_hashes the adversary hands in (right length, wrong content)."""
    n_full = len(spec["tokens"]) // block_size
    mode = spec["forge"]
    if mode == "none":
        return None

    def chain(tokens, lora, salt, mm):
        extras = hashing.extra_key_digests(KEY, len(tokens) // block_size, block_size, lora_id=lora, mm_items=mm,
                                           cache_salt=salt)
        return hashing.hash_block_chain(KEY, tokens, block_size, extras=extras)

    if mode == "honest":
        return chain(spec["tokens"], spec["lora"], spec["salt"], spec["mm"])
    if mode == "other-chain":  # another prompt's digests: the cache-poisoning attack
        other = (spec["other"] * 4)[: len(spec["tokens"])]
        return chain(other, spec["lora"], spec["salt"], ())
    if mode == "other-extras":  # the same tokens under another tenant's LoRA and salt
        return chain(spec["tokens"], 1 if spec["lora"] != 1 else 2, "s1" if spec["salt"] != "s1" else "s2", ())
    if mode == "random":
        return [spec["random"]] * n_full
    source = next((d for d in live_digests if len(d) >= n_full), None)  # copied from a live request
    return list(source[:n_full]) if source is not None else [spec["random"]] * n_full


def adversarial_step(draw, m, block_size: int, max_len: int, counter: list, names: list):
    """One step of the adversary: 1-3 new requests (honest or forged),
    finishes and running updates of ids it used before."""
    new = []
    for _ in range(draw(st.integers(1, 3))):
        rid, spec = draw(request_specs(counter, max_len))
        live = []
        for prev in names[-3:]:
            if prev in m.request_ids():
                live.append(m.block_hashes(prev))
        new.append(NewRequest(rid, spec["tokens"], lora_id=spec["lora"], mm_items=spec["mm"],
                              cache_salt=spec["salt"], block_hashes=forged_hashes(spec, block_size, live)))
    finish = draw(st.lists(st.sampled_from(names), max_size=2, unique=True)) if names else []
    running = draw(st.lists(st.sampled_from(names), max_size=2, unique=True)) if names else []
    updates = [RunningUpdate(rid, draw(st.lists(st.integers(0, 9), min_size=1, max_size=2))) for rid in running]
    names += [r.request_id for r in new]
    return finish, updates, new, draw(st.booleans())


def run_adversary(kind, data, num_blocks, block_size, windows, num_steps, max_len):
    m = make(kind, num_blocks, block_size, windows)
    truth = Truth(block_size, windows)
    counter, names = [0], []
    # Steps are drawn one at a time so a forged request can copy the digests
    # of requests that are live at that point.
    for _ in range(num_steps):
        play(m, truth, [adversarial_step(data.draw, m, block_size, max_len, counter, names)])
    return truth


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), block_size=st.sampled_from([1, 2, 3]),
       windows=st.sampled_from([[None], [3], [None, 3], [None, 4], [5]]))
def test_no_false_hit_on_the_reference(data, block_size, windows):
    run_adversary("ref", data, 20 * len(windows), block_size, windows, num_steps=6, max_len=10)


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), windows=st.sampled_from([[None], [3]]))
def test_no_false_hit_on_the_device(data, windows):
    run_adversary("dev", data, 12, 2, windows, num_steps=4, max_len=8)


@pytest.mark.parametrize("kind", ["ref", "dev"])
def test_forged_requests_of_every_kind_on_a_fixed_script(kind):
    """One deterministic run through every forging mode, so the device part
    never depends on what hypothesis happened to draw; honest repeats must
    still hit (the truth counts the hit blocks it checked)."""
    bs, windows = 2, [None]
    m = make(kind, 16, bs, windows)
    truth = Truth(bs, windows)
    honest = NewRequest("h", [1, 2, 5, 6, 5])
    forged_chain = hashing.hash_block_chain(KEY, [1, 2, 3, 4, 5], bs)  # a chain h shares one block of
    steps = [
        ([], [], [honest], True),
        # Another prompt claiming the chain (the issue's attack); an honest
        # prompt claiming it under a LoRA; a salted request with random bytes.
        ([], [], [NewRequest("x1", [7, 7, 3, 4, 5], block_hashes=forged_chain),
                  NewRequest("x2", [1, 2, 3, 4, 6], lora_id=1, block_hashes=forged_chain),
                  NewRequest("x3", [1, 2, 3, 4, 7], cache_salt="s1", block_hashes=[b"\x01" * 16] * 2)], True),
        (["h"], [RunningUpdate("x1", [8])], [NewRequest("y", [1, 2, 3, 4, 9])], False),
        ([], [], [NewRequest("z", [1, 2, 3, 4, 6, 6], lora_id=1)], True),
    ]
    play(m, truth, steps)
    # y hits h's first block only (x1's [3, 4] was computed after [7, 7]);
    # z hits x2's two blocks (same prompt and LoRA).
    assert truth.checked_hits == 3


# ------------------------------------------------- the issue's examples

@pytest.mark.parametrize("kind", ["ref", "dev"])
def test_the_issues_cache_poisoning_example(kind):
    m = make(kind, 16, 2, [None])
    m.step(new=[NewRequest("honest", [1, 2, 5, 6, 9])])
    assert m.get_block_ids("honest") == [[1, 2, 3]]  # blocks 1 and 2 full and cached
    lie = hashing.hash_block_chain(KEY, [1, 2, 3, 4, 9], 2)
    with pytest.warns(DeprecationWarning, match="block_hashes is deprecated and ignored"):
        res = m.step(new=[NewRequest("liar", [7, 7, 3, 4, 9], block_hashes=lie)])
    # The liar's digests are recomputed from [7, 7] and [3, 4]: no hit, and its
    # blocks 4, 5 are cached under its own chain, not under the victim's.
    assert res.num_computed_tokens == [0]
    assert m.get_block_ids("liar") == [[4, 5, 6]]
    res = m.step(new=[NewRequest("victim", [1, 2, 3, 4, 9])])
    # Before the fix: 4 tokens, block 5 (computed after [7, 7]) at position 1.
    # Now: only [1, 2] (block 1, honest's) hits; [3, 4] and [9] are computed.
    assert res.num_computed_tokens == [2]
    assert m.get_block_ids("victim") == [[1, 7, 8]]
    assert m.block_hashes("liar") == hashing.hash_block_chain(KEY, [7, 7, 3, 4, 9], 2)
    m.check_invariants()


@pytest.mark.parametrize("kind", ["ref", "dev"])
def test_the_issues_window_only_example(kind):
    # Window 3, block size 2: a hit needs only the last ceil(2/2) = 1 block,
    # so a liar that copies honest's digests once got position 1 (computed
    # after [1, 2]) for its own prompt [7, 7, 5, 6, 9]: 4 tokens, [[0, 2, 4]].
    m = make(kind, 16, 2, [3])
    m.step(new=[NewRequest("honest", [1, 2, 5, 6, 9])])
    copied = m.block_hashes("honest")
    with pytest.warns(DeprecationWarning):
        res = m.step(new=[NewRequest("liar", [7, 7, 5, 6, 9], block_hashes=copied)])
    assert res.num_computed_tokens == [0]
    assert m.get_block_ids("liar") == [[4, 5, 6]]
    # An honest request with honest's prefix still hits: position 1 (block 2),
    # the null block before it, one new block.
    res = m.step(new=[NewRequest("again", [1, 2, 5, 6, 7])])
    assert res.num_computed_tokens == [4]
    assert m.get_block_ids("again") == [[0, 2, 7]]
    m.check_invariants()


@pytest.mark.parametrize("kind", ["ref", "dev"])
def test_mm_items_given_as_an_iterator_are_not_dropped(kind):
    m = make(kind, 16, 2, [None])
    m.step(new=[NewRequest("text", [1, 2, 3, 4, 5])])
    # Once, the check consumed the iterator and the image request shared the
    # text request's blocks; now the items are materialised once and hashed.
    res = m.step(new=[NewRequest("image", [1, 2, 3, 4, 5], mm_items=iter([MMItem(0, 2, "img")]))])
    assert res.num_computed_tokens == [0]
    assert m.get_block_ids("image") == [[4, 5, 6]]
    res = m.step(new=[NewRequest("image2", [1, 2, 3, 4, 5], mm_items=(MMItem(0, 2, "img"),))])
    assert res.num_computed_tokens == [4]
    assert m.get_block_ids("image2") == [[4, 5, 7]]
    m.check_invariants()


@pytest.mark.parametrize("kind", ["ref", "dev"])
def test_a_caller_that_changes_its_token_array_afterwards_changes_nothing(kind):
    import numpy as np

    m = make(kind, 16, 2, [None])
    tokens = np.array([1, 2, 3, 4, 5])
    m.step(new=[NewRequest("a", tokens)])
    tokens[:] = 9  # the manager took a copy
    assert m.step(new=[NewRequest("b", [1, 2, 3, 4, 6])]).num_computed_tokens == [4]
    assert m.step(new=[NewRequest("c", [9, 9, 9, 9, 9])]).num_computed_tokens == [0]
    m.check_invariants()
