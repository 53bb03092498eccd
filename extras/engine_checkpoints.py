"""Loading a published checkpoint directory into an engine (--sync-method checkpoint)."""

from pathlib import Path

import torch

from extras.checksum import checksum


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the *.safetensors files of a checkpoint directory (CPU); FileNotFoundError when there are none."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    return {k: v for f in files for k, v in load_file(f).items()}


def published_meta(model_path: str, dtype: torch.dtype, lora=None):
    """(meta model, [(name, meta tensor)]): the Hugging Face model of `model_path` on the meta
    device (with `lora`, a peft LoraConfig, its peft model) and what a weight sync carries of it,
    in wire order (the trainer's named_parameters; with LoRA the adapters)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_path), dtype=dtype
        )
        if lora is None:
            return model, list(model.named_parameters())
        from peft import get_peft_model

        model = get_peft_model(model, lora)
        from extras.lora import published_parameters

        return model, published_parameters(model)


def wire_order(model_path: str, lora=None) -> list[str]:
    """The names a checkpoint directory gives the tensors of a publish, in wire order: the order
    in which the trainer's checksum (extras/checksum.py) sums them (a safetensors file keeps no order)."""
    model, named = published_meta(model_path, torch.float32, lora)
    if lora is None:
        return [n for n, _ in named]
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(model, state_dict=dict(named)))


def load_into_hf(engine, path: str | Path) -> float | None:
    """engines.HFEngine.load_checkpoint: the weights (or with LoRA the adapters) of `path`, in
    place; their checksum when the engine checks syncs (else None)."""
    if engine.lora:  # a peft adapter directory
        from extras.lora import load_adapter

        load_adapter(engine.model, path)
    else:
        state = read_safetensors(path)
        with torch.no_grad():
            for name, p in engine.model.named_parameters():
                p.copy_(state[name])
    return checksum(engine.parameters()) if engine.checksum else None
