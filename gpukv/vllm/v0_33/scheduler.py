"""vLLM 0.33's v1 ``Scheduler`` and ``AsyncScheduler`` on gpukv:
``--scheduler-cls gpukv.vllm.AsyncScheduler`` (async scheduling, vLLM
0.33's default) or ``gpukv.vllm.Scheduler``.

vLLM's own scheduling loop, unchanged: after vLLM's ``__init__`` builds its
``KVCacheManager``, the mixin swaps in ``gpukv.vllm.v0_33.KVCacheManager``,
which answers every call as vLLM's manager does. A plain ``Scheduler``
subclass under async scheduling would run every other batch empty (the
output placeholders are ``AsyncScheduler``'s), hence the two classes.

The batched path (``batched``, the default): during ``schedule()`` the
running requests' allocations are answered on the host and applied as one
gpukv step (``gpukv.vllm.v0_33.pending``: one gpukv call and at most one
device read for the whole running loop, not one of each per request), and
a run of plain waiting requests is admitted in that same step, vLLM's
calls for them answered from it (``gpukv.vllm.v0_33.admissions``); other
admissions make one call each. KV events are regrouped into vLLM's per-call
order after the step (``gpukv.vllm.v0_33.events``). In models with
sliding-window groups the running loop is batched too, but for the calls
whose window release may free an uncached block (each made on the
per-request path in its turn: ``gpukv.vllm.v0_33.window_releases``), and
so are waiting runs (a hybrid model's shared-prefix boundaries from the
step's full-attention hits, or read from the event index call by call where
vLLM's first lookup group is a window one); ``Unbatched*`` classes never
batch.

Configurations the adapter does not follow are refused at construction with
an ``UnsupportedConfigError`` saying what and what to do
(``_refuse_unsupported``; ``gpukv/vllm/v0_33/manager.py`` lists them).
Sliding-window and hybrid models run on both, with or without speculative
decoding: with tokens in flight, window blocks are released behind vLLM's
processed tokens (``KVCacheManager._grow``).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

from gpukv.vllm.discarded import unlink_free_list
from gpukv.vllm.v0_8.manager import resolve_backend
from gpukv.vllm.v0_33 import engine_hashing
from gpukv.vllm.v0_33.admissions import long_prefill_cap, plain_run
from gpukv.vllm.v0_33.conformance import check_conformance, check_scheduler
from gpukv.vllm.v0_33.groups import UnsupportedConfigError, check_kv_cache_config
from gpukv.vllm.v0_33.manager import KVCacheManager
from gpukv.vllm.v0_33.screening import (
    check_request,
    prompt_refusal,
    refuse_at_arrival,
    refuse_sampled,
    sampled_refusals,
)


def _refuse_unsupported(scheduler: Any, kv_cache_config: Any) -> None:
    """Refuse what vLLM's constructor set up that the gpukv manager does not
    follow (the old manager is bound to connectors; Mamba, copy-on-write and
    zeroing need vLLM's pool)."""
    def refuse(what: str, fix: str) -> UnsupportedConfigError:
        return UnsupportedConfigError(f"gpukv's vLLM 0.33 scheduler does not support {what}",
                                      argument="vllm_config", fix=fix)

    check_kv_cache_config(kv_cache_config)
    if scheduler.connector is not None:
        raise refuse("a KV connector (kv_transfer_config)", "drop kv_transfer_config, or use vLLM's own scheduler")
    if scheduler.aux_output_connector is not None:
        raise refuse("the aux-output connector (aux_output_config.enabled)",
                     "turn aux_output_config off, or use vLLM's own scheduler")
    if scheduler.is_encoder_decoder:
        raise refuse("encoder-decoder models", "use vLLM's own scheduler")
    if scheduler.hash_block_size != scheduler.block_size:
        raise refuse(f"a hash block size ({scheduler.hash_block_size}) below the block size ({scheduler.block_size}): "
                     "fine-grained partial hits", "hash at the block size")
    if scheduler.use_eagle_block_drop:
        raise refuse("EAGLE's trailing-block drop", "use n-gram or draft-model speculation, or vLLM's own scheduler")
    if scheduler.num_hash_lookahead_tokens or scheduler.num_prefill_lookahead:
        raise refuse("hash or prefill lookahead tokens", "use vLLM's own scheduler")
    if scheduler.dcp_world_size > 1:
        raise refuse("decode context parallelism (decode_context_parallel_size > 1)", "use vLLM's own scheduler")


class _GpukvManagerMixin:
    """Swaps vLLM's ``KVCacheManager`` for gpukv's after vLLM's constructor.

    ``backend`` (class attribute): "auto" (the device manager on CUDA, the
    reference elsewhere), "reference" or "device". ``batched`` (class
    attribute, or set on an instance): the running loop's allocations as one
    gpukv step (True, the default) or one gpukv call each (False)."""

    backend = "auto"
    batched = True
    engine_hashes_blocks = True
    """Whether vLLM's engine builds its request block hasher for this
    scheduler: False when gpukv took the hashing over
    (``gpukv.vllm.v0_33.engine_hashing``) or prefix caching is off."""
    _flag_to_restore = False
    prepare_admissions_at_start: bool | None = None
    """Whether the device manager prepares every admission bucket a prompt up
    to ``max_model_len`` can meet, and every release bucket its free can, when
    the scheduler is built (``DeviceManager.prepare_admissions``: kernels
    compiled and launches kept before serving, not on the first admission of
    each prompt length or the first free of each size).
    None: on CUDA only (under Triton's interpreter every program of those
    launches runs on the host: about a minute at 128k tokens). When it does,
    the manager's request rows are made for ``max_num_seqs`` at once (else 64,
    grown when needed): a growth would drop every prepared launch."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        check_conformance()  # (the installed vLLM asks of its manager only what gpukv answers)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)  # type: ignore[call-arg]
        me: Any = self
        check_scheduler(me)
        _refuse_unsupported(me, kv_cache_config)
        unlink_free_list(me.kv_cache_manager)  # (vLLM's, replaced: freed now, not by a later full collection)
        backend = resolve_backend(self.backend)
        prepare = self.prepare_admissions_at_start
        prepare = backend == "device" and (torch.cuda.is_available() if prepare is None else prepare)
        # Rows for every running request when preparing (a growth would drop every prepared launch), else 64
        # at first, grown past when needed.
        rows = max(1, me.max_num_running_reqs) if prepare else min(max(1, me.max_num_running_reqs), 64)
        me.kv_cache_manager = KVCacheManager(
            kv_cache_config, me.max_model_len, enable_caching=bool(me.cache_config.enable_prefix_caching),
            log_stats=me.log_stats, enable_kv_cache_events=me.enable_kv_cache_events,
            watermark=me.scheduler_config.watermark, max_in_flight_tokens=me.vllm_config.max_in_flight_tokens,
            backend=backend,
            max_num_reqs=rows,
            max_num_batched_tokens=getattr(me, "max_num_scheduled_tokens", None))  # (None: sized by the prompts)
        if prepare:
            self.prepare_admissions()
        # gpukv hashes every token itself: the engine, built on after this, needs no block hasher.
        self._flag_to_restore = engine_hashing.hand_over(me, me.kv_cache_manager.reads_vllm_hashes)
        self.engine_hashes_blocks = bool(me.cache_config.enable_prefix_caching)

    def prepare_admissions(self) -> int:
        """The device manager's admission and release buckets for every prompt
        up to ``max_model_len`` prepared (``DeviceManager.prepare_admissions``),
        what the constructor does when ``prepare_admissions_at_start`` says
        so; how many it prepared (0 on the reference manager)."""
        me: Any = self
        kv = me.kv_cache_manager
        if kv.backend != "device":
            return 0
        return kv.manager.prepare_admissions(min(me.max_model_len, kv.manager.max_model_len))

    def add_request(self, request: Any) -> None:
        """vLLM's ``add_request``; a request the adapter cannot serve is
        refused here, never inside ``schedule()``: finished as an error at
        the next ``update_from_output`` (``gpukv.vllm.v0_33.screening``)."""
        me: Any = self
        if self._flag_to_restore:  # (the engine's construction is over)
            engine_hashing.take_back(me)
            self._flag_to_restore = False
        if request.request_id not in me.requests:  # (a streaming session's next chunk is the session's)
            kv = me.kv_cache_manager
            error = prompt_refusal(request, kv.max_model_len, check_request, kv.lora_ids)
            if error is not None:
                refuse_at_arrival(me, request, error)
        super().add_request(request)  # type: ignore[misc]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's ``update_from_output``; a request given a token gpukv
        cannot hold is finished as an error in it, before gpukv sees it."""
        refused = sampled_refusals(model_runner_output)
        if refused:
            me: Any = self
            me.kv_cache_manager.refused.update(refused)
            refuse_sampled(me, refused)
        return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]

    def schedule(self, throttle_prefills: bool = False) -> Any:
        """vLLM's ``schedule()``; when ``batched``, the running loop's
        allocations as one gpukv step (applied before it returns) and a run
        of plain waiting requests admitted as one more
        (``gpukv.vllm.v0_33.admissions``)."""
        kv: Any = self.kv_cache_manager  # type: ignore[attr-defined]
        kv.batching = bool(self.batched)
        kv.num_scheduled_tokens = kv.num_scheduled_requests = 0
        kv.admissions.reset()
        if kv.batching:
            cap = long_prefill_cap(self)
            kv.waiting_run = lambda tokens: plain_run(self, kv, tokens, throttle_prefills, cap)
        try:
            out = super().schedule(throttle_prefills)  # type: ignore[misc]
        finally:
            kv.batching, kv.waiting_run = False, None
            kv.flush()
        kv.admissions.check_taken()  # (not over an exception vLLM raised: that one says more)
        return out


class Scheduler(_GpukvManagerMixin, VllmScheduler):
    """vLLM 0.33's ``Scheduler`` (synchronous) on gpukv's block manager."""


class AsyncScheduler(_GpukvManagerMixin, VllmAsyncScheduler):
    """vLLM 0.33's ``AsyncScheduler`` (async scheduling, the engine's default) on gpukv's block manager."""


class ReferenceScheduler(Scheduler):
    """``Scheduler`` on the reference manager (host, the executable spec)."""

    backend = "reference"


class ReferenceAsyncScheduler(AsyncScheduler):
    """``AsyncScheduler`` on the reference manager."""

    backend = "reference"


class DeviceScheduler(Scheduler):
    """``Scheduler`` on the device manager (Triton kernels; the interpreter without CUDA)."""

    backend = "device"


class DeviceAsyncScheduler(AsyncScheduler):
    """``AsyncScheduler`` on the device manager."""

    backend = "device"


class UnbatchedReferenceScheduler(ReferenceScheduler):
    """``ReferenceScheduler`` with one gpukv call per running request (vLLM's loop, no batched path)."""

    batched = False


class UnbatchedReferenceAsyncScheduler(ReferenceAsyncScheduler):
    """``ReferenceAsyncScheduler`` with one gpukv call per running request."""

    batched = False


class UnbatchedDeviceScheduler(DeviceScheduler):
    """``DeviceScheduler`` with one gpukv call per running request."""

    batched = False


class UnbatchedDeviceAsyncScheduler(DeviceAsyncScheduler):
    """``DeviceAsyncScheduler`` with one gpukv call per running request."""

    batched = False
