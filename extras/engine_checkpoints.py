"""Loading a published checkpoint directory into an engine (--sync-method checkpoint)."""

from pathlib import Path

import torch

import models
import sync


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the *.safetensors files of a checkpoint directory (CPU); FileNotFoundError when there are none."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    return {k: v for f in files for k, v in load_file(f).items()}


def load_into_hf(engine, path: str | Path, version: int) -> float | None:
    """engines.HFEngine.load_checkpoint: the weights (or with LoRA the adapters) of `path`, in place."""
    if engine.lora:  # a peft adapter directory
        models.lora("load_adapter")(engine.model, path)
    else:
        state = read_safetensors(path)
        with torch.no_grad():
            for name, p in engine.model.named_parameters():
                p.copy_(state[name])
    engine.version = version
    return sync.checksum(engine.parameters()) if engine.checksum else None
