"""Fill a service's config dataclass from CLI flags and environment variables.

Precedence: CLI flag > environment variable (`PDSERVE_<SERVICE>_<FIELD>`, e.g. PDSERVE_ROUTER_PORT) >
field default. Field names map to flags with dashes (`kv_dtype` → `--kv-dtype`). List fields take
comma-separated values in the environment and repeated or comma-separated flags on the CLI.

A dataclass with a `config` field also reads a TOML file (`--config FILE` or its env variable) as the layer
between the environment and the defaults: top-level keys are field names; a table may group them
(`[pcs] w_in = 0.3` sets `pcs_w_in` when that field exists, else `w_in`). Unknown keys are an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def _field_type(cls: type, field: dataclasses.Field) -> Any:
    hints = typing.get_type_hints(cls)
    return hints[field.name]


def _parse_value(tp: Any, raw: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (inner,) = typing.get_args(tp)[:1]
        return [_parse_value(inner, part.strip()) for part in raw.split(",") if part.strip()]
    if origin is typing.Union or str(origin) == "types.UnionType":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if raw.lower() in ("", "none") else _parse_value(args[0], raw)
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    return tp(raw)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one `--flag` per dataclass field; help text comes from field metadata['help']."""
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(
            flag,
            dest=f.name,
            default=None,
            action="append" if _is_list(cls, f) else "store",
            help=f.metadata.get("help", ""),
            metavar=f.name.upper(),
        )


def _is_list(cls: type, f: dataclasses.Field) -> bool:
    return typing.get_origin(_field_type(cls, f)) in (list, tuple)


def config_from(
    cls: type[T], args: argparse.Namespace | None, env_prefix: str, environ: Mapping[str, str] | None = None
) -> T:
    """Build `cls` from parsed CLI args (None entries = not given), then env, then defaults."""
    if environ is None:
        environ = os.environ
    values: dict[str, Any] = {}
    path = (getattr(args, "config", None) if args is not None else None) or environ.get(f"{env_prefix}CONFIG")
    from_file = file_values(cls, path) if path and any(f.name == "config" for f in dataclasses.fields(cls)) else {}
    for f in dataclasses.fields(cls):
        tp = _field_type(cls, f)
        cli = getattr(args, f.name, None) if args is not None else None
        env = environ.get(f"{env_prefix}{f.name.upper()}")
        try:
            if cli is not None:
                values[f.name] = _parse_value(tp, ",".join(cli)) if isinstance(cli, list) else _parse_value(tp, cli)
            elif env is not None:
                values[f.name] = _parse_value(tp, env)
            elif f.name in from_file:
                values[f.name] = _parse_value(tp, from_file[f.name])
        except (TypeError, ValueError) as e:
            raise SystemExit(f"invalid value for {f.name}: {e}") from None
    cfg = cls(**values)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg


def file_values(cls: type, path: str) -> dict[str, str]:
    """Field values (as strings, parsed like env values) from a TOML file; see the module docstring."""
    import tomllib
    from pathlib import Path

    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SystemExit(f"cannot read config file {path}: {e}") from None
    names = {f.name for f in dataclasses.fields(cls)} - {"config"}
    out: dict[str, str] = {}
    for key, value in data.items():
        items = (
            [(f"{key}_{k}" if f"{key}_{k}" in names else k, v, f"[{key}] {k}") for k, v in value.items()]
            if isinstance(value, dict)
            else [(key, value, key)]
        )
        for name, v, where in items:
            if name not in names:
                raise SystemExit(f"config file {path}: unknown setting {where!r}")
            if isinstance(v, dict):
                raise SystemExit(f"config file {path}: {where!r} must be a value, not a table")
            out[name] = ",".join(str(x) for x in v) if isinstance(v, list) else str(v)
    return out
