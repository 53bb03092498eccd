"""Fault benchmark: nothing lost, nothing served or trained twice, no hang, one error line.

    python benchmarks/faults.py                          # all three parts (about 30 min on 2 CPU cores)
    python benchmarks/faults.py --part kills --trials 27 # kill -9 at random moments and in writes, then --resume
    python benchmarks/faults.py --part buffer            # concurrent writers + one reader; writers killed mid-write
    python benchmarks/faults.py --part buffer-postgres   # the same on a PostgreSQL server it starts
    python benchmarks/faults.py --part inputs            # malformed flags, files, plug-ins

kills:  each trial starts a short run of a tiny random model (mode both with broadcast or
        checkpoint sync, or a fully asynchronous explore + train pair), kill -9s the trainer,
        the explorer or the whole process group at a random moment, or aimed inside a
        resume-state write or a checkpoint publish (checkpoint interval 1; the run directory
        is polled and the kill sent when the write is seen; where it landed is read off the
        directory), then restarts what died (--resume for a trainer, a plain relaunch for an
        async explorer) and reads the buffer: groups lost (a partial group, or a whole one
        never trained while later ones of its explorer were), trained twice (a step with more
        than batch_size groups, or a group split over steps), generated twice (an explorer
        batch stored more than once), runs that could not resume (non-zero exit or no end in
        10 min), processes left behind.
buffer: W writer processes x N experiences (groups of G) with one reader calling read(1)
        at the same time: partial groups served, rows served twice, rows lost; then writers
        kill -9ed at a random moment of a write: partial groups left, explorer state not
        matching its rows.
inputs: >= 100 malformed inputs, each run as a user would (python run.py ...): counted as
        a one-line error (exit 2, or exit 1 for a run that failed), a counted skip (exit 0,
        the failures counted in the metrics: rollout/reward_errors, rollout/skipped), accepted
        (exit 0, nothing counted), a traceback, or a hang (no exit in 5 min).

Prints a table per part (the goal is 0 in every column but the first) and saves
benchmarks/results/faults.json. This is a benchmark, not a test: tests/test_reliability.py
runs a fast subset of each part.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from conftest import make_tiny_model, run_py, subprocess_env  # noqa: E402 (the tests' helpers: tiny model, run.py)

STEPS, BATCH, GROUP = 6, 2, 4  # the kill trials' job (configs/tiny.toml shape)
RUN = [
    "--config",
    "configs/tiny.toml",
    "--reward-fn",
    "tests.rewards.length_parity",
    "--eval-size",
    "0",
    "--steps",
    str(STEPS),
    "--checkpoint-interval",
    "1",
    "--sync-interval",
    "1",
    "--sync-offset",
    "1",
]
SCENARIOS = {  # name: (flags, fully asynchronous)
    "both, broadcast": ([], False),
    "both, checkpoint sync": (["--sync-method", "checkpoint"], False),
    "explore + train": (["--sync-method", "checkpoint"], True),
}
VICTIMS = ("trainer", "explorer", "group")
MOMENTS = (
    "random",
    "resume-state write",
    "checkpoint publish",
)  # when: a random time, or inside that write


def launch(args: list, log: Path) -> subprocess.Popen:
    """python run.py ARGS in a session of its own (killpg reaches its explorer), output to `log`."""
    return subprocess.Popen(
        [sys.executable, "run.py", *map(str, args)],
        cwd=ROOT,
        env=subprocess_env(),
        start_new_session=True,
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
    )


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (zombies excluded)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def explorer_pid(trainer: int) -> int | None:
    """The spawned explorer child of a mode-both trainer (not multiprocessing's resource tracker)."""
    for pid in session_pids(os.getpgid(trainer)):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if pid != trainer and b"spawn_main" in cmd:
            return pid
    return None


def phase(run_dir: Path) -> str:
    """What the run was writing when it was killed, read off its directory."""
    ck = run_dir / "checkpoints"
    marker = ck / "resume-latest"
    named = marker.read_text().strip() if marker.is_file() else None
    if any(p.name != named for p in ck.glob("resume-[0-9]*")):
        return "resume-state write"
    if list(ck.glob(".tmp-v*")):
        return "checkpoint publish"
    return "before first resume state" if named is None else "between writes"


def wait_gone(sid: int, timeout: float) -> int:
    """Wait until session `sid` has no live process; kill -9 what is left after `timeout`
    seconds and return how many were left."""
    deadline = time.monotonic() + timeout
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200].decode()
            print(f"left running: {cmd}")
            stack = subprocess.run(
                ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True
            )
            print(stack.stdout[-3000:])
        except (OSError, FileNotFoundError):
            pass
        os.kill(pid, signal.SIGKILL)
    return len(left)


def audit(
    run_dir: Path, buffer: str = "", steps: int = STEPS, batch: int = BATCH, group: int = GROUP
) -> dict:
    """Read the buffer of a run of `steps` steps, `batch` groups of `group` rollouts each,
    after it has ended (`buffer`: the run's --buffer; "" = RUN_DIR/buffer.sqlite): groups
    lost (partial, skipped, or missing from a step), trained twice (split over steps, or a
    step with more than `batch` groups), generated twice (an explorer batch stored more
    than once)."""
    from extras.postgres import open_buffer

    db = open_buffer(buffer, run_dir)
    try:
        rows = db.db.execute(
            "SELECT group_id, explorer, consumed, info FROM experiences"
        ).fetchall()
    finally:
        db.close()
    groups: dict[str, dict] = {}
    for gid, explorer, consumed, info in rows:
        g = groups.setdefault(
            gid,
            {"explorer": explorer, "consumed": set(), "n": 0, "batch": json.loads(info)["batch"]},
        )
        g["consumed"].add(consumed)
        g["n"] += 1
    per_step: dict[int, int] = {}
    batches: dict[tuple, int] = {}
    last_trained: dict[str, int] = {}
    for g in groups.values():
        batches[g["explorer"], g["batch"]] = batches.get((g["explorer"], g["batch"]), 0) + 1
        for c in g["consumed"] - {0}:
            per_step[c] = per_step.get(c, 0) + 1
            last_trained[g["explorer"]] = max(last_trained.get(g["explorer"], -1), g["batch"])
    partial = sum(g["n"] != group for g in groups.values())
    split = sum(len(g["consumed"]) > 1 for g in groups.values())
    skipped = sum(
        g["consumed"] == {0} and g["batch"] < last_trained.get(g["explorer"], -1)
        for g in groups.values()
    )
    return {
        "lost": partial
        + skipped
        + sum(max(0, batch - per_step.get(s, 0)) for s in range(1, steps + 1)),
        "trained_twice": split + sum(max(0, n - batch) for n in per_step.values()),
        "generated_twice": sum(max(0, n - batch) for n in batches.values()),
    }


def kill_trial(i: int, model: str, rng: random.Random, durations: dict) -> dict:
    name = list(SCENARIOS)[i % len(SCENARIOS)]
    flags, separate = SCENARIOS[name]
    victim = VICTIMS[(i // len(SCENARIOS)) % len(VICTIMS)]
    moment = MOMENTS[(i // (len(SCENARIOS) * len(VICTIMS))) % len(MOMENTS)]
    if moment == "checkpoint publish" and "checkpoint" not in flags:
        moment = "resume-state write"  # broadcast sync publishes no checkpoints
    with tempfile.TemporaryDirectory() as d:
        run_dir, log = Path(d) / "run", Path(d) / "log.txt"
        args = [*RUN, "--model", model, "--run-dir", run_dir, *flags]
        run_dir.mkdir()
        train = launch([*args, "--mode", "train"] if separate else args, log)
        explore = (
            launch([*args, "--mode", "explore", "--explorer-name", "e1"], log) if separate else None
        )
        deadline = time.monotonic() + rng.uniform(0.15, 0.95) * durations[name]
        if (
            moment != "random"
        ):  # poll the run directory and kill inside the write (else at the deadline)
            deadline += durations[name]
            while phase(run_dir) != moment and time.monotonic() < deadline and train.poll() is None:
                time.sleep(0.002)
        else:
            time.sleep(max(0.0, deadline - time.monotonic()))
        if victim == "explorer":
            target = explore.pid if separate else explorer_pid(train.pid)
            if target is None:  # not started yet, or done: kill the trainer instead
                victim, target = "trainer", train.pid
            os.kill(target, signal.SIGKILL)
        elif victim == "trainer":
            os.kill(train.pid, signal.SIGKILL)
        else:
            for p in (train, explore):
                if p is not None:
                    os.killpg(p.pid, signal.SIGKILL)
        at = phase(run_dir)
        if (
            separate
        ):  # fully async: the side left alive waits for the other to come back; restart what died
            trainer_dead, explorer_dead = (
                victim in ("trainer", "group"),
                victim in ("explorer", "group"),
            )
            left = 0
            for p, dead in ((train, trainer_dead), (explore, explorer_dead)):
                if dead:
                    p.wait()
                    left += wait_gone(p.pid, 60)
            resumed = launch([*args, "--mode", "train", "--resume"], log) if trainer_dead else train
            again = (
                launch([*args, "--mode", "explore", "--explorer-name", "e1"], log)
                if explorer_dead
                else explore
            )
        else:  # mode both: --resume at once; the side left alive ends by itself (a trainer with one error line)
            resumed, again = launch([*args, "--resume"], log), None
        try:
            ok = resumed.wait(timeout=600) == 0 and (again is None or again.wait(timeout=180) == 0)
        except subprocess.TimeoutExpired:
            ok = False
        if not separate:
            left = wait_gone(train.pid, 60)
        for p in (resumed, again):
            if p is not None:
                left += wait_gone(p.pid, 0)
        result = {
            "scenario": name,
            "victim": victim,
            "aimed": moment,
            "phase": at,
            "could_not_resume": int(not ok),
            "left_running": left,
        }
        if ok:
            result.update(audit(run_dir))
        else:
            result["log"] = log.read_text()[-2000:]
        return result


def measure(model: str) -> dict:
    """Seconds an uninterrupted run of each scenario takes (the window the kills fall in)."""
    out = {}
    for name, (flags, separate) in SCENARIOS.items():
        with tempfile.TemporaryDirectory() as d:
            run_dir, log = Path(d) / "run", Path(d) / "log.txt"
            run_dir.mkdir()
            args = [*RUN, "--model", model, "--run-dir", run_dir, *flags]
            t0 = time.monotonic()
            train = launch([*args, "--mode", "train"] if separate else args, log)
            explore = (
                launch([*args, "--mode", "explore", "--explorer-name", "e1"], log)
                if separate
                else None
            )
            if train.wait(timeout=600) or (explore and explore.wait(timeout=180)):
                raise RuntimeError(
                    f"{name}: the run without faults failed:\n{log.read_text()[-3000:]}"
                )
            out[name] = time.monotonic() - t0
            bad = audit(run_dir)
            if any(bad.values()):
                raise RuntimeError(f"{name}: the run without faults already fails the audit: {bad}")
    return out


def part_kills(trials: int, model: str, seed: int) -> dict:
    rng = random.Random(seed)
    durations = measure(model)
    print(f"uninterrupted runs (s): {json.dumps({k: round(v, 1) for k, v in durations.items()})}")
    results = []
    for i in range(trials):
        r = kill_trial(i, model, rng, durations)
        results.append(r)
        print(
            f"trial {i + 1:>2}: {r['scenario']:<22} kill {r['victim']:<8} aimed at {r['aimed']:<19} "
            f"landed in {r['phase']:<26} "
            + " ".join(
                f"{k}={r.get(k, '-')}"
                for k in (
                    "lost",
                    "trained_twice",
                    "generated_twice",
                    "could_not_resume",
                    "left_running",
                )
            ),
            flush=True,
        )
        if "log" in r:
            print(r["log"])
    total = {
        k: sum(r.get(k, 0) for r in results)
        for k in ("lost", "trained_twice", "generated_twice", "could_not_resume", "left_running")
    }
    phases = {
        p: sum(r["phase"] == p for r in results) for p in sorted({r["phase"] for r in results})
    }
    return {"trials": len(results), **total, "phases": phases, "runs": results}


# ----------------------------------------------------------------------------- buffer


def _write(path: str, name: str, n_groups: int, size: int) -> None:
    from buffer import Buffer, Experience

    buf = Buffer(path)
    for i in range(n_groups):
        group = [
            Experience(
                [1, 2, 3], 1, [-0.5, -0.5], [1, 1], 1.0, f"{name}-{i}", f"t{i}", 0, {"row": j}, name
            )
            for j in range(size)
        ]
        buf.write_batch([group], name, {"batch": i + 1})


def sqlite_buffer(d: str) -> str:
    """A fresh SQLite buffer in directory `d` (the default `fresh` of the buffer part)."""
    return str(Path(d) / "buffer.sqlite")


def concurrent_writers(writers: int, experiences: int, size: int, fresh=sqlite_buffer) -> dict:
    """W writer processes x `experiences` each (groups of `size`), one reader in this process,
    on the buffer `fresh(temporary directory)` returns (a SQLite path or a PostgreSQL URL)."""
    from buffer import Buffer

    n_groups = experiences // size
    with tempfile.TemporaryDirectory() as d:
        path = fresh(d)
        Buffer(path)
        procs = [
            mp.get_context("spawn").Process(target=_write, args=(path, f"w{k}", n_groups, size))
            for k in range(writers)
        ]
        for p in procs:
            p.start()
        reader, served = Buffer(path), []
        while len(served) < writers * n_groups:
            served += reader.read(1, timeout_s=300)
        for p in procs:
            p.join()
        rows = [(e.group_id, e.info["row"]) for g in served for e in g]
        left = reader.counts()["ready"]
    return {
        "writers": writers,
        "experiences": writers * n_groups * size,
        "group_size": size,
        "partial_reads": sum(len(g) != size or len({e.group_id for e in g}) != 1 for g in served),
        "served_twice": len(rows) - len(set(rows)),
        "lost": writers * n_groups * size - len(set(rows)) + left,
    }


def killed_writers(trials: int, size: int, rng: random.Random, fresh=sqlite_buffer) -> dict:
    """kill -9 a writer at a random moment; count partial groups left in the buffer and
    explorer states that do not match the writer's stored batches."""
    from buffer import Buffer

    partial = mismatched = 0
    for _ in range(trials):
        with tempfile.TemporaryDirectory() as d:
            path = fresh(d)
            Buffer(path)
            p = mp.get_context("spawn").Process(target=_write, args=(path, "w", 10**6, size))
            p.start()
            while Buffer(path).counts()["total"] < size:  # it has started writing
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.5))
            os.kill(p.pid, signal.SIGKILL)
            p.join()
            buf = Buffer(path)
            sizes = [
                n
                for (n,) in buf.db.execute(
                    "SELECT COUNT(*) FROM experiences GROUP BY group_id"
                ).fetchall()
            ]
            partial += sum(n != size for n in sizes)
            mismatched += int((buf.explorer_state("w") or {"batch": 0})["batch"] != len(sizes))
    return {"killed_writers": trials, "partial_groups_left": partial, "state_mismatch": mismatched}


def part_buffer(writers: int, experiences: int, kills: int, seed: int, fresh=sqlite_buffer) -> dict:
    runs = [
        concurrent_writers(1, 128_000 * experiences // 2000, 64, fresh),
        concurrent_writers(writers, experiences, 8, fresh),
    ]
    for r in runs:
        print(" ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    killed = killed_writers(kills, 64, random.Random(seed), fresh)
    print(" ".join(f"{k}={v}" for k, v in killed.items()))
    return {"concurrent": runs, **killed}


def part_buffer_postgres(writers: int, experiences: int, kills: int, seed: int) -> dict:
    """The buffer part on a PostgreSQL server started for it (tests/conftest.py: start_postgres),
    a fresh schema per trial."""
    import uuid

    from conftest import start_postgres

    with tempfile.TemporaryDirectory() as d:
        url, stop = start_postgres(Path(d))
        try:
            return part_buffer(
                writers,
                experiences,
                kills,
                seed,
                lambda _: f"{url}?schema=f_{uuid.uuid4().hex[:12]}",
            )
        finally:
            stop()


# ----------------------------------------------------------------------------- malformed inputs

NUMERIC = [
    "steps",
    "batch_size",
    "group_size",
    "max_tokens",
    "train_size",
    "eval_size",
    "eval_interval",
    "sync_interval",
    "sync_offset",
    "lr",
    "temperature",
    "top_p",
    "token_budget",
    "checkpoint_interval",
    "max_grad_norm",
    "weight_decay",
    "seed",
    "workflow_timeout_s",
    "workflow_retries",
    "max_staleness",
    "buffer_timeout_s",
    "sync_timeout_s",
    "explorer_threads",
    "trainer_threads",
    "bench_k",
    "expert_fraction",
    "refill_rounds",
    "entropy_coef",
]


def input_cases(tmp: Path, model: str) -> list[tuple[str, list]]:
    """(what, run.py arguments) for each malformed input; files are written under `tmp`."""

    def write(name: str, data: str | bytes) -> Path:
        p = tmp / name
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        return p

    def model_like(name: str, drop: str = "", edit: tuple[str, str] | None = None) -> Path:
        p = tmp / name
        shutil.copytree(model, p, ignore=shutil.ignore_patterns(drop) if drop else None)
        if edit:
            (p / edit[0]).write_text(edit[1])
        return p

    cases: list[tuple[str, list]] = []
    for f in NUMERIC:  # every numeric setting: not a number, and a non-finite number
        flag = "--" + f.replace("_", "-")
        cases += [(f"{flag} abc", [flag, "abc"]), (f"{flag} nan", [flag, "nan"])]
    cases += [
        (f"{flag} {v}", [flag, v])
        for flag, v in [
            ("--steps", "-3"),
            ("--batch-size", "0"),
            ("--group-size", "0"),
            ("--max-tokens", "0"),
            ("--lr", "-1"),
            ("--lr", "inf"),
            ("--temperature", "0"),
            ("--top-p", "1.5"),
            ("--top-p", "0"),
            ("--sync-interval", "0"),
            ("--sync-offset", "-1"),
            ("--token-budget", "0"),
            ("--expert-fraction", "1.5"),
            ("--train-size", "0"),
            ("--mode", "sideways"),
            ("--engine", "tpu"),
            ("--sync-method", "carrier-pigeon"),
            ("--loss-agg", "median"),
            ("--kl-estimator", "k9"),
            ("--policy-loss", "no_such_loss"),
            ("--advantage", "no_such_adv"),
            ("--policy-loss", "no_such_module.fn"),
            ("--policy-loss-kwargs", '{"clip": 1}'),
            ("--advantage-kwargs", "[1, 2]"),
            ("--filters", '{"no_such_filter": {}}'),
            ("--task-kwargs", "{bad"),
            ("--reward-kwargs", "not json"),
            ("--task", "no_such_reasoning_gym_task"),
            ("--task-kwargs", '{"no_such_option": 1}'),
            ("--bench-models", "/no/such/model"),
            ("--unknown-flag", "1"),
            ("--config", str(tmp / "missing.toml")),
            ("--model", "/no/such/dir"),
            ("--max-staleness", "-2"),
        ]
    ]
    cases.append(("--group-size 1 with grpo", ["--group-size", "1"]))
    cases.append(("--mode train --overwrite", ["--mode", "train", "--overwrite"]))
    cases.append(("--inflight --mode train", ["--inflight", "--mode", "train"]))
    cases.append(("--resume with no run", ["--resume"]))
    for name, text in [
        ("syntax.toml", "steps = = 3"),
        ("unknown_key.toml", "no_such_key = 1"),
        ("wrong_type.toml", 'steps = "three"'),
        ("table.toml", "[steps]\nx = 1"),
        ("list.toml", "lr = [1, 2]"),
        ("binary.toml", b"\xff\xfe\x00\x80"),
    ]:
        cases.append((f"TOML {name}", ["--config", write(name, text)]))
    cases.append(("TOML is a directory", ["--config", tmp]))
    tasks = {
        "empty.jsonl": "",
        "blank.jsonl": "\n\n",
        "binary.jsonl": b"\xff\xfe\x00garbage\x80",
        "not_json.jsonl": "{question: 1}\n",
        "no_answer.jsonl": '{"question": "1+1"}\n',
        "no_question.jsonl": '{"answer": "2"}\n',
        "list_row.jsonl": "[1, 2]\n",
        "truncated.jsonl": '{"question": "1+1", "answer": "2"}\n{"question": "2+',
    }
    for name, text in tasks.items():
        cases.append((f"task file {name}", ["--task", write(name, text)]))
    cases.append(("task file is a directory", ["--task", tmp]))
    chats = {
        "chat_not_json.jsonl": "{messages\n",
        "chat_no_messages.jsonl": '{"text": "hi"}\n',
        "chat_no_assistant.jsonl": '{"messages": [{"role": "user", "content": "hi"}]}\n',
        "chat_bad_role.jsonl": '{"messages": [{"role": "wizard", "content": "hi"}]}\n',
        "chat_empty.jsonl": "",
        "chat_binary.jsonl": b"\x80\x81\x82",
    }
    for name, text in chats.items():
        p = write(name, text)
        cases.append(
            (
                f"SFT data {name}",
                [
                    "--mode",
                    "train",
                    "--train-data",
                    p,
                    "--policy-loss",
                    "sft",
                    "--advantage",
                    "dr_grpo",
                ],
            )
        )
        cases.append(
            (
                f"MIX expert data {name}",
                ["--policy-loss", "mix", "--expert-data", p, "--expert-fraction", "0.25"],
            )
        )
    prefs = {
        "pref_no_rejected.jsonl": '{"prompt": [{"role": "user", "content": "hi"}], "chosen": "a"}\n',
        "pref_bad_chosen.jsonl": '{"prompt": [{"role": "user", "content": "hi"}], "chosen": 3, "rejected": "b"}\n',
    }
    for name, text in prefs.items():
        cases.append(
            (
                f"DPO data {name}",
                ["--mode", "train", "--train-data", write(name, text), "--policy-loss", "dpo"],
            )
        )
    models = {
        "model: config.json not JSON": model_like("m_conf", edit=("config.json", "{not json")),
        "model: no weights": model_like("m_noweights", drop="*.safetensors"),
        "model: corrupt weights": model_like("m_badweights", edit=("model.safetensors", "garbage")),
        "model: no tokenizer": model_like("m_notok", drop="tokenizer*"),
        "model: empty directory": tmp / "m_empty",
        "model: a file": write("m_file", "x"),
    }
    (tmp / "m_empty").mkdir()
    for what, path in models.items():
        cases.append((what, ["--model", path]))
    for what, data in [
        ("corrupt", b"this is not a database" * 100),
        ("directory", "dir"),
        ("another schema", None),
    ]:
        run = tmp / f"run_{what.replace(' ', '_')}"
        run.mkdir()
        if data == "dir":
            (run / "buffer.sqlite").mkdir()
        elif data is None:
            sqlite3.connect(run / "buffer.sqlite").execute("CREATE TABLE experiences (x)")
        else:
            (run / "buffer.sqlite").write_bytes(data)
        cases.append((f"--resume with a {what} buffer", ["--run-dir", run, "--resume"]))
    cases.append(("run dir is a file", ["--run-dir", write("a_file", "x")]))
    cases.append(("run dir inside a file", ["--run-dir", tmp / "a_file" / "r"]))
    for fn in (
        "always_raises",
        "returns_nan",
        "returns_none",
        "returns_string",
        "blocks",
        "sometimes_raises",
        "sometimes_nan",
    ):
        extra = {
            "blocks": [
                "--workflow-timeout-s",
                "2",
                "--workflow-retries",
                "0",
                "--refill-rounds",
                "0",
            ],
            "returns_none": ["--buffer-timeout-s", "20"],
        }.get(fn, [])  # None = a lagged reward: never filled
        cases.append(
            (
                f"reward function {fn}",
                ["--reward-fn", f"tests.rewards.{fn}", "--steps", "4", *extra],
            )
        )
    cases += [
        ("reward function missing", ["--reward-fn", "tests.rewards.no_such_fn"]),
        ("reward module missing", ["--reward-fn", "no_such_module.fn"]),
        ("workflow raises in __init__", ["--workflow", "tests.plugins.BrokenInitWorkflow"]),
        (
            "workflow fails later",
            [
                "--workflow",
                "tests.plugins.FailingLaterWorkflow",
                "--workflow-retries",
                "0",
                "--refill-rounds",
                "0",
                "--steps",
                "6",
            ],
        ),
        ("workflow missing", ["--workflow", "tests.plugins.NoSuchWorkflow"]),
        ("loss raises", ["--policy-loss", "tests.plugins.failing_loss", "--steps", "4"]),
    ]
    return cases


def case_argv(args: list, model: str, run_dir: Path) -> list:
    """run.py's arguments for a case: the tiny job, then the case's own (a later --config /
    --model / --run-dir in `args` wins: argparse's last one counts)."""
    fixed = ["--config", "configs/tiny.toml", "--model", model, "--eval-size", "0"]
    return [*fixed, "--run-dir", run_dir, *args]


def run_case(what: str, args: list, model: str, tmp: Path) -> dict:
    run_dir = tmp / f"run_{abs(hash(what))}"
    try:
        res = run_py(*case_argv(args, model, run_dir), timeout=300)
    except subprocess.TimeoutExpired:
        return {"input": what, "outcome": "hang"}
    errors = [x for x in res.stderr.splitlines() if "error:" in x]
    if "Traceback" in res.stderr:
        outcome = "traceback"
    elif res.returncode in (1, 2) and len(errors) == 1:
        outcome = "one-line error"
    elif res.returncode == 0:  # it ran: were the bad parts counted (reward errors, skipped tasks)?
        metrics = run_dir / "metrics.jsonl"
        recs = (
            [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
        )
        counted = sum(r.get("rollout/reward_errors", 0) + r.get("rollout/skipped", 0) for r in recs)
        outcome = "counted skip" if counted else "accepted"
    else:
        outcome = f"exit {res.returncode}"
    return {
        "input": what,
        "outcome": outcome,
        "exit": res.returncode,
        "line": (errors or [""])[-1][:200],
    }


def parse_case(what: str, args: list, model: str, tmp: Path) -> dict:
    """run_case for an input refused while parsing, in this process: run.main prints the
    ValueError of run.parse_config as its one error line and exits 2; an input that parses
    would start a run, and counts as accepted."""
    import run

    try:
        run.parse_config([str(a) for a in case_argv(args, model, tmp / "run")])
    except ValueError as e:
        return {"input": what, "outcome": "one-line error", "exit": 2, "line": str(e)[:200]}
    except SystemExit as e:
        return {"input": what, "outcome": f"exit {e.code}", "exit": e.code}
    return {"input": what, "outcome": "accepted", "exit": 0}


def part_inputs(model: str, workers: int = 2, fast_only: bool = False) -> dict:
    """Every malformed input run as a user would; fast_only: those refused while parsing (a
    number that is none, or not finite), each checked in this process (`parse_case`)."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cases = input_cases(tmp, model)
        if fast_only:
            cases = [
                c
                for c in cases
                if c[0].split()[0].startswith("--") and c[0].split()[-1] in ("abc", "nan")
            ]
            results = [parse_case(*c, model, tmp) for c in cases]
        else:
            with ThreadPoolExecutor(workers) as pool:
                results = list(pool.map(lambda c: run_case(*c, model, tmp), cases))
    for r in results:
        print(f"{r['outcome']:<15} {r['input']:<45} {r.get('line', '')}")
    counts = {
        k: sum(r["outcome"] == k for r in results)
        for k in ("one-line error", "counted skip", "accepted", "traceback", "hang")
    }
    counts["other"] = len(results) - sum(counts.values())
    return {"inputs": len(results), **counts, "cases": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--part",
        choices=["kills", "buffer", "buffer-postgres", "inputs", "all"],
        default="all",
        help="buffer-postgres: the buffer part on a PostgreSQL server it starts (all: both buffer parts)",
    )
    p.add_argument(
        "--trials",
        type=int,
        default=27,
        help="kill -9 trials (27: each scenario x victim x moment)",
    )
    p.add_argument("--writers", type=int, default=4)
    p.add_argument("--experiences", type=int, default=2000, help="experiences per writer")
    p.add_argument("--writer-kills", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out_path = ROOT / "benchmarks" / "results" / "faults.json"
    out = json.loads(out_path.read_text()) if out_path.exists() else {}
    with tempfile.TemporaryDirectory() as d:
        model = str(make_tiny_model(Path(d) / "model"))
        if args.part in ("buffer", "all"):
            out["buffer"] = part_buffer(
                args.writers, args.experiences, args.writer_kills, args.seed
            )
        if args.part in ("buffer-postgres", "all"):
            out["buffer-postgres"] = part_buffer_postgres(
                args.writers, args.experiences, args.writer_kills, args.seed
            )
        if args.part in ("inputs", "all"):
            out["inputs"] = part_inputs(model)
        if args.part in ("kills", "all"):
            out["kills"] = part_kills(args.trials, model, args.seed)
    out_path.write_text(json.dumps(out, indent=1))
    print("\nsummary")
    if "kills" in out:
        k = out["kills"]
        print(
            f"kill -9 trials {k['trials']}: lost {k['lost']}, trained twice {k['trained_twice']}, generated twice "
            f"{k['generated_twice']}, could not resume {k['could_not_resume']}, left running {k['left_running']}; "
            f"phases {k['phases']}"
        )
    for part in ("buffer", "buffer-postgres"):
        if part not in out:
            continue
        for r in out[part]["concurrent"]:
            print(
                f"{part} {r['writers']} writer(s) x {r['experiences'] // r['writers']} experiences (groups of "
                f"{r['group_size']}): partial {r['partial_reads']}, served twice {r['served_twice']}, lost {r['lost']}"
            )
        b = out[part]
        print(
            f"{part}: writers killed mid-write {b['killed_writers']}: partial groups left {b['partial_groups_left']}, "
            f"explorer state mismatched {b['state_mismatch']}"
        )
    if "inputs" in out:
        i = out["inputs"]
        print(
            f"malformed inputs {i['inputs']}: one-line error {i['one-line error']}, counted skip {i['counted skip']}, "
            f"accepted {i['accepted']}, traceback {i['traceback']}, hang {i['hang']}, other {i['other']}"
        )
    print(f"saved {out_path}")


if __name__ == "__main__":
    main()
