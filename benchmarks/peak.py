"""The matrix-product peak of this machine, which MFU is measured against (perf.py measures
it once per CPU with `measure_matmul` and caches the result).

    python benchmarks/peak.py        # FLOP/s of float32 and bfloat16 products on every core
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from perf import cpu_model, measure_matmul  # noqa: E402


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
