"""--sync-method ipc (ipc_sync.py): the protocol in two real processes (shared memory on the CPU, CUDA IPC on
a GPU), its failures as one line within the timeout, where auto picks it, and mode both end to end."""

import contextlib
import multiprocessing as mp
import os
import threading
import time
import types

import pytest
import torch

import components
import launch
import sync
from conftest import run_py
from ipc_sync import IpcSync
from sync import checksum

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)"
)
SHAPES = [(3, 5), (40,), (2, 2)]  # 15 | 40 | 4 elements: three buckets of at most 16
SPAWN = mp.get_context("spawn")


@pytest.fixture(autouse=True)
def sharing_strategy():
    """A CPU publish sets torch's sharing strategy for the process: back to what it was for the tests after."""
    import torch.multiprocessing

    before = torch.multiprocessing.get_sharing_strategy()
    yield
    torch.multiprocessing.set_sharing_strategy(before)


@contextlib.contextmanager
def spawned(target, *args):
    """A process running target(*args) (spawned), killed on the way out."""
    proc = SPAWN.Process(target=target, args=args)
    proc.start()
    try:
        yield proc
    finally:
        proc.kill()


def receiver(port, publishes, device, dtype, go, q):
    """Join, then take each of `publishes` publishes once `go` allows it."""
    ws = IpcSync(None, port=port, timeout_s=60, wire_dtype=dtype).connect()
    params = [torch.zeros(s, dtype=dtype, device=device) for s in SHAPES]
    for _ in range(publishes):
        assert go.acquire(timeout=60)  # the sender says when to take its publish
        version = ws.recv(params)
        q.put((version, [p.float().tolist() for p in params], checksum(params), ws.mapped[0]))


@pytest.mark.parametrize(
    "device,dtype",
    [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=needs_cuda)],
    ids=["cpu", "cuda"],
)
def test_publishes_arrive_equal_through_one_mapping_and_wait_for_their_acknowledgement(
    device, dtype
):
    # publishes gathered in buckets of at most 16 elements, each written into the staging tensor, cast to the dtype
    # the receiver declared; the receiver maps staging once, and a publish is not written before the receiver
    # has copied and acknowledged the one before
    go, q = SPAWN.Semaphore(0), SPAWN.Queue()
    ws = IpcSync(0, 2, port=0, timeout_s=60, bucket_elems=16, checksum=True)
    with spawned(receiver, ws.port, 3, device, dtype, go, q) as proc:
        ws.connect(proc.is_alive)
        assert ws.wire_dtype == dtype
        torch.manual_seed(0)
        params = [torch.randn(s, device=device) for s in SHAPES]
        gathered = []

        def buckets(scale):  # lazily, as the trainer gathers them
            for r in sync.bucket_ranges([p.numel() for p in params], 16):
                gathered.append(r)
                yield [params[i] * scale for i in r]

        # returns at once: the receiver waits for `go`
        digests = [ws.send(3, buckets(1), proc.is_alive)]
        # staging grew from the first bucket (15, then 55 and 110 elements) and is handed out at its size, once
        assert len(gathered) == 3 and ws.stagings == 1 and ws.staging.numel() == 59 and q.empty()
        second = threading.Thread(
            target=lambda: digests.append(ws.send(4, buckets(2), proc.is_alive))
        )
        second.start()
        second.join(0.5)
        # staging still holds version 3, not acknowledged: nothing of version 4 gathered yet
        assert second.is_alive() and len(gathered) == 3
        go.release()
        second.join(60)
        assert not second.is_alive() and len(gathered) == 6
        go.release()
        digests.append(ws.send(5, buckets(3), proc.is_alive))
        go.release()
        ws.wait(proc.is_alive)
        for scale, digest in zip((1, 2, 3), digests):
            version, got, received, mapped = q.get(timeout=60)
            assert version == scale + 2
            assert got == [(p * scale).to(dtype).float().tolist() for p in params]
            assert received == pytest.approx(digest, rel=1e-12)
            assert mapped == ws.stagings == 1  # the one staging tensor of every publish
        proc.join(60)
        assert proc.exitcode == 0


def idle_receiver(ports, q):
    q.put("ready")
    IpcSync(None, port=ports.get(timeout=60), timeout_s=60).connect()
    time.sleep(120)  # joined, never takes a bucket


def test_a_publish_nobody_takes_is_one_error_line_within_the_timeout_or_once_the_explorer_died():
    ports, q = SPAWN.Queue(), SPAWN.Queue()
    with spawned(idle_receiver, ports, q) as proc:
        assert q.get(timeout=60) == "ready"
        ws = IpcSync(0, 2, port=0, timeout_s=3)
        ports.put(ws.port)
        ws.connect(proc.is_alive)
        ws.send(1, [[torch.ones(4)]])
        t0 = time.monotonic()
        with pytest.raises(
            RuntimeError,
            match=r"^weight sync: no acknowledgement of publish 1 within "
            r"--sync-timeout-s 3 s$",
        ):
            ws.wait(proc.is_alive)
        assert 2.5 < time.monotonic() - t0 < 10
        proc.kill()
        proc.join(30)
        with pytest.raises(
            RuntimeError,
            match=r"^weight sync: an explorer died \(waiting for acknowledgement of "
            r"publish 1\)$",
        ):
            ws.wait(proc.is_alive)


def short_lived_trainer(ports, die):
    ws = IpcSync(0, 2, port=0, timeout_s=60)
    ports.put(ws.port)
    ws.connect()
    die.wait(60)
    os._exit(0)


def test_a_receiver_stops_waiting_once_the_trainer_died():
    ports, die = SPAWN.Queue(), SPAWN.Event()
    with spawned(short_lived_trainer, ports, die) as proc:
        ws = IpcSync(None, port=ports.get(timeout=60), timeout_s=60).connect(proc.is_alive)
        die.set()
        proc.join(30)
        t0 = time.monotonic()
        gone = r"^weight sync: the trainer('s store at \S+ stopped answering| died)"
        with pytest.raises(RuntimeError, match=gone):
            ws.recv([torch.zeros(4)], proc.is_alive)
        assert time.monotonic() - t0 < 5


@pytest.mark.parametrize(
    "conf",
    ["backend:cudaMallocAsync", "expandable_segments:True", "garbage_collection_threshold:0.6"],
)
def test_auto_takes_ipc_only_where_the_cuda_allocator_can_hand_out_handles(monkeypatch, conf):
    # cudaMallocAsync's pools export no CUDA IPC handle and expandable segments' need pidfd_getfd: broadcast then
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    layout = launch.place(1, 1, "both")
    allowed = conf.startswith("garbage")
    auto = types.SimpleNamespace(mode="both", engine="hf", sync_method="auto")
    assert components.sync_method(auto, layout) == ("ipc" if allowed else "broadcast")
    ipc = types.SimpleNamespace(mode="both", engine="hf", sync_method="ipc")
    if allowed:
        assert components.sync_method(ipc, layout) == "ipc"
    else:  # asked for by name: one line
        with pytest.raises(ValueError, match=r"^--sync-method ipc needs CUDA IPC handles"):
            components.sync_method(ipc, layout)


@pytest.mark.parametrize(
    "gpus,ranks,mode,engine,method,expected",
    [
        (0, 1, "both", "hf", "auto", "broadcast"),  # CPU: gloo, as before
        (
            1,
            1,
            "both",
            "hf",
            "auto",
            "ipc",
        ),  # one GPU, colocated: a broadcast would go through the host
        (8, 8, "both", "hf", "auto", "ipc"),  # the explorer beside rank 0 on cuda:0
        (1, 1, "both", "vllm", "auto", "broadcast"),  # vLLM's worker receives by broadcast only
        (2, 1, "both", "hf", "auto", "broadcast"),  # a GPU of its own: NCCL
        (0, 2, "both", "hf", "ipc", "ipc"),  # CPU: shared memory
        (1, 1, "both", "hf", "ipc", "ipc"),
        (2, 1, "both", "hf", "ipc", ValueError),  # another GPU than rank 0's
        (1, 1, "both", "vllm", "ipc", ValueError),
        (0, 1, "train", "hf", "ipc", ValueError),  # no explorer in this launch
        (1, 1, "both", "hf", "checkpoint", "checkpoint"),
    ],
)
def test_ipc_only_where_the_explorer_shares_rank_0s_device(
    gpus, ranks, mode, engine, method, expected, monkeypatch
):
    for name in (
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
    ):  # settings that rule CUDA IPC out
        monkeypatch.delenv(name, raising=False)
    cfg = types.SimpleNamespace(mode=mode, engine=engine, sync_method=method)
    layout = launch.place(gpus, ranks, mode)
    if expected is ValueError:
        with pytest.raises(
            ValueError,
            match=r"^--sync-method ipc hands the weights to an hf engine on trainer rank "
            r"0's device",
        ):
            components.sync_method(cfg, layout)
    else:
        assert components.sync_method(cfg, layout) == expected


def run_ipc(tiny_model, out, *extra):
    from test_lora import checksums

    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        out,
        "--sync-method",
        "ipc",
        "--sync-checksum",
        "--eval-size",
        0,
        "--reward-fn",
        "tests.rewards.length_parity",
        *extra,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "weight sync ipc" in res.stdout
    sent, got = checksums(out)
    assert set(sent) == set(got) == {1, 2, 3}
    assert all(got[v] == pytest.approx(sent[v], rel=1e-9) for v in sent)


@pytest.mark.slow
def test_mode_both_syncs_by_handle_with_equal_checksums(tiny_model, tmp_path):
    # trainer and explorer on the CPU: the weights in buckets of 0.05 MiB through shared memory, every version
    run_ipc(tiny_model, tmp_path / "run", "--sync-bucket-mb", 0.05)


@pytest.mark.slow
def test_mode_both_syncs_lora_adapters_by_handle_with_equal_checksums(tiny_model, tmp_path):
    run_ipc(tiny_model, tmp_path / "run", "--lora-rank", 4, "--sync-bucket-mb", 0.005)


def test_a_publish_is_written_into_the_staging_tensor_without_a_second_copy():
    # the cast of each tensor goes straight into staging: no temporaries of the publish's size beside it
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class NewMemory(TorchDispatchMode):  # bytes of the new storages the ops inside allocate
        bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {
                t.untyped_storage().data_ptr()
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)
            }
            self.bytes += sum(
                t.untyped_storage().nbytes()
                for t in tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given
            )
            return out

    ws = IpcSync(0, 2, port=0, timeout_s=5, bucket_elems=0, wire_dtype=torch.bfloat16)
    tensors = [torch.randn(300, 40), torch.randn(500)]
    with NewMemory() as new:
        ws.send(0, [tensors])  # no --sync-checksum
    assert new.bytes == ws.staging.untyped_storage().nbytes() == 12_500 * 2
    assert torch.equal(ws.staging, torch.cat([t.reshape(-1) for t in tensors]).bfloat16())
    # acknowledged as a receiver of rank 1 does: the next publish is written into the same staging tensor
    ws.store.set("ipc_ack/1/1", "1")
    doubled = [t * 2 for t in tensors]
    with NewMemory() as new:
        ws.send(1, [doubled])
    assert new.bytes == 0 and ws.stagings == 1
    assert torch.equal(ws.staging, torch.cat([t.reshape(-1) for t in doubled]).bfloat16())
