"""Several hosts for real: network namespaces on one machine (benchmarks/hosts.py), a
two-node torchrun trainer, explorers and PostgreSQL each on a host of its own, links cut,
a trainer node killed and the buffer's server restarted mid-run; and the product's parts
that a multi-host run needs (the address gloo binds, the line a lost peer gives).

The namespace tests need root and iproute2 (CI runs as root); without them they skip with
the reason. The slow-link fault uses netem where the kernel has it, else a token bucket."""

import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import hosts  # noqa: E402

from extras.postgres import open_buffer


def need_namespaces():
    """Skip with the reason where network namespaces cannot be made; fail instead with
    NANORFT_REQUIRE_NETNS=1 (CI, as root)."""
    if (why := hosts.unavailable()) is not None:
        if os.environ.get("NANORFT_REQUIRE_NETNS") == "1":
            pytest.fail(why)
        pytest.skip(why)


def test_gloo_binds_the_interface_on_the_route_to_the_master(monkeypatch):
    # the FSDP group's gloo sockets bound the hostname's address (127.0.0.1 here, 127.0.1.1 on Debian), where a
    # second node cannot reach them: its rendezvous failed with "connectFullMesh ... remote=[127.0.0.1]"
    from test_modes import host_address

    import launch
    from launch import interface_of

    monkeypatch.setenv(
        "GLOO_SOCKET_IFNAME", ""
    )  # (recorded, so that what gloo_interface sets is undone after)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert (
        launch.gloo_interface() is None and "GLOO_SOCKET_IFNAME" not in os.environ
    )  # one machine: as before
    assert interface_of("127.0.0.1") == "lo" and interface_of("192.0.2.77") is None
    addr = host_address()
    if addr == "127.0.0.1":
        pytest.skip("this machine has no network address besides loopback")
    monkeypatch.setenv("MASTER_ADDR", addr)
    name = launch.gloo_interface()
    assert name and os.environ["GLOO_SOCKET_IFNAME"] == name and interface_of(addr) == name
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "given")
    assert (
        launch.gloo_interface() is None and os.environ["GLOO_SOCKET_IFNAME"] == "given"
    )  # the user's choice stays


def test_an_explorer_whose_trainer_vanished_says_so_in_one_line():
    # the explorer's last line was "Broken pipe": its goodbye to the dead trainer's store (leave, in a finally)
    # replaced the error that had ended it, itself a bare DistNetworkError from the store
    import torch.distributed as dist

    import sync

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    receiver = sync.WeightSync(None, port=master.port)
    receiver.store = dist.TCPStore(
        "127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10)
    )
    master.set("published", "3")
    master.get(
        "published"
    )  # a set is not answered: a request after it on the same connection waits for it
    assert receiver.announced() == 3
    del master  # the trainer's process is gone, and its store with it
    with pytest.raises(
        RuntimeError,
        match=rf"^weight sync: the trainer's store at 127.0.0.1:{receiver.port} stopped "
        r"answering \(the trainer is gone: ",
    ):
        receiver.announced()
    receiver.leave()  # nothing to say goodbye to: no exception


@pytest.mark.slow
def test_a_resumed_trainers_first_publish_reaches_bucketed_explorers():
    # mode train resumed with broadcast sync sends its weights as one list of all parameters (extras.train_mode.connect_explorers);
    # explorers receiving in --sync-bucket-mb buckets aborted inside gloo (the default model: 538060032 vs 113246208
    # bytes), leaving no error line and the trainer waiting. The tiny model fits one bucket: the topology missed it
    import multiprocessing as mp

    import torch
    from test_sync import bucket_receiver

    import sync

    ws = sync.WeightSync(0, 2, port=0, timeout_s=60, bucket_elems=16, checksum=True)
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=bucket_receiver, args=(ws.port, torch.float32, q))
    proc.start()
    try:
        ws.connect(proc.is_alive)
        torch.manual_seed(0)
        params = [
            torch.randn(3, 5),
            torch.randn(40),
            torch.randn(2, 2),
        ]  # 15 | 40 | 4 elements: three buckets
        digest = ws.send(5, [params], proc.is_alive)
        version, _, got, received_digest = q.get(timeout=60)
        ws.wait(proc.is_alive)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert version == 5 and got == [p.tolist() for p in params]
    assert digest == pytest.approx(received_digest, rel=1e-12)


def trainer_that_dies(q, connected):
    """A trainer rank 0 that builds the weight-sync group with one explorer, then dies once the
    explorer's side of the group is built too (its store serves the explorer until then)."""
    import sync

    ws = sync.WeightSync(0, 2, port=0, timeout_s=60)
    q.put(ws.port)
    ws.connect()
    connected.wait(60)
    os._exit(1)


@pytest.mark.slow
def test_an_explorer_in_a_receive_when_its_trainer_dies_names_the_trainer():
    # the explorers' line was gloo's own "Connection closed by peer [ADDR]:PORT ... remote worker crashing"
    import multiprocessing as mp

    import torch

    import sync

    ctx = mp.get_context("spawn")
    q, connected = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=trainer_that_dies, args=(q, connected))
    proc.start()
    try:
        receiver = sync.WeightSync(None, port=q.get(timeout=60), timeout_s=60).connect()
        connected.set()
        with pytest.raises(
            RuntimeError,
            match=rf"^weight sync: a publish broke off, the trainer at 127.0.0.1:"
            rf"{receiver.port} went away \(.*\)$",
        ):
            receiver.recv([torch.zeros(4)])
    finally:
        proc.join(60)


def test_a_lost_postgres_connection_is_one_line_naming_the_buffer(postgres):
    # a restarted server ended the explorers with psycopg's bare "terminating connection due to administrator command"
    import uuid

    buf = open_buffer(f"{postgres}?schema=t_{uuid.uuid4().hex[:12]}")
    other = open_buffer(postgres)
    pid = buf.db.conn.info.backend_pid
    other.db.execute("SELECT pg_terminate_backend(?)", (pid,))
    with pytest.raises(
        ConnectionError,
        match=r"^buffer postgresql://127.0.0.1:\d+/postgres \(schema t_\w+\): "
        r"connection to the server lost \(.*\); when it is back, the same "
        r"commands with --resume continue the run$",
    ):
        buf.counts()
    with pytest.raises(ConnectionError):
        buf.write([])  # a transaction too
    other.close()


def test_a_topology_is_removed_after_an_error_and_after_ctrl_c(tmp_path):
    need_namespaces()
    with pytest.raises(ZeroDivisionError):
        with hosts.Topology(("a", "b")) as topo:
            # `ip netns exec` joins the namespace before it runs the shell: the shell's line
            # says the process is inside, which Popen's return does not
            sleeper = subprocess.Popen(
                topo.exec("b") + ["sh", "-c", "echo inside; exec sleep 300"],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert sleeper.stdout.readline() == "inside\n"
            assert hosts.leftovers(topo.tag)["processes"] == [sleeper.pid]
            1 / 0
    assert sleeper.wait(timeout=30) == -signal.SIGKILL
    assert hosts.leftovers(topo.tag) == {"namespaces": [], "links": [], "processes": []}
    # Ctrl-C in a script that made one (the atexit hook): its namespaces, links and processes go
    script = (
        "import subprocess, sys, time; sys.path.insert(0, 'benchmarks'); import hosts\n"
        "t = hosts.Topology(('a', 'b')).up()\n"
        "s = subprocess.Popen(t.exec('a') + ['sh', '-c', 'echo inside; exec sleep 300'], stdout=subprocess.PIPE)\n"
        "assert s.stdout.readline() == b'inside\\n'\n"
        "print(t.tag, flush=True); time.sleep(300)"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # as from a
    tag = (
        p.stdout.readline().strip()
    )  # terminal: a suite started in the background (nohup ... &) passes SIGINT ignored
    assert tag.startswith(hosts.PREFIX) and len(hosts.leftovers(tag)["namespaces"]) == 2
    assert len(hosts.leftovers(tag)["processes"]) == 1
    p.send_signal(signal.SIGINT)
    p.wait(timeout=60)
    assert "KeyboardInterrupt" in p.stderr.read()
    assert hosts.leftovers(tag) == {"namespaces": [], "links": [], "processes": []}


@pytest.mark.slow
def test_two_trainer_nodes_explorers_and_postgres_on_hosts_of_their_own(tiny_model, tmp_path):
    # The tiny preset on five hosts: PostgreSQL on db, torchrun --nnodes 2 on t0 + t1 (c10d rendezvous on t0's
    # address), explorers on e0 and e1. Broadcast sync with three faults in one run: e1's link down 10 s (the run
    # goes on), the PostgreSQL server restarted and trainer node t1 killed (each ends the run with one error line
    # per process; --resume continues it); then checkpoint sync in a shared directory with a slow link on e1.
    need_namespaces()
    flags = [
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--reward-fn",
        "tests.rewards.length_parity",
        "--eval-size",
        "0",
        "--checkpoint-interval",
        "1",
        "--sync-bucket-mb",
        "4",
    ]  # (several buckets)
    results = {}
    for method, faults, steps in (
        ("broadcast", ["link", "postgres", "node"], 8),
        ("checkpoint", ["slow"], 4),
    ):
        with hosts.Topology() as topo:
            results[method] = r = hosts.run_job(
                topo,
                tmp_path / method,
                flags,
                method,
                faults,
                steps,
                2,
                4,
                link_down_s=10,
                timeout_s=600,
            )
        assert hosts.leftovers(topo.tag) == {"namespaces": [], "links": [], "processes": []}
        assert {
            k: r[k] for k in ("lost", "trained_twice", "generated_twice", "left_running")
        } == dict.fromkeys(("lost", "trained_twice", "generated_twice", "left_running"), 0), r
        assert [f["fault"] for f in r["faults"]] == faults
        for f in r["faults"]:
            if f["fault"] in ("link", "slow"):
                assert f["outcome"] == "went on", f
            else:  # every process ended by itself, each with at most one error line, the trainer's naming the cause
                assert f["outcome"] == "ended" and f["left_running"] == 0, f
                procs = f["processes"]
                assert all(
                    p["exit"] not in (None, 0) and len(p["errors"]) <= 1 for p in procs.values()
                ), procs
                assert len(procs["trainer_t0"]["errors"]) == 1, procs
                if f["fault"] == "postgres":
                    assert any(
                        "connection to the server lost" in p["errors"][0]
                        for p in procs.values()
                        if p["errors"]
                    ), procs
                else:  # trainer rank 0 names the killed node's address; the explorers, that their trainer is gone
                    assert topo.addr["t1"] in procs["trainer_t0"]["errors"][0], procs
                    assert all(
                        len(procs[e]["errors"]) == 1 and "trainer" in procs[e]["errors"][0]
                        for e in ("explorer_e0", "explorer_e1")
                    ), procs
        assert r["launches"] == 1 + sum(f["outcome"] == "ended" for f in r["faults"])
    assert hosts.leftovers(hosts.process_prefix()) == {
        "namespaces": [],
        "links": [],
        "processes": [],
    }
