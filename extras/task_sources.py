"""The task sources besides reasoning-gym that --task names: the bundled guessing game, an
installed verifiers environment (`verifiers:NAME`), a .jsonl task file and a Hugging Face
dataset. `load_tasks` asks `source_tasks` first and the core's reasoning-gym source where they
find none (the composition root asks it for a --task that is no reasoning-gym dataset)."""

import workflows
from losses import resolve

# task sources in extras/ named by --task, by import path: name -> f(kwargs, train_size,
# eval_size, seed); prefix -> f(text after "prefix:", train_size, eval_size)
TASK_SOURCES = {"guess_number": "extras.guess_number.guess_number_tasks"}
TASK_PREFIXES = {"verifiers": "extras.verifiers_env.verifiers_tasks"}


def source_tasks(
    name: str, kwargs: dict, train_size: int, eval_size: int, seed: int
) -> tuple | None:
    """(train, held-out tasks, None) of task `name` from the sources above; None: not theirs (a
    reasoning-gym dataset). ValueError: bad dataset, kwargs, row; FileNotFoundError."""
    if name in TASK_SOURCES:  # the bundled multi-turn game
        return (*resolve(TASK_SOURCES[name], {}, "task")(kwargs, train_size, eval_size, seed), None)
    prefix, _, rest = name.partition(":")
    if rest and prefix in TASK_PREFIXES:  # an installed verifiers environment's tasks
        return (*resolve(TASK_PREFIXES[prefix], {}, "task")(rest, train_size, eval_size), None)
    if name.endswith(".jsonl"):  # a task file
        from extras.offline import jsonl_tasks

        return (*jsonl_tasks(name, eval_size), None)
    from extras.hub import hf_dataset_tasks, is_dataset

    if is_dataset(name):  # Hugging Face datasets
        return (*hf_dataset_tasks(name, kwargs, train_size, eval_size), None)
    return None


def load_tasks(name: str, kwargs: dict, train_size: int, eval_size: int, seed: int, *eval_seed):
    """(train, held-out tasks, verifier dataset or None) of task `name`: from the sources above,
    else the reasoning-gym dataset of workflows.load_tasks (its error for an unknown name;
    `eval_seed`: its last argument)."""
    tasks = source_tasks(name, kwargs, train_size, eval_size, seed)
    if tasks is not None:
        return tasks
    return workflows.load_tasks(name, kwargs, train_size, eval_size, seed, *eval_seed)
