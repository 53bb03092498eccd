"""One short run.py job per algorithm family on the tiny model (subprocess, real processes)."""

import json
import sqlite3

import pytest
import torch
from safetensors.torch import load_file
from test_e2e import metrics

from conftest import run_py

FAMILIES = {
    # prime-rl's defaults + every sequence filter + online difficulty filtering + task pools
    "dppo": (
        [
            "--advantage",
            "dr_grpo",
            "--policy-loss",
            "dppo_kl",
            "--filters",
            '{"zero_advantage": {}, "gibberish": {"min_mean_logprob": -30}, "repetition": {}}',
            "--difficulty-filter",
            "--pool-easy",
            "0.75",
            "--pool-hard",
            "0.25",
            "--pool-lift-fraction",
            "0.5",
            # varied samples of the tiny model: at 1.0 its groups include some the filters drop
            "--temperature",
            "1.0",
        ],
        [
            "loss/masked",
            "filter/zero_advantage",
            "filter/gibberish",
            "filter/repetition",
            "filter/difficulty_dropped",
            "pool/retired_easy",
        ],
    ),
    # truncated-IS REINFORCE with a KL loss to the reference model and an entropy bonus
    "reinforce": (
        [
            "--advantage",
            "rloo",
            "--policy-loss",
            "reinforce_tis",
            "--kl-loss-coef",
            "0.1",
            "--kl-estimator",
            "k2",
            "--entropy-coef",
            "0.01",
            "--loss-agg",
            "seq-mean-token-mean",
        ],
        ["loss/truncated", "loss/kl_ref", "loss/entropy"],
    ),
    # CISPO with REINFORCE++ normalisation, KL as a reward penalty and a length penalty
    "cispo": (
        [
            "--advantage",
            "reinforce_pp",
            "--policy-loss",
            "cispo",
            "--kl-reward-coef",
            "0.01",
            "--length-penalty",
            "0.01",
        ],
        ["loss/clipped", "reward/kl_penalty"],
    ),
    # the OPMD family (group-level losses keep whole groups together, here over 2 ranks);
    # pairwise / simple OPMD, GSPO and TOPR are checked against references in test_algorithms.py
    "opmd_kimi": (
        [
            "--advantage",
            "opmd",
            "--advantage-kwargs",
            '{"baseline": "logavgexp"}',
            "--policy-loss",
            "opmd_kimi",
            "--nproc",
            "2",
        ],
        [],
    ),
    "dpo": (
        ["--policy-loss", "dpo", "--policy-loss-kwargs", '{"beta": 0.5}', "--nproc", "2"],
        ["loss/pair_correct"],
    ),
    "sft": (["--policy-loss", "sft", "--filters", '{"zero_advantage": {}}'], []),
    "plugin": (
        [
            "--advantage",
            "tests.plugins.rank_advantages",
            "--policy-loss",
            "tests.plugins.clipped_reinforce",
            "--policy-loss-kwargs",
            '{"cap": 1.2}',
        ],
        ["loss/capped"],
    ),
}


def run_family(tiny_model, run_dir, args, steps=3):
    nproc = 0
    if "--nproc" in args:
        i = args.index("--nproc")
        nproc, args = int(args[i + 1]), args[:i] + args[i + 2 :]
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--steps",
        steps,
        "--reward-fn",
        "tests.rewards.length_parity",
        "--eval-size",
        0,
        *args,
        nproc=nproc,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return [r for r in metrics(run_dir) if "loss/grad_norm" in r]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains(tiny_model, tmp_path, family):
    args, keys = FAMILIES[family]
    steps = run_family(tiny_model, tmp_path / "run", list(args))
    assert [r["step"] for r in steps] == [0, 1, 2]
    for k in keys + ["loss/policy", "loss/entropy", "advantage/abs_mean", "filter/kept"]:
        assert all(k in r for r in steps), k
    init = load_file(f"{tiny_model}/model.safetensors")
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert any(not torch.equal(init[k], final[k]) for k in init), "parameters did not change"
    if family == "dppo":
        assert sum(r["filter/difficulty_dropped"] + r["filter/zero_advantage"] for r in steps) > 0
        db = sqlite3.connect(tmp_path / "run" / "buffer.sqlite")
        assert (
            db.execute("SELECT COUNT(*) FROM task_pool").fetchone()[0] > 0
        )  # pools persisted with the buffer
    if family == "reinforce":
        assert steps[-1]["loss/kl_ref"] > 0 and steps[0]["loss/kl_ref"] == pytest.approx(
            0, abs=1e-6
        )


@pytest.mark.slow
def test_mix_draws_expert_fraction(tiny_model, tmp_path):
    expert = tmp_path / "expert.jsonl"
    expert.write_text(
        "\n".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"{i}+1?"},
                        {"role": "assistant", "content": str(i + 1)},
                    ]
                }
            )
            for i in range(5)
        )
        + "\n"
    )
    steps = run_family(
        tiny_model,
        tmp_path / "run",
        ["--policy-loss", "mix", "--expert-data", str(expert), "--expert-fraction", "0.2"],
    )
    # 2 groups x 4 rollouts = 8; a fifth of the batch is expert data: 2 sequences
    assert [r["train/expert_seqs"] for r in steps] == [2, 2, 2]
    assert all(0 < r["loss/expert"] < 1 for r in steps)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--policy-loss", "nope"], "unknown policy_loss 'nope'"),
        (
            ["--advantage", "tests.plugins.missing"],
            "advantage 'tests.plugins.missing' cannot be imported",
        ),
        (["--policy-loss-kwargs", '{"clip": 0.1}'], "takes no argument(s) ['clip']"),
        (["--filters", '{"zero_advantage": 1}'], "must be a table of keyword arguments"),
        (["--loss-agg", "mean"], "unknown loss_agg 'mean'"),
        (["--policy-loss", "mix"], "policy_loss mix and expert_fraction > 0 go together"),
    ],
)
@pytest.mark.slow
def test_bad_algorithm_config_is_one_error_line(tmp_path, args, message):
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        str(tmp_path),
        "--run-dir",
        tmp_path / "r",
        *args,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and message in res.stderr, res.stderr
