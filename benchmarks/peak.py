"""The matrix-product peak of this machine, which MFU is measured against (perf.py calls
`measure_matmul` once per CPU and caches the result).

    python benchmarks/peak.py        # FLOP/s of float32 and bfloat16 products on every core
"""

from __future__ import annotations

import os
import sys
import time


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none)."""
    try:
        return next(
            (
                x.split(":", 1)[1].strip()
                for x in open("/proc/cpuinfo")
                if x.startswith("model name")
            ),
            "",
        )
    except OSError:
        return ""


def measure_matmul(device, dtype, n: int, trials: int = 5, trial_s: float = 0.15) -> float:
    """FLOP/s of n x n matrix products on `device` in `dtype` (torch's): the best of
    `trials` runs of about `trial_s` seconds."""
    import torch

    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        a @ b
    best = 0.0
    for _ in range(trials):
        sync()
        t0, k = time.perf_counter(), 0
        while (dt := time.perf_counter() - t0) < trial_s:
            a @ b
            k += 1
            sync()
        best = max(best, 2.0 * n**3 * k / dt)
    return best


def main() -> int:
    import torch

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    print(
        f"{cpu_model() or 'CPU'} ({torch.backends.cpu.get_cpu_capability()}), {threads} threads, torch {torch.__version__}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        print(
            f"{str(dtype).removeprefix('torch.'):<9} {measure_matmul(torch.device('cpu'), dtype, 1024) / 1e12:.3f} TFLOP/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
