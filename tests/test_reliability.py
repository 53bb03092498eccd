"""Reliability: transactions in the buffer, atomic resume state, checkpoint retention,
explorer identity, no hang and one error line whatever fails (issue: nothing lost, nothing
served or trained twice). Interleavings are forced (hooks, kills at a chosen point), never
left to which process is faster."""

import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from test_first_contact import strict_json_lines

from buffer import Experience
from conftest import one_batch, run_py
from extras import checkpoint_sync
from extras.lagged_rewards import pending_groups, set_rewards
from extras.postgres import open_buffer


def group(gid, n=4, reward=1.0, explorer="w"):
    return [
        Experience(
            [1, 2, 3, 4], 2, [-0.5, -0.5], [1, 1], reward, gid, f"task-{gid}", 0, {"i": i}, explorer
        )
        for i in range(n)
    ]


def _die_before_commit(path, gid):
    buf = open_buffer(path)
    from conftest import before_commit

    before_commit(
        buf, lambda: os.kill(os.getpid(), signal.SIGKILL)
    )  # kill -9 inside the transaction
    buf.write_batch([group(gid, 64)], "w", {"batch": 1}, [(f"task-{gid}", 1.0, 0.5, 0.0)])


@pytest.mark.slow
def test_a_writer_killed_mid_write_leaves_nothing(buffer_url):
    path = buffer_url
    open_buffer(path).write_batch([group("old")], "w", {"batch": 0})
    p = mp.get_context("spawn").Process(target=_die_before_commit, args=(path, "new"))
    p.start()
    p.join()
    assert p.exitcode == -signal.SIGKILL
    buf = open_buffer(path)
    # neither a partial group, nor the explorer state, nor the pool update of the lost batch
    assert (
        buf.counts()["total"] == 4
        and buf.explorer_state("w") == {"batch": 0}
        and buf.retired() == {}
    )
    assert [g[0].group_id for g in buf.read(1, timeout_s=1)] == ["old"]
    with pytest.raises(TimeoutError):
        buf.read(1, timeout_s=0.2)


def test_only_unconsumed_rows_are_served(buffer_url):
    buf = open_buffer(buffer_url)
    buf.write(group("g", 2))
    assert len(buf.read(1, timeout_s=1)[0]) == 2
    buf.write(group("g", 3))  # the same group id again: only the new rows are served
    assert [e.info["i"] for e in buf.read(1, timeout_s=1)[0]] == [0, 1, 2]


def _writer(path, name, groups, size):
    buf = open_buffer(path)
    for i in range(groups):
        buf.write_batch([group(f"{name}-{i}", size, explorer=name)], name, {"batch": i + 1})


@pytest.mark.slow
def test_concurrent_writers_and_a_reader_lose_and_repeat_nothing(buffer_url):
    path = buffer_url
    open_buffer(path)
    ctx = mp.get_context("spawn")
    writers = [ctx.Process(target=_writer, args=(path, f"w{k}", 40, 16)) for k in range(3)]
    for w in writers:
        w.start()
    reader, served = open_buffer(path), []
    for _ in range(3 * 40):
        (g,) = reader.read(1, timeout_s=120)
        served.append(g)
    for w in writers:
        w.join()
    assert all(
        len(g) == 16 and len({e.group_id for e in g}) == 1 for g in served
    )  # whole groups only
    assert len({g[0].group_id for g in served}) == 120  # none twice, none lost
    for k in range(3):  # FIFO per writer
        mine = [int(g[0].group_id.split("-")[1]) for g in served if g[0].explorer == f"w{k}"]
        assert mine == sorted(mine)


def test_rewards_must_be_finite_numbers(buffer_url):
    with pytest.raises(ValueError, match="reward must be a finite number"):
        group("nan", reward=float("nan"))
    buf = open_buffer(buffer_url)
    buf.write(group("g", reward=None))
    with pytest.raises(ValueError, match="finite numbers"):
        set_rewards(buf, "g", float("nan"))
    assert pending_groups(buf) == ["g"]


@pytest.mark.parametrize(
    "value,expected",
    [
        (float("nan"), "not a finite number"),
        ("high", "not a finite number"),
        (None, None),
        (0.5, None),
    ],
)
def test_workflow_scores_check_what_the_reward_function_returns(value, expected):
    import asyncio

    from workflows import Task, Workflow

    wf = Workflow(None, lambda task, completion, dataset: value, None, "", None)
    reward, error = asyncio.run(wf.score(Task("t", "q", "1"), "1"))
    if expected:
        assert reward == 0.0 and expected in error
    else:
        assert reward == value and error is None


def _trainer(tiny_model, run_dir, port, **settings):
    import torch.distributed as dist

    from run import Config

    if (
        not dist.is_initialized()
    ):  # a one-rank group in this process (no environment variables: subprocesses inherit them)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from trainer import Trainer

    return Trainer(
        Config(run_dir=str(run_dir), dtype="float32", save_dtype="float32", **settings),
        tiny_model,
        torch.device("cpu"),
    )


def test_resume_state_is_replaced_atomically(tiny_model, tmp_path):
    from checkpoints import load_resume_state, resume_state, save_resume_state
    from launch import free_port as _free_port

    trainer = _trainer(tiny_model, tmp_path, _free_port())
    first = save_resume_state(trainer, tmp_path, 2)
    assert resume_state(tmp_path) == first

    import checkpoints

    replace = checkpoints.os.replace

    def crash(src, dst):  # the marker is named by a rename: killed just before it
        if os.path.basename(dst) == "resume-latest":
            raise KeyboardInterrupt("killed between writing the new state and naming it")
        replace(src, dst)

    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(checkpoints.os, "replace", crash)
        with pytest.raises(KeyboardInterrupt):
            save_resume_state(trainer, tmp_path, 4)
    assert resume_state(tmp_path) == first and (tmp_path / "checkpoints" / "resume-000004").is_dir()
    assert (
        load_resume_state(trainer, resume_state(tmp_path)) == 2
    )  # the complete old state still loads
    save_resume_state(
        trainer, tmp_path, 4
    )  # the partial directory is rewritten, then named; the old one goes
    assert resume_state(tmp_path).name == "resume-000004" and not first.exists()
    import torch.distributed as dist

    dist.destroy_process_group()


def test_resume_state_holds_the_weights_once_and_resumes_exactly(tiny_model, tmp_path):
    # it held them three times (DCP model state with the tied embedding twice, and hf/): 68 MB for this
    # 3.2M-parameter model, 2.2 GB for SmolLM2-135M; what an exact resume needs is 12 bytes per parameter
    import torch.distributed as dist

    from checkpoints import load_resume_state, resume_state, save_resume_state
    from launch import free_port as _free_port

    # a learning-rate schedule goes on where it was: lr 0 at step 0 (warm-up), lr at step 1, then a cosine decay
    schedule = {"lr_schedule": "cosine", "lr_warmup_steps": 1, "steps": 4}
    a = _trainer(tiny_model, tmp_path, _free_port(), **schedule)
    exps = [
        Experience([5, 6, 7, 20 + i, 30 + i], 3, [-2.0, -2.0], [1, 1], float(i % 2), "g", "t", 0)
        for i in range(4)
    ]
    assert a.step([exps])["train/lr"] == 0.0  # AdamW moments that are not zero
    state = save_resume_state(a, tmp_path, 1)
    n = sum(p.numel() for p in a.model.parameters())  # (the tied embedding once)
    files = {
        f.relative_to(state).as_posix(): f.stat().st_size for f in state.rglob("*") if f.is_file()
    }
    tokenizer = sum(
        size
        for name, size in files.items()
        if name.startswith("hf/") and not name.endswith(".safetensors")
    )
    # float32 weights (4 bytes per parameter) + AdamW's two float32 moments (8), the tokenizer and configs for
    # the explorer, and some metadata (DCP's, safetensors' header, trainer.pt)
    assert sum(files.values()) <= 12 * n + tokenizer + 256 * 1024, files
    assert a.step([exps])["train/lr"] == a.cfg.lr
    b = _trainer(
        tiny_model, tmp_path, 0, **schedule
    )  # a fresh trainer, resumed: the next step is the same, bit for bit
    assert load_resume_state(b, resume_state(tmp_path)) == 1 and b.version == 1
    assert b.step([exps])["train/lr"] == a.cfg.lr
    assert all(torch.equal(x, y) for x, y in zip(a.full_parameters(), b.full_parameters()))
    dist.destroy_process_group()


def test_retention_never_deletes_a_checkpoint_being_loaded(tmp_path):
    def save(d):
        d.mkdir()
        (d / "w").write_text("x")

    checkpoint_sync.publish_checkpoint(tmp_path, 1, save, keep=2)

    def load(directory, version):  # while v1 is being read, the trainer publishes four more
        for v in range(2, 6):
            checkpoint_sync.publish_checkpoint(tmp_path, v, save, keep=2)
        return (directory / "w").read_text()

    assert checkpoint_sync.load_checkpoint(tmp_path, "e1", load) == (1, "x")
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("v*"))
    assert names == [
        "v000001",
        "v000004",
        "v000005",
    ]  # v1 survived its reader; the others beyond keep=2 went
    checkpoint_sync.publish_checkpoint(tmp_path, 6, save, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("v*")) == ["v000005", "v000006"]
    assert checkpoint_sync.load_checkpoint(tmp_path, "e1", lambda d, v: v, newer_than=6) is None


def test_a_resumed_run_logs_each_step_once(tmp_path):
    # killed after step 3 (and while writing a record) with the resume state at step 2: steps 2 and 3 are trained
    # again and the respawned explorer evaluates version 2 again, so their old records go; receipts of the weights
    # it starts from stay. (metrics.jsonl used to get them appended a second time.)
    import types

    import components
    import loop
    from run import Config

    old = [{"step": 0, "eval/version": 0, "eval/accuracy": 0.1}]
    for s in range(4):
        old += [
            {"step": s, "loss/grad_norm": 1.0},
            {"step": s + 1, "explorer/received_version": s + 1},
        ]
        if s % 2:
            old.append({"step": s + 1, "eval/version": s + 1, "eval/accuracy": 0.2})
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in old) + '{"step": 4, "loss/gr'
    )
    cfg = Config(run_dir=str(tmp_path), resume=True, log="none")
    _, log = components.reader_and_log(
        cfg, types.SimpleNamespace(version=2, tokenizer=None, loop_state={}), 2, ""
    )
    for r in (
        {"step": 2, "eval/version": 2, "eval/accuracy": 0.3},
        {"step": 2, "loss/grad_norm": 1.0},
        {"step": 3, "explorer/received_version": 3},
        {"step": 3, "loss/grad_norm": 1.0},
    ):
        log.metrics.write(r)
    log.bar.close()
    log.metrics.close()
    log.buffer.close()
    recs = strict_json_lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs if "loss/grad_norm" in r] == [0, 1, 2, 3]
    assert [r["eval/version"] for r in recs if "eval/accuracy" in r] == [0, 2]
    assert [r["explorer/received_version"] for r in recs if "explorer/received_version" in r] == [
        1,
        2,
        3,
    ]
    # mode train with explorers: the trainer reads all their evaluations from the buffer again
    assert not loop.kept_on_resume(2, evals_from_buffer=True)(
        {"step": 0, "eval/version": 0, "eval/accuracy": 0.1}
    )


@pytest.mark.slow
def test_mix_expert_data_continues_the_same_after_a_resume(tiny_model, tmp_path):
    # MIX adds round(f * n / (1 - f)) expert groups to a batch of n sequences, and n varies (here groups of 2 and
    # 4 sequences; shaping, replay and multi-turn workflows do the same): a resumed run continues the expert order
    # where the resume state says, as an uninterrupted run does (it used to start the expert data from the start)
    import dataclasses

    import torch.distributed as dist

    import components
    import run
    from checkpoints import load_resume_state, resume_state
    from launch import free_port as _free_port
    from run import Config

    expert = tmp_path / "expert.jsonl"
    expert.write_text(
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
            for i in range(7)
        )
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    buffer = open_buffer(run_dir / "buffer.sqlite")
    for s, n in enumerate([2, 4, 2, 4]):  # one group a step
        buffer.write(
            [
                Experience(
                    [1, 2, 3, 4 + i],
                    2,
                    [-0.5, -0.5],
                    [1, 1],
                    float(i % 2),
                    f"g{s}",
                    f"t{s}",
                    0,
                    {},
                    "w",
                )
                for i in range(n)
            ]
        )
    buffer.close()
    cfg = Config(
        run_dir=str(run_dir),
        steps=4,
        batch_size=1,
        checkpoint_interval=2,
        sync_method="checkpoint",
        policy_loss="mix",
        expert_fraction=0.5,
        expert_data=str(expert),
        log="none",
        dtype="float32",
        save_dtype="float32",
        eval_size=0,
    )

    def run_loop(start, resume):  # steps start..3 in this process: the expert sequences of each
        c = dataclasses.replace(cfg, resume=resume)
        trainer = components.make_trainer(c, tiny_model, torch.device("cpu"))
        assert (load_resume_state(trainer, resume_state(run_dir)) if resume else 0) == start
        reader, log = components.reader_and_log(c, trainer, start, tiny_model)
        publisher = components.publisher(c, 0, None)
        drawn, draw = [], reader.shape.expert.draw

        def recorded(n):
            got = draw(n)
            drawn.append([e.tokens for g in got for e in g])
            return got

        reader.shape.expert.draw = recorded
        try:
            run.rl_loop(c, trainer, reader, publisher, log, start)
        finally:
            log.bar.close()
            log.metrics.close()
            log.buffer.close()
        return drawn

    if not dist.is_initialized():  # a one-rank group in this process
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    try:
        whole = run_loop(0, False)
        assert [len(d) for d in whole] == [2, 4, 2, 4]
        assert run_loop(2, True) == whole[2:]
    finally:
        dist.destroy_process_group()


def test_explorers_differ_and_one_explorer_continues_the_same_after_a_restart(tiny_model, tmp_path):
    import components
    from engines import HFEngine
    from explorer import Explorer, explorer_seed
    from run import Config

    assert (
        explorer_seed(0, "explorer0") == 0
        and len({explorer_seed(0, n) for n in ("e1", "e2", "explorer0")}) == 3
    )

    class Keep:
        def __init__(self):
            self.groups, self.states = [], []

        def write_batch(self, groups, explorer=None, state=None, pools=()):
            self.groups.append(groups)
            self.states.append(state)

        def retired(self):
            return {}

    def explorer(name):
        cfg = Config(
            run_dir=str(tmp_path),
            explorer_name=name,
            batch_size=2,
            group_size=2,
            max_tokens=6,
            reward_fn="tests.rewards.length_parity",
            system_prompt="",
        )
        from workflows import Task

        tasks = [Task(f"t{i}", f"question {i}", "1") for i in range(20)]
        engine = HFEngine(tiny_model, seed=explorer_seed(0, name) + 1)
        return Explorer(cfg, engine, tasks, [], None, print, components.explorer_parts(cfg))

    def tokens(keep):
        return [[(e.task_id, e.tokens) for e in g] for gs in keep.groups for g in gs]

    a, b = explorer("e1"), explorer("e2")
    ka, kb = Keep(), Keep()
    one_batch(a, 0, ka)
    one_batch(b, 0, kb)
    assert {e.task_id for g in ka.groups[0] for e in g} != {
        e.task_id for g in kb.groups[0] for e in g
    }
    one_batch(a, 1, ka)
    restarted, kr = explorer("e1"), Keep()
    restarted.restore(
        json.loads(json.dumps(ka.states[0]))
    )  # the state stored with batch 0, through JSON
    one_batch(restarted, 1, kr)
    assert tokens(kr) == tokens(ka)[2:]  # batch 1 again, identical


@pytest.mark.parametrize(
    "args,message",
    [
        (["--lr", "-1"], "lr must be >= 0, got -1.0"),
        (["--lr", "nan"], "lr must be a finite number"),
        (
            ["--group-size", "1"],
            "advantage grpo compares the rollouts of a group: it needs group_size >= 2",
        ),
        (["--task-kwargs", "{bad"], "Error parsing --task-kwargs: Expecting property name"),
        (["--engine", "vllm", "--top-p", "0.9"], "--engine vllm with top_p 0.9, top_k 0: vLLM"),
        (["--bench-models", "smollm2-135m"], "--bench-models is for --mode bench"),
        (["--max-staleness", "-2"], "max_staleness must be >= 0, or -1 for no bound"),
        (
            ["--buffer", "postgresql://u:pw@127.0.0.1:1/db"],
            "buffer postgresql://127.0.0.1:1/db (schema nanorft_r): ",
        ),
    ],
)
@pytest.mark.slow
def test_bad_settings_are_one_error_line(tiny_model, tmp_path, args, message):
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        tmp_path / "r",
        *args,
        timeout=120,
    )
    assert res.returncode == 2 and message in res.stderr.strip().splitlines()[-1], res.stderr[
        -2000:
    ]
    assert "Traceback" not in res.stderr


def _bad_inputs(tiny_model, tmp_path):
    broken = tmp_path / "broken_model"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").write_text("{not json")
    empty = tmp_path / "no_weights"
    shutil.copytree(tiny_model, empty, ignore=shutil.ignore_patterns("*.safetensors"))
    (tmp_path / "a_file").write_text("x")
    run = tmp_path / "corrupt_run"
    run.mkdir()
    (run / "buffer.sqlite").write_bytes(b"this is not a database" * 100)
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage\x80")
    (tmp_path / "empty.jsonl").write_text("")
    return [
        (["--model", broken], "config.json cannot be loaded"),
        (["--model", empty], "model directory has no weights"),
        (["--run-dir", tmp_path / "a_file"], "a_file"),
        (["--run-dir", run, "--resume"], "not a usable SQLite database"),
        (["--workflow", "tests.plugins.BrokenInitWorkflow"], "environment server unreachable"),
        (["--task", tmp_path / "binary.jsonl"], "binary.jsonl: not UTF-8 text"),
        (
            [
                "--policy-loss",
                "mix",
                "--expert-data",
                tmp_path / "empty.jsonl",
                "--expert-fraction",
                0.25,
            ],
            "empty.jsonl: no conversations",
        ),
    ]


@pytest.mark.slow
def test_bad_files_are_one_error_line(tiny_model, tmp_path):
    for args, message in _bad_inputs(tiny_model, tmp_path):
        res = run_py(
            "--config",
            "configs/tiny.toml",
            "--model",
            tiny_model,
            "--run-dir",
            tmp_path / "r",
            *args,
            timeout=120,
        )
        last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""
        assert res.returncode == 2 and message in last and "Traceback" not in res.stderr, (
            args,
            res.stderr[-2000:],
        )


def test_jsonl_tasks_with_no_held_out_set(tmp_path):
    from components import load_tasks

    f = tmp_path / "t.jsonl"
    f.write_text(
        "".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(3))
    )
    train, held, _ = load_tasks(str(f), {}, 0, 0, 0)
    assert len(train) == 3 and held == []


@pytest.mark.parametrize(
    "args,message",
    [
        # the reward function fails on every rollout: the run stops after 3 such steps, with the reason
        (
            ["--reward-fn", "tests.rewards.always_raises", "--steps", 5],
            "the reward function failed on every rollout of 3 consecutive steps, e.g. RuntimeError: broken reward function",
        ),
        (
            ["--reward-fn", "tests.rewards.returns_nan", "--steps", 5],
            "returned nan, not a finite number",
        ),
        # a reward function that never returns is abandoned at the workflow timeout; the batch cannot be filled
        (
            [
                "--reward-fn",
                "tests.rewards.blocks",
                "--workflow-timeout-s",
                2,
                "--workflow-retries",
                0,
                "--refill-rounds",
                0,
            ],
            "explorer failed: RuntimeError: explorer: only 0 of 2 groups",
        ),
        # the trainer fails on its second step: the explorer (waiting for weights) goes with it
        (["--policy-loss", "tests.plugins.failing_loss", "--steps", 4], "loss diverged"),
        # the explorer's environment breaks for good after the first batches
        (
            [
                "--workflow",
                "tests.plugins.FailingLaterWorkflow",
                "--workflow-retries",
                0,
                "--refill-rounds",
                0,
                "--steps",
                6,
            ],
            "explorer failed: RuntimeError: explorer: only",
        ),
    ],
)
@pytest.mark.slow
def test_a_failing_side_ends_the_run_with_one_line(tiny_model, tmp_path, args, message):
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        tmp_path / "r",
        "--eval-size",
        0,
        *args,
        timeout=300,
    )
    lines = [x for x in res.stderr.strip().splitlines() if x.startswith("run.py: error:")]
    assert res.returncode == 1 and len(lines) == 1 and message in lines[0], res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert (
        "Traceback" in next((tmp_path / "r").glob("error*.log")).read_text()
    )  # the details are kept
    # the explorer, stopped by the failing trainer while it waits in a weight receive, exits by itself (it
    # used to hang in the weight-sync group's destructor until it was killed 30 s later)
    assert "did not stop" not in res.stderr


@pytest.mark.slow
def test_a_failed_run_that_cannot_finish_still_exits(tiny_model, tmp_path, monkeypatch):
    """Something left behind blocks the interpreter's exit (here an exit handler that waits
    forever): the failed run still ends, with its one error line, within the grace period,
    and the stacks of what blocked it go to its error log."""
    monkeypatch.setenv("NANORFT_EXIT_GRACE_S", "3")
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        tmp_path / "r",
        "--eval-size",
        0,
        "--policy-loss",
        "tests.plugins.failing_loss_that_hangs_on_exit",
        timeout=240,
    )
    lines = [x for x in res.stderr.strip().splitlines() if x.startswith("run.py: error:")]
    assert res.returncode == 1 and len(lines) == 1 and "loss diverged" in lines[0], res.stderr[
        -3000:
    ]
    log = (tmp_path / "r" / "error.log").read_text()
    assert "FloatingPointError: loss diverged" in log and "Timeout (0:00:03)!" in log


@pytest.mark.slow
def test_two_trainer_ranks_publish_checkpoints(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--steps",
        2,
        "--sync-method",
        "checkpoint",
        "--eval-size",
        0,
        "--reward-fn",
        "tests.rewards.length_parity",
        nproc=2,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert checkpoint_sync.latest_checkpoint(run_dir)[0] == 2
    steps = [r for r in strict_json_lines(run_dir / "metrics.jsonl") if "loss/grad_norm" in r]
    assert [r["trainer/ranks"] for r in steps] == [2, 2] and not math.isnan(
        steps[-1]["loss/policy"]
    )


def test_fault_benchmark_fast_subset(tiny_model):
    """benchmarks/faults.py, its quick parts: concurrent writers with a reader, and every
    malformed number refused while parsing, checked in-process (the whole benchmark runs each
    input as `python run.py`: README "Reliability")."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import faults

    r = faults.concurrent_writers(3, 240, 8)
    assert (r["partial_reads"], r["served_twice"], r["lost"]) == (0, 0, 0), r
    res = faults.part_inputs(tiny_model, fast_only=True)
    assert res["inputs"] >= 50 and res["one-line error"] == res["inputs"], [
        c for c in res["cases"] if c["outcome"] != "one-line error"
    ]


def _put_records_and_exit(queue, done, n):
    """An explorer's last moments: records on the queue (its feeder thread writes them to the pipe), then exit."""
    for i in range(n):
        queue.put({"batch": i, "pad": "x" * 1024})
    done.set()


def test_finish_reads_the_explorer_queue_while_waiting_for_it_to_exit(tmp_path):
    # a process that has put items on a multiprocessing queue does not exit until they are read: with more than a
    # pipe's worth (64 KiB) waiting, finish() that joined the explorer before draining its queue waited forever
    import threading
    import types

    import loop
    from metrics import Metrics
    from run import Config

    ctx = mp.get_context("spawn")  # as loop.start_explorer
    queue, done = ctx.Queue(), ctx.Event()
    n = 256  # records of 1 KiB: four pipe buffers
    child = ctx.Process(target=_put_records_and_exit, args=(queue, done, n))
    child.start()
    assert done.wait(
        300
    )  # every record is queued: the child now waits, in its exit, until they are read
    cfg = Config(run_dir=str(tmp_path), log="none", steps=n)
    (tmp_path / "final").mkdir()
    run_state = {}  # (a SQLite buffer would refuse finish's thread)
    metrics = Metrics(tmp_path)
    the_loop = loop.StepLog(
        cfg,
        0,
        1,
        n,
        buffer=types.SimpleNamespace(set_run_state=run_state.__setitem__),
        metrics=metrics,
    )
    the_loop.connect(loop.Explorers(lambda: loop.queued(queue), child.is_alive))
    failed = []

    def finish():
        try:
            loop.finish(cfg, the_loop, n, child, None, board=False)
        except BaseException as e:  # noqa: BLE001 - reported below
            failed.append(e)

    t = threading.Thread(target=finish, daemon=True)
    t.start()
    t.join(
        60
    )  # a guard (finish takes a few seconds: the plot): a deadlock fails the test instead of hanging it
    hung = t.is_alive()
    while (
        child.is_alive()
    ):  # after a deadlock: read the queue here, so that the child and then finish() can end
        loop.queued(queue)
        child.join(0.1)
    t.join()
    metrics.close()
    assert not hung, "finish() joined the explorer before reading its queue: deadlock"
    assert not failed and child.exitcode == 0, failed
    assert sorted(the_loop.records.pending) == list(range(n))  # every record was read
    assert run_state == {"trainer_done": str(n)}  # and finish went on to the end


def test_a_stopped_explorer_unwinds_without_a_second_report():
    # SIGTERM lands while an asyncio task runs (as in the explorer's engine): exit 1, nothing on stderr
    import subprocess
    import sys

    from conftest import ROOT

    code = (
        "import asyncio, os, signal, launch\n"
        "signal.signal(signal.SIGTERM, launch.exit_quietly)\n"
        "async def work():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    while True: sum(range(1000))\n"
        "async def main():\n"  # a task nobody awaits, like the engine's batch flush
        "    asyncio.get_running_loop().create_task(work())\n"
        "    await asyncio.sleep(3600)\n"
        "try:\n"
        "    asyncio.run(main())\n"
        "finally:\n"
        "    open(os.environ['MARK'], 'w').write('unwound')\n"
    )
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        mark = os.path.join(d, "mark")
        res = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "MARK": mark},
        )
        assert res.returncode == 1 and res.stderr == "", res.stderr
        assert open(mark).read() == "unwound"  # finally blocks ran (the engine is closed there)


@pytest.mark.slow
def test_a_run_killed_while_starting_can_be_resumed(tiny_model, tmp_path):
    # killed while starting, before the buffer existed: --resume starts it from step 0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--steps",
        1,
        "--eval-size",
        0,
        "--reward-fn",
        "tests.rewards.length_parity",
        "--resume",
        timeout=300,
    )
    assert res.returncode == 0 and "resumed at step 0" in res.stdout, res.stderr[-2000:]


def hold_in_another_process(buffer_url: str, name: str):
    """A process that holds explorer name `name` in the buffer until it is killed."""
    import subprocess
    import sys

    from conftest import ROOT

    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from extras.postgres import open_buffer; b = open_buffer(sys.argv[1]); "
            "b.hold(sys.argv[2]); print('held', flush=True); sys.stdin.read()",
            buffer_url,
            name,
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline() == "held\n"
    return p


def test_an_explorer_name_is_held_until_its_process_dies(buffer_url):
    # a restarted explorer waits for the old one of its name (an orphan still storing a batch): the name is a
    # flock (SQLite) or a session advisory lock (PostgreSQL), both dropped with the process, kill -9 included

    p = hold_in_another_process(buffer_url, "e1")
    other = open_buffer(buffer_url)
    assert other.hold("e1", wait=False) is False
    assert other.hold("e2", wait=False) is True  # another name is free
    p.kill()  # SIGKILL: no clean-up code runs
    p.wait()
    assert (
        other.hold("e1") is True
    )  # blocks until the kernel / the server has dropped the old holder


def test_running_explorers_are_the_named_ones_whose_process_lives(buffer_url):
    # mode train's trainer waits, after its last step, for the explorers that still run: each
    # evaluates the final weights before it leaves; a dead one (kill -9 included) no longer counts

    from extras.train_mode import running_explorers

    p = hold_in_another_process(buffer_url, "e1")
    trainer = open_buffer(buffer_url)
    for name in ("e1", "e2"):  # both wrote a batch; e2 has left
        trainer.db.execute("INSERT INTO explorer_state VALUES (?, ?)", (name, "{}"))
    assert running_explorers(trainer) == ["e1"]
    assert running_explorers(trainer) == ["e1"]  # asking takes no name
    p.kill()
    p.wait()
    deadline = time.monotonic() + 60  # the server drops a dead session's locks once it notices
    while running_explorers(trainer):
        assert time.monotonic() < deadline, "e1 still counted 60 s after its process died"
        time.sleep(0.05)
    assert trainer.hold("e1", wait=False) is True  # asking left the name free


def test_ctrl_c_wrapped_by_a_library_still_says_how_to_resume(tmp_path, monkeypatch, capsys):
    # torch.distributed.checkpoint turns a KeyboardInterrupt inside a save into a CheckpointException: Ctrl-C
    # during a resume-state write must still end as an interruption (130, the --resume line), not as a failure
    from torch.distributed.checkpoint.api import CheckpointException

    import run

    def run_that_is_interrupted_in_a_library(*_):
        try:
            os.kill(
                os.getpid(), signal.SIGINT
            )  # the handler raises at the next bytecode: inside this try
            for _ in range(1000):
                pass
        except KeyboardInterrupt as e:
            raise CheckpointException("write", {0: e}) from e  # a BaseException, not an Exception

    monkeypatch.setattr(run, "prepare", lambda cfg, rank: ("model", ()))
    monkeypatch.setitem(run.MODES, "both", run_that_is_interrupted_in_a_library)
    before = signal.getsignal(signal.SIGINT)
    signal.signal(
        signal.SIGINT, signal.default_int_handler
    )  # as in a terminal (a background job ignores it)
    try:
        assert run.main(["--run-dir", str(tmp_path / "r")]) == 130
        assert (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )  # the handler before run.main, back
    finally:
        signal.signal(signal.SIGINT, before)
    err = capsys.readouterr().err
    assert "interrupted; to continue: the same command with --resume" in err and "error" not in err


@pytest.mark.slow
def test_ctrl_c_says_how_to_resume_in_one_line(tiny_model, tmp_path):
    # SIGINT (Ctrl-C) once the run has written its first step: one line naming --resume, exit code 130,
    # no traceback from the trainer or the explorer; the resume itself then works
    import subprocess
    import sys
    import time

    from conftest import ROOT, subprocess_env, tiny_args

    run_dir = tmp_path / "r"
    more = ["--steps", "200", "--eval-size", "0", "--checkpoint-interval", "1"]
    args = tiny_args(tiny_model, run_dir, *more)
    proc = subprocess.Popen(
        [sys.executable, "run.py", *args],
        cwd=ROOT,
        # SIGABRT prints where every thread of a process waits
        env={**subprocess_env(), "PYTHONFAULTHANDLER": "1"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # as from a terminal
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    # a condition, not a duration
    while not (metrics.is_file() and "loss/grad_norm" in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal sends it to the whole process group
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        # which processes are left and where they wait; none left behind
        left = subprocess.run(
            ["ps", "-ww", "-o", "pid,ppid,stat,wchan:32,etime,args", "-g", str(proc.pid)],
            capture_output=True,
            text=True,
        ).stdout
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            err = proc.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            err = proc.communicate()[1]
        pytest.fail(
            f"no exit within 120 s of SIGINT; the processes of its group:\n{left}\n"
            f"their threads at SIGABRT:\n{err[-8000:]}"
        )
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted; to continue: the same command with --resume" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    res = run_py(*args[:-4], "--steps", 3, "--eval-size", 0, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.slow
def test_ctrl_c_with_a_collective_in_flight_still_exits(tiny_model, tmp_path):
    # Ctrl-C while a broadcast is in flight to a peer that never receives it: after the --resume
    # line, freeing the interrupted frame (its process group) or finalizing the interpreter would
    # wait for that peer; the process must end at once, with exit code 130
    import subprocess
    import sys

    from conftest import ROOT, subprocess_env, tiny_args

    args = tiny_args(tiny_model, tmp_path / "r")
    script = tmp_path / "interrupted.py"
    script.write_text(f"""import os, runpy, signal, subprocess, sys
from datetime import timedelta
import torch, torch.distributed as dist
sys.path.insert(0, {str(ROOT)!r})
import launch
store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
peer = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as dist; "
    f"g = dist.ProcessGroupGloo(dist.TCPStore('127.0.0.1', {{store.port}}, 2, False), 1, 2); "
    "time.sleep(600)"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(peer.pid, flush=True)
def interrupted_in_a_broadcast():  # mode both's first call, inside launch.guarded
    group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=600))
    work = group.broadcast([torch.zeros(1 << 24)])  # 64 MiB: more than the sockets hold
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10**6):  # the handler raises here, with `group` and `work` in this frame
        pass
launch.init_distributed = interrupted_in_a_broadcast
sys.argv = ["run.py", *{args!r}]
runpy.run_path("run.py", run_name="__main__")
""")
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=subprocess_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # as from a terminal
    peer = int(proc.stdout.readline())
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        os.kill(peer, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted; to continue: the same command with --resume" in err


def test_the_base_models_evaluation_is_read_from_the_cache_when_nothing_it_depends_on_changed(
    tiny_model, tmp_path, monkeypatch
):
    import components
    import explorer as X
    from config import Config
    from engines import HFEngine
    from workflows import Task

    monkeypatch.setenv("NANORFT_CACHE", str(tmp_path / "cache"))
    held_out = [Task(f"h{i}", f"question {i}", "1") for i in range(6)]

    def evaluation(version=0, **settings):
        cfg = Config(
            run_dir=str(tmp_path),
            model=tiny_model,
            group_size=4,
            eval_k=2,
            max_tokens=6,
            reward_fn="tests.rewards.length_parity",
            system_prompt="",
            **settings,
        )
        engine = HFEngine(tiny_model, seed=3)
        before = engine.rng_state()
        parts = components.explorer_parts(cfg)
        record = X.Explorer(cfg, engine, [], held_out, None, print, parts).evaluate(version)
        assert (
            engine.rng_state() == before
        )  # a cached evaluation leaves every later rollout as it was
        return record, engine

    calls = []
    sample = HFEngine.generate_batch
    monkeypatch.setattr(HFEngine, "generate_batch", lambda *a: calls.append(1) or sample(*a))
    first, _ = evaluation()
    assert (
        "eval/cached" not in first
        and first["eval/samples"] == 4
        and "eval/learnable_groups" in first
        and calls
    )
    assert len(list((tmp_path / "cache" / "evals").glob("*.json"))) == 1
    calls.clear()
    again, _ = evaluation()
    assert again["eval/cached"] == 1 and not calls  # read, not sampled
    assert {
        k: v
        for k, v in again.items()
        if k.startswith("eval/") and k not in ("eval/cached", "eval/seconds")
    } == {k: v for k, v in first.items() if k.startswith("eval/") and k != "eval/seconds"}
    # another sampling setting, or a later version: evaluated afresh
    evaluation(temperature=Config().temperature / 2)
    assert calls
    calls.clear()
    evaluation(version=2)
    assert calls
    for f in (tmp_path / "cache" / "evals").glob("*.json"):
        f.write_text("{not json")  # unreadable: a miss, never an error
    third, _ = evaluation()
    assert "eval/cached" not in third and third["eval/accuracy"] == first["eval/accuracy"]


def test_the_evaluation_cache_key_tells_apart_a_file_in_another_folder(
    tiny_model, tmp_path, monkeypatch
):
    import shutil

    import explorer as X
    from config import Config
    from workflows import Task

    monkeypatch.setenv("NANORFT_CACHE", str(tmp_path / "cache"))
    keys = []
    for name, folder in (("one", "a"), ("two", "b")):  # the same file, in another folder
        model = tmp_path / name
        shutil.copytree(tiny_model, model)
        (model / folder).mkdir()
        (model / folder / "extra.txt").write_text("1")
        keys.append(
            X.eval_cache(
                Config(), SimpleNamespace(loaded_from=str(model)), [Task("t", "q", "1")], 4
            ).name
        )
    assert keys[0] != keys[1]


def test_a_cached_evaluation_is_of_the_weights_the_engine_loaded(tiny_model, tmp_path, monkeypatch):
    # the key digested the files of --model: an engine started from other weights (a benchmark scoring a trained
    # model, an evaluation of another directory) read the start model's version-0 record instead of its own
    import shutil

    import components
    import explorer as X
    from config import Config
    from engines import HFEngine
    from workflows import Task

    monkeypatch.setenv("NANORFT_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    (other / "extra.txt").write_text("other weights")
    cfg = Config(
        run_dir=str(tmp_path),
        model=tiny_model,
        group_size=2,
        eval_k=2,
        max_tokens=4,
        reward_fn="tests.rewards.length_parity",
        system_prompt="",
    )
    held_out = [Task(f"h{i}", f"question {i}", "1") for i in range(3)]
    parts = components.explorer_parts(cfg)
    records = [
        X.Explorer(cfg, HFEngine(path, seed=3), [], held_out, None, print, parts).evaluate(0)
        for path in (tiny_model, str(other), str(other))
    ]
    assert (
        "eval/cached" not in records[0]
        and "eval/cached" not in records[1]
        and records[2]["eval/cached"] == 1
    )
    assert (
        X.eval_cache(cfg, SimpleNamespace(loaded_from=""), held_out, 2) is None
    )  # names no directory: no cache
    # a record written before the key covered the engine's weights may be another model's: never read
    path = X.eval_cache(cfg, HFEngine(tiny_model, seed=3), held_out, 2)
    path.write_text(json.dumps({**records[0], "eval/accuracy": -1.0}))
    engine = HFEngine(tiny_model, seed=3)
    again = X.Explorer(cfg, engine, [], held_out, None, print, parts).evaluate(0)
    assert "eval/cached" not in again and again["eval/accuracy"] == records[0]["eval/accuracy"]


def test_an_engine_failure_fails_the_runs_waiting_on_it_and_they_are_retried(tiny_model, tmp_path):
    from conftest import tiny_explorer
    from engines import HFEngine

    class FailsOnce(HFEngine):
        failed = False

        def generate_batch(self, prompts, ns, sampling):
            if not self.failed:
                self.failed = True
                raise RuntimeError("engine hiccup")
            return super().generate_batch(prompts, ns, sampling)

    engine = FailsOnce(tiny_model, seed=1)
    explorer, tasks = tiny_explorer(engine, tmp_path, 3, workflow_retries=1)
    groups = explorer.rollout(tasks)
    assert [len(g) for g in groups] == [2, 2, 2]
    # the three runs shared the failed batch: each failed once and succeeded on its retry
    assert explorer.counts == {"timeouts": 0, "errors": 3, "retries": 3, "skipped": 0}
    assert explorer.last_error == "RuntimeError: engine hiccup"
