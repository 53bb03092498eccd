"""LoRA (--lora-rank > 0, peft; Hu et al., arXiv:2106.09685): the trainer trains adapters on the
frozen model and publishes only them (`LoraTrainer`); the engines sample with them
(`LoraHFEngine`; vLLM's in extras/vllm_engine.py). Imported where a LoRA run needs it."""

from pathlib import Path

import torch

import models
from engines import HFEngine
from trainer import Trainer


def check_config(cfg) -> None:
    """Raise ValueError (one line) for bad --lora-* settings or without peft."""
    if cfg.lora_alpha <= 0 or not 0 <= cfg.lora_dropout < 1 or not cfg.lora_target_modules.strip():
        raise ValueError("LoRA needs lora_alpha > 0, 0 <= lora_dropout < 1 and lora_target_modules")
    lora_config(cfg)


def lora_config(cfg, base: str = ""):
    """The peft `LoraConfig` of cfg's --lora-* settings on base model `base`. ValueError (one
    line) without peft."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise ValueError("--lora-rank needs peft: pip install peft") from None
    targets = cfg.lora_target_modules.strip()
    targets = (
        targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    )
    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base or None,
    )


def published_parameters(model) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of the peft `model`'s adapters in `named_parameters()` order: what LoRA
    trains."""
    return [(n, p) for n, p in model.named_parameters() if ".lora_" in n]


def save_adapter(model, path: str | Path, named: list[tuple[str, torch.Tensor]], config) -> None:
    """Write the adapters `named` ((name, CPU tensor) of `model`) and `config` as a peft adapter
    directory."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    Path(path).mkdir(parents=True, exist_ok=True)
    save_file(
        {
            k: v.contiguous()
            for k, v in get_peft_model_state_dict(model, state_dict=dict(named)).items()
        },
        str(Path(path) / "adapter_model.safetensors"),
    )
    config.save_pretrained(str(path))


def load_adapter(model, path: str | Path) -> None:
    """Load the peft adapter directory `path` into the unsharded peft `model`. ValueError when it
    misses an adapter."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(
        model, load_file(str(Path(path) / "adapter_model.safetensors"))
    )
    if missing := [k for k in result.missing_keys if ".lora_" in k]:
        raise ValueError(
            f"adapter {path} has no weights for {missing[:3]} ({len(missing)} tensors)"
        )


def merge_adapter(adapter: str | Path, out: str | Path, dtype: torch.dtype) -> None:
    """Write the peft `adapter` merged into its base model (loaded again) as a Hugging Face
    directory."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(models.base_model_dir(adapter), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().to(dtype)
    merged.config.dtype = dtype  # (the config would record the float32 it was loaded in)
    merged.save_pretrained(str(out))


class LoraTrainer(Trainer):
    """A Trainer of fresh LoRA adapters on the frozen model; saves and resume states hold the
    adapters only. `parts`: the Trainer's keyword arguments (its algorithm, frozen scorers)."""

    def __init__(self, cfg, model_path: str, device: torch.device, **parts):
        self.lora = lora_config(cfg, model_path)
        super().__init__(cfg, model_path, device, **parts)

    def pretrained(self, model_path: str):
        from peft import get_peft_model

        model = get_peft_model(super().pretrained(model_path), self.lora)
        for (
            name,
            sub,
        ) in model.named_modules():  # LoRA dropout, when asked for, applies while training
            if isinstance(sub, torch.nn.Dropout) and "lora_dropout" in name:
                sub.training = True
        return model

    def named_trained_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return published_parameters(self.model)

    def resume_tensors(self) -> dict:
        """The adapters, sharded: the frozen model comes back from --model, not the resume state."""
        return {"adapters": dict(self.named_trained_parameters())}

    def save(
        self,
        path: str | Path,
        params: list[torch.Tensor] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """A peft adapter directory of the adapters (cast to `dtype`) and the tokenizer."""
        params = params if params is not None else self.full_parameters()
        if self.rank == 0:
            save_adapter(
                self.model,
                path,
                [
                    (n, p.detach().to("cpu", dtype))
                    for (n, _), p in zip(self.named_trained_parameters(), params)
                ],
                self.lora,
            )
            self.tokenizer.save_pretrained(str(path))

    def save_final(self, path: str | Path, params: list[torch.Tensor] | None = None) -> None:
        """The adapters (float32) in path/adapter and the merged model at `path` in
        `final_dtype`."""
        self.save(Path(path) / "adapter", params)
        if self.rank == 0:
            merge_adapter(Path(path) / "adapter", path, self.final_dtype)
            self.tokenizer.save_pretrained(str(path))


class LoraHFEngine(HFEngine):
    """An HFEngine sampling with the peft LoraConfig `lora`'s adapters on the frozen model (from
    `model_path` when it is a peft adapter directory, else fresh); a weight sync carries the
    adapters only."""

    def __init__(self, model_path: str, lora, **kwargs):
        self.lora = lora  # (pretrained, called by HFEngine.__init__, needs it)
        super().__init__(model_path, **kwargs)

    @classmethod
    def from_config(
        cls, cfg, model_path: str, seed: int, device: str, colocated: bool, graphs=None
    ) -> "LoraHFEngine":
        """The engine of cfg's settings with the adapters of its --lora-* settings."""
        return cls(model_path, lora_config(cfg), **cls.settings(cfg, seed, device, graphs))

    def pretrained(self, model_path: str, dtype: torch.dtype):
        from peft import get_peft_model

        model = get_peft_model(super().pretrained(model_path, dtype), self.lora).eval()
        if models.is_adapter(model_path):
            load_adapter(model, model_path)
        return model

    def parameters(self) -> list[torch.Tensor]:
        """The adapters, in the wire order (named_parameters)."""
        return [p for _, p in published_parameters(self.model)]

    def load_weights(self, path: str | Path) -> None:
        """Load the peft adapter directory `path` (a publish carries the adapters only)."""
        load_adapter(self.model, path)
