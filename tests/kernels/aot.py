"""Every Triton kernel of ``gpukv.kernels``, compiled ahead of time for NVIDIA
GPUs, without one.

A support module of the tests (not a test file), outside the package: its
recorded workloads drive ``gpukv.device.manager.DeviceManager``, which stands above
the kernels, and nothing in ``gpukv.kernels`` imports what stands above it.

Triton's interpreter (what runs the kernels on a machine without CUDA) accepts
code the real compiler rejects (a non-constexpr module global read in a
kernel, for one), so the interpreter-run tests alone cannot show that a kernel
builds on a GPU. This module is the one home of the check, used by
``tests/kernels/test_compile.py`` and ``benchmarks/compile_table.py``:

1. ``discover()`` imports every module of the package and finds every
   ``@triton.jit`` function; a kernel is one no other jit function refers to
   and that returns nothing (the helpers they call are compiled as part of
   them).
2. ``record()`` runs short real workloads (``gpukv.device.manager.DeviceManager``,
   one full-attention group and full + sliding window) plus a few direct
   launcher calls for what a manager never launches, and intercepts every
   kernel launch (``Recorder``): it computes the argument specialisation the
   real JIT would (Triton's own binder: dtypes, ints equal to 1 or divisible
   by 16, pointer alignment, constexpr values, ``num_warps``), honouring each
   kernel's ``do_not_specialize``.
3. ``compile_all()`` compiles each distinct signature for each target
   (``TARGETS``: sm_80 and sm_90) with Triton's real compiler in subprocesses
   whose ``TRITON_INTERPRET`` is off and whose ``TRITON_CACHE_DIR`` is a fresh
   temporary folder (a warm cache would hide failures), and reports per
   compile the registers and spills (the bundled ptxas's ``-v`` log: no driver
   needed), Triton's shared memory and the seconds it took.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

TARGETS: tuple[tuple[str, int, int], ...] = (("cuda", 80, 32), ("cuda", 90, 32))

#: Options of a launch that select a different compiled kernel.
_OPTION_KEYS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


# ---------------------------------------------------------------- discovery


def _is_jit(obj) -> bool:
    from triton.runtime.jit import JITFunction
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        InterpretedFunction = JITFunction
    return isinstance(obj, (JITFunction, InterpretedFunction))


def kernel_modules() -> list:
    """Every module of ``gpukv.kernels``, imported."""
    import gpukv.kernels as pkg
    return [importlib.import_module(f"{pkg.__name__}.{info.name}")
            for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name)]


def _short(module_name: str, qualname: str) -> str:
    return f"{module_name.rsplit('.', 1)[-1]}.{qualname}"


def _returns_value(fn) -> bool:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(tree))


def discover() -> tuple[dict, dict, dict]:
    """``(kernels, helpers, unused)``: name (``module.function``) -> jit object.

    A helper is a jit function another jit function names (calls it, or
    passes it as a combine function); it is compiled inside the kernels that
    use it. Of the others, one that returns a value cannot be a kernel: it
    is an unused helper (kept as API, compiled nowhere). Every other jit
    function is a kernel.
    """
    jits: dict[str, Any] = {}
    for mod in kernel_modules():
        for obj in vars(mod).values():
            if _is_jit(obj) and obj.fn.__module__ == mod.__name__:
                jits[_short(mod.__name__, obj.fn.__qualname__)] = obj
    by_id = {id(obj): name for name, obj in jits.items()}
    referenced: set[str] = set()
    for name, obj in jits.items():
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj.fn)))
        glb = obj.fn.__globals__
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Name) and node.id in glb:
                target = glb[node.id]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                mod = glb.get(node.value.id)
                if inspect.ismodule(mod):
                    target = getattr(mod, node.attr, None)
            ref = by_id.get(id(target))
            if ref is not None and ref != name:
                referenced.add(ref)
    kernels, helpers, unused = {}, {}, {}
    for name, obj in jits.items():
        if name in referenced:
            helpers[name] = obj
        elif _returns_value(obj.fn):
            unused[name] = obj
        else:
            kernels[name] = obj
    return kernels, helpers, unused


# ---------------------------------------------------------------- recording


@dataclasses.dataclass(frozen=True)
class Signature:
    """One compiled variant: the kernel, its parameters' specialisation
    (``(type, attr)`` per parameter: ``("constexpr", value)``, ``("*i32", "D")``
    for a 16-byte aligned pointer, ``("i32", None)`` for an unspecialised
    int, ...) and its launch options."""

    kernel: str
    params: tuple
    spec: tuple
    options: tuple

    def describe(self) -> str:
        parts = []
        for name, (ty, attr) in zip(self.params, self.spec, strict=True):
            if ty == "constexpr":
                parts.append(f"{name}={attr}")
            else:
                parts.append(f"{name}:{ty}" + (f"/{attr}" if attr else ""))
        opts = ", ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.kernel}({', '.join(parts)})" + (f" [{opts}]" if opts else "")

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "params": list(self.params), "spec": [list(s) for s in self.spec],
                "options": [list(o) for o in self.options]}


def _plain(v):
    """A constexpr value as a JSON-able Python value."""
    import triton.language as tl
    if isinstance(v, tl.constexpr):
        v = v.value
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    raise TypeError(f"unsupported constexpr value {v!r} ({type(v).__name__})")


class Recorder:
    """Intercepts launches of the given kernels (``with Recorder(kernels) as
    rec:``), running each as usual, and keeps every launch's ``Signature``.

    ``honour_do_not_specialize=False`` records what the signatures would be
    if no parameter were marked ``do_not_specialize`` (to measure what the
    marks save)."""

    def __init__(self, kernels: dict, *, honour_do_not_specialize: bool = True):
        self.kernels = kernels
        self.honour = honour_do_not_specialize
        self.launches: Counter = Counter()  # Signature -> launches
        self.workload = ""  # the label launches are filed under (``record`` sets it)
        self.by_workload: dict[str, set] = defaultdict(set)  # label -> signatures
        self._binders: dict[str, tuple] = {}

    def _binder(self, name: str, obj):
        if name not in self._binders:
            from triton.backends.compiler import GPUTarget
            from triton.compiler.compiler import make_backend
            from triton.runtime.jit import KernelParam, create_function_from_signature
            sig = inspect.signature(obj.fn)
            if hasattr(obj, "do_not_specialize"):  # JITFunction
                dns, dnsoa = obj.do_not_specialize, obj.do_not_specialize_on_alignment
            else:  # InterpretedFunction keeps the decorator's arguments
                dns = obj.kwargs.get("do_not_specialize") or []
                dnsoa = obj.kwargs.get("do_not_specialize_on_alignment") or []
            if not self.honour:
                dns, dnsoa = [], []
            params = [KernelParam(i, p, i in dns or p.name in dns, i in dnsoa or p.name in dnsoa)
                      for i, p in enumerate(sig.parameters.values())]
            backend = make_backend(GPUTarget(*TARGETS[0]))
            self._binders[name] = (tuple(sig.parameters), create_function_from_signature(sig, params, backend))
        return self._binders[name]

    def signature_of(self, name: str, obj, args, kwargs) -> Signature:
        names, binder = self._binder(name, obj)
        kw = {k: v for k, v in kwargs.items() if k in names}
        _, spec, _ = binder(*args, **kw)
        spec = tuple((ty, _plain(attr)) for ty, attr in spec)
        options = tuple(sorted((k, _plain(v)) for k, v in kwargs.items() if k in _OPTION_KEYS))
        return Signature(name, names, spec, options)

    def __enter__(self) -> Recorder:
        for name, obj in self.kernels.items():
            orig = obj.run

            def run(*args, _name=name, _obj=obj, _orig=orig, **kwargs):
                if not kwargs.get("warmup", False):
                    kw = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
                    sig = self.signature_of(_name, _obj, args, kw)
                    self.launches[sig] += 1
                    self.by_workload[self.workload].add(sig)
                return _orig(*args, **kwargs)

            obj.run = run
        return self

    def __exit__(self, *exc) -> None:
        for obj in self.kernels.values():
            obj.__dict__.pop("run", None)

    def signatures(self) -> list[Signature]:
        return sorted(self.launches, key=lambda s: (s.kernel, repr(s.spec), s.options))

    def per_kernel(self, labels: Iterable[str] | None = None) -> dict[str, int]:
        """Distinct signatures per launched kernel (of the workloads with
        these labels; all by default)."""
        sigs = self.launches if labels is None else set().union(*(self.by_workload[x] for x in labels))
        out: Counter = Counter(s.kernel for s in sigs)
        return dict(sorted(out.items()))


# ---------------------------------------------------------------- workloads

_KEY = bytes(range(16))


def _prompt(seed: int, n: int, base: list | None = None) -> list[int]:
    """``n`` tokens; a shared ``base`` prefix first when given."""
    head = list(base or [])[:n]
    return head + [(seed * 7919 + 13 * i) % 50000 for i in range(n - len(head))]


def _attention_inputs(mgr, running: list, step: int) -> None:
    """What a serving loop derives from the block tables for its attention
    kernels after a step: the slot mapping of each running request's last
    token (a decode), in a batch padded by ``step % 3`` tokens, with token
    positions every other step."""
    import torch

    if not running or importlib.util.find_spec("gpukv.kernels.slot_mapping") is None:
        return
    from gpukv.kernels import slot_mapping as slot_ops

    dev = mgr.device
    tables = mgr.block_table_for(running)
    qsl = torch.arange(len(running) + 1, dtype=torch.int32, device=dev)
    starts = torch.tensor([mgr.num_computed_tokens(r) - 1 for r in running], dtype=torch.int32, device=dev)
    for g in range(tables.shape[0]):
        slot_ops.slot_mapping(tables, qsl, starts, block_size=mgr.block_size, num_tokens=len(running) + step % 3,
                              group=g, with_positions=step % 2 == 1)


def manager_workload(*, windows=(None,), block_size: int = 16, num_blocks: int = 48, steps: int = 5,
                     uncached_first: bool = True, seed: int = 0) -> None:
    """A short serving loop on a ``DeviceManager``: batches of new
    requests sharing prefixes (verified hits, pending hits within a step),
    decodes crossing block boundaries, finishes (cached blocks back to the
    free queue, hits on free blocks), a running update that does not fit
    (preemption), a lookup-only ``get_computed_blocks`` and
    ``allocate_slots``, and a prefix-cache reset; after every step, the slot
    mapping an attention kernel would take. Counts vary every step."""
    from gpukv.core.requests import NewRequest, RunningUpdate
    from gpukv.device import launches as launches_module
    from gpukv.device import manager as manager_module
    from gpukv.kernels.block_hash import hash_rows

    # The manager hashes on the host under the interpreter; record the kernel.
    host_hashing, launches_module._hash_rows = launches_module._hash_rows, hash_rows
    try:
        _manager_steps(manager_module.DeviceManager, NewRequest, RunningUpdate, windows=windows,
                       block_size=block_size, num_blocks=num_blocks, steps=steps, uncached_first=uncached_first,
                       seed=seed)
    finally:
        launches_module._hash_rows = host_hashing


def _manager_steps(DeviceManager, NewRequest, RunningUpdate, *, windows, block_size, num_blocks, steps,
                   uncached_first, seed) -> None:
    bs = block_size
    mgr = DeviceManager(num_blocks, bs, sliding_windows=list(windows), uncached_first=uncached_first,
                         hash_key=_KEY, max_model_len=16 * bs, max_num_reqs=4)
    doc = _prompt(seed + 1, 5 * bs)
    running: list[str] = []
    n = 0
    for step in range(steps):
        new = []
        for j in range(1 + (step + seed) % 3):
            length = (2 + (step * 5 + j * 3 + seed) % 4) * bs + (step + j + 3 * seed) % bs + 1
            base = doc if (step + j) % 2 == 0 else None
            new.append(NewRequest(f"r{n}", _prompt(seed * 100 + n, length, base)))
            n += 1
        updates = [RunningUpdate(rid, list(range(1 + (step + i + seed) % (bs + 2)))) for i, rid in enumerate(running)]
        finished = running[: step % 3]
        updates = [u for u in updates if u.request_id not in finished]
        if step % 4 == 3 and updates:  # the same work as a ragged RunningBatch, with the outputs gathered
            from gpukv.core.running_batch import RunningBatch

            batch = RunningBatch([mgr.row_of(u.request_id) for u in updates],
                                 [t for u in updates for t in u.new_token_ids],
                                 num_new_tokens=[len(u.new_token_ids) for u in updates])
            res = mgr.step(finished, batch, new, block_ids=True, prefix_of=updates[0].request_id)
        else:
            res = mgr.step(finished, updates, new)
        running = [rid for rid in running if rid not in finished]
        if not res.ok:  # preempt the newest running request, as a scheduler would
            victim = running.pop()
            mgr.step(finished=[victim])
        running += [r.request_id for r in new[: res.num_admitted]]
        if running and step % 2:  # the batched decode entry, one and two tokens a row
            rows = [mgr.row_of(r) for r in running]
            res = mgr.decode(rows, [[(step + i) % 7] * (1 + step % 4 // 2) for i in range(len(rows))])
            if not res.ok:
                mgr.step(finished=running[res.running_failed_at:])
                running = running[: res.running_failed_at]
        _attention_inputs(mgr, running, step)
    # A running update that cannot fit: ask for more blocks than are free.
    if running:
        free = mgr.read_num_free_blocks()
        too_many = min((free + 1) * bs, mgr.max_model_len - mgr.num_computed_tokens(running[0]))
        if too_many > free * bs:
            mgr.step(running=[RunningUpdate(running[0], [1] * too_many)])
    probe = NewRequest("probe", _prompt(999, 3 * bs, doc))
    computed = mgr.get_computed_blocks(probe)
    mgr.allocate_slots(probe, computed=computed)  # None when it does not fit
    held = set(mgr.request_ids())
    mgr.step(finished=[rid for rid in running + ["probe"] if rid in held])
    mgr.reset_prefix_cache()
    mgr.step(new=[NewRequest("after-reset", _prompt(7, 2 * bs + 3, doc))])


def _direct_free_queue(mod, dev) -> None:
    import torch
    i32 = dict(dtype=torch.int32, device=dev)
    fq = mod.FreeQueue.create(40, dev)
    mod.remove(fq, torch.tensor([3, 5, 7], **i32))
    mod.remove(fq, torch.tensor([9, 11], **i32), count=torch.ones(1, dtype=torch.int64, device=dev))
    mod.push(fq, torch.tensor([5, 3], **i32), torch.tensor([1, 2], **i32))
    mod.compact(fq)
    mod.maybe_compact(fq, 4)


def _direct_blocks(mod, dev) -> None:
    """``touch`` on its own (the manager's admission touches its hits inside
    its own launches, through the same ``add_references``)."""
    import torch

    from gpukv.kernels import free_queue
    i32 = dict(dtype=torch.int32, device=dev)
    fq = free_queue.FreeQueue.create(40, dev)
    mod.touch(torch.tensor([3, 3, 5, 0], **i32), torch.tensor([1, 1, 0, 1], **i32),
              ref_cnt=torch.zeros(40, **i32), fq=fq)


def _direct_hash_table(mod, dev) -> None:
    import torch
    i32 = dict(dtype=torch.int32, device=dev)
    table = mod.HashTable.create(40, dev)
    lo = torch.arange(5, dtype=torch.int64, device=dev) * 977
    blocks = torch.arange(1, 6, **i32)
    mod.insert(table, lo, lo + 1, 0, blocks)
    mod.insert(table, lo[:2] + 5, lo[:2], 1, blocks[:2] + 10, _lane_perm=torch.tensor([1, 0], **i32))
    mod.find_oldest(table, lo, lo + 1, 0)
    mod.erase(table, torch.tensor([2], **i32))
    mod.rebuild(table)


def _hash_chains(mod, dev) -> None:
    """A module's ``hash_block_chains``: with extra keys at block size 16, and
    without at an odd block size."""
    import torch
    i32 = dict(dtype=torch.int32, device=dev)
    parents = torch.zeros(2, 2, dtype=torch.int64, device=dev)
    extras = torch.ones(2, 2, 2, dtype=torch.int64, device=dev)
    mod.hash_block_chains(_KEY, parents, torch.arange(2 * 32, **i32).reshape(2, 32), torch.tensor([2, 1], **i32),
                          extras, block_size=16)
    mod.hash_block_chains(_KEY, parents, torch.arange(2 * 9, **i32).reshape(2, 9), torch.tensor([3, 2], **i32),
                          block_size=3)


def _direct_block_hash(mod, dev) -> None:
    import torch
    _hash_chains(mod, dev)
    msgs = torch.arange(3 * 70, dtype=torch.uint8, device=dev).reshape(3, 70)
    mod.blake3_bytes(msgs)
    mod.blake3_bytes(msgs, key=bytes(range(32)))
    mod.blake3_bytes(msgs, derive_key_context="gpukv aot check")


def _direct_lookup(mod, dev) -> None:
    """``verify`` both ways (the manager's lookup runs the same comparison
    inside ``prefill._lookup_kernel``)."""
    import torch
    i32 = dict(dtype=torch.int32, device=dev)
    tokens = torch.arange(2 * 32, **i32).reshape(2, 32)
    digests = torch.ones(2, 2, 2, dtype=torch.int64, device=dev)
    cand, rows, pos = torch.tensor([0, 1], **i32), torch.tensor([1, 0], **i32), torch.tensor([1, 0], **i32)
    mod.verify(cand, rows, pos, tokens=tokens, digests=digests, extras=digests, root=(1, 2), block_size=16,
               from_pool=False)
    mod.verify(cand, rows, pos, tokens=tokens, digests=digests, extras=digests, root=(1, 2), block_size=16,
               from_pool=True, blk_tokens=tokens.view(-1, 16), blk_parent=digests.view(-1, 2),
               blk_extra=digests.view(-1, 2))


#: Per kernel module, the launcher calls ``direct_launches`` makes (modules
#: that are not there are skipped).
_DIRECT = {
    "blocks": _direct_blocks,
    "free_queue": _direct_free_queue,
    "hash_table": _direct_hash_table,
    "block_hash": _direct_block_hash,
    "lookup": _direct_lookup,
}


def direct_launches() -> None:
    """What a manager never launches, or launches in only one variant,
    through the public launchers: a touch on its own, forced and conditional
    free-queue compaction, a push without call ids, a counted remove, a forced table
    rebuild, an unmasked lookup, an insert under a lane permutation (the
    tests' thread-schedule hook), chained hashing with and without extra keys
    and at an odd block size, BLAKE3 of byte strings in its three
    modes, the lookup's ``verify`` both ways."""
    from gpukv import _runtime

    dev = _runtime.default_device()
    for mod in kernel_modules():
        call = _DIRECT.get(mod.__name__.rsplit(".", 1)[-1])
        if call is not None:
            call(mod, dev)


#: The device-manager runs ``record`` makes: (label, callable).
MANAGER_WORKLOADS = (
    ("full attention", lambda: manager_workload(windows=(None,))),
    ("full + sliding window", lambda: manager_workload(windows=(None, 40), uncached_first=False, seed=1)),
)
#: Everything ``record`` runs: (label, callable).
WORKLOADS = MANAGER_WORKLOADS + (("direct launcher calls", direct_launches),)


def record(kernels: dict | None = None, *, honour_do_not_specialize: bool = True,
           workloads=WORKLOADS) -> Recorder:
    """Run the workloads under a ``Recorder`` of every discovered kernel."""
    if kernels is None:
        kernels = discover()[0]
    with Recorder(kernels, honour_do_not_specialize=honour_do_not_specialize) as rec:
        for label, fn in workloads:
            rec.workload = label
            fn()
    return rec


# ---------------------------------------------------------------- compiling


@dataclasses.dataclass
class CompileResult:
    kernel: str
    target: str  # "sm_80"
    signature: str
    ok: bool
    error: str = ""
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared: int | None = None
    seconds: float = 0.0


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _error_text(e: BaseException | None) -> str:
    """The error and its causes (a ``CompilationError`` says where; its cause
    says what)."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}".strip())
        e = e.__cause__ or e.__context__
    return "\n caused by ".join(parts)


def _compile_one(job: dict, target) -> dict:
    """Compile one signature (in a worker process, interpreter off)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod_name, qual = job["kernel"].split(".", 1)
    fn = getattr(importlib.import_module(f"gpukv.kernels.{mod_name}"), qual)
    backend_target = GPUTarget(*target)
    from triton.compiler.compiler import make_backend
    backend = make_backend(backend_target)
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, (ty, attr)) in enumerate(zip(job["params"], job["spec"], strict=True)):
        signature[name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = attr
        elif isinstance(attr, str):
            attrs[(i,)] = backend.parse_attr(attr)
    options = dict(job["options"])
    knobs.nvidia.dump_ptxas_log = True
    out = {"kernel": job["kernel"], "target": f"sm_{target[1]}", "signature": job["describe"], "ok": False}
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=backend_target, options=options)
    except Exception as e:  # noqa: BLE001 (reported, the caller fails the test)
        out["error"] = _error_text(e)
        out["seconds"] = time.perf_counter() - t0
        return out
    out["seconds"] = time.perf_counter() - t0
    text = log.getvalue()
    regs = [int(m) for m in _PTXAS_REGS.findall(text)]
    spills = [(int(a), int(b)) for a, b in _PTXAS_SPILLS.findall(text)]
    out.update(ok=True, registers=max(regs) if regs else None,
               spill_stores=max((s for s, _ in spills), default=None),
               spill_loads=max((ld for _, ld in spills), default=None),
               shared=int(k.metadata.shared))
    return out


def _worker() -> None:
    """Worker process: ``python -c 'from tests.kernels.aot import _worker;
    _worker()' JOBS.json OUT.json``."""
    jobs_path, out_path = sys.argv[1], sys.argv[2]
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = [_compile_one(job, tuple(job["target"])) for job in jobs]
    with open(out_path, "w") as f:
        json.dump(results, f)


def _worker_env(cache_dir: str) -> dict:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0"  # the real compiler (gpukv._runtime keeps a caller's choice)
    env["TRITON_CACHE_DIR"] = cache_dir
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    for var in ("TRITON_KERNEL_OVERRIDE", "TRITON_KERNEL_DUMP", "TRITON_ALWAYS_COMPILE",
                "TRITON_ALLOW_NON_CONSTEXPR_GLOBALS"):  # the check must be as strict as a default GPU run
        env.pop(var, None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/kernels/aot.py
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def compile_all(signatures: Iterable[Signature], targets=TARGETS, *, jobs: int | None = None,
                timeout: float = 600.0) -> list[CompileResult]:
    """Compile every signature for every target with Triton's real compiler,
    in ``jobs`` worker processes sharing one fresh, empty Triton cache."""
    work = []
    for sig in signatures:
        for t in targets:
            work.append({**sig.to_json(), "describe": sig.describe(), "target": list(t)})
    if not work:
        return []
    jobs = max(1, min(jobs or min(2, os.cpu_count() or 1), len(work)))
    # Spread round-robin across the workers (the two targets of a signature land on different ones).
    chunks = [work[i::jobs] for i in range(jobs)]
    with tempfile.TemporaryDirectory(prefix="gpukv-aot-") as tmp:
        cache = os.path.join(tmp, "triton-cache")
        os.makedirs(cache)
        env = _worker_env(cache)
        procs = []
        for i, chunk in enumerate(chunks):
            jp, op = os.path.join(tmp, f"jobs{i}.json"), os.path.join(tmp, f"out{i}.json")
            with open(jp, "w") as f:
                json.dump(chunk, f)
            cmd = [sys.executable, "-c", "from tests.kernels.aot import _worker; _worker()", jp, op]
            procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True), op, chunk))
        results: list[CompileResult] = []
        deadline = time.monotonic() + timeout
        for proc, op, _chunk in procs:
            try:
                output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as e:
                proc.kill()
                output, _ = proc.communicate()
                raise RuntimeError(f"compile worker timed out after {timeout:.0f} s:\n{output[-4000:]}") from e
            if proc.returncode != 0 or not os.path.exists(op):
                raise RuntimeError(f"compile worker failed (exit {proc.returncode}):\n{output[-4000:]}")
            with open(op) as f:
                results += [CompileResult(**r) for r in json.load(f)]
    results.sort(key=lambda r: (r.kernel, r.target, r.signature))
    return results


# ---------------------------------------------------------------- the table


def summarize(results: list[CompileResult]) -> list[dict]:
    """One row per (kernel, target): the worst registers, spills and shared
    memory over the kernel's signatures, and their total compile seconds."""
    rows: dict = defaultdict(list)
    for r in results:
        rows[(r.kernel, r.target)].append(r)
    out = []
    for (kernel, target), rs in sorted(rows.items()):
        ok = [r for r in rs if r.ok]
        out.append({
            "kernel": kernel,
            "target": target,
            "variants": len(rs),
            "failed": len(rs) - len(ok),
            "registers": max((r.registers for r in ok if r.registers is not None), default=None),
            "spills": max(((r.spill_stores or 0) + (r.spill_loads or 0) for r in ok), default=None),
            "shared": max((r.shared for r in ok if r.shared is not None), default=None),
            "seconds": sum(r.seconds for r in rs),
        })
    return out


def markdown_table(results: list[CompileResult]) -> str:
    def cell(v):
        return "-" if v is None else str(v)

    lines = ["| kernel | target | variants | registers | spills (bytes) | shared memory (bytes) | compile s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in summarize(results):
        name = row["kernel"] + (f" (**{row['failed']} failed**)" if row["failed"] else "")
        lines.append(f"| `{name}` | {row['target']} | {row['variants']} | {cell(row['registers'])} | "
                     f"{cell(row['spills'])} | {cell(row['shared'])} | {row['seconds']:.2f} |")
    return "\n".join(lines)
