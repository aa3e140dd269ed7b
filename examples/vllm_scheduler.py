"""vLLM's own AsyncScheduler on gpukv's block manager, built as vLLM's engine
builds it, on a CPU machine: two requests that share a 32-token prefix, run
to the end with a stand-in model, what the second one reused, and the same
run on vLLM's own AsyncScheduler for comparison.

    python examples/vllm_scheduler.py         # with vLLM 0.33 or 0.34 installed (README: "Use with vLLM")

Under ``vllm serve`` none of this is written by hand: ``--scheduler-cls
gpukv.vllm.AsyncScheduler`` makes vLLM build the class below itself. What a
server has and a CPU machine lacks is the model: vLLM's ``ModelConfig``
loads the model's Hugging Face config, so a stand-in (``TextModel``) answers
the few fields the scheduler reads, and ``answer`` plays the model runner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# (first: importing gpukv.vllm switches on Triton's interpreter without CUDA before vLLM imports triton, and
# refuses an untested vLLM before anything is built; so not isort's order)
from gpukv.vllm import AsyncScheduler  # noqa: E402,I001
import torch  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK_SIZE = 16


@dataclass
class TextModel:
    """The fields of vLLM's ``ModelConfig`` its scheduler reads, for a text-only generative model."""

    max_model_len: int = 1024
    uses_mrope: bool = False
    is_encoder_decoder: bool = False
    runner_type: str = "generate"
    is_diffusion: bool = False
    supports_multimodal_inputs: bool = False
    return_sampling_mask: bool = False
    skip_tokenizer_init: bool = True
    multimodal_config: None = None
    model: str = "text-model"

    def get_vocab_size(self) -> int:
        return 32000


def build_scheduler(cls: type = AsyncScheduler, num_blocks: int = 64):
    """A scheduler of class ``cls`` (gpukv's ``AsyncScheduler`` by default) as
    vLLM's ``EngineCore`` builds the configured class."""
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                                         is_encoder_decoder=False, async_scheduling=True),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        device_config=DeviceConfig(device="cpu"))
    vllm_config.model_config = TextModel()  # (on a server: the model's own config)
    vllm_config.cache_config.num_gpu_blocks = num_blocks  # (on a server: what profiling the GPU's memory found)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=64, dtype=torch.float16)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
               structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK_SIZE,
               hash_block_size=BLOCK_SIZE, include_finished_set=False, log_stats=True)


def request(request_id: str, prompt: list[int]) -> Request:
    """A request as vLLM's engine makes it: its block hasher set (the engine's, sha256)."""
    init_none_hash(get_hash_fn_by_name("sha256"))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=params, pooling_params=None,
                   arrival_time=0.0,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, get_hash_fn_by_name("sha256")))


def answer(out) -> ModelRunnerOutput:
    """The model's answer to one step: token 7 for every request that finished its prompt."""
    ids = list(out.num_scheduled_tokens)
    rows = {"req_id_to_index": {rid: i for i, rid in enumerate(ids)}} if _ROWS_BY_ID else {}  # (0.33's field)
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids], **rows)


_ROWS_BY_ID = "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__


def run(scheduler) -> list[tuple[str, list[int], int]]:
    """Request a, then b (sharing a's first 32 tokens) once a has finished:
    each admission's blocks and tokens taken from the prefix cache."""
    admissions = []
    shared = list(range(100, 132))  # 32 tokens: two full blocks
    for rid, own in (("a", [1, 2, 3]), ("b", [4, 5])):
        scheduler.add_request(request(rid, shared + own))
        while scheduler.has_requests():
            out = scheduler.schedule()
            admissions += [(n.req_id, list(n.block_ids[0]), n.num_computed_tokens) for n in out.scheduled_new_reqs]
            scheduler.update_from_output(out, answer(out))
    return admissions


def main() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler

    gpukv_scheduler = build_scheduler()
    ours, vllms = run(gpukv_scheduler), run(build_scheduler(VllmAsyncScheduler))
    for rid, blocks, hit in ours:
        print(f"request {rid}: blocks {blocks}, {hit} tokens from the prefix cache")
    print(f"gpukv's block manager ({type(gpukv_scheduler.kv_cache_manager.manager).__name__}) made vLLM's own "
          f"decisions: {ours == vllms}")


if __name__ == "__main__":
    main()
