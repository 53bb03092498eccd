"""The SQLite buffer shared by a writer process and a reader process."""
import multiprocessing as mp
import time

import pytest

from buffer import Buffer, Experience


def group(gid: str, n: int = 3, reward=1.0, version=0) -> list[Experience]:
    return [Experience([1, 2, 3, 4 + i], 2, [-0.5, -0.25], [1, 1], reward, gid, f"task-{gid}", version,
                       {"i": i}) for i in range(n)]


def writer(path, n_groups):
    buf = Buffer(path)
    buf.write(group("pending", reward=None))  # never complete: must never be served
    for k in range(n_groups):
        buf.write(group(f"g{k}", version=k))
        time.sleep(0.01)


def test_two_processes_fifo_complete_groups_once(tmp_path):
    path = tmp_path / "buffer.sqlite"
    Buffer(path)  # create the schema before both processes open it
    proc = mp.get_context("spawn").Process(target=writer, args=(path, 20))
    proc.start()
    reader = Buffer(path)
    served = []
    for _ in range(5):
        served += reader.read(4, timeout_s=60)
    proc.join()
    assert proc.exitcode == 0
    assert [g[0].group_id for g in served] == [f"g{k}" for k in range(20)]
    assert all(len(g) == 3 and g[0].model_version == int(g[0].group_id[1:]) for g in served)
    first = served[0][1]
    assert (first.tokens, first.prompt_length, first.logprobs, first.action_mask, first.info) == \
        ([1, 2, 3, 5], 2, [-0.5, -0.25], [1, 1], {"i": 1})
    assert reader.counts() == {"total": 63, "consumed": 60, "pending": 3, "ready": 0}
    with pytest.raises(TimeoutError):
        reader.read(1, timeout_s=0.2)  # only the pending group is left


def test_reader_does_not_hang_on_dead_writer(tmp_path):
    buf = Buffer(tmp_path / "b.sqlite")
    with pytest.raises(RuntimeError, match="writer stopped"):
        buf.read(1, alive=lambda: False)


def test_experience_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 logprobs"):
        Experience([1, 2, 3], 2, [-0.1, -0.2], [1], 1.0, "g", "t", 0)


def test_task_pools_persist_and_reactivate(tmp_path):
    buf = Buffer(tmp_path / "b.sqlite")
    assert buf.update_pool("t1", 1.0, easy=0.9, hard=0.1) == "easy"
    assert buf.update_pool("t2", 0.0, easy=0.9, hard=0.1) == "hard"
    assert buf.update_pool("t3", 0.5, easy=0.9, hard=0.1) is None
    assert Buffer(tmp_path / "b.sqlite").retired() == {"t1": "easy", "t2": "hard"}  # persisted
    assert buf.update_pool("t1", 0.5, easy=0.9, hard=0.1) is None  # a lifted task that is no longer easy
    assert buf.retired() == {"t2": "hard"}


def test_offline_sampler_cycles_all_and_marks_expert():
    from workflows import OfflineSampler

    groups = [[Experience([1, 2, i], 2, [0.0], [1], 1.0, f"g{i}", f"t{i}", 0)] for i in range(3)]
    s = OfflineSampler(groups, seed=0)
    drawn = [g[0] for g in s.draw(3) + s.draw(3)]
    assert sorted(e.tokens[-1] for e in drawn[:3]) == [0, 1, 2] == sorted(e.tokens[-1] for e in drawn[3:])
    assert all(e.info["offline"] for e in drawn) and not groups[0][0].info
    with pytest.raises(ValueError, match="empty"):
        OfflineSampler([], 0)
