"""Model FLOPs and MFU, logged by every step: how close a run comes to the machine's limit.
The peak is the device's nominal one (CUDA) or, on a CPU, the matrix-product speed that
benchmarks/peak.py measures, once per CPU (cached in the model cache). A file of its own so
that measurement sits beside the RL code, not inside it: the trainer, the explorer and the
loop only report FLOPs and seconds here.
"""
from __future__ import annotations

import json
import os
import time

from benchmarks.peak import cpu_model, measure_matmul
from metrics import cpu_seconds, print0


def matmul_params(model_path: str) -> tuple[int, int]:
    """(body, head): the parameters a token meets in matrix products, from the model's
    config (built on the meta device: nothing is loaded). body = every weight of two or
    more dimensions but the input and output embeddings (attention, MLP); head = the
    output embedding (vocabulary x hidden; counted once when tied to the input one, whose
    lookup costs no FLOPs). A peft adapter directory counts its base model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import models

    path = models.lora("adapter_base")(model_path) if models.is_adapter(model_path) else model_path
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    embed = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    body = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in embed)
    return body, model.get_output_embeddings().weight.numel()


def train_flops(body: int, head: int, tokens: int, predicted: int, passes: int = 3) -> float:
    """Model FLOPs of training on `tokens` tokens (each computed once: a shared prompt
    once per row, no padding) of which `predicted` are response tokens whose log-prob is
    taken: forward 2 FLOPs per parameter and token, backward 4 (`passes` = 3: forward +
    backward, the 6N of Kaplan et al. 2020, arXiv:2001.08361 section 2.1), the LM head only
    on the predicted tokens. Recomputation (activation checkpointing) and attention scores
    (under 2% of the FLOPs at these lengths) are not counted, as in PaLM's MFU (Chowdhery
    et al. 2022, arXiv:2204.02311 appendix B)."""
    return 2.0 * passes * (body * tokens + head * predicted)


def generate_flops(body: int, head: int, prompt_tokens: int, sampled: int) -> float:
    """Model FLOPs of sampling: 2 per parameter and token (a forward pass) over the
    `prompt_tokens` prefilled (each distinct prompt once) and the `sampled` tokens (body
    and LM head)."""
    return 2.0 * (body * prompt_tokens + (body + head) * sampled)


# nominal dense peak FLOP/s of CUDA devices by name (bf16 tensor cores, float32 without TF32)
CUDA_PEAKS = {"H200": (989e12, 67e12), "H100 PCIe": (756e12, 51e12), "H100": (989e12, 67e12),
              "A100": (312e12, 19.5e12)}


def peak_flops(device: str = "cpu", dtype: str = "float32", threads: int = 1) -> float:
    """The FLOP/s that MFU is measured against. CPU: the matrix-product speed of `threads`
    threads in `dtype`, measured once per CPU, instruction-set limit and torch version (best
    of a few 1024 x 1024 products, about a second; cached in `models.cache_dir()`/peak.json).
    CUDA: the device's nominal dense peak (`CUDA_PEAKS`), else a measured product."""
    import torch

    import models

    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        for key, (bf16, fp32) in CUDA_PEAKS.items():
            if key in name:
                return bf16 if dt == torch.bfloat16 else fp32
        return measure_matmul(torch.device(device), dt, 8192)
    key = "|".join([cpu_model(), torch.backends.cpu.get_cpu_capability(), torch.__version__, dtype, str(threads)] +
                   [os.environ.get(v, "") for v in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")])
    path = models.cache_dir() / "peak.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            cached[key] = measure_matmul(torch.device("cpu"), dt, 1024)
        finally:
            torch.set_num_threads(before)
        try:  # best effort: a cache that cannot be written means measuring again next time
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".peak.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cached, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass
    return cached[key]


def job_units(device_type: str) -> int:
    """The cores (CPU: those this process may run on) or CUDA devices a job on this machine has."""
    import torch

    return torch.cuda.device_count() if device_type == "cuda" else len(os.sched_getaffinity(0))


def unit_peak(device_type: str, dtype: str) -> float:
    """Peak FLOP/s of one core (CPU: the measured peak of all `job_units` cores together,
    divided by their count) or of one CUDA device (`peak_flops`)."""
    if device_type == "cuda":
        return peak_flops("cuda", dtype)
    n = job_units("cpu")
    return peak_flops("cpu", dtype, n) / n


def announce_peak(device: str, dtype: str) -> None:
    """Measure (or read from the cache) the peak MFU is measured against and print it."""
    import models

    units = job_units(device)
    peak = unit_peak(device, dtype) * units
    print0(f"nanorft: MFU is measured against {peak / 1e12:.3g} TFLOP/s, " + (
        f"the nominal {dtype} peak of {units} GPU(s)" if device == "cuda" else
        f"{dtype} matrix products measured on {units} core(s) (once per CPU, cached in {models.cache_dir()})"))


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation: `flops` done in `seconds` over `peak` FLOP/s (0 when either is 0)."""
    return flops / (seconds * peak) if seconds > 0 and peak > 0 else 0.0


class JobMeter:
    """The whole job's use of the machine between two steps: cpu/utilisation_pct (CPU
    seconds of this process and its children over wall seconds: 200 = two cores busy) and
    perf/job_mfu (the trainer's and the explorers' model FLOPs over the peak of every core
    or GPU)."""

    def __init__(self):
        self.mark = (cpu_seconds(), time.perf_counter())
        self.explorer_flops = 0.0

    def add(self, record: dict) -> None:
        """Count the model FLOPs of an explorer's record (a batch or an evaluation)."""
        self.explorer_flops += record.get("perf/explorer_model_flops", 0.0) + record.get("perf/eval_model_flops", 0.0)

    def since_last(self, trainer_flops: float, unit_peak: float, device_type: str) -> dict[str, float]:
        """The two metrics since the last call, the trainer's `trainer_flops` included;
        `unit_peak`: FLOP/s of one core or device (`unit_peak`)."""
        cpu_s, now = cpu_seconds(), time.perf_counter()
        wall = now - self.mark[1]
        out = {"cpu/utilisation_pct": 100 * (cpu_s - self.mark[0]) / max(1e-9, wall),
               "perf/job_mfu": mfu(trainer_flops + self.explorer_flops, wall, unit_peak * job_units(device_type))}
        self.mark, self.explorer_flops = (cpu_s, now), 0.0
        return out
