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
