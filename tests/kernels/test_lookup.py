"""Lookup kernels: hit verification and sequential admission, by hand."""

import pytest
import torch

import gpukv._runtime
from gpukv.core import windows
from gpukv.kernels import lookup

ROOT = (11, 22)


def rows(tokens_list, bs, M=4):
    R = len(tokens_list)
    tokens = torch.zeros(R, M * bs, dtype=torch.int32)
    for r, t in enumerate(tokens_list):
        tokens[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    digests = torch.arange(R * M * 2, dtype=torch.int64).reshape(R, M, 2) + 100
    extras = torch.zeros(R, M, 2, dtype=torch.int64)
    return tokens, digests, extras


def test_verify_from_pool_checks_parent_tokens_and_extra():
    bs = 2
    tokens, digests, extras = rows([[1, 2, 3, 4]], bs)
    blk_tokens = torch.tensor([[0, 0], [1, 2], [3, 4], [3, 5]], dtype=torch.int32)
    blk_parent = torch.tensor([[0, 0], list(ROOT), digests[0, 0].tolist(), digests[0, 0].tolist()], dtype=torch.int64)
    blk_extra = torch.zeros(4, 2, dtype=torch.int64)
    blk_extra[2, 1] = 0  # same extra
    cand = torch.tensor([1, 2, 3, -1, 1], dtype=torch.int32)
    row = torch.zeros(5, dtype=torch.int32)
    pos = torch.tensor([0, 1, 1, 1, 1], dtype=torch.int32)
    out = lookup.verify(cand, row, pos, tokens=tokens, digests=digests, extras=extras, root=ROOT,
                        blk_tokens=blk_tokens, blk_parent=blk_parent, blk_extra=blk_extra, from_pool=True,
                        block_size=bs)
    # block 1 at position 0: root parent, tokens [1, 2]: a hit. Block 2 at 1: a hit.
    # Block 3 has token 5 where the request has 4: a miss. Block 1 at position 1: wrong parent and tokens.
    assert out.tolist() == [1, 2, -1, -1, -1]
    extras[0, 1, 0] = 9  # the request's extra key differs from block 2's
    out = lookup.verify(cand[1:2], row[:1], pos[1:2], tokens=tokens, digests=digests, extras=extras, root=ROOT,
                        blk_tokens=blk_tokens, blk_parent=blk_parent, blk_extra=blk_extra, from_pool=True,
                        block_size=bs)
    assert out.tolist() == [-1]


def test_verify_between_request_rows():
    tokens, digests, extras = rows([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 9, 9]], 2)
    digests[1] = digests[0]
    digests[2] = digests[0]
    cand = torch.tensor([0, 0], dtype=torch.int32)
    out = lookup.verify(cand, torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32),
                        tokens=tokens, digests=digests, extras=extras, root=ROOT, from_pool=False,
                        block_size=2)
    assert out.tolist() == [0, -1]


def admit(cache, pend, max_hit, n_blocks, n_tok, skip, ref_cnt, num_free, blocked=0, bs=2):
    K = len(max_hit)
    hit = torch.full((K,), -1, dtype=torch.int32)
    status = torch.zeros(lookup.NUM_STATUS, dtype=torch.int64)
    touched = torch.full((len(ref_cnt),), -1, dtype=torch.int64)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    lookup.admit(i32(cache), i32(pend), i32(max_hit), i32(n_blocks), i32(n_tok), i32(skip),
                 ref_cnt=i32(ref_cnt), touched=touched, stamp=5, num_free=torch.tensor([num_free]),
                 blocked=i32([blocked]), block_size=bs, hit_out=hit, status=status)
    return hit.tolist(), status.tolist()


def test_admission_first_miss_touches_and_prefix():
    # Request 0: positions 0, 1 hit blocks 3 and 4 (free), position 2 misses.
    # Request 1: hits block 3 (already touched by request 0) then request 0's
    # pending block at position 1. Request 2 does not fit.
    cache = [[[3], [4], [-1]], [[3], [-1], [-1]], [[-1], [-1], [-1]]]
    pend = [[-1, -1, -1], [-1, 0, -1], [-1, -1, -1]]
    hit, status = admit(cache, pend, max_hit=[3, 2, 0], n_blocks=[4, 3, 5], n_tok=[8, 6, 9], skip=[0, 0, 0],
                        ref_cnt=[0, 0, 0, 0, 0], num_free=6)
    # Request 0 hits 2 (max 3, misses at 2): needs 2 new + 2 first touches = 4.
    # Request 1: position 1 is pending from request 0 (hit 2 <= 1? no: request 0
    # hit position 1 itself, so it does not compute it): hit 1, needs 2 new.
    # Request 2: 5 new > 0 left: refused.
    assert hit == [2, 1, 0]
    def st(name: str) -> int:
        return status[getattr(lookup, f"ST_{name}")]

    assert (st("ADMITTED"), st("USED"), st("NEW_BLOCKS")) == (2, 6, 4)
    assert (st("REQUESTS"), st("QUERIES"), st("HITS"), st("QUERY_TOKENS"), st("HIT_TOKENS")) == (
        3, 4 + 3 + 5, 3, 8 + 6 + 9, 6)


def test_pending_hit_on_a_block_an_earlier_request_computes():
    cache = [[[-1], [-1]], [[-1], [-1]]]
    pend = [[-1, -1], [0, 0]]
    hit, status = admit(cache, pend, max_hit=[2, 2], n_blocks=[3, 3], n_tok=[5, 6], skip=[0, 0],
                        ref_cnt=[0] * 4, num_free=10)
    assert hit == [0, 2] and status[lookup.ST_ADMITTED] == 2 and status[lookup.ST_NEW_BLOCKS] == 3 + 1


def test_skip_and_blocked():
    cache = [[[1]]]
    hit, status = admit(cache, [[-1]], max_hit=[1], n_blocks=[2], n_tok=[3], skip=[1], ref_cnt=[0, 0], num_free=5)
    assert hit == [0]
    assert [status[getattr(lookup, f"ST_{n}")] for n in ("ADMITTED", "USED", "REQUESTS", "QUERIES", "HITS")] == [
        1, 2, 1, 0, 0]
    hit, status = admit(cache, [[-1]], max_hit=[1], n_blocks=[2], n_tok=[3], skip=[0], ref_cnt=[0, 0],
                        num_free=5, blocked=1)
    assert hit == [-1] and status == [0] * lookup.NUM_STATUS


# The longest hit one group can serve, by hand: availability per position
# ("1": a verified block there), the group's window in blocks (-1: full
# attention) and the hit. Full attention: the first miss. A window of W
# blocks: the end of the rightmost run of W available blocks, or the leading
# run when no run is that long (it reaches block 0, before which the window
# needs nothing).
GROUP_HIT_CASES = [
    ("full, all there", "111111", -1, 6),
    ("full, first miss", "110110", -1, 2),
    ("full, miss at 0", "011111", -1, 0),
    ("window 2, all there", "111111", 2, 6),
    ("window 2, rightmost run", "110011", 2, 6),
    ("window 2, an earlier run", "110010", 2, 2),
    ("window 2, a run after a miss", "011010", 2, 3),
    ("window 2, only a short leading run", "100000", 2, 1),
    ("window 2, nothing", "000000", 2, 0),
    ("window 1, last block", "101", 1, 3),
    ("window 3, run of 3 in the middle", "0111001", 3, 4),
]


def _cache_for(patterns: list[str]) -> list:
    """One request's cached hits [1, P, G]: a distinct block where available."""
    P = len(patterns[0])
    return [[[p + 1 + 100 * g if patterns[g][p] == "1" else -1 for g in range(len(patterns))] for p in range(P)]]


def _kernel_hits(patterns: list[str], boundary_blocks: list[int], max_hit: int | None = None,
                 skip: int = 0) -> tuple[int, int]:
    """The admission kernel's hit and full-attention hit of one request
    whose groups hold ``patterns`` (at most ``max_hit`` blocks, default all)."""
    cache = torch.tensor(_cache_for(patterns), dtype=torch.int32)
    P = cache.shape[1]
    hit = torch.full((1,), -1, dtype=torch.int32)
    full = torch.full((1,), -7, dtype=torch.int32)
    status = torch.zeros(lookup.NUM_STATUS, dtype=torch.int64)
    N = 100 * len(patterns) + P + 1
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    lookup.admit(cache, i32([[-1] * P]), i32([P if max_hit is None else max_hit]), i32([P + 1]), i32([2 * (P + 1)]),
                 i32([skip]), ref_cnt=torch.ones(N, dtype=torch.int32), touched=torch.full((N,), -1, dtype=torch.int64),
                 stamp=0, num_free=torch.tensor([10 * N]), blocked=i32([0]), block_size=2, hit_out=hit, status=status,
                 window_blocks=i32(boundary_blocks), full_hit_out=full)
    assert status[lookup.ST_ADMITTED] == 1
    return int(hit[0]), int(full[0])


def _kernel_hit(patterns: list[str], boundary_blocks: list[int]) -> int:
    return _kernel_hits(patterns, boundary_blocks)[0]


@pytest.mark.parametrize(("pattern", "window", "want"), [c[1:] for c in GROUP_HIT_CASES],
                         ids=[c[0] for c in GROUP_HIT_CASES])
def test_group_hit_table_on_the_admission_kernel_and_the_reference(pattern, window, want):
    assert _kernel_hit([pattern], [window]) == want
    assert windows.group_hit([c == "1" for c in pattern], window) == want


def test_hybrid_groups_take_the_hit_every_group_serves():
    # full attention misses at 3, so the window group is asked for at most 3:
    # its run [1, 3) serves that.
    assert _kernel_hit(["1110111", "0111111"], [-1, 2]) == 3
    # the window group's only run of 2 is [0, 2); full attention could serve 7
    assert _kernel_hit(["1111111", "1101001"], [-1, 2]) == 2


# (the full-attention group's own hit: its first miss, at most the request's
# bound; the window groups left out; 0 where the request skips the cache)
FULL_HIT_CASES = [
    ("window short of full attention", ["1111111", "1101001"], [-1, 2], None, 0, (2, 7)),
    ("full attention is the bound", ["1110111", "0111111"], [-1, 2], None, 0, (3, 3)),
    ("two full groups: the first miss of either", ["1111011", "1111101", "0011111"], [-1, -1, 2], None, 0, (4, 4)),
    ("within the request's bound", ["1111111", "1101001"], [-1, 2], 5, 0, (2, 5)),
    ("window group first in the config", ["1101001", "1111111"], [2, -1], None, 0, (2, 7)),
    ("skips the cache", ["1111111", "1101001"], [-1, 2], None, 1, (0, 0)),
]


@pytest.mark.parametrize(("patterns", "windows_", "max_hit", "skip", "want"), [c[1:] for c in FULL_HIT_CASES],
                         ids=[c[0] for c in FULL_HIT_CASES])
def test_the_full_attention_hit_is_the_full_groups_own(patterns, windows_, max_hit, skip, want):
    assert _kernel_hits(patterns, windows_, max_hit, skip) == want


# ----------------------------------------------------- the pending walk's cost
def _admit_chains(cache, max_hit, n_tok, skip=None, bs=2, num_free=10_000):
    """``lookup.admit`` with the chains of a step whose K requests share every
    block (one prompt): the chain at each position runs through all K, request
    by request, every entry verifying. Returns hits, resolved, status."""
    cache_t = torch.tensor(cache, dtype=torch.int32)
    K, P, G = cache_t.shape
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    pos = torch.arange(P, dtype=torch.int32)
    head = pos.repeat(K, 1).contiguous()  # request 0's entry 0 * P + p heads every chain
    nxt = torch.arange(K * P, dtype=torch.int32) + P
    nxt[(K - 1) * P:] = -1
    ok = torch.ones(K * P, dtype=torch.int32)
    hit = torch.full((K,), -1, dtype=torch.int32)
    resolved = torch.full((K, P), -7, dtype=torch.int32)
    status = torch.zeros(lookup.NUM_STATUS, dtype=torch.int64)
    N = int(cache_t.max()) + 1
    lookup.admit(cache_t, None, i32(max_hit), i32([-(-n // bs) for n in n_tok]), i32(n_tok),
                 i32(skip or [0] * K), ref_cnt=torch.zeros(N, dtype=torch.int32),
                 touched=torch.full((N,), -1, dtype=torch.int64), stamp=1, num_free=torch.tensor([num_free]),
                 blocked=i32([0]), block_size=bs, hit_out=hit, status=status, chains=(head, nxt, ok),
                 resolved=resolved)
    return hit.tolist(), resolved.tolist(), status.tolist()


def _lanes(x):
    """A value inside an interpreted kernel as numpy (its lanes, or a scalar)."""
    import numpy as np

    return np.asarray(x.handle.data if hasattr(x, "handle") else x)


@pytest.fixture
def pending_walks(monkeypatch):
    """Under the interpreter, every (request, position) the admission asks
    ``_pending`` to walk a chain for: a list of (i, positions)."""
    if not gpukv._runtime.INTERPRETED:
        pytest.skip("counts the walk inside an interpreted kernel")
    calls = []
    real = lookup._pending

    def counting(pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, i, P, p, mask, BS):
        calls.append((int(_lanes(i)), _lanes(p)[_lanes(mask).astype(bool)].tolist()))
        return real(pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, i, P, p, mask, BS)

    monkeypatch.setattr(lookup, "_pending", counting)  # (the interpreter runs kernels in the module's globals)
    return calls


def test_admission_walks_no_chain_where_the_cache_hits(pending_walks):
    # K requests of one prompt: positions < S cached (free blocks 1..S), the
    # rest missing. Request 0 hits S and computes the rest; every later request
    # hits S from the cache and the rest pending from request 0. Every chain is
    # K long, so walking it at the cached positions (as the reference never
    # does) made the admission O(K^2 * S).
    K, P, S, bs = 8, 6, 4, 2
    cache = [[[p + 1 if p < S else -1] for p in range(P)] for _ in range(K)]
    n = P * bs + 1
    hit, resolved, status = _admit_chains(cache, max_hit=[P] * K, n_tok=[n] * K, bs=bs)
    assert hit == [S] + [P] * (K - 1)
    assert resolved[0] == [-1] * P  # (its own hit: all cached)
    assert all(row == [-1] * S + [0] * (P - S) for row in resolved[1:])  # pending hits take request 0's blocks
    new_blocks = (-(-n // bs) - S) + (K - 1) * (-(-n // bs) - P)
    assert status[lookup.ST_ADMITTED] == K and status[lookup.ST_NEW_BLOCKS] == new_blocks
    assert status[lookup.ST_USED] == new_blocks + S  # request 0 touches the S free cached blocks first
    assert status[lookup.ST_TOUCHES] == S  # (the later requests' touches of them are not first ones)
    walked = [(i, p) for i, ps in pending_walks for p in ps]
    assert walked, "the counter saw no walk (the interpreter no longer calls the module's _pending?)"
    assert all(p >= S for _, p in walked), sorted({(i, p) for i, p in walked if p < S})


def test_a_cached_block_is_taken_over_a_pending_one(pending_walks):
    # Request 0 skips the prefix cache, so it computes every block; request 1
    # hits them all in the cache: the reference takes the cached block
    # (``block_at`` looks for a pending hit only where the cache misses), so
    # nothing is pending and no chain is walked for request 1.
    P, bs = 4, 2
    cache = [[[p + 1] for p in range(P)]] * 2
    hit, resolved, _ = _admit_chains(cache, max_hit=[P, P], n_tok=[P * bs + 1] * 2, skip=[1, 0], bs=bs)
    assert hit == [0, P]
    assert resolved[1] == [-1] * P
    assert not [p for i, ps in pending_walks if i == 1 for p in ps]


def test_a_pending_hit_in_one_group_resolves_where_another_group_hits_the_cache():
    # Two groups: the first has every block cached, the second only the first
    # two. Request 0 hits 2 and computes positions 2, 3; request 1 hits the
    # first group's cached blocks and, in the second group, request 0's at
    # 2 and 3: ``resolved`` names request 0 there (``place_hits`` reads it
    # for the group that misses).
    P, bs = 4, 2
    cache = [[[10 + p, 20 + p if p < 2 else -1] for p in range(P)]] * 2
    hit, resolved, status = _admit_chains(cache, max_hit=[P, P], n_tok=[P * bs + 1] * 2, bs=bs)
    assert hit == [2, P]
    assert resolved[1] == [-1, -1, 0, 0]
    assert status[lookup.ST_ADMITTED] == 2


@pytest.mark.parametrize("num_free", [0, 3, 100])
def test_first_touches_are_counted_for_a_request_refused_for_room(num_free):
    """``ST_TOUCHES``: the first touches of every request charged, admitted
    or refused for room (a lookup's unheld blocks, which ``read_prefix_hit``
    reads from it): one request hitting S free cached blocks."""
    P, S, bs = 6, 4, 2
    cache = [[[p + 1 if p < S else -1] for p in range(P)]]
    n = P * bs + 1
    hit, _, status = _admit_chains(cache, max_hit=[P], n_tok=[n], bs=bs, num_free=num_free)
    need = -(-n // bs) - S + S
    assert hit == [S] and status[lookup.ST_ADMITTED] == int(need <= num_free)
    assert status[lookup.ST_TOUCHES] == S and status[lookup.ST_USED] == (need if need <= num_free else 0)
