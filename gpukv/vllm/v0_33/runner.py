"""vLLM's Model Runner V2 with its block tables on gpukv's
(``gpukv.vllm.v0_33.tables``): the two points where the runner meets them.

* ``initialize_kv_cache``: vLLM's, then its ``BlockTables`` adopted (the
  layout handed to the binding, before the scheduler is built);
* ``add_requests``: vLLM's, then each new request's gpukv row recorded at
  vLLM's index for it (Model Runner V2 gets resumed requests as new ones,
  the only time a request's gpukv row changes).
"""

from __future__ import annotations

import functools
from typing import Any

from gpukv.vllm.v0_33.tables import adopt

__all__ = ["gpukv_runner_class"]


@functools.cache
def gpukv_runner_class() -> type:
    """The runner class (built on first use: vLLM's runner module is heavy)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    class GpukvModelRunner(GPUModelRunner):  # type: ignore[misc,valid-type]
        """vLLM's ``GPUModelRunner`` (V2) reading gpukv's tables."""

        def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
            super().initialize_kv_cache(*args, **kwargs)
            adopt(self.block_tables)

        def add_requests(self, scheduler_output: Any) -> None:
            super().add_requests(scheduler_output)
            index = self.req_states.req_id_to_index
            for new in scheduler_output.scheduled_new_reqs:
                self.block_tables.set_row(index[new.req_id], new.req_id)

    return GpukvModelRunner
