"""Drive vLLM 0.8.5's v1 ``Scheduler``, and gpukv's subclasses of it, without a model.

What is here, for the tests in this folder (and any test that wants to run the
real vLLM scheduling loop on gpukv):

* vLLM itself, imported once. Without vLLM 0.8.5 every module that imports this
  one is skipped, with a reason saying how to get it.
* :func:`scheduler_params`: the scheduler classes to parametrize a test over, as
  ``pytest.param``\\ s with ids ``vllm`` (vLLM's own ``Scheduler``, which proves
  the test itself), ``reference`` (``gpukv.vllm.UnbatchedReferenceScheduler``:
  vLLM's loop, one manager call per request), ``batched``
  (``gpukv.vllm.ReferenceScheduler``: the batched ``schedule()``, the
  default, on the reference), ``device`` (``gpukv.vllm.DeviceScheduler``,
  batched) and ``device-unbatched`` (``gpukv.vllm.UnbatchedDeviceScheduler``).
* :func:`make_scheduler`: any of those classes, built from plain keyword
  options (vLLM's ``SchedulerConfig``, ``CacheConfig``, ``VllmConfig`` and
  ``KVCacheConfig`` made here, with a stand-in model config, since
  ``vllm.config.ModelConfig`` reads the model from the Hugging Face hub).
* :func:`make_requests`: vLLM ``Request``\\ s.
* :func:`model_output`: what a model runner would answer to a
  ``SchedulerOutput``: a sampled token for every request that finished its
  prompt, nothing for one still prefilling, as vLLM's GPU model runner does.
  :func:`step` and :func:`run_until_idle` wrap the schedule / answer / update
  loop.
* :class:`KVView`: the facts about the KV cache a test may assert (block ids per
  request, free blocks, cached blocks, who holds blocks), read from vLLM's
  ``KVCacheManager`` internals or from gpukv's adapter, the same way for both.
* :class:`BlockTables`: the block tables a model runner would hold, rebuilt
  from the ``SchedulerOutput``\\ s alone, to compare with the manager's.

The configs are built the way vLLM's engine builds them for a text-only model
with one full-attention KV-cache group; every option has vLLM 0.8.5's default
for its own scheduler tests unless a test says otherwise.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

import gpukv._runtime  # before vLLM imports triton: the interpreter switch on a machine without CUDA

INSTALL_HINT = (
    "install it with `pip install -e '.[vllm085]'` from a clone, or build a venv with "
    "`bash ../shared/tools/vllm085/setup.sh DIR` and run the tests with "
    "`PYTHONPATH=. DIR/venv/bin/python -m pytest -q tests/test_vllm`"
)
VLLM_VERSION_PREFIX = "0.8.5"

try:
    import torch
    import vllm
    from vllm.config import CacheConfig, KVTransferConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.multimodal.inputs import MultiModalKwargs, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
except Exception as exc:  # noqa: BLE001 (any failure to import means: no usable vLLM here)
    pytest.skip(f"vLLM {VLLM_VERSION_PREFIX} is not importable ({type(exc).__name__}: {exc}); {INSTALL_HINT}",
                allow_module_level=True)

if not vllm.__version__.startswith(VLLM_VERSION_PREFIX):
    pytest.skip(f"these tests follow vLLM {VLLM_VERSION_PREFIX}'s scheduler, found vLLM {vllm.__version__}; "
                f"{INSTALL_HINT}", allow_module_level=True)

__all__ = [
    "EOS_TOKEN_ID", "SAMPLED_TOKEN_ID", "BlockTables", "EngineCoreOutputs", "FullAttentionSpec", "KVCacheConfig",
    "KVCacheGroupSpec", "KVView", "ModelRunnerOutput", "PlaceholderRange", "Request", "RequestStatus",
    "SamplingParams", "SchedulerOutput", "VllmKVCacheManager", "VllmScheduler", "backend_of",
    "make_requests", "make_scheduler", "model_output", "run_until_idle", "scheduler_params",
    "small_on_interpreter", "step",
]

EOS_TOKEN_ID = 50256
"""The end-of-sequence token every request made here stops on (GPT-2's)."""

SAMPLED_TOKEN_ID = 1000
"""The token :func:`model_output` samples unless told otherwise."""

LLAVA_IMAGE_TOKENS = 576
"""Tokens per image of llava-1.5 (a 336x336 image, 14x14 patches): what the
stand-in multimodal registry reports when a test asks for a multimodal model."""


# ---------------------------------------------------------------- scheduler classes

GPUKV_BACKENDS = ("reference", "batched", "device", "device-unbatched")


def _gpukv_schedulers() -> tuple[dict[str, type | None], str | None]:
    """gpukv's scheduler classes by backend, or Nones and why they are absent.

    Only a missing ``gpukv.vllm`` package counts as absent; any other failure to
    import it is a bug and propagates.
    """
    try:
        import gpukv.vllm as gv
    except ModuleNotFoundError as exc:
        if exc.name not in ("gpukv.vllm", "gpukv"):
            raise
        return dict.fromkeys(GPUKV_BACKENDS), f"gpukv.vllm is not there yet ({exc})"
    return {"reference": gv.UnbatchedReferenceScheduler, "batched": gv.ReferenceScheduler,
            "device": gv.DeviceScheduler, "device-unbatched": gv.UnbatchedDeviceScheduler}, None


def scheduler_params(*backends: str) -> list[Any]:
    """``pytest.param``\\ s of scheduler classes, for ``@pytest.mark.parametrize``.

    ``backends``: any of ``"vllm"``, ``"reference"``, ``"batched"``,
    ``"device"``, ``"device-unbatched"`` (when none are named: ``vllm``,
    ``reference``, ``batched`` and ``device``); the param ids are these names.
    A gpukv class that cannot be imported because ``gpukv.vllm`` does not
    exist is skipped.
    """
    classes, why = _gpukv_schedulers()
    params = []
    for name in backends or ("vllm", "reference", "batched", "device"):
        if name == "vllm":
            params.append(pytest.param(VllmScheduler, id="vllm"))
        elif name in classes:
            marks = [pytest.mark.skip(reason=why)] if classes[name] is None else []
            params.append(pytest.param(classes[name], id=name, marks=marks))
        else:
            raise ValueError(f"unknown backend {name!r}; pass 'vllm' or one of {GPUKV_BACKENDS}")
    return params


def backend_of(scheduler: Any) -> str:
    """``"vllm"`` for vLLM's own ``KVCacheManager``, else the gpukv adapter's
    backend (``"reference"`` or ``"device"``), read from the manager it built."""
    kvm = scheduler.kv_cache_manager
    if _is_gpukv(kvm):
        from gpukv.device.manager import DeviceManager

        return "device" if isinstance(kvm.manager, DeviceManager) else "reference"
    return "vllm"


def small_on_interpreter(cls: type, n: int, n_interpreted: int) -> int:
    """``n``, or ``n_interpreted`` for a scheduler on gpukv's device manager
    whose kernels run under Triton's interpreter (no CUDA: about a second of
    CPU per admitted request), to keep such runs short."""
    return n_interpreted if getattr(cls, "backend", None) == "device" and gpukv._runtime.INTERPRETED else n


# ---------------------------------------------------------------- configs

@dataclass
class FakeModelConfig:
    """Stands in for ``vllm.config.ModelConfig``, which cannot be built offline.

    vLLM 0.8.5's scheduler reads one thing of it (``compute_encoder_budget``:
    ``is_multimodal_model``); a multimodal model's token counts come from the
    multimodal registry, for which :class:`FakeMultiModalRegistry` stands in.
    """

    max_model_len: int
    is_multimodal_model: bool = False
    model: str = "fake-text-model"


@dataclass
class FakeMultiModalRegistry:
    """Stands in for vLLM's ``MULTIMODAL_REGISTRY`` for a model whose one
    modality (images) takes ``tokens_per_item`` tokens an item: the only
    question the scheduler asks it (``get_max_tokens_per_item_by_nonzero_modality``)."""

    tokens_per_item: int

    def get_max_tokens_per_item_by_nonzero_modality(self, model_config: Any) -> dict[str, int]:  # noqa: ARG002
        return {"image": self.tokens_per_item}


@contextlib.contextmanager
def _v1_engine() -> Iterator[None]:
    """``VLLM_USE_V1=1`` while a scheduler and its configs are built (vLLM's
    configs and KV-connector factory read it then), and as it was afterwards:
    left set, it would reach every later ``import vllm`` in a subprocess (the
    docs' snippets), which then loads the whole v1 engine (xgrammar,
    tokenizers...) that the scheduler does not need."""
    before = os.environ.get("VLLM_USE_V1")
    os.environ["VLLM_USE_V1"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["VLLM_USE_V1"]
        else:
            os.environ["VLLM_USE_V1"] = before


def make_scheduler(cls: type = VllmScheduler, **options: Any) -> Any:
    """:func:`_make_scheduler` (its options) as vLLM's v1 engine builds it."""
    with _v1_engine():
        return _make_scheduler(cls, **options)


def _make_scheduler(
    cls: type = VllmScheduler,
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    enable_prefix_caching: bool | None = None,
    long_prefill_token_threshold: int = 0,
    disable_chunked_mm_input: bool = False,
    num_blocks: int = 10000,
    block_size: int = 16,
    max_model_len: int | None = None,
    num_speculative_tokens: int | None = None,
    log_stats: bool = True,
    mm_tokens_per_item: int | None = None,
    kv_connector_path: str | os.PathLike | None = None,
    include_finished_set: bool = False,
    sliding_window: int | None = None,
) -> Any:
    """A scheduler of class ``cls`` (vLLM's ``Scheduler`` or a subclass with its
    constructor), built as vLLM's engine builds one.

    * ``max_num_seqs``, ``max_num_batched_tokens``, ``long_prefill_token_threshold``,
      ``disable_chunked_mm_input``: ``SchedulerConfig``'s, chunked prefill on.
    * ``max_model_len``: None for ``max_num_batched_tokens``.
    * ``enable_prefix_caching``: ``CacheConfig``'s; None leaves its default
      (None), which vLLM 0.8.5's v1 ``KVCacheManager`` takes as off.
    * ``num_blocks``, ``block_size``: the pool, block 0 of it the null block, so
      ``num_blocks - 1`` usable; one full-attention KV-cache group.
    * ``num_speculative_tokens``: a ``SpeculativeConfig`` with the n-gram
      proposer (no lookahead slots; drafts come in ``ModelRunnerOutput.spec_token_ids``).
    * ``log_stats``: the scheduler's (prefix-cache and spec-decode stats).
    * ``mm_tokens_per_item``: make the model multimodal, ``N`` tokens an image
      (``LLAVA_IMAGE_TOKENS`` is llava-1.5's); None: text only.
    * ``kv_connector_path``: give the scheduler vLLM's ``SharedStorageConnector``
      (``kv_both``) storing under this folder; None: no KV connector.
    * ``include_finished_set``: the scheduler's own option.
    * ``sliding_window``: the one KV-cache group is sliding-window attention
      over that many tokens (None: full attention).
    """
    if max_model_len is None:
        max_model_len = max_num_batched_tokens
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        disable_chunked_mm_input=disable_chunked_mm_input,
        enable_chunked_prefill=True,
    )
    cache_kwargs = {} if enable_prefix_caching is None else {"enable_prefix_caching": enable_prefix_caching}
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, swap_space=0,
                               cache_dtype="auto", **cache_kwargs)
    speculative_config = None
    if num_speculative_tokens is not None:
        speculative_config = SpeculativeConfig(model="ngram", num_speculative_tokens=num_speculative_tokens)
    kv_transfer_config = None
    if kv_connector_path is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector="SharedStorageConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": os.fspath(kv_connector_path)})
    vllm_config = VllmConfig(scheduler_config=scheduler_config, cache_config=cache_config,
                             speculative_config=speculative_config, kv_transfer_config=kv_transfer_config)
    # Set after construction: VllmConfig.__post_init__ would verify a real ModelConfig against the others.
    vllm_config.model_config = FakeModelConfig(max_model_len=max_model_len,
                                               is_multimodal_model=mm_tokens_per_item is not None)
    if sliding_window is None:
        attention_spec = FullAttentionSpec(block_size, 1, 1, torch.float32, False)
    else:
        attention_spec = SlidingWindowSpec(block_size, 1, 1, torch.float32, False, sliding_window=sliding_window)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        tensors={},
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], attention_spec)],
    )
    cache_config.num_gpu_blocks = num_blocks  # what the engine sets after profiling memory
    extra: dict[str, Any] = {}
    if mm_tokens_per_item is not None:
        extra["mm_registry"] = FakeMultiModalRegistry(mm_tokens_per_item)
    scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        include_finished_set=include_finished_set,
        log_stats=log_stats,
        **extra,
    )
    # A gpukv scheduler that pins its backend must run on it (no test may pass on vLLM's manager by mistake).
    pinned = getattr(cls, "backend", None)
    if pinned in ("reference", "device"):
        assert backend_of(scheduler) == pinned, f"{cls.__name__} runs on {backend_of(scheduler)}, not {pinned}"
    return scheduler


# ---------------------------------------------------------------- requests

def make_requests(
    num_requests: int,
    num_tokens: int = 10,
    *,
    prompt: Callable[[int], Sequence[int]] | None = None,
    first_id: int = 0,
    mm_positions: Sequence[Sequence[PlaceholderRange]] | None = None,
    mm_hashes: Sequence[Sequence[str]] | None = None,
    max_tokens: int = 16,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    prompt_logprobs: int | None = None,
) -> list[Request]:
    """``num_requests`` vLLM ``Request``\\ s with ids ``str(first_id + i)``.

    Request ``i``'s prompt is ``prompt(i)``, by default ``num_tokens`` copies of
    the token ``first_id + i`` (so no two requests share a block's tokens).
    ``mm_positions[i]``: request ``i``'s image placeholders (each with an empty
    ``MultiModalKwargs``), ``mm_hashes[i]`` their hashes (None: none, as vLLM's
    engine hands the scheduler when it does not hash multimodal inputs).
    The rest go to ``SamplingParams``; every request stops on ``EOS_TOKEN_ID``
    unless ``ignore_eos``.
    """
    requests = []
    for i in range(num_requests):
        rid = first_id + i
        tokens = list(prompt(i)) if prompt is not None else [rid] * num_tokens
        positions = list(mm_positions[i]) if mm_positions is not None else None
        params = SamplingParams(ignore_eos=ignore_eos, max_tokens=max_tokens,
                                stop_token_ids=list(stop_token_ids) if stop_token_ids is not None else None,
                                prompt_logprobs=prompt_logprobs)
        requests.append(Request(
            request_id=str(rid),
            prompt_token_ids=tokens,
            multi_modal_inputs=[MultiModalKwargs({}) for _ in positions] if positions else None,
            multi_modal_hashes=list(mm_hashes[i]) if mm_hashes is not None else None,
            multi_modal_placeholders=positions,
            sampling_params=params,
            eos_token_id=EOS_TOKEN_ID,
            arrival_time=0,
        ))
    return requests


# ---------------------------------------------------------------- the model runner's side

Sampler = Callable[[Request], "int | Sequence[int]"]


def _constant_sampler(request: Request) -> int:  # noqa: ARG001
    return SAMPLED_TOKEN_ID


def model_output(
    scheduler: Any,
    scheduler_output: SchedulerOutput,
    sample: Sampler | None = None,
    *,
    sampled: Mapping[str, Sequence[int]] | None = None,
    spec_token_ids: Mapping[str, Sequence[int]] | None = None,
    req_ids: Iterable[str] | None = None,
) -> ModelRunnerOutput:
    """The ``ModelRunnerOutput`` a model runner would return for ``scheduler_output``.

    Call it after ``scheduler.schedule()`` and before ``update_from_output``.
    A request sampled in this step (its computed tokens reached its known
    tokens) gets ``sampled[req_id]`` if given, else ``sample(request)`` (a token
    or a list: with speculative decoding, the accepted drafts and the bonus
    token), by default ``[SAMPLED_TOKEN_ID]``; a request still prefilling gets
    ``[]``, as vLLM's GPU model runner discards a partial prefill's sample.
    ``spec_token_ids``: new drafts per request (None: the field is None, as
    without speculative decoding; requests missing from it draft nothing).
    ``req_ids``: the requests to answer for, in batch order (default: those
    scheduled, new ones first, as in ``num_scheduled_tokens``).
    """
    sample = sample or _constant_sampler
    ids = list(req_ids) if req_ids is not None else list(scheduler_output.num_scheduled_tokens)
    sampled_lists: list[list[int]] = []
    for rid in ids:
        if sampled is not None and rid in sampled:
            sampled_lists.append(list(sampled[rid]))
            continue
        request = scheduler.requests[rid]
        # schedule() already advanced num_computed_tokens by what it scheduled.
        if request.num_computed_tokens < request.num_tokens:
            sampled_lists.append([])
        else:
            got = sample(request)
            sampled_lists.append([got] if isinstance(got, int) else list(got))
    drafts = None
    if spec_token_ids is not None:
        drafts = [list(spec_token_ids.get(rid, ())) for rid in ids]
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=sampled_lists,
        spec_token_ids=drafts,
        logprobs=None,
        prompt_logprobs_dict={},
    )


def step(scheduler: Any, sample: Sampler | None = None, *, tables: BlockTables | None = None,
         **output_kwargs: Any) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """One engine step: ``schedule()``, the model's answer (:func:`model_output`
    with ``sample`` and ``output_kwargs``), ``update_from_output``. With
    ``tables``, the block tables are followed and checked against the manager
    right after ``schedule()``."""
    out = scheduler.schedule()
    if tables is not None:
        tables.update(out)
        tables.check(scheduler)
    result = scheduler.update_from_output(out, model_output(scheduler, out, sample, **output_kwargs))
    return out, result


def run_until_idle(scheduler: Any, sample: Sampler | None = None, *, max_steps: int = 1000,
                   tables: BlockTables | None = None) -> int:
    """Step until no request is waiting or running; returns the steps taken.
    Fails if ``max_steps`` pass first (a request that can never be scheduled)."""
    for n in range(max_steps):
        if not scheduler.waiting and not scheduler.running:
            return n
        step(scheduler, sample, tables=tables)
    raise AssertionError(f"still {len(scheduler.waiting)} waiting and {len(scheduler.running)} running "
                         f"after {max_steps} steps")


# ---------------------------------------------------------------- the KV cache, as tests see it

def _is_gpukv(kvm: Any) -> bool:
    return hasattr(kvm, "manager") and hasattr(kvm, "get_block_ids") and hasattr(kvm, "request_ids")


class KVView:
    """The facts about a scheduler's KV cache that tests assert, read the same
    way from vLLM's ``KVCacheManager`` (its ``req_to_blocks``, ``block_pool``,
    ``num_cached_block``) and from gpukv's adapter (its inspection helpers and
    the gpukv manager under it). Block ids count from 0, the null block."""

    def __init__(self, scheduler: Any) -> None:
        self.kvm = scheduler.kv_cache_manager
        self.is_gpukv = _is_gpukv(self.kvm)
        if not self.is_gpukv and not isinstance(self.kvm, VllmKVCacheManager):
            raise TypeError(f"unknown KV cache manager {type(self.kvm).__name__}")

    @property
    def num_blocks(self) -> int:
        """The pool's blocks, the null block included."""
        return self.kvm.manager.num_blocks if self.is_gpukv else self.kvm.block_pool.num_gpu_blocks

    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones among them), as vLLM's
        ``block_pool.get_num_free_blocks()``."""
        return self.kvm.num_free_blocks() if self.is_gpukv else self.kvm.block_pool.get_num_free_blocks()

    def request_ids(self) -> set[str]:
        """Ids of the requests the manager keeps blocks or block counts for."""
        if self.is_gpukv:
            return set(self.kvm.request_ids())
        return {rid for rid, blocks in self.kvm.req_to_blocks.items() if blocks} | set(self.kvm.num_cached_block)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, position by position ([] if it holds none)."""
        if self.is_gpukv:
            return list(self.kvm.get_block_ids(request_id)) if request_id in self.request_ids() else []
        return [b.block_id for b in self.kvm.req_to_blocks.get(request_id, [])]

    def _cached_block_ids(self) -> set[int]:
        manager = self.kvm.manager
        pool = manager.pool
        table = pool.table_entries() if hasattr(pool, "table_entries") else pool.table()
        return {b for blocks in table.values() for b in blocks}

    def num_cached_blocks(self, request_id: str) -> int:
        """How many of the request's blocks are in the prefix cache (vLLM:
        ``num_cached_block``, its count of leading full blocks cached)."""
        if not self.is_gpukv:
            return self.kvm.num_cached_block.get(request_id, 0)
        cached = self._cached_block_ids()
        return sum(1 for b in self.block_ids(request_id) if b in cached)

    def num_block_hashes(self, request_id: str) -> int:
        """How many block hashes the manager keeps for a request holding blocks
        (vLLM: ``req_to_block_hashes``; gpukv: the digests of its full known blocks)."""
        if not self.is_gpukv:
            return len(self.kvm.req_to_block_hashes.get(request_id, []))
        return len(self.kvm.manager.block_hashes(request_id)) if request_id in self.request_ids() else 0

    def leftovers(self) -> dict[str, set[str]]:
        """Per-request structures still holding something, by name ({} when the
        manager keeps nothing for any request)."""
        if self.is_gpukv:
            found = {"adapter.request_ids()": set(self.kvm.request_ids()),
                     "manager.request_ids()": set(self.kvm.manager.request_ids())}
        else:
            found = {"req_to_blocks": set(self.kvm.req_to_blocks),
                     "req_to_block_hashes": set(self.kvm.req_to_block_hashes),
                     "num_cached_block": set(self.kvm.num_cached_block)}
        return {name: ids for name, ids in found.items() if ids}

    def assert_empty(self) -> None:
        """No request holds a block or is remembered, every usable block is
        free (vLLM: every reference count 0), and the manager's own invariants hold."""
        assert self.leftovers() == {}
        assert self.num_free_blocks() == self.num_blocks - 1
        if self.is_gpukv:
            self.kvm.manager.check_invariants()
        else:
            assert [b.block_id for b in self.kvm.block_pool.blocks if b.ref_cnt != 0] == []


class BlockTables:
    """The block table per request that a model runner rebuilds from the
    ``SchedulerOutput``\\ s alone: a new request's ``block_ids``, a running one's
    ``new_block_ids`` appended, a resumed one's ``new_block_ids`` from scratch."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def update(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
        for cached in out.scheduled_cached_reqs:
            if cached.resumed_from_preemption:
                self.tables[cached.req_id] = list(cached.new_block_ids)
            else:
                self.tables[cached.req_id].extend(cached.new_block_ids)

    def check(self, scheduler: Any) -> None:
        """Every running request's table equals the blocks its manager holds for it."""
        view = KVView(scheduler)
        got = {r.request_id: view.block_ids(r.request_id) for r in scheduler.running}
        want = {r.request_id: self.tables.get(r.request_id) for r in scheduler.running}
        assert got == want, f"manager's block ids {got} != the outputs' block tables {want}"
