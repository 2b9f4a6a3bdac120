"""Typed settings: the base every config section builds on, and registries that carry them.

Each part of emapg declares its own section next to its code (`kl.KLSettings`,
`anchor.AnchorSettings`, `rollout.base.RolloutSettings`, each task's settings ...) as a
`Section`: a pydantic model whose fields carry their default, one line of help, their type
(strict: an int is no bool, a name is one of a `Literal`'s values) and their range
(`ge=`, `gt=` ...), and whose validators hold the rules that join several of its fields.
`emapg.training.config` composes the sections into the run's `Config`. Why pydantic: it already does
what the hand-written parser did (coercion, ranges, choices, nested lists) and reports where
each error is, which becomes our one line naming the field; docs/design.md says more.

A `Registry` maps a name (a task, an engine) to its factory and its settings class: the
config section of `task` is the class that `task.name` registered.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from emapg.errors import EmapgError


def _number(value):
    """YAML reads 1e-3 (no dot) as a string: a number written that way is still a number."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


Float = Annotated[float, BeforeValidator(_number)]  # a float setting: ints and 1e-3 accepted


def setting(default: Any, help: str, **constraints) -> Any:
    """A field: its default, one line of help (`emapg train --help`, docs/configuration.md) and
    pydantic's constraints (ge=0, le=1 ...). Lists and dicts get a fresh copy per instance."""
    if isinstance(default, list | dict):
        return Field(default_factory=lambda: type(default)(default), description=help, **constraints)
    return Field(default, description=help, **constraints)


class Section(BaseModel):
    """A config section: strict types, no unknown keys, finite numbers, checked on assignment too.

    `key` is the section's name in the config (`kl`), which messages name fields by."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=True)
    key: ClassVar[str] = ""


def check(ok: bool, message: str) -> None:
    """A rule of a section's validator: `message` names the field (`kl.iw_clip must ...`)."""
    if not ok:
        raise ValueError(message)


def exists(path: str, file: bool = False) -> bool:
    """Whether `path` (with ~) names an existing file (or, file False, anything)."""
    try:  # "~nobody/x" (unknown user) raises instead of answering False
        found = Path(path).expanduser()
    except RuntimeError:
        return False
    return found.is_file() if file else found.exists()


def existing_paths(paths: list[str], where: str) -> None:
    """A section rule: every path of the list `where` names exists."""
    for path in paths:
        check(exists(path), f"{where}: {path!r} does not exist")


def suggest(name: str, options, prefix: str = "") -> str:
    """The option that extends `name` (a renamed value: seq_mean -> seq_mean_token_mean), else the
    closest spelling, as a hint; `prefix` makes it the name to type (`kl.` + `k`)."""
    longer = [o for o in options if str(o).startswith(name)] if name else []
    close = longer or difflib.get_close_matches(name, [str(o) for o in options], n=1)
    return f" (did you mean {prefix + str(close[0])!r}?)" if close else ""


def one_line(error: ValidationError, prefix: str, names: dict[str, str] | None = None) -> EmapgError:
    """The first error of a validation as one line naming the field: `prefix.field`, or what
    `names` calls the field (another API's name for the same setting)."""
    e = error.errors(include_url=False)[0]
    loc = list(e["loc"])
    if loc and names and loc[0] in names:
        prefix, loc[0] = names[loc[0]], ""
    where = prefix + "".join(
        f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc if part != ""
    )
    if e["type"] == "extra_forbidden":
        return EmapgError(f"unknown config key {where!r}")
    if e["type"] == "value_error":  # a rule (`check`): a section's names its fields itself
        message = str(e["ctx"]["error"])
        return EmapgError(f"{where}: {message}" if e["loc"] and not message.startswith(where) else message)
    if e["type"] == "literal_error":
        choices = e["ctx"]["expected"].replace("'", "").replace(" or ", ", ")
        value = str(e["input"])
        return EmapgError(
            f"{where}: unknown {value!r}{suggest(value, choices.split(', '))}; expected one of {choices}"
        )
    return EmapgError(f"{where}: {e['msg'][0].lower()}{e['msg'][1:]}; got {e['input']!r:.80}")


def validated(cls: type[Section], values: dict, prefix: str, names: dict[str, str] | None = None) -> Section:
    """`cls` built from `values`; the first problem as one line naming `prefix.field` (or
    `names[field]`)."""
    try:
        return cls.model_validate(values)
    except ValidationError as e:
        raise one_line(e, prefix, names) from None


@dataclass
class Entry:
    """What a registry keeps under a name: how to build the thing, its settings, optional hooks."""

    factory: Callable
    config: type[Section]
    hooks: dict[str, Callable] = field(default_factory=dict)


class Registry:
    """Names -> (factory, settings class, hooks), for the section `setting` selects (`task.name`)."""

    def __init__(self, setting: str, base: type[Section]):
        self.setting, self.base = setting, base
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, factory: Callable, config: type[Section] | None = None, **hooks) -> None:
        """`setting=name` builds with `factory`; its section is `config` (a subclass of the base
        section; default: the base alone). A later call replaces the entry."""
        if not name or not isinstance(name, str):
            raise EmapgError(f"register: expected a non-empty name for {self.setting}, got {name!r}")
        config = config or self.base
        if not (isinstance(config, type) and issubclass(config, self.base)):
            raise EmapgError(f"register {name!r}: config must subclass {self.base.__name__}, got {config!r}")
        self._entries[name] = Entry(factory, config, {k: v for k, v in hooks.items() if v is not None})

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __getitem__(self, name: str) -> Entry:
        if not isinstance(name, str) or name not in self._entries:  # a YAML list or number too
            raise EmapgError(
                f"{self.setting}: unknown {name!r}{suggest(str(name), self._entries)}; "
                f"registered: {', '.join(self.names())}"
            )
        return self._entries[name]

    def items(self) -> Iterator[tuple[str, Entry]]:
        return iter(sorted(self._entries.items()))

    @contextmanager
    def registered(self, name: str, factory: Callable, config: type[Section] | None = None, **hooks):
        """`register` for the duration of a `with` block; the registry is as it was afterwards."""
        saved = self._entries.get(name)
        self.register(name, factory, config, **hooks)
        try:
            yield
        finally:
            if saved is None:
                self._entries.pop(name, None)
            else:
                self._entries[name] = saved
