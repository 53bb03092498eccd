"""Lagged rewards (reward_fn "human"): groups wait in the buffer (`pending_groups`) until
`set_rewards` fills them, from code, extras/label_studio.py or
`python -m extras.lagged_rewards BUFFER pending | set-reward GROUP_ID REWARD...` (`main`)."""

import argparse
import math
import sys
from pathlib import Path

from buffer import COLUMNS, POSTGRES, Buffer, Experience
from extras.postgres import open_buffer


def human_reward(task, completion: str, dataset) -> None:
    """None: the rollouts wait in the buffer for a human label (Label Studio, or buffer.py
    set-reward)."""


def set_rewards(buffer: Buffer, group_id: str, rewards: list[float] | float) -> int:
    """Fill a group's rewards (one for all, or one each); returns how many. ValueError for a wrong
    group."""
    return set_rewards_many(buffer, {group_id: rewards})


def set_rewards_many(buffer: Buffer, rewards: dict[str, list[float] | float]) -> int:
    """`set_rewards` for several groups (group_id -> rewards) in one transaction: all or none."""
    n, db = 0, buffer.db
    with db.transaction():
        for group_id, values in rewards.items():
            if not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for v in (values if isinstance(values, list) else [values])
            ):
                raise ValueError(
                    f"group {group_id!r}: rewards must be finite numbers, got {values!r}"
                )
            ids = [
                r[0]
                for r in db.execute(
                    "SELECT id FROM experiences WHERE group_id = ? ORDER BY id", (group_id,)
                )
            ]
            vals = values if isinstance(values, list) else [values] * len(ids)
            if not ids or len(vals) != len(ids):
                raise ValueError(
                    f"group {group_id!r} has {len(ids)} experiences, got {len(vals)} rewards"
                )
            db.executemany(
                "UPDATE experiences SET reward = ? WHERE id = ?", zip(map(float, vals), ids)
            )
            n += len(ids)
    return n


def pending_groups(buffer: Buffer) -> list[str]:
    """Groups still waiting for a reward, oldest first."""
    return [
        r[0]
        for r in buffer.db.execute(
            "SELECT group_id FROM experiences WHERE reward IS NULL GROUP BY group_id "
            "ORDER BY MIN(id)"
        )
    ]


def pending_group_rows(buffer: Buffer) -> list[list[Experience]]:
    """The experiences of the groups still waiting for a reward, oldest group first."""
    ids = pending_groups(buffer)
    return (
        buffer.groups_of(
            ids,
            buffer.db.execute(
                f"SELECT {COLUMNS} FROM experiences "
                f"WHERE group_id IN ({','.join('?' * len(ids))}) ORDER BY id",
                ids,
            ).fetchall(),
        )
        if ids
        else []
    )


def main(argv: list[str] | None = None) -> int:
    """List the groups waiting for a reward, or set a group's rewards; exit code 2 on an error."""
    p = argparse.ArgumentParser(
        prog="python -m extras.lagged_rewards",
        description="inspect a buffer and fill lagged rewards",
    )
    p.add_argument(
        "buffer", help="RUN_DIR/buffer.sqlite, or postgresql://user@host:port/db?schema=NAME"
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("pending", help="list groups waiting for a reward")
    s = sub.add_parser(
        "set-reward", help="set the rewards of a group (one value, or one per experience)"
    )
    s.add_argument("group_id")
    s.add_argument("rewards", type=float, nargs="+")
    args = p.parse_args(argv)
    try:
        if not args.buffer.startswith(POSTGRES) and not Path(args.buffer).is_file():
            raise ValueError(f"no buffer file {args.buffer}")
        buf = open_buffer(args.buffer)
        if args.cmd == "pending":
            print("\n".join(pending_groups(buf)))
            return 0
        n = set_rewards(
            buf, args.group_id, args.rewards[0] if len(args.rewards) == 1 else args.rewards
        )
    except ValueError as e:
        print(f"extras.lagged_rewards: error: {e}", file=sys.stderr)
        return 2
    print(f"set {n} rewards of group {args.group_id}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
