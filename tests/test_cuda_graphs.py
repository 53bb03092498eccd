"""The HF engine's decode step over a static cache (cuda_graphs.py): the same tokens and
behaviour log-probs as the growing cache, run eagerly on the CPU and replayed as a CUDA graph
where a GPU is visible."""

import pytest
import torch

from conftest import PROMPTS
from cuda_graphs import Graphs
from engines import HFEngine, Sampling

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)"
)
CASES = [
    pytest.param("cpu", torch.float32, id="cpu-eager-float32"),
    pytest.param(
        "cpu", "autocast", id="cpu-eager-autocast"
    ),  # float32 weights, bf16 values, float32 keys
    pytest.param("cuda:0", torch.float32, marks=needs_cuda, id="cuda-graph-float32"),
    pytest.param("cuda:0", torch.bfloat16, marks=needs_cuda, id="cuda-graph-bf16"),
]
# prompts sharing a prefix, of different lengths (left padding), one of a single token
SHARED = [[3, 4, 5, 6, 7], [3, 4, 5, 9, 10, 11, 12, 13], [3, 4, 5, 20]]


def sample(engine, prompts, n, sampling):
    """(tokens, behaviour log-probs) of every completion, generated from seed 0."""
    engine.generator.manual_seed(0)
    out = [
        c for group in engine.generate_batch(prompts, [n] * len(prompts), sampling) for c in group
    ]
    return [c.tokens for c in out], [c.behaviour_logprobs for c in out]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("prompts", [PROMPTS, SHARED], ids=["distinct", "shared-prefix"])
def test_static_cache_decodes_as_the_growing_cache(tiny_model, device, dtype, prompts):
    capture, bf16 = device != "cpu", dtype == "autocast"
    dtype = torch.float32 if bf16 else dtype
    growing = HFEngine(tiny_model, max_batch=16, device=device, dtype=dtype, bf16=bf16)
    static = HFEngine(tiny_model, max_batch=16, device=device, dtype=dtype, bf16=bf16)
    static.graphs = Graphs(16, capture=capture)
    tol = 2e-2 if dtype == torch.bfloat16 or bf16 else 1e-5
    for sampling in (
        Sampling(max_tokens=20, temperature=0.0),
        Sampling(max_tokens=20, temperature=1.0),
    ):
        tokens, logprobs = sample(growing, prompts, 4, sampling)
        tokens_s, logprobs_s = sample(static, prompts, 4, sampling)
        # bf16 rounding, or kernels chosen by shape (12 growing rows, 16 static; a cache of 128 columns, not the
        # replies' length), can tip a near tie (the tiny model's random weights make many); and a static step
        # draws a number for each of its 16 rows: up to each reply's first different token, the same log-probs
        exact = device == "cpu" and dtype == torch.float32 and not bf16
        for a, b, lp_a, lp_b in zip(tokens, tokens_s, logprobs, logprobs_s):
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            assert same >= 1 and lp_b[:same] == pytest.approx(lp_a[:same], abs=tol)
            # the first decode step draws the growing cache's numbers for the first 12 of its 16 rows
            assert same >= min(2, len(a)) or not exact
        equal = sum(a == b for a, b in zip(tokens_s, tokens))
        if sampling.temperature == 0:
            assert equal >= (len(tokens) - 1 if exact else 0.75 * len(tokens))
    # both samplings decoded with the one step of their shape, a graph of each where captured
    assert [len(step.graphs) for step in static.graphs.steps.values()] == [2 if capture else 0]
    if capture:  # the replayed graph against the same static step run eagerly: the same numbers
        eager = HFEngine(tiny_model, max_batch=16, device=device, dtype=dtype, bf16=bf16)
        eager.graphs = Graphs(16, capture=False)
        (tokens_e, logprobs_e), (tokens_g, logprobs_g) = (
            sample(e, prompts, 4, sampling) for e in (eager, static)
        )
        assert tokens_g == tokens_e
        assert all(g == pytest.approx(e, abs=1e-4) for g, e in zip(logprobs_g, logprobs_e))


def test_steps_are_kept_by_batch_bucket_and_capacity(tiny_model):
    engine = HFEngine(tiny_model, max_batch=16, device="cpu")
    engine.graphs = graphs = Graphs(16, capture=False, keep=2)
    for n, max_tokens in ((1, 4), (2, 4), (5, 4), (5, 130)):  # 3, 6, 15 and 15 rows
        engine.generate_batch(PROMPTS, [n] * 3, Sampling(max_tokens=max_tokens, temperature=1.0))
    assert [key[1:3] for key in graphs.steps] == [(16, 128), (16, 256)]
    engine.generate_batch(PROMPTS, [1] * 3, Sampling(max_tokens=4, temperature=1.0))
    assert [key[1:3] for key in graphs.steps] == [(16, 256), (4, 128)]


def test_each_layer_keeps_its_own_cache_shape():  # models whose layers differ in KV heads or head size
    from types import SimpleNamespace

    from cuda_graphs import Step

    like = [
        SimpleNamespace(keys=torch.zeros(3, h, 5, d), values=torch.zeros(3, h, 5, e))
        for h, d, e in ((1, 32, 32), (2, 16, 8))
    ]
    step = Step(None, like, rows=4, capacity=128, capture=False)
    assert [(tuple(c.keys.shape), tuple(c.values.shape)) for c in step.cache.layers] == [
        ((4, 1, 128, 32), (4, 1, 128, 32)),
        ((4, 2, 128, 16), (4, 2, 128, 8)),
    ]


def test_cuda_graphs_stay_off_on_a_cpu(tiny_model):
    assert HFEngine(tiny_model, device="cpu", graphs=Graphs).graphs is None


@pytest.mark.parametrize("error", [RuntimeError, ValueError])
def test_a_step_that_cannot_be_captured_decodes_eagerly(tiny_model, monkeypatch, capsys, error):
    import cuda_graphs as cg

    def fail(*args, **kwargs):  # ValueError: a model's own check, raised while it is traced
        raise error("operation not permitted when stream is capturing")

    engine, growing = (HFEngine(tiny_model, max_batch=16, device="cpu") for _ in range(2))
    engine.graphs = Graphs(16, capture=False)
    monkeypatch.setattr(cg, "Step", fail)
    sampling = Sampling(max_tokens=12, temperature=0.0)
    assert sample(engine, PROMPTS, 2, sampling) == sample(growing, PROMPTS, 2, sampling)
    assert sample(engine, PROMPTS, 2, sampling) == sample(growing, PROMPTS, 2, sampling)
    assert capsys.readouterr().err.count("CUDA graphs off, decoding eagerly") == 1
    assert "not permitted when stream is capturing" in engine.graphs.failed


@needs_cuda
def test_a_step_that_waits_for_the_gpu_decodes_eagerly_and_leaves_cuda_as_it_was(
    tiny_model, capsys
):
    engine, growing = (
        HFEngine(tiny_model, max_batch=16, device="cuda:0", dtype=torch.bfloat16) for _ in range(2)
    )
    engine.graphs, forward = Graphs(16), engine.model.forward

    def waits(
        *args, **kwargs
    ):  # reads a number back to the host: illegal while a stream is captured
        out = forward(*args, **kwargs)
        out.logits.sum().item()
        return out

    engine.model.forward = waits
    sampling = Sampling(max_tokens=12, temperature=0.0)
    assert sample(engine, PROMPTS, 2, sampling) == sample(growing, PROMPTS, 2, sampling)
    assert (
        "CUDA graphs off, decoding eagerly" in capsys.readouterr().err and not engine.graphs.steps
    )
    assert (
        torch.cuda.current_stream() == torch.cuda.default_stream()
        and torch.cuda.get_sync_debug_mode() == 0
    )
    torch.cuda.empty_cache()  # fails while an abandoned capture is still registered with the allocator
    captured = HFEngine(tiny_model, max_batch=16, device="cuda:0", dtype=torch.bfloat16)
    captured.graphs = Graphs(16)
    sample(captured, PROMPTS, 2, sampling)
    assert [len(step.graphs) for step in captured.graphs.steps.values()] == [1]


class FakeCuda:
    """Stand-ins for the CUDA calls of cuda_graphs.Step.captured and Graphs on a CPU, the logic
    around them real: the warm-up and the capture run the step eagerly, a graph's replay does
    nothing (its outputs stay those of the capture), and where `fail` the capture's end raises as
    CUDAGraph.capture_end does for an invalidated capture. Records the pools handed out
    (`handles`), the pool of each capture (`captures`) and the generators registered with a graph
    (`registered`)."""

    def __init__(self, monkeypatch, fail: bool = False):
        import contextlib
        import itertools
        from types import SimpleNamespace

        self.handles, self.captures, self.registered = [], [], []
        counter = itertools.count(1)
        stream = SimpleNamespace(wait_stream=lambda other: None)

        def handle():
            self.handles.append((0, next(counter)))
            return self.handles[-1]

        fake = self

        class Graph:
            def register_generator_state(self, generator):
                fake.registered.append(generator)

            def replay(self):
                pass

        @contextlib.contextmanager
        def graph(g, pool=None, capture_error_mode="global"):
            self.captures.append(pool)
            yield
            if fail:
                raise RuntimeError(
                    "CUDA error: operation failed due to a previous error during capture"
                )

        for name, value in (
            ("graph_pool_handle", handle),
            ("Stream", lambda: stream),
            ("current_stream", lambda: stream),
            ("set_stream", lambda s: None),
            ("stream", lambda s: contextlib.nullcontext()),
            ("get_sync_debug_mode", lambda: 0),
            ("set_sync_debug_mode", lambda mode: None),
            ("CUDAGraph", Graph),
            ("graph", graph),
        ):
            monkeypatch.setattr(torch.cuda, name, value)


def test_a_capture_that_fails_at_its_end_samples_eagerly_from_a_new_generator(
    tiny_model, monkeypatch, capsys
):
    # capture_end raises for an invalidated capture before the generators registered with the
    # graph leave capture mode: on a GPU every later eager draw from such a generator raises, so
    # the engine must never draw from it again; the new one starts where the old one was before
    # the warm-up, so the replies are those of eager decoding from the same seed
    fake = FakeCuda(monkeypatch, fail=True)
    engine, growing = (HFEngine(tiny_model, max_batch=16, device="cpu") for _ in range(2))
    engine.graphs = Graphs(16)
    sampling = Sampling(max_tokens=12, temperature=1.0)
    for _ in range(2):
        assert sample(engine, PROMPTS, 2, sampling) == sample(growing, PROMPTS, 2, sampling)
    assert fake.registered and all(engine.generator is not g for g in fake.registered)
    assert "previous error during capture" in engine.graphs.failed and not engine.graphs.steps
    assert capsys.readouterr().err.count("CUDA graphs off, decoding eagerly") == 1


@pytest.mark.parametrize("keep,pools", [(1, [(0, 1), (0, 2)]), (2, [(0, 1), (0, 1)])])
def test_a_new_pool_once_the_last_graph_of_one_is_evicted(tiny_model, monkeypatch, keep, pools):
    # a capture into a pool that no graph holds any more asserts in c10 (a known torch issue):
    # with keep=1 each new capacity evicts the only step, and with it the pool's last graph
    fake = FakeCuda(monkeypatch)
    engine = HFEngine(tiny_model, max_batch=16, device="cpu")
    engine.graphs = Graphs(16, keep=keep)
    for max_tokens in (4, 130):  # capacities 128 and 256
        engine.generate_batch(PROMPTS, [1] * 3, Sampling(max_tokens=max_tokens, temperature=1.0))
    assert fake.captures == pools and not engine.graphs.failed


def test_unused_rows_of_a_static_step_start_each_batch_at_position_0(tiny_model):
    # every row of the bucket advances at each step: carried from batch to batch, the unused
    # rows' positions would grow without bound and run past a learned position table (GPT-2)
    engine = HFEngine(tiny_model, max_batch=16, device="cpu")
    engine.graphs = Graphs(16, capture=False)
    sampling = Sampling(max_tokens=12, temperature=0.0)  # greedy: both batches take as many steps
    unused = []
    for _ in range(2):  # 9 rows in a bucket of 16
        engine.generate_batch(PROMPTS, [3] * 3, sampling)
        (step,) = engine.graphs.steps.values()
        unused.append(step.pos[9:, 0].clone())
    assert 0 < int(unused[0].max()) < sampling.max_tokens
    assert torch.equal(unused[1], unused[0])


def capture_fails_at_its_end(model: str, q) -> None:
    """In a process of its own (the default CUDA generator stays in capture mode): completions at
    temperature 1 from an engine whose forward reads a number back while it is captured, and from
    an eager one of the same seed."""
    from engines import HFEngine, Sampling

    engine, growing = (
        HFEngine(model, max_batch=16, device="cuda:0", dtype=torch.bfloat16) for _ in range(2)
    )
    engine.graphs, forward, before = Graphs(16), engine.model.forward, engine.generator

    def reads_back(*args, **kwargs):  # only while captured: the warm-up passes
        out = forward(*args, **kwargs)
        if torch.cuda.is_current_stream_capturing():
            out.logits.sum().item()
        return out

    engine.model.forward = reads_back
    sampling = Sampling(max_tokens=12, temperature=1.0)
    q.put(
        (
            [sample(engine, PROMPTS, 2, sampling) for _ in range(2)],
            [sample(growing, PROMPTS, 2, sampling) for _ in range(2)],
            engine.graphs.failed,
            engine.generator is not before,
        )
    )


@needs_cuda
def test_a_capture_invalidated_on_the_gpu_samples_eagerly_at_temperature_1(tiny_model):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=capture_fails_at_its_end, args=(tiny_model, q))
    proc.start()
    graphs, eager, failed, replaced = q.get(timeout=300)
    proc.join(60)
    assert failed and replaced, failed
    assert graphs == eager and all(c for tokens, _ in graphs for c in tokens)


@needs_cuda
def test_two_capacities_in_a_row_with_keep_1_capture_both(tiny_model):
    engine = HFEngine(tiny_model, max_batch=16, device="cuda:0", dtype=torch.bfloat16)
    engine.graphs = Graphs(16, keep=1)
    pools = []
    for max_tokens in (4, 130):  # capacities 128 and 256: the second evicts the first
        out = engine.generate_batch(
            PROMPTS, [1] * 3, Sampling(max_tokens=max_tokens, temperature=1.0)
        )
        assert all(c.tokens for group in out for c in group)
        (step,) = engine.graphs.steps.values()
        pools.append(step.pool)
    assert not engine.graphs.failed and len(step.graphs) == 1 and pools[0] != pools[1]
