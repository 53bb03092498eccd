"""Modes train and explore as launches of their own, and offline --train-data: their checks
(run.check_modes); mode train's weight-sync group, explorer records and its wait for the
explorers to leave (run.started)."""

import functools
import json
import math
import time
from typing import Callable

from loop import Explorers, weight_group
from metrics import print0

# the losses that need no behaviour log-probs: offline rows carry none (MIX's expert rows:
# --expert-data)
OFFLINE_LOSSES = ("sft", "dpo")


def check_config(cfg) -> None:
    """run.check_modes outside mode both, or with --train-data: resolve sync_method "auto"
    (checkpoint); ValueError (one line) for conflicting flags."""
    if cfg.sync_method == "auto" and cfg.mode != "both":
        cfg.sync_method = "checkpoint"
    if cfg.mode in ("explore", "train") and cfg.sync_method == "broadcast" and not cfg.sync_port:
        raise ValueError(
            f"mode {cfg.mode} with --sync-method broadcast needs --sync-port (the same on trainer "
            "and explorers) and, across hosts, --sync-host (the trainer host's address)"
        )
    if cfg.inflight and cfg.mode not in ("both", "explore"):
        raise ValueError("--inflight is a setting of the explorer (mode both or explore)")
    if cfg.train_data and cfg.mode != "train":
        raise ValueError("--train-data is for --mode train (offline SFT / DPO)")
    if cfg.train_data and cfg.policy_loss not in OFFLINE_LOSSES:
        raise ValueError(
            f"--train-data has no behaviour log-probs for policy_loss {cfg.policy_loss!r} to take "
            "a ratio against: train offline data with --policy-loss "
            f"{' or '.join(OFFLINE_LOSSES)}"
        )
    if cfg.train_data and cfg.sync_method == "broadcast":
        raise ValueError(
            "--train-data trains offline, with no explorer to sync with: leave out "
            "--sync-method broadcast"
        )
    # (offline: no other side)
    if cfg.overwrite and cfg.mode in ("explore", "train") and not cfg.train_data:
        raise ValueError(
            f"--overwrite would delete a run directory shared with the other side (mode {cfg.mode})"
        )


def connect_explorers(cfg, buffer, layout, trainer, rank: int, transport: type | None):
    """Every rank: (a sync.WeightSync or None, the loop.Explorers link: records from the
    buffer); with broadcast, rank 0 connects the explorers' weight-sync group (of class
    `transport`)."""
    if rank == 0:
        wait = functools.partial(wait_left, buffer, cfg.sync_timeout_s)
        explorers = Explorers(records_from_buffer(buffer), wait_left=wait)
    else:
        explorers = Explorers()
    params = (
        trainer.full_parameters() if cfg.sync_method == "broadcast" and trainer.version else None
    )  # every rank
    if rank != 0 or cfg.sync_method != "broadcast":
        return None, explorers
    weights = weight_group(cfg, layout, cfg.num_explorers, transport)
    print0(
        f"weight sync: waiting for {cfg.num_explorers} explorer(s) at "
        f"{cfg.sync_host}:{weights.port}"
    )
    weights.connect()
    if weights.device.type != layout.sync_device:  # sync.group_backend
        print0(
            "weight sync: an explorer shares trainer rank 0's GPU, where NCCL cannot have two "
            "ranks: the weights go through host memory (gloo)"
        )
    if params is not None:
        weights.send(trainer.version, [params])
    return weights, explorers


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


def running_explorers(buffer) -> list[str]:
    """The names of the explorers that have written a batch and still run (they hold their
    name: buffer.Buffer.hold), sorted."""
    rows = buffer.db.execute("SELECT name FROM explorer_state ORDER BY name").fetchall()
    return [name for (name,) in rows if buffer.db.held(name)]


def wait_left(buffer, timeout_s: float, drain: Callable[[], None]) -> None:
    """After trainer_done: call `drain` (it reads the explorers' records into the trainer's
    metrics) until every explorer that wrote a batch has left, so that their evaluations of the
    final weights, made after the trainer's last step, are read too; at most `timeout_s`, then
    one line names those still running."""
    deadline = time.monotonic() + timeout_s
    running = running_explorers(buffer)
    if running:
        print0(f"waiting for {', '.join(running)} to evaluate the final weights and leave")
    while running and time.monotonic() < deadline:
        drain()
        time.sleep(0.2)
        running = running_explorers(buffer)
    if running:
        print0(
            f"{', '.join(running)} still running after {timeout_s:.0f} s: their evaluation of "
            "the final weights is not in metrics.jsonl"
        )
