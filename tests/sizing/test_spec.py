"""Specs and configs: sizes worked out by hand, validation, dict round trips."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gpukv.sizing.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    spec_from_dict,
)

# A Llama-3-8B-like layer: 8 KV heads of 128, fp16, 16-token blocks.
# page = 2 (K and V) * 16 tokens * 8 heads * 128 * 2 bytes = 65536 bytes.
LLAMA = FullAttentionSpec(16, 8, 128, torch.float16)


# --------------------------------------------------------------------------
# page sizes and type ids


def test_page_size_full_attention_fp16():
    assert LLAMA.page_size_bytes == 2 * 16 * 8 * 128 * 2 == 65536


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float32, 131072),  # 4 bytes: 2 * 16 * 8 * 128 * 4
        (torch.bfloat16, 65536),  # 2 bytes
        (torch.float8_e4m3fn, 32768),  # 1 byte: fp8 KV cache halves the page
    ],
)
def test_page_size_follows_dtype(dtype, expected):
    assert FullAttentionSpec(16, 8, 128, dtype).page_size_bytes == expected


def test_page_size_mla_stores_one_latent_not_k_and_v():
    # DeepSeek-like MLA: one 576-wide latent (512 + 64 rope) per token, bf16.
    # page = 1 * 16 * 1 * 576 * 2 = 18432 bytes.
    mla = FullAttentionSpec(16, 1, 576, torch.bfloat16, use_mla=True)
    assert mla.page_size_bytes == 18432
    # The same shape without MLA keeps K and V: twice the bytes.
    assert FullAttentionSpec(16, 1, 576, torch.bfloat16).page_size_bytes == 36864


def test_page_size_sliding_window_same_as_full():
    assert SlidingWindowSpec(16, 8, 128, torch.float16, 4096).page_size_bytes == 65536


def test_type_ids():
    assert LLAMA.type_id == "full_attention_16_65536"
    assert SlidingWindowSpec(16, 8, 128, torch.float16, 4096).type_id == (
        "sliding_window_4096_16_65536"
    )
    assert FullAttentionSpec(16, 1, 576, torch.bfloat16, use_mla=True).type_id == (
        "full_attention_16_18432_mla"
    )


def test_type_id_equal_exactly_when_groupable():
    same = FullAttentionSpec(16, 8, 128, torch.bfloat16)  # other dtype, same bytes
    assert same.type_id == LLAMA.type_id
    assert FullAttentionSpec(32, 8, 128, torch.float16).type_id != LLAMA.type_id  # block size
    assert FullAttentionSpec(16, 4, 128, torch.float16).type_id != LLAMA.type_id  # page size
    sw_4k = SlidingWindowSpec(16, 8, 128, torch.float16, 4096)
    sw_1k = SlidingWindowSpec(16, 8, 128, torch.float16, 1024)
    assert sw_4k.type_id != sw_1k.type_id  # windows differ
    assert sw_4k.type_id != LLAMA.type_id  # kinds differ
    # MLA and K/V pages of equal size still have different layouts.
    mla_same_bytes = FullAttentionSpec(16, 1, 2048, torch.float16, use_mla=True)
    assert mla_same_bytes.page_size_bytes == LLAMA.page_size_bytes
    assert mla_same_bytes.type_id != LLAMA.type_id


# --------------------------------------------------------------------------
# max memory per request


def test_max_memory_full_attention():
    # 8192 tokens / 16 = 512 blocks of 65536 bytes = 32 MiB.
    assert LLAMA.max_memory_usage_bytes(8192) == 512 * 65536 == 32 * 2**20
    # One token more starts block 513.
    assert LLAMA.max_memory_usage_bytes(8193) == 513 * 65536
    assert LLAMA.max_memory_usage_bytes(1) == 65536
    # Full attention ignores the batch size.
    assert LLAMA.max_memory_usage_bytes(8192, 16) == 512 * 65536


def test_max_memory_sliding_window_default_batch_is_whole_request():
    sw = SlidingWindowSpec(16, 8, 128, torch.float16, 4096)
    # batched defaults to 8192: min(4095 + 8192, 8192) = 8192 tokens
    # -> ceil(8192 / 16) + 1 = 513 blocks.
    assert sw.max_memory_usage_bytes(8192) == 513 * 65536


def test_max_memory_sliding_window_with_chunked_prefill():
    sw = SlidingWindowSpec(16, 8, 128, torch.float16, 4096)
    # min(4095 + 2048, 8192) = 6143 tokens -> ceil(6143 / 16) = 384, + 1 = 385 blocks.
    assert sw.max_memory_usage_bytes(8192, 2048) == 385 * 65536
    small = SlidingWindowSpec(16, 8, 128, torch.float16, 128)
    # min(127 + 512, 32768) = 639 -> ceil(639 / 16) = 40, + 1 = 41 blocks.
    assert small.max_memory_usage_bytes(32768, 512) == 41 * 65536


def test_max_memory_sliding_window_short_request():
    sw = SlidingWindowSpec(16, 8, 128, torch.float16, 4096)
    # min(4095 + 1000, 1000) = 1000 -> ceil(62.5) = 63, + 1 = 64 blocks.
    assert sw.max_memory_usage_bytes(1000) == 64 * 65536


@pytest.mark.parametrize("spec", [LLAMA, SlidingWindowSpec(16, 8, 128, torch.float16, 64)])
@pytest.mark.parametrize(
    ("args", "error"),
    [((0,), ValueError), ((-5,), ValueError), ((8.0,), TypeError), ((8, 0), ValueError)],
)
def test_max_memory_bad_lengths(spec, args, error):
    with pytest.raises(error, match="max_model_len|max_num_batched_tokens"):
        spec.max_memory_usage_bytes(*args)


# --------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("field", ["block_size", "num_kv_heads", "head_size"])
@pytest.mark.parametrize("value", [0, -1, -16])
def test_non_positive_sizes_raise_value_error_naming_field(field, value):
    args = {"block_size": 16, "num_kv_heads": 8, "head_size": 128, "dtype": torch.float16}
    args[field] = value
    with pytest.raises(ValueError, match=rf"{field} must be a positive int, got {value}"):
        FullAttentionSpec(**args)


@pytest.mark.parametrize("value", [16.0, "16", True, None])
def test_non_int_sizes_raise_type_error(value):
    with pytest.raises(TypeError, match="block_size must be an int"):
        FullAttentionSpec(value, 8, 128, torch.float16)


@pytest.mark.parametrize("window", [0, -4096])
def test_bad_sliding_window(window):
    with pytest.raises(ValueError, match=rf"sliding_window must be a positive int, got {window}"):
        SlidingWindowSpec(16, 8, 128, torch.float16, window)


def test_dtype_must_be_torch_dtype():
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        FullAttentionSpec(16, 8, 128, "float16")


def test_use_mla_must_be_bool():
    with pytest.raises(TypeError, match="use_mla must be a bool"):
        FullAttentionSpec(16, 8, 128, torch.float16, use_mla=1)


def test_sliding_window_with_mla_is_refused():
    with pytest.raises(ValueError, match="does not support use_mla"):
        SlidingWindowSpec(16, 1, 576, torch.bfloat16, 4096, use_mla=True)


def test_base_spec_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        KVCacheSpec(16, 8, 128, torch.float16)


def test_specs_are_frozen_values():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LLAMA.block_size = 32  # type: ignore[misc]
    assert FullAttentionSpec(16, 8, 128, torch.float16) == LLAMA
    assert hash(FullAttentionSpec(16, 8, 128, torch.float16)) == hash(LLAMA)


# --------------------------------------------------------------------------
# configs


def _two_layer_config(num_blocks: int = 10) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        tensors=[
            KVCacheTensor(size=65536 * num_blocks, shared_by=["layers.0"]),
            KVCacheTensor(size=65536 * num_blocks, shared_by=["layers.1"]),
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layers.0", "layers.1"], LLAMA)],
    )


def test_config_round_trips_through_json():
    sw = SlidingWindowSpec(16, 8, 128, torch.float16, 1024)
    config = KVCacheConfig(
        num_blocks=7,
        tensors=[KVCacheTensor(size=65536 * 7, shared_by=["full.0", "sw.0"])],
        kv_cache_groups=[KVCacheGroupSpec(["full.0"], LLAMA), KVCacheGroupSpec(["sw.0"], sw)],
    )
    data = config.to_dict()
    assert data == {
        "num_blocks": 7,
        "tensors": [{"size": 458752, "shared_by": ["full.0", "sw.0"]}],
        "kv_cache_groups": [
            {
                "layer_names": ["full.0"],
                "kv_cache_spec": {
                    "kind": "full_attention",
                    "block_size": 16,
                    "num_kv_heads": 8,
                    "head_size": 128,
                    "dtype": "float16",
                    "use_mla": False,
                },
            },
            {
                "layer_names": ["sw.0"],
                "kv_cache_spec": {
                    "kind": "sliding_window",
                    "block_size": 16,
                    "num_kv_heads": 8,
                    "head_size": 128,
                    "dtype": "float16",
                    "use_mla": False,
                    "sliding_window": 1024,
                },
            },
        ],
    }
    assert KVCacheConfig.from_dict(json.loads(json.dumps(data))) == config


@given(
    block_size=st.integers(1, 256),
    heads=st.integers(1, 64),
    head_size=st.integers(1, 512),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float8_e5m2]),
    window=st.none() | st.integers(1, 1 << 17),
    mla=st.booleans(),
)
def test_spec_dict_round_trip(block_size, heads, head_size, dtype, window, mla):
    if window is None:
        spec: KVCacheSpec = FullAttentionSpec(block_size, heads, head_size, dtype, use_mla=mla)
    else:
        spec = SlidingWindowSpec(block_size, heads, head_size, dtype, window)
    again = spec_from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and type(again) is type(spec) and again.type_id == spec.type_id


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda d: d.pop("num_blocks"), ValueError, "missing key"),
        (lambda d: d["kv_cache_groups"][0]["kv_cache_spec"].update(kind="mamba"), ValueError,
         "unknown KV cache spec kind 'mamba'"),
        (lambda d: d["kv_cache_groups"][0]["kv_cache_spec"].update(dtype="float17"), ValueError,
         "unknown torch dtype 'float17'"),
        (lambda d: d["kv_cache_groups"][0]["kv_cache_spec"].update(block_size=0), ValueError,
         "block_size must be a positive int, got 0"),
        (lambda d: d["tensors"][0].pop("size"), ValueError, "missing key"),
        (lambda d: d.update(num_blocks=3), ValueError, "not a multiple of num_blocks=3"),
    ],
)
def test_config_from_bad_dict(mutate, error, match):
    data = _two_layer_config().to_dict()
    mutate(data)
    with pytest.raises(error, match=match):
        KVCacheConfig.from_dict(data)


def test_config_validation():
    with pytest.raises(ValueError, match="num_blocks must be a positive int, got 0"):
        KVCacheConfig(num_blocks=0, tensors=[], kv_cache_groups=[])
    with pytest.raises(ValueError, match="size must be a positive int"):
        KVCacheTensor(size=0, shared_by=["a"])
    with pytest.raises(ValueError, match="at least one layer"):
        KVCacheTensor(size=8, shared_by=[])
    with pytest.raises(ValueError, match="names a layer twice"):
        KVCacheGroupSpec(["a", "a"], LLAMA)
    with pytest.raises(TypeError, match="list of layer names"):
        KVCacheGroupSpec("ab", LLAMA)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a KVCacheSpec"):
        KVCacheGroupSpec(["a"], "full")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\['a'\] are in two groups"):
        KVCacheConfig(
            num_blocks=1,
            tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["a"], LLAMA), KVCacheGroupSpec(["a", "b"], LLAMA)],
        )
