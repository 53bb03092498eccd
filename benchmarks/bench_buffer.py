"""Buffer throughput, SQLite vs PostgreSQL, measured side by side in one run.

    python benchmarks/bench_buffer.py                       # 1 and 4 writers, both backends (~1 min)
    python benchmarks/bench_buffer.py --groups 500 --group-size 8 --tokens 256

Starts a PostgreSQL server of its own (tests/conftest.py: start_postgres, Debian's package)
on this machine, connected over TCP on loopback; SQLite is a file in a temporary directory.
For each backend and W in (1, 4) writers, with groups of G experiences of T tokens (half
prompt, half response: the explorer's write of one group):

  write:  W writer processes append N groups each (`write_batch`, one group per
          transaction with the explorer state, as the explorer does), no reader: groups/s.
  read:   one reader (the trainer) takes all of them, 4 groups per `read`: groups/s.
  mixed:  W writers and the reader at the same time, until the reader has everything:
          groups/s through the buffer.

Prints a table with the PostgreSQL / SQLite ratio of each figure and saves
benchmarks/results/buffer.json. The figures are for one machine (this one: 2 shared
cores), where server and clients compete for the same cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from buffer import Experience  # noqa: E402
from conftest import start_postgres  # noqa: E402 (the tests' PostgreSQL server)
from extras.postgres import open_buffer  # noqa: E402


def groups_of(name: str, n: int, size: int, tokens: int) -> list[list[Experience]]:
    half = tokens // 2
    return [
        [
            Experience(
                list(range(tokens)),
                half,
                [-0.5] * half,
                [1] * half,
                1.0,
                f"{name}-{i}",
                f"t{i}",
                0,
                {"row": j},
                name,
            )
            for j in range(size)
        ]
        for i in range(n)
    ]


def writer(url: str, name: str, n: int, size: int, tokens: int, start, done) -> None:
    buf, groups = open_buffer(url), groups_of(name, n, size, tokens)
    done.put("ready")
    start.wait()
    for i, g in enumerate(groups):
        buf.write_batch([g], name, {"batch": i + 1})
    done.put(time.perf_counter())


def run_writers(url: str, writers: int, n: int, size: int, tokens: int, reader: bool) -> dict:
    ctx = mp.get_context("spawn")
    start, done = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=writer, args=(url, f"w{k}", n, size, tokens, start, done))
        for k in range(writers)
    ]
    for p in procs:
        p.start()
    buf = open_buffer(url)
    assert [done.get(timeout=120) for _ in procs] == [
        "ready"
    ] * writers  # connected, groups built: not timed
    t0 = time.perf_counter()
    start.set()
    got = 0
    if reader:
        while got < writers * n:
            got += len(buf.read(min(4, writers * n - got), timeout_s=600, poll_s=0.005))
    t_read = time.perf_counter()
    ends = [done.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return {"groups": writers * n, "seconds": (t_read if reader else max(ends)) - t0}


def read_all(url: str, total: int) -> float:
    buf = open_buffer(url)
    t0 = time.perf_counter()
    got = 0
    while got < total:
        got += len(buf.read(min(4, total - got), timeout_s=60))
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=300, help="groups per writer")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256, help="tokens per experience")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="nanorft-bench-buffer-"))
    pg, stop = start_postgres(tmp)
    rows = []
    try:
        for writers in (1, 4):
            row = {"writers": writers}
            for backend in ("sqlite", "postgres"):

                def fresh(backend=backend):
                    if backend == "sqlite":
                        return str(tmp / f"{uuid.uuid4().hex}.sqlite")
                    return f"{pg}?schema=b_{uuid.uuid4().hex[:12]}"

                url = fresh()
                open_buffer(url)  # the schema exists before the writers start
                w = run_writers(
                    url, writers, args.groups, args.group_size, args.tokens, reader=False
                )
                r = read_all(url, w["groups"])
                url = fresh()
                open_buffer(url)
                m = run_writers(
                    url, writers, args.groups, args.group_size, args.tokens, reader=True
                )
                row[backend] = {
                    "write": w["groups"] / w["seconds"],
                    "read": w["groups"] / r,
                    "mixed": m["groups"] / m["seconds"],
                }
                print(
                    f"{backend:>8} {writers} writer(s): write {row[backend]['write']:.0f} groups/s, read "
                    f"{row[backend]['read']:.0f} groups/s, mixed {row[backend]['mixed']:.0f} groups/s",
                    flush=True,
                )
            rows.append(row)
    finally:
        stop()
    print(
        f"\ngroups of {args.group_size} experiences x {args.tokens} tokens, {args.groups} groups per writer"
    )
    print(
        f"{'writers':>7} {'figure':>6} {'SQLite g/s':>11} {'PostgreSQL g/s':>15} {'PG/SQLite':>10}"
    )
    for row in rows:
        for fig in ("write", "read", "mixed"):
            s, q = row["sqlite"][fig], row["postgres"][fig]
            print(f"{row['writers']:>7} {fig:>6} {s:>11.0f} {q:>15.0f} {q / s:>10.2f}")
    out = ROOT / "benchmarks" / "results" / "buffer.json"
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
