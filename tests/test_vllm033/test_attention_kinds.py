"""KV-cache groups followed by the manager vLLM runs them on.

vLLM picks each group's single-type manager from its spec registry (the
spec's class and the group's role). MLA layers (DeepSeek's latent attention,
``MLAAttentionSpec``, and ``SlidingWindowMLASpec``) run on vLLM's own
full-attention and sliding-window managers, so gpukv follows them, held to
vLLM step by step; a spec vLLM runs on any other manager (a subclass of
full attention with rules of its own among them) is refused.
"""

from __future__ import annotations

import pytest

# (vLLM's names through the harness, which skips this module where vLLM 0.33 is not importable)
from . import harness
from .harness import VllmAsyncScheduler, VllmScheduler, gpukv033, is_async, kv_cache_groups, make_scheduler, torch
from .streams import StreamConfig, coverage, run_stream

GPUKV = [pytest.param(gpukv033.ReferenceScheduler, id="gpukv-ref"),
         pytest.param(gpukv033.ReferenceAsyncScheduler, id="gpukv-ref-async")]
MLA_STREAMS = [
    pytest.param(dict(), id="mla"),  # drafts and KV events: the per-request path
    pytest.param(dict(kv_events=False, num_speculative_tokens=0), id="mla-batched"),
    pytest.param(dict(sliding_window=17, hybrid=True, num_blocks=20, num_speculative_tokens=0,
                      max_num_batched_tokens=32), id="mla-hybrid-window"),
]


def _kinds(records: list) -> set[str]:
    """The spec kinds the stored-block events name."""
    return {str(event[7]) for record in records for event in record.events if event[0] == "BlockStored"}


def _run_accepted(cls: type, config: StreamConfig) -> list:
    """``run_stream``, failing (not skipping) if gpukv refuses the configuration."""
    try:
        return run_stream(cls, config)
    except pytest.skip.Exception as exc:
        pytest.fail(f"{cls.__name__} refused an MLA configuration vLLM runs: {exc}")


def test_mla_groups_are_followed_as_vllms_full_attention_and_window_groups():
    check = gpukv033.groups.check_kv_cache_config

    def config(**shape: object) -> object:
        from vllm.v1.kv_cache_interface import KVCacheConfig

        return KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups(16, mla=True,
                                                                                                 **shape))

    full = check(config(sliding_window=None, hybrid=False), 512)
    assert (full.windows, full.admission_caps, full.lookup_order) == ((None,), (None,), ((0,),))
    hybrid = check(config(sliding_window=17, hybrid=True), 512, 32)
    # the window group's cap: cdiv(min(17 - 1 + 32, 512), 16) + 1 = 4 blocks; full attention looked up first
    assert (hybrid.windows, hybrid.admission_caps, hybrid.lookup_order) == ((None, 17), (None, 4), ((0,), (1,)))


@pytest.mark.parametrize("cls", GPUKV)
@pytest.mark.parametrize("options", MLA_STREAMS)
def test_gpukv_mla_streams_are_vllms_step_by_step(cls, options):
    """Every step's output, tokens, stats, usage and KV events (which name the
    MLA kinds) of a model of MLA layers equal vLLM's; on gpukv it was refused."""
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    config = StreamConfig(seed=0, mla=True, **options)
    expected = run_stream(vllm_cls, config, check_tables=False)
    got = _run_accepted(cls, config)
    for step, (want, have) in enumerate(zip(expected, got, strict=False)):
        assert have == want, f"step {step} differs"
    assert len(got) == len(expected)
    if config.kv_events:
        assert _kinds(expected) == ({"mla_attention", "sliding_window_mla"} if config.sliding_window
                                    else {"mla_attention"})


def test_gpukv_device_mla_stream_is_vllms_step_by_step():
    """The device backend on one short MLA stream with drafts and KV events."""
    config = StreamConfig(seed=3, num_requests=8, arrival_steps=4, max_output_tokens=16, mla=True)
    expected = run_stream(VllmScheduler, config, check_tables=False)
    got = _run_accepted(gpukv033.DeviceScheduler, config)
    counts = coverage(expected)
    assert all(counts[name] > 0 for name in ("hits", "chunks", "stored_events")), counts
    for step, (want, have) in enumerate(zip(expected, got, strict=False)):
        assert have == want, f"step {step} differs"
    assert len(got) == len(expected)


# Specs vLLM runs on managers of their own (each a KVCacheSpec subclass with the fields it needs):
# a full-attention subclass whose manager changes the rules, and other attention kinds.
OTHER_MANAGERS = [
    pytest.param("SinkFullAttentionSpec", {}, id="sink-full-attention"),
    pytest.param("RSWASpec", dict(rswa_window=32), id="rswa"),
    pytest.param("ChunkedLocalAttentionSpec", dict(attention_chunk_size=32), id="chunked-local"),
    pytest.param("CircularBufferSpec", {}, id="circular-buffer"),
    pytest.param("CrossAttentionSpec", {}, id="cross-attention"),
]


def _config(spec: object, **group: object) -> object:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l.0"], spec,
                                                                                               **group)])


@pytest.mark.parametrize(("name", "fields"), OTHER_MANAGERS)
def test_specs_vllm_runs_on_other_managers_are_refused(name, fields):
    from vllm.v1 import kv_cache_interface

    spec_cls = getattr(kv_cache_interface, name, None)
    if spec_cls is None:
        pytest.skip(f"this vLLM has no {name}")
    spec = spec_cls(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, **fields)
    with pytest.raises(gpukv033.UnsupportedConfigError, match=f"KV-cache spec {name};"):
        gpukv033.groups.check_kv_cache_config(_config(spec), 512)


def test_a_group_role_vllm_runs_on_another_manager_is_refused():
    from vllm.v1 import kv_cache_interface

    role = getattr(kv_cache_interface, "KVCacheGroupRole", None)
    if role is None:
        pytest.skip("this vLLM's KV-cache groups have no roles")
    spec = kv_cache_interface.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    gpukv033.groups.check_kv_cache_config(_config(spec), 512)  # (the default role: accepted)
    with pytest.raises(gpukv033.UnsupportedConfigError, match="FullAttentionSpec in role 'hisparse_source'"):
        gpukv033.groups.check_kv_cache_config(_config(spec, role=role.HISPARSE_SOURCE), 512)


def test_a_host_resident_group_is_refused():
    """A group whose blocks come from a pool of their own (vLLM's host pool)."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    if "host_resident" not in KVCacheGroupSpec.__dataclass_fields__:
        pytest.skip("this vLLM's KV-cache groups have no host pool")
    spec = harness.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    with pytest.raises(gpukv033.UnsupportedConfigError, match="host-resident KV-cache groups"):
        gpukv033.groups.check_kv_cache_config(_config(spec, host_resident=True), 512)


def test_the_scheduler_refuses_what_the_groups_refuse(monkeypatch):
    """Through the scheduler's constructor, as the engine builds it (the
    harness turns a refusal into a skip that names it)."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    spec = CircularBufferSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    monkeypatch.setattr(harness, "kv_cache_groups", lambda *_: _config(spec).kv_cache_groups)
    with pytest.raises(pytest.skip.Exception, match="refuses this configuration: .*KV-cache spec CircularBufferSpec"):
        make_scheduler(gpukv033.ReferenceScheduler)
    make_scheduler(VllmScheduler)  # (vLLM runs it)
