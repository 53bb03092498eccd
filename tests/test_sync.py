"""Sync schedule (hand-written tables) and the weight-sync process group."""

import multiprocessing as mp
import time
import types

import pytest
import torch

import components
import engines
import perf
import schedule
import sync
from config import Config
from extras.hosts import StoreAlive
from sync import Checksum, checksum

# explorer batch e -> weight version it must be generated with (Trinity-RFT semantics)
SCHEDULES = {
    (1, 0): [0, 1, 2, 3, 4, 5],  # strict on-policy
    (1, 1): [0, 0, 1, 2, 3, 4],  # one-step off-policy
    (2, 0): [0, 0, 2, 2, 4, 4],
    (2, 1): [0, 0, 0, 2, 2, 4],
    (3, 0): [0, 0, 0, 3, 3, 3],
    (3, 2): [0, 0, 0, 0, 0, 3],
}


@pytest.mark.parametrize("interval,offset", sorted(SCHEDULES))
def test_required_version_table(interval, offset):
    assert [schedule.required_version(e, interval, offset) for e in range(6)] == SCHEDULES[
        (interval, offset)
    ]


def test_published_versions_include_last_step():
    assert [t + 1 for t in range(5) if schedule.publishes_after(t, 2, 5)] == [2, 4, 5]
    assert [t + 1 for t in range(4) if schedule.publishes_after(t, 1, 4)] == [1, 2, 3, 4]
    assert [t + 1 for t in range(6) if schedule.publishes_after(t, 3, 6)] == [3, 6]


def receiver(port, q):
    ws = sync.WeightSync(None, port=port, timeout_s=60).connect()
    params = [torch.zeros(3, 2), torch.zeros(4), torch.zeros(2, dtype=torch.int64)]
    for _ in range(2):
        version = ws.recv(params)
        q.put((version, [p.tolist() for p in params]))


def test_weight_sync_broadcast_two_processes():
    ws = sync.WeightSync(0, 2, port=0, timeout_s=60)
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=receiver, args=(ws.port, q))
    proc.start()
    ws.connect(proc.is_alive)
    for version in (2, 4):
        params = [torch.randn(3, 2), torch.randn(4), torch.tensor([version, -version])]
        ws.send(version, [params], proc.is_alive)
        got_version, got = q.get(timeout=60)
        assert got_version == version
        assert got == [p.tolist() for p in params]
    ws.wait(proc.is_alive)
    proc.join(60)
    assert proc.exitcode == 0


def test_connect_fails_fast_when_peer_is_dead():
    ws = sync.WeightSync(0, 2, port=0, timeout_s=60)
    with pytest.raises(RuntimeError, match="died before joining"):
        ws.connect(lambda: False)


def test_a_receiver_stops_waiting_when_the_trainer_died_before_its_store_was_reached():
    # the trainer was killed before the explorer joined: nothing listens on the port any more
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(
        RuntimeError, match="died before joining"
    ):  # its joining thread, left behind, gives up
        sync.WeightSync(None, port=port, timeout_s=2).connect(
            lambda: False
        )  # soon: not as the test process exits


def leaving_receiver(host, port, q):
    ws = sync.WeightSync(None, port=port, host=host, timeout_s=60).connect()
    params = [torch.zeros(4)]
    q.put((ws.rank, ws.recv(params), params[0].tolist()))
    ws.leave()


def test_receivers_take_ranks_from_the_store_and_leave():
    # explorers started separately need only the address: each takes the next free rank; one too many is
    # refused; the trainer waits until all have left before its store goes
    from test_modes import host_address

    host = host_address()
    ws = sync.WeightSync(0, 3, port=0, host=host, timeout_s=60)
    q = mp.get_context("spawn").Queue()
    procs = [
        mp.get_context("spawn").Process(target=leaving_receiver, args=(host, ws.port, q))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    ws.connect(lambda: all(p.is_alive() for p in procs))
    ws.send(3, [[torch.arange(4.0)]])
    got = sorted(q.get(timeout=60) for _ in procs)
    assert got == [(1, 3, [0.0, 1.0, 2.0, 3.0]), (2, 3, [0.0, 1.0, 2.0, 3.0])]
    assert ws.wait_left(60)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with pytest.raises(RuntimeError, match="expects 2 explorer"):
        sync.WeightSync(None, port=ws.port, host=host, timeout_s=30).connect()


def test_bucket_ranges_cut_both_ends_the_same_way():
    assert sync.bucket_ranges([4, 4, 4, 4], 8) == [range(0, 2), range(2, 4)]
    assert sync.bucket_ranges([3, 10, 2, 2, 5], 6) == [
        range(0, 1),
        range(1, 2),
        range(2, 4),
        range(4, 5),
    ]
    assert sync.bucket_ranges([3, 10, 2], 0) == [range(0, 3)]  # unbucketed: one for all


def bucket_receiver(port, dtype, q):
    ws = sync.WeightSync(None, port=port, timeout_s=60, wire_dtype=dtype).connect()
    params = [
        torch.zeros(3, 5, dtype=dtype),
        torch.zeros(40, dtype=dtype),
        torch.zeros(2, 2, dtype=dtype),
    ]
    version = ws.recv(params)
    q.put((version, ws.bucket_elems, [p.float().tolist() for p in params], checksum(params)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "bucket_elems,dtype", [(0, torch.float32), (16, torch.float32), (16, torch.bfloat16)]
)
def test_bucketed_sync_equals_unbucketed_and_holds_one_bucket(bucket_elems, dtype):
    # gloo, two processes: the receiver gets the same tensors whatever the bucket size, cast on the
    # wire to the dtype it declared; the sender builds a bucket only after the previous one was taken
    ws = sync.WeightSync(0, 2, port=0, timeout_s=60, bucket_elems=bucket_elems, checksum=True)
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=bucket_receiver, args=(ws.port, dtype, q))
    proc.start()
    ws.connect(proc.is_alive)
    assert ws.wire_dtype == dtype
    torch.manual_seed(0)
    params = [torch.randn(3, 5), torch.randn(40), torch.randn(2, 2)]
    built = []

    def buckets():  # lazily, as the trainer gathers them
        for r in sync.bucket_ranges([p.numel() for p in params], bucket_elems):
            built.append(len(ws._pending))  # publishes in flight when this bucket is built
            yield [params[i] for i in r]

    digest = ws.send(9, buckets(), proc.is_alive)
    version, got_elems, got, received_digest = q.get(timeout=60)
    ws.wait(proc.is_alive)
    proc.join(60)
    assert version == 9 and got_elems == bucket_elems
    assert got == [p.to(dtype).float().tolist() for p in params]
    assert digest == pytest.approx(received_digest, rel=1e-12)
    if (
        bucket_elems
    ):  # 15 | 40 | 4 elements: three buckets; the 2nd and 3rd are built with nothing in flight
        assert built == [1, 0, 0]


def test_the_idle_side_lends_its_threads_to_the_busy_one():
    flags = mp.get_context("spawn").Array("i", 2)
    trainer, explorer = perf.CoreShare(flags, 0, 1, 1), perf.CoreShare(flags, 1, 1, 1)
    before = torch.get_num_threads()
    try:
        explorer.busy(True)
        assert (
            trainer.apply() == 1 and torch.get_num_threads() == 1
        )  # the explorer generates: one each
        trainer.busy(True)
        assert explorer.apply() == 1
        explorer.busy(False)  # the explorer waits for weights
        assert trainer.apply() == 2 and torch.get_num_threads() == 2
        trainer.busy(False)  # the trainer waits for a batch
        explorer.busy(True)
        assert explorer.apply() == 2
    finally:
        torch.set_num_threads(before)


def test_a_publish_lends_the_trainers_threads_to_the_explorer_while_it_waits():
    # a publish waits until the explorer receives, after the evaluation it may still run: the
    # trainer's idle threads go to that evaluation
    flags = mp.get_context("spawn").Array("i", 2)
    trainer, explorer = perf.CoreShare(flags, 0, 1, 1), perf.CoreShare(flags, 1, 1, 1)
    seen = []
    before = torch.get_num_threads()
    try:
        trainer.busy(True)
        explorer.busy(True)  # evaluating
        send = perf.lending(lambda version, buckets: seen.append(explorer.apply()), trainer)
        send(2, [])
        assert seen == [2] and flags[0] == 1 and explorer.apply() == 1
    finally:
        torch.set_num_threads(before)


def dtype_receiver(port, dtype, q):
    ws = sync.WeightSync(None, port=port, timeout_s=60, wire_dtype=dtype).connect()
    params = [torch.zeros(3, 5, dtype=dtype), torch.zeros(7, dtype=dtype)]
    ws.recv(params)
    q.put((str(dtype), ws.wire_dtype, [p.float().tolist() for p in params]))


def test_receivers_holding_different_dtypes_take_the_wire_dtype_rank_0_announces():
    # a bf16 engine and a float32 engine in one group: the wire carries float32, and both allocate their receive
    # buffers in it (each allocating its own dtype made the broadcasts' sizes differ)
    ws = sync.WeightSync(0, 3, port=0, timeout_s=60)
    q = mp.get_context("spawn").Queue()
    procs = [
        mp.get_context("spawn").Process(target=dtype_receiver, args=(ws.port, d, q))
        for d in (torch.bfloat16, torch.float32)
    ]
    for p in procs:
        p.start()
    try:
        ws.connect(lambda: all(p.is_alive() for p in procs))
        assert ws.wire_dtype == torch.float32
        torch.manual_seed(0)
        params = [torch.randn(3, 5), torch.randn(7)]
        ws.send(1, [params])
        got = dict((d, (wire, values)) for d, wire, values in (q.get(timeout=60) for _ in procs))
        ws.wait()
        for dtype in (torch.bfloat16, torch.float32):
            assert got[str(dtype)] == (
                torch.float32,
                [p.to(dtype).float().tolist() for p in params],
            )
    finally:
        for p in procs:
            p.kill()


def test_the_backend_is_nccl_only_when_every_rank_has_a_gpu_of_its_own():
    # NCCL refuses two ranks of one group on one GPU ("Duplicate GPU detected"): an explorer of another launch on
    # trainer rank 0's GPU gets host staging over gloo instead
    assert sync.group_backend(["GPU-a", "GPU-b", "GPU-c"]) == "nccl"
    assert sync.group_backend(["GPU-a", "GPU-b", "GPU-a"]) == "gloo"
    assert sync.group_backend(["", ""]) == "gloo"  # CPU ranks


def test_a_checksum_holds_no_float64_copy_of_a_whole_tensor(monkeypatch):
    # a float64 sum casts its input first (also sum(dtype=torch.float64)): of a whole embedding, GiBs of GPU memory
    monkeypatch.setattr("sync.CHECKSUM_CHUNK", 2**16)
    t = torch.full((2**20,), 0.5)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        digest = checksum([t, torch.ones(3, dtype=torch.bfloat16), torch.arange(4)])
    stream = torch.cat([t.double(), torch.ones(3, dtype=torch.float64), torch.arange(4.0)])
    k = torch.arange(len(stream), dtype=torch.float64)
    assert digest == pytest.approx(float((stream * (1 + torch.frac(k * 0.6180339887498949))).sum()))
    assert max(e.cpu_memory_usage for e in prof.events()) <= 8 * 2**16


def test_without_sync_checksum_neither_end_sums_the_weights(tiny_model, monkeypatch):
    # --sync-checksum off (the default): no extra pass over the weights on either end, no checksum in the receipt
    import threading

    import loop
    import run
    from engines import make_engine

    def no_checksum(digest, tensors):
        raise AssertionError("a checksum was computed without --sync-checksum")

    monkeypatch.setattr(Checksum, "add", no_checksum)
    cfg = run.parse_config(
        [
            "--config",
            "configs/tiny.toml",
            "--engine",
            "hf",
            "--sync-method",
            "broadcast",
            "--sync-bucket-mb",
            "0",
            "--explorer-threads",
            str(torch.get_num_threads()),
        ]
    )
    engine = make_engine(cfg, tiny_model, 0)
    ws = loop.weight_group(cfg, types.SimpleNamespace(sync_device="cpu"), 1)  # the trainer's end
    joiner = threading.Thread(target=ws.connect)
    joiner.start()
    records = []
    receiver = sync.Receiver(engine, cfg, records.append, lambda: True, ws.port)
    receiver.join()
    joiner.join()
    assert ws.send(2, [[p.detach() + 1 for p in engine.parameters()]]) is None
    receiver.receive()
    ws.wait()
    assert engine.version == 2 and [set(r) for r in records] == [
        {"explorer/received_version", "time/explorer_wait_sync_s"}
    ]


@pytest.fixture
def trainer_store():
    """A trainer rank 0's weight-sync store (sync.WeightSync rank 0) in a process of its own: (port, process)."""
    import subprocess
    import sys

    from conftest import ROOT

    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import sync; "
        "ws = sync.WeightSync(0, 2, port=0); print(ws.port, flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(ROOT)], stdout=subprocess.PIPE, text=True
    )
    try:
        yield int(proc.stdout.readline()), proc
    finally:
        proc.kill()
        proc.wait()


def gone_within(alive, seconds: float) -> bool:
    """Whether `alive()` turns False within `seconds`."""
    deadline = time.monotonic() + seconds
    while alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.slow
def test_a_trainer_is_alive_while_its_store_answers(trainer_store):
    port, proc = trainer_store
    alive = StoreAlive("127.0.0.1", port, 30)
    assert alive() and alive()
    proc.kill()
    proc.wait()
    assert gone_within(alive, 2)
    with pytest.raises(RuntimeError, match=f"no trainer answered at 127.0.0.1:{port} within 1 s"):
        StoreAlive("127.0.0.1", port, 1)


def test_mode_explore_watches_the_trainer_of_the_other_launch(trainer_store, tmp_path, monkeypatch):
    # --mode explore --sync-method broadcast: the trainer is no parent of the explorer. What its receiver (and its
    # engine's receives, NCCL ones included) watches is the trainer's store, not a constant
    import run
    from extras import explore_mode

    port, proc = trainer_store
    cfg = run.parse_config(
        [
            "--config",
            "configs/tiny.toml",
            "--mode",
            "explore",
            "--sync-method",
            "broadcast",
            "--sync-port",
            str(port),
            "--run-dir",
            str(tmp_path),
        ]
    )

    class Engine:
        version = 0

        def join_weight_sync(self, host, port, timeout_s, alive, device="cpu", transport=None):
            self.alive = alive

        def weights_announced(self):
            return -1

        def weights_joined(self):
            return False

        def close(self):
            pass

    receivers = []

    def explorer_loop(cfg, explorer, buffer, pace, *rest):
        receivers.append(pace.receiver)

    explore_mode.run_mode_explore(
        cfg,
        run.Prepared("model", ([], [], None), None),
        explorer_loop,
        lambda *a: Engine(),
        lambda *a: None,
        components.receiver,
        lambda cfg: types.SimpleNamespace(close=lambda: None),
    )
    (receiver,) = receivers
    assert receiver.engine.alive is receiver.alive and receiver.alive()
    proc.kill()
    proc.wait()
    assert gone_within(receiver.alive, 2)


class AnnouncingEngine(engines.Engine):
    """An engine that joined the weight-sync store of a trainer (a WeightSync of rank 0) and waits for its
    announcements as engines do; records its receives."""

    def __init__(self, port: int):
        super().__init__()
        self.weights = sync.WeightSync(None, port=port, timeout_s=60)
        self.weights._join()
        self.received = []

    def receive_weights(self, alive):
        self.version = int(self.weights.store.get("published"))
        self.weights.publishes += 1
        self.received.append(self.version)
        return self.version, None


def test_a_receive_is_posted_only_once_its_publish_is_announced(tmp_path):
    # mode both: an NCCL receive posted while the trainer still trains counts against the group's timeout (its
    # watchdog then kills the explorer); the receiver blocks on the store until the announcement, watching the
    # trainer meanwhile
    import threading

    trainer = sync.WeightSync(0, 2, port=0, timeout_s=60)
    engine = AnnouncingEngine(trainer.port)
    state = {"alive": True}
    cfg = Config(run_dir=str(tmp_path), explorer_name="e")
    receiver = sync.Receiver(engine, cfg, lambda record: None, lambda: state["alive"], port=1)
    waiting = threading.Thread(target=receiver.until, args=(2,))
    waiting.start()
    waiting.join(0.3)
    assert engine.received == [] and waiting.is_alive()
    trainer.announce(2)
    waiting.join(30)
    assert engine.received == [2] and not waiting.is_alive()
    trainer.announce(3)  # announced before the explorer asks: no wait
    receiver.until(3)
    assert engine.received == [2, 3]
    state["alive"] = False
    with pytest.raises(
        RuntimeError, match=r"^weight sync: the trainer died \(waiting for next publish\)$"
    ):
        receiver.until(4)
    assert engine.received == [2, 3]


class CheckpointEngine:
    """An engine that records which checkpoint versions it loads."""

    def __init__(self):
        self.version = 0
        self.loaded = []

    def load_checkpoint(self, directory, version):
        self.version = version
        self.loaded.append(version)


def test_checkpoint_sync_loads_the_version_the_schedule_asks_not_a_newer_one(tmp_path):
    # the trainer may have written versions 1 and 2 before a lagging explorer asks for 1: the
    # batch must be generated with 1 (and recorded so), as a broadcast would deliver it
    from extras import checkpoint_sync

    def save(d):
        d.mkdir()

    for v in (1, 2):
        checkpoint_sync.publish_checkpoint(tmp_path, v, save)
    engine = CheckpointEngine()
    cfg = Config(run_dir=str(tmp_path), explorer_name="e")
    source = checkpoint_sync.CheckpointSource(cfg.run_dir, cfg.explorer_name, engine)
    receiver = sync.Receiver(engine, cfg, lambda record: None, lambda: True, source=source)
    receiver.until(1)
    assert engine.loaded == [1]
    receiver.receive()  # an in-flight update takes the newest
    assert engine.loaded == [1, 2]
    # a version the explorer still needs that retention deleted: one clear error, not a newer one
    checkpoint_sync.publish_checkpoint(tmp_path, 4, save)
    (tmp_path / "checkpoints" / "v000002").rename(tmp_path / "checkpoints" / "gone")
    engine.version = 1
    with pytest.raises(RuntimeError, match="version 2 was deleted before it was loaded"):
        receiver.until(2)


@pytest.mark.parametrize("interval", [1, 2, 3])
@pytest.mark.parametrize("offset", [0, 1, 2, 5, 9])
def test_checkpoint_retention_keeps_every_version_the_schedule_may_still_ask_for(
    tmp_path, interval, offset
):
    # when the trainer publishes after step t, batches t + 1 onwards are still to be generated:
    # the version the oldest of them needs must still be there (a sync_offset of 5 needs 6)
    from extras import checkpoint_sync

    def save(d):
        d.mkdir()

    keep = checkpoint_sync.kept_versions(interval, offset)
    steps = 30
    for t in range(steps):
        if not schedule.publishes_after(t, interval, steps):
            continue
        checkpoint_sync.publish_checkpoint(tmp_path, t + 1, save, keep)
        needed = schedule.required_version(t + 1, interval, offset)
        if needed > 0:  # version 0: the explorer's start weights, never a checkpoint
            assert (tmp_path / "checkpoints" / f"v{needed:06d}").is_dir(), (t, needed, keep)


def test_the_checksum_sees_two_swapped_tensors_and_any_split_of_the_stream():
    # a plain sum of all weights gave two swapped tensors of one shape the same digest
    torch.manual_seed(0)
    a, b, c = torch.randn(3, 5), torch.randn(3, 5), torch.randn(7)
    digest = checksum([a, b, c])
    assert checksum([b, a, c]) != pytest.approx(digest, rel=1e-9)
    assert checksum([a, b.flip(0), c]) != pytest.approx(digest, rel=1e-9)
    # the sender sums flattened buckets, the receiver its parameters: the same digest
    flat = torch.cat([a.reshape(-1), b.reshape(-1), c])
    streamed = Checksum().add([flat[:9]]).add([flat[9:22], flat[22:]]).value
    assert streamed == pytest.approx(digest, rel=1e-12)


def test_a_peer_found_dead_is_reported_dead_even_when_the_wait_ended_first(monkeypatch):
    # past its deadline the store's wait ends at once, possibly before the waiting side looks at its peer
    # (a loaded machine): the error still says the peer died, not that the timeout passed
    import threading

    class AtOnce(threading.Thread):
        def start(self):  # the wait has ended before anyone asks whether it runs
            self.run()

    ws = sync.WeightSync(0, 2, port=0, timeout_s=60)
    monkeypatch.setattr(threading, "Thread", AtOnce)
    died = r"^weight sync: an explorer died \(waiting for acknowledgement\)$"
    with pytest.raises(RuntimeError, match=died):
        ws.wait_for(["never set"], lambda: False, "acknowledgement", time.monotonic() - 1)
