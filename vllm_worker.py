"""What runs inside vLLM's worker process: the weight-sync receiver, loaded by vLLM as its
worker extension (`worker_extension_cls="vllm_worker.VLLMWeightReceiver"`, engines.VLLMEngine),
and reading safetensors checkpoints. Only control messages cross `collective_rpc`; the
tensors come over the weight-sync group (sync.WeightSync). A file of its own: vLLM imports it
by name in its worker process, apart from the engine that runs in the explorer."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

import models
import sync


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the *.safetensors files of a checkpoint directory (CPU). Raises
    FileNotFoundError when there are none."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    return {k: v for f in files for k, v in load_file(f).items()}


class VLLMWeightReceiver:
    """vLLM worker extension (`worker_extension_cls="engines.VLLMWeightReceiver"`): the
    vLLM worker joins the weight-sync group as rank 1 (NCCL on its GPU, or gloo through host
    memory: `sync_device` "cpu", also when it shares a GPU with the trainer) and loads each publish in place with
    `model.load_weights`, inside vLLM's layerwise-reload helpers (needed on CPU, where
    linear weights are prepacked and a bare load can have no effect)."""

    def nanorft_join(self, model_path: str, host: str, port: int, timeout_s: float, sync_device: str,
                     lora: dict | None = None, lora_root: str = "") -> None:
        """Join the group whose store is at `host`:`port` (sync_device "cuda": on this
        worker's GPU; "cpu": through host memory). The trainer's liveness, here and in every
        receive, is its store answering (`StoreAlive`): this process is vLLM's, not the
        trainer's child, and in mode explore the explorer is not its child either. With a
        peft `lora` config (LoraConfig.to_dict()), publishes carry the adapters, which each receive writes as a peft
        adapter directory lora_root/v{version:06d} for the engine's next LoRARequest."""
        from transformers import AutoConfig, AutoModelForCausalLM

        dtype = self.vllm_config.model_config.dtype  # the dtype it holds: bf16 to a bf16 vLLM
        with torch.device("meta"):  # names and shapes of the HF checkpoint (or of its adapters), in wire order
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=dtype)
            if lora is not None:
                from peft import LoraConfig, get_peft_model

                lora = LoraConfig.from_peft_type(**lora)
                hf = get_peft_model(hf, lora)
        self.nanorft_lora, self.nanorft_meta, self.nanorft_root = lora, hf, lora_root
        device = self.device if self.device.type == "cuda" and sync_device == "cuda" else torch.device("cpu")
        named = models.lora("published_parameters")(hf) if lora is not None else list(hf.named_parameters())
        self.nanorft_named = [(n, torch.empty(p.shape, dtype=dtype, device=device)) for n, p in named]
        self.nanorft_alive = sync.StoreAlive(host, port, sync.STORE_KNOWN_WAIT_S)
        self.nanorft_sync = sync.WeightSync(None, port=port, host=host, device=str(device), timeout_s=timeout_s,
                                       wire_dtype=dtype).connect(self.nanorft_alive)

    def nanorft_receive(self) -> tuple[int, float]:
        tensors = [t for _, t in self.nanorft_named]
        version = self.nanorft_sync.recv(tensors, self.nanorft_alive)
        if self.nanorft_lora is not None:
            models.lora("save_adapter")(self.nanorft_meta, Path(self.nanorft_root) / f"v{version:06d}",
                                [(n, t.cpu()) for n, t in self.nanorft_named], self.nanorft_lora)
        else:
            self._nanorft_load(self.nanorft_named)
        return version, sync.checksum(tensors)

    def nanorft_announced(self) -> int:
        """The newest version the trainer has started to publish (never blocks)."""
        return self.nanorft_sync.announced()

    def nanorft_joined(self) -> bool:
        return getattr(self, "nanorft_sync", None) is not None

    def nanorft_leave(self) -> None:
        self.nanorft_sync.leave()

    def nanorft_load(self, path: str) -> float:
        """Load a safetensors checkpoint directory in place; returns its checksum."""
        named = list(read_safetensors(path).items())
        self._nanorft_load(named)
        return sync.checksum(t for _, t in named)

    def _nanorft_load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.get_model()  # not `.model`: on CUDA that is vLLM's CUDAGraphWrapper around it
        dtype = self.vllm_config.model_config.dtype  # a checkpoint may hold float32; vLLM may hold bf16
        tied = self.vllm_config.model_config.hf_config.tie_word_embeddings
        expected = ("RotaryEmbedding", "ParallelLMHead") if tied else ("RotaryEmbedding",)
        # layers a publish has no tensors for (no weights; the tied lm_head comes as the embedding)
        # keep theirs, as intended: vLLM's "<layer>: Failed to load weights" for them is noise
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").filters = [
            lambda r: r.getMessage() not in {f"{name}: Failed to load weights" for name in expected}]
        initialize_layerwise_reload(model)
        model.load_weights((n, t.to(dtype) if t.is_floating_point() else t) for n, t in named)
        finalize_layerwise_reload(model, self.vllm_config.model_config)
        lm_head = getattr(model, "lm_head", None)
        if self.vllm_config.model_config.hf_config.tie_word_embeddings and hasattr(lm_head, "quant_method"):
            # the reload reprocesses only embed_tokens; the tied lm_head keeps its own
            # prepacked copy on CPU unless it is processed again
            lm_head.quant_method.process_weights_after_loading(lm_head)
