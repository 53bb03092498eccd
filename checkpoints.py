"""Weights and training state on disk, under RUN_DIR/checkpoints.

Checkpoint sync (fully asynchronous mode, separate launches): the trainer writes a Hugging
Face safetensors directory RUN_DIR/checkpoints/v{version:06d} (written under a temporary
name, then renamed) and then the marker RUN_DIR/checkpoints/latest (written, then renamed
over the old one), so a reader never sees a partial checkpoint; a reader holds a lease
while it loads, so that retention never deletes a checkpoint under it
(`publish_checkpoint`, `latest_checkpoint`, `load_latest_checkpoint`).

Resume states (`save_resume_state`, `load_resume_state`): RUN_DIR/checkpoints/resume-{step:06d}, named by the
marker checkpoints/resume-latest once complete (`resume_state`); a finished run deletes
them (`delete_resume_states`). A file of its own: trainer ranks, the explorer's Receiver
(sync.py) and run.py all read and write these directories.
"""
from __future__ import annotations

import fcntl
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def resume_state(run_dir: str | Path) -> Path | None:
    """The newest complete resume state of a run (named by checkpoints/resume-latest), or
    None when the run has none yet."""
    marker = Path(run_dir) / "checkpoints" / "resume-latest"
    return marker.parent / marker.read_text().strip() if marker.is_file() else None


def delete_resume_states(run_dir: str | Path) -> int:
    """Delete a finished run's resume states (checkpoints/resume-*, the marker first, so
    that no moment names a partly deleted state) and checkpoints/ itself if that leaves it
    empty. Returns the bytes freed (0: there were none)."""
    root = Path(run_dir) / "checkpoints"
    states = sorted(root.glob("resume-[0-9]*"))
    freed = sum(f.stat().st_size for d in states for f in d.rglob("*") if f.is_file())
    (root / "resume-latest").unlink(missing_ok=True)
    (root / ".resume-latest.tmp").unlink(missing_ok=True)
    for d in states:
        shutil.rmtree(d, ignore_errors=True)
    if root.is_dir() and not any(root.iterdir()):
        root.rmdir()
    return freed


@contextmanager
def _checkpoint_lock(root: Path):
    """Exclusive lock (flock on root/.lock) between retention and readers taking a lease."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _leased(root: Path) -> set[int]:
    """Versions a reader is loading now (files root/loading/<reader> holding a version)."""
    out = set()
    for lease in (root / "loading").glob("*"):
        try:
            out.add(int(lease.read_text()))
        except (OSError, ValueError):  # removed meanwhile, or a lease being written
            pass
    return out


def publish_checkpoint(run_dir: str | Path, version: int, save: Callable[[Path], None], keep: int = 3) -> Path:
    """Write checkpoint `version` with `save(directory)` atomically (temporary directory,
    rename, then the `latest` marker written and renamed), and delete all but the `keep`
    newest checkpoints, except any a reader is loading (`load_latest_checkpoint` leases).
    Call it on one process only (trainer rank 0). Returns the checkpoint directory."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"v{version:06d}", root / f".tmp-v{version:06d}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
    save(tmp)
    with _checkpoint_lock(root):
        if final.exists() and version in _leased(root):  # republished after a resume while being read: keep it
            shutil.rmtree(tmp)
        else:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        marker = root / ".latest.tmp"
        marker.write_text(str(version))
        os.replace(marker, root / "latest")
        protected = _leased(root) | {version}
        for old in sorted(root.glob("v[0-9]*"))[:-keep]:
            if int(old.name[1:]) not in protected:
                shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """(version, directory) of the newest published checkpoint, or None."""
    marker = Path(run_dir) / "checkpoints" / "latest"
    if not marker.is_file():
        return None
    version = int(marker.read_text())
    return version, Path(run_dir) / "checkpoints" / f"v{version:06d}"


def load_latest_checkpoint(run_dir: str | Path, reader: str, load: Callable[[Path, int], T],
                           newer_than: int = -1) -> tuple[int, T] | None:
    """If the newest published checkpoint is newer than `newer_than`, load it with
    `load(directory, version)` and return (version, its result); else None. While it
    loads, `reader` holds a lease (RUN_DIR/checkpoints/loading/<reader>, taken under the
    checkpoint lock) so retention cannot delete the directory under it."""
    root = Path(run_dir) / "checkpoints"
    lease = root / "loading" / reader
    with _checkpoint_lock(root):
        latest = latest_checkpoint(run_dir)
        if latest is None or latest[0] <= newer_than:
            return None
        lease.parent.mkdir(exist_ok=True)
        lease.write_text(str(latest[0]))
    try:
        return latest[0], load(latest[1], latest[0])
    finally:
        lease.unlink(missing_ok=True)


def save_resume_state(trainer, run_dir: str | Path, step: int) -> Path:
    """Write the resume state of `trainer` after `step` steps to
    RUN_DIR/checkpoints/resume-{step:06d}/ and return it: the weights once, as a float32 HF
    directory hf/ (exact; the explorer of a resumed run starts from it), the optimizer state
    (torch.distributed.checkpoint in dcp/, sharded as it is), version, RNG and rank 0's
    `loop_state`: about 12 bytes per parameter; with LoRA, the adapters only (hf/ a peft
    adapter directory, dcp/ also holding them). Only once it is complete does the marker
    checkpoints/resume-latest (written, then renamed) name it and are older states deleted:
    the marker always names a complete state, whatever is killed when. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    root = Path(run_dir) / "checkpoints"
    path = root / f"resume-{step:06d}"
    if trainer.rank == 0:
        shutil.rmtree(path, ignore_errors=True)  # a partial state left by a crash
        path.mkdir(parents=True)
    dist.barrier()
    # one copy of the weights, in hf/ (the explorer starts from it): DCP holds the optimizer (and LoRA adapters)
    dcp.save({"optim": get_optimizer_state_dict(trainer.model, trainer.opt), **_adapter_state(trainer)},
             checkpoint_id=str(path / "dcp"))
    trainer.save(path / "hf")
    if trainer.rank == 0:
        torch.save({"step": step, "version": trainer.version, "rng": torch.get_rng_state(), "loop": trainer.loop_state},
                   path / "trainer.pt")
        tmp = root / ".resume-latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, root / "resume-latest")
        for old in root.glob("resume-[0-9]*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load_resume_state(trainer, path: str | Path) -> int:
    """Load a `save_resume_state` directory into `trainer` and its `loop_state`; returns the
    number of steps it had done. The weights come from hf/ (read by every rank, sharded
    here), the optimizer (and with LoRA the adapters) from dcp/. Collective. Raises
    ValueError when hf/ lacks a parameter of the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optim": get_optimizer_state_dict(trainer.model, trainer.opt), **_adapter_state(trainer)}
    dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))  # LoRA: the adapters in place, as sharded
    set_optimizer_state_dict(trainer.model, trainer.opt, state["optim"])
    if not trainer.lora:
        _load_weights(trainer, Path(path) / "hf")
    meta = torch.load(Path(path) / "trainer.pt", weights_only=False)
    trainer.version = meta["version"]
    trainer.loop_state = dict(meta["loop"])
    torch.set_rng_state(meta["rng"])
    return meta["step"]


def _adapter_state(trainer) -> dict:
    """With LoRA, the adapters for DCP to save or load in place ({} otherwise)."""
    return {"adapters": {n: p for n, p in trainer.published()}} if trainer.lora else {}


def _load_weights(trainer, hf: Path) -> None:
    """Load the float32 HF directory `hf` (a resume state's) into the sharded model."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full: dict[str, torch.Tensor] = {}
    for f in sorted(hf.glob("*.safetensors")):  # (save_pretrained shards a large model)
        full.update(load_file(f))
    names = [n for n, _ in trainer.model.named_parameters()]  # the names `save` writes
    if missing := [n for n in names if n not in full]:
        raise ValueError(f"resume state {hf}: no weights for {missing[:3]} ({len(missing)} parameters)")
    # strict=False: the tied alias of a weight (lm_head.weight) is not a parameter of its own
    set_model_state_dict(trainer.model, {n: full[n] for n in names},
                         options=StateDictOptions(full_state_dict=True, strict=False))
