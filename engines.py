"""Inference engines the explorer samples rollouts with: `Engine`, `HFEngine` (transformers),
`ENGINES` (--engine names of the core; the composition root adds the others, vLLM's) and
`make_engine`."""

import asyncio
import contextlib
import functools
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import models
import sync
from losses import resolve
from packing import kept_floor, left_pad, packed_sdpa


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters. temperature 0 = greedy; max_tokens counts response tokens."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class Completion:
    """One response: tokens [R], behaviour_logprobs [R], finish_reason (stop, length), weight
    versions (first, last), logprob_floors [R] of a truncation (sample_token's floors) or None."""

    tokens: list[int]
    behaviour_logprobs: list[float]
    finish_reason: str
    versions: tuple[int, int] = (0, 0)
    logprob_floors: list[float] | None = None


@dataclass
class Batch:
    """The requests of one sampling setting that workflows wait on: one `generate_batch` call.
    Per request: its prompt token ids, n, and the future of its n completions."""

    sampling: Sampling
    prompts: list[list[int]] = field(default_factory=list)
    ns: list[int] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)


class WorkflowRuns:
    """Workflow runs (coroutines) on an event loop of their own, each cut off after `timeout_s`,
    whose `engine.generate` calls the caller serves (Explorer.rollout):

        with WorkflowRuns(engine, runs, timeout_s) as waiting:
            for batch in waiting:  # the requests of every run waiting for completions
                outs = engine.generate_batch(batch.prompts, batch.ns, batch.sampling)
                engine.deliver(batch, outs)
        waiting.outcomes  # per run, in order: its result, or the exception it ended with

    The event loop runs only while the caller asks for the next batch: the workflows run until
    each waits for completions or has ended; then the caller generates."""

    def __init__(self, engine: "Engine", runs, timeout_s: float):
        self.engine = engine
        self.runner = asyncio.Runner()
        loop = self.runner.get_loop()
        self.jobs = [loop.create_task(asyncio.wait_for(r, timeout_s)) for r in runs]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.outcomes: list = []

    def __enter__(self) -> "WorkflowRuns":
        if self.engine._batches is not None:
            raise RuntimeError("the engine already serves another rollout loop")
        self.engine._batches = self.queue
        return self

    def __iter__(self):
        while (batch := self.runner.run(self._next())) is not None:
            yield batch

    async def _next(self) -> Batch | None:
        """The next batch of waiting requests; None once every run has ended."""
        while self.queue.empty():
            running = [j for j in self.jobs if not j.done()]
            if not running:
                return None
            get = asyncio.ensure_future(self.queue.get())
            await asyncio.wait([get, *running], return_when=asyncio.FIRST_COMPLETED)
            if get.done():
                return get.result()
            get.cancel()
        return self.queue.get_nowait()

    def __exit__(self, *exc) -> None:
        self.engine._batches = None
        # cancels what still runs (an exception left the loop), closes the event loop
        self.runner.close()
        # per run: its result, or the exception it ended with (CancelledError if cancelled)
        self.outcomes = [
            asyncio.CancelledError() if j.cancelled() else j.exception() or j.result()
            for j in self.jobs
        ]


class Engine:
    """Base engine. Subclasses implement `generate_batch`, `join_weight_sync`,
    `receive_weights(alive)` -> (version, checksum), `load_checkpoint(path, version)` -> checksum
    and `from_config`; `step_hook` runs between decode steps."""

    def __init__(self):
        self._pending: dict[Sampling, Batch] = {}
        # while a rollout loop serves generate's requests (WorkflowRuns): where they wait
        self._batches: asyncio.Queue | None = None
        self.version = 0  # the weight version loaded now
        # run by close, newest first: services started on this engine (an OpenAI endpoint)
        self.closers: list[Callable[[], None]] = []
        self.step_hook = None
        self.checksum = False
        # says what the engine is doing (mode both: on the trainer's progress bar)
        self.status = lambda text: None
        self.label = ""  # what the current requests are for ("batch 3", "evaluation of version 10")
        # the model or adapter directory of the start weights (its files key eval_cache)
        self.loaded_from = ""
        # tokens of every generate_batch so far: prefilled (a prompt a group shares: once), sampled
        self.prefilled_tokens = 0
        self.sampled_tokens = 0

    def working_on(self, label: str) -> None:
        """Name what the next requests are for, in the engine's status lines."""
        self.label = label

    @contextlib.contextmanager
    def paced_by(self, step_hook: Callable[[], None] | None):
        """Call `step_hook` between decode steps inside the block (in flight: new weights for the
        sequences being decoded); None: no call, one weight version per request."""
        outer = self.step_hook
        self.step_hook = step_hook
        try:
            yield
        finally:
            self.step_hook = outer

    async def generate(self, prompt_ids: list[int], n: int, sampling: Sampling) -> list[Completion]:
        """`n` completions of one prompt, sampled in one `generate_batch` with the requests in
        flight. Runs inside `WorkflowRuns` (RuntimeError elsewhere): the rollout loop samples
        them."""
        if self._batches is None:
            raise RuntimeError("Engine.generate runs in WorkflowRuns: the rollout loop serves it")
        fut = asyncio.get_running_loop().create_future()
        if sampling not in self._pending:
            self._pending[sampling] = Batch(sampling)
            asyncio.get_running_loop().create_task(self._flush(sampling))
        batch = self._pending[sampling]
        batch.prompts.append(prompt_ids)
        batch.ns.append(n)
        batch.futures.append(fut)
        return await fut

    async def _flush(self, sampling: Sampling) -> None:
        for _ in range(3):  # let every runnable workflow reach its generate call
            await asyncio.sleep(0)
        self._batches.put_nowait(self._pending.pop(sampling))

    def deliver(self, batch: "Batch", outs: list[list["Completion"]] | Exception) -> None:
        """Hand each waiting request its completions (or the engine's exception)."""
        if not isinstance(outs, Exception):
            prompts = {tuple(p) for p in batch.prompts}  # each distinct prompt is prefilled once
            self.prefilled_tokens += sum(map(len, prompts))
            self.sampled_tokens += sum(len(c.tokens) for out in outs for c in out)
        for i, fut in enumerate(batch.futures):
            if fut.done():  # a workflow that timed out has cancelled its future
                continue
            if isinstance(outs, Exception):
                fut.set_exception(outs)
            else:
                fut.set_result(outs[i])

    def generate_batch(
        self, prompts: list[list[int]], ns: list[int], sampling: Sampling
    ) -> list[list[Completion]]:
        """Per prompt, its n completions."""
        raise NotImplementedError

    def weights_announced(self) -> int:
        """Newest version the trainer has started to publish (-1 before any); never blocks."""
        return self.weights.announced()

    def wait_weights(self, alive: Callable[[], bool]) -> None:
        """Block until the trainer starts its next publish; RuntimeError once `alive()` is False."""
        self.weights.wait_announced(alive)

    def weights_joined(self) -> bool:
        return getattr(self, "weights", None) is not None

    def leave_weight_sync(self) -> None:
        self.weights.leave()

    def rng_state(self) -> bytes | None:
        """State of the sampling RNG (for resume), or None when the engine cannot save it."""
        return None

    def set_rng_state(self, state: bytes) -> None:
        """Restore a `rng_state()`."""

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run `fn` when the engine closes (before the engine's own release)."""
        self.closers.append(fn)

    def close(self) -> None:
        """Stop what was started on the engine (`on_close`); subclasses then release their
        processes (vLLM's engine core)."""
        while self.closers:
            self.closers.pop()()


def sample_token(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(tokens [B], behaviour_logprobs [B], floors [B] or None) from logits [B, V]: softmax(logits /
    temperature) renormalised in its kept set (packing.kept_floor: top-k, then top-p; the floors
    the trainer replays, None without truncation). temperature 0: greedy, log-prob 0."""
    if sampling.temperature == 0:
        return logits.argmax(-1), logits.new_zeros(logits.shape[0], dtype=torch.float), None
    logp = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)  # [B, V]
    if (floors := kept_floor(logp, sampling.top_p, sampling.top_k)) is not None:  # [B]
        logp = torch.log_softmax(logp.masked_fill(logp < floors[:, None], float("-inf")), dim=-1)
    cdf = logp.exp().cumsum(-1)  # [B, V]
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]  # [B, 1]
    # inverse CDF (never a token of mass 0): on a CPU much faster than torch.multinomial
    tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1).squeeze(-1)  # [B]
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), floors


@functools.cache
def slot_layer() -> type:
    """The KV-cache layer class of the HF engine's decoding."""
    from transformers.cache_utils import DynamicLayer

    class SlotLayer(DynamicLayer):
        """After `reserve(capacity)`, each decode step writes its slot of buffers [B, KV, capacity,
        D]."""

        room = None  # (keys, values) buffers [B, KV, capacity, D]

        def reserve(self, capacity: int) -> None:
            if not self.is_initialized or self.keys.shape[-2] >= capacity:
                return
            B, H, L, D = self.keys.shape
            self.room = tuple(x.new_empty(B, H, capacity, D) for x in (self.keys, self.values))
            self.room[0][:, :, :L], self.room[1][:, :, :L] = self.keys, self.values
            self.keys, self.values = self.room[0][:, :, :L], self.room[1][:, :, :L]

        def update(self, key_states, value_states, *args, **kwargs):
            room = self.room
            if room is None or self.keys.shape[-2] + key_states.shape[-2] > room[0].shape[-2]:
                self.room = None
                return super().update(key_states, value_states, *args, **kwargs)
            L, n = self.keys.shape[-2], key_states.shape[-2]
            room[0][:, :, L : L + n], room[1][:, :, L : L + n] = key_states, value_states
            self.keys, self.values = room[0][:, :, : L + n], room[1][:, :, : L + n]
            return self.keys, self.values

        def reorder_cache(self, beam_idx):
            self.room = None
            super().reorder_cache(beam_idx)

        def keep(self, rows: torch.Tensor) -> None:
            """Keep only the batch rows `rows` [A], the room still reserved."""
            if self.room is None:
                return super().reorder_cache(rows)
            L = self.keys.shape[-2]
            self.room = (self.room[0][rows], self.room[1][rows])
            self.keys, self.values = self.room[0][:, :, :L], self.room[1][:, :, :L]

    return SlotLayer


def decode_cache():
    """An empty KV cache of `slot_layer` layers."""
    from transformers.cache_utils import Cache

    return Cache(layer_class_to_replicate=slot_layer())


class Decoding:
    """Decode steps over a prefilled cache of `decode_cache()`: each call takes the tokens [A] just
    sampled and samples the next ones under `sampling` with `generator` (kept as `generator`):
    (tokens [A], behaviour log-probs [A], floors [A] or None: `sample_token`'s)."""

    drops = True  # ended rows can leave the batch

    def __init__(
        self,
        model,
        cache,
        attn: torch.Tensor,
        pos: torch.Tensor,
        sampling: Sampling,
        generator: torch.Generator,
    ):
        self.model = model
        self.cache = cache
        self.attn = attn  # [A, P]
        self.pos = pos  # [A, S]
        self.sampling = sampling
        self.generator = generator
        for layer in cache.layers:
            # each decode step writes its slot: no copy
            layer.reserve(attn.shape[1] + sampling.max_tokens)

    def keep(self, rows: torch.Tensor) -> None:
        self.attn, self.pos = self.attn[rows], self.pos[rows]
        for layer in self.cache.layers:
            layer.keep(rows)

    def __call__(self, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        self.attn = torch.cat([self.attn, self.attn.new_ones((len(tok), 1))], dim=1)
        self.pos = self.pos[:, -1:] + 1
        logits = self.model(
            input_ids=tok[:, None],
            attention_mask=self.attn,
            position_ids=self.pos,
            past_key_values=self.cache,
            use_cache=True,
        ).logits[:, -1]
        return sample_token(logits, self.sampling, self.generator)


# decode steps between two reads of `done` on a GPU: each read waits for the GPU to finish the step,
# while a row that has ended only decodes padding until the next read
GPU_CHECK_EVERY = 8


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the *.safetensors files of a checkpoint directory (CPU);
    FileNotFoundError when there are none."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    return {k: v for f in files for k, v in load_file(f).items()}


class HFEngine(Engine):
    """transformers engine. model_path: a model or peft adapter directory; drop_ended: ended rows
    leave the decode batch once they are this fraction of it (> 1: never; a smaller batch costs a
    reorder of the KV cache); graphs: on a CUDA device, a factory(max_batch) of `Decoding`'s
    contract that the decode steps run on (the composition root's CUDA graphs for --cuda-graphs),
    else `Decoding`; the engine draws from the `generator` of the decoding it returns. A subclass
    with adapters overrides `pretrained`, `parameters` and `load_weights`."""

    def __init__(
        self,
        model_path: str,
        max_batch: int = 64,
        seed: int = 0,
        bf16: bool = False,
        device: str = "",
        dtype: torch.dtype = torch.float32,
        graphs: Callable[[int], Callable] | None = None,
        drop_ended: float = 0.25,
    ):
        super().__init__()
        from transformers import AutoTokenizer

        self.drop_ended = drop_ended
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # decode steps between two reads of which rows have ended
        self.check_every = 1 if self.device.type == "cpu" else GPU_CHECK_EVERY
        self.model = self.pretrained(model_path, dtype)
        self.max_batch = max_batch
        self.bf16 = bf16
        self.loaded_from = model_path
        gen_eos = self.model.generation_config.eos_token_id
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        eos = {e for e in gen_eos + [self.tokenizer.eos_token_id] if e is not None}
        self.eos = torch.tensor(sorted(eos), device=self.device)
        self.pad = models.pad_token_id(self.tokenizer)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.graphs = None
        if graphs is not None and self.device.type == "cuda":
            self.graphs = graphs(max_batch)

    def pretrained(self, model_path: str, dtype: torch.dtype):
        """The model of `model_path` on this engine's device, in eval mode."""
        from transformers import AutoModelForCausalLM

        base = models.base_model_dir(model_path)
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype=dtype, attn_implementation=packed_sdpa()
        )
        return model.to(self.device).eval()

    @classmethod
    def from_config(
        cls, cfg, model_path: str, seed: int, device: str, colocated: bool, graphs=None
    ) -> "HFEngine":
        """The engine of cfg's settings (`settings`), sampling with `seed` on `device`."""
        return cls(model_path, **cls.settings(cfg, seed, device, graphs))

    @staticmethod
    def settings(cfg, seed: int, device: str, graphs=None) -> dict:
        """The keyword arguments of cfg's engine: bf16 weights for --dtype bfloat16, so that no
        float32 copy is cast at every step (faster decoding, docs/benchmarks.md)."""
        bf16 = cfg.dtype == "bfloat16"
        return dict(
            max_batch=cfg.explorer_max_batch,
            seed=seed,
            bf16=bf16,
            device=device,
            dtype=torch.bfloat16 if bf16 else torch.float32,
            graphs=graphs,
        )

    def rng_state(self):
        return bytes(self.generator.get_state().tolist())

    def set_rng_state(self, state):
        self.generator.set_state(torch.tensor(list(state), dtype=torch.uint8))

    def parameters(self) -> list[torch.Tensor]:
        """What a weight sync carries, in the wire order (named_parameters): the weights."""
        return list(self.model.parameters())

    def join_weight_sync(
        self, host, port, timeout_s, alive, device="cpu", transport=sync.WeightSync
    ):
        self.weights = transport(
            None,
            port=port,
            host=host,
            device=device,
            timeout_s=timeout_s,
            wire_dtype=self.parameters()[0].dtype,
        ).connect(alive)

    def receive_weights(self, alive):
        params = self.parameters()
        self.version = self.weights.recv(params, alive)
        digest = sync.new_digest(self.checksum)
        return self.version, None if digest is None else digest.add(params).value

    def load_checkpoint(self, path, version):
        """Load the checkpoint directory `path` of weight `version` (`load_weights`) in place;
        the checksum of what a weight sync carries when the engine checks syncs, else None."""
        self.load_weights(path)
        self.version = version
        return sync.checksum(self.parameters()) if self.checksum else None

    def load_weights(self, path: str | Path) -> None:
        """Copy the weights of the checkpoint directory `path` into the model."""
        state = read_safetensors(path)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(state[name])

    def generate_batch(self, prompts, ns, s):
        """max_batch rollouts at a time; a shared prompt prefix and each prompt are prefilled
        once."""
        seqs = [p for p, n in zip(prompts, ns) for _ in range(n)]
        out = []
        dev = self.device
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.bf16):
            for start in range(0, len(seqs), self.max_batch):
                stop = min(len(seqs), start + self.max_batch)
                self.status(f"{self.label}: sequences {start}-{stop} of {len(seqs)}")
                chunk = seqs[start:stop]
                B = len(chunk)
                # a group shares its prompt: [B] the row in `distinct` of each sequence's prompt
                distinct = list(dict.fromkeys(map(tuple, chunk)))
                of = torch.tensor([distinct.index(tuple(p)) for p in chunk], device=dev)
                cache = decode_cache()
                C = len(os.path.commonprefix(distinct)) if len(distinct) > 1 else 0
                # every prompt keeps a token of its own to prefill
                C = min(C, min(map(len, distinct)) - 1)
                if C > 0:  # the prefix all prompts share, prefilled once in one row
                    self.model(
                        input_ids=torch.tensor([distinct[0][:C]], device=dev),
                        past_key_values=cache,
                        position_ids=torch.arange(C, device=dev)[None],
                        use_cache=True,
                        logits_to_keep=1,
                    )
                    cache.reorder_cache(torch.zeros(len(distinct), dtype=torch.long, device=dev))
                rest = [list(p[C:]) for p in distinct]
                ids, attn, pos = (x.to(dev) for x in left_pad(rest, self.pad))  # [U, S]
                attn = torch.cat([attn.new_ones(len(distinct), C), attn], 1)  # [U, C + S]
                pos = pos + C
                logits = self.model(
                    input_ids=ids,
                    attention_mask=attn,
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                ).logits[:, -1]  # [U, V]
                if len(distinct) < B:  # its rollouts start from copies of its prompt's KV
                    cache.reorder_cache(of)
                    logits = logits[of]  # [B, V]
                attn, pos = attn[of], pos[of]  # [B, P]
                decoding = (self.graphs or Decoding)(
                    self.model, cache, attn, pos, s, self.generator
                )
                self.generator = decoding.generator  # a failed graph capture gives a new one
                # [B, R] the sampled tokens and their behaviour log-probs
                tokens = torch.full((B, s.max_tokens), self.pad, dtype=torch.long, device=dev)
                behaviour, floors = torch.zeros(2, B, s.max_tokens, device=dev)  # [B, R] each
                # [A] the row of `chunk` of each row still decoding
                live = torch.arange(B, device=dev)
                done = torch.zeros(B, dtype=torch.bool, device=dev)  # [A]
                # [B] latest version
                first = self.version
                last = torch.full((B,), self.version, device=dev)
                # [A] tokens, [A] their log-probs: the first from the prefill, then from decoding
                tok, lp, fl = sample_token(logits, s, self.generator)
                for step in range(s.max_tokens):
                    if step > 0:
                        tok, lp, fl = decoding(tok)
                    tok = tok.masked_fill(done, self.pad)
                    tokens[live, step], behaviour[live, step] = tok, lp
                    if fl is not None:  # a truncation's kept sets
                        floors[live, step] = fl
                    if self.version != first:  # no boolean index: it would wait for the device
                        last[live] = torch.where(done, last[live], self.version)
                    done = done | torch.isin(tok, self.eos)
                    checking = (step + 1) % self.check_every == 0
                    if checking and done.all():
                        break
                    if self.step_hook is not None:
                        self.step_hook()  # in-flight: may load new weights; the KV cache is kept
                    # ended rows leave
                    ending = checking and decoding.drops
                    if ending and int(done.sum()) >= self.drop_ended * len(done):
                        keep = (~done).nonzero().squeeze(1)  # [A']
                        live, tok, done = live[keep], tok[keep], done[keep]
                        decoding.keep(keep)
                eos = set(self.eos.tolist())
                for t, lp, v in zip(
                    tokens[:, : step + 1].tolist(), behaviour[:, : step + 1].tolist(), last.tolist()
                ):
                    end = next((j + 1 for j, x in enumerate(t) if x in eos), None)
                    reason = "length" if end is None else "stop"
                    out.append(Completion(t[:end], lp[:end], reason, (first, v)))
                for c, row in zip(out[start:], [] if fl is None else floors.tolist()):
                    c.logprob_floors = [round(f, 6) for f in row[: len(c.tokens)]]  # compact JSON
        completions = iter(out)
        return [list(itertools.islice(completions, n)) for n in ns]


def vllm_available() -> bool:
    """Whether the vllm package is installed."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# --engine name -> the engine class
ENGINES = {"hf": HFEngine}


def make_engine(
    cfg,
    model_path: str,
    seed: int,
    device: str = "",
    colocated: bool = False,
    version: int = 0,
    status: Callable[[str], None] | None = None,
    build: Callable[..., Engine] | None = None,
) -> Engine:
    """The engine of `model_path`, sampling with `seed` on `device`, holding weight `version`,
    saying what it does to `status`. build: (cfg, model_path, seed, device, colocated) -> the
    engine, the composition root's for cfg.engine; None: the from_config of the class ENGINES
    or an import path names."""
    torch.set_num_threads(cfg.explorer_threads)
    build = build or resolve(cfg.engine, ENGINES, "engine").from_config
    engine = build(cfg, model_path, seed, device, colocated)
    engine.checksum = cfg.sync_checksum
    engine.version = version
    if status is not None:
        engine.status = status
    return engine


def use_gpu(device: str) -> str:
    """Make `device` the only GPU this process sees (vLLM takes the first): "cuda:0", else
    `device`."""
    if not device.startswith("cuda:"):
        return device
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[int(device.split(":")[1])]
    return "cuda:0"
