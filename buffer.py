"""Experience (the explorer/trainer contract) and the persistent buffer between them.

One code path, two backends: a SQLite file (stdlib sqlite3, WAL; the default,
RUN_DIR/buffer.sqlite) or a PostgreSQL database (extras/postgres.py, for several hosts),
differing only in placeholders, two column types, how a transaction excludes other writers
and the lock that holds an explorer name. Explorers write groups; one trainer reads
complete groups (no NULL reward: lagged rewards wait) in FIFO order and marks them consumed
in the same transaction, so a group is served at most once. Each explorer's resume position
and task-pool updates are written in the transaction of its batch, and `release_after(step)`
serves again what a crashed trainer had taken, so after a restart no experience is lost,
generated twice or trained on twice. Tables: experiences (one row per experience; consumed =
1 + the trainer step, use_count for replay), explorer_state, task_pool, run_state,
explorer_records (explorers' evaluations for the trainer's metrics), replays. Several runs
share one PostgreSQL database, each in its own schema (`open_buffer`).
"""
from __future__ import annotations

import fcntl
import json
import math
import re
import sqlite3
import sys
import time
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from config import Config

SCHEMA = """
CREATE TABLE IF NOT EXISTS experiences (
    id {id}, group_id TEXT NOT NULL, task_id TEXT NOT NULL, model_version INTEGER NOT NULL,
    prompt_length INTEGER NOT NULL, tokens {blob} NOT NULL, behaviour_logprobs {blob} NOT NULL,
    action_mask {blob} NOT NULL, reward DOUBLE PRECISION, info TEXT NOT NULL, explorer TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL, consumed INTEGER NOT NULL DEFAULT 0, use_count INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS experiences_group ON experiences (group_id);
CREATE INDEX IF NOT EXISTS experiences_open ON experiences (consumed, id);
CREATE TABLE IF NOT EXISTS explorer_state (name TEXT PRIMARY KEY, state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS task_pool (
    task_id TEXT PRIMARY KEY, pool TEXT NOT NULL, mean_reward DOUBLE PRECISION NOT NULL,
    updated DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS run_state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS explorer_records (id {id}, explorer TEXT NOT NULL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS replays (step INTEGER NOT NULL, group_id TEXT NOT NULL);
"""


COLUMNS = ("group_id, task_id, model_version, prompt_length, tokens, behaviour_logprobs, action_mask, reward, info, "
            "explorer")


@dataclass
class Experience:
    """One training sample (the contract between explorer and trainer).

    tokens:             prompt + response token ids, length L; the first prompt_length = P
                        are the prompt, the response tokens[P:] has length R = L - P.
    behaviour_logprobs: [R] log-prob of each response token under the exact distribution it
                        was sampled from (temperature applied; training needs top_p 1); 0.0
                        where there is none: environment tokens and offline data.
    action_mask:        [R] 1 where the policy generated the token and it is trained on.
    reward:             float, or None while not known (lagged reward).
    group_id, task_id:  the rollouts of one task share group_id; model_version: the weight
                        version that generated it. info: free JSON-able dict; info["offline"]
                        marks data not sampled from the policy (extras/offline.py).
    """

    tokens: list[int]
    prompt_length: int
    behaviour_logprobs: list[float]
    action_mask: list[int]
    reward: float | None
    group_id: str
    task_id: str
    model_version: int
    info: dict = field(default_factory=dict)
    explorer: str = Config.explorer_name

    def __post_init__(self):
        if self.reward is not None and not (isinstance(self.reward, (int, float)) and math.isfinite(self.reward)):
            raise ValueError(f"experience {self.task_id}: reward must be a finite number or None, got {self.reward!r}")
        r = len(self.tokens) - self.prompt_length
        if not (len(self.behaviour_logprobs) == len(self.action_mask) == r >= 0):
            raise ValueError(f"experience {self.task_id}: response has {r} tokens but {len(self.behaviour_logprobs)} "
                             f"behaviour_logprobs and {len(self.action_mask)} mask entries")


def pool_for(mean_reward: float, easy: float, hard: float) -> str | None:
    """The pool of a task whose latest group had `mean_reward`: "easy", "hard" or None (active)."""
    return "easy" if mean_reward >= easy else "hard" if mean_reward <= hard else None


class _SQLite:
    """The SQLite dialect: a file; BEGIN IMMEDIATE excludes other writers (and readers
    taking groups) for the whole transaction; explorer names are flocks on files beside it."""

    def __init__(self, path: str, timeout_s: float):
        self.path, self.where = Path(path), str(path)
        try:
            self.conn = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.executescript(SCHEMA.format(id="INTEGER PRIMARY KEY AUTOINCREMENT", blob="BLOB"))
        except sqlite3.DatabaseError as e:
            raise ValueError(f"buffer {self.where}: not a usable SQLite database ({e})") from None
        self._held = []

    def execute(self, sql: str, params=()):
        return self.conn.execute(sql, params)

    def executemany(self, sql: str, rows) -> None:
        self.conn.executemany(sql, rows)

    @contextmanager
    def transaction(self, readers: bool = False):
        """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on any exception). (With isolation_level=None
        sqlite3 is in autocommit mode, so `with conn:` alone would commit every statement.)"""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    def hold(self, name: str, wait: bool) -> bool:
        f = (self.path.parent / f".explorer-{name}.lock").open("a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                f.close()
                return False
            fcntl.flock(f, fcntl.LOCK_EX)
        self._held.append(f)  # the kernel drops the flock when the process dies, kill -9 included
        return True

    def close(self) -> None:
        self.conn.close()


POSTGRES = ("postgresql://", "postgres://")  # URL prefixes of the PostgreSQL backend
POSTGRES_BACKEND = "extras.postgres.Postgres"  # optional (psycopg), for several hosts: by import path


def open_buffer(url: str, run_dir: str | Path, timeout_s: float = 60.0) -> "Buffer":
    """The buffer of a run (config `buffer`): "" = RUN_DIR/buffer.sqlite; a path or
    sqlite:///path = that SQLite file; postgresql://... = that database, in schema
    `?schema=` or, by default, nanorft_<run dir name> (lower-cased, other characters as _).
    Raises ValueError (one line) when it cannot be opened."""
    if not url:
        return Buffer(Path(run_dir) / "buffer.sqlite", timeout_s)
    if url.startswith(POSTGRES) and "schema=" not in urlsplit(url).query:
        name = re.sub(r"[^a-z0-9_]", "_", Path(run_dir).resolve().name.lower())[:54]
        url += ("&" if urlsplit(url).query else "?") + f"schema=nanorft_{name}"
    return Buffer(url, timeout_s)


class Buffer:
    """The experience buffer; open one per process. `url`: a SQLite file (a path, or
    sqlite:///path) or postgresql://user@host:port/db[?schema=NAME]; `timeout_s`: how long a
    writer waits for a lock (s). ValueError (one line) for a file that is not a SQLite
    database, a server out of reach or a bad schema."""

    def __init__(self, url: str | Path, timeout_s: float = 60.0):
        url = str(url)
        if url.startswith(POSTGRES):
            from losses import resolve

            self.db = resolve(POSTGRES_BACKEND, {}, "buffer backend")(url, timeout_s, SCHEMA)
        else:
            self.db = _SQLite(url.removeprefix("sqlite:///"), timeout_s)
        self.where = self.db.where

    def close(self) -> None:
        """Close the connection (an explorer name held by `hold` is released)."""
        self.db.close()

    def clear(self) -> None:
        """Delete everything in this buffer (every table of the run), in one transaction."""
        with self.db.transaction(readers=True):
            for table in ("experiences", "explorer_state", "task_pool", "run_state", "explorer_records", "replays"):
                self.db.execute(f"DELETE FROM {table}")

    def write(self, group: list[Experience]) -> None:
        """Append one group atomically (all rows or none)."""
        self.write_batch([group])

    def write_batch(self, groups: list[list[Experience]], explorer: str | None = None,
                    state: dict | None = None, pools: list[tuple[str, float, float, float]] = ()) -> None:
        """Append groups, (optionally) the explorer's resume state and task-pool updates
        ((task_id, mean reward, easy, hard): `_set_pool`) in one transaction: all or nothing."""
        now = time.time()
        rows = [(e.group_id, e.task_id, e.model_version, e.prompt_length,
                 array("i", e.tokens).tobytes(), array("f", e.behaviour_logprobs).tobytes(),
                 array("b", e.action_mask).tobytes(), e.reward, json.dumps(e.info), e.explorer, now)
                for g in groups for e in g]
        with self.db.transaction():
            self.db.executemany(
                f"INSERT INTO experiences ({COLUMNS}, created) VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
            if state is not None:
                self.db.execute("INSERT INTO explorer_state VALUES (?, ?) ON CONFLICT (name) DO UPDATE "
                                "SET state = excluded.state", (explorer, json.dumps(state)))
            for pool in pools:
                self._set_pool(*pool)

    def set_rewards(self, group_id: str, rewards: list[float] | float) -> int:
        """Lagged rewards: fill the rewards of a group's experiences (one value for all, or one
        per experience in insertion order). Returns the rows updated; ValueError for an
        unknown group or a wrong number of rewards."""
        return self.set_rewards_many({group_id: rewards})

    def set_rewards_many(self, rewards: dict[str, list[float] | float]) -> int:
        """`set_rewards` for several groups (group_id -> rewards) in one transaction: all of
        them or none. Returns the number of rows updated."""
        checked = {}
        for group_id, values in rewards.items():
            vals = values if isinstance(values, list) else [values]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals):
                raise ValueError(f"group {group_id!r}: rewards must be finite numbers, got {values!r}")
            checked[group_id] = vals
        n = 0
        with self.db.transaction():
            for group_id, vals in checked.items():
                ids = [r[0] for r in self.db.execute("SELECT id FROM experiences WHERE group_id = ? ORDER BY id",
                                                     (group_id,))]
                vals = vals if isinstance(rewards[group_id], list) else vals * len(ids)
                if not ids or len(vals) != len(ids):
                    raise ValueError(f"group {group_id!r} has {len(ids)} experiences, got {len(vals)} rewards")
                self.db.executemany("UPDATE experiences SET reward = ? WHERE id = ?", zip(map(float, vals), ids))
                n += len(ids)
        return n

    def pending_groups(self) -> list[str]:
        """Groups still waiting for a reward (lagged), oldest first."""
        return [r[0] for r in self.db.execute(
            "SELECT group_id FROM experiences WHERE reward IS NULL GROUP BY group_id ORDER BY MIN(id)")]

    def pending_group_rows(self) -> list[list[Experience]]:
        """The experiences of the groups still waiting for a reward, oldest group first."""
        ids = self.pending_groups()
        return self.groups_of(ids, self.db.execute(
            f"SELECT {COLUMNS} FROM experiences WHERE group_id IN ({','.join('?' * len(ids))}) ORDER BY id",
            ids).fetchall()) if ids else []

    def explorer_state(self, name: str) -> dict | None:
        """The state saved with explorer `name`'s last batch, or None."""
        row = self.db.execute("SELECT state FROM explorer_state WHERE name = ?", (name,)).fetchone()
        return json.loads(row[0]) if row else None

    def hold(self, name: str, wait: bool = True) -> bool:
        """Take the explorer name `name` for the life of this connection (a flock beside the
        SQLite file, a PostgreSQL session advisory lock; dropped when the process dies). While
        another process holds it: wait, or return False with wait=False. A restarted explorer
        must not read its resume state while an old one can still store a batch."""
        if self.db.hold(name, wait=False):
            return True
        if wait:
            print(f"explorer {name}: waiting for the previous explorer of this name to stop", file=sys.stderr, flush=True)
            self.db.hold(name, wait=True)
        return wait

    def set_run_state(self, key: str, value: str | None) -> None:
        """Set (None: delete) a run-wide value, e.g. "trainer_done" = the final version."""
        with self.db.transaction():
            self.db.execute("DELETE FROM run_state WHERE key = ?", (key,))
            if value is not None:
                self.db.execute("INSERT INTO run_state VALUES (?, ?)", (key, value))

    def run_state(self, key: str) -> str | None:
        """A run-wide value set by `set_run_state`, or None."""
        row = self.db.execute("SELECT value FROM run_state WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def add_record(self, explorer: str, record: dict) -> None:
        """Store a metric record of explorer `explorer` for the trainer's metrics (NaN as null)."""
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.db.execute("INSERT INTO explorer_records (explorer, record) VALUES (?, ?)", (explorer, json.dumps(clean)))

    def records_after(self, last_id: int) -> tuple[int, list[dict]]:
        """Records stored by `add_record` with id > `last_id`, each tagged with "explorer";
        returns (the newest id, the records)."""
        rows = self.db.execute("SELECT id, explorer, record FROM explorer_records WHERE id > ? ORDER BY id",
                               (last_id,)).fetchall()
        return (rows[-1][0] if rows else last_id), [{**json.loads(r), "explorer": e} for _, e, r in rows]

    def release_after(self, step: int) -> int:
        """Mark groups consumed at trainer steps >= `step` as not consumed; returns the
        number of experiences released."""
        with self.db.transaction(readers=True):
            for (group_id,) in self.db.execute("SELECT group_id FROM replays WHERE step >= ?", (step,)).fetchall():
                self.db.execute("UPDATE experiences SET use_count = use_count - 1 WHERE group_id = ?", (group_id,))
            self.db.execute("DELETE FROM replays WHERE step >= ?", (step,))
            return self.db.execute("UPDATE experiences SET consumed = 0, use_count = 0 WHERE consumed > ?",
                                   (step,)).rowcount

    def read(self, num_groups: int, timeout_s: float = float("inf"),
             alive: Callable[[], bool] = lambda: True, poll_s: float = 0.05, step: int = 0) -> list[list[Experience]]:
        """Take the `num_groups` oldest complete, unconsumed groups and mark them consumed by
        trainer step `step`; blocks (polling every `poll_s` s) until enough are ready. Raises
        TimeoutError after `timeout_s` s, RuntimeError once `alive()` is False (the writer died)."""
        deadline = time.monotonic() + timeout_s
        while True:
            groups = self._take(num_groups, step)
            if groups is not None:
                return groups
            if not alive():
                raise RuntimeError(f"buffer {self.where}: writer stopped before {num_groups} groups were ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"buffer {self.where}: {num_groups} groups not ready after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def _take(self, num_groups: int, step: int) -> list[list[Experience]] | None:
        with self.db.transaction(readers=True):
            ids = [r[0] for r in self.db.execute(
                "SELECT group_id FROM experiences WHERE consumed = 0 GROUP BY group_id "
                "HAVING COUNT(*) = COUNT(reward) ORDER BY MIN(id) LIMIT ?", (num_groups,))]
            if len(ids) < num_groups:
                return None
            marks = ",".join("?" * len(ids))
            rows = self.db.execute(f"SELECT {COLUMNS} FROM experiences WHERE consumed = 0 AND group_id IN ({marks}) "
                                   "ORDER BY id", ids).fetchall()
            self.db.execute(f"UPDATE experiences SET consumed = ?, use_count = 1 WHERE consumed = 0 AND group_id IN "
                            f"({marks})", [step + 1, *ids])
        return self.groups_of(ids, rows)

    @staticmethod
    def groups_of(ids: list[str], rows) -> list[list[Experience]]:
        """Rows of COLUMNS (ordered by id) as groups of Experience, in the order of `ids`."""
        by_group: dict[str, list[Experience]] = {g: [] for g in ids}
        for g, task, ver, plen, tok, lp, mask, reward, info, explorer in rows:
            by_group[g].append(Experience(
                list(array("i", tok)), plen, list(array("f", lp)), list(array("b", mask)),
                reward, g, task, ver, json.loads(info), explorer))
        return list(by_group.values())

    def counts(self) -> dict[str, int]:
        """Experience counts: total, consumed, ready (unconsumed, reward known), pending (reward NULL)."""
        total, consumed, known = self.db.execute(
            "SELECT COUNT(*), COUNT(CASE WHEN consumed > 0 THEN 1 END), COUNT(reward) FROM experiences").fetchone()
        return {"total": total, "consumed": consumed, "pending": total - known, "ready": known - consumed}

    def _set_pool(self, task_id: str, mean_reward: float, easy: float, hard: float) -> None:
        """Record a task's latest group mean reward: retire it to "easy" (>= easy) or "hard"
        (<= hard), else make it active again (prime-rl's difficulty pools)."""
        pool = pool_for(mean_reward, easy, hard)
        if pool is None:
            self.db.execute("DELETE FROM task_pool WHERE task_id = ?", (task_id,))
        else:
            self.db.execute("INSERT INTO task_pool VALUES (?, ?, ?, ?) ON CONFLICT (task_id) DO UPDATE SET "
                            "pool = excluded.pool, mean_reward = excluded.mean_reward, updated = excluded.updated",
                            (task_id, pool, mean_reward, time.time()))

    def retired(self) -> dict[str, str]:
        """Retired tasks: task_id -> pool ("easy" or "hard")."""
        return dict(self.db.execute("SELECT task_id, pool FROM task_pool").fetchall())


def check_config(cfg) -> None:
    """Open the run's buffer once before any process starts: ValueError for a file that is
    not a SQLite database or a PostgreSQL server out of reach. A new run in mode both on a
    PostgreSQL schema that holds experiences: FileExistsError, or with --overwrite the schema
    is emptied (as the run directory is deleted)."""
    buf = open_buffer(cfg.buffer, cfg.run_dir)
    try:
        if cfg.buffer and cfg.mode == "both" and not cfg.resume and buf.counts()["total"]:
            if not cfg.overwrite:
                raise FileExistsError(f"buffer {buf.where} holds experiences of another run "
                                      "(use --overwrite, --resume or another ?schema=)")
            buf.clear()
    finally:
        buf.close()


def main(argv: list[str] | None = None) -> int:
    """Command line for lagged rewards (BUFFER: the file, or the PostgreSQL URL with ?schema=):
        python buffer.py RUN_DIR/buffer.sqlite pending
        python buffer.py RUN_DIR/buffer.sqlite set-reward GROUP_ID 1.0 [0.0 ...]
    """
    import argparse

    p = argparse.ArgumentParser(prog="buffer.py", description="inspect a buffer and fill lagged rewards")
    p.add_argument("buffer", help="RUN_DIR/buffer.sqlite, or postgresql://user@host:port/db?schema=NAME")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("pending", help="list groups waiting for a reward")
    s = sub.add_parser("set-reward", help="set the rewards of a group (one value, or one per experience)")
    s.add_argument("group_id")
    s.add_argument("rewards", type=float, nargs="+")
    args = p.parse_args(argv)
    if not args.buffer.startswith(POSTGRES) and not Path(args.buffer).is_file():
        print(f"buffer.py: error: no buffer file {args.buffer}", file=sys.stderr)
        return 2
    try:
        buf = Buffer(args.buffer)
    except ValueError as e:
        print(f"buffer.py: error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "pending":
        print("\n".join(buf.pending_groups()))
        return 0
    try:
        n = buf.set_rewards(args.group_id, args.rewards[0] if len(args.rewards) == 1 else args.rewards)
    except ValueError as e:
        print(f"buffer.py: error: {e}", file=sys.stderr)
        return 2
    print(f"set {n} rewards of group {args.group_id}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
