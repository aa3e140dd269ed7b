"""gpukv's adapter for vLLM 0.8.5 (``gpukv.vllm`` exports its names when that vLLM is installed).

* ``manager``: vLLM 0.8.5's ``KVCacheManager`` interface on a gpukv manager;
* ``scheduler``: vLLM's v1 ``Scheduler`` on it, batched or one call per request;
* ``batched_step`` and ``batched_update``: a batched ``schedule()`` and its
  ``update_from_output``;
* ``batch_rows``: vLLM's running requests as one gpukv ``RunningBatch``;
* ``checks``: the checks of what vLLM's scheduler hands the adapter.

Importing the package imports none of them (nor vLLM).
"""
