"""Experience and the persistent buffer between explorer and trainer.

The buffer is one SQLite file (stdlib sqlite3, WAL journal) in the run directory. Any
number of explorer processes write groups of experiences; one trainer process reads
complete groups in FIFO order (by insertion) and marks them consumed in the same
transaction, so a group is served at most once. A group with any experience whose reward
is NULL (not known yet: lagged rewards) is never served.

Schema (one row per experience):
    id INTEGER PRIMARY KEY  -- insertion order, the FIFO key
    group_id, task_id TEXT; model_version, prompt_length INTEGER
    tokens BLOB (int32), logprobs BLOB (float32), action_mask BLOB (int8)
    reward REAL NULL; info TEXT (JSON); explorer TEXT; created REAL (unix s)
    consumed INTEGER  -- 0 = not yet; else 1 + the trainer step that consumed it

Resume: `release_after(step)` makes the groups consumed at steps >= step servable again
(their training was lost with the crash), and each explorer's position is saved in the same
transaction as its batch (`write_batch`, `explorer_state`), so after a restart no
experience is lost, generated twice or trained on twice.

Difficulty pools (table task_pool, persisted with the buffer): a task whose latest group
had a mean reward >= `easy` is retired to pool "easy", <= `hard` to pool "hard"; explorers
skip retired tasks except for a lifted fraction, and a lifted task that lands in between
returns to the active set.
"""
from __future__ import annotations

import json
import math
import sqlite3
import time
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

_SCHEMA = """
CREATE TABLE IF NOT EXISTS experiences (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id TEXT NOT NULL, task_id TEXT NOT NULL, model_version INTEGER NOT NULL,
    prompt_length INTEGER NOT NULL, tokens BLOB NOT NULL, logprobs BLOB NOT NULL,
    action_mask BLOB NOT NULL, reward REAL, info TEXT NOT NULL, explorer TEXT NOT NULL,
    created REAL NOT NULL, consumed INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS experiences_group ON experiences (group_id);
CREATE INDEX IF NOT EXISTS experiences_open ON experiences (consumed, id);
CREATE TABLE IF NOT EXISTS explorer_state (name TEXT PRIMARY KEY, state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS task_pool (
    task_id TEXT PRIMARY KEY, pool TEXT NOT NULL, mean_reward REAL NOT NULL, updated REAL NOT NULL);
"""


@dataclass
class Experience:
    """One training sample (the contract between explorer and trainer).

    tokens:        prompt + response token ids, length L.
    prompt_length: P, number of prompt tokens; the response is tokens[P:], length R = L - P.
    logprobs:      [R] behaviour-policy log-prob of each response token under the exact
                   distribution it was sampled from (temperature applied; training needs
                   top_p 1). Placeholder 0.0 where there is none: environment tokens
                   (action_mask 0) and offline data.
    action_mask:   [R] 1 where the policy generated the token and it is trained on.
    reward:        float, or None while not known (lagged reward).
    group_id:      the rollouts of one task share it; task_id names the task.
    model_version: weight version (trainer steps) that generated it.
    info:          free JSON-able dict (response text, finish reason, errors, ...);
                   info["offline"] = True marks data not sampled from the policy (SFT chats,
                   DPO pairs, MIX expert data): no behaviour log-probs, a fixed reward.
    """

    tokens: list[int]
    prompt_length: int
    logprobs: list[float]
    action_mask: list[int]
    reward: float | None
    group_id: str
    task_id: str
    model_version: int
    info: dict = field(default_factory=dict)
    explorer: str = "explorer0"

    def __post_init__(self):
        if self.reward is not None and not (isinstance(self.reward, (int, float)) and math.isfinite(self.reward)):
            raise ValueError(f"experience {self.task_id}: reward must be a finite number or None, got {self.reward!r}")
        r = len(self.tokens) - self.prompt_length
        if not (len(self.logprobs) == len(self.action_mask) == r >= 0):
            raise ValueError(f"experience {self.task_id}: response has {r} tokens but "
                             f"{len(self.logprobs)} logprobs and {len(self.action_mask)} mask entries")


def pool_for(mean_reward: float, easy: float, hard: float) -> str | None:
    """The pool of a task whose latest group had `mean_reward`: "easy", "hard" or None (active)."""
    return "easy" if mean_reward >= easy else "hard" if mean_reward <= hard else None


class Buffer:
    """SQLite-backed experience buffer; open one per process.

    `timeout_s` is sqlite's busy timeout for concurrent writers (seconds).
    """

    def __init__(self, path: str | Path, timeout_s: float = 60.0):
        self.path = Path(path)
        try:
            self.db = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as e:
            raise ValueError(f"buffer {self.path}: not a usable SQLite database ({e})") from None
        self.before_commit: Callable[[], None] | None = None  # tests: runs inside each write transaction

    @contextmanager
    def _transaction(self):
        """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on any exception): the statements inside
        take effect together or not at all, and no other connection writes in between.
        (With isolation_level=None sqlite3 is in autocommit mode, so `with self.db:` alone
        would commit every statement on its own.)"""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            if self.before_commit is not None:
                self.before_commit()
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def write(self, group: list[Experience]) -> None:
        """Append one group atomically (all rows or none)."""
        self.write_batch([group])

    def write_batch(self, groups: list[list[Experience]], explorer: str | None = None,
                    state: dict | None = None, pools: list[tuple[str, float, float, float]] = ()) -> None:
        """Append groups, (optionally) the explorer's resume state and task-pool updates
        (`update_pool` arguments) in one transaction: all of it or nothing."""
        now = time.time()
        rows = [(e.group_id, e.task_id, e.model_version, e.prompt_length,
                 array("i", e.tokens).tobytes(), array("f", e.logprobs).tobytes(),
                 array("b", e.action_mask).tobytes(), e.reward, json.dumps(e.info), e.explorer, now)
                for g in groups for e in g]
        with self._transaction():
            self.db.executemany(
                "INSERT INTO experiences (group_id, task_id, model_version, prompt_length, tokens, "
                "logprobs, action_mask, reward, info, explorer, created) VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
            if state is not None:
                self.db.execute("INSERT OR REPLACE INTO explorer_state VALUES (?, ?)", (explorer, json.dumps(state)))
            for pool in pools:
                self._set_pool(*pool)

    def set_rewards(self, group_id: str, rewards: list[float] | float) -> int:
        """Lagged rewards: fill the rewards of a group's experiences (one value for all, or
        one per experience in insertion order); the group becomes servable once none is
        NULL. Returns the number of rows updated; raises ValueError for an unknown group or
        a wrong number of rewards."""
        values = rewards if isinstance(rewards, list) else [rewards]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            raise ValueError(f"group {group_id!r}: rewards must be finite numbers, got {values!r}")
        with self._transaction():
            ids = [r[0] for r in self.db.execute("SELECT id FROM experiences WHERE group_id = ? ORDER BY id", (group_id,))]
            values = values if isinstance(rewards, list) else values * len(ids)
            if not ids or len(values) != len(ids):
                raise ValueError(f"group {group_id!r} has {len(ids)} experiences, got {len(values)} rewards")
            self.db.executemany("UPDATE experiences SET reward = ? WHERE id = ?", zip(map(float, values), ids))
        return len(ids)

    def pending_groups(self) -> list[str]:
        """Groups still waiting for a reward (lagged), oldest first."""
        return [r[0] for r in self.db.execute(
            "SELECT group_id FROM experiences WHERE reward IS NULL GROUP BY group_id ORDER BY MIN(id)")]

    def explorer_state(self, name: str) -> dict | None:
        """The state saved with explorer `name`'s last batch, or None."""
        row = self.db.execute("SELECT state FROM explorer_state WHERE name = ?", (name,)).fetchone()
        return json.loads(row[0]) if row else None

    def release_after(self, step: int) -> int:
        """Mark groups consumed at trainer steps >= `step` as not consumed; returns the
        number of experiences released."""
        with self._transaction():
            return self.db.execute("UPDATE experiences SET consumed = 0 WHERE consumed > ?", (step,)).rowcount

    def read(self, num_groups: int, timeout_s: float = float("inf"),
             alive: Callable[[], bool] = lambda: True, poll_s: float = 0.05, step: int = 0) -> list[list[Experience]]:
        """Take the `num_groups` oldest complete, unconsumed groups and mark them consumed
        by trainer step `step`.

        Blocks (polling every `poll_s` seconds) until enough are ready. Raises TimeoutError
        after `timeout_s` seconds, RuntimeError as soon as `alive()` returns False (the
        writer died), so a reader never hangs on a dead writer.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            groups = self._take(num_groups, step)
            if groups is not None:
                return groups
            if not alive():
                raise RuntimeError(f"buffer {self.path}: writer stopped before {num_groups} groups were ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"buffer {self.path}: {num_groups} groups not ready after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def _take(self, num_groups: int, step: int) -> list[list[Experience]] | None:
        with self._transaction():
            ids = [r[0] for r in self.db.execute(
                "SELECT group_id FROM experiences WHERE consumed = 0 GROUP BY group_id "
                "HAVING SUM(reward IS NULL) = 0 ORDER BY MIN(id) LIMIT ?", (num_groups,))]
            if len(ids) < num_groups:
                return None
            marks = ",".join("?" * len(ids))
            rows = self.db.execute(
                "SELECT group_id, task_id, model_version, prompt_length, tokens, logprobs, action_mask, reward, info, "
                f"explorer FROM experiences WHERE consumed = 0 AND group_id IN ({marks}) ORDER BY id", ids).fetchall()
            self.db.execute(f"UPDATE experiences SET consumed = ? WHERE consumed = 0 AND group_id IN ({marks})",
                            [step + 1, *ids])
        by_group: dict[str, list[Experience]] = {g: [] for g in ids}
        for g, task, ver, plen, tok, lp, mask, reward, info, explorer in rows:
            by_group[g].append(Experience(
                list(array("i", tok)), plen, list(array("f", lp)), list(array("b", mask)),
                reward, g, task, ver, json.loads(info), explorer))
        return list(by_group.values())

    def counts(self) -> dict[str, int]:
        """Experience counts: total, consumed, ready (unconsumed, reward known), pending (reward NULL)."""
        total, consumed, pending = self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(consumed > 0), 0), COALESCE(SUM(reward IS NULL), 0) FROM experiences").fetchone()
        return {"total": total, "consumed": consumed, "pending": pending, "ready": total - consumed - pending}

    def update_pool(self, task_id: str, mean_reward: float, easy: float, hard: float) -> str | None:
        """Record a task's latest group mean reward: retire it to "easy" (>= easy) or
        "hard" (<= hard), else make it active again. Returns the pool or None (active)."""
        with self._transaction():
            return self._set_pool(task_id, mean_reward, easy, hard)

    def _set_pool(self, task_id: str, mean_reward: float, easy: float, hard: float) -> str | None:
        pool = pool_for(mean_reward, easy, hard)
        if pool is None:
            self.db.execute("DELETE FROM task_pool WHERE task_id = ?", (task_id,))
        else:
            self.db.execute("INSERT OR REPLACE INTO task_pool VALUES (?, ?, ?, ?)", (task_id, pool, mean_reward, time.time()))
        return pool

    def retired(self) -> dict[str, str]:
        """Retired tasks: task_id -> pool ("easy" or "hard")."""
        return dict(self.db.execute("SELECT task_id, pool FROM task_pool"))


def main(argv: list[str] | None = None) -> int:
    """Command line for lagged rewards:
        python buffer.py RUN_DIR/buffer.sqlite pending
        python buffer.py RUN_DIR/buffer.sqlite set-reward GROUP_ID 1.0 [0.0 ...]
    """
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="buffer.py", description="inspect a buffer and fill lagged rewards")
    p.add_argument("buffer")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("pending", help="list groups waiting for a reward")
    s = sub.add_parser("set-reward", help="set the rewards of a group (one value, or one per experience)")
    s.add_argument("group_id")
    s.add_argument("rewards", type=float, nargs="+")
    args = p.parse_args(argv)
    if not Path(args.buffer).is_file():
        print(f"buffer.py: error: no buffer file {args.buffer}", file=sys.stderr)
        return 2
    buf = Buffer(args.buffer)
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
