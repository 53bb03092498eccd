"""The buffer shared by writer and reader processes, in both backends (SQLite file, PostgreSQL server)."""

import math
import multiprocessing as mp
import time

import pytest

from buffer import Experience
from conftest import before_commit
from extras.postgres import open_buffer


def group(gid: str, n: int = 3, reward=1.0, version=0) -> list[Experience]:
    return [
        Experience(
            [1, 2, 3, 4 + i],
            2,
            [-0.5, -0.25],
            [1, 1],
            reward,
            gid,
            f"task-{gid}",
            version,
            {"i": i},
        )
        for i in range(n)
    ]


def writer(path, n_groups):
    buf = open_buffer(path)
    buf.write(group("pending", reward=None))  # never complete: must never be served
    for k in range(n_groups):
        buf.write(group(f"g{k}", version=k))
        time.sleep(0.01)


def test_two_processes_fifo_complete_groups_once(buffer_url):
    path = buffer_url
    open_buffer(path)  # create the schema before both processes open it
    proc = mp.get_context("spawn").Process(target=writer, args=(path, 20))
    proc.start()
    reader = open_buffer(path)
    served = []
    for _ in range(5):
        served += reader.read(4, timeout_s=60)
    proc.join()
    assert proc.exitcode == 0
    assert [g[0].group_id for g in served] == [f"g{k}" for k in range(20)]
    assert all(len(g) == 3 and g[0].model_version == int(g[0].group_id[1:]) for g in served)
    first = served[0][1]
    assert (
        first.tokens,
        first.prompt_length,
        first.behaviour_logprobs,
        first.action_mask,
        first.info,
    ) == ([1, 2, 3, 5], 2, [-0.5, -0.25], [1, 1], {"i": 1})
    assert reader.counts() == {"total": 63, "consumed": 60, "pending": 3, "ready": 0}
    with pytest.raises(TimeoutError):
        reader.read(1, timeout_s=0.2)  # only the pending group is left


def test_reader_does_not_hang_on_dead_writer(buffer_url):
    buf = open_buffer(buffer_url)
    with pytest.raises(RuntimeError, match="writer stopped"):
        buf.read(1, alive=lambda: False)


def test_experience_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 behaviour_logprobs"):
        Experience([1, 2, 3], 2, [-0.1, -0.2], [1], 1.0, "g", "t", 0)


def test_task_pools_persist_and_reactivate(buffer_url):
    buf = open_buffer(buffer_url)
    buf.write_batch([], pools=[("t1", 1.0, 0.9, 0.1), ("t2", 0.0, 0.9, 0.1), ("t3", 0.5, 0.9, 0.1)])
    assert open_buffer(buffer_url).retired() == {"t1": "easy", "t2": "hard"}  # persisted
    buf.write_batch([], pools=[("t1", 0.5, 0.9, 0.1)])  # a lifted task that is no longer easy
    assert buf.retired() == {"t2": "hard"}


def test_the_default_settings_retire_no_task_whatever_its_rewards():
    # rewards outside [0, 1] (a -1 for a wrong format, a bonus of 2) are no reason to retire a task
    from buffer import pool_for
    from config import Config

    cfg = Config()
    for mean_reward in (-5.0, -1.0, 0.0, 0.5, 1.0, 2.0, 5.0):
        assert pool_for(mean_reward, cfg.pool_easy, cfg.pool_hard) is None
    assert pool_for(-1.0, cfg.pool_easy, -1.0) == "hard"
    assert pool_for(2.0, 2.0, cfg.pool_hard) == "easy"


def test_a_pool_bound_is_a_number_or_off():
    from config import parse_config

    cfg = parse_config(["--pool-easy", "0.9", "--pool-hard", "0.1"])
    assert (cfg.pool_easy, cfg.pool_hard) == (0.9, 0.1)
    assert parse_config(["--pool-easy", "inf", "--pool-hard", "-inf"]).pool_hard == -math.inf
    # an unbounded bound the other way would retire every task
    with pytest.raises(ValueError, match="pool_easy must be a finite number"):
        parse_config(["--pool-easy", "-inf"])


def test_offline_sampler_cycles_all_and_marks_offline():
    from extras.offline import OfflineSampler

    groups = [[Experience([1, 2, i], 2, [0.0], [1], 1.0, f"g{i}", f"t{i}", 0)] for i in range(3)]
    s = OfflineSampler(groups, seed=0)
    drawn = [g[0] for g in s.draw(3) + s.draw(3)]
    assert (
        sorted(e.tokens[-1] for e in drawn[:3])
        == [0, 1, 2]
        == sorted(e.tokens[-1] for e in drawn[3:])
    )
    assert all(e.info["offline"] for e in drawn) and not groups[0][0].info
    with pytest.raises(ValueError, match="empty"):
        OfflineSampler([], 0)


def test_two_readers_never_take_the_same_group(postgres):
    # PostgreSQL: reader A is stopped inside its take (group chosen and marked, not committed) until
    # the server shows reader B waiting for a lock: B must then get the other group, not A's
    # again (the readers' advisory lock; without it B would read g0 before A commits). SQLite's
    # BEGIN IMMEDIATE excludes this by itself.
    import threading
    import uuid

    buffer_url = f"{postgres}?schema=t_{uuid.uuid4().hex[:12]}"
    open_buffer(buffer_url).write_batch([group("g0"), group("g1")])
    inside, release, got = threading.Event(), threading.Event(), {}

    def reader(
        name, hook=None
    ):  # a connection per thread (sqlite3 connections stay in their thread)
        buf = open_buffer(buffer_url)
        if hook is not None:
            before_commit(buf, hook)
        got[name] = buf.read(1, timeout_s=60)

    ta = threading.Thread(target=reader, args=("a", lambda: (inside.set(), release.wait(60))))
    ta.start()
    assert inside.wait(60)
    tb = threading.Thread(target=reader, args=("b",))
    tb.start()
    watch = open_buffer(buffer_url)
    while not watch.db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    ).fetchone()[0]:
        assert tb.is_alive()  # B is waiting or about to: never done before A commits
    release.set()
    ta.join()
    tb.join()
    assert {got["a"][0][0].group_id, got["b"][0][0].group_id} == {"g0", "g1"}


def test_run_state_records_and_clear(buffer_url):
    from extras.train_mode import add_record, records_after

    buf = open_buffer(buffer_url)
    assert buf.run_state("trainer_done") is None
    buf.set_run_state("trainer_done", "4")
    assert open_buffer(buffer_url).run_state("trainer_done") == "4"
    buf.set_run_state("trainer_done", None)
    assert buf.run_state("trainer_done") is None
    add_record(buf, "e1", {"eval/accuracy": 0.5, "eval/bad": float("nan")})
    last, recs = records_after(buf, 0)
    assert recs == [{"eval/accuracy": 0.5, "eval/bad": None, "explorer": "e1"}]
    add_record(buf, "e2", {"eval/accuracy": 0.75})
    assert records_after(buf, last)[1] == [{"eval/accuracy": 0.75, "explorer": "e2"}]
    buf.write_batch([group("g")], "e1", {"batch": 1}, [("task-g", 1.0, 0.9, 0.1)])
    buf.clear()
    assert buf.counts()["total"] == 0 and buf.explorer_state("e1") is None and buf.retired() == {}
    assert records_after(buf, 0)[1] == []


def test_postgres_runs_share_a_database_in_their_own_schemas(postgres, tmp_path):
    from extras.postgres import open_buffer

    a = open_buffer(postgres, tmp_path / "Run-A")  # default schema: nanorft_<run dir name>
    b = open_buffer(postgres, tmp_path / "run-b")
    assert a.db.schema == "nanorft_run_a" and b.db.schema == "nanorft_run_b"
    a.clear()
    b.clear()
    a.write(group("only-a"))
    assert a.counts()["total"] == 3 and b.counts()["total"] == 0
    assert (
        open_buffer(f"{postgres}?schema=nanorft_run_a", tmp_path / "elsewhere").counts()["total"]
        == 3
    )
    with pytest.raises(ValueError, match="schema 'Bad-Name'"):
        open_buffer(f"{postgres}?schema=Bad-Name")


def test_unreachable_or_bad_buffers_are_one_line(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(
        ValueError, match=r"^buffer postgresql://127.0.0.1:\d+/db \(schema x\): .*"
    ) as e:
        open_buffer(f"postgresql://user:secret@127.0.0.1:{port}/db?schema=x", timeout_s=2)
    assert "secret" not in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "junk").write_text("not a database" * 100)
    with pytest.raises(ValueError, match="not a usable SQLite database"):
        open_buffer(tmp_path / "junk")


def test_a_new_run_does_not_mix_into_a_used_postgres_schema(postgres, tmp_path):
    # mode both refuses a schema holding another run's experiences (as it refuses a non-empty run dir);
    # --overwrite empties it, --resume and the fully asynchronous modes share it
    from components import check_buffer
    from run import Config

    run_dir = tmp_path / "shared"
    url = f"{postgres}?schema=t_reuse_{tmp_path.name[-8:].lower().replace('-', '_')}"
    open_buffer(url).write_batch([group("old")], "e1", {"batch": 1})
    with pytest.raises(FileExistsError, match="holds experiences of another run"):
        check_buffer(Config(run_dir=str(run_dir), buffer=url))
    check_buffer(Config(run_dir=str(run_dir), buffer=url, mode="train"))
    check_buffer(Config(run_dir=str(run_dir), buffer=url, resume=True))
    assert open_buffer(url).counts()["total"] == 3
    check_buffer(Config(run_dir=str(run_dir), buffer=url, overwrite=True))
    assert open_buffer(url).counts()["total"] == 0 and open_buffer(url).explorer_state("e1") is None


def test_resume_serves_again_what_the_lost_steps_took(buffer_url):
    # --resume at step 1: the groups taken by steps 1 and 2 (lost with the crash) are served again, in
    # their order; the group trained at step 0 is not
    buf = open_buffer(buffer_url)
    buf.write_batch([group(f"g{k}") for k in range(4)])
    assert [g[0].group_id for s in range(3) for g in buf.read(1, timeout_s=5, step=s)] == [
        "g0",
        "g1",
        "g2",
    ]
    assert open_buffer(buffer_url).release_after(1) == 6  # 2 groups x 3 experiences
    assert [g[0].group_id for g in buf.read(3, timeout_s=5, step=1)] == ["g1", "g2", "g3"]
    assert buf.counts() == {"total": 12, "consumed": 12, "pending": 0, "ready": 0}
