"""Performance beside the RL: model FLOPs and MFU (`train_flops`, `generate_flops`, `mfu`, the
meters) against the device's peak (`unit_peak`); on one CPU machine, the threads the waiting side
lends to the busy one (`CoreShare`, `lend_threads`, `LendingPace`); `compiled` decoder blocks
(where `compiles_layers`); a CPU engine's bf16 linear layers on weights reordered once for oneDNN
(`pack_linear_weights`); the allocator's free pages returned to the OS (`return_free_memory`)."""

import ctypes
import functools
import os
import threading
import time
from typing import Callable

import torch

import models
from metrics import cpu_seconds, print0


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none)."""
    try:
        names = [x for x in open("/proc/cpuinfo") if x.startswith("model name")]
    except OSError:
        return ""
    return names[0].split(":", 1)[1].strip() if names else ""


def measure_matmul(device, dtype, n: int, trials: int = 5, trial_s: float = 0.15) -> float:
    """FLOP/s of n x n matrix products on `device` in `dtype` (torch's): the best of
    `trials` runs of about `trial_s` seconds."""
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


def matmul_params(model_path: str) -> tuple[int, int]:
    """(body, head) parameters a token meets in matrix products (the output embedding is the
    head)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = models.base_model_dir(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    embed = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    body = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in embed)
    return body, model.get_output_embeddings().weight.numel()


def train_flops(body: int, head: int, tokens: int, predicted: int, passes: int = 3) -> float:
    """Model FLOPs of training on `tokens`, the head on `predicted` ones: 2 per parameter, token and
    pass (3: forward + backward, Kaplan et al., arXiv:2001.08361); no recomputation or attention, as
    PaLM (arXiv:2204.02311)."""
    return 2.0 * passes * (body * tokens + head * predicted)


def generate_flops(body: int, head: int, prompt_tokens: int, sampled: int) -> float:
    """Model FLOPs of sampling: one forward pass over the prefilled and the sampled tokens."""
    return 2.0 * (body * prompt_tokens + (body + head) * sampled)


# nominal dense peak FLOP/s of CUDA devices by name (bf16 tensor cores, float32 without TF32)
CUDA_PEAKS = {
    "H200": (989e12, 67e12),
    "H100 PCIe": (756e12, 51e12),
    "H100": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
}


def peak_flops(device: str = "cpu", dtype: str = "float32", threads: int = 1) -> float:
    """FLOP/s of `CUDA_PEAKS`, or of `threads` threads' measured matrix products, cached per CPU."""
    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        known = [peaks[dt != torch.bfloat16] for key, peaks in CUDA_PEAKS.items() if key in name]
        return known[0] if known else measure_matmul(torch.device(device), dt, 8192)
    cpu = [cpu_model(), torch.backends.cpu.get_cpu_capability(), torch.__version__]
    isa = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
    key = "|".join(cpu + [dtype, str(threads)] + [os.environ.get(v, "") for v in isa])
    path = models.cache_dir() / "peak.json"
    cached = models.read_cached(path)
    if key not in cached:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            cached[key] = measure_matmul(torch.device("cpu"), dt, 1024)
        finally:
            torch.set_num_threads(before)
        models.write_cached(path, cached)
    return cached[key]


def job_units(device_type: str) -> int:
    """The cores this process may run on, or the CUDA devices."""
    return torch.cuda.device_count() if device_type == "cuda" else len(os.sched_getaffinity(0))


def unit_peak(device_type: str, dtype: str) -> float:
    """Peak FLOP/s of one CUDA device, or of one core (all `job_units` cores measured together)."""
    if device_type == "cuda":
        return peak_flops("cuda", dtype)
    n = job_units("cpu")
    return peak_flops("cpu", dtype, n) / n


def announce_peak(device: str, dtype: str) -> None:
    """Print the peak MFU is measured against (measured first if not cached)."""
    units = job_units(device)
    tflops = unit_peak(device, dtype) * units / 1e12
    if device == "cuda":
        what = f"the nominal {dtype} peak of {units} GPU(s)"
    else:
        what = (
            f"{dtype} matrix products measured on {units} core(s) (once per CPU, cached in "
            f"{models.cache_dir()})"
        )
    print0(f"nanorft: MFU is measured against {tflops:.3g} TFLOP/s, {what}")


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation: `flops` in `seconds` over `peak` FLOP/s (0 when either is 0)."""
    return flops / (seconds * peak) if seconds > 0 and peak > 0 else 0.0


class TrainerMeter:
    """perf/trainer_model_flops and perf/trainer_mfu of a step, from its tokens computed and
    predicted and its busy seconds (summed over ranks). `passes`: 3 (forward and backward) plus one
    forward of a reference model if one is loaded; `matmul`: the model's `matmul_params`."""

    def __init__(self, matmul: tuple[int, int], device_type: str, dtype: str, passes: int):
        self.matmul = matmul
        self.peak = unit_peak(device_type, dtype)  # FLOP/s of one core (CPU) or device (CUDA)
        self.passes = passes

    def measure(self, m: dict) -> dict[str, float]:
        tokens, predicted = m["train/packed_tokens"], m["train/predicted_tokens"]
        flops = train_flops(*self.matmul, tokens, predicted, passes=self.passes)
        return {
            "perf/trainer_model_flops": flops,
            "perf/trainer_mfu": mfu(flops, m["time/train_busy_s"], self.peak),
        }


class ExplorerMeter:
    """perf/explorer_model_flops and perf/explorer_mfu of an explorer's batch record, and
    perf/eval_* of an evaluation record, from the tokens its engine prefilled and sampled and
    its busy seconds (Explorer.work); `matmul`: the model's `matmul_params`."""

    def __init__(self, matmul: tuple[int, int], device_type: str, dtype: str):
        self.matmul = matmul
        self.peak = unit_peak(device_type, dtype)

    def measure(self, record: dict) -> dict[str, float]:
        out = {}
        for part in ("explorer", "eval"):
            if f"perf/{part}_prefilled_tokens" in record:
                prefilled = record[f"perf/{part}_prefilled_tokens"]
                sampled = record[f"perf/{part}_sampled_tokens"]
                flops = generate_flops(*self.matmul, prefilled, sampled)
                out[f"perf/{part}_model_flops"] = flops
                out[f"perf/{part}_mfu"] = mfu(flops, record[f"perf/{part}_busy_s"], self.peak)
        return out


class JobMeter:
    """cpu/utilisation_pct (200 = two cores busy) and perf/job_mfu of the whole job between
    steps."""

    def __init__(self):
        # (CPU seconds, wall clock) at the last call
        self.mark = (cpu_seconds(), time.perf_counter())
        self.explorer_flops = 0.0

    def add(self, record: dict) -> None:
        """Count the model FLOPs of an explorer's record (a batch or an evaluation)."""
        self.explorer_flops += record.get("perf/explorer_model_flops", 0.0) + record.get(
            "perf/eval_model_flops", 0.0
        )

    def since_last(
        self, trainer_flops: float, unit_peak: float, device_type: str
    ) -> dict[str, float]:
        """The two metrics since the last call; `unit_peak`: FLOP/s of one core or device."""
        cpu_s = cpu_seconds()
        now = time.perf_counter()
        wall = now - self.mark[1]
        flops = trainer_flops + self.explorer_flops
        out = {
            "cpu/utilisation_pct": 100 * (cpu_s - self.mark[0]) / max(1e-9, wall),
            "perf/job_mfu": mfu(flops, wall, unit_peak * job_units(device_type)),
        }
        self.mark = (cpu_s, now)
        self.explorer_flops = 0.0
        return out


class StepMeters:
    """The model FLOPs and MFU of a run's work, measured beside the RL step: each explorer
    record's (`add_explorer`), each trainer step's and the whole job's since the last step
    (`add_step`); without meters (None) only the job's CPU use is kept between records."""

    def __init__(
        self,
        trainer: TrainerMeter | None = None,
        explorer: ExplorerMeter | None = None,
        device_type: str = "cpu",
    ):
        self.trainer = trainer
        self.explorer = explorer
        self.device_type = device_type
        self.job = JobMeter()  # cpu/utilisation_pct, perf/job_mfu

    def add_explorer(self, record: dict) -> None:
        """Add an explorer record's model FLOPs and MFU to it; count them for the job's."""
        if self.explorer is not None:
            record.update(self.explorer.measure(record))
        self.job.add(record)

    def add_step(self, m: dict) -> None:
        """Add a trainer step's model FLOPs and MFU, and the job's since the last step, to its
        metrics `m`."""
        if self.trainer is None:
            return
        m.update(self.trainer.measure(m))
        flops = m["perf/trainer_model_flops"]
        m.update(self.job.since_last(flops, self.trainer.peak, self.device_type))


class CoreShare:
    """The side that waits (`flags`: trainer busy, explorer busy) lends its CPU threads to the busy
    one."""

    def __init__(self, flags, side: int, own: int, other: int):
        self.flags = flags
        self.side = side
        self.own = own
        self.other = other

    def busy(self, flag: bool) -> None:
        self.flags[self.side] = int(flag)

    def apply(self) -> int:
        """Set torch's threads to own + other while the other side is idle, else own; returns
        them."""
        n = self.own if self.flags[1 - self.side] else self.own + self.other
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n


def lend_threads(model, cores: CoreShare) -> None:
    """Take or give back the threads the idle side lends (`cores.apply`) before each forward
    pass of `model`'s decoder blocks (`_no_split_modules`); a block's hook also runs in each
    recompute of the backward pass."""
    blocks = set(model._no_split_modules or [])

    def apply(*_) -> None:
        cores.apply()

    for m in model.modules():
        if type(m).__name__ in blocks:
            m.register_forward_pre_hook(apply)


def lending(send: Callable, cores: CoreShare) -> Callable:
    """`send` (sync.WeightSync.send), its errors raised, with this side's threads lent to the other
    while it runs, its own copy into the buffer included: a publish waits until the explorer
    receives, after the evaluation it may still be running."""

    @functools.wraps(send)
    def lent(*args, **kwargs):
        cores.busy(False)
        try:
            return send(*args, **kwargs)
        finally:
            cores.busy(True)

    return lent


class LendingPace:
    """A `schedule.Pace` that lends this process's threads to the other side (`cores.busy`)
    while `pace` waits for weights or for the trainer, and takes them back to generate."""

    def __init__(self, pace, cores: CoreShare):
        self.pace = pace
        self.cores = cores

    def join(self) -> None:
        self.pace.join()

    def before_batch(self, batch: int) -> bool:
        self.cores.busy(False)
        go = self.pace.before_batch(batch)
        self.cores.busy(True)
        return go

    def inflight(self) -> None:
        self.pace.inflight()

    def final(self) -> None:
        self.cores.busy(False)
        self.pace.final()


class PackedLinear(torch.nn.Module):
    """`linear` (a bf16 torch.nn.Linear on a CPU, without autograd) computed on a copy of its
    weight that oneDNN keeps in the blocked layout its matrix products read
    (`torch.ops.mkldnn._reorder_linear_weight`, the layout of torch.compile's frozen CPU graphs):
    F.linear reorders the weight at every call, which at a decode step's few rows costs about as
    much as the product. The same parameters as `linear` (a tied weight stays tied), so a weight
    sync writes them as before; the copy is made again after each in-place change of the weight
    (its version counter: `copy_`). Input [..., in_features] -> [..., out_features], the same
    values as F.linear; input of another dtype: F.linear."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = None
        self.packed_version = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if self.packed_version != self.weight._version:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            self.packed_version = self.weight._version
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Each bf16 torch.nn.Linear of `model` on a CPU replaced by a `PackedLinear` of it, where
    this torch's oneDNN computes bf16; returns how many were replaced. For inference only: a
    PackedLinear has no backward. The packed copies take as much memory again as the weights."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return 0
    names = [
        name
        for name, m in model.named_modules()
        if type(m) is torch.nn.Linear
        and m.weight.dtype == torch.bfloat16
        and m.weight.device.type == "cpu"
    ]
    for name in names:
        model.set_submodule(name, PackedLinear(model.get_submodule(name)))
    return len(names)


def compiles_layers(cfg, device_type: str) -> tuple[bool, str]:
    """Whether the trainer compiles its decoder blocks (`compiled`) under `cfg` (config.Config)
    on `device_type`, and why. A GPU: by default. A CPU: only when asked (`--compile-layers`),
    in bf16 and with the C++ compiler inductor builds its kernels with (`$CXX`, else g++;
    without one every block would fail to compile, slowly): fusing a block's casts, norms and
    activations makes a step 0.7-0.9x as long, and the compiler's modules and graphs take about
    0.08 GiB more of the trainer's memory, which the default job's 3 GB bound has no room for
    (docs/benchmarks.md). float32 on a CPU: not measured."""
    if not cfg.compile_layers:
        return False, "--no-compile-layers"
    if device_type == "cuda":
        return True, "CUDA"
    if cfg.dtype != "bfloat16":
        return False, "float32 on a CPU"
    if "compile_layers" not in cfg.given:
        return False, "a CPU: --compile-layers compiles them, faster steps for 0.08 GiB more memory"
    from torch._inductor import cpp_builder

    try:
        compiler = cpp_builder.get_cpp_compiler()
    except (RuntimeError, OSError) as e:
        return (
            False,
            f"no C++ compiler for torch.compile ({type(e).__name__}): set CXX or install g++",
        )
    return True, f"bf16 on a CPU, kernels built by {compiler}"


def compiled(forward: Callable, dynamic: bool = False) -> Callable:
    """torch.compile of `forward`; where compiling fails, `forward` itself from then on (one warning
    line). `dynamic`: one graph for inputs of any length (a CPU trainer's packed lengths vary from
    step to step, and each compile takes seconds there); else torch.compile's default."""
    fast = torch.compile(forward, dynamic=dynamic or None)

    def call(*args, **kwargs):
        nonlocal fast
        try:
            return fast(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:  # the backend's errors too
            print(
                "warning: torch.compile of a decoder block failed, it runs eagerly: "
                f"{type(e).__name__}",
                flush=True,
            )
            fast = forward
            return forward(*args, **kwargs)

    return call


def return_free_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The trainer returning the allocator's free pages to the system: these allocators keep
    freed pages resident beside tensors of other sizes, and a returned page faults when used
    again. Under mimalloc, which purges what stays free for its delay by itself, just before each
    of the step's memory peaks: the end of the decoder's forward pass, the end of the LM head's
    backward (its temporaries freed before the blocks' backward) and `optimizer`'s step. Under
    tcmalloc, which returns nothing by itself, every 0.2 s from a thread. `model`: a transformers
    causal LM. Other allocators: nothing."""
    process = ctypes.CDLL(None)
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        name = "return-free-memory"
        threading.Thread(
            target=every_fifth_of_a_second, args=(release,), name=name, daemon=True
        ).start()
        return
    if not hasattr(process, "mi_collect"):
        return
    collect = process.mi_collect
    collect.argtypes = [ctypes.c_bool]
    # true: purged now, not after mimalloc's delay, the pages other threads freed included
    release = functools.partial(collect, True)

    def before_peak(*args) -> None:  # a gradient hook's None: the gradient as it is
        release()

    def after_forward(module, args, output) -> None:
        release()
        # the hidden states' [B, L, H] gradient is complete when the LM head's backward ends
        if output[0].requires_grad:
            output[0].register_hook(before_peak)

    model.get_decoder().register_forward_hook(after_forward)
    optimizer.register_step_pre_hook(before_peak)


def every_fifth_of_a_second(fn: Callable[[], object]) -> None:
    """Call `fn` every 0.2 s, forever (a daemon thread's target)."""
    while True:
        time.sleep(0.2)
        fn()
