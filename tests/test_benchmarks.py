"""The benchmark scripts measure what a run does: their explorer and trainer are the ones run.py
builds from the same settings."""

import pytest
import torch
from test_logprobs import process_group  # noqa: F401 (an autouse fixture: a Trainer needs one rank)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bench_steps_engine_holds_the_weights_a_run_gives_it(tiny_model, monkeypatch, dtype):
    """bench_step.setup's HF engine holds bf16 weights for --dtype bfloat16, as a run's engine
    (engines.HFEngine.settings), not float32 ones cast under autocast at every step."""
    from conftest import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_step

    from engines import HFEngine

    class Args:
        model = tiny_model

    made = bench_step.setup(Args(), ["--engine", "hf"], dtype)
    engine = made["ex"].engine
    want = HFEngine.settings(made["cfg"], 0, "cpu")
    assert {p.dtype for p in engine.model.parameters()} == {want["dtype"]}
    assert engine.bf16 == want["bf16"] == (dtype == "bfloat16")
    assert want["dtype"] == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
