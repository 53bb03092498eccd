"""The MLflow tracker (`--log mlflow`): components.trackers hands it to metrics.Metrics."""

import json
import os
import time
from pathlib import Path


class MLflowLog:
    """An MLflow run in experiment "nanorft" at $MLFLOW_TRACKING_URI, else RUN_DIR/mlflow.db;
    resumed by its id."""

    def __init__(self, run_dir: Path, config: dict):
        import logging

        from mlflow import MlflowClient
        from mlflow.entities import Param

        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # table creation notes
        self.client = MlflowClient(
            os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        )
        id_file = run_dir / "mlflow_run_id"
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
            return
        exp = self.client.get_experiment_by_name("nanorft")
        exp_id = (
            exp.experiment_id
            if exp
            else self.client.create_experiment(
                "nanorft", artifact_location=(run_dir.resolve() / "mlflow_artifacts").as_uri()
            )
        )
        self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        id_file.write_text(self.run_id)
        params = [Param(k, json.dumps(v)[:6000]) for k, v in config.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()]
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
