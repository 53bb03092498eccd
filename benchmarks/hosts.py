"""Several hosts on one Linux machine: network namespaces joined by a bridge, a two-node
torchrun trainer, explorers and PostgreSQL each on a host of its own, and links cut mid-run.

    sudo python benchmarks/hosts.py                          # the default model, both sync methods, every fault
    sudo python benchmarks/hosts.py --tiny                   # the tests' tiny random model (tests/test_hosts.py)
    sudo python benchmarks/hosts.py --tiny --sync broadcast --faults link,slow --link-down-s 60

Needs root and iproute2 (`ip netns`, veth pairs, a Linux bridge; `tc` for the slow link)
and PostgreSQL's server binaries (Debian: apt-get install postgresql). The hosts, each a
network namespace with an address of its own in a subnet 10.X.Y.0/24 picked at random
among the free ones, joined by one bridge (whose own address .254 lets this process read
the buffer; the namespaces do not forward, so no traffic leaves them):

    db      PostgreSQL 15 (the buffer), started by tests/conftest.py's PostgresServer
    t0, t1  trainer nodes: torchrun --nnodes 2 --nproc_per_node 1, c10d rendezvous hosted on
            t0 (--rdzv-conf is_host=1), FSDP2 over the two ranks (gloo); rank 0 (t0: the
            lowest --local-addr) reads the buffer and hosts the weight-sync store
    e0, e1  explorers (--mode explore); weights by broadcast to them, or by checkpoints in
            the run directory they share with the trainer (one filesystem: the machine's)

Faults (`--faults`, in this order, each once the buffer shows the run has got going):
    link      e1's link down for --link-down-s seconds (30), then up again: the run goes on
    postgres  the PostgreSQL server restarted (pg_ctl stop -m fast, start)
    node      every process of trainer node t1 killed (kill -9)
    slow      t1's link (the trainer nodes' FSDP traffic) slowed: netem delay 20 ms, 1% loss,
              --slow-mbit Mbit/s where the kernel has it, else a token bucket (tbf) of
              --slow-mbit Mbit/s whose queue drops what would wait over 20 ms
After a fault that ends the run, each process must end by itself within a bounded time
with one `run.py: error:` line; then the trainer nodes are started again with --resume and
the explorers again, as an operator would. At the end the buffer is audited
(benchmarks/faults.py's `audit`: groups lost, trained twice, generated twice) and the
processes still alive in the namespaces counted; everything this script made (namespaces,
veths, bridge, processes, the server) is removed at the end, after a failure or Ctrl-C too.
Results: benchmarks/results/hosts.json.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(p) for p in (ROOT, ROOT / "tests", ROOT / "benchmarks") if str(p) not in sys.path
]
from faults import audit  # noqa: E402 (lost / trained twice / generated twice, read off the buffer)

from conftest import PostgresServer, make_tiny_model, subprocess_env  # noqa: E402 (the tests' helpers)

HOSTS = ("db", "t0", "t1", "e0", "e1")
FAULTS = ("link", "postgres", "node", "slow")
PREFIX = "nrh"  # every namespace, link and bridge name this script makes starts with it
_serial = itertools.count()


def process_prefix(pid: int | None = None) -> str:
    """The start of every name the topologies of process `pid` (default: this one) make:
    PREFIX + the pid in base 36 + "x" (a link name has at most 15 characters)."""
    n, digits = pid or os.getpid(), ""
    while n:
        n, d = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[d] + digits
    return f"{PREFIX}{digits}x"


def run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (iproute2, tc); CalledProcessError with its stderr when it fails and `check`."""
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode:
        raise subprocess.CalledProcessError(res.returncode, cmd, res.stdout, res.stderr)
    return res


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (not root, no `ip`, a kernel that refuses
    them), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if not shutil.which("ip"):
        return "iproute2's ip command not found (apt-get install iproute2)"
    name = f"{process_prefix()}probe"
    res = run(["ip", "netns", "add", name], check=False)
    run(["ip", "netns", "del", name], check=False)
    return f"ip netns add failed: {res.stderr.strip()}" if res.returncode else None


def free_subnet(rng: random.Random, tries: int = 200) -> ipaddress.IPv4Network:
    """A 10.X.Y.0/24 that overlaps no address or route of this machine; RuntimeError when
    `tries` random picks all clash."""
    used = []
    for line in (
        run(["ip", "-4", "-o", "addr"]).stdout.splitlines()
        + run(["ip", "-4", "route"]).stdout.splitlines()
    ):
        for word in line.split():
            try:
                net = ipaddress.ip_network(word, strict=False)
            except ValueError:
                continue
            if net.prefixlen:  # (not "default")
                used.append(net)
    for _ in range(tries):
        net = ipaddress.ip_network(f"10.{rng.randrange(16, 250)}.{rng.randrange(0, 256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.X.Y.0/24 subnet for the namespaces")


def leftovers(prefix: str = PREFIX) -> dict[str, list]:
    """What is left of topologies whose names start with `prefix`: namespaces, links, and
    the processes inside those namespaces."""
    spaces = [
        line.split()[0]
        for line in run(["ip", "netns", "list"]).stdout.splitlines()
        if line.split() and line.split()[0].startswith(prefix)
    ]
    links = [
        line.split(":")[1].strip().split("@")[0]
        for line in run(["ip", "-o", "link"]).stdout.splitlines()
        if line.split(":")[1].strip().startswith(prefix)
    ]
    pids = [p for ns in spaces for p in _pids(ns)]
    return {"namespaces": spaces, "links": links, "processes": pids}


def _pids(ns: str) -> list[int]:
    """The processes in network namespace `ns`."""
    return [int(p) for p in run(["ip", "netns", "pids", ns], check=False).stdout.split()]


def _kill_all(ns: str) -> int:
    """kill -9 every process in network namespace `ns`; returns how many there were."""
    pids = _pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


class Topology:
    """Hosts on one machine: a network namespace per name in `hosts`, each with one veth
    (named `net0` inside, address 10.X.Y.(i+1)/24) on a bridge in this namespace (address
    10.X.Y.254). Names start with process_prefix() + a serial, so topologies of
    parallel or crashed runs never collide. `up()` builds it; `down()` (also at exit, and
    from the `with` block) kills every process left in its namespaces and removes the
    namespaces, links and bridge; it can be called any number of times. Raises
    subprocess.CalledProcessError when an `ip` command fails."""

    def __init__(self, hosts=HOSTS, seed: int | None = None):
        self.tag = f"{process_prefix()}{next(_serial)}"
        self.hosts = list(hosts)
        self.net = free_subnet(random.Random(seed))
        base = self.net.network_address
        self.addr = {h: str(base + i + 1) for i, h in enumerate(self.hosts)}
        self.gateway = str(base + 254)  # the bridge: this process's address on the subnet
        self.ns = {h: f"{self.tag}-{h}" for h in self.hosts}
        self.veth = {
            h: f"{self.tag}v{i}" for i, h in enumerate(self.hosts)
        }  # this namespace's end (<= 15 chars)
        self.bridge = f"{self.tag}br"
        self.made: list[tuple[str, str]] = []  # ("ns" | "link", name), in order of creation
        atexit.register(self.down)

    def __enter__(self) -> "Topology":
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "Topology":
        """Make the bridge, the namespaces and their links."""
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self.made.append(("link", self.bridge))
        run(["ip", "addr", "add", f"{self.gateway}/{self.net.prefixlen}", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])
        for h in self.hosts:
            ns, veth, peer = self.ns[h], self.veth[h], self.veth[h] + "p"
            run(["ip", "netns", "add", ns])
            self.made.append(("ns", ns))
            run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
            self.made.append(("link", veth))
            run(["ip", "link", "set", peer, "netns", ns])
            run(["ip", "-n", ns, "link", "set", peer, "name", "net0"])
            run(
                [
                    "ip",
                    "-n",
                    ns,
                    "addr",
                    "add",
                    f"{self.addr[h]}/{self.net.prefixlen}",
                    "dev",
                    "net0",
                ]
            )
            run(["ip", "-n", ns, "link", "set", "net0", "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            run(["ip", "link", "set", veth, "master", self.bridge])
            run(["ip", "link", "set", veth, "up"])
        return self

    def exec(self, host: str) -> list[str]:
        """The command prefix that runs a command on `host` (inside its namespace)."""
        return ["ip", "netns", "exec", self.ns[host]]

    def pids(self, host: str) -> list[int]:
        """The processes running on `host`."""
        return _pids(self.ns[host])

    def kill(self, host: str) -> int:
        """kill -9 every process on `host` (a host that dies); returns how many there were."""
        return _kill_all(self.ns[host])

    def link(self, host: str, up: bool) -> None:
        """Cut `host`'s link (its veth end on the bridge down: nothing reaches it or leaves
        it, its processes keep running) or restore it."""
        run(["ip", "link", "set", self.veth[host], "up" if up else "down"])

    def slow(self, host: str, mbit: int = 20) -> str:
        """Make `host`'s link slow and lossy, both ways; returns what was applied. netem
        (20 ms delay, 1% loss, `mbit` Mbit/s) where the kernel has sch_netem, else a token
        bucket (tbf, `mbit` Mbit/s, 20 ms of queue: what would wait longer is dropped)."""
        ends = [
            (self.exec(host) if inside else [])
            + ["tc", "qdisc", "add", "dev", "net0" if inside else self.veth[host], "root"]
            for inside in (False, True)
        ]
        netem = ["netem", "delay", "20ms", "loss", "1%", "rate", f"{mbit}mbit"]
        if run(ends[0] + netem, check=False).returncode == 0:
            run(ends[1] + netem)
            return f"netem delay 20 ms, loss 1%, {mbit} Mbit/s (each way)"
        for end in ends:
            run(end + ["tbf", "rate", f"{mbit}mbit", "burst", "32kb", "latency", "20ms"])
        return f"tbf {mbit} Mbit/s, 20 ms queue, tail drop (each way; this kernel has no sch_netem)"

    def unslow(self, host: str) -> None:
        """Remove what `slow` applied."""
        run(["tc", "qdisc", "del", "dev", self.veth[host], "root"], check=False)
        run(self.exec(host) + ["tc", "qdisc", "del", "dev", "net0", "root"], check=False)

    def down(self) -> None:
        """Kill what runs in the namespaces, then remove namespaces, links and bridge."""
        for kind, name in reversed(self.made):
            if kind == "ns":
                for _ in range(50):  # bounded: a process may be forking as we kill
                    if not _kill_all(name):
                        break
                    time.sleep(0.1)
                run(["ip", "netns", "del", name], check=False)
            else:
                run(["ip", "link", "del", name], check=False)
        self.made.clear()

    def describe(self) -> str:
        return f"subnet {self.net} (bridge {self.bridge} {self.gateway}): " + ", ".join(
            f"{h} {self.addr[h]}" for h in self.hosts
        )


# ----------------------------------------------------------------------------- the job on the hosts


class Job:
    """The default job's shape (or the tiny preset's) run on a Topology: PostgreSQL on db,
    the trainer on t0 + t1, explorers on e0, e1, weights by `sync` ("broadcast" or
    "checkpoint"). `flags`: run.py flags of both sides (model, steps, ...). Every launch's
    output goes to a log file in `work`."""

    def __init__(
        self,
        topo: Topology,
        work: Path,
        flags: list[str],
        sync: str,
        steps: int,
        batch: int,
        group: int,
        explorers=("e0", "e1"),
    ):
        self.topo, self.work, self.sync, self.explorers = topo, work, sync, list(explorers)
        self.steps, self.batch, self.group = steps, batch, group
        self.run_dir = work / "run"
        work.mkdir(parents=True, exist_ok=True)
        # the server's own directory (it runs as user postgres: the test's tmp_path is not open to it)
        self.pg_root = Path(tempfile.mkdtemp(prefix="nanorft-hosts-pg-"))
        try:
            self.db = PostgresServer(self.pg_root, wrap=topo.exec("db"), host=topo.addr["db"])
            self.db.start()
        except BaseException:
            shutil.rmtree(self.pg_root, ignore_errors=True)
            raise
        self.schema = "nanorft_hosts"
        self.url = f"{self.db.url}?schema={self.schema}"
        self.ports = {"rdzv": 29400, "sync": 29600}
        t0 = topo.addr["t0"]
        self.common = [
            *flags,
            "--run-dir",
            str(self.run_dir),
            "--buffer",
            self.url,
            "--steps",
            str(steps),
            "--sync-method",
            sync,
            "--sync-host",
            t0,
            *(["--sync-port", str(self.ports["sync"])] if sync == "broadcast" else []),
        ]
        self.procs: dict[str, subprocess.Popen] = {}
        self.launches = 0
        # (an interface named for this host does not exist on the others: each process finds its own)
        self.env = {
            k: v
            for k, v in subprocess_env().items()
            if k not in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR")
        }
        self.env["NANORFT_EXIT_GRACE_S"] = "20"

    def log(self, name: str) -> Path:
        return self.work / f"{name}.log"

    def _popen(self, host: str, name: str, cmd: list[str]) -> None:
        with self.log(name).open("a") as out:
            out.write(f"\n=== launch {self.launches}: {' '.join(cmd)}\n")
            out.flush()
            self.procs[name] = subprocess.Popen(
                self.topo.exec(host) + cmd,
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def launch(self, resume: bool = False) -> None:
        """Start the two trainer nodes (node 0 first: it hosts the rendezvous) and the explorers."""
        self.launches += 1
        t0 = self.topo.addr["t0"]
        for i, host in enumerate(("t0", "t1")):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"{t0}:{self.ports['rdzv']}",
                "--rdzv-id",
                f"hosts{self.launches}",
                "--local-addr",
                self.topo.addr[host],
                "--max-restarts",
                "0",
                *(["--rdzv-conf", "is_host=1"] if i == 0 else []),
                "run.py",
                *self.common,
                "--mode",
                "train",
                "--num-explorers",
                str(len(self.explorers)),
                *(["--resume"] if resume else []),
            ]
            self._popen(host, f"trainer_{host}", cmd)
        for name in self.explorers:
            self._popen(
                name,
                f"explorer_{name}",
                [
                    sys.executable,
                    "run.py",
                    *self.common,
                    "--mode",
                    "explore",
                    "--explorer-name",
                    name,
                ],
            )

    def buffer(self):
        from extras.postgres import open_buffer

        return open_buffer(self.url)

    def consumed_steps(self) -> int:
        """Trainer steps whose groups are marked consumed in the buffer (0 while it is not there)."""
        try:
            buf = self.buffer()
        except ValueError:  # (the server restarting)
            return 0
        try:
            return buf.db.execute("SELECT COALESCE(MAX(consumed), 0) FROM experiences").fetchone()[
                0
            ]
        except ConnectionError:
            return 0
        finally:
            buf.close()

    def wait_until(self, condition, what: str, timeout_s: float, ended_ok: bool = False) -> float:
        """Poll `condition()` (bounded); RuntimeError naming `what` and the logs' tails when it
        has not held within `timeout_s` seconds or (unless `ended_ok`) every process has
        ended. Returns seconds waited."""
        t0 = time.monotonic()
        while not condition():
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(
                    f"timed out ({timeout_s:.0f} s) waiting for {what}\n{self.tails()}"
                )
            if (
                not ended_ok
                and self.procs
                and all(p.poll() is not None for p in self.procs.values())
            ):
                raise RuntimeError(f"every process ended while waiting for {what}\n{self.tails()}")
            time.sleep(0.2)
        return time.monotonic() - t0

    def ended(self, timeout_s: float) -> dict:
        """Wait (up to `timeout_s`) until every launched process has ended; returns, per
        process, its exit code and its `run.py: error:` lines, and the seconds until all had ended."""
        t0 = time.monotonic()
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, timeout_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                pass
        out = {"seconds": round(time.monotonic() - t0, 1), "processes": {}}
        for name, p in self.procs.items():
            text = self.log(name).read_text(errors="replace").rsplit("=== launch", 1)[-1]
            out["processes"][name] = {
                "exit": p.poll(),
                "errors": [x for x in text.splitlines() if x.startswith("run.py: error:")],
            }
        return out

    def tails(self, chars: int = 1500) -> str:
        return "\n".join(
            f"--- {name}\n{self.log(name).read_text(errors='replace')[-chars:]}"
            for name in self.procs
        )

    def left_running(self) -> int:
        """Processes still alive on the trainer and explorer hosts (the server on db is not counted)."""
        return sum(len(self.topo.pids(h)) for h in ("t0", "t1", *self.explorers))

    def audit(self) -> dict:
        return audit(self.run_dir, self.url, self.steps, self.batch, self.group)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.db.stop()
        shutil.rmtree(self.pg_root, ignore_errors=True)


def run_job(
    topo: Topology,
    work: Path,
    flags: list[str],
    sync: str,
    faults: list[str],
    steps: int,
    batch: int,
    group: int,
    link_down_s: float = 30.0,
    timeout_s: float = 900.0,
    say=print,
    slow_mbit: int = 20,
) -> dict:
    """One run of the job on `topo` with `faults` applied in order (FAULTS), restarting with
    --resume after each fault that ended the run. Returns what happened: per fault the
    outcome ("went on" / "ended"), the seconds to the last process's end or to recovery, the
    error lines; then the audit (lost, trained_twice, generated_twice) and left_running.
    RuntimeError (with the logs' tails) when a wait exceeds `timeout_s`."""
    job = Job(topo, work, flags, sync, steps, batch, group)
    result = {"sync": sync, "steps": steps, "hosts": topo.describe(), "faults": []}
    try:
        t_start = time.monotonic()
        job.launch()
        say(
            f"{sync}: trainer on t0 {topo.addr['t0']} + t1 {topo.addr['t1']} (torchrun --nnodes 2), explorers on "
            + ", ".join(f"{e} {topo.addr[e]}" for e in job.explorers)
            + f", PostgreSQL on db {job.url}"
        )
        done = 0  # steps known done before the next fault
        for n, fault in enumerate(faults):
            # at least one step after the last (re)launch: a fault lands in a run that has got going
            target = done + max(1, (steps - done) // (len(faults) - n + 1))
            if target > steps - 1:
                raise RuntimeError(
                    f"{steps} steps are too few for the faults {faults}: none left for {fault}"
                )
            job.wait_until(
                lambda: job.consumed_steps() >= target,
                f"step {target} before fault {fault}",
                timeout_s,
            )
            before = job.consumed_steps()
            say(f"{sync}: fault {fault} at step {before}")
            row = {"fault": fault, "at_step": before}
            t0 = time.monotonic()
            if fault == "link":
                topo.link("e1", up=False)
                time.sleep(link_down_s)  # the fault's duration (not a synchronisation)
                topo.link("e1", up=True)
                row["down_s"] = link_down_s
            elif fault == "postgres":
                job.db.restart()
            elif fault == "node":
                row["killed"] = topo.kill("t1")
            elif fault == "slow":
                row["applied"] = topo.slow("t1", slow_mbit)
            goal, t_done, first = min(steps, before + 2), time.monotonic(), []

            def settled() -> (
                bool
            ):  # two more steps with every process alive, or every process ended
                ended = [p.poll() is not None for p in job.procs.values()]
                if not first and not any(ended) and job.consumed_steps() > before:
                    first.append(
                        time.monotonic() - t_done
                    )  # the first step after the fault (its end: link up)
                return all(ended) or (not any(ended) and job.consumed_steps() >= goal)

            job.wait_until(
                settled,
                f"two more steps or the end of every process after fault {fault}",
                timeout_s,
                ended_ok=True,
            )
            row["seconds"] = round(
                time.monotonic() - t0, 1
            )  # to recovery (two more steps) or to the last exit
            if all(p.poll() == 0 for p in job.procs.values()) or all(
                p.poll() is None for p in job.procs.values()
            ):
                row.update(
                    outcome="went on",
                    steps_after=job.consumed_steps(),
                    next_step_s=round(first[0], 1) if first else None,
                )
            else:
                end = job.ended(timeout_s)
                row.update(
                    outcome="ended", processes=end["processes"], left_running=job.left_running()
                )
                job.launch(resume=True)
                row["restarted_at_step"] = job.consumed_steps()
            if fault == "slow":
                topo.unslow("t1")
            done = job.consumed_steps()
            say(
                f"{sync}: fault {fault}: {json.dumps({k: v for k, v in row.items() if k != 'processes'})}"
            )
            for name, p in row.get("processes", {}).items():
                say(f"    {name}: exit {p['exit']}: {' | '.join(p['errors']) or '(no error line)'}")
            result["faults"].append(row)
        end = job.ended(timeout_s)
        result["final"] = end["processes"]
        if any(p["exit"] != 0 for p in end["processes"].values()):
            raise RuntimeError(f"the run did not finish: {end['processes']}\n{job.tails()}")
        result["seconds"] = round(time.monotonic() - t_start, 1)
        result["launches"] = job.launches
        result.update(job.audit())
        result["left_running"] = job.left_running()
        return result
    finally:
        job.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tiny",
        action="store_true",
        help="the tests' tiny random model and configs/tiny.toml's shape",
    )
    p.add_argument("--sync", choices=["broadcast", "checkpoint", "both"], default="both")
    p.add_argument(
        "--faults",
        default="link,postgres,node",
        help=f"comma-separated, applied in order to the broadcast run: {', '.join(FAULTS)} (the checkpoint "
        "run gets 'slow')",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help="trainer steps (default: 10 tiny, 8 with the default model)",
    )
    p.add_argument("--link-down-s", type=float, default=30.0)
    p.add_argument(
        "--slow-mbit",
        type=int,
        default=0,
        help="the slow link's rate (default: 20 tiny, 400 with the default model: ~40x the FSDP traffic)",
    )
    args = p.parse_args()
    if (why := unavailable()) is not None:
        raise SystemExit(f"hosts.py: error: {why}")
    faults = [f for f in args.faults.split(",") if f]
    if bad := set(faults) - set(FAULTS):
        raise SystemExit(
            f"hosts.py: error: unknown fault(s) {sorted(bad)}; choose from {', '.join(FAULTS)}"
        )
    for sig in (
        signal.SIGTERM,
        signal.SIGHUP,
    ):  # as Ctrl-C: unwind, so the finally blocks and atexit clean up
        signal.signal(sig, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        run_all(args, faults)
    except KeyboardInterrupt:
        raise SystemExit(
            "hosts.py: interrupted; its namespaces, links, processes and files are removed"
        )


def run_all(args, faults: list[str]) -> None:
    """The runs `main` asked for; results to benchmarks/results/hosts.json."""
    out_path = ROOT / "benchmarks" / "results" / "hosts.json"
    out = json.loads(out_path.read_text()) if out_path.exists() else {}
    with tempfile.TemporaryDirectory(prefix="nanorft-hosts-") as d:
        work = Path(d)
        if args.tiny:
            model = str(make_tiny_model(work / "model"))
            flags = [
                "--config",
                "configs/tiny.toml",
                "--model",
                model,
                "--reward-fn",
                "tests.rewards.length_parity",
                "--eval-size",
                "0",
                "--checkpoint-interval",
                "1",
                "--sync-bucket-mb",
                "4",
            ]  # (several buckets)
            steps, batch, group = args.steps or 10, 2, 4
        else:  # the default job (configs/default.toml's shape: 8 tasks x 8 rollouts, 24 tokens), evaluations off
            flags = ["--eval-size", "0", "--checkpoint-interval", "1", "--engine", "hf"]
            steps, batch, group = args.steps or 8, 8, 8
        methods = ["broadcast", "checkpoint"] if args.sync == "both" else [args.sync]
        key = "tiny" if args.tiny else "default"
        out[key] = {}
        for method in methods:
            with Topology() as topo:
                print(f"hosts: {topo.describe()}", flush=True)
                todo = faults if method == "broadcast" else ["slow"]
                r = run_job(
                    topo,
                    work / method,
                    flags,
                    method,
                    todo,
                    steps,
                    batch,
                    group,
                    args.link_down_s,
                    say=lambda s: print(s, flush=True),
                    slow_mbit=args.slow_mbit or (20 if args.tiny else 400),
                )
                out[key][method] = r
                print(
                    f"{method}: {r['seconds']} s, {r['launches']} launch(es): lost {r['lost']}, trained twice "
                    f"{r['trained_twice']}, generated twice {r['generated_twice']}, left running {r['left_running']}",
                    flush=True,
                )
            print(f"left of the topology: {leftovers(topo.tag)}")
    out_path.write_text(json.dumps(out, indent=1))
    print(f"saved {out_path}")


if __name__ == "__main__":
    main()
