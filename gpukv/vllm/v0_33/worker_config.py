"""What ``gpukv.vllm.Worker`` refuses (``gpukv.vllm.v0_33.worker``'s
docstring says why), apart from vLLM's worker module, which imports a model
stack."""

from __future__ import annotations

from typing import Any

from gpukv.vllm.v0_33.groups import UnsupportedConfigError

__all__ = ["check_worker_config"]


def check_worker_config(vllm_config: Any) -> None:
    """Refuse what the gpukv worker cannot serve (module docstring)."""
    def refuse(what: str, fix: str) -> UnsupportedConfigError:
        return UnsupportedConfigError(f"gpukv's worker does not support {what}", argument="vllm_config", fix=fix)

    parallel = vllm_config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if tp * pp != 1:
        raise refuse(f"tensor parallel size {tp} with pipeline parallel size {pp} (the runner reads gpukv's tables "
                     "in the scheduler's process)", "drop --worker-cls: vLLM's worker runs gpukv's scheduler")
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        raise refuse("decode context parallelism", "drop --worker-cls gpukv.vllm.Worker")
    if not getattr(vllm_config, "use_v2_model_runner", True):
        raise refuse("Model Runner V1", "use Model Runner V2 (vLLM's default)")
    spec = vllm_config.speculative_config
    if spec is not None and spec.method not in ("ngram", "suffix"):
        raise refuse(f"speculative method {spec.method!r} (its drafter reads the tables)",
                     "use n-gram or suffix decoding, or drop --worker-cls gpukv.vllm.Worker")
