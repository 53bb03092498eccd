"""The vLLM engine (`--engine vllm`) and `VLLMWeightReceiver`, its worker extension that receives
the weights."""

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

import models
import sync
from engines import Completion, Engine, read_safetensors, vllm_available
from extras.engine_checkpoints import published_meta, wire_order
from extras.hosts import StoreAlive
from sync import Checksum, checksum

WORKER = "extras.vllm_engine.VLLMWeightReceiver"
# how long the worker waits for the trainer's store (known to exist) to answer
STORE_KNOWN_WAIT_S = 30.0


def check_config(cfg) -> None:
    """components.check_explorer's check of --engine vllm: ValueError (one line) without vLLM,
    for --inflight with LoRA, or for a top-p / top-k truncation in a mode that trains on the
    rollouts."""
    if not vllm_available():
        raise ValueError(
            "--engine vllm: vLLM is not installed (GPU: pip install vllm; CPU: see README)"
        )
    if cfg.lora_rank and cfg.inflight:
        raise ValueError(
            "--inflight with --lora-rank needs --engine hf: a vLLM request keeps the LoRA adapter "
            "it started with, so new adapters cannot reach sequences in flight"
        )
    # vLLM 0.32's return_sampling_mask gives kept token ids only on Model Runner V2 (Triton: not
    # the CPU build) and only under top_k > 0, no log-prob floors: nothing the trainer can replay
    if (cfg.top_p < 1 or cfg.top_k > 0) and cfg.mode in ("both", "explore"):
        raise ValueError(
            f"--engine vllm with top_p {cfg.top_p}, top_k {cfg.top_k}: vLLM records no kept set "
            "per token for the trainer to replay, so training needs top_p 1 and top_k 0 "
            "(or --engine hf, which records them; mode bench takes any)"
        )


class VLLMEngine(Engine):
    """A `vllm.LLM` whose processed log-probs are the behaviour log-probs (`lora`: peft LoraConfig);
    ImportError."""

    def __init__(
        self,
        model_path: str,
        seed: int = 0,
        bf16: bool = False,
        threads: int = 0,
        memory_fraction: float = 0.2,
        inflight: bool = False,
        lora=None,
    ):
        super().__init__()
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(
                f"--engine vllm needs vLLM (GPU: pip install vllm; CPU: see README): {e}"
            ) from None
        adapter, self.loaded_from = models.is_adapter(model_path), model_path
        self.model_path, self.inflight, self.lora = (
            models.base_model_dir(model_path),
            inflight,
            lora,
        )
        # the names of a checkpoint's tensors in wire order (--sync-checksum), on first use
        self.checkpoint_order = None
        self.lora_request, self.lora_root = (
            None,
            tempfile.mkdtemp(prefix="nanorft-lora-") if lora else "",
        )
        # vLLM takes a max_lora_rank of 1, 8, 16, 32, 64, 128, 256, 320 or 512
        lora_args = (
            {
                "enable_lora": True,
                "max_loras": 1,
                "max_lora_rank": next(
                    x for x in (1, 8, 16, 32, 64, 128, 256, 320, 512) if x >= lora.r
                ),
            }
            if lora
            else {}
        )
        # CPU build: bind to the last cores
        if threads and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cores = sorted(os.sched_getaffinity(0))[-threads:]
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        os.environ.setdefault(
            "VLLM_LOGGING_LEVEL", "WARNING"
        )  # its INFO lines (dozens per start) unless asked for
        if inflight:  # the engine core runs in this process, so it stops between two step() calls
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.llm = LLM(
            model=self.model_path,
            dtype="bfloat16" if bf16 else "float32",
            seed=seed,
            logprobs_mode="processed_logprobs",
            gpu_memory_utilization=memory_fraction,
            worker_extension_cls=WORKER,
            enable_prefix_caching=not inflight,
            **lora_args,
        )
        self.tokenizer = self.llm.get_tokenizer()
        if adapter and lora:
            self._use_adapter(model_path, 0, copy=True)

    @classmethod
    def from_config(
        cls, cfg, model_path: str, seed: int, device: str, colocated: bool
    ) -> "VLLMEngine":
        """vLLM takes the first GPU this process sees (engines.use_gpu), whatever `device` says."""
        lora = None
        if cfg.lora_rank:
            from extras.lora import lora_config

            lora = lora_config(cfg)
        return cls(
            model_path,
            seed=seed,
            bf16=cfg.dtype == "bfloat16",
            threads=cfg.explorer_threads,
            memory_fraction=cfg.vllm_memory_fraction,
            inflight=cfg.inflight,
            lora=lora,
        )

    def _use_adapter(self, path: str | Path, version: int, copy: bool = False) -> None:
        from vllm.lora.request import LoRARequest

        own = Path(self.lora_root) / f"v{version:06d}"
        if copy:
            shutil.rmtree(own, ignore_errors=True)
            shutil.copytree(path, own)
        self.lora_request = LoRARequest(f"nanorft-v{version}", version + 1, str(own))
        for old in Path(self.lora_root).glob("v*"):
            if old != own:
                shutil.rmtree(old, ignore_errors=True)

    def generate_batch(self, prompts, ns, sampling):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,  # 0: off, vLLM 0.32's own "off" (older ones took -1)
                max_tokens=sampling.max_tokens,
                logprobs=0,
            )
            for n in ns
        ]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        if self.step_hook is not None:
            return self._generate_inflight(inputs, params)
        outs = self.llm.generate(inputs, params, use_tqdm=False, lora_request=self.lora_request)
        v = (self.version, self.version)
        return [[self._completion(c, v) for c in out.outputs] for out in outs]

    @staticmethod
    def _completion(c, versions: tuple[int, int]) -> Completion:
        return Completion(
            list(c.token_ids),
            [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)],
            "stop" if c.finish_reason == "stop" else "length",
            versions,
        )

    def _generate_inflight(self, inputs, params) -> list[list[Completion]]:
        """Step vLLM's engine by hand, `step_hook` between steps (new weights for the sequences in
        flight)."""
        engine, first = self.llm.llm_engine, self.version
        self.calls = getattr(self, "calls", 0) + 1
        ids = [f"nanorft-{self.calls}-{i}" for i in range(len(inputs))]
        for rid, inp, p in zip(ids, inputs, params):
            engine.add_request(rid, inp, p, lora_request=self.lora_request)
        seen, last, done = (
            {},
            {},
            {},
        )  # (request id, choice) -> tokens seen, version of the newest, output
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    key = (out.request_id, c.index)
                    if len(c.token_ids) > seen.get(key, 0):
                        seen[key], last[key] = len(c.token_ids), self.version
                    if c.finish_reason is not None:
                        done[key] = c
            self.step_hook()
        return [
            [self._completion(done[(rid, j)], (first, last[(rid, j)])) for j in range(p.n)]
            for rid, p in zip(ids, params)
        ]

    def join_weight_sync(self, host, port, timeout_s, alive, device="cpu", transport=None):
        """The worker joins; it watches the trainer itself (StoreAlive): `alive` cannot cross to
        it."""
        lora = self.lora.to_dict() if self.lora else None  # (collective_rpc sends plain data)
        self.llm.collective_rpc(
            "nanorft_join",
            args=(self.model_path, host, port, timeout_s, device, lora, self.lora_root),
        )

    def receive_weights(self, alive):
        self.version, digest = self.llm.collective_rpc("nanorft_receive", args=(self.checksum,))[0]
        if self.lora:  # the worker wrote the adapters to lora_root/v{version}
            self._use_adapter(Path(self.lora_root) / f"v{self.version:06d}", self.version)
        self._forget_prefixes()
        return self.version, digest

    def weights_announced(self):
        return self.llm.collective_rpc("nanorft_announced")[0]

    def wait_weights(self, alive):
        """Block until the trainer starts a publish newer than the loaded version; RuntimeError (one
        line) once `alive()` is False. The worker holds the store connection: asked every 50 ms, as
        a blocking wait there would hold the worker."""
        while self.weights_announced() <= self.version:
            if not alive():
                raise RuntimeError("weight sync: the trainer died (waiting for next publish)")
            time.sleep(0.05)

    def weights_joined(self):
        return self.llm.collective_rpc("nanorft_joined")[0]

    def leave_weight_sync(self):
        self.llm.collective_rpc("nanorft_leave")

    def load_checkpoint(self, path, version):
        order = self.wire_order() if self.checksum else None
        if self.lora:  # a peft adapter directory
            digest = None
            if order is not None:
                adapters = read_safetensors(path)
                digest = checksum(adapters[n] for n in order)
            self._use_adapter(path, version, copy=True)
        else:
            digest = self.llm.collective_rpc("nanorft_load", args=(str(path), order))[0]
        self._forget_prefixes()
        self.version = version
        return digest

    def wire_order(self) -> list[str]:
        """extras.engine_checkpoints.wire_order of this engine's model, built once (a meta
        model)."""
        if self.checkpoint_order is None:
            self.checkpoint_order = wire_order(self.model_path, self.lora)
        return self.checkpoint_order

    def _forget_prefixes(self) -> None:
        if not self.inflight:
            self.llm.reset_prefix_cache()

    def close(self):
        super().close()
        self.llm.llm_engine.engine_core.shutdown()
        if self.lora_root:
            shutil.rmtree(self.lora_root, ignore_errors=True)


class VLLMWeightReceiver:
    """vLLM worker extension (`WORKER`): a receiving rank of the weight-sync group; loads each
    publish in place."""

    def nanorft_join(
        self,
        model_path: str,
        host: str,
        port: int,
        timeout_s: float,
        sync_device: str,
        lora: dict | None = None,
        lora_root: str = "",
    ) -> None:
        """Join the group at `host`:`port`; with `lora` (LoraConfig.to_dict()) write adapters to
        lora_root/vVERSION."""
        dtype = self.vllm_config.model_config.dtype  # the dtype it holds: bf16 to a bf16 vLLM
        if lora is not None:
            from peft import LoraConfig

            lora = LoraConfig.from_peft_type(**lora)
        hf, named = published_meta(model_path, dtype, lora)
        self.nanorft_lora, self.nanorft_meta, self.nanorft_root = lora, hf, lora_root
        device = (
            self.device
            if self.device.type == "cuda" and sync_device == "cuda"
            else torch.device("cpu")
        )
        self.nanorft_named = [
            (n, torch.empty(p.shape, dtype=dtype, device=device)) for n, p in named
        ]
        self.nanorft_alive = StoreAlive(host, port, STORE_KNOWN_WAIT_S)
        self.nanorft_sync = sync.WeightSync(
            None, port=port, host=host, device=str(device), timeout_s=timeout_s, wire_dtype=dtype
        ).connect(self.nanorft_alive)

    def nanorft_receive(self, checksum: bool = False) -> tuple[int, float | None]:
        """The next publish, loaded: (version, its checksum (--sync-checksum) or None)."""
        tensors = [t for _, t in self.nanorft_named]
        version = self.nanorft_sync.recv(tensors, self.nanorft_alive)
        if self.nanorft_lora is not None:
            from extras.lora import save_adapter

            save_adapter(
                self.nanorft_meta,
                Path(self.nanorft_root) / f"v{version:06d}",
                [(n, t.cpu()) for n, t in self.nanorft_named],
                self.nanorft_lora,
            )
        else:
            self._nanorft_load(self.nanorft_named)
        # (the argument `checksum` hides the function of that name here)
        return version, Checksum().add(tensors).value if checksum else None

    def nanorft_announced(self) -> int:
        return self.nanorft_sync.announced()

    def nanorft_joined(self) -> bool:
        return getattr(self, "nanorft_sync", None) is not None

    def nanorft_leave(self) -> None:
        self.nanorft_sync.leave()

    def nanorft_load(self, path: str, order: list[str] | None = None) -> float | None:
        """Load a checkpoint directory in place; with `order` (extras.engine_checkpoints.wire_order)
        its checksum, the tensors summed in that order."""
        state = read_safetensors(path)
        self._nanorft_load(list(state.items()))
        return checksum(state[n] for n in order) if order is not None else None

    def _nanorft_load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        # not `.model`: on CUDA that is vLLM's CUDAGraphWrapper around it
        model = self.model_runner.get_model()
        # a checkpoint may hold float32; vLLM may hold bf16
        dtype = self.vllm_config.model_config.dtype
        tied = self.vllm_config.model_config.hf_config.tie_word_embeddings
        expected = ("RotaryEmbedding", "ParallelLMHead") if tied else ("RotaryEmbedding",)
        # layers a publish has no tensors for keep theirs: vLLM's "Failed to load weights" for them
        # is noise
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").filters = [
            lambda r: r.getMessage() not in {f"{name}: Failed to load weights" for name in expected}
        ]
        initialize_layerwise_reload(model)
        model.load_weights((n, t.to(dtype) if t.is_floating_point() else t) for n, t in named)
        finalize_layerwise_reload(model, self.vllm_config.model_config)
        lm_head = getattr(model, "lm_head", None)
        if tied and hasattr(lm_head, "quant_method"):
            # the reload reprocesses only embed_tokens; on CPU the tied lm_head keeps its own
            # prepacked copy
            lm_head.quant_method.process_weights_after_loading(lm_head)
