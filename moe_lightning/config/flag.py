"""A flag declared once (`Flag`), the parser that reads its environment variable, and the base of
every process's typed config (`CliConfig`: add_cli_args / from_cli_args / to_argv).

A process's config is a dataclass whose fields name their Flag (`option(FLAG, default)`) and that
inherits what every service takes (config/service.py); the field's name is the flag's dest. The
flag's type, choices and help live in the Flag; its default in the config that uses it (gpu_expert's
--device defaults to a visible GPU, `up`'s to cpu). docs/configuration.md has the whole picture.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self

ENV_PREFIX = "MOE_LIGHTNING_"
REQUIRED: Any = dataclasses.MISSING  # option(FLAG, REQUIRED): the flag must be given


@dataclass(frozen=True, eq=False)
class Flag:
    """One command-line option, declared once: every parser that offers it adds this object."""

    name: str  # "--kv-dtype"
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    action: str | None = None  # "store_true" or "append"
    nargs: str | None = None
    const: Any = None
    metavar: str | None = None
    hidden: bool = False  # set by one process for another (a rank's --tp-rank), not by people
    secret: bool = False  # never written to argv (ps shows argv): passed by environment

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def add_to(self, parser: Any, default: Any = None, required: bool = False) -> argparse.Action:
        """Adds this flag to a parser (or an argument group) with a use's default."""
        kwargs: dict[str, Any] = {"help": argparse.SUPPRESS if self.hidden else self.help}
        if self.action is not None:
            kwargs["action"] = self.action
        if self.action != "store_true":
            kwargs |= {"type": self.type, "choices": self.choices, "metavar": self.metavar}
            if self.nargs is not None:
                kwargs |= {"nargs": self.nargs, "const": self.const}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if required:
            kwargs["required"] = True
        else:
            kwargs["default"] = [] if self.action == "append" and default is None else default
        action = parser.add_argument(self.name, **kwargs)
        action.flag = self  # type: ignore[attr-defined]  # what tests/test_config_flags.py walks
        return action

    def argv(self, value: Any) -> list[str]:
        """This flag and `value` as a command line gives them (nothing for None, False or a secret)."""
        if value is None or self.secret or value is False:
            return []
        if self.action == "store_true":
            return [self.name]
        if self.action == "append":
            return [a for v in value for a in (self.name, _text(v))]
        return [self.name, _text(value)]


def _text(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)  # every bit: a rate or a timeout reads back the same
    return str(value)


class EnvDefaultsParser(argparse.ArgumentParser):
    """An ArgumentParser whose options take their default from MOE_LIGHTNING_<DEST> when set (an empty
    value counts as unset, as compose's `${VAR:-}` passes one), checked as the flag's own value would
    be: its type, and its choices. A bad value is an error as the parser is built (a service's)."""

    defer_env_errors = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_errors: list[str] = []

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        if self.env_errors:
            self.error(self.env_errors[0])
        return super().parse_known_args(args, namespace)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        action = super().add_argument(*args, **kwargs)
        _declared(action)
        _env_default(self, action)
        return action

    def add_argument_group(self, *args: Any, **kwargs: Any) -> Any:
        return _EnvGroup(super().add_argument_group(*args, **kwargs), self)

    def add_mutually_exclusive_group(self, **kwargs: Any) -> Any:
        return _EnvGroup(super().add_mutually_exclusive_group(**kwargs), self)


class CommandParser(EnvDefaultsParser):
    """A subcommand's parser: a bad environment value is its error only when this subcommand is the one
    run (`moe-lightning` builds every subcommand's parser, and MOE_LIGHTNING_QUANTIZE means nothing to
    `timeline`)."""

    defer_env_errors = True


class _EnvGroup:
    """A group of an EnvDefaultsParser whose options read the environment too."""

    def __init__(self, group: Any, parser: EnvDefaultsParser) -> None:
        self._group, self._parser = group, parser

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = self._group.add_argument(*args, **kwargs)
        _declared(action)
        _env_default(self._parser, action)
        return action

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


def _declared(action: argparse.Action) -> None:
    """Records where an option not added from a Flag is declared (the test of one declaration per flag)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename in (__file__, argparse.__file__):
        frame = frame.f_back
    action.declared_at = f"{frame.f_code.co_filename}:{frame.f_lineno}"  # type: ignore[attr-defined]


def _env_default(parser: argparse.ArgumentParser, action: argparse.Action) -> None:
    if not action.option_strings or action.dest == "help":
        return
    env = ENV_PREFIX + action.dest.upper()
    raw = os.environ.get(env)
    if raw:
        try:
            action.default = _env_value(action, raw)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            message = f"{env}={raw!r} ({action.option_strings[0]}): {exc}"
            if not getattr(parser, "defer_env_errors", False):
                parser.error(message)
            parser.env_errors.append(message)  # type: ignore[attr-defined]
            return
        action.required = False
    if action.help and action.help is not argparse.SUPPRESS:
        action.help += f" [env {env}]"


def _env_value(action: argparse.Action, raw: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        return raw.lower() in ("1", "true", "yes", "on")
    if isinstance(action, argparse._AppendAction):
        return [_one(action, v) for v in raw.split(",")]
    return _one(action, raw)


def _one(action: argparse.Action, raw: str) -> Any:
    value = action.type(raw) if callable(action.type) else raw
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}")
    return value


def _is_default(f: dataclasses.Field[Any], value: Any) -> bool:
    if f.default is not dataclasses.MISSING:
        return bool(value == f.default)
    if f.default_factory is not dataclasses.MISSING:
        return bool(value == f.default_factory())
    return False  # a required field: always given


def option(flag: Flag, default: Any = None) -> Any:
    """A config field set by `flag` (default: this use's; REQUIRED: the flag must be given)."""
    if default is REQUIRED:
        return dataclasses.field(metadata={"flag": flag})
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"flag": flag})
    return dataclasses.field(default=default, metadata={"flag": flag})


class CliConfig:
    """The base of a process's typed config. Subclasses are `@dataclass(kw_only=True)`."""

    @classmethod
    def options(cls) -> Iterator[tuple[dataclasses.Field[Any], Flag]]:
        """(field, flag) of every flag of this config."""
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if "flag" in f.metadata:
                yield f, f.metadata["flag"]

    @classmethod
    def add_cli_args(cls, parser: Any, exclude: Sequence[str] = (), defaults: dict[str, Any] | None = None) -> None:
        """Adds this config's flags (less `exclude`) to `parser`; `defaults` replaces fields' defaults
        known only at run time (an internal service's socket under $XDG_RUNTIME_DIR)."""
        defaults = defaults or {}
        for f, flag in cls.options():
            if f.name in exclude:
                continue
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            default = None if required else f.default_factory() if f.default is dataclasses.MISSING else f.default
            flag.add_to(parser, default=defaults.get(f.name, default), required=required and f.name not in defaults)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **overrides: Any) -> Self:
        """This config from parsed flags (flags the parser lacks keep their defaults); `overrides` win."""
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if "flag" in f.metadata and hasattr(ns, f.name):
                kwargs[f.name] = getattr(ns, f.name)
        return cls(**(kwargs | overrides))

    def to_argv(self, explicit: Collection[str] = ()) -> list[str]:
        """The command line that gives this config back: the values other than the defaults, and those
        of `explicit` fields even at their default (a value left at its default lets the process's
        environment decide, as it would by hand); secrets never (those go by environment: ps shows argv)."""
        out: list[str] = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if "flag" in f.metadata and (f.name in explicit or not _is_default(f, value)):
                out += f.metadata["flag"].argv(value)
        return out

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]
