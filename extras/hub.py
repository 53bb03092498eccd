"""The Hugging Face Hub and datasets: `hub_snapshot` (by Hub id), `model_dir` (a model by Hub id
or as models.resolve_model finds it) and `hf_dataset_tasks`."""

from pathlib import Path

import models
from extras.offline import hold_out
from workflows import Task

DATA_FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".csv": "csv"}
HF_TASK_KWARGS = {
    "config": None,
    "split": "train",
    "eval_split": None,
    "question": "question",
    "answer": "answer",
}


def hub_snapshot(repo_id: str, repo_type: str = "model") -> str:
    """Local directory of a Hub model or dataset (cached, else downloaded); FileNotFoundError (one
    line) otherwise."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    patterns = (
        ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"] if repo_type == "model" else None
    )
    flag = "" if repo_type == "model" else f" --repo-type {repo_type}"
    try:
        return snapshot_download(repo_id, repo_type=repo_type, allow_patterns=patterns)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise FileNotFoundError(
            f"{repo_type} {repo_id!r} is neither a local path nor in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and the Hub cannot be reached; on a connected machine "
            f"run `hf download{flag} {repo_id}` (or copy its cache here)"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{repo_type} {repo_id!r}: no such repository on the Hugging Face Hub"
        ) from None


def model_dir(name: str) -> str:
    """The local directory of model `name` (models.resolve_model), a Hugging Face Hub id
    (models.hub_id) fetched first (`hub_snapshot`). FileNotFoundError (one line) when missing."""
    return models.resolve_model(hub_snapshot(name) if models.hub_id(name) else name)


def hf_dataset_tasks(
    name: str, kwargs: dict, train_size: int, eval_size: int
) -> tuple[list[Task], list[Task]]:
    """(train, held-out) tasks of a .parquet / .json / .csv file, dataset directory or Hub id;
    answers after "####" (GSM8K; verl's examples/data_preprocess/gsm8k.py). ValueError /
    FileNotFoundError (one line) for bad input."""
    if unknown := set(kwargs) - set(HF_TASK_KWARGS):
        raise ValueError(
            f"task {name}: unknown task_kwargs {sorted(unknown)} "
            f"(a Hugging Face dataset takes {sorted(HF_TASK_KWARGS)})"
        )
    kw = {**HF_TASK_KWARGS, **kwargs}
    suffix = Path(name).suffix
    if suffix in DATA_FILE_BUILDERS and not Path(name).is_file():
        raise FileNotFoundError(f"task file not found: {name}")
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"task {name}: a Hugging Face dataset needs the datasets package: pip install datasets"
        ) from None
    datasets.disable_progress_bars()
    path, files = (
        (DATA_FILE_BUILDERS[suffix], name) if suffix in DATA_FILE_BUILDERS else (name, None)
    )
    if files is None and not Path(name).is_dir():
        path = hub_snapshot(name, "dataset")

    def rows(split: str) -> list[Task]:
        try:
            ds = datasets.load_dataset(path, kw["config"], data_files=files, split=split)
        except (ValueError, FileNotFoundError) as e:  # unknown config or split, unreadable file
            raise ValueError(f"task {name}: {str(e).splitlines()[0]}") from None
        for key in ("question", "answer"):
            if kw[key] not in ds.column_names:
                raise ValueError(
                    f"task {name}: no field {kw[key]!r} (fields: {ds.column_names}); "
                    f'name the {key} field with task_kwargs {{"{key}": ...}}'
                )
        return [
            Task(
                f"{name}/{split}/{i}",
                str(r[kw["question"]]),
                str(r[kw["answer"]]).split("####")[-1].strip(),
                r,
            )
            for i, r in enumerate(ds)
        ]

    if kw["eval_split"]:
        return rows(kw["split"])[:train_size], rows(kw["eval_split"])[:eval_size]
    train, held = hold_out(name, rows(kw["split"]), eval_size)
    return train[:train_size], held


def is_dataset(name: str) -> bool:
    """Whether task `name` is a Hugging Face dataset: a data file, a directory or a Hub id
    (owner/name)."""
    return Path(name).suffix in DATA_FILE_BUILDERS or Path(name).is_dir() or name.count("/") == 1
