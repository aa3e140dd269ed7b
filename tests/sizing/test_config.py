"""Config generation, the memory check, unification and the memory budget,
with every expected number worked out by hand in the comments."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from gpukv.sizing.config import (
    available_kv_cache_memory,
    check_enough_kv_cache_memory,
    get_kv_cache_config,
    kv_cache_budget,
    unify_kv_cache_configs,
)
from gpukv.sizing.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

GiB = 1 << 30
MiB = 1 << 20
PAGE = 65536  # 2 * 16 tokens * 8 heads * 128 * 2 bytes (fp16)

FULL = FullAttentionSpec(16, 8, 128, torch.float16)
SW_1K = SlidingWindowSpec(16, 8, 128, torch.float16, 1024)


def llama(num_layers: int = 32) -> dict:
    """Llama-3-8B-like: 32 full-attention layers, each page 65536 bytes."""
    return {f"layers.{i}": FULL for i in range(num_layers)}


def gemma_like() -> dict:
    """12 layers, every 4th full attention, the rest a 1024-token window:
    sliding at 0,1,2, 4,5,6, 8,9,10; full at 3, 7, 11. One page size (65536)."""
    return {f"layers.{i}": (FULL if i % 4 == 3 else SW_1K) for i in range(12)}


# --------------------------------------------------------------------------
# uniform models


def test_uniform_llama_hand_computed(caplog):
    # 10 GiB / 65536 = 163840 pages, / 32 layers = 5120 blocks per layer.
    # Tokens: 5120 * 16 = 81920; concurrency at 8192: 81920 / 8192 = 10.00x.
    caplog.set_level(logging.INFO, logger="gpukv")
    config = get_kv_cache_config(llama(), 10 * GiB, max_model_len=8192)
    assert config.num_blocks == 5120
    assert len(config.tensors) == 32
    for i, tensor in enumerate(config.tensors):
        assert tensor.size == 65536 * 5120 == 320 * MiB
        assert tensor.shared_by == [f"layers.{i}"]
    assert config.kv_cache_groups == [
        KVCacheGroupSpec([f"layers.{i}" for i in range(32)], FULL)
    ]
    assert sum(t.size for t in config.tensors) == 10 * GiB
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 1
    assert "5,120 blocks" in lines[0]
    assert "81,920 tokens" in lines[0]
    assert "8,192 tokens per request: 10.00x" in lines[0]


def test_uniform_rounds_down():
    # (10 GiB + 12345) / 65536 = 163840.19 -> 163840 pages, / 32 = 5120 blocks.
    # 10 GiB - 1 byte: 163839 pages // 32 = 5119 blocks.
    assert get_kv_cache_config(llama(), 10 * GiB + 12345, max_model_len=8192).num_blocks == 5120
    assert get_kv_cache_config(llama(), 10 * GiB - 1, max_model_len=8192).num_blocks == 5119


def test_uniform_concurrency_two_decimals(caplog):
    # 3 layers, 1 GiB: 16384 pages // 3 = 5461 blocks = 87376 tokens;
    # 87376 / 10000 = 8.7376 -> "8.74x".
    caplog.set_level(logging.INFO, logger="gpukv")
    config = get_kv_cache_config(llama(3), GiB, max_model_len=10000)
    assert config.num_blocks == 5461
    assert "87,376 tokens" in caplog.text
    assert "10,000 tokens per request: 8.74x" in caplog.text


def test_override_replaces_num_blocks_and_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="gpukv")
    config = get_kv_cache_config(
        llama(), 10 * GiB, max_model_len=8192, num_gpu_blocks_override=1000
    )
    assert config.num_blocks == 1000
    assert all(t.size == 65536 * 1000 for t in config.tensors)
    assert "num_gpu_blocks_override=1000 replaces the 5120 blocks" in caplog.text
    assert "16,000 tokens" in caplog.text  # 1000 * 16


def test_override_smaller_than_one_request_warns(caplog):
    # An 8192-token request holds 512 blocks, + the null block = 513.
    caplog.set_level(logging.INFO, logger="gpukv")
    config = get_kv_cache_config(llama(), 10 * GiB, max_model_len=8192, num_gpu_blocks_override=512)
    assert config.num_blocks == 512
    assert "fewer than the 513 blocks" in caplog.text


def test_override_larger_than_memory_warns(caplog):
    caplog.set_level(logging.INFO, logger="gpukv")
    config = get_kv_cache_config(
        llama(), 10 * GiB, max_model_len=8192, num_gpu_blocks_override=6000
    )
    assert config.num_blocks == 6000
    assert any(r.levelno == logging.WARNING and "more blocks than fit" in r.getMessage()
               for r in caplog.records)


def test_uniform_sliding_window_only_model():
    # 4 sliding-window layers of one type: the uniform path, one group.
    # 64 MiB / 65536 = 1024 pages, / 4 layers = 256 blocks.
    specs = {f"sw.{i}": SW_1K for i in range(4)}
    config = get_kv_cache_config(specs, 64 * MiB, max_model_len=2048)
    assert config.num_blocks == 256
    assert config.kv_cache_groups == [KVCacheGroupSpec(list(specs), SW_1K)]


def test_mla_uniform():
    # MLA pages: 1 * 16 * 1 * 576 * 2 = 18432 bytes. 61 layers, 18 GiB:
    # 18 * 2**30 / 18432 = 1048576 pages (exact: 18432 = 18 * 1024),
    # // 61 = 17189 blocks.
    mla = FullAttentionSpec(16, 1, 576, torch.bfloat16, use_mla=True)
    specs = {f"layers.{i}": mla for i in range(61)}
    config = get_kv_cache_config(specs, 18 * GiB, max_model_len=32768)
    assert config.num_blocks == 17189
    assert config.tensors[0].size == 18432 * 17189


# --------------------------------------------------------------------------
# hybrid models


def test_hybrid_gemma_like_hand_computed(caplog):
    # Types in first-appearance order: sliding (9 layers), full (3 layers).
    # group_size: smallest = 3, largest = 9, and 9 >= 1.25 * 3, so 3.
    # Groups: sliding [0,1,2], [4,5,6], [8,9,10]; full [3,7,11].
    # num_blocks = 3 GiB / 65536 = 49152 pages, / 3 = 16384.
    # Tensors: 3, each 65536 * 16384 = 1 GiB, tensor i shared by the i-th
    # layer of each group.
    caplog.set_level(logging.INFO, logger="gpukv")
    config = get_kv_cache_config(gemma_like(), 3 * GiB, max_model_len=8192)
    assert config.num_blocks == 16384
    names = [g.layer_names for g in config.kv_cache_groups]
    assert names == [
        ["layers.0", "layers.1", "layers.2"],
        ["layers.4", "layers.5", "layers.6"],
        ["layers.8", "layers.9", "layers.10"],
        ["layers.3", "layers.7", "layers.11"],
    ]
    assert [g.kv_cache_spec for g in config.kv_cache_groups] == [SW_1K, SW_1K, SW_1K, FULL]
    assert [t.shared_by for t in config.tensors] == [
        ["layers.0", "layers.4", "layers.8", "layers.3"],
        ["layers.1", "layers.5", "layers.9", "layers.7"],
        ["layers.2", "layers.6", "layers.10", "layers.11"],
    ]
    assert all(t.size == GiB for t in config.tensors)
    # A max-length request: each sliding group min(1023 + 8192, 8192) = 8192
    # tokens -> 512 + 1 = 513 blocks; the full group 512. 3 * 513 + 512 = 2051
    # blocks; 16384 / 2051 = 7.988 -> "7.99x".
    assert "needs 2051 blocks" in caplog.text
    assert "7.99x" in caplog.text


def test_hybrid_concurrency_with_chunked_prefill(caplog):
    # Chunks of 2048: a sliding group needs min(1023 + 2048, 8192) = 3071 tokens
    # -> ceil(3071 / 16) = 192, + 1 = 193 blocks. 3 * 193 + 512 = 1091;
    # 16384 / 1091 = 15.017 -> "15.02x".
    caplog.set_level(logging.INFO, logger="gpukv")
    get_kv_cache_config(gemma_like(), 3 * GiB, max_model_len=8192, max_num_batched_tokens=2048)
    assert "needs 1091 blocks" in caplog.text
    assert "15.02x" in caplog.text


def test_hybrid_close_counts_pad_to_one_group_per_type():
    # 5 full + 6 sliding: 6 < 1.25 * 5 = 6.25, so group_size = 6: the full
    # group has 5 layers (padded), the sliding one 6.
    # (6 * 65536 * 200 + 777) / 65536 = 1200 pages (777 bytes left), / 6 = 200.
    specs = {f"full.{i}": FULL for i in range(5)} | {f"sw.{i}": SW_1K for i in range(6)}
    config = get_kv_cache_config(specs, 6 * PAGE * 200 + 777, max_model_len=1024)
    assert config.num_blocks == 200
    assert [g.layer_names for g in config.kv_cache_groups] == [
        [f"full.{i}" for i in range(5)],
        [f"sw.{i}" for i in range(6)],
    ]
    assert [t.shared_by for t in config.tensors] == [
        [f"full.{i}", f"sw.{i}"] for i in range(5)
    ] + [["sw.5"]]
    assert all(t.size == PAGE * 200 for t in config.tensors)


def test_padded_groups_cost_pool_blocks_the_per_layer_sum_misses():
    # The same 5 full + 6 sliding layers, max_model_len 1024. Per layer: full
    # 1024 / 16 = 64 pages, sliding min(1023 + 1024, 1024) = 1024 -> 64 + 1 = 65;
    # 5 * 64 + 6 * 65 = 710 pages, so 720 pages pass vLLM's per-layer check.
    # But the pool has 720 // 6 = 120 blocks and a request holds 64 + 65 = 129
    # of them, plus the null block: 130. Largest fitting length: 2 * ceil(L/16)
    # + 2 <= 120 -> ceil(L/16) <= 59 -> L = 944.
    specs = {f"full.{i}": FULL for i in range(5)} | {f"sw.{i}": SW_1K for i in range(6)}
    check_enough_kv_cache_memory(specs, 720 * PAGE, max_model_len=1024)
    with pytest.raises(ValueError) as info:
        get_kv_cache_config(specs, 720 * PAGE, max_model_len=1024)
    message = str(info.value)
    assert "needs 130 blocks of the shared pool (129 + the null block)" in message
    assert "the 0.04 GiB available hold only 120 blocks" in message
    assert "largest max_model_len that fits is 944" in message


def test_hybrid_exactly_one_and_a_quarter_does_not_pad():
    # 4 full + 5 sliding: 5 is not < 1.25 * 4 = 5, so group_size = 4:
    # full [0..3], sliding [0..3], [4]. 4 tensors; tensor 0 shared by
    # full.0, sw.0 and sw.4. num_blocks = 4 * 65536 * 100 / 65536 / 4 = 100
    # (a 512-token request holds 32 + 2 * 33 = 98 blocks, + null = 99: fits).
    specs = {f"full.{i}": FULL for i in range(4)} | {f"sw.{i}": SW_1K for i in range(5)}
    config = get_kv_cache_config(specs, 4 * PAGE * 100, max_model_len=512)
    assert config.num_blocks == 100
    assert [g.layer_names for g in config.kv_cache_groups] == [
        [f"full.{i}" for i in range(4)],
        [f"sw.{i}" for i in range(4)],
        ["sw.4"],
    ]
    assert [t.shared_by for t in config.tensors] == [
        ["full.0", "sw.0", "sw.4"], ["full.1", "sw.1"], ["full.2", "sw.2"], ["full.3", "sw.3"]
    ]


def test_hybrid_two_windows_are_two_types():
    # Two windows of the same page size: 2 layers each -> two groups of 2.
    # 2 * 65536 * 200 bytes / 65536 / 2 = 200 blocks.
    sw_4k = SlidingWindowSpec(16, 8, 128, torch.float16, 4096)
    specs = {"a": SW_1K, "b": sw_4k, "c": SW_1K, "d": sw_4k}
    config = get_kv_cache_config(specs, 2 * PAGE * 200, max_model_len=1024)
    assert config.num_blocks == 200
    assert [g.layer_names for g in config.kv_cache_groups] == [["a", "c"], ["b", "d"]]
    assert [t.shared_by for t in config.tensors] == [["a", "b"], ["c", "d"]]


def test_hybrid_override():
    config = get_kv_cache_config(
        gemma_like(), 3 * GiB, max_model_len=8192, num_gpu_blocks_override=100
    )
    assert config.num_blocks == 100
    assert all(t.size == PAGE * 100 for t in config.tensors)


def test_fallback_treats_sliding_window_as_full_attention(caplog):
    # The same 12 layers as one group of 12 full-attention layers:
    # 3 GiB / 65536 = 49152 pages, / 12 = 4096 blocks.
    caplog.set_level(logging.INFO, logger="gpukv")
    config = get_kv_cache_config(
        gemma_like(), 3 * GiB, max_model_len=8192, sliding_window_as_full_attention=True
    )
    assert config.num_blocks == 4096
    assert config.kv_cache_groups == [
        KVCacheGroupSpec([f"layers.{i}" for i in range(12)], FULL)
    ]
    assert [t.shared_by for t in config.tensors] == [[f"layers.{i}"] for i in range(12)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("9 sliding-window layer(s) as full attention" in w for w in warnings)


def test_fallback_checks_memory_with_full_attention_needs():
    # With 2048-token chunks a request needs, in pages: hybrid 3 * 512 (full)
    # + 9 * 193 (sliding) = 3273; as full attention 12 * 512 = 6144.
    # 4000 pages fit the first only.
    memory = 4000 * PAGE
    get_kv_cache_config(gemma_like(), memory, max_model_len=8192, max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match="not enough memory"):
        get_kv_cache_config(
            gemma_like(), memory, max_model_len=8192, max_num_batched_tokens=2048,
            sliding_window_as_full_attention=True,
        )


def test_mixed_page_sizes_raise_naming_layers_and_sizes():
    # Sliding layers with 4 heads: page 2 * 16 * 4 * 128 * 2 = 32768 bytes.
    narrow = SlidingWindowSpec(16, 4, 128, torch.float16, 1024)
    specs = {f"full.{i}": FULL for i in range(2)} | {f"sw.{i}": narrow for i in range(5)}
    expected = (
        r"page sizes disagree \(65536 bytes: layers full.0, full.1; "
        r"32768 bytes: layers sw.0, sw.1, sw.2 \(\+2 more\)\).*must agree"
    )
    with pytest.raises(ValueError, match=expected):
        get_kv_cache_config(specs, GiB, max_model_len=1024)
    # Treating the window as full attention keeps the page size: still an error.
    with pytest.raises(ValueError, match="page sizes disagree"):
        get_kv_cache_config(specs, GiB, max_model_len=1024, sliding_window_as_full_attention=True)


def test_mixed_block_sizes_with_equal_pages_raise():
    # 32-token blocks with 4 heads: 2 * 32 * 4 * 128 * 2 = 65536, same page as FULL.
    wide_blocks = SlidingWindowSpec(32, 4, 128, torch.float16, 1024)
    with pytest.raises(ValueError, match=r"block sizes disagree \(16 tokens: layers a; 32 tokens"):
        get_kv_cache_config({"a": FULL, "b": wide_blocks}, GiB, max_model_len=1024)


# --------------------------------------------------------------------------
# the memory check


def test_not_enough_memory_message_has_the_numbers():
    # One 8192-token request: 32 layers * 512 blocks * 65536 = 1 GiB.
    # 600 MiB available: 600 MiB / (32 * 65536 = 2 MiB per block of all layers)
    # = 300 blocks = 4800 tokens at most. 600 MiB = 0.5859 GiB -> "0.59".
    with pytest.raises(ValueError) as info:
        check_enough_kv_cache_memory(llama(), 600 * MiB, max_model_len=8192)
    message = str(info.value)
    assert "needs 1.00 GiB" in message
    assert "only 0.59 GiB is available" in message
    assert "largest max_model_len that fits is 4800" in message
    assert "gpu_memory_utilization" in message and "lower max_model_len" in message


def test_largest_fitting_length_is_exact():
    # 4800 tokens need 300 blocks * 2 MiB = 600 MiB exactly: fits. 4801 does not.
    check_enough_kv_cache_memory(llama(), 600 * MiB, max_model_len=4800)
    with pytest.raises(ValueError, match="fits is 4800"):
        check_enough_kv_cache_memory(llama(), 600 * MiB, max_model_len=4801)


def test_not_enough_for_one_token():
    # One token needs one block in each of 32 layers: 2 MiB > 1 MiB.
    with pytest.raises(ValueError, match="Not even a 1-token request fits"):
        check_enough_kv_cache_memory(llama(), MiB, max_model_len=8192)


@pytest.mark.parametrize("memory", [0, -1])
def test_no_memory_left(memory):
    with pytest.raises(ValueError, match="no memory left for the KV cache.*gpu_memory_utilization"):
        check_enough_kv_cache_memory(llama(), memory, max_model_len=8192)


def test_get_kv_cache_config_checks_memory():
    with pytest.raises(ValueError, match="no memory left"):
        get_kv_cache_config(llama(), 0, max_model_len=8192)
    with pytest.raises(ValueError, match="needs 1.00 GiB"):
        get_kv_cache_config(llama(), GiB - 1, max_model_len=8192)


def test_pool_counts_the_null_block():
    # 1 GiB: 512 blocks per layer, exactly one 8192-token request by the
    # per-layer sum; but block 0 is the null block, so 511 are allocatable.
    # Largest length: ceil(L / 16) + 1 <= 512 -> L = 511 * 16 = 8176.
    check_enough_kv_cache_memory(llama(), GiB, max_model_len=8192)
    with pytest.raises(ValueError) as info:
        get_kv_cache_config(llama(), GiB, max_model_len=8192)
    message = str(info.value)
    assert "needs 513 blocks of the shared pool (512 + the null block), 1.00 GiB" in message
    assert "the 1.00 GiB available hold only 512 blocks" in message
    assert "largest max_model_len that fits is 8176" in message
    # One block more (2 MiB over 32 layers) and it fits.
    assert get_kv_cache_config(llama(), GiB + 2 * MiB, max_model_len=8192).num_blocks == 513


# --------------------------------------------------------------------------
# bad inputs


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kv_cache_spec": {}}, ValueError, "kv_cache_spec is empty"),
        ({"kv_cache_spec": [FULL]}, TypeError, "must be a dict"),
        ({"kv_cache_spec": {"a": "full"}}, TypeError, "layer 'a' has str"),
        ({"kv_cache_spec": {0: FULL}}, TypeError, "layer names must be str"),
        ({"available_memory": -1}, ValueError, "available_memory must be >= 0 bytes, got -1"),
        ({"available_memory": 1e9}, TypeError, "available_memory must be an int"),
        ({"max_model_len": 0}, ValueError, "max_model_len must be a positive int, got 0"),
        ({"max_model_len": -8}, ValueError, "max_model_len must be a positive int, got -8"),
        ({"max_model_len": 8192.0}, TypeError, "max_model_len must be an int"),
        ({"num_gpu_blocks_override": 0}, ValueError, "num_gpu_blocks_override must be a positive"),
        ({"num_gpu_blocks_override": -3}, ValueError, "num_gpu_blocks_override must be a positive"),
        ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens must be a positive"),
        ({"sliding_window_as_full_attention": 1}, TypeError, "must be a bool"),
    ],
)
def test_get_kv_cache_config_bad_inputs(kwargs, error, match):
    args = {"kv_cache_spec": llama(2), "available_memory": GiB, "max_model_len": 1024} | kwargs
    with pytest.raises(error, match=match):
        get_kv_cache_config(**args)


# --------------------------------------------------------------------------
# unify


def _config(num_blocks: int, names=("a", "b"), spec=FULL) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        tensors=[KVCacheTensor(PAGE * num_blocks, [n]) for n in names],
        kv_cache_groups=[KVCacheGroupSpec(list(names), spec)],
    )


def test_unify_takes_the_smallest_num_blocks():
    unified = unify_kv_cache_configs([_config(100), _config(80), _config(120)])
    assert [c.num_blocks for c in unified] == [80, 80, 80]
    assert all(t.size == PAGE * 80 for c in unified for t in c.tensors)
    assert all(c == _config(80) for c in unified)


def test_unify_hybrid_configs_keep_their_layout():
    small = get_kv_cache_config(gemma_like(), GiB, max_model_len=4096)
    big = get_kv_cache_config(gemma_like(), 3 * GiB, max_model_len=4096)
    unified = unify_kv_cache_configs([big, small])
    # Same layout as `small`, groups in type_id order (full attention first).
    by_type = sorted(small.kv_cache_groups, key=lambda g: g.kv_cache_spec.type_id)
    assert [g.kv_cache_spec for g in by_type[:1]] == [FULL]
    assert unified == [dataclasses.replace(small, kv_cache_groups=by_type)] * 2


def _two_group_config(num_blocks: int, order: tuple[int, int]) -> KVCacheConfig:
    groups = [KVCacheGroupSpec(["full"], FULL), KVCacheGroupSpec(["window"], SW_1K)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        tensors=[KVCacheTensor(PAGE * num_blocks, ["full", "window"])],
        kv_cache_groups=[groups[i] for i in order],
    )


def test_unify_sorts_groups_by_type_id_as_vllm_does():
    # Two workers that built the same groups in a different order agree, and
    # both get the groups in type_id order ("full_attention_..." < "sliding_window_...").
    unified = unify_kv_cache_configs([_two_group_config(40, (1, 0)), _two_group_config(30, (0, 1))])
    assert [[g.layer_names for g in c.kv_cache_groups] for c in unified] == [[["full"], ["window"]]] * 2
    assert [c.num_blocks for c in unified] == [30, 30]
    assert unified[0] == unified[1] == _two_group_config(30, (0, 1))


@pytest.mark.parametrize(
    ("other", "match"),
    [
        (
            _config(50, names=("a", "c")),
            r"config 2 has different KV cache groups from config 0: "
            r"group 0 has layers \['a', 'c'\] instead of \['a', 'b'\]",
        ),
        (_config(50, spec=SW_1K), r"config 2 .*group 0 has spec SlidingWindowSpec"),
        (KVCacheConfig(50, [], []), r"config 2 .*0 groups instead of 1"),
    ],
)
def test_unify_mismatch_names_the_config(other, match):
    with pytest.raises(ValueError, match=match):
        unify_kv_cache_configs([_config(50), _config(60), other, _config(10, names=("x",))])


def test_unify_custom_names_and_bad_inputs():
    with pytest.raises(ValueError, match="worker-b has different"):
        unify_kv_cache_configs(
            [_config(5), _config(5, names=("b",))], names=["worker-a", "worker-b"]
        )
    with pytest.raises(ValueError, match="non-empty list"):
        unify_kv_cache_configs([])
    with pytest.raises(TypeError, match=r"configs\[1\] is dict"):
        unify_kv_cache_configs([_config(5), _config(5).to_dict()])
    with pytest.raises(ValueError, match="2 names for 1 configs"):
        unify_kv_cache_configs([_config(5)], names=["a", "b"])


# --------------------------------------------------------------------------
# memory budget


def test_kv_cache_budget_arithmetic():
    # 80 GiB device, 70 GiB free, 0.9 utilisation, model still needs 2 GiB:
    # 72 GiB share - 10 GiB in use - 2 GiB = 60 GiB.
    assert kv_cache_budget(80 * GiB, 70 * GiB, 0.9, 2 * GiB) == 60 * GiB
    # Whole device, nothing used: all of it.
    assert kv_cache_budget(1000, 1000, 1.0) == 1000
    # 0.5 of 1001 bytes = 500.5 -> 500 (floored); 1 byte used -> 499.
    assert kv_cache_budget(1001, 1000, 0.5) == 499


def test_kv_cache_budget_clips_at_zero():
    # 72 GiB share, but 75 GiB already in use (another process): nothing left.
    assert kv_cache_budget(80 * GiB, 5 * GiB, 0.9) == 0
    assert kv_cache_budget(80 * GiB, 80 * GiB, 0.9, 100 * GiB) == 0


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((100, 50, 0.0), ValueError, r"gpu_memory_utilization must be in \(0, 1\], got 0.0"),
        ((100, 50, 1.5), ValueError, r"must be in \(0, 1\], got 1.5"),
        ((100, 50, -0.1), ValueError, r"must be in \(0, 1\]"),
        ((100, 50, "0.9"), TypeError, "gpu_memory_utilization must be a number"),
        ((100, 150, 0.9), ValueError, r"free_bytes must be in \[0, total_bytes=100\]"),
        ((0, 0, 0.9), ValueError, "total_bytes must be positive"),
        ((100, 50, 0.9, -1), ValueError, "model_memory_bytes must be >= 0"),
        ((100.0, 50, 0.9), TypeError, "total_bytes must be an int"),
    ],
)
def test_kv_cache_budget_bad_inputs(args, error, match):
    with pytest.raises(error, match=match):
        kv_cache_budget(*args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_available_memory_without_gpu_says_pass_it_explicitly():
    expected = "no CUDA GPU.*pass available_memory.*get_kv_cache_config"
    with pytest.raises(RuntimeError, match=expected):
        available_kv_cache_memory()


@pytest.mark.parametrize("utilization", [0, 1.01])
def test_available_memory_checks_utilization_first(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        available_kv_cache_memory(gpu_memory_utilization=utilization)


@pytest.mark.gpu
def test_available_memory_on_gpu_matches_mem_get_info():
    free, total = torch.cuda.mem_get_info(0)
    budget = available_kv_cache_memory(0, gpu_memory_utilization=0.5)
    expected = kv_cache_budget(total, free, 0.5)
    # NVML and the CUDA runtime may count reserved memory a little differently
    # and other allocations come and go; 1 GiB of slack is far below a real
    # budget on a GPU that size.
    assert budget > 0
    assert abs(budget - expected) <= GiB
    # What the model still needs comes off the budget, clipped at zero.
    assert available_kv_cache_memory("cuda:0", 0.5, model_memory_bytes=budget + 2 * GiB) == 0
    with pytest.raises(ValueError, match="must be a CUDA device"):
        available_kv_cache_memory("cpu")
    with pytest.raises(ValueError, match="does not exist"):
        available_kv_cache_memory(torch.cuda.device_count())
