"""Checkpoint sync (--sync-method checkpoint): RUN_DIR/checkpoints/v{version:06d} is written under a
temporary name and renamed, then the marker checkpoints/latest; a reader holds a lease while it
loads, so retention spares it."""

import fcntl
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from queue import Empty
from typing import Any, Callable

from sync import checksum


@contextmanager
def _lock(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _leased(root: Path) -> set[int]:
    out = set()
    for lease in (root / "loading").glob("*"):
        try:
            out.add(int(lease.read_text()))
        except (OSError, ValueError):  # removed meanwhile, or a lease being written
            pass
    return out


def publish_checkpoint(
    run_dir: str | Path, version: int, save: Callable[[Path], None], keep: int = 3
) -> Path:
    """Write checkpoint `version` with `save(directory)`, keep the `keep` newest (and those being
    read)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"v{version:06d}", root / f".tmp-v{version:06d}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
    save(tmp)
    with _lock(root):
        # republished after a resume while being read: keep it
        if final.exists() and version in _leased(root):
            shutil.rmtree(tmp)
        else:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        (root / ".latest.tmp").write_text(str(version))
        os.replace(root / ".latest.tmp", root / "latest")
        protected = _leased(root) | {version}
        for old in sorted(root.glob("v[0-9]*"))[:-keep]:
            if int(old.name[1:]) not in protected:
                shutil.rmtree(old, ignore_errors=True)
    return final


class CheckpointWeights:
    """The weight publisher of --sync-method checkpoint (components.publisher): rank 0 writes
    each version to RUN_DIR/checkpoints, where the explorers look for it. It keeps every
    version that mode both's schedule may still ask for (`kept_versions`)."""

    def __init__(self, cfg, rank: int):
        self.run_dir = cfg.run_dir
        self.checksum = cfg.sync_checksum
        self.keep = kept_versions(cfg.sync_interval, cfg.sync_offset)
        self.rank = rank

    def publish(self, trainer) -> tuple[float | None, list]:
        """(the checksum of what was written, or None; the full parameters). Collective."""
        params = trainer.full_parameters()
        if self.rank != 0:
            return None, params
        publish_checkpoint(
            self.run_dir, trainer.version, lambda d: trainer.save(d, params), self.keep
        )
        return (checksum(params) if self.checksum else None), params


def kept_versions(sync_interval: int, sync_offset: int) -> int:
    """How many checkpoints to keep: 3, or more where mode both's schedule may still ask for an
    older one. When the trainer publishes version t + 1 after step t, batches t + 1 onwards are
    not generated yet; the oldest they need is required_version(t + 1) (schedule.py), which
    lags t + 1 by at most sync_offset + sync_interval - 1, that is (m + k - 1) // k publishes."""
    return max(3, (sync_offset + sync_interval - 1) // sync_interval + 1)


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """(version, directory) of the newest published checkpoint, or None."""
    marker = Path(run_dir) / "checkpoints" / "latest"
    if not marker.is_file():
        return None
    version = int(marker.read_text())
    return version, marker.parent / f"v{version:06d}"


def load_checkpoint(
    run_dir: str | Path,
    reader: str,
    load: Callable[[Path, int], Any],
    newer_than: int = -1,
    version: int | None = None,
) -> tuple[int, Any] | None:
    """(v, load(directory, v)) for checkpoint v = `version`, or (`version` None) the newest if
    newer than `newer_than`; None while there is no such checkpoint yet. RuntimeError when
    checkpoint `version` was deleted (a newer one is published and it is not there)."""
    lease = Path(run_dir) / "checkpoints" / "loading" / reader
    with _lock(lease.parent.parent):
        latest = latest_checkpoint(run_dir)
        if latest is None or latest[0] <= newer_than:
            return None
        if version is not None:
            if latest[0] < version:
                return None
            wanted = latest[1].parent / f"v{version:06d}"
            if not wanted.is_dir():
                raise RuntimeError(
                    f"checkpoint sync: version {version} was deleted before it was loaded"
                )
            latest = version, wanted
        lease.parent.mkdir(exist_ok=True)
        lease.write_text(str(latest[0]))
    try:
        return latest[0], load(latest[1], latest[0])
    finally:
        lease.unlink(missing_ok=True)


class CheckpointSource:
    """sync.Receiver's source with checkpoint sync: a published checkpoint, loaded into `engine`."""

    def __init__(self, run_dir: str | Path, name: str, engine):
        self.run_dir = run_dir
        self.name = name
        self.engine = engine

    def weights_announced(self) -> int:
        return (latest_checkpoint(self.run_dir) or (-1,))[0]

    def receive_weights(
        self, alive: Callable[[], bool], version: int | None = None
    ) -> tuple[int, float | None]:
        """Load checkpoint `version` (mode both's schedule asks for exactly it), or the newest
        (`version` None: in-flight updates, fully asynchronous explorers); waits until it is
        published. (version, checksum or None). RuntimeError when the trainer died."""
        load = self.engine.load_checkpoint
        while (
            got := load_checkpoint(self.run_dir, self.name, load, self.engine.version, version)
        ) is None:
            if not alive():
                raise RuntimeError("explorer: the trainer died")
            time.sleep(0.05)
        return got


def wait_until_loaded(explorer, queue) -> None:
    """Mode both: wait until the explorer has loaded its start weights; RuntimeError when it fails
    first."""
    while True:
        try:
            r = queue.get(timeout=1.0)
        except Empty:
            r = (
                {}
                if explorer.is_alive()
                else {"error": f"exit code {explorer.exitcode} before its weights were loaded"}
            )
        if "error" in r:
            raise RuntimeError(f"explorer failed: {r['error']}")
        if r.get("explorer/ready"):
            return
