"""The command line for lagged rewards, `python buffer.py BUFFER pending | set-reward GROUP_ID
REWARD [REWARD ...]` (BUFFER: RUN_DIR/buffer.sqlite, or postgresql://...?schema=NAME).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from buffer import POSTGRES, Buffer


def main(argv: list[str] | None = None) -> int:
    """List the groups waiting for a reward, or set a group's rewards; exit code 2 on an error."""
    p = argparse.ArgumentParser(prog="buffer.py", description="inspect a buffer and fill lagged rewards")
    p.add_argument("buffer", help="RUN_DIR/buffer.sqlite, or postgresql://user@host:port/db?schema=NAME")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("pending", help="list groups waiting for a reward")
    s = sub.add_parser("set-reward", help="set the rewards of a group (one value, or one per experience)")
    s.add_argument("group_id")
    s.add_argument("rewards", type=float, nargs="+")
    args = p.parse_args(argv)
    try:
        if not args.buffer.startswith(POSTGRES) and not Path(args.buffer).is_file():
            raise ValueError(f"no buffer file {args.buffer}")
        buf = Buffer(args.buffer)
        if args.cmd == "pending":
            print("\n".join(buf.pending_groups()))
            return 0
        n = buf.set_rewards(args.group_id, args.rewards[0] if len(args.rewards) == 1 else args.rewards)
    except ValueError as e:
        print(f"buffer.py: error: {e}", file=sys.stderr)
        return 2
    print(f"set {n} rewards of group {args.group_id}")
    return 0
