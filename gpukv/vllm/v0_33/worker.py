"""``gpukv.vllm.Worker``: vLLM's GPU worker whose Model Runner V2 reads
gpukv's device block tables (``--worker-cls gpukv.vllm.Worker`` with
``--scheduler-cls gpukv.vllm.AsyncScheduler``).

The model runner is vLLM's own; after it lays out its KV cache, its
``BlockTables`` becomes a ``GpukvBlockTables`` (``gpukv.vllm.v0_33.tables``):
gather and slot mapping read gpukv's table by gpukv's rows, and no block id
is staged or uploaded by the runner. The scheduler's gpukv manager finds the
runner through the process-local binding (``gpukv.vllm.v0_33.binding``):
the runner says what its tables need, the adapter sizes the device manager
to it (vLLM's ``max_num_reqs`` rows, table width W) and publishes it, and
the runner refuses if gpukv's table ever moves. That needs the scheduler and
the runner in one process: one GPU (vLLM's ``UniProcExecutor``). With tensor
or pipeline parallel size > 1 each rank is its own process, and the worker
refuses with an ``UnsupportedConfigError`` (use vLLM's worker; the gpukv
scheduler works as before). So do decode context parallelism and
speculative methods with a draft model (they read the tables at other
points of the step; n-gram and suffix decoding are fine).

Ordering under async scheduling (``gpukv.vllm.v0_33.ordering``): each read
of gpukv's tables waits for gpukv's writes so far, and gpukv's stream waits
on an event recorded right after it, so a row or block freed at update N
and handed out again at schedule N+1 is not rewritten before step N's
gather and slot mapping have read it.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu_worker import Worker as VllmWorker

from gpukv.vllm.v0_33.worker_config import check_worker_config

__all__ = ["Worker", "check_worker_config"]


class Worker(VllmWorker):
    """vLLM's ``Worker`` with a Model Runner V2 on gpukv's tables."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        check_worker_config(vllm_config)
        super().__init__(vllm_config, *args, **kwargs)

    def _make_model_runner(self) -> Any:
        from gpukv.vllm.v0_33.runner import gpukv_runner_class

        return gpukv_runner_class()(self.vllm_config, self.device)
