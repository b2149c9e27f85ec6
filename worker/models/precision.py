"""The precision a model computes in, chosen once when it loads.

A profile names its ``compute_precision``; on a CPU worker a profile that asks float32 may run in
bfloat16 instead (``SIE_CPU_PRECISION``): where the CPU has native bf16 instructions
(``avx512_bf16`` or ``amx_bf16``) bf16 matmuls are faster than fp32 ones, and for the adapters
that declare it safe (``Adapter.cpu_bf16_safe``) their outputs stay within the correctness gate
(cosine >= 0.99 against fp32; tests/integration/lifecycle/test_cpu_precision.py). GPU workers and profiles
that ask a half precision themselves get what the profile asks.
"""

from __future__ import annotations

import functools
from pathlib import Path

from worker.adapters.base import Adapter

#: /proc/cpuinfo flags of x86 CPUs that compute bf16 dot products natively
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU's flags name a native bf16 instruction set (read once; False where there is
    no /proc/cpuinfo or no flags line, e.g. macOS or ARM)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool(NATIVE_BF16_FLAGS & set(line.partition(":")[2].split()))
    return False


def load_precision(asked: str | None, adapter: type[Adapter], device: str, cpu_setting: str) -> str:
    """What a model loads in: the profile's ``asked`` precision (float32 when unset), except on CPU,
    where a float32 profile of a bf16-safe adapter runs in bfloat16 when ``cpu_setting`` is
    ``bfloat16``, or ``auto`` and the CPU has native bf16."""
    precision = asked or "float32"
    if device != "cpu" or precision != "float32" or not adapter.cpu_bf16_safe:
        return precision
    if cpu_setting == "bfloat16" or (cpu_setting == "auto" and cpu_has_native_bf16()):
        return "bfloat16"
    return precision
