"""Experience (the explorer/trainer contract) and the buffer between them: a SQLite file, or a
server database through a backend with the same dialect methods (PostgreSQL's, handed over by
the composition root). The trainer takes complete groups in FIFO order, each once;
`release_after` serves again what a crashed one took."""

import fcntl
import json
import math
import sqlite3
import sys
import time
from array import array
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from config import Config

SCHEMA = """
CREATE TABLE IF NOT EXISTS experiences (
    id {id}, group_id TEXT NOT NULL, task_id TEXT NOT NULL, model_version INTEGER NOT NULL,
    prompt_length INTEGER NOT NULL, tokens {blob} NOT NULL, behaviour_logprobs {blob} NOT NULL,
    action_mask {blob} NOT NULL, reward DOUBLE PRECISION, info TEXT NOT NULL,
    explorer TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, consumed INTEGER NOT NULL DEFAULT 0,
    use_count INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS experiences_group ON experiences (group_id);
CREATE INDEX IF NOT EXISTS experiences_open ON experiences (consumed, id);
CREATE TABLE IF NOT EXISTS explorer_state (name TEXT PRIMARY KEY, state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS task_pool (task_id TEXT PRIMARY KEY, pool TEXT NOT NULL,
    mean_reward DOUBLE PRECISION NOT NULL, updated DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS run_state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS explorer_records (id {id}, explorer TEXT NOT NULL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS replays (step INTEGER NOT NULL, group_id TEXT NOT NULL);
"""
COLUMNS = (
    "group_id, task_id, model_version, prompt_length, tokens, behaviour_logprobs, action_mask, "
    "reward, info, explorer"
)
# every table of SCHEMA (Buffer.clear)
TABLES = ("experiences", "explorer_state", "task_pool", "run_state", "explorer_records", "replays")


@dataclass
class Experience:
    """One training sample: tokens = prompt + response (R); behaviour_logprobs, action_mask [R];
    reward None: lagged."""

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
        finite = isinstance(self.reward, (int, float)) and math.isfinite(self.reward)
        if self.reward is not None and not finite:
            raise ValueError(
                f"experience {self.task_id}: reward must be a finite number or None, "
                f"got {self.reward!r}"
            )
        r = len(self.tokens) - self.prompt_length
        if not (len(self.behaviour_logprobs) == len(self.action_mask) == r >= 0):
            raise ValueError(
                f"experience {self.task_id}: response has {r} tokens but "
                f"{len(self.behaviour_logprobs)} behaviour_logprobs and {len(self.action_mask)} "
                "mask entries"
            )


def pool_for(mean_reward: float, easy: float, hard: float) -> str | None:
    """A task's pool after a group with `mean_reward`: "easy", "hard" or None (active; prime-rl's
    pools)."""
    return "easy" if mean_reward >= easy else "hard" if mean_reward <= hard else None


class _SQLite:
    """The SQLite dialect: BEGIN IMMEDIATE transactions; explorer names are flocks beside the
    file."""

    def __init__(self, path: str, timeout_s: float):
        self.path = Path(path)
        self.where = str(path)
        try:
            self.conn = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.executescript(
                SCHEMA.format(id="INTEGER PRIMARY KEY AUTOINCREMENT", blob="BLOB")
            )
        except sqlite3.DatabaseError as e:
            raise ValueError(f"buffer {self.where}: not a usable SQLite database ({e})") from None
        self._held = []

    def execute(self, sql: str, params=()):
        return self.conn.execute(sql, params)

    def executemany(self, sql: str, rows) -> None:
        self.conn.executemany(sql, rows)

    @contextmanager
    def transaction(self, readers: bool = False):
        # explicit: with isolation_level=None, `with conn:` alone would commit every statement
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    def lock_file(self, name: str) -> Path:
        return self.path.parent / f".explorer-{name}.lock"

    def hold(self, name: str, wait: bool) -> bool:
        f = self.lock_file(name).open("a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                f.close()
                return False
            fcntl.flock(f, fcntl.LOCK_EX)
        self._held.append(f)  # the kernel drops the flock when the process dies, kill -9 included
        return True

    def held(self, name: str) -> bool:
        # a lock of our own on another open file conflicts with the holder's, even in-process
        with self.lock_file(name).open("a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False  # closing the file drops our lock

    def close(self) -> None:
        self.conn.close()


POSTGRES = ("postgresql://", "postgres://")  # URL prefixes of the PostgreSQL backend


def open_buffer(
    url: str, run_dir: str | Path, timeout_s: float = 60.0, backend: type | None = None
) -> "Buffer":
    """The buffer of a run (config `buffer`; "" = RUN_DIR/buffer.sqlite; `backend`: as Buffer's).
    ValueError when it cannot be opened."""
    return Buffer(url or Path(run_dir) / "buffer.sqlite", timeout_s, run_dir, backend)


class Buffer:
    """The buffer, one per process: a SQLite path, or postgresql://...[?schema=NAME] with the
    class of its connection `backend(url, timeout_s, SCHEMA, run_dir)`; ValueError if unusable."""

    def __init__(
        self,
        url: str | Path,
        timeout_s: float = 60.0,
        run_dir: str | Path | None = None,
        backend: type | None = None,
    ):
        url = str(url)
        if url.startswith(POSTGRES):  # run_dir: the default schema's name
            if backend is None:
                raise ValueError(f"buffer {url}: a PostgreSQL buffer is opened with its backend")
            self.db = backend(url, timeout_s, SCHEMA, run_dir)
        else:
            self.db = _SQLite(url.removeprefix("sqlite:///"), timeout_s)
        self.where = self.db.where

    def close(self) -> None:
        """Close the connection (an explorer name held by `hold` is released)."""
        self.db.close()

    def clear(self) -> None:
        """Delete everything in this buffer, in one transaction."""
        with self.db.transaction(readers=True):
            for table in TABLES:
                self.db.execute(f"DELETE FROM {table}")

    def write(self, group: list[Experience]) -> None:
        self.write_batch([group])

    def write_batch(
        self,
        groups: list[list[Experience]],
        explorer: str | None = None,
        state: dict | None = None,
        pools: list[tuple[str, float, float, float]] = (),
    ) -> None:
        """Append groups, the explorer's state and task-pool updates in one transaction."""
        now = time.time()
        rows = [
            (
                e.group_id,
                e.task_id,
                e.model_version,
                e.prompt_length,
                array("i", e.tokens).tobytes(),
                array("f", e.behaviour_logprobs).tobytes(),
                array("b", e.action_mask).tobytes(),
                e.reward,
                json.dumps(e.info),
                e.explorer,
                now,
            )
            for g in groups
            for e in g
        ]
        with self.db.transaction():
            self.db.executemany(
                f"INSERT INTO experiences ({COLUMNS}, created) VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows
            )
            if state is not None:
                self.db.execute(
                    "INSERT INTO explorer_state VALUES (?, ?) ON CONFLICT (name) DO UPDATE "
                    "SET state = excluded.state",
                    (explorer, json.dumps(state)),
                )
            for pool in pools:
                self._set_pool(*pool)

    def explorer_state(self, name: str) -> dict | None:
        """The state saved with explorer `name`'s last batch, or None."""
        row = self.db.execute("SELECT state FROM explorer_state WHERE name = ?", (name,)).fetchone()
        return json.loads(row[0]) if row else None

    def hold(self, name: str, wait: bool = True) -> bool:
        """Hold explorer name `name` while this connection lives (wait=False: False if taken)."""
        if self.db.hold(name, wait=False):
            return True
        if wait:
            waiting = f"explorer {name}: waiting for the previous explorer of this name to stop"
            print(waiting, file=sys.stderr, flush=True)
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

    def release_after(self, step: int) -> int:
        """Serve again what trainer steps >= `step` took; returns the number of experiences."""
        with self.db.transaction(readers=True):
            replayed = self.db.execute("SELECT group_id FROM replays WHERE step >= ?", (step,))
            self.db.executemany(
                "UPDATE experiences SET use_count = use_count - 1 WHERE group_id = ?",
                replayed.fetchall(),
            )
            self.db.execute("DELETE FROM replays WHERE step >= ?", (step,))
            return self.db.execute(
                "UPDATE experiences SET consumed = 0, use_count = 0 WHERE consumed > ?", (step,)
            ).rowcount

    def read(
        self,
        num_groups: int,
        timeout_s: float = float("inf"),
        alive: Callable[[], bool] = lambda: True,
        poll_s: float = 0.05,
        step: int = 0,
    ) -> list[list[Experience]]:
        """Wait for and take the `num_groups` oldest complete groups; TimeoutError, RuntimeError
        (writer died)."""
        deadline = time.monotonic() + timeout_s
        while True:
            groups = self._take(num_groups, step)
            if groups is not None:
                return groups
            if not alive():
                raise RuntimeError(
                    f"buffer {self.where}: writer stopped before {num_groups} groups were ready"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"buffer {self.where}: {num_groups} groups not ready after {timeout_s:.0f} s"
                )
            time.sleep(poll_s)

    def _take(self, num_groups: int, step: int) -> list[list[Experience]] | None:
        with self.db.transaction(readers=True):
            ready = self.db.execute(
                "SELECT group_id FROM experiences WHERE consumed = 0 GROUP BY group_id "
                "HAVING COUNT(*) = COUNT(reward) ORDER BY MIN(id) LIMIT ?",
                (num_groups,),
            )
            ids = [r[0] for r in ready]
            if len(ids) < num_groups:
                return None
            marks = ",".join("?" * len(ids))
            rows = self.db.execute(
                f"SELECT {COLUMNS} FROM experiences WHERE consumed = 0 AND group_id IN ({marks}) "
                "ORDER BY id",
                ids,
            ).fetchall()
            self.db.execute(
                "UPDATE experiences SET consumed = ?, use_count = 1 WHERE consumed = 0 "
                f"AND group_id IN ({marks})",
                [step + 1, *ids],
            )
        return self.groups_of(ids, rows)

    @staticmethod
    def groups_of(ids: list[str], rows) -> list[list[Experience]]:
        """Rows of COLUMNS (ordered by id) as groups, in the order of `ids`."""
        by_group: dict[str, list[Experience]] = {g: [] for g in ids}
        for g, task, ver, plen, tok, lp, msk, reward, info, explorer in rows:
            tokens = list(array("i", tok))
            logprobs = list(array("f", lp))
            mask = list(array("b", msk))
            e = Experience(
                tokens, plen, logprobs, mask, reward, g, task, ver, json.loads(info), explorer
            )
            by_group[g].append(e)
        return list(by_group.values())

    def counts(self) -> dict[str, int]:
        """Experience counts: total, consumed, ready (reward known, unconsumed), pending (reward
        NULL)."""
        total, consumed, known = self.db.execute(
            "SELECT COUNT(*), COUNT(CASE WHEN consumed > 0 THEN 1 END), COUNT(reward) "
            "FROM experiences"
        ).fetchone()
        return dict(total=total, consumed=consumed, pending=total - known, ready=known - consumed)

    def _set_pool(self, task_id: str, mean_reward: float, easy: float, hard: float) -> None:
        pool = pool_for(mean_reward, easy, hard)
        if pool is None:
            self.db.execute("DELETE FROM task_pool WHERE task_id = ?", (task_id,))
        else:
            self.db.execute(
                "INSERT INTO task_pool VALUES (?, ?, ?, ?) ON CONFLICT (task_id) DO UPDATE SET "
                "pool = excluded.pool, mean_reward = excluded.mean_reward, "
                "updated = excluded.updated",
                (task_id, pool, mean_reward, time.time()),
            )

    def retired(self) -> dict[str, str]:
        """Retired tasks: task_id -> pool ("easy" or "hard")."""
        return dict(self.db.execute("SELECT task_id, pool FROM task_pool").fetchall())


def check_config(cfg, backend: type | None = None) -> None:
    """Open the run's buffer (`backend`: as Buffer's) before any process starts; FileExistsError
    for another run's (--overwrite)."""
    with closing(open_buffer(cfg.buffer, cfg.run_dir, backend=backend)) as buf:
        if cfg.buffer and cfg.mode == "both" and not cfg.resume and buf.counts()["total"]:
            if not cfg.overwrite:
                raise FileExistsError(
                    f"buffer {buf.where} holds experiences of another run "
                    "(use --overwrite, --resume or another ?schema=)"
                )
            buf.clear()
