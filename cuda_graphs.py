"""The HF engine's decode step, sampling included, as a CUDA graph (`--cuda-graphs`, on by
default on a GPU: the composition root gives engines.HFEngine the factory `Graphs`; a module of
its own, performance machinery beside the engine, never inside it): one launch instead of tens per
layer and no host sync. Graphs need fixed shapes and addresses, so the KV cache is static
([Bb, KV, L, D] per layer for a batch bucket Bb and a capacity L) with a boolean mask
[Bb, 1, 1, L]; syncs copy weights in place, so graphs stay valid; the engine's generator is
registered with each graph (its draws advance as eager steps' would). After PyTorch's CUDA
Graphs notes (torch.cuda.graph, warm-up on a side stream, CUDAGraph.register_generator_state)
and transformers' StaticCache."""

import sys
from collections import OrderedDict

import torch
from transformers.cache_utils import Cache, DynamicLayer

from engines import Decoding, sample_token

CAPACITY_STEP = 128  # tokens: the capacities of the static caches


class ColumnLayer(DynamicLayer):
    """KV buffers [Bb, KV, L, D]; each update writes the column `index` [1], a device tensor set
    between steps."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.index, self.is_initialized = keys, values, index, True
        self.dtype, self.device = keys.dtype, keys.device

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.index, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, self.index, value_states.to(self.values.dtype))
        return self.keys, self.values


class Step:
    """One decode step of `model` over a static cache shaped like `like` (a prefilled cache's
    layers) for `rows` sequences and `capacity` tokens, the next tokens sampled in the step;
    captured as a CUDA graph per sampling (its temperature, top-p and top-k) when `capture`, else
    run eagerly."""

    def __init__(self, model, like: list, rows: int, capacity: int, capture: bool, pool=None):
        device = like[0].keys.device
        # [Bb, KV, L, D] of each layer in the growing cache's dtypes (under autocast: float32, as it
        # promotes)
        kv = lambda t: t.new_zeros(rows, t.shape[1], capacity, t.shape[3])  # noqa: E731
        self.index = torch.zeros(1, dtype=torch.long, device=device)
        self.cache = Cache(
            layers=[ColumnLayer(kv(layer.keys), kv(layer.values), self.index) for layer in like]
        )
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [Bb, 1]
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [Bb, 1]
        self.mask = torch.zeros(
            rows, 1, 1, capacity, dtype=torch.bool, device=device
        )  # [Bb, 1, 1, L]
        self.mask[:, 0, 0, 0] = True  # no row attends to nothing (softmax of no column is NaN)
        self.model = model
        self.capture = capture
        self.pool = pool  # the memory pool its graphs share (torch.cuda.graph_pool_handle)
        # (temperature, top_p, top_k) -> (graph, its sampled tokens [Bb], their log-probs [Bb],
        # their floors [Bb] or None)
        self.graphs: dict[tuple, tuple] = {}

    def forward(self, sampling, generator: torch.Generator) -> tuple:
        """(tokens [Bb], log-probs [Bb], floors [Bb] or None): engines.sample_token's."""
        logits = self.model(
            input_ids=self.ids,
            attention_mask=self.mask,
            position_ids=self.pos,
            past_key_values=self.cache,
            use_cache=True,
        ).logits[:, -1]  # [Bb, V]
        return sample_token(logits, sampling, generator)

    def prepare(self, sampling, generator: torch.Generator) -> None:
        """Capture the step for `sampling` unless it is (eager: nothing to do). Raises what the
        capture raised."""
        key = (sampling.temperature, sampling.top_p, sampling.top_k)
        if self.capture and key not in self.graphs:
            self.graphs[key] = self.captured(sampling, generator)

    def captured(self, sampling, generator: torch.Generator) -> tuple:
        """(graph, tokens [Bb], log-probs [Bb], floors [Bb] or None) of the step under `sampling`,
        drawing from `generator` (registered with the graph: each replay advances it as the eager
        step would); the generator is left as it was."""
        # autocast's weight cache would free the casts the graph reads: the graph casts on every
        # replay
        cast = torch.autocast(
            "cuda",
            dtype=torch.get_autocast_dtype("cuda"),
            enabled=torch.is_autocast_enabled("cuda"),
            cache_enabled=False,
        )
        side = torch.cuda.Stream()
        before = torch.cuda.current_stream()
        debug = torch.cuda.get_sync_debug_mode()
        state = generator.get_state()  # the warm-up's draws are not the batch's
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(generator)
        side.wait_stream(before)
        try:
            # a step that waits for the GPU fails in the warm-up: a failed capture cannot be
            # undone cleanly
            torch.cuda.set_sync_debug_mode("error")
            with torch.cuda.stream(side), cast:
                for _ in range(2):  # kernels chosen, workspaces allocated, outside the capture
                    self.forward(sampling, generator)
            # the capture synchronizes the device (the warm-up) first
            torch.cuda.set_sync_debug_mode(debug)
            # thread_local: a weight sync in another thread may copy meanwhile
            with (
                torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"),
                cast,
            ):
                tokens, logprobs, floors = self.forward(sampling, generator)
        finally:
            # a failed warm-up may still be writing the cache; a failed capture leaves its stream
            # current
            torch.cuda.set_sync_debug_mode(debug)
            before.wait_stream(side)
            torch.cuda.set_stream(before)
            generator.set_state(state)
        return graph, tokens, logprobs, floors

    def __call__(self, sampling, generator: torch.Generator) -> tuple:
        """The next tokens [Bb], their log-probs [Bb] and floors [Bb] or None; a captured step's are
        overwritten by its next call."""
        key = (sampling.temperature, sampling.top_p, sampling.top_k)
        if key not in self.graphs:
            return self.forward(sampling, generator)
        graph, tokens, logprobs, floors = self.graphs[key]
        graph.replay()
        return tokens, logprobs, floors


class Replay:
    """engines.Decoding's contract on a `Step`: rows stay in the batch until the last one ends."""

    drops = False

    def __init__(
        self, step: Step, cache, attn: torch.Tensor, pos: torch.Tensor, sampling, generator
    ):
        B, P = attn.shape
        for column, layer in zip(step.cache.layers, cache.layers):
            column.keys[:B, :, :P], column.values[:B, :, :P] = layer.keys, layer.values
        step.mask[:, :, :, 1:] = False
        step.mask[:B, 0, 0, :P] = attn.bool()
        step.pos[:B] = pos[:, -1:]
        # the unused rows start again at 0: each step advances every row, and positions carried over
        # from batch to batch would run past a learned position table (GPT-2, OPT: a device assert)
        step.pos[B:] = 0
        self.step = step
        self.rows = B
        self.column = P
        self.sampling = sampling
        self.generator = generator

    def __call__(self, tok: torch.Tensor) -> tuple:
        """(tokens [B], log-probs [B], floors [B] or None) of the next step."""
        s = self.step
        s.ids[: self.rows, 0] = tok
        s.pos += 1
        s.index.fill_(self.column)
        s.mask[:, 0, 0, self.column] = True
        self.column += 1
        tokens, logprobs, floors = s(self.sampling, self.generator)
        floors = None if floors is None else floors[: self.rows]
        return tokens[: self.rows], logprobs[: self.rows], floors


def restored(generator: torch.Generator, state: torch.Tensor) -> torch.Generator:
    """A new generator on `generator`'s device in `state` (`get_state`'s uint8 tensor)."""
    fresh = torch.Generator(generator.device)
    fresh.set_state(state)
    return fresh


class Graphs:
    """engines.Decoding for each batch: the last `keep` steps used, by (batch bucket, capacity,
    dtype), each with a graph per sampling; eager if not `capture`. The decoding it returns
    carries the generator to draw from (`generator`): a new one after a failed capture."""

    def __init__(self, max_batch: int, capture: bool = True, keep: int = 8):
        self.max_batch, self.capture, self.keep = max_batch, capture, keep
        self.steps: OrderedDict[tuple, Step] = OrderedDict()
        # every graph's memory in one pool: a graph's inputs and cache are allocated outside its
        # capture, and its outputs, which another graph's replay may overwrite, are read before the
        # next replay (generate_batch); a new pool once the steps holding the last one are evicted
        self.pool = None
        self.failed = ""  # why a capture failed: from then on every batch decodes eagerly

    def __call__(self, model, cache, attn: torch.Tensor, pos: torch.Tensor, sampling, generator):
        B, P = attn.shape
        rows = max(B, min(self.max_batch, 1 << (B - 1).bit_length()))
        capacity = -(-(P + sampling.max_tokens) // CAPACITY_STEP) * CAPACITY_STEP
        key = (id(model), rows, capacity, cache.layers[0].keys.dtype, cache.layers[0].values.dtype)
        if not self.failed:
            # the state before any warm-up: a failed capture leaves `generator` unusable (below)
            state = generator.get_state()
            try:
                if key not in self.steps:
                    while len(self.steps) >= self.keep:
                        self.steps.popitem(last=False)
                    if not self.steps:
                        # the pool's last graphs went with the evicted steps: a capture into a pool
                        # that no graph holds any more asserts in c10 (a known torch issue)
                        self.pool = None
                    if self.capture and self.pool is None:
                        self.pool = torch.cuda.graph_pool_handle()
                    self.steps[key] = Step(
                        model, cache.layers, rows, capacity, self.capture, self.pool
                    )
                self.steps[key].prepare(sampling, generator)
            except Exception as e:  # a model whose step cannot be captured still decodes
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                self.steps.clear()  # their static caches are not used again
                # capture_end raises for an invalidated capture before the registered generators
                # leave capture mode: every eager draw from `generator` would raise. A new one in
                # the state from before the warm-up takes its place (the engine draws from the
                # returned Decoding's); the default generator is left as it is
                generator = restored(generator, state)
                print(
                    "nanorft: CUDA graphs off, decoding eagerly: the capture failed "
                    f"({self.failed})",
                    file=sys.stderr,
                    flush=True,
                )
        if self.failed:
            return Decoding(model, cache, attn, pos, sampling, generator)
        self.steps.move_to_end(key)
        return Replay(self.steps[key], cache, attn, pos, sampling, generator)
