"""The TensorBoard tracker (--log tensorboard, the default): scalars as event files."""

import json
from pathlib import Path


class TensorBoardLog:
    """Scalars as TensorBoard event files in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`)."""

    def __init__(self, run_dir: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.writer.add_text(
            "config", "    " + json.dumps(config, indent=2).replace("\n", "\n    ")
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
