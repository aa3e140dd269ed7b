"""Lookup kernels: hit verification and sequential admission, by hand."""

import torch

import gpukv._runtime  # noqa: F401
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
    admitted, used, requests, queries, hits, qtok, htok, new_blocks = status
    assert (admitted, used, new_blocks) == (2, 6, 4)
    assert (requests, queries, hits, qtok, htok) == (3, 4 + 3 + 5, 3, 8 + 6 + 9, 6)


def test_pending_hit_on_a_block_an_earlier_request_computes():
    cache = [[[-1], [-1]], [[-1], [-1]]]
    pend = [[-1, -1], [0, 0]]
    hit, status = admit(cache, pend, max_hit=[2, 2], n_blocks=[3, 3], n_tok=[5, 6], skip=[0, 0],
                        ref_cnt=[0] * 4, num_free=10)
    assert hit == [0, 2] and status[0] == 2 and status[7] == 3 + 1


def test_skip_and_blocked():
    cache = [[[1]]]
    hit, status = admit(cache, [[-1]], max_hit=[1], n_blocks=[2], n_tok=[3], skip=[1], ref_cnt=[0, 0], num_free=5)
    assert hit == [0] and status[:5] == [1, 2, 1, 0, 0]
    hit, status = admit(cache, [[-1]], max_hit=[1], n_blocks=[2], n_tok=[3], skip=[0], ref_cnt=[0, 0],
                        num_free=5, blocked=1)
    assert hit == [-1] and status == [0] * lookup.NUM_STATUS
