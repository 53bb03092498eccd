"""TOML presets (`--config FILE.toml`): `read_preset` for config.parse_config, `coerce` also for mode bench."""

import tomllib
import typing
from pathlib import Path

from config import Config

# each setting's type, resolved once (Config's annotations are strings)
HINTS = typing.get_type_hints(Config)


def coerce(name: str, value):
    """A TOML (or saved-config) value as setting `name` takes it (its type, one of its choices);
    ValueError (one line) otherwise."""
    hint = HINTS[name]
    choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()
    typ = type(choices[0]) if choices else hint
    if typ in (bool, dict, list):
        if not isinstance(value, typ):
            want = {bool: "true/false", dict: "a table", list: "a list"}[typ]
            raise ValueError(f"config key {name!r}: expected {want}, got {value!r}")
        return value
    try:
        value = typ(value)
    except (TypeError, ValueError):
        raise ValueError(f"config key {name!r}: expected {typ.__name__}, got {value!r}") from None
    if choices and value not in choices:
        raise ValueError(
            f"config key {name!r}: expected one of {', '.join(choices)}, got {value!r}"
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
    if unknown := set(values) - set(HINTS):
        raise ValueError(f"{path}: unknown config key(s) {sorted(unknown)}")
    return {k: coerce(k, v) for k, v in values.items()}
