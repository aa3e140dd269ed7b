"""Drive vLLM 0.33's v1 ``Scheduler`` and ``AsyncScheduler`` without a model.

The 0.33 counterpart of ``tests/test_vllm/harness.py`` (vLLM 0.8.5). What is here:

* vLLM 0.33 itself, imported once. Without it (the project's default ``.venv``
  holds vLLM 0.8.5) every module that imports this one is skipped, with a
  reason saying how to get it.
* :func:`scheduler_params`: the scheduler classes to parametrize a test over,
  as ``pytest.param``\\ s: ``vllm`` (vLLM's ``Scheduler``) and ``vllm-async``
  (vLLM's ``AsyncScheduler``, the engine's default since async scheduling is on
  unless something rules it out). A gpukv class joins through
  :data:`EXTRA_SCHEDULERS`; the tests are the spec it has to pass.
* :func:`make_scheduler`: a scheduler built from plain keyword options, as
  vLLM's engine builds it (``EngineCore.__init__``), with a stand-in for
  ``ModelConfig`` (:class:`FakeModelConfig`: the real one reads the model from
  the Hugging Face hub) and a ``KVCacheConfig`` of one full-attention group,
  one sliding-window group, or both (hybrid).
* :func:`make_requests`: vLLM ``Request``\\ s whose block hashes are computed
  by the request itself, through the engine's ``block_hasher``.
* :class:`Engine`: the schedule / model answer / update loop, synchronous or
  asynchronous (two batches in flight, as ``EngineCore.step_with_batch_queue``
  runs an ``AsyncScheduler``), with drafts handed back after each update as
  the engine's ``post_step`` does.
* :class:`KVView` and :class:`BlockTables`: the KV-cache facts tests assert,
  and the block tables a model runner rebuilds from the outputs alone.

Run (``INSTALL_HINT``)::

    PYTHONPATH=. VENV/bin/python -m pytest -q tests/test_vllm033
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

import gpukv._runtime  # noqa: F401  (before vLLM imports triton: the interpreter switch without CUDA)
from gpukv.vllm_plugin import has_async_scheduler

INSTALL_HINT = (
    "build a second venv: `pip install torch==2.13.0`, `pip install --no-deps vllm==0.33.0`, the pure-Python "
    "packages its scheduler imports (tests/test_vllm033/requirements-vllm033.txt; docs/notes/vllm033_research.md), "
    "`pip install --no-deps -e .`, then `PYTHONPATH=. VENV/bin/python -m pytest -q tests/test_vllm033`"
)

# vLLM logs at INFO on every config it builds; the tests need none of it.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

try:
    import vllm
except Exception as exc:  # noqa: BLE001 (any failure to import means: no usable vLLM here)
    pytest.skip(f"vLLM is not importable ({type(exc).__name__}: {exc}); {INSTALL_HINT}", allow_module_level=True)

if not has_async_scheduler():
    pytest.skip(f"these tests follow vLLM's scheduler from 0.33 on (its AsyncScheduler), found vLLM "
                f"{vllm.__version__}; {INSTALL_HINT}", allow_module_level=True)

try:
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        LoRAConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )
    from vllm.v1.metrics.stats import PrefixCacheStats
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
except Exception as exc:  # noqa: BLE001 (any failure to import means: no usable vLLM 0.33 here)
    pytest.skip(f"vLLM {vllm.__version__}'s scheduler core is not importable ({type(exc).__name__}: {exc}); "
                f"{INSTALL_HINT}", allow_module_level=True)

__all__ = [
    "EOS_TOKEN_ID", "SAMPLED_TOKEN_ID", "AllBlocksCleared", "BlockRemoved", "BlockStored", "BlockTables",
    "DraftTokenIds", "Engine", "EngineCoreOutputs", "EventRecorder", "KVCacheBlocks", "KVView", "LoRARequest",
    "ModelRunnerOutput", "PauseState",
    "PrefixCacheStats", "Request", "RequestStatus", "SamplingParams", "SchedulerOutput", "VllmAsyncScheduler",
    "VllmKVCacheManager", "VllmScheduler", "coordinator_name", "is_async", "is_gpukv", "make_requests",
    "gpukv033", "make_scheduler", "scheduler_params", "HAS_V1_MODEL_RUNNER", "HAS_COMMON_PREFIX_BLOCKS", "HIT_LIMIT",
    "HAS_CACHE_AWARE_ADMISSION", "vllm_version",
]

EOS_TOKEN_ID = 50256
"""The end-of-sequence token every request made here stops on (GPT-2's, as in vLLM's tests)."""

SAMPLED_TOKEN_ID = 1000
"""The token the model answers with unless a test says otherwise."""


# ---------------------------------------------------------------- scheduler classes

from gpukv.vllm import v0_33 as gpukv033  # noqa: E402  (after the skips: it imports vLLM 0.33)

EXTRA_SCHEDULERS: dict[str, type] = {
    "gpukv-ref": gpukv033.ReferenceScheduler,
    "gpukv-ref-async": gpukv033.ReferenceAsyncScheduler,
}
"""More scheduler classes by param id (gpukv's for vLLM 0.33, on the
reference backend): ``scheduler_params`` offers them beside vLLM's own. A
class that subclasses ``AsyncScheduler`` runs with async scheduling on. The
device backend runs a few streams of its own (``test_streams.py``)."""


def is_gpukv(scheduler_or_cls: Any) -> bool:
    """Whether a scheduler (or class) is one of gpukv's."""
    cls = scheduler_or_cls if isinstance(scheduler_or_cls, type) else type(scheduler_or_cls)
    return issubclass(cls, (gpukv033.Scheduler, gpukv033.AsyncScheduler))


def coordinator_name(scheduler: Any) -> str:
    """The class name of the KV-cache coordinator vLLM chose (for gpukv: the
    one it would have chosen, which gpukv's stand-in names)."""
    coordinator = scheduler.kv_cache_manager.coordinator
    return getattr(coordinator, "vllm_kind", type(coordinator).__name__)


def is_async(cls: type) -> bool:
    """Whether ``cls`` schedules asynchronously (vLLM's ``AsyncScheduler`` or a subclass)."""
    return issubclass(cls, VllmAsyncScheduler)


def scheduler_params(*, sync: bool = True, async_: bool = True) -> list[Any]:
    """``pytest.param``\\ s of scheduler classes, ids ``vllm``, ``vllm-async``
    and those of :data:`EXTRA_SCHEDULERS`; ``sync`` / ``async_`` pick the
    synchronous and the asynchronous ones."""
    classes = {"vllm": VllmScheduler, "vllm-async": VllmAsyncScheduler, **EXTRA_SCHEDULERS}
    return [pytest.param(cls, id=name) for name, cls in classes.items()
            if (async_ if is_async(cls) else sync)]


# ---------------------------------------------------------------- configs

@dataclass
class FakeModelConfig:
    """Stands in for ``vllm.config.ModelConfig`` (which loads the model's Hugging
    Face config): what vLLM 0.33's ``Scheduler.__init__`` (``uses_mrope``,
    ``is_encoder_decoder``, ``max_model_len``, ``runner_type``, ``is_diffusion``,
    ``supports_multimodal_inputs``, ``return_sampling_mask``), ``VllmConfig``'s
    properties (``multimodal_config``) and ``StructuredOutputManager``
    (``skip_tokenizer_init``, ``get_vocab_size``) read of it, for a text-only
    generative model."""

    max_model_len: int
    uses_mrope: bool = False
    is_encoder_decoder: bool = False
    runner_type: str = "generate"
    is_diffusion: bool = False
    supports_multimodal_inputs: bool = False
    return_sampling_mask: bool = False
    skip_tokenizer_init: bool = True
    multimodal_config: Any = None
    model: str = "fake-text-model"

    def get_vocab_size(self) -> int:
        return 50272


def kv_cache_groups(block_size: int, sliding_window: int | None, hybrid: bool,
                    second_window: int | None = None, mla: bool = False) -> list[Any]:
    """One full-attention group; one sliding-window group (``sliding_window``),
    and a second one of ``second_window`` tokens (two window specs: vLLM's
    first lookup group is then a window one); or, ``hybrid``, a
    full-attention group then a sliding-window one. ``mla``: MLA layers
    (``MLAAttentionSpec``, ``SlidingWindowMLASpec``: one latent per token)."""
    full_spec, window_spec = (MLAAttentionSpec, SlidingWindowMLASpec) if mla else (FullAttentionSpec,
                                                                                    SlidingWindowSpec)
    full = full_spec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    if sliding_window is None:
        return [KVCacheGroupSpec(["full.0"], full)]

    def window(name: str, tokens: int) -> Any:
        return KVCacheGroupSpec([name], window_spec(block_size=block_size, num_kv_heads=1, head_size=1,
                                                    dtype=torch.float32, sliding_window=tokens))

    if second_window is not None:
        return [window("window.0", sliding_window), window("window.1", second_window)]
    if not hybrid:
        return [window("window.0", sliding_window)]
    return [KVCacheGroupSpec(["full.0"], full), window("window.0", sliding_window)]


def make_vllm_config(*, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                     enable_prefix_caching: bool, long_prefill_token_threshold: int, block_size: int,
                     num_speculative_tokens: int | None, async_scheduling: bool,
                     enable_kv_cache_events: bool, hash_algo: str, scheduler_options: Mapping[str, Any],
                     watermark: float = 0.0) -> Any:
    """A ``VllmConfig`` as the engine has it after start-up, on a CPU device,
    with :class:`FakeModelConfig` set after construction (``__post_init__``
    would otherwise verify a real model config against the others)."""
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold, enable_chunked_prefill=True,
        is_encoder_decoder=False, watermark=watermark, async_scheduling=async_scheduling, **scheduler_options)
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=enable_prefix_caching, prefix_caching_hash_algo=hash_algo)
    speculative_config = None
    if num_speculative_tokens is not None:
        speculative_config = SpeculativeConfig(model="ngram", num_speculative_tokens=num_speculative_tokens)
    events_config = None
    if enable_kv_cache_events:
        events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    vllm_config = VllmConfig(scheduler_config=scheduler_config, cache_config=cache_config,
                             speculative_config=speculative_config, kv_events_config=events_config,
                             device_config=DeviceConfig(device="cpu"))
    vllm_config.model_config = FakeModelConfig(max_model_len=max_model_len)
    return vllm_config


def make_scheduler(
    cls: type = VllmScheduler,
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = True,
    long_prefill_token_threshold: int = 0,
    adaptive_threshold: bool = False,
    num_blocks: int = 10000,
    block_size: int = 16,
    num_speculative_tokens: int | None = None,
    sliding_window: int | None = None,
    hybrid: bool = False,
    second_window: int | None = None,
    mla: bool = False,
    enable_kv_cache_events: bool = False,
    hash_algo: str = "sha256",
    model_runner_v2: bool = True,
    log_stats: bool = True,
    include_finished_set: bool = False,
    cache_aware_window: int = 0,
    cache_aware_threshold: float = 0.0,
    watermark: float = 0.0,
    policy: str = "fcfs",
    max_loras: int = 0,
    prefill_schedule_interval: int = 1,
    encoder_budget: int = 0,
) -> Any:
    """A scheduler of class ``cls`` built as ``EngineCore.__init__`` builds one.

    * ``max_model_len``: None for ``max_num_batched_tokens``.
    * ``adaptive_threshold``: the long-prefill threshold floored at a fair
      share of the budget (``long_prefill_token_threshold_adaptive``).
    * ``num_blocks`` blocks in the pool, block 0 of it the null block;
      ``block_size`` is the scheduler's and the hash block size (one size).
    * ``sliding_window`` / ``hybrid`` / ``second_window`` / ``mla``: the KV-cache groups (:func:`kv_cache_groups`).
    * ``num_speculative_tokens``: an n-gram ``SpeculativeConfig`` (no lookahead
      slots; drafts come back through ``update_draft_token_ids``).
    * ``enable_kv_cache_events``: a ``KVEventsConfig`` with the null publisher,
      so ``kv_cache_manager.take_events()`` returns the events.
    * ``model_runner_v2``: the model runner the scheduler writes for (vLLM's
      default on CUDA with Triton: V2, which gets resumed requests as new ones).
    * async scheduling is on exactly when ``cls`` is an ``AsyncScheduler``.
    * ``watermark``: the scheduler config's (the fraction of the pool an
      admission leaves free).
    * ``policy``: the scheduler config's (``"priority"``: the waiting queue by
      priority, the preempted request the running one of lowest priority).
    * ``max_loras``: a ``LoRAConfig`` allowing that many adapters a step (0:
      none; LoRA requests then run unconstrained).
    * ``prefill_schedule_interval``: the scheduler config's prefill cadence
      (> 1: prefills held until that many steps passed since the last one).
    * ``encoder_budget``: the encoder's compute budget and cache, in tokens,
      a multimodal model's (0: a text model's, which schedules no encoder
      input; the fake model config has no multimodal registry to size them).
    * ``cache_aware_window`` (vLLM 0.34 on; skipped before): the scheduler
      config's ``cache_aware_admission_window``, engaging from
      ``cache_aware_threshold`` usage.
    """
    scheduler_options: dict[str, Any] = {} if policy == "fcfs" else {"policy": policy}
    if prefill_schedule_interval != 1:
        scheduler_options["prefill_schedule_interval"] = prefill_schedule_interval
    if adaptive_threshold:
        scheduler_options["long_prefill_token_threshold_adaptive"] = True
    if cache_aware_window:
        if not HAS_CACHE_AWARE_ADMISSION:
            pytest.skip(f"vLLM {vllm.__version__} has no cache-aware admission")
        scheduler_options |= dict(cache_aware_admission_window=cache_aware_window,
                                  cache_aware_admission_threshold=cache_aware_threshold)
    max_model_len = max_num_batched_tokens if max_model_len is None else max_model_len
    vllm_config = make_vllm_config(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching, long_prefill_token_threshold=long_prefill_token_threshold,
        block_size=block_size, num_speculative_tokens=num_speculative_tokens, async_scheduling=is_async(cls),
        enable_kv_cache_events=enable_kv_cache_events, hash_algo=hash_algo, scheduler_options=scheduler_options,
        watermark=watermark)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=kv_cache_groups(block_size, sliding_window, hybrid,
                                                                                    second_window, mla))
    vllm_config.cache_config.num_gpu_blocks = num_blocks  # what the engine sets after profiling memory
    if max_loras:
        vllm_config.lora_config = LoRAConfig(max_loras=max_loras, max_lora_rank=8)
    try:
        scheduler = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                        structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size,
                        hash_block_size=block_size, include_finished_set=include_finished_set, log_stats=log_stats)
    except gpukv033.UnsupportedConfigError as exc:  # a configuration gpukv refuses, by design (its message says why)
        pytest.skip(f"{cls.__name__} refuses this configuration: {exc}")
    if encoder_budget:
        scheduler.max_num_encoder_input_tokens = encoder_budget
        scheduler.encoder_cache_manager = EncoderCacheManager.create_manager(cache_size=encoder_budget,
                                                                             vllm_config=vllm_config)
    if enable_kv_cache_events:
        scheduler.kv_event_publisher = EventRecorder()  # what a subscriber to the ZMQ publisher receives
    if HAS_V1_MODEL_RUNNER:
        scheduler.use_v2_model_runner = model_runner_v2  # as vLLM's own tests set it, after construction
    elif not model_runner_v2:
        pytest.skip(f"vLLM {vllm.__version__} has no V1 model runner (Model Runner V2 is its only one)")
    scheduler.harness_block_size = block_size  # make_requests hashes at the scheduler's block size
    scheduler.harness_hash_algo = hash_algo
    # EngineCore.__init__ next: a request block hasher only if the flag is still set after the scheduler's build
    # (gpukv's scheduler clears it until its first add_request: gpukv.vllm.v0_33.engine_hashing).
    scheduler.harness_hasher = (block_hasher(block_size, hash_algo) if vllm_config.cache_config.enable_prefix_caching
                                else None)
    return scheduler


class EventRecorder:
    """Stands in for the scheduler's ``kv_event_publisher``: keeps every
    ``KVEventBatch`` that ``update_from_output`` publishes (the manager's
    ``take_events()`` drained each step), as a router subscribed to the ZMQ
    publisher would receive them."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass

    def take(self) -> list[Any]:
        """The events published since the last call, in order."""
        events = [event for batch in self.batches for event in batch.events]
        self.batches = []
        return events


# ---------------------------------------------------------------- requests

_none_hash_for: list[str] = []


def block_hasher(block_size: int, hash_algo: str = "sha256") -> Callable[[Any], list[Any]]:
    """The engine's ``block_hasher`` for requests (``EngineCore.__init__``):
    ``NONE_HASH`` initialised for ``hash_algo`` (a module global in vLLM, set
    again only when the algorithm changes), block hashes at ``block_size``."""
    hash_fn = get_hash_fn_by_name(hash_algo)
    if _none_hash_for[-1:] != [hash_algo]:
        init_none_hash(hash_fn)
        _none_hash_for.append(hash_algo)
    return get_request_block_hasher(block_size, hash_fn)


def make_requests(
    num_requests: int,
    num_tokens: int = 10,
    *,
    prompt: Callable[[int], Sequence[int]] | None = None,
    first_id: int = 0,
    max_tokens: int = 16,
    ignore_eos: bool = False,
    stop_token_ids: Sequence[int] | None = None,
    prompt_logprobs: int | None = None,
    prompt_logprob_start: int | None = None,
    block_size: int = 16,
    hash_algo: str = "sha256",
    scheduler: Any = None,
    lora_request: Any = None,
    cache_salt: str | None = None,
    priority: int = 0,
    mm_items: Sequence[tuple[str, int, int]] = (),
) -> list[Any]:
    """``num_requests`` vLLM ``Request``\\ s with ids ``str(first_id + i)``.

    Request ``i``'s prompt is ``prompt(i)``, by default ``num_tokens`` copies of
    token ``first_id + i`` (no two requests share a block). Each stops on
    ``EOS_TOKEN_ID`` unless ``ignore_eos`` (set as the engine does, through
    ``update_from_generation_config``). Block hashes at ``block_size`` with
    ``hash_algo``; with ``scheduler``, those its engine would compute (none
    when gpukv's scheduler took the hashing over). ``lora_request`` (a
    ``LoRARequest``), ``cache_salt`` and ``priority``: every request's; so
    are ``mm_items``, its multimodal inputs as ``(identifier, offset,
    length)`` (images, their placeholder ranges in the prompt).
    """
    hasher = scheduler.harness_hasher if scheduler is not None else block_hasher(block_size, hash_algo)
    requests = []
    for i in range(num_requests):
        rid = first_id + i
        tokens = list(prompt(i)) if prompt is not None else [rid] * num_tokens
        # (0.34: scoring from a start reads the cache before it only when asked to, as vLLM's docs say)
        start = {} if prompt_logprob_start is None else {"prompt_logprob_start": prompt_logprob_start,
                                                          "skip_reading_prefix_cache": False}
        params = SamplingParams(ignore_eos=ignore_eos, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs,
                                stop_token_ids=list(stop_token_ids) if stop_token_ids is not None else None, **start)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        requests.append(Request(request_id=str(rid), prompt_token_ids=tokens, sampling_params=params,
                                pooling_params=None, arrival_time=0.0, block_hasher=hasher,
                                lora_request=lora_request, cache_salt=cache_salt, priority=priority,
                                mm_features=[MultiModalFeatureSpec(data=None, modality="image", identifier=name,
                                                                   mm_position=PlaceholderRange(offset, length),
                                                                   mm_hash=name)
                                             for name, offset, length in mm_items] or None))
    return requests


# ---------------------------------------------------------------- the model runner's side

#: ``sample(request, drafts)``: ``drafts`` are the draft tokens scheduled for
#: the request this step (``scheduled_spec_decode_tokens``; -1 placeholders
#: under async scheduling), since ``schedule()`` has cleared its own.
Sampler = Callable[[Any, Sequence[int]], "int | Sequence[int]"]


def _constant_sampler(request: Any, drafts: Sequence[int]) -> int:  # noqa: ARG001
    return SAMPLED_TOKEN_ID


def model_output(scheduler: Any, out: Any, sample: Sampler | None = None, *,
                 sampled: Mapping[str, Sequence[int]] | None = None) -> Any:
    """The ``ModelRunnerOutput`` a model runner returns for ``out``; call it
    right after ``schedule()``. A request whose prefill this step does not
    finish (``is_prefill_chunk``) gets ``[]``, as the GPU model runner discards
    a partial prefill's sample; any other gets ``sampled[req_id]`` if given,
    else ``sample(request, drafts)`` (``drafts``: the step's scheduled drafts
    for it; returns a token, or a list: accepted drafts then the bonus
    token), by default ``[SAMPLED_TOKEN_ID]``."""
    sample = sample or _constant_sampler
    ids = list(out.num_scheduled_tokens)
    lists: list[list[int]] = []
    for rid in ids:
        request = scheduler.requests[rid]
        if request.is_prefill_chunk:
            lists.append([])
        elif sampled is not None and rid in sampled:
            lists.append(list(sampled[rid]))
        else:
            got = sample(request, out.scheduled_spec_decode_tokens.get(rid, ()))
            lists.append([got] if isinstance(got, int) else list(got))
    extra = {"req_id_to_index": {rid: i for i, rid in enumerate(ids)}} if _RUNNER_OUTPUT_HAS_INDEX else {}
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=lists, **extra)


HAS_V1_MODEL_RUNNER = hasattr(VllmConfig, "use_v2_model_runner")
"""vLLM 0.33 still writes for Model Runner V1 when asked (``use_v2_model_runner``); 0.34 has V2 alone."""

def vllm_version() -> str:
    return vllm.__version__


HAS_COMMON_PREFIX_BLOCKS = hasattr(VllmKVCacheManager, "get_num_common_prefix_blocks")
"""vLLM 0.33 keeps the deprecated cascade-attention call (always 0s); 0.34 removed it."""

HIT_LIMIT = hasattr(Request, "get_max_cache_hit_length")
"""vLLM 0.34 bounds a request's hits (``prefix_cache_hit_limit``, ``prompt_logprob_start``); 0.33 has a skip flag."""

HAS_CACHE_AWARE_ADMISSION = "cache_aware_admission_window" in SchedulerConfig.__dataclass_fields__
"""vLLM 0.34's waiting queue reordered by cached prefix (``cache_aware_admission_window``)."""

_RUNNER_OUTPUT_HAS_INDEX = "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__
"""vLLM 0.33's ``ModelRunnerOutput`` maps ids to rows; 0.34's follows ``req_ids``' order alone."""


@dataclass
class Engine:
    """The engine loop around a scheduler, as ``EngineCore`` runs it.

    Synchronous (``Scheduler``): each :meth:`step` schedules, answers and
    updates. Asynchronous (``AsyncScheduler``): up to two scheduled batches are
    in flight, and a step completes the oldest when two are (or when nothing
    new was scheduled), as ``step_with_batch_queue`` does. A batch's model
    answer is made when it is scheduled (what the GPU would sample).
    ``drafts(request)``: the draft tokens the proposer returns for a request
    after an update (None: no speculative decoding), handed back through
    ``update_draft_token_ids`` as ``EngineCore.post_step`` does.
    ``outputs``: every ``SchedulerOutput`` in order; ``results``: every
    ``update_from_output`` return value in order.
    """

    scheduler: Any
    sample: Sampler | None = None
    drafts: Callable[[Any], Sequence[int]] | None = None
    tables: BlockTables | None = None
    outputs: list[Any] = field(default_factory=list)
    results: list[dict[int, Any]] = field(default_factory=list)
    in_flight: deque[tuple[Any, Any]] = field(default_factory=deque)

    @property
    def depth(self) -> int:
        return 2 if is_async(type(self.scheduler)) else 1

    def add(self, requests: Iterable[Any]) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def schedule(self, sampled: Mapping[str, Sequence[int]] | None = None) -> Any:
        """``schedule()`` and the model's answer to it, kept in flight."""
        out = self.scheduler.schedule()
        self.outputs.append(out)
        if self.tables is not None:
            self.tables.update(out)
            self.tables.check(self.scheduler)
        self.in_flight.append((out, model_output(self.scheduler, out, self.sample, sampled=sampled)))
        return out

    def complete(self) -> dict[int, Any]:
        """``update_from_output`` for the oldest batch in flight, then the drafts."""
        out, answer = self.in_flight.popleft()
        result = self.scheduler.update_from_output(out, answer)
        self.results.append(result)
        # EngineCore.post_step: drafts go back only without async scheduling
        # (an AsyncScheduler's drafts stay on the worker; it schedules placeholders).
        if self.drafts is not None and self.depth == 1 and out.total_num_scheduled_tokens > 0:
            self._hand_back_drafts(answer.req_ids)
        return result

    def _hand_back_drafts(self, req_ids: Sequence[str]) -> None:
        live = [rid for rid in req_ids if rid in self.scheduler.requests]
        drafts = [list(self.drafts(self.scheduler.requests[rid])) for rid in live]
        self.scheduler.update_draft_token_ids(DraftTokenIds(req_ids=live, draft_token_ids=drafts))

    def step(self, sampled: Mapping[str, Sequence[int]] | None = None) -> Any:
        """One engine step (``EngineCore.step`` / ``step_with_batch_queue``):
        schedule when the scheduler has requests; return at once while the
        queue has room and the batch ran (or more requests wait); else complete
        the oldest batch. Returns the new ``SchedulerOutput``, or None."""
        out = None
        if self.scheduler.has_requests():
            out = self.schedule(sampled)
            ran = out.total_num_scheduled_tokens > 0
            if len(self.in_flight) < self.depth and (ran or self.scheduler.has_requests()):
                return out
        elif not self.in_flight:
            return None
        self.complete()
        return out

    def drain(self) -> None:
        while self.in_flight:
            self.complete()

    def run_until_idle(self, max_steps: int = 1000) -> int:
        """Steps until no request is unfinished and nothing is in flight;
        returns the steps taken. Fails if ``max_steps`` pass first."""
        for n in range(max_steps):
            if not self.scheduler.has_requests() and not self.in_flight:
                return n
            self.step()
        raise AssertionError(f"still {self.scheduler.get_request_counts()} (running, waiting) "
                             f"after {max_steps} steps")

    def finished(self) -> dict[str, Any]:
        """Every ``EngineCoreOutput`` that carried a finish reason, by request id."""
        return {o.request_id: o for result in self.results for eco in result.values() for o in eco.outputs
                if o.finish_reason is not None}

    def tokens(self, request_id: str) -> list[int]:
        """The tokens the engine returned for a request, in order."""
        return [t for result in self.results for eco in result.values() for o in eco.outputs
                if o.request_id == request_id for t in o.new_token_ids]


def stats_of(results: dict[int, Any]) -> Any:
    """The ``SchedulerStats`` one ``update_from_output`` returned (None if none)."""
    for eco in results.values():
        if eco.scheduler_stats is not None:
            return eco.scheduler_stats
    return None


# ---------------------------------------------------------------- the KV cache, as tests see it

class KVView:
    """The facts about a scheduler's KV cache that tests assert, through the
    manager's public interface where it has one (``get_block_ids``, ``usage``)
    and through vLLM's ``block_pool`` otherwise (a gpukv scheduler:
    :class:`GpukvKVView`, the same facts from the gpukv manager). Block ids
    count from 0, the null block."""

    def __new__(cls, scheduler: Any) -> Any:
        if cls is KVView and is_gpukv(scheduler):
            return super().__new__(GpukvKVView)
        return super().__new__(cls)

    def __init__(self, scheduler: Any) -> None:
        self.kvm = scheduler.kv_cache_manager
        self.pool = self.kvm.block_pool

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (empty lists if it holds none)."""
        return self.kvm.get_block_ids(request_id)

    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones among them); the null block is never free."""
        return self.pool.get_num_free_blocks()

    def free_queue(self) -> list[int]:
        """Free block ids in eviction order: the next allocation takes from the front."""
        return [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]

    def cached_block_ids(self) -> set[int]:
        """Ids of the blocks the prefix cache can hit."""
        return {b.block_id for b in self.pool.blocks if b.block_hash is not None}

    def ref_counts(self) -> dict[int, int]:
        """Reference count of every block some request holds."""
        return {b.block_id: b.ref_cnt for b in self.pool.blocks if b.ref_cnt > 0 and not b.is_null}

    def assert_empty(self) -> None:
        """No request holds a block: every block but the null one is free."""
        assert self.ref_counts() == {}
        assert self.num_free_blocks() == self.pool.num_gpu_blocks - 1
        assert self.kvm.usage == 0.0


class GpukvKVView(KVView):
    """:class:`KVView` of a gpukv scheduler: the same facts read from the
    gpukv manager under the adapter (``kv_cache_manager.manager``), the
    reference's host state or the device pool's host views."""

    def __init__(self, scheduler: Any) -> None:
        self.kvm = scheduler.kv_cache_manager
        self.manager = self.kvm.manager
        self.device = self.kvm.backend == "device"

    def num_free_blocks(self) -> int:
        return self.manager.read_num_free_blocks()

    def free_queue(self) -> list[int]:
        return self.manager.free_queue()

    def cached_block_ids(self) -> set[int]:
        table = self.manager.pool.table_entries() if self.device else self.manager.pool.table()
        return {b for blocks in table.values() for b in blocks}

    def ref_counts(self) -> dict[int, int]:
        counts = self.manager.pool.ref_counts() if self.device else self.manager.pool.ref_cnt
        return {b: int(n) for b, n in enumerate(counts) if b and n > 0}

    def assert_empty(self) -> None:
        assert self.ref_counts() == {}
        assert self.num_free_blocks() == self.kvm.num_gpu_blocks - 1
        assert self.kvm.usage == 0.0
        self.kvm.check_invariants()


class BlockTables:
    """The block table per request and group that a model runner rebuilds from
    the ``SchedulerOutput``\\ s alone: a new request's ``block_ids``, a running
    one's ``new_block_ids`` appended (None: nothing new), a resumed one's
    ``new_block_ids`` from scratch (model runner V1; V2 gets it as a new request)."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}

    def update(self, out: Any) -> None:
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(group) for group in new.block_ids]
        cached = out.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid in getattr(cached, "resumed_req_ids", ()):  # (a V1 model runner's; 0.34 re-sends them as new)
                self.tables[rid] = [list(group) for group in new_ids or ()]
            elif new_ids is not None:
                for table, group in zip(self.tables[rid], new_ids, strict=True):
                    table.extend(group)

    def check(self, scheduler: Any) -> None:
        """Every running request's table equals the blocks its manager holds,
        a position the manager has released behind a sliding window (now the
        null block, 0) excepted; and a gpukv reference adapter's invariants
        (the device's cost a second under the interpreter: checked at the
        end, ``KVView.assert_empty``)."""
        if is_gpukv(scheduler) and scheduler.kv_cache_manager.backend == "reference":
            scheduler.kv_cache_manager.check_invariants()
        view = KVView(scheduler)
        for request in scheduler.running:
            held = view.block_ids(request.request_id)
            table = self.tables[request.request_id]
            assert len(held) == len(table), (request.request_id, held, table)
            for group_held, group_table in zip(held, table, strict=True):
                assert len(group_held) == len(group_table), (request.request_id, held, table)
                assert all(h in (t, 0) for h, t in zip(group_held, group_table, strict=True)), \
                    (request.request_id, held, table)
