"""What the hardware can do and what a step used: peak FLOP/s for MFU, and memory.

MFU is only defined against a known peak, so it is reported on GPUs in the table below and never
on CPUs (whose peak depends on the SKU, clocks and vector units Kiln cannot see); CPU runs report
achieved FLOP/s only.
"""

from __future__ import annotations

import re

import torch

# Dense bf16 tensor-core peaks (no structured sparsity), per GPU, from the vendors' data sheets.
# First match wins, so the specific names come before the generic ones.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    (r"H100.*PCIe", 756.5e12),
    (r"H100.*NVL", 835.5e12),
    (r"H200.*NVL", 835.5e12),
    (r"H200", 989.4e12),
    (r"H100", 989.4e12),  # SXM
    (r"GH200", 989.4e12),
    (r"B200", 2250e12),
    (r"A100", 312e12),
    (r"L40S", 362.05e12),
    (r"\bL4\b", 121e12),
]


def peak_bf16_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of one GPU named like `torch.cuda.get_device_name()`, or None."""
    for pattern, peak in PEAK_BF16_FLOPS:
        if re.search(pattern, device_name):
            return peak
    return None


def mfu(flops_per_s: float, world_size: int, device_name: str | None, bf16: bool) -> float | None:
    """Model FLOP/s utilisation of `world_size` identical GPUs; None on CPU, fp32 or an unknown GPU."""
    if device_name is None or not bf16:
        return None
    peak = peak_bf16_flops(device_name)
    return flops_per_s / (world_size * peak) if peak else None


def memory_metrics(on_gpu: bool) -> dict[str, float]:
    """This process's memory: CUDA peak allocated on GPU, resident set size on CPU."""
    if on_gpu:
        return {"cuda_max_allocated_bytes": float(torch.cuda.max_memory_allocated())}
    import psutil

    return {"rss_bytes": float(psutil.Process().memory_info().rss)}
