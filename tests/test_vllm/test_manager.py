"""``gpukv.vllm.KVCacheManager``: vLLM 0.8.5's manager interface, call by call.

Hand-worked cases against vLLM's own ``KVCacheManager`` (the resumed-request
lookup rule), and the adapter's refusals: bad input gets a typed
``gpukv.errors`` class and changes nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpukv.errors import GpukvInputError, InvalidInputError, InvalidTypeError
from tests.test_vllm.harness import (  # noqa: F401  (it skips the module without vLLM)
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    Request,
    RequestStatus,
    SamplingParams,
    VllmKVCacheManager,
)

BACKENDS = ["reference", "device"]


def kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    import torch

    spec = FullAttentionSpec(block_size, 1, 1, torch.float32, False)
    return KVCacheConfig(num_blocks=num_blocks, tensors={}, kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])


def vllm_manager(num_blocks: int, block_size: int, max_model_len: int = 64) -> Any:
    return VllmKVCacheManager(kv_cache_config(num_blocks, block_size), max_model_len, enable_caching=True,
                              log_stats=True)


def gpukv_manager(num_blocks: int, block_size: int, max_model_len: int = 64, **kwargs: Any) -> Any:
    from gpukv.vllm import KVCacheManager

    kwargs.setdefault("backend", "reference")
    return KVCacheManager(kv_cache_config(num_blocks, block_size), max_model_len, enable_caching=True,
                          log_stats=True, **kwargs)


def request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, multi_modal_inputs=None, multi_modal_hashes=None,
                   multi_modal_placeholders=None, sampling_params=SamplingParams(max_tokens=100),
                   eos_token_id=None, arrival_time=0)


def admit(m: Any, req: Request, num_tokens: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: look up, allocate, advance."""
    blocks, hit = m.get_computed_blocks(req)
    num_tokens = req.num_tokens - hit if num_tokens is None else num_tokens
    new = m.allocate_slots(req, num_tokens, blocks)
    if new is None:
        return None
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = hit + num_tokens
    return [b.block_id for b in blocks + new]


def decode(m: Any, req: Request, tokens: list[int]) -> list[int] | None:
    """A running request appends ``tokens`` (a multi-token append, as after
    speculative decoding) and computes them."""
    req.append_output_token_ids(tokens)
    new = m.allocate_slots(req, len(tokens))
    if new is not None:
        req.num_computed_tokens += len(tokens)
    return None if new is None else [b.block_id for b in new]


def resumed_hit(m: Any) -> int:
    """The smallest case of a resumed request's hit: block size 1, 9 blocks. A = [1,2,3] is
    computed and decodes [7,8]; B = [1,2,3] hits 2; a filler takes the last 2
    free blocks; B's decode of [7,8] does not fit and B is preempted; the
    filler finishes; B, now [1,2,3,7,8], is looked up again."""
    a, b, filler = request("A", [1, 2, 3]), request("B", [1, 2, 3]), request("F", [50, 51])
    assert admit(m, a) == [1, 2, 3]
    assert decode(m, a, [7, 8]) == [4, 5]
    assert m.get_computed_blocks(b)[1] == 2
    assert admit(m, b) == [1, 2, 6]
    assert admit(m, filler) == [7, 8]
    assert decode(m, b, [7, 8]) is None  # the scheduler preempts B
    m.free(b)
    b.status, b.num_computed_tokens = RequestStatus.PREEMPTED, 0
    filler.status = RequestStatus.FINISHED_STOPPED
    m.free(filler)
    m.free_block_hashes(filler)
    return m.get_computed_blocks(b)[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_resumed_request_looks_up_what_vllm_hashed(backend: str) -> None:
    """vLLM hits 3 tokens (it never hashed B's uncomputed [7, 8]); gpukv's
    default under vLLM does too, and ``lookup="all"`` finds the valid 4th."""
    assert resumed_hit(vllm_manager(9, 1)) == 3
    assert resumed_hit(gpukv_manager(9, 1, backend=backend)) == 3
    assert resumed_hit(gpukv_manager(9, 1, backend=backend, lookup="all")) == 4


def image_request(rid: str, tokens: list[int], hashes: list[str] | None, **params: Any) -> Request:
    from vllm.multimodal.inputs import MultiModalKwargs, PlaceholderRange

    return Request(request_id=rid, prompt_token_ids=tokens, multi_modal_inputs=[MultiModalKwargs({})],
                   multi_modal_hashes=hashes, multi_modal_placeholders=[PlaceholderRange(offset=0, length=4)],
                   sampling_params=SamplingParams(max_tokens=100, **params), eos_token_id=None, arrival_time=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_image_blocks_are_cached_under_their_image(backend: str) -> None:
    """A request's image is part of every digest its blocks are cached under,
    even when it asks for prompt logprobs (no lookup of its own): a text
    request with the same placeholder tokens, or another image, does not hit
    them, and the same image does."""
    for m in (vllm_manager(20, 4), gpukv_manager(20, 4, backend=backend)):
        assert admit(m, image_request("A", list(range(10)), ["img-1"], prompt_logprobs=1)) == [1, 2, 3]
        assert m.get_computed_blocks(request("text", list(range(10))))[1] == 0
        assert m.get_computed_blocks(image_request("other", list(range(10)), ["img-2"]))[1] == 0
        assert m.get_computed_blocks(image_request("same", list(range(10)), ["img-1"]))[1] == 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_blocks_are_cached_under_their_adapter(backend: str) -> None:
    from vllm.lora.request import LoRARequest

    def with_lora(rid: str, lora_id: int | None) -> Request:
        r = request(rid, list(range(10)))
        r.lora_request = None if lora_id is None else LoRARequest(f"adapter-{lora_id}", lora_id, "/nowhere")
        return r

    for m in (vllm_manager(20, 4), gpukv_manager(20, 4, backend=backend)):
        assert admit(m, with_lora("A", 1)) == [1, 2, 3]
        assert [m.get_computed_blocks(with_lora(f"q{i}", lid))[1] for i, lid in enumerate((None, 2, 1))] == [0, 0, 8]


def test_stats_in_blocks_as_vllm_counts() -> None:
    """vLLM 0.8.5's prefix-cache stats count requests, and queries and hits in blocks."""
    want, got = vllm_manager(9, 1), gpukv_manager(9, 1)
    for m in (want, got):
        resumed_hit(m)
    w, g = want.make_prefix_cache_stats(), got.make_prefix_cache_stats()
    assert (g.requests, g.queries, g.hits, g.reset) == (w.requests, w.queries, w.hits, w.reset) == (5, 10, 7, False)


# ---------------------------------------------------------------- refusals

def snapshot(m: Any) -> tuple:
    inner = m.manager
    return (inner.free_queue(), sorted((r, tuple(inner.get_block_ids(r)[0])) for r in inner.request_ids()),
            dict(m._rows), list(m._pending_free), dict(m._num_hashed))


def running_manager(backend: str) -> tuple[Any, Request]:
    m = gpukv_manager(20, 4, max_model_len=32, backend=backend)
    a = request("A", list(range(10)))
    assert admit(m, a) is not None
    return m, a


def _bad_calls() -> list[tuple[str, Any, type]]:
    """(name, call(manager, running request), the error class)."""
    def no_tokens(m: Any, _: Request) -> Any:
        return m.get_computed_blocks(request("E", []))

    def finished(m: Any, _: Request) -> Any:
        done = request("D", [1, 2, 3])
        done.status = RequestStatus.FINISHED_ABORTED
        return m.allocate_slots(done, 3)

    def double_free(m: Any, _: Request) -> Any:
        done = request("D", [1, 2, 3])
        assert admit(m, done) is not None
        done.status = RequestStatus.FINISHED_STOPPED
        m.free(done)
        m.free_block_hashes(done)
        return m.free(done)

    def more_tokens_than_known(m: Any, _: Request) -> Any:
        return m.allocate_slots(request("L", list(range(20))), 21)

    def too_long(m: Any, _: Request) -> Any:
        return m.get_computed_blocks(request("T", list(range(33))))

    def zero_tokens(m: Any, a: Request) -> Any:
        return m.allocate_slots(a, 0)

    def negative_lookahead(m: Any, a: Request) -> Any:
        return m.allocate_slots(a, 1, num_lookahead_tokens=-1)

    def forged_blocks(m: Any, _: Request) -> Any:
        from gpukv.vllm import Block

        other = request("F", list(range(10)))
        return m.allocate_slots(other, 2, [Block(1), Block(2)])

    def not_a_request(m: Any, _: Request) -> Any:
        return m.get_computed_blocks("A")

    def computed_blocks_for_running(m: Any, a: Request) -> Any:
        from gpukv.vllm import Block

        return m.allocate_slots(a, 1, [Block(1)])

    def image_without_hash(m: Any, _: Request) -> Any:
        return m.get_computed_blocks(image_request("I", list(range(10)), None))

    def common_prefix_of_waiting(m: Any, _: Request) -> Any:
        return m.get_num_common_prefix_blocks(request("W", [1, 2]), 1)

    return [
        ("no tokens", no_tokens, InvalidInputError),
        ("finished request", finished, InvalidInputError),
        ("double free", double_free, InvalidInputError),
        ("more tokens than the request has", more_tokens_than_known, InvalidInputError),
        ("request past max_model_len", too_long, InvalidInputError),
        ("zero tokens", zero_tokens, InvalidInputError),
        ("negative lookahead", negative_lookahead, InvalidInputError),
        ("blocks not from a lookup", forged_blocks, InvalidInputError),
        ("not a request", not_a_request, InvalidTypeError),
        ("computed blocks for a running request", computed_blocks_for_running, InvalidInputError),
        ("common prefix of a waiting request", common_prefix_of_waiting, InvalidInputError),
        ("an image without its hash", image_without_hash, InvalidInputError),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "call", "error"), _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_is_refused_and_changes_nothing(backend: str, name: str, call: Any, error: type) -> None:
    m, a = running_manager(backend)
    if name == "double free":  # its setup admits and frees a request: snapshot after that
        with pytest.raises(error):
            call(m, a)
    else:
        before = snapshot(m)
        with pytest.raises(error) as info:
            call(m, a)
        assert snapshot(m) == before
        assert isinstance(info.value, GpukvInputError)
    m.check_invariants()
    assert decode(m, a, [99]) is not None  # still working


@pytest.mark.parametrize("backend", BACKENDS)
def test_lookahead_is_capped_at_max_model_len_as_vllm_caps_blocks(backend: str) -> None:
    """vLLM caps a request's blocks at ``cdiv(max_model_len, block_size)``
    (EAGLE asks for lookahead slots near the end); so does the adapter."""
    want, got = vllm_manager(20, 4, max_model_len=32), gpukv_manager(20, 4, max_model_len=32, backend=backend)
    for m in (want, got):
        r = request("A", list(range(30)))
        blocks, hit = m.get_computed_blocks(r)
        new = m.allocate_slots(r, 30, blocks, num_lookahead_tokens=8)
        assert [b.block_id for b in new] == list(range(1, 9))


def test_unknown_backend_and_lookup_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="backend"):
        gpukv_manager(9, 1, backend="tpu")
    with pytest.raises(InvalidInputError, match="lookup"):
        gpukv_manager(9, 1, lookup="some")
