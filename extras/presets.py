"""TOML presets (`--config FILE.toml`): `read_preset` for config.parse_config, `coerce` also for mode bench."""

import dataclasses
import tomllib
from pathlib import Path

from config import CHOICES, TYPES, Config


def coerce(name: str, value, typ: str):
    """A TOML (or saved-config) value as field `name` of type `typ` takes it; ValueError (one line) otherwise."""
    if typ in ("bool", "dict", "list"):
        if not isinstance(value, TYPES[typ]):
            want = {"bool": "true/false", "dict": "a table", "list": "a list"}[typ]
            raise ValueError(f"config key {name!r}: expected {want}, got {value!r}")
        return value
    try:
        value = TYPES[typ](value)
    except (TypeError, ValueError):
        raise ValueError(f"config key {name!r}: expected {typ}, got {value!r}") from None
    if value not in CHOICES.get(name, (value,)):
        raise ValueError(
            f"config key {name!r}: expected one of {', '.join(CHOICES[name])}, got {value!r}"
        )
    return value


def read_preset(path: Path) -> dict:
    """The settings of TOML preset `path`, coerced; FileNotFoundError / ValueError (one line) for a bad file."""
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML ({e})") from None
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    if unknown := set(values) - set(types):
        raise ValueError(f"{path}: unknown config key(s) {sorted(unknown)}")
    return {k: coerce(k, v, types[k]) for k, v in values.items()}
