"""benchmarks/bench_trainer.py on a CPU (tiny shape) and the CUDA levers of the trainer that a CPU can check."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the benchmark script end to end
def test_bench_trainer_writes_both_arms_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_trainer.py",
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--lengths",
            "64,128",
            "--lora-ranks",
            "0,16",
            "--levers",
            "activation_checkpointing",
            "--tokens-per-step",
            "256",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        timeout=300,
    )
    rec = json.loads(out.read_text())
    arms = {(r["arm"], r["lora_rank"], r["length"], r["lever"]) for r in rec["rows"]}
    assert arms >= {
        (a, rank, n, "default") for a in ("nanorft", "raw") for rank in (0, 16) for n in (64, 128)
    }
    assert ("nanorft", 0, 128, "activation_checkpointing=off") in arms and not rec["skipped"]
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_step"] == 256 for r in rec["rows"])
    assert set(rec["nanorft_vs_raw"]) == {"r0_64", "r0_128", "r16_64", "r16_128"}


@pytest.mark.slow  # the benchmark script end to end
def test_bench_trainer_writes_each_arm_as_it_comes_and_keeps_to_its_compile_budget(tmp_path):
    # the GPU check's trainer stage once lost every figure when it ran out of time: the JSON came
    # only at the end. A compile budget of 0 s: the compiled raw loop is skipped, not compiled
    import time

    out = tmp_path / "bench.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "benchmarks/bench_trainer.py",
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--lengths",
            "64",
            "--lora-ranks",
            "0",
            "--levers",
            "activation_checkpointing",
            "--tokens-per-step",
            "256",
            "--rounds",
            "1",
            "--compile-budget-s",
            "0",
            "--json",
            str(out),
        ],
        cwd=ROOT,
    )
    try:
        while not out.exists() and proc.poll() is None:
            time.sleep(0.02)
        first = json.loads(out.read_text())
        assert proc.wait(timeout=300) == 0
    finally:
        proc.kill()
    # the first figures, before the lever's arm ran
    assert {(r["arm"], r["lever"]) for r in first["rows"]} == {
        ("nanorft", "default"),
        ("raw", "default"),
    }
    last = json.loads(out.read_text())
    assert [(r["arm"], r["lever"]) for r in last["rows"]][2:] == [
        ("nanorft", "activation_checkpointing=off")
    ]
    assert last["skipped"] == ["raw_compiled lora_rank 0 length 64"] and last["compile_s"] == []
    assert set(last["nanorft_vs_raw"]) == {"r0_64"} and "nanorft_vs_raw_compiled" not in last


def test_causal_rows_give_the_logprobs_of_the_block_mask(tiny_model):
    # rows of one sequence each (different lengths, so the shorter row is padded): is_causal attention without a mask
    from transformers import AutoModelForCausalLM

    from buffer import Experience
    from packing import pack, response_logprobs

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="sdpa"
    )
    exps = [
        Experience(
            [5, 6, 7, n] + list(range(40, 40 + n)), 4, [-1.0] * n, [1] * n, 1.0, f"g{n}", "t", 0
        )
        for n in (9, 3)
    ]  # prompts differ: a row each
    plain, causal = pack(exps, 2, 0, 8), pack(exps, 2, 0, 8, causal=True)
    assert causal["attention_mask"] is None and plain["attention_mask"].shape == (2, 1, 16, 16)
    with torch.no_grad():
        a, _ = response_logprobs(model, plain, 1.0)  # [B, R]
        b, _ = response_logprobs(model, causal, 1.0)  # [B, R]
    assert torch.allclose(a, b, atol=1e-5) and (a * plain["mask"]).abs().sum() > 0
    shared = [
        Experience([5, 6, 7, 8, 40 + i], 4, [-1.0], [1], 1.0, "g", "t", 0) for i in range(2)
    ]  # one row of two
    assert pack(shared, 2, 0, 8, causal=True)["attention_mask"] is not None


def test_a_block_that_fails_to_compile_runs_eagerly(monkeypatch, capsys):
    import perf

    def broken(fn, **settings):
        def fail(*args, **kwargs):
            raise torch._dynamo.exc.TorchDynamoException("no backend")

        return fail

    monkeypatch.setattr(torch, "compile", broken)
    forward = perf.compiled(lambda x: x + 1)
    assert forward(1) == 2 and forward(2) == 3
    assert capsys.readouterr().out.count("warning: torch.compile") == 1


@pytest.mark.parametrize("chunk", [0, 64])
def test_head_chunks_of_any_size_give_the_same_logprobs(chunk):
    from packing import chunked_logprobs

    torch.manual_seed(0)
    hidden, weight, targets = torch.randn(9, 8), torch.randn(16, 8), torch.randint(16, (9,))
    lp, _ = chunked_logprobs(hidden, weight, targets, 1.0, chunk_elems=chunk)
    assert torch.allclose(
        lp,
        torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[:, None]).squeeze(-1),
        atol=1e-5,
    )


@pytest.mark.parametrize(
    "lever",
    ["causal_rows", "fused_adamw", "one_gpu_fsdp", "checkpoint_if_needed", "head_chunk_elems"],
)
def test_a_lever_is_a_setting_flipped_from_its_default(lever):
    # the levers are Config fields: an arm sets them in its own Config, nothing module-wide
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_trainer

    from config import Config, parse_config

    assert lever in bench_trainer.LEVERS
    (value,) = bench_trainer.flip(lever).values()
    assert value != getattr(Config(), lever)
    name = lever.replace("_", "-")
    if isinstance(value, bool):
        flags = [f"--{name}" if value else f"--no-{name}"]
    else:
        flags = [f"--{name}", str(value)]
    assert getattr(parse_config(flags), lever) == value  # a user sets it as the arm does


def test_mfu_counts_attention_as_palm_does():
    # PaLM (arXiv:2204.02311 appendix B): 6N + 12 L H Q T per token; attention was counted at a
    # quarter of that (6 L H Q T^2 / 2 per rollout)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_trainer

    fields = {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8, "vocab_size": 100}
    fields["hidden_size"] = 32
    length, n, body = 50, 3, 1000
    reply = length - length // 10
    per_token = 6 * body + 12 * 2 * 4 * 8 * length
    want = n * (per_token * length + 6 * 100 * 32 * reply)
    assert bench_trainer.model_flops(fields, body, length, n) == want
