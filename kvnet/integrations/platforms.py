"""What kvnet's vLLM connector serves: platforms, GPU attention backends and KV cache dtypes.

Decisions as data, each refusal one line, with no vLLM import, so they are tested where vLLM is not
installed. The connector asks vLLM for the facts (its platform, the attention backend it chose, the KV
cache dtype) and these functions for the verdict.
"""

from __future__ import annotations

from typing import Any

PLATFORM_LAYOUTS = {
    "cpu": "kvnet.integrations.cpu_layout",
    "cuda": "kvnet.integrations.paged_layout",
}
"""vLLM platforms (``PlatformEnum`` names, lower case) kvnet serves, and the module that maps their KV."""
GPU_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
"""vLLM attention backends (``get_name()``) whose per-layer KV is the plain K‖V view ``paged_layout`` maps."""
PLAIN_CACHE_DTYPES = ("auto", "bfloat16", "float16")
"""``kv_cache_dtype`` values that keep K and V in the model's bf16 or fp16, without scales."""

PLATFORM_CHECKS = (("out_of_tree", "oot"), ("cuda", "cuda"), ("rocm", "rocm"), ("cpu", "cpu"), ("xpu", "xpu"),
                   ("tpu", "tpu"))
"""vLLM's public ``Platform.is_<predicate>()`` checks, in the order asked, and the ``PlatformEnum`` name
(lower case) each stands for. Out-of-tree first: a plugin may keep CUDA's enum for vLLM's own kernel
choices while its device and layouts are its own."""


def platform_name(platform: Any) -> str:
    """The ``PlatformEnum`` name (lower case) of vLLM's ``current_platform``, read through its public
    predicates (``is_cuda()``, ...) rather than its private enum; a platform none of them names goes by its
    ``device_name``, or "unspecified"."""
    for predicate, name in PLATFORM_CHECKS:
        check = getattr(platform, f"is_{predicate}", None)
        if callable(check) and check():
            return name
    try:
        device = getattr(platform, "device_name", "")
    except Exception:  # vLLM's Platform.__getattr__ forwards unknown names to torch's device module
        device = ""
    return str(device or "unspecified").lower()


def platform_refusal(platform: str) -> str | None:
    """Why kvnet cannot serve vLLM on ``platform`` (one line), or None when it can.

    ROCm, XPU and TPU keep their KV in layouts (and, on ROCm, with kernels) kvnet has neither mapped nor
    tested; a block copied from one would be the wrong bytes, so they are refused rather than guessed."""
    name = platform.lower()
    if name in PLATFORM_LAYOUTS:
        return None
    served = " and ".join(sorted(PLATFORM_LAYOUTS))
    return f"kvnet's vLLM connector serves vLLM on {served} only, not on {name}"


def cache_dtype_refusal(cache_dtype: str) -> str | None:
    """Why kvnet cannot carry a GPU KV cache of vLLM's ``kv_cache_dtype`` ``cache_dtype`` (one line), or
    None when it can.

    fp8 (and other quantized) caches are refused: their values decode only with per-tensor or per-head
    scales kept outside the block (Triton even pads per-token-head scales into it), and kvnet's block
    objects do not carry scales yet."""
    if cache_dtype in PLAIN_CACHE_DTYPES:
        return None
    kind = "fp8" if "fp8" in cache_dtype else "quantized"
    return (
        f"kvnet's vLLM connector does not carry {kind} KV caches (kv_cache_dtype {cache_dtype!r}): "
        "their values need per-head scales, which kvnet's blocks do not carry yet"
    )


def gpu_backend_refusal(backend: str) -> str | None:
    """Why kvnet cannot map the KV of vLLM attention backend ``backend`` on a GPU (one line), or None."""
    if backend in GPU_BACKENDS:
        return None
    served = ", ".join(GPU_BACKENDS)
    return f"kvnet's vLLM connector maps the KV of the {served} attention backends, not {backend}"
