"""Sync schedule (hand-written tables) and the weight-sync process group."""
import multiprocessing as mp

import pytest
import torch

import sync

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
    assert [sync.required_version(e, interval, offset) for e in range(6)] == SCHEDULES[(interval, offset)]


def test_published_versions_include_last_step():
    assert sync.published_versions(5, 2) == [2, 4, 5]
    assert sync.published_versions(4, 1) == [1, 2, 3, 4]
    assert sync.published_versions(6, 3) == [3, 6]


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
    with pytest.raises(RuntimeError, match="died before joining"):
        sync.WeightSync(None, port=port, timeout_s=30).connect(lambda: False)


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
    procs = [mp.get_context("spawn").Process(target=leaving_receiver, args=(host, ws.port, q)) for _ in range(2)]
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
    assert sync.bucket_ranges([3, 10, 2, 2, 5], 6) == [range(0, 1), range(1, 2), range(2, 4), range(4, 5)]
    assert sync.bucket_ranges([3, 10, 2], 0) == [range(0, 3)]  # unbucketed: one for all


def bucket_receiver(port, dtype, q):
    ws = sync.WeightSync(None, port=port, timeout_s=60, wire_dtype=dtype).connect()
    params = [torch.zeros(3, 5, dtype=dtype), torch.zeros(40, dtype=dtype), torch.zeros(2, 2, dtype=dtype)]
    version = ws.recv(params)
    q.put((version, ws.bucket_elems, [p.float().tolist() for p in params], sync.checksum(params)))


@pytest.mark.parametrize("bucket_elems,dtype", [(0, torch.float32), (16, torch.float32), (16, torch.bfloat16)])
def test_bucketed_sync_equals_unbucketed_and_holds_one_bucket(bucket_elems, dtype):
    # gloo, two processes: the receiver gets the same tensors whatever the bucket size, cast on the
    # wire to the dtype it declared; the sender builds a bucket only after the previous one was taken
    ws = sync.WeightSync(0, 2, port=0, timeout_s=60, bucket_elems=bucket_elems)
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
    if bucket_elems:  # 15 | 40 | 4 elements: three buckets; the 2nd and 3rd are built with nothing in flight
        assert built == [1, 0, 0]


def test_the_idle_side_lends_its_threads_to_the_busy_one():
    flags = mp.get_context("spawn").Array("i", 2)
    trainer, explorer = sync.CoreShare(flags, 0, 1, 1), sync.CoreShare(flags, 1, 1, 1)
    before = torch.get_num_threads()
    try:
        explorer.busy(True)
        assert trainer.apply() == 1 and torch.get_num_threads() == 1   # the explorer generates: one each
        trainer.busy(True)
        assert explorer.apply() == 1
        explorer.busy(False)                                             # the explorer waits for weights
        assert trainer.apply() == 2 and torch.get_num_threads() == 2
        trainer.busy(False)                                              # the trainer waits for a batch
        explorer.busy(True)
        assert explorer.apply() == 2
    finally:
        torch.set_num_threads(before)
