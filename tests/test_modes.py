"""The RFT modes end to end on the tiny model: fully asynchronous explore/train launches with
several explorers, checkpoint sync, in-flight updates, max staleness, offline SFT/DPO,
bench, and resume after a kill."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch
from test_e2e import buffer_versions, metrics, published_checksum
from test_first_contact import strict_json_lines

import run
from conftest import ROOT, run_py
from extras.postgres import open_buffer

COMMON = ["--config", "configs/tiny.toml", "--reward-fn", "tests.rewards.length_parity"]


def steps_of(run_dir):
    return [r for r in metrics(run_dir) if "loss/grad_norm" in r]


def popen(*args):
    return subprocess.Popen(
        [sys.executable, "run.py", *COMMON, *map(str, args)],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition, what, timeout=300):
    """Poll `condition()` until it holds (a state to reach, not a race to win)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def batches_of(run_dir, name):
    if not (run_dir / "buffer.sqlite").exists():
        return 0
    db = sqlite3.connect(run_dir / "buffer.sqlite")
    try:
        return db.execute(
            "SELECT COUNT(DISTINCT group_id) FROM experiences WHERE explorer = ?", (name,)
        ).fetchone()[0]
    except sqlite3.OperationalError:  # the schema is being created
        return 0
    finally:
        db.close()


def pause(p, run_dir):
    """SIGSTOP process group `p` at a moment it holds no write lock on the buffer."""
    while True:
        os.killpg(p.pid, signal.SIGSTOP)
        db = sqlite3.connect(run_dir / "buffer.sqlite", timeout=0, isolation_level=None)
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:  # stopped inside a write: let it finish
            os.killpg(p.pid, signal.SIGCONT)
            time.sleep(0.01)
        finally:
            db.close()


@pytest.mark.slow
def test_async_two_explorers_and_a_trainer_with_max_staleness(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Order forced, not raced: e1 writes a batch and is paused; the trainer starts and e2 runs alone until it has
    # written a batch (after the trainer took e1's first, if back-pressure held e2); then e1 continues. So e2's
    # first batch is among the first three the trainer reads, whichever process is faster.
    e1 = popen(
        "--model", tiny_model, "--run-dir", run_dir, "--mode", "explore", "--explorer-name", "e1"
    )
    wait_for(lambda: batches_of(run_dir, "e1") >= 2 or e1.poll() is not None, "e1's first batch")
    pause(e1, run_dir)
    e2 = popen(
        "--model", tiny_model, "--run-dir", run_dir, "--mode", "explore", "--explorer-name", "e2"
    )
    trainer = subprocess.Popen(
        [
            sys.executable,
            "run.py",
            *COMMON,
            "--model",
            tiny_model,
            "--run-dir",
            run_dir,
            "--mode",
            "train",
            "--steps",
            "6",
            "--sync-interval",
            "2",
            "--max-staleness",
            "2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: batches_of(run_dir, "e2") >= 2 or e2.poll() is not None, "e2's first batch")
    os.killpg(e1.pid, signal.SIGCONT)
    explorers = {"e1": e1, "e2": e2}
    out, err = trainer.communicate(timeout=600)
    res = subprocess.CompletedProcess(trainer.args, trainer.returncode, out, err)
    assert res.returncode == 0, res.stderr[-3000:]
    for p in explorers.values():  # they see the trainer finish and stop by themselves
        assert p.wait(timeout=120) == 0, p.stderr.read()[-3000:]
    steps = steps_of(run_dir)
    assert [r["step"] for r in steps] == list(range(6))
    assert all(r["staleness/max"] <= 2 for r in steps)  # never trained on older experiences
    db = sqlite3.connect(run_dir / "buffer.sqlite")
    first = {
        name: [
            t
            for (t,) in db.execute(
                "SELECT DISTINCT task_id FROM experiences WHERE explorer = ? ORDER BY id LIMIT 2",
                (name,),
            )
        ]
        for name in explorers
    }
    assert (
        first["e1"] != first["e2"]
    )  # different explorers, different tasks (seeds mix in the explorer name)
    names = {k.split("/")[1] for r in steps for k in r if k.endswith("/share")}
    assert names == {"e1", "e2"}, names  # both explorers' groups were trained on
    assert all("staleness/dropped_groups" in r for r in steps)
    db = sqlite3.connect(run_dir / "buffer.sqlite")
    rows = db.execute(
        "SELECT consumed, COUNT(DISTINCT group_id) FROM experiences WHERE consumed > 0 GROUP BY consumed"
    ).fetchall()
    dropped = sum(r["staleness/dropped_groups"] for r in steps)
    assert (
        sum(n for _, n in rows) == 6 * 2 + dropped
    )  # every consumed group was trained or counted as dropped
    # each explorer loaded the checkpoints the trainer published, up to the final one
    for name in ("e1", "e2"):
        log = [json.loads(x) for x in (run_dir / f"explorer_{name}.jsonl").read_text().splitlines()]
        assert max(r.get("explorer/received_version", 0) for r in log) == 6
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("[lv]*[0-9t]")) == [
        "latest",
        "v000002",
        "v000004",
        "v000006",
    ]
    # the explorers' held-out evaluations reach the trainer's metrics (valid JSON: no NaN) and its plot
    evals = [r for r in strict_json_lines(run_dir / "metrics.jsonl") if "eval/accuracy" in r]
    assert {r["explorer"] for r in evals} == {"e1", "e2"} and all(
        0 <= r["eval/accuracy"] <= 1 for r in evals
    )
    # each explorer evaluates the final weights after the trainer's last step: the trainer waits
    # for those evaluations before it writes its final files
    assert {r["explorer"] for r in evals if r["eval/version"] == 6} == {"e1", "e2"}
    assert (run_dir / "plot.png").stat().st_size > 1000


@pytest.mark.slow
def test_both_with_checkpoint_sync_follows_the_schedule(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    res = run_py(
        *COMMON,
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--steps",
        4,
        "--sync-interval",
        2,
        "--sync-method",
        "checkpoint",
        "--sync-checksum",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert buffer_versions(run_dir, 2) == [0, 0, 2, 2]
    receipt = next(r for r in metrics(run_dir) if r.get("explorer/received_version") == 4)
    assert receipt["sync/explorer_checksum"] == pytest.approx(
        published_checksum(run_dir / "final"), rel=1e-12
    )


class StubEngine:
    """What WaitForPublish touches of an engine: the batch label, the version loaded, the announced one."""

    def __init__(self):
        self.label, self.version, self.announced, self.loads = "", 0, 0, []
        self.step_hook = self.load_newest

    def load_newest(self):  # the explorer's in-flight hook
        self.loads.append(self.announced)
        self.version = max(self.version, self.announced)

    def weights_announced(self):
        return self.announced

    def generate_batch(self, *args, steps=4):
        for _ in range(steps):
            self.step_hook()


def test_wait_for_publish_waits_for_weights_newer_than_the_call_started_with():
    """The in-flight test workflow's pause cannot wait for weights trained from the batch it pauses: weights
    loaded at the 1st decode step already landed mid-sequence, and a retry of a batch never pauses."""
    from tests.plugins import WaitForPublish

    wf, engine = WaitForPublish.__new__(WaitForPublish), StubEngine()
    wf.deadline_s = 0.2
    wf.install(engine)
    engine.label = "batch 0 (version 0)"
    engine.generate_batch(
        [[1]], [1], None
    )  # the first batch: trained before any publish, never paused
    engine.generate_batch([[1]], [1], None)  # its retry, as a second call: the same
    engine.label, engine.announced = (
        "batch 1 (version 0)",
        1,
    )  # the trainer published while batch 1 starts
    engine.generate_batch(
        [[1]], [1], None
    )  # loaded at step 1: waiting at step 3 for version 2 would hang
    assert engine.version == 1
    engine.label = "batch 2 (version 1)"
    with pytest.raises(
        TimeoutError
    ):  # nothing newer than the start's version 1 is announced: it waits
        engine.generate_batch([[1]], [1], None)


@pytest.mark.slow
def test_inflight_updates_mark_sequences_spanning_versions(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    # the workflow pauses each batch from the second on at its 3rd decode step until the trainer has announced
    # new weights: the update lands mid-sequence deterministically, not by the relative speed of the processes
    res = run_py(
        *COMMON,
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--steps",
        4,
        "--sync-interval",
        1,
        "--sync-offset",
        1,
        "--inflight",
        "--max-tokens",
        24,
        "--eval-size",
        0,
        "--workflow",
        "tests.plugins.WaitForPublish",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    steps = steps_of(run_dir)
    assert all(
        r["inflight/multi_version_seqs"] > 0 for r in steps[1:]
    )  # weights changed mid-sequence, every batch
    db = sqlite3.connect(run_dir / "buffer.sqlite")
    spans = [json.loads(i)["versions"] for (i,) in db.execute("SELECT info FROM experiences")]
    assert all(a <= b <= a + 2 for a, b in spans) and any(a < b for a, b in spans)
    # the lag stays bounded by the schedule (sync_offset 1): batch e starts at version >= e - 1
    assert all(r["staleness/max"] <= 1 for r in steps)


@pytest.mark.slow
def test_inflight_engine_switches_weights_between_decode_steps(tiny_model, tmp_path):
    from conftest import make_tiny_model
    from engines import HFEngine, Sampling, read_safetensors

    engine = HFEngine(tiny_model, seed=0)
    other = read_safetensors(make_tiny_model(tmp_path / "other", seed=1))
    calls = []

    def hook():
        calls.append(1)
        if len(calls) == 3:  # after the 3rd token: new weights, version 7
            with torch.no_grad():
                for n, p in engine.model.named_parameters():
                    p.copy_(other[n])
            engine.version = 7

    engine.step_hook = hook
    (c,) = engine.generate_batch([[5, 6, 7]], [1], Sampling(max_tokens=8))[0]
    assert c.versions == (0, 7) and len(c.tokens) == 8
    # the first 3 tokens came from the old weights: their behaviour log-probs equal a fresh old model's
    fresh = HFEngine(tiny_model, seed=0)
    with torch.no_grad():
        logits = fresh.model(torch.tensor([[5, 6, 7] + c.tokens])).logits[0, 2:-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.tokens)[:, None]).squeeze(-1)
    assert torch.allclose(ref[:3], torch.tensor(c.behaviour_logprobs[:3]), atol=1e-4)
    assert not torch.allclose(ref[3:], torch.tensor(c.behaviour_logprobs[3:]), atol=1e-2)


@pytest.mark.slow
def test_offline_sft_and_dpo_train_only(tiny_model, tmp_path):
    sft, dpo = tmp_path / "sft.jsonl", tmp_path / "dpo.jsonl"
    sft.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"{i}+{i}?"},
                        {"role": "assistant", "content": str(2 * i)},
                    ]
                }
            )
            + "\n"
            for i in range(6)
        )
    )
    dpo.write_text(
        "".join(
            json.dumps({"prompt": f"{i}+{i}?", "chosen": str(2 * i), "rejected": str(2 * i + 1)})
            + "\n"
            for i in range(6)
        )
    )
    res = run_py(
        *COMMON,
        "--model",
        tiny_model,
        "--run-dir",
        tmp_path / "sft",
        "--mode",
        "train",
        "--train-data",
        sft,
        "--policy-loss",
        "sft",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [r["loss/policy"] for r in steps_of(tmp_path / "sft")]
    assert len(losses) == 3 and losses[-1] < losses[0]  # NLL of the assistant tokens goes down
    # offline data has no rollouts: no reward curve, the progress bar shows the loss
    assert not any("reward/mean" in r for r in steps_of(tmp_path / "sft")) and "loss=" in res.stderr
    assert (tmp_path / "sft" / "plot.png").stat().st_size > 1000
    res = run_py(
        *COMMON,
        "--model",
        tiny_model,
        "--run-dir",
        tmp_path / "dpo",
        "--mode",
        "train",
        "--train-data",
        dpo,
        "--policy-loss",
        "dpo",
        "--policy-loss-kwargs",
        '{"beta": 0.5}',
        "--no-plot",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (tmp_path / "dpo" / "plot.png").exists() and "plot:" not in res.stdout
    steps = steps_of(tmp_path / "dpo")
    assert steps[0]["loss/policy"] == pytest.approx(
        0.6931, abs=1e-3
    )  # policy = reference: -log sigmoid(0)
    assert all(r["train/expert_seqs"] == 4 for r in steps)  # 2 pairs per step


def test_the_plot_of_an_offline_run_has_no_empty_panel():
    # SFT / DPO have no rollouts: no reward, no held-out accuracy. The first panel showed nothing; now the loss
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from metrics import figure

    sft = [
        {
            "step": s,
            "loss/policy": 2.0 - 0.5 * s,
            "loss/grad_norm": 1.0,
            "loss/entropy": 3.0,
            "response/len_mean": 4.0,
            "train/expert_seqs": 2,
        }
        for s in range(3)
    ]
    dpo = [{**r, "loss/pair_correct": 0.5} for r in sft]
    for recs in sft, dpo:
        fig = figure(recs, "offline")
        try:
            for ax in fig.axes:  # every panel has a curve with the run's points
                assert any(len(line.get_xydata()) == 3 for line in ax.lines), ax.get_title()
            first = {line.get_label(): line.get_ydata().tolist() for line in fig.axes[0].lines}
            assert first["training loss"] == [2.0, 1.5, 1.0] and "loss" in fig.axes[0].get_title()
        finally:
            plt.close(fig)
    assert "pairs ranked right (DPO)" in first


def offline_argv(tiny_model, tmp_path):
    """run.py's arguments for an SFT run (mode train, --train-data) into tmp_path / "r"."""
    sft = tmp_path / "sft.jsonl"
    chat = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    sft.write_text(json.dumps({"messages": chat}) + "\n")
    return [
        *COMMON,
        "--model",
        tiny_model,
        "--run-dir",
        str(tmp_path / "r"),
        "--mode",
        "train",
        "--train-data",
        str(sft),
        "--policy-loss",
        "sft",
    ]


def test_offline_train_refuses_a_used_run_dir_and_overwrite_deletes_it(
    tiny_model, tmp_path, capsys, monkeypatch
):
    # offline SFT / DPO has no other side sharing its run dir: like mode both, a second run into it is refused
    # (it appended to metrics.jsonl), and --overwrite (refused before) starts it afresh
    import run

    monkeypatch.chdir(ROOT)
    argv = offline_argv(tiny_model, tmp_path)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 0}\n')  # an earlier run's
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "is not empty (use --overwrite, --resume or another --run-dir)" in err
    ), err
    run.prepare(run.parse_config([*argv, "--overwrite"]), 0)
    assert (
        not (tmp_path / "r" / "metrics.jsonl").exists()
        and (tmp_path / "r" / "config.json").is_file()
    )


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo", "reinforce_tis"])
def test_offline_data_with_a_ratio_loss_is_one_error_line(
    tiny_model, tmp_path, capsys, monkeypatch, loss
):
    # offline rows carry 0.0 as behaviour log-probs: a ratio loss turned SFT into probability-weighted SFT
    import run

    monkeypatch.chdir(ROOT)
    argv = [*offline_argv(tiny_model, tmp_path), "--policy-loss", loss]
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train offline data with --policy-loss sft or dpo" in err, err
    assert not (tmp_path / "r").exists()


def test_offline_train_writes_config_json_and_the_async_trainer_config_train_json(
    tiny_model, tmp_path, monkeypatch
):
    # offline mode train owns its run dir (config.json, as the docs say); the fully asynchronous trainer shares
    # it with explorers and keeps a file of its own
    import run

    monkeypatch.chdir(ROOT)
    argv = offline_argv(tiny_model, tmp_path)
    run.prepare(run.parse_config(argv), 0)
    assert sorted(p.name for p in (tmp_path / "r").glob("config*.json")) == ["config.json"]
    argv = [*COMMON, "--model", tiny_model, "--run-dir", str(tmp_path / "a"), "--mode", "train"]
    run.prepare(run.parse_config(argv), 0)
    assert sorted(p.name for p in (tmp_path / "a").glob("config*.json")) == ["config_train.json"]


@pytest.mark.slow
def test_bench_table_and_json(tiny_model, tmp_path):
    res = run_py(
        *COMMON,
        "--model",
        tiny_model,
        "--run-dir",
        tmp_path / "b",
        "--mode",
        "bench",
        "--bench-models",
        f"{tiny_model},{tiny_model}",
        "--bench-k",
        3,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert len(rows) == 2 and rows[0]["tasks"] == 8
    for r in rows:  # the aggregates of the per-task counts of correct samples
        c = r["correct"]
        assert len(c) == 8 and all(0 <= x <= 3 for x in c)
        assert r["avg@3"] == pytest.approx(sum(c) / 24) and r["pass@3"] == pytest.approx(
            sum(x > 0 for x in c) / 8
        )
        from metrics import learnable_groups  # the learnability forecast at the run's group size

        assert r["learnable_groups"] == pytest.approx(learnable_groups(c, 3, r["group_size"]))
    assert (
        "avg@3" in res.stdout
        and "pass@3" in res.stdout
        and f"learnable groups of {rows[0]['group_size']}" in res.stdout
    )


def test_bench_on_a_run_dir_takes_the_runs_task(tiny_model, tmp_path, capsys, monkeypatch):
    # without --bench-models, RUN_DIR/final is evaluated on the run's own task settings (from the config saved
    # next to it), not the default task's; a flag still wins; the table and bench.json name the task
    import dataclasses
    import shutil

    import run
    from extras.bench import RUN_TASK_SETTINGS

    monkeypatch.chdir(ROOT)
    final = tmp_path / "run" / "final"
    shutil.copytree(tiny_model, final)
    saved = run.Config(
        task="leg_counting",
        task_kwargs={},
        system_prompt="S",
        reward_fn="tests.rewards.constant",
        eval_size=3,
        seed=5,
        max_tokens=4,
    )
    (final / "nanorft_config.json").write_text(json.dumps(dataclasses.asdict(saved)))
    assert (
        run.main(
            [
                "--mode",
                "bench",
                "--run-dir",
                str(tmp_path / "run"),
                "--eval-size",
                "2",
                "--bench-k",
                "2",
                "--train-size",
                "8",
                "--engine",
                "hf",
                "--dtype",
                "float32",
                "--explorer-threads",
                str(torch.get_num_threads()),
            ]
        )
        == 0
    )  # (in this process: its threads)
    out = capsys.readouterr().out
    used = json.loads(
        (tmp_path / "run" / "config_bench.json").read_text()
    )  # what the bench ran with
    want = {k: getattr(saved, k) for k in RUN_TASK_SETTINGS} | {"eval_size": 2}
    assert {k: used[k] for k in want} == want
    rows = json.loads((tmp_path / "run" / "bench.json").read_text())
    assert [(r["task"], r["tasks"]) for r in rows] == [("leg_counting", 2)]
    assert (
        "task leg_counting; task, task_kwargs, system_prompt, reward_fn, reward_kwargs, workflow, seed, "
        f"eval_seed, max_tokens from {final / 'nanorft_config.json'}" in out
    ), out
    assert "task leg_counting: 2 held-out tasks" in out


# checkpoint sync, interval 1: the resumed explorer starts from the resume state that the resumed trainer's
# first save_resume_state deletes (the fault benchmark found it failing to load); the trainer waits until it has loaded
# (and the finished run deletes its resume state, unless --keep-resume-state)
@pytest.mark.parametrize(
    "sync",
    [
        ["--checkpoint-interval", 2],
        ["--checkpoint-interval", 1, "--sync-method", "checkpoint", "--keep-resume-state"],
    ],
)
@pytest.mark.slow
def test_resume_after_kill_loses_and_repeats_nothing(tiny_model, tmp_path, sync):
    run_dir = tmp_path / "run"
    args = [
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--steps",
        6,
        *sync,
        "--sync-interval",
        1,
        "--sync-offset",
        1,
    ]
    p = popen(*args)
    deadline = time.time() + 300
    while time.time() < deadline:  # kill -9 (trainer and explorer) once step 3 is recorded
        if (run_dir / "metrics.jsonl").exists() and any(
            r.get("step") == 3 for r in steps_of(run_dir)
        ):
            break
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    res = run_py(*COMMON, *args, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed at step" in res.stdout
    db = sqlite3.connect(run_dir / "buffer.sqlite")
    per_step = db.execute(
        "SELECT consumed, COUNT(DISTINCT group_id), MIN(model_version), MAX(model_version) "
        "FROM experiences GROUP BY consumed ORDER BY consumed"
    ).fetchall()
    # every step 1..6 trained exactly 2 groups, one-step off-policy versions; nothing left over
    assert per_step == [
        (1, 2, 0, 0),
        (2, 2, 0, 0),
        (3, 2, 1, 1),
        (4, 2, 2, 2),
        (5, 2, 3, 3),
        (6, 2, 4, 4),
    ]
    batches = db.execute("SELECT COUNT(DISTINCT group_id) FROM experiences").fetchone()[0]
    assert batches == 12  # the explorer did not generate any batch twice
    # each step logged once (the records of the steps trained again were dropped), each evaluated version once
    assert [r["step"] for r in steps_of(run_dir)] == list(range(6))
    evals = [r["eval/version"] for r in metrics(run_dir) if "eval/accuracy" in r]
    assert evals and len(evals) == len(set(evals)), evals
    import run
    from checkpoints import resume_state

    if "--keep-resume-state" in sync:
        assert (
            resume_state(run_dir).name == "resume-000005"
            and "resume state deleted" not in res.stdout
        )
    else:  # the finished run's resume state is gone; a --resume of it has nothing to do (not: train from step 0)
        assert (
            not list((run_dir / "checkpoints").glob("resume*"))
            and "resume state deleted" in res.stdout
        )
        assert run.finished_run(run.parse_config([*COMMON, *map(str, args), "--resume"]))


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--max-staleness", "0", "--sync-interval", "2"],
            "max_staleness 0 < sync_offset + sync_interval - 1 = 1",
        ),
        (["--inflight", "--mode", "train"], "--inflight is a setting of the explorer"),
        (
            ["--mode", "train", "--sync-method", "broadcast"],
            "with --sync-method broadcast needs --sync-port",
        ),
        (["--mode", "train", "--num-explorers", "0"], "num_explorers must be >= 1"),
        (["--mode", "train", "--overwrite"], "--overwrite would delete a run directory shared"),
        (["--train-data", "x.jsonl"], "--train-data is for --mode train"),
        (
            [
                "--mode",
                "train",
                "--train-data",
                "x.jsonl",
                "--policy-loss",
                "sft",
                "--sync-method",
                "broadcast",
                "--sync-port",
                "29999",
            ],
            "--train-data trains offline, with no explorer to sync with",
        ),
        (["--resume"], "--resume: no run to resume in"),
    ],
)
@pytest.mark.slow
def test_bad_mode_config_is_one_error_line(tmp_path, args, message):
    res = run_py(*COMMON, "--model", str(tmp_path), "--run-dir", tmp_path / "r", *args)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and message in res.stderr, res.stderr


def host_address() -> str:
    """This machine's address on its default route (not loopback), or 127.0.0.1 without one."""
    import sync

    try:
        return sync.local_address(
            "198.51.100.1"
        )  # a documentation address: only the route is looked up
    except OSError:
        return "127.0.0.1"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["broadcast", "checkpoint"])
def test_async_explorers_and_trainer_on_a_postgres_buffer(tiny_model, tmp_path, postgres, method):
    # separate launches as on separate hosts: the buffer is a PostgreSQL server reached at this machine's
    # network address (not loopback); weights by a broadcast group whose store the trainer hosts at the address
    # given by --sync-host, or by checkpoints in the shared run directory
    import socket
    import uuid

    import sync

    addr = host_address()
    url = postgres.replace("127.0.0.1", addr) + f"?schema=t_{uuid.uuid4().hex[:12]}"
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    common = [
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--buffer",
        url,
        "--sync-method",
        method,
        "--sync-host",
        addr,
        "--sync-port",
        port,
        "--sync-checksum",
    ]
    workflow = [
        "--workflow",
        "tests.plugins.AllExplorersStarted",
    ]  # both take part, however late one starts
    explorers = {
        name: popen(*common, *workflow, "--mode", "explore", "--explorer-name", name)
        for name in ("e1", "e2")
    }
    res = run_py(
        *COMMON,
        *common,
        "--mode",
        "train",
        "--steps",
        4,
        "--sync-interval",
        2,
        "--num-explorers",
        2,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for p in explorers.values():  # they see trainer_done in the buffer and stop by themselves
        assert p.wait(timeout=120) == 0, p.stderr.read()[-3000:]
    assert not (run_dir / "buffer.sqlite").exists()
    steps = steps_of(run_dir)
    assert [r["step"] for r in steps] == list(range(4))
    buf = open_buffer(url)
    # each explorer wrote batches (which of them the trainer took depends on their speed)
    assert all(buf.explorer_state(name) for name in ("e1", "e2"))
    assert {k.split("/")[1] for r in steps for k in r if k.endswith("/share")} <= {"e1", "e2"}
    assert buf.run_state("trainer_done") == "4" and buf.counts()["consumed"] == 4 * 2 * 4
    sent = {
        r["step"] + 1: r["sync/trainer_checksum"] for r in steps if "sync/trainer_checksum" in r
    }
    assert sorted(sent) == [2, 4]
    for name in ("e1", "e2"):
        log = [json.loads(x) for x in (run_dir / f"explorer_{name}.jsonl").read_text().splitlines()]
        got = {
            r["explorer/received_version"]: r["sync/explorer_checksum"]
            for r in log
            if "explorer/received_version" in r
        }
        if method == "broadcast":  # every publish reached every explorer, bit for bit
            assert got == pytest.approx(sent, rel=1e-12) and not (run_dir / "checkpoints").exists()
        else:
            assert max(got) == 4 and got[4] == pytest.approx(sent[4], rel=1e-12)
    # the explorers' evaluations travel through the buffer to the trainer's metrics
    evals = [r for r in strict_json_lines(run_dir / "metrics.jsonl") if "eval/accuracy" in r]
    assert {r["explorer"] for r in evals} == {"e1", "e2"}
    assert sync.local_address(addr) == addr  # the address given by flag is this machine's own


def test_a_batch_sampled_at_another_temperature_is_refused(tmp_path):
    # an explorer launched with --temperature 0.7 feeding a trainer at 1.0 biased every ratio
    import loop
    from buffer import Experience

    buf = open_buffer(tmp_path / "buffer.sqlite")
    try:
        for g, temperature in (("g0", 1.0), ("g1", 0.7)):
            info = {"temperature": temperature, "top_p": 1.0}
            group = [Experience([1, 2, 3], 2, [-0.5], [1], 1.0, g, "t", 0, info, "e") for _ in "ab"]
            buf.write(group)
        # mode train: in mode both the explorer samples with the trainer's own cfg
        cfg = run.parse_config(["--mode", "train", "--batch-size", "1", "--temperature", "1.0"])
        batches = loop.BufferBatches(cfg, buf)
        groups, _ = batches.next(0, 0, lambda: True)  # g0: as the trainer samples
        assert groups[0][0].group_id == "g0"
        with pytest.raises(
            RuntimeError, match="sampled at temperature 0.7, top_p 1.0; this trainer"
        ):
            batches.next(1, 0, lambda: True)
    finally:
        buf.close()


@pytest.mark.slow
def test_an_explorer_without_a_trainer_says_what_it_waits_for(tiny_model, tmp_path):
    # to a file, mode explore printed its banner and then nothing until buffer_timeout_s ran out
    args = ("--model", tiny_model, "--run-dir", tmp_path / "r", "--buffer-timeout-s", "5")
    res = run_py(*COMMON, "--mode", "explore", *args)
    lines = res.stdout.splitlines()
    assert "explorer0: batch 0 (version 0) written in" in res.stdout, res.stdout
    assert "explorer0: batch 1 (version 0) written in" in res.stdout
    waiting = [x for x in lines if "waiting for a trainer to take them" in x]
    assert len(waiting) == 1 and f"--mode train --run-dir {tmp_path / 'r'}" in waiting[0]
    assert res.returncode == 1 and "no trainer took a batch for 5 s" in res.stderr
