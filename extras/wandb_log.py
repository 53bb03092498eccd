"""The W&B tracker (`--log wandb`): components.trackers hands it to metrics.Metrics."""

import os
import uuid
from pathlib import Path


class WandbLog:
    """A W&B run in project $WANDB_PROJECT (default "nanorft"), resumed by its id; offline unless
    logged in."""

    def __init__(self, run_dir: Path, config: dict):
        import netrc

        import wandb

        try:
            logged_in = bool(
                os.environ.get("WANDB_API_KEY") or netrc.netrc().authenticators("api.wandb.ai")
            )
        except (OSError, netrc.NetrcParseError):
            logged_in = False
        (run_dir / "wandb").mkdir(exist_ok=True)
        id_file = run_dir / "wandb" / "nanorft_run_id"
        if not id_file.is_file():
            id_file.write_text(uuid.uuid4().hex[:12])
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "nanorft"),
            name=run_dir.name,
            dir=str(run_dir),
            config=config,
            id=id_file.read_text().strip(),
            resume="allow",
            mode=os.environ.get("WANDB_MODE") or ("online" if logged_in else "offline"),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log({**scalars, "step": step})

    def close(self) -> None:
        self.run.finish()
