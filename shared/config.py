"""Fill a service's config dataclass from CLI flags, environment variables and a TOML file.

Precedence: CLI flag > environment variable (`PDSERVE_<SERVICE>_<SETTING>`, e.g. PDSERVE_ROUTER_PORT) > TOML file >
field default. Setting names map to flags with dashes (`kv_dtype` → `--kv-dtype`). List fields take
comma-separated values in the environment and repeated or comma-separated flags on the CLI; a boolean setting is a
switch: `--insecure` / `--no-insecure` (`--insecure true|false` works too).

A field made with `nested(SubConfig, ...)` holds a dataclass of its own (e.g. a service's `engine: EngineConfig`):
its fields are settings of the outer config under their own names (`--page-size`, `PDSERVE_DECODE_PAGE_SIZE`, not
`--engine-page-size`), with the outer config's defaults, help texts and names for some of them. Setting names are
unique across the whole tree.

A dataclass with a `config` field also reads a TOML file (`--config FILE` or its env variable) as the layer
between the environment and the defaults: top-level keys are setting names; a table may group them
(`[pcs] w_in = 0.3` sets `pcs_w_in` when that setting exists, else `w_in`). Unknown keys are an error.

Validation: after filling, `cfg.validate()` runs when the class has one; a ValueError it raises (a nested config's
own check, e.g. EngineConfig.validate) ends the program with its message, setting names written as flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def opt(default: Any, help: str) -> Any:
    """A dataclass field with CLI help text."""
    return dataclasses.field(default=default, metadata={"help": help})


def nested(
    cls: type,
    *,
    defaults: Mapping[str, Any] | None = None,
    names: Mapping[str, str] | None = None,
    helps: Mapping[str, str] | None = None,
) -> Any:
    """A field holding a `cls` whose fields are settings of the outer config. `defaults`: the outer config's
    defaults for some of them (by field name); `names`: setting names that differ from the field names (e.g.
    {"model_dir": "model"}); `helps`: help texts that differ from the field's own."""
    values = dict(defaults or {})
    return dataclasses.field(
        default_factory=lambda: cls(**values),
        metadata={"nested": cls, "defaults": values, "names": dict(names or {}), "helps": dict(helps or {})},
    )


@dataclasses.dataclass(frozen=True)
class Setting:
    """One flag / env variable / TOML key of a config tree."""

    name: str  # kv_dtype: --kv-dtype, <PREFIX>KV_DTYPE, TOML key kv_dtype
    path: tuple[str, ...]  # attributes from the outer config to the field: ("engine", "kv_dtype")
    type: Any
    default: Any  # dataclasses.MISSING when the field has none
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def env(self, prefix: str) -> str:
        return prefix + self.name.upper()


def settings(cls: type) -> list[Setting]:
    """Every setting of `cls`, nested configs' fields included (see the module docstring)."""
    hints = typing.get_type_hints(cls)
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False:
            continue
        sub = f.metadata.get("nested")
        if sub is None:
            out.append(Setting(f.name, (f.name,), hints[f.name], _default(f), f.metadata.get("help", "")))
            continue
        defaults, names, helps = f.metadata["defaults"], f.metadata["names"], f.metadata["helps"]
        for s in settings(sub):
            key = s.path[0] if len(s.path) == 1 else None  # the outer config overrides its direct fields only
            out.append(
                dataclasses.replace(
                    s,
                    name=names.get(key, s.name),
                    path=(f.name, *s.path),
                    default=defaults.get(key, s.default),
                    help=helps.get(key, s.help),
                )
            )
    seen: set[str] = set()
    for s in out:
        if s.name in seen:
            raise TypeError(f"{cls.__name__}: two settings named {s.name!r}")
        seen.add(s.name)
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


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


def _is_list(s: Setting) -> bool:
    return typing.get_origin(s.type) in (list, tuple)


class Switch(argparse.Action):
    """A yes/no flag `--x [true|false]`: alone it means true; a value is read as the environment reads one
    (1/0, yes/no, on/off too). Its `--no-x` twin (a store_const) means false."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs="?", metavar="true|false", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            setattr(namespace, self.dest, "true" if values is None else str(_parse_value(bool, str(values))).lower())
        except ValueError as e:
            parser.error(f"{option_string}: {e}")


def shown_default(s: Setting) -> str:
    """A setting's default as help texts show it."""
    if s.default is dataclasses.MISSING:
        return "required"
    if s.type is bool:
        return "on" if s.default else "off"
    if isinstance(s.default, (list, tuple)):
        return ",".join(map(str, s.default)) or "none"
    return repr(s.default) if s.default == "" else str(s.default)


def add_dataclass_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    only: Callable[[Setting], bool] | None = None,
    env_prefix: str | None = None,
) -> None:
    """Add one `--flag` per setting of `cls` (those `only` accepts); help text comes from field metadata['help'],
    followed by the default and the environment variable (`env_prefix` + NAME; a `<SERVICE>` placeholder in it is
    shown as is). A boolean setting is a switch: `--x [true|false]` (`Switch`) and `--no-x`. Every flag defaults
    to None (not given), so that the environment, the file and the defaults fill the rest."""
    for s in settings(cls):
        if only is not None and not only(s):
            continue
        where = f"; ${s.env(env_prefix)}" if env_prefix else ""
        help_text = f"{s.help} (default: {shown_default(s)}{where})".replace("%", "%%")
        if s.type is bool:
            parser.add_argument(s.flag, dest=s.name, default=None, help=help_text, action=Switch)
            no = "--no-" + s.flag[2:]
            parser.add_argument(
                no, dest=s.name, default=None, action="store_const", const="false", help="= " + s.flag + " false"
            )
            continue
        extra: dict[str, Any] = {"action": "append"} if _is_list(s) else {}
        parser.add_argument(s.flag, dest=s.name, default=None, help=help_text, metavar=s.name.upper(), **extra)


def given_flags(args: argparse.Namespace, chosen: list[Setting]) -> list[str]:
    """The flags of the `chosen` settings given in `args`, as command-line arguments for another process."""
    out: list[str] = []
    for s in chosen:
        value = getattr(args, s.name, None)
        for v in value if isinstance(value, list) else [] if value is None else [value]:
            out += [s.flag, str(v)]
    return out


def config_from(
    cls: type[T], args: argparse.Namespace | None, env_prefix: str, environ: Mapping[str, str] | None = None
) -> T:
    """Build `cls` from parsed CLI args (None entries = not given), then env, then file, then defaults."""
    if environ is None:
        environ = os.environ
    table = settings(cls)
    path = (getattr(args, "config", None) if args is not None else None) or environ.get(f"{env_prefix}CONFIG")
    from_file = file_values(cls, path) if path and any(s.name == "config" for s in table) else {}
    given: dict[tuple[str, ...], Any] = {}
    for s in table:
        cli = getattr(args, s.name, None) if args is not None else None
        raw = ",".join(map(str, cli)) if isinstance(cli, list) else None if cli is None else str(cli)
        if raw is None:
            raw = environ.get(s.env(env_prefix), from_file.get(s.name))
        if raw is None:
            continue
        try:
            given[s.path] = _parse_value(s.type, raw)
        except (TypeError, ValueError) as e:
            raise SystemExit(f"invalid value for {s.name}: {e}") from None
    cfg = _build(cls, given, {})
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as e:
            raise SystemExit(in_flag_terms(table, str(e))) from None
    return cfg


def _build(cls: type, given: Mapping[tuple[str, ...], Any], defaults: Mapping[str, Any]) -> Any:
    kwargs = dict(defaults)
    for f in dataclasses.fields(cls):
        sub = f.metadata.get("nested")
        if sub is not None:
            inner = {p[1:]: v for p, v in given.items() if p[0] == f.name}
            kwargs[f.name] = _build(sub, inner, f.metadata["defaults"])
        elif (f.name,) in given:
            kwargs[f.name] = given[(f.name,)]
    return cls(**kwargs)


def in_flag_terms(table: list[Setting], message: str) -> str:
    """`message` with the field names of `table`'s settings written as their flags ("page_size must be > 0" →
    "--page-size must be > 0"), so that a nested config's own check speaks the command line's language."""
    flags = {s.path[-1]: s.flag for s in table if "_" in s.path[-1]}  # not plain words such as "device"
    return re.sub(r"\b[a-z][a-z0-9]*_[a-z0-9_]*\b", lambda m: flags.get(m.group(0), m.group(0)), message)


def file_values(cls: type, path: str) -> dict[str, str]:
    """Setting values (as strings, parsed like env values) from a TOML file; see the module docstring."""
    import tomllib
    from pathlib import Path

    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SystemExit(f"cannot read config file {path}: {e}") from None
    names = {s.name for s in settings(cls)} - {"config"}
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
