"""Mode explore (run.MODES): one explorer beside a `--mode train` launch, paced by the buffer
(`Backpressure`); the composition root hands it its loop and the makers of its parts."""

import sys
import time
from pathlib import Path

import torch

import launch
import sync
from buffer import Buffer
from explorer import engine_seed
from extras.hosts import StoreAlive
from extras.train_mode import add_record
from metrics import JsonlLog, eval_line


class Backpressure:
    """The `schedule.Pace` of mode explore: no batch once the trainer has finished or while two
    batches wait in the buffer; new weights are taken when published."""

    def __init__(self, cfg, buffer: Buffer, receiver: sync.Receiver):
        self.cfg, self.buffer, self.receiver = cfg, buffer, receiver

    def catch_up(self) -> None:
        """Take every publish announced so far (checkpoints: the newest)."""
        while self.receiver.newest() > self.receiver.engine.version:
            self.receiver.receive()

    inflight = catch_up

    def join(self) -> None:
        self.receiver.join()
        self.catch_up()

    def before_batch(self, batch: int) -> bool:
        cfg, since = self.cfg, time.monotonic()
        said = False
        while (
            not (done := self.buffer.run_state("trainer_done"))
            and self.buffer.counts()["ready"] >= 2 * cfg.batch_size * cfg.group_size
        ):
            if not said:  # a user who started the explorer first sees why nothing happens
                print(
                    f"{cfg.explorer_name}: two batches wait in the buffer; waiting for a "
                    f"trainer to take them (python run.py --mode train --run-dir {cfg.run_dir}), "
                    "at most "
                    f"{cfg.buffer_timeout_s:.0f} s",
                    flush=True,
                )
                said = True
            if time.monotonic() - since > cfg.buffer_timeout_s:
                raise RuntimeError(
                    f"explorer {cfg.explorer_name}: no trainer took a batch for "
                    f"{cfg.buffer_timeout_s:.0f} s"
                )
            if cfg.sync_method == "broadcast":
                self.catch_up()
            time.sleep(0.1)
        if not done and batch % cfg.sync_interval == 0:
            self.catch_up()
        return not done

    def final(self) -> None:
        # broadcast: trainer_done is set once every receiver has the last
        if self.cfg.sync_method != "broadcast":
            self.catch_up()


def run_mode_explore(
    cfg, prepared, explorer_loop, make_engine, make_explorer, receiver, open_buffer
) -> None:
    """Generate batches with `explorer_loop` (run.explorer_loop) until the trainer has finished;
    records to RUN_DIR/explorer_<name>.jsonl. The makers, from components.py:
    `make_engine(cfg, model_path, seed)`, `make_explorer(cfg, engine, tasks, log)`,
    `receiver(cfg, engine, log, alive, port, device)`, `open_buffer(cfg)`."""
    launch.split_threads(cfg, 1)
    print(
        f"nanorft: mode explore ({cfg.explorer_name}), engine {cfg.engine}, "
        f"{cfg.explorer_threads} threads, run dir {cfg.run_dir}"
    )
    log = JsonlLog(Path(cfg.run_dir) / f"explorer_{cfg.explorer_name}.jsonl")
    buffer = open_buffer(cfg)
    by_broadcast = cfg.sync_method == "broadcast"

    def log_and_share(record: dict) -> None:
        log.write(record)
        if "eval/accuracy" in record:
            add_record(buffer, cfg.explorer_name, record)
            line = eval_line(record, cfg.group_size)
            print(
                f"{cfg.explorer_name}: eval @ version {record['eval/version']}: {line}", flush=True
            )
        elif "batch" in record:
            print(
                f"{cfg.explorer_name}: batch {record['batch']} (version "
                f"{record['explorer/version']}) written in {record['time/explore_s']:.1f} s",
                flush=True,
            )

    try:
        engine = make_engine(cfg, prepared.model_path, engine_seed(cfg))
        # the trainer is no parent of ours: alive while its store answers (waited for: it may start
        # after us)
        alive = (
            StoreAlive(cfg.sync_host, cfg.sync_port, cfg.sync_timeout_s)
            if by_broadcast
            else lambda: True
        )
        port = cfg.sync_port if by_broadcast else None
        device = "cuda" if torch.cuda.is_available() else "cpu"
        pace = Backpressure(cfg, buffer, receiver(cfg, engine, log.write, alive, port, device))
        try:
            pace.join()
            explorer = make_explorer(cfg, engine, prepared.tasks, log_and_share)
            explorer_loop(cfg, explorer, buffer, pace, log_and_share, sys.maxsize)
        finally:  # the trainer may go (its store with it) once every explorer has left
            engine.close()
            if by_broadcast and engine.weights_joined():
                engine.leave_weight_sync()
    finally:
        buffer.close()
        log.close()
