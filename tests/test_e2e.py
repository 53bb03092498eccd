"""run.py end to end in a subprocess, on the tiny random model."""

import json
import sqlite3

import pytest
import torch
from safetensors.torch import load_file

import launch
import run
from config import parse_config
from conftest import run_py


def metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def receipt(run_dir, version):
    """The explorer's record of receiving weight `version`."""
    return next(r for r in metrics(run_dir) if r.get("explorer/received_version") == version)


def buffer_versions(run_dir, batch_size):
    """Weight version of each explorer batch, in write order."""
    db = sqlite3.connect(run_dir / "buffer.sqlite")
    groups = db.execute(
        "SELECT group_id, MIN(model_version) FROM experiences GROUP BY group_id ORDER BY MIN(id)"
    ).fetchall()
    return [v for _, v in groups][::batch_size]


def published_checksum(model_dir) -> float:
    """The checksum of a saved model's parameters in the order the trainer publishes them."""
    from transformers import AutoModelForCausalLM

    from sync import checksum

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return checksum(p for _, p in model.named_parameters())


@pytest.mark.slow
def test_run_trains_and_syncs(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--reward-fn",
        "tests.rewards.length_parity",
        "--steps",
        4,
        "--sync-interval",
        2,
        "--eval-k",
        2,
        "--sync-checksum",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # run.py re-executes itself with the allocator preloaded (requirements.txt installs mimalloc)
    assert f"memory allocator {launch.allocator(parse_config([]))[0]};" in res.stdout
    recs = metrics(run_dir)
    steps = [r for r in recs if "reward/mean" in r]
    evals = [r for r in recs if "eval/accuracy" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert [r["eval/version"] for r in evals] == [0, 2, 4]
    for key in (
        "loss/policy",
        "loss/clipped",
        "loss/clipped_low",
        "loss/clipped_high",
        "loss/clipped_dual",
        "loss/ratio_mean",
        "loss/ratio_min",
        "loss/ratio_max",
        "loss/log_ratio_clamped",
        "loss/kl_behaviour",
        "loss/grad_norm",
        "reward/std",
        "response/len_mean",
        "staleness/mean",
        "time/train_s",
        "time/explore_s",
        "time/wait_s",
        "time/sync_s",
        "train/tokens_per_s",
        "explorer/tokens_per_s",
        "buffer/consumed",
    ):
        assert key in steps[-1], key
    # every rollout records the sampling settings the trainer checks (extras/train_mode.py's check_sampling)
    db = sqlite3.connect(run_dir / "buffer.sqlite")
    infos = [json.loads(i) for (i,) in db.execute("SELECT info FROM experiences")]
    db.close()
    defaults = parse_config([])
    sampled = (defaults.temperature, defaults.top_p)
    assert infos and all((i["temperature"], i["top_p"]) == sampled for i in infos)
    for key in (
        "perf/trainer_model_flops",
        "perf/trainer_mfu",
        "perf/explorer_model_flops",
        "perf/explorer_mfu",
        "perf/job_mfu",
    ):
        assert all(r[key] > 0 for r in steps), key
    # the base model's evaluation may come from NANORFT_CACHE (an earlier run of this test): no work, no FLOPs
    assert all(
        r["perf/eval_model_flops"] > 0 and r["perf/eval_mfu"] > 0
        for r in evals
        if not r.get("eval/cached")
    )
    assert all(not r.get("eval/cached") for r in evals[1:])
    # avg@2 with its standard error at every evaluation; at version 0 group_size (4) samples, for pass@4
    assert [r["eval/samples"] for r in evals] == [4, 2, 2] and all(r["eval/k"] == 2 for r in evals)
    assert all(0 <= r["eval/avg_at_k"] <= 1 and r["eval/avg_at_k_stderr"] >= 0 for r in evals)
    assert "eval/pass_at_4" in evals[0] and "eval/pass_at_4" not in evals[1]
    assert all(0 <= r["eval/format_rate"] <= 1 and 0 <= r["eval/accuracy_stderr"] for r in evals)
    assert "avg@2" in res.stdout + res.stderr
    # a raising reward function is caught, scored 0 and counted; the run went on
    assert sum(r["rollout/reward_errors"] for r in steps) > 0
    assert [r["buffer/consumed"] for r in steps] == [8, 16, 24, 32]  # 2 groups of 4 per step
    assert "reward error" in (run_dir / "samples.log").read_text()
    # parameters changed, and the explorer holds exactly the trainer's final weights
    init = load_file(f"{tiny_model}/model.safetensors")
    final = load_file(run_dir / "final" / "model.safetensors")
    assert any(not torch.equal(init[k], final[k]) for k in init)
    checksum = published_checksum(run_dir / "final")
    assert receipt(run_dir, 4)["sync/explorer_checksum"] == pytest.approx(checksum, rel=1e-12)
    assert steps[-1]["sync/trainer_checksum"] == pytest.approx(checksum, rel=1e-12)
    assert buffer_versions(run_dir, 2) == [0, 0, 2, 2]
    assert (run_dir / "plot.png").stat().st_size > 1000
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_dir / "final")


@pytest.mark.parametrize(
    "interval,offset,expected", [(1, 0, [0, 1, 2, 3]), (1, 1, [0, 0, 1, 2]), (3, 1, [0, 0, 0, 0])]
)
@pytest.mark.slow
def test_sync_schedule_versions_in_buffer(tiny_model, tmp_path, interval, offset, expected):
    run_dir = tmp_path / "run"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--steps",
        4,
        "--sync-interval",
        interval,
        "--sync-offset",
        offset,
        "--eval-size",
        0,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert buffer_versions(run_dir, 2) == expected
    steps = [r for r in metrics(run_dir) if "reward/mean" in r]
    assert [r["staleness/max"] for r in steps] == [t - v for t, v in enumerate(expected)]


@pytest.mark.slow
def test_torchrun_two_trainer_ranks(tiny_model, tmp_path):
    # FSDP over 2 ranks with bucketed sync: every rank gathers one bucket (0.05 MiB) at a time, rank 0 sends it
    run_dir = tmp_path / "run"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--reward-fn",
        "tests.rewards.length_parity",
        "--steps",
        2,
        "--eval-size",
        0,
        "--sync-bucket-mb",
        0.05,
        "--sync-checksum",
        nproc=2,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [r for r in metrics(run_dir) if "reward/mean" in r]
    assert [r["trainer/ranks"] for r in steps] == [2, 2]
    checksum = published_checksum(run_dir / "final")
    assert receipt(run_dir, 2)["sync/explorer_checksum"] == pytest.approx(checksum, rel=1e-12)
    for r in steps:  # every publish arrived whole
        assert receipt(run_dir, r["step"] + 1)["sync/explorer_checksum"] == pytest.approx(
            r["sync/trainer_checksum"], rel=1e-12
        )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--no-such-flag"], "Unrecognized options: --no-such-flag"),
        (["--sync-intervl", "2"], "Perhaps you meant: --sync-interval INT"),
        (["--model", "/nonexistent/model"], "model directory not found"),
        (["--task", "no_such_dataset"], "reasoning-gym dataset 'no_such_dataset'"),
        (["--steps", "zero"], "Error parsing --steps: invalid literal for int()"),
        (["--reward-fn", "no.such.module"], "reward_fn 'no.such.module' cannot be imported"),
    ],
)
@pytest.mark.slow
def test_bad_input_is_one_error_line(tmp_path, args, message):
    res = run_py("--run-dir", tmp_path / "r", *args, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and message in lines[-1], res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_plugins_from_the_working_directory(tiny_model, tmp_path, monkeypatch, capsys):
    # `--workflow mymod.MyWorkflow` from the directory holding mymod.py: sys.path[0] is run.py's directory, so
    # this failed with "No module named 'mymod'" and no hint; run.main puts the working directory on the path
    # (the spawned explorer inherits sys.path), and an import path that still fails says where modules are looked up
    import sys

    from conftest import ROOT

    (tmp_path / "cwd_plugins_e2e.py").write_text(
        "from workflows import MathWorkflow\n\n\n"
        "class MyWorkflow(MathWorkflow):\n    pass\n\n\n"
        "def always_right(task, completion, dataset):\n    return 1.0\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    argv = [
        "--config",
        str(ROOT / "configs" / "tiny.toml"),
        "--model",
        tiny_model,
        "--mode",
        "bench",
        "--run-dir",
        str(tmp_path / "r"),
        "--bench-models",
        tiny_model,
        "--bench-k",
        "1",
        "--eval-size",
        "2",
        "--train-size",
        "8",
        "--explorer-threads",
        str(torch.get_num_threads()),
    ]  # (in this process: leave its thread count)
    assert (
        run.main(
            [
                *argv,
                "--workflow",
                "cwd_plugins_e2e.MyWorkflow",
                "--reward-fn",
                "cwd_plugins_e2e.always_right",
            ]
        )
        == 0
    ), capsys.readouterr().err
    assert (
        json.loads((tmp_path / "r" / "bench.json").read_text())[0]["avg@1"] == 1.0
    )  # the plug-in's reward
    capsys.readouterr()
    assert run.main([*argv, "--workflow", "not_here_e2e.MyWorkflow"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.count("\n") == 0
        and "workflow 'not_here_e2e.MyWorkflow' cannot be imported: No module named" in err
    )
    assert "modules are looked up in " in err and f"{tmp_path} (the working directory)" in err, err


@pytest.mark.slow
def test_bad_config_and_jsonl(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("lr = 1e-5\nlearning_rate = 3\n")
    res = run_py("--config", toml, "--run-dir", tmp_path / "r", timeout=120)
    assert res.returncode == 2 and "unknown config key(s) ['learning_rate']" in res.stderr
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2"}\n')
    res = run_py("--task", jsonl, "--run-dir", tmp_path / "r", timeout=120)
    assert (
        res.returncode == 2
        and "tasks.jsonl line 2: needs 'question' and 'answer' fields" in res.stderr
    )
    assert "Traceback" not in res.stderr
