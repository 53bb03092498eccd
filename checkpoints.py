"""Resume states, RUN_DIR/checkpoints/resume-{step:06d} (`save_resume_state`,
`load_resume_state`)."""

import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp's no_dist note


def resume_state(run_dir: str | Path) -> Path | None:
    """The newest complete resume state of a run, or None."""
    marker = Path(run_dir) / "checkpoints" / "resume-latest"
    return marker.parent / marker.read_text().strip() if marker.is_file() else None


def delete_resume_states(run_dir: str | Path) -> int:
    """Delete a finished run's resume states (the marker first); returns the bytes freed."""
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


def save_resume_state(trainer, run_dir: str | Path, step: int) -> Path:
    """Write `trainer`'s state after `step` steps, return its path; resume-latest names it when
    complete. Collective."""
    import torch.distributed.checkpoint as dcp

    root = Path(run_dir) / "checkpoints"
    path = root / f"resume-{step:06d}"
    if trainer.rank == 0:
        shutil.rmtree(path, ignore_errors=True)  # a partial state left by a crash
        path.mkdir(parents=True)
    dist.barrier()
    # one rank, no collectives: gloo's copies in a thread of its own slow the trainer after them
    dcp.save(_dcp_state(trainer), checkpoint_id=str(path / "dcp"), no_dist=trainer.world == 1)
    # the one copy of the weights: the explorer of a resumed run starts from it
    trainer.save(path / "hf")
    if trainer.rank == 0:
        rng = torch.get_rng_state()
        meta = dict(step=step, version=trainer.version, rng=rng, loop=trainer.loop_state)
        torch.save(meta, path / "trainer.pt")
        tmp = root / ".resume-latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, root / "resume-latest")
        for old in root.glob("resume-[0-9]*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load_resume_state(trainer, path: str | Path) -> int:
    """Load a resume state into `trainer`; returns its step. Collective. ValueError for missing
    weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = _dcp_state(trainer)
    # the trainer's resume_tensors in place, as sharded
    dcp.load(state, checkpoint_id=str(Path(path) / "dcp"), no_dist=trainer.world == 1)
    set_optimizer_state_dict(trainer.model, trainer.opt, state["optim"])
    if state.keys() == {"optim"}:  # no trained tensors in dcp: the whole model from the HF copy
        _load_weights(trainer, Path(path) / "hf")
    meta = torch.load(Path(path) / "trainer.pt", weights_only=False)
    trainer.resume_at(meta["version"], dict(meta["loop"]))
    torch.set_rng_state(meta["rng"])
    return meta["step"]


def _dcp_state(trainer) -> dict:
    """What dcp saves and loads, sharded: the optimizer's state and the trainer's
    `resume_tensors`."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {
        "optim": get_optimizer_state_dict(trainer.model, trainer.opt),
        **trainer.resume_tensors(),
    }


def _load_weights(trainer, hf: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full: dict[str, torch.Tensor] = {}
    for f in sorted(hf.glob("*.safetensors")):  # (save_pretrained shards a large model)
        full.update(load_file(f))
    names = [n for n, _ in trainer.model.named_parameters()]
    if missing := [n for n in names if n not in full]:
        raise ValueError(
            f"resume state {hf}: no weights for {missing[:3]} ({len(missing)} parameters)"
        )
    # strict=False: the tied alias of a weight (lm_head.weight) is not a parameter of its own
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(trainer.model, {n: full[n] for n in names}, options=options)
