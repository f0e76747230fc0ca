"""What kvnet's vLLM connector serves (``kvnet.integrations.platforms``): the verdicts the connector asks
for once vLLM has told it its platform, attention backend and KV cache dtype."""

from __future__ import annotations

import pytest

from kvnet.integrations.platforms import (
    GPU_BACKENDS,
    cache_dtype_refusal,
    gpu_backend_refusal,
    platform_name,
    platform_refusal,
)


class _Platform:
    """What the connector reads of vLLM's ``current_platform``: its public ``is_<name>()`` predicates."""

    def __init__(self, *true: str, device_name: str = "") -> None:
        self._true = set(true)
        self.device_name = device_name

    def __getattr__(self, attr: str) -> object:
        if not attr.startswith("is_"):
            raise AttributeError(attr)
        return lambda: attr.removeprefix("is_") in self._true


@pytest.mark.parametrize("name", ["cuda", "rocm", "cpu", "xpu", "tpu"])
def test_the_platform_is_named_by_vllms_public_predicates(name: str) -> None:
    assert platform_name(_Platform(name)) == name


def test_an_out_of_tree_platform_keeping_cudas_enum_is_not_taken_for_cuda() -> None:
    # A plugin may answer is_cuda() (its enum, for vLLM's kernel choices) and is_out_of_tree() both.
    name = platform_name(_Platform("cuda", "out_of_tree"))
    assert name == "oot" and platform_refusal(name) is not None


def test_a_platform_no_predicate_names_goes_by_its_device_name_and_is_refused() -> None:
    assert platform_name(_Platform(device_name="HPU")) == "hpu"
    assert platform_name(_Platform()) == "unspecified"
    assert platform_refusal("hpu") is not None and platform_refusal("unspecified") is not None


@pytest.mark.parametrize("platform", ["cpu", "cuda", "CUDA"])
def test_cpu_and_cuda_are_served(platform: str) -> None:
    assert platform_refusal(platform) is None


@pytest.mark.parametrize("platform", ["rocm", "xpu", "tpu", "oot", "unspecified"])
def test_other_platforms_are_refused_in_one_line_naming_them(platform: str) -> None:
    refusal = platform_refusal(platform)
    assert refusal == f"kvnet's vLLM connector serves vLLM on cpu and cuda only, not on {platform}"


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"])
def test_the_three_gpu_backends_kvnet_maps_are_served(backend: str) -> None:
    assert backend in GPU_BACKENDS
    assert gpu_backend_refusal(backend) is None


@pytest.mark.parametrize("backend", ["FLEX_ATTENTION", "ROCM_ATTN", "FLASHMLA", "TRITON_ATTN_DIFFKV", "CPU"])
def test_other_backends_are_refused_in_one_line(backend: str) -> None:
    refusal = gpu_backend_refusal(backend)
    assert refusal is not None and refusal.endswith(f"not {backend}") and "\n" not in refusal


@pytest.mark.parametrize("cache_dtype", ["auto", "bfloat16", "float16"])
def test_plain_kv_cache_dtypes_are_carried(cache_dtype: str) -> None:
    assert cache_dtype_refusal(cache_dtype) is None


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head"])
def test_fp8_caches_are_refused_in_one_line_saying_why(cache_dtype: str) -> None:
    refusal = cache_dtype_refusal(cache_dtype)
    assert refusal is not None and "\n" not in refusal
    assert f"does not carry fp8 KV caches (kv_cache_dtype {cache_dtype!r})" in refusal
    assert "per-head scales" in refusal


@pytest.mark.parametrize("cache_dtype", ["nvfp4", "int8_per_token_head", "turboquant_k8v4"])
def test_other_quantized_caches_are_refused_too(cache_dtype: str) -> None:
    refusal = cache_dtype_refusal(cache_dtype)
    assert refusal is not None and "does not carry quantized KV caches" in refusal
