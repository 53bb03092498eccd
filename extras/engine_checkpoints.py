"""A published checkpoint directory (--sync-method checkpoint) as the vLLM engine reads it: the
meta model of what a publish carries (`published_meta`) and the order of its tensors
(`wire_order`). The HF engine loads one itself (engines.HFEngine.load_checkpoint)."""

import torch


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
    in which the trainer's checksum (sync.checksum) sums them (a safetensors file keeps no
    order)."""
    model, named = published_meta(model_path, torch.float32, lora)
    if lora is None:
        return [n for n, _ in named]
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(model, state_dict=dict(named)))
