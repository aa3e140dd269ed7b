"""A small serving loop on gpukv: a paged KV cache that a real attention layer
writes through the slot mapping and reads through the block tables, checked
against a dense computation at every step.

What it does, step by step (vLLM v1's scheduler, reduced):

1. Size the cache: one attention layer described by a ``FullAttentionSpec``
   and a memory budget go through ``gpukv.get_kv_cache_config``; the
   config's one tensor (``page_size * num_blocks`` bytes) is viewed as
   ``[2, num_blocks, block_size, num_kv_heads, head_size]``: K and V caches of
   ``[num_blocks, block_size, num_kv_heads, head_size]`` each (vLLM's
   FlashAttention layout). The cache starts as NaN, so reading a slot nobody
   wrote poisons the output and fails the check.
2. Requests share a few prefixes ("system prompts"), arrive a few per step,
   and decode greedily for a few tokens each. Each step is one
   ``manager.step(finished, running, new)``: finished requests are freed,
   running ones append the token they sampled last step, waiting ones are
   admitted while they fit (prefix-cache hits skip their cached tokens). When
   a running request's next block does not fit, the newest running request is
   preempted (freed, put back at the head of the queue with every token it
   has, prompt and generated) and the step is retried without it and without
   new requests; its re-admission may hit its own cached blocks.
3. The slot mapping of the step's scheduled tokens (every uncomputed token of
   each scheduled request, request after request, padded to a multiple of
   ``--pad-to`` with ``PAD``) comes from ``gpukv.slot_mapping``, from
   the block tables of the batch, the cumulative token offsets and each
   request's start position. The layer computes Q/K/V of the scheduled tokens
   only and writes K/V into the paged cache through the slot mapping (padding
   dropped); then, per request, gathers its K/V through its block table and
   computes causal attention for its scheduled tokens.
4. The check: recompute the request's K/V densely from its full token list and
   compare the attention outputs (``torch.allclose``, float32, ``rtol=1e-4,
   atol=1e-5``, which assumes PyTorch's default "highest" float32 matmul
   precision: no TF32); the sampled token comes from the paged output. At the
   end every block must be free again.

The layer: a token's input is ``E[token] + P[position] + C[context]``, random
tables, where ``context`` is a hash of the whole prefix up to and including
the token (standing in for the layers below, which make a real token's K/V
depend on everything before it). So a cached block's K/V equals what
recomputation gives exactly when the block is a true prefix hit: a hit on a
block with the same tokens after a different prefix would fail the check.

Run: ``python examples/serving_loop.py --small`` (CPU, a few seconds; the
device manager's kernels run under Triton's interpreter), ``--backend
reference`` for the sequential reference manager (block tables from
``get_block_ids``), no ``--small`` on a GPU for a larger run. ``--json PATH``
writes the summary. Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence

try:
    import gpukv  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# (gpukv's names that import torch switch on Triton's interpreter on a machine without CUDA, before triton loads)
from gpukv import (  # noqa: E402
    DeviceManager,
    FullAttentionSpec,
    NewRequest,
    ReferenceManager,
    RunningUpdate,
    get_kv_cache_config,
    slot_mapping,
)

#: float32 everywhere; paged and dense differ only by matmul shapes and
#: reduction order, so this is tight.
RTOL, ATOL = 1e-4, 1e-5
_HASH_KEY = bytes(range(16))  # a fixed key: runs are reproducible
_P31 = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model, cache and workload sizes (``SMALL`` or ``LARGE``)."""

    block_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden: int
    vocab: int
    kv_cache_blocks: int  # the memory budget, in pages of this layer
    max_model_len: int
    num_requests: int
    num_prefixes: int
    prefix_len: int
    suffix_len: tuple[int, int]  # inclusive range
    max_new: tuple[int, int]  # inclusive range of generated tokens
    arrivals_per_step: int
    max_running: int


SMALL = Sizes(block_size=4, num_heads=4, num_kv_heads=2, head_size=16, hidden=64, vocab=512,
              kv_cache_blocks=12, max_model_len=32, num_requests=6, num_prefixes=2, prefix_len=8,
              suffix_len=(1, 4), max_new=(4, 6), arrivals_per_step=4, max_running=6)
LARGE = Sizes(block_size=16, num_heads=16, num_kv_heads=4, head_size=64, hidden=512, vocab=32000,
              kv_cache_blocks=400, max_model_len=1024, num_requests=96, num_prefixes=6, prefix_len=200,
              suffix_len=(20, 300), max_new=(16, 96), arrivals_per_step=8, max_running=32)


@dataclasses.dataclass
class Summary:
    backend: str
    device: str
    num_blocks: int
    block_size: int
    steps: int = 0  # scheduling steps
    step_calls: int = 0  # manager.step calls (a preemption retries the step)
    admissions: int = 0  # new requests admitted, re-admissions included
    hit_admissions: int = 0  # admissions with a prefix-cache hit
    prefix_hit_tokens: int = 0  # tokens served from the cache
    readmission_hit_tokens: int = 0  # of which, by re-admissions after preemption
    computed_tokens: int = 0  # tokens whose K/V were written this run
    padding_tokens: int = 0  # PAD slots in the slot mappings
    evictions: int = 0
    preemptions: int = 0
    generated_tokens: int = 0
    checked_tokens: int = 0  # attention outputs compared with the dense computation
    max_abs_error: float = 0.0
    seconds: float = 0.0


class DenseMismatch(AssertionError):
    """The paged attention output differs from the dense computation."""


@dataclasses.dataclass
class _Req:
    rid: str
    prompt: list[int]
    max_new: int
    arrival: int
    tokens: list[int] = dataclasses.field(default_factory=list)  # what the manager holds (all computed)
    pending: int | None = None  # sampled last step, not yet appended
    generated: int = 0
    preempted: bool = False  # waiting again after a preemption


class Layer:
    """One attention layer with random weights (GQA: ``num_heads`` query
    heads share ``num_kv_heads`` K/V heads)."""

    CONTEXT_TABLE = 4096

    def __init__(self, s: Sizes, device: torch.device, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device)

        self.s = s
        self.device = device
        self.emb = rnd(s.vocab, s.hidden)
        self.pos = rnd(s.max_model_len, s.hidden)
        self.ctx = rnd(self.CONTEXT_TABLE, s.hidden)
        inv = 1.0 / math.sqrt(s.hidden)
        self.wq = rnd(s.hidden, s.num_heads * s.head_size, scale=inv)
        self.wk = rnd(s.hidden, s.num_kv_heads * s.head_size, scale=inv)
        self.wv = rnd(s.hidden, s.num_kv_heads * s.head_size, scale=inv)
        self.wout = rnd(s.num_heads * s.head_size, s.vocab, scale=1.0 / math.sqrt(s.num_heads * s.head_size))

    @staticmethod
    def context_ids(tokens: torch.Tensor) -> torch.Tensor:
        """Per token, a hash of (token, position) pairs of the prefix up to
        and including it, reduced to the context table (int64 arithmetic, no
        overflow: exact on every device)."""
        pos = torch.arange(tokens.numel(), dtype=torch.int64, device=tokens.device)
        a = ((tokens % _P31) * 2654435761 + (pos + 1) * 40503) % _P31
        s = torch.cumsum(a, 0)
        return (s % _P31) * 48271 % _P31 % Layer.CONTEXT_TABLE

    def qkv(self, tokens: torch.Tensor, positions: torch.Tensor, contexts: torch.Tensor):
        """Q [n, H, D], K and V [n, Hkv, D] of tokens at positions."""
        s = self.s
        x = self.emb[tokens] + self.pos[positions] + self.ctx[contexts]
        q = (x @ self.wq).view(-1, s.num_heads, s.head_size)
        k = (x @ self.wk).view(-1, s.num_kv_heads, s.head_size)
        v = (x @ self.wv).view(-1, s.num_kv_heads, s.head_size)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
        """Causal attention of queries at positions ``first_pos..`` over keys
        at positions ``0..len(k)-1``: [n, H, D]."""
        s = self.s
        rep = s.num_heads // s.num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q, k) / math.sqrt(s.head_size)
        qpos = torch.arange(first_pos, first_pos + q.shape[0], device=q.device)
        kpos = torch.arange(k.shape[0], device=q.device)
        scores = scores.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)

    def sample(self, out_last: torch.Tensor) -> torch.Tensor:
        """Greedy next tokens from the attention outputs of requests' last tokens [B, H, D]."""
        return (out_last.reshape(out_last.shape[0], -1) @ self.wout).argmax(dim=-1)


def _workload(s: Sizes, seed: int) -> list[_Req]:
    g = torch.Generator().manual_seed(seed + 1)

    def ints(lo, hi, n=1):  # inclusive range
        return torch.randint(lo, hi + 1, (n,), generator=g).tolist()

    prefixes = [ints(0, s.vocab - 1, s.prefix_len) for _ in range(s.num_prefixes)]
    reqs = []
    for i in range(s.num_requests):
        suffix = ints(0, s.vocab - 1, ints(*s.suffix_len)[0])
        prompt = prefixes[i % s.num_prefixes] + suffix
        max_new = min(ints(*s.max_new)[0], s.max_model_len - len(prompt))
        reqs.append(_Req(f"req{i}", prompt, max_new, arrival=i // s.arrivals_per_step))
    return reqs


def _default_device() -> torch.device:
    """CUDA if present; else the CPU, where the device manager's kernels run under Triton's interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _make_manager(backend: str, config, s: Sizes, device: torch.device):
    if backend == "reference":
        return ReferenceManager(config.num_blocks, s.block_size, hash_key=_HASH_KEY)
    return DeviceManager(config.num_blocks, s.block_size, hash_key=_HASH_KEY, max_model_len=s.max_model_len,
                         max_num_reqs=2 * s.max_running, device=device)


def _block_tables(mgr, backend: str, rids: list[str], max_blocks: int, device: torch.device) -> torch.Tensor:
    """int32[B, M] block tables of group 0 for the batch."""
    if backend == "device":
        return mgr.block_table_for(rids)[0]
    bt = torch.zeros((len(rids), max_blocks), dtype=torch.int32)
    for b, rid in enumerate(rids):
        ids = mgr.get_block_ids(rid)[0]
        bt[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return bt.to(device)


def _append_pending(r: _Req, scheduled: list) -> None:
    """A running update went through: its sampled token is appended (and is
    computed this step, at position ``len(r.tokens)`` before the append)."""
    scheduled.append((r, len(r.tokens)))
    r.tokens.append(r.pending)
    r.pending = None


def run(sizes: Sizes, *, backend: str = "device", device: str | None = None, seed: int = 0,
        pad_to: int = 8, log=None) -> Summary:
    """Run the loop; raise ``DenseMismatch`` at the first output that differs."""
    t0 = time.perf_counter()
    s = sizes
    dev = torch.device(device) if device is not None else _default_device()
    dtype = torch.float32
    spec = {"layer.0": FullAttentionSpec(s.block_size, s.num_kv_heads, s.head_size, dtype)}
    page = spec["layer.0"].page_size_bytes
    config = get_kv_cache_config(spec, available_memory=s.kv_cache_blocks * page, max_model_len=s.max_model_len)
    N = config.num_blocks
    (tensor,) = config.tensors
    raw = torch.empty(tensor.size, dtype=torch.uint8, device=dev)
    kv = raw.view(dtype).view(2, N, s.block_size, s.num_kv_heads, s.head_size)
    kv.fill_(float("nan"))
    k_cache, v_cache = kv[0], kv[1]
    k_slots = k_cache.view(N * s.block_size, s.num_kv_heads, s.head_size)
    v_slots = v_cache.view(N * s.block_size, s.num_kv_heads, s.head_size)
    max_blocks = -(-s.max_model_len // s.block_size)

    layer = Layer(s, dev, seed)
    mgr = _make_manager(backend, config, s, dev)
    summary = Summary(backend=backend, device=str(dev), num_blocks=N, block_size=s.block_size)
    reqs = _workload(s, seed)
    waiting: list[_Req] = []
    running: list[_Req] = []
    done_last_step: list[_Req] = []
    arrivals = list(reqs)
    step = 0
    while arrivals or waiting or running or done_last_step:
        if step > 20 * len(reqs) + 100:
            raise RuntimeError("the loop is not making progress")
        while arrivals and arrivals[0].arrival <= step:
            waiting.append(arrivals.pop(0))
        finished = [r.rid for r in done_last_step]
        done_last_step = []
        updates = [RunningUpdate(r.rid, [r.pending]) for r in running]
        by_id = {r.rid: r for r in running}
        cands = waiting[: max(0, s.max_running - len(running))]
        new = [NewRequest(r.rid, r.tokens + ([r.pending] if r.pending is not None else []) if r.preempted
                          else r.prompt) for r in cands]
        # (request, first scheduled position) for every request computing this step
        scheduled: list[tuple[_Req, int]] = []
        while True:
            res = mgr.step(finished, updates, new)
            summary.step_calls += 1
            finished = []
            if res.ok:
                break
            k = res.running_failed_at
            for u in updates[:k]:  # these got their blocks before the failure
                _append_pending(by_id[u.request_id], scheduled)
            victim = running.pop()  # the newest running request: lowest priority
            assert updates[-1].request_id == victim.rid
            finished = [victim.rid]
            victim.preempted = True
            waiting.insert(0, victim)
            summary.preemptions += 1
            if log:
                log(f"step {step}: preempted {victim.rid} ({len(victim.tokens)} tokens computed)")
            updates = updates[k:-1]
            new = []  # as vLLM: no admissions in a step that preempted
        for u in updates:
            _append_pending(by_id[u.request_id], scheduled)
        for r, hit in zip(cands[: res.num_admitted] if new else [], res.num_computed_tokens, strict=True):
            waiting.remove(r)
            if r.preempted:
                r.tokens = r.tokens + ([r.pending] if r.pending is not None else [])
                r.pending = None
                summary.readmission_hit_tokens += hit
                r.preempted = False
            else:
                r.tokens = list(r.prompt)
            running.append(r)
            scheduled.append((r, hit))
            summary.admissions += 1
            summary.hit_admissions += hit > 0
            summary.prefix_hit_tokens += hit
        step += 1
        summary.steps = step
        if not scheduled:
            continue
        _compute_step(layer, mgr, backend, scheduled, k_slots, v_slots, k_cache, v_cache, max_blocks, pad_to,
                      summary, dev)
        for r, _ in scheduled:
            if r.generated >= r.max_new:
                running.remove(r)
                done_last_step.append(r)
    summary.evictions = mgr.read_num_evictions()
    assert mgr.read_num_free_blocks() == mgr.num_blocks - 1, "blocks still held after every request finished"
    summary.seconds = time.perf_counter() - t0
    return summary


def _compute_step(layer: Layer, mgr, backend, scheduled, k_slots, v_slots, k_cache, v_cache, max_blocks, pad_to,
                  summary: Summary, dev) -> None:
    """Slot mapping, K/V writes, paged attention, dense check and sampling
    for one step's scheduled requests."""
    bs = k_cache.shape[1]
    rids = [r.rid for r, _ in scheduled]
    starts = [start for _, start in scheduled]
    lens = [len(r.tokens) - start for r, start in scheduled]
    for (r, start), n in zip(scheduled, lens, strict=True):
        assert n >= 1 and mgr.num_computed_tokens(r.rid) == len(r.tokens), (r.rid, start, n)
    qsl_host = [0]
    for n in lens:
        qsl_host.append(qsl_host[-1] + n)
    total = qsl_host[-1]
    padded = -(-total // pad_to) * pad_to
    bt = _block_tables(mgr, backend, rids, max_blocks, dev)
    qsl = torch.tensor(qsl_host, dtype=torch.int32, device=dev)
    start_t = torch.tensor(starts, dtype=torch.int32, device=dev)
    slots, positions = slot_mapping(bt, qsl, start_t, block_size=bs, num_tokens=padded, with_positions=True)

    # Inputs of the scheduled tokens (padding: token 0 at position 0, dropped below).
    tok = torch.zeros(padded, dtype=torch.int64, device=dev)
    ctx = torch.zeros(padded, dtype=torch.int64, device=dev)
    for (r, start), a, b in zip(scheduled, qsl_host, qsl_host[1:], strict=False):  # query start offsets: one more
        full = torch.tensor(r.tokens, dtype=torch.int64, device=dev)
        tok[a:b] = full[start:]
        ctx[a:b] = Layer.context_ids(full)[start:]
    q, k, v = layer.qkv(tok, positions, ctx)
    keep = slots >= 0  # PAD slots are not written (what reshape_and_cache does)
    k_slots[slots[keep]] = k[keep]
    v_slots[slots[keep]] = v[keep]
    summary.computed_tokens += total
    summary.padding_tokens += padded - total

    lasts = []
    for b, ((r, start), a, e) in enumerate(zip(scheduled, qsl_host, qsl_host[1:], strict=False)):
        L = len(r.tokens)
        nb = -(-L // bs)
        blocks = bt[b, :nb].long()
        kp = k_cache[blocks].reshape(nb * bs, *k_cache.shape[2:])[:L]
        vp = v_cache[blocks].reshape(nb * bs, *v_cache.shape[2:])[:L]
        out = layer.attend(q[a:e], kp, vp, start)
        # Dense: every token of the request from scratch.
        full = torch.tensor(r.tokens, dtype=torch.int64, device=dev)
        qd, kd, vd = layer.qkv(full, torch.arange(L, device=dev), Layer.context_ids(full))
        ref = layer.attend(qd[start:], kd, vd, start)
        err = float((out - ref).abs().max())
        summary.max_abs_error = max(summary.max_abs_error, err)
        summary.checked_tokens += e - a
        if not torch.allclose(out, ref, rtol=RTOL, atol=ATOL):
            raise DenseMismatch(f"request {r.rid}: paged attention of positions {start}..{L - 1} differs from the "
                                f"dense computation by up to {err:.3g} (blocks {bt[b, :nb].tolist()})")
        lasts.append(out[-1])
    nxt = layer.sample(torch.stack(lasts)).tolist()
    for (r, _), t in zip(scheduled, nxt, strict=True):
        r.pending = int(t)
        r.generated += 1
        summary.generated_tokens += 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--small", action="store_true",
                   help="the small size (CPU, seconds); neither --small nor --large: small without CUDA, large with it")
    p.add_argument("--large", action="store_true", help="the large size (meant for a GPU)")
    p.add_argument("--backend", choices=("device", "reference"), default="device",
                   help="gpukv.device (block tables on the device) or gpukv.reference (from get_block_ids)")
    p.add_argument("--device", default=None,
                   help="torch device of the cache, the model and the device manager; none: cuda if present, else cpu")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the workload")
    p.add_argument("--pad-to", type=int, default=8, help="pad each step's token count to a multiple of this")
    p.add_argument("--json", default=None, metavar="PATH", help="write the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no per-preemption lines")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the loop; 0 when every attention output matched the dense one."""
    args = _parser().parse_args(argv)
    if args.small and args.large:
        print("serving_loop: --small and --large exclude each other", file=sys.stderr)
        return 2
    if args.pad_to < 1:
        print("serving_loop: --pad-to must be >= 1", file=sys.stderr)
        return 2
    dev = torch.device(args.device) if args.device else _default_device()
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("serving_loop: --device cpu needs Triton's interpreter on a machine with CUDA: "
              "run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    large = args.large or (not args.small and torch.cuda.is_available())
    sizes = LARGE if large else SMALL
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr))
    try:
        summary = run(sizes, backend=args.backend, device=str(dev), seed=args.seed, pad_to=args.pad_to, log=log)
    except DenseMismatch as e:
        print(f"serving_loop: FAILED: {e}", file=sys.stderr)
        return 1
    print(f"serving loop ({'large' if large else 'small'}, {summary.backend} manager, {summary.device}): "
          f"{summary.steps} steps ({summary.step_calls} step calls), {summary.num_blocks} blocks of "
          f"{summary.block_size} tokens")
    print(f"  admissions {summary.admissions} ({summary.hit_admissions} with a prefix hit, "
          f"{summary.prefix_hit_tokens} tokens from the cache, {summary.readmission_hit_tokens} of them by "
          f"re-admissions), evictions {summary.evictions}, preemptions {summary.preemptions}")
    print(f"  K/V written for {summary.computed_tokens} tokens (+{summary.padding_tokens} padding slots), "
          f"{summary.generated_tokens} tokens generated, {summary.checked_tokens} outputs checked against dense: "
          f"max abs error {summary.max_abs_error:.2e} (rtol {RTOL}, atol {ATOL}), {summary.seconds:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dataclasses.asdict(summary), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
