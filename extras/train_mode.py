"""Mode train beside `--mode explore` launches (imported by loop.started and loop.finish): the weight-sync group, records."""

import json
import math
import sys
import time
from typing import Callable

from loop import Explorers, weight_group
from metrics import print0


def connect_explorers(cfg, buffer, layout, trainer, rank: int):
    """Every rank: (a sync.WeightSync or None, the loop.Explorers link: records from the
    buffer); with broadcast, rank 0 connects the explorers' weight-sync group."""
    explorers = Explorers(records_from_buffer(buffer)) if rank == 0 else Explorers()
    params = (
        trainer.full_parameters() if cfg.sync_method == "broadcast" and trainer.version else None
    )  # every rank
    if rank != 0 or cfg.sync_method != "broadcast":
        return None, explorers
    weights = weight_group(cfg, layout, cfg.num_explorers)
    print0(
        f"weight sync: waiting for {cfg.num_explorers} explorer(s) at {cfg.sync_host}:{weights.port}"
    )
    weights.connect()
    if weights.device.type != layout.sync_device:  # sync.group_backend
        print0(
            "weight sync: an explorer shares trainer rank 0's GPU, where NCCL cannot have two ranks: the weights "
            "go through host memory (gloo)"
        )
    if params is not None:
        weights.send(trainer.version, [params])
    return weights, explorers


def wait_left(weights, timeout_s: float) -> bool:
    """Rank 0: wait until every explorer has left the weight-sync group; False (a warning) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while weights.store.add("left", 0) < weights.world_size - 1:
        if time.monotonic() > deadline:
            print(
                f"run.py: warning: not every explorer left the weight-sync group within {timeout_s:.0f} s",
                file=sys.stderr,
            )
            return False
        time.sleep(0.05)
    return True


def add_record(buffer, explorer: str, record: dict) -> None:
    """Store a record of `explorer` for the trainer's metrics (NaN as null)."""
    clean = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }
    buffer.db.execute(
        "INSERT INTO explorer_records (explorer, record) VALUES (?, ?)",
        (explorer, json.dumps(clean)),
    )


def records_after(buffer, last_id: int) -> tuple[int, list[dict]]:
    """(the newest id, the records stored with id > `last_id`, each tagged with "explorer")."""
    rows = buffer.db.execute(
        "SELECT id, explorer, record FROM explorer_records WHERE id > ? ORDER BY id", (last_id,)
    ).fetchall()
    return (rows[-1][0] if rows else last_id), [
        {**json.loads(r), "explorer": e} for _, e, r in rows
    ]


def records_from_buffer(buffer) -> Callable[[], list[dict]]:
    """An `Explorers.records`: the explorers' records added to `buffer` since its last call."""
    last = 0

    def records() -> list[dict]:
        nonlocal last
        last, new = records_after(buffer, last)
        return new

    return records
