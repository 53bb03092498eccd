"""Put on PYTHONPATH of a run.py subprocess (and so of the processes it spawns): every
reasoning-gym dataset built appends a line to $NANORFT_BUILD_LOG (test_first_contact)."""

import os

import reasoning_gym

_create = reasoning_gym.create_dataset


def _counted(name, **kwargs):
    with open(os.environ["NANORFT_BUILD_LOG"], "a") as f:
        f.write(f"{os.getpid()} {name}\n")
    return _create(name, **kwargs)


reasoning_gym.create_dataset = _counted
