"""The reference of every config field, from the settings classes: `emapg train --help` and
docs/configuration.md (`python -m emapg.training.config_reference > docs/configuration.md`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, get_args, get_origin

import yaml

from emapg.settings import Section
from emapg.training.config import SELECTED, Config, read_config

REGENERATE = "python -m emapg.training.config_reference > docs/configuration.md"


def reference() -> Iterator[tuple[str, str, list[tuple[str, object, str]]]]:
    """(title, intro, [(field, default, help)]) per section and, for the sections a registry
    picks, per registered choice with settings of its own (`task.name=math`)."""

    def rows(name: str, fields: dict) -> list[tuple[str, object, str]]:
        return [
            (f"{name}.{k}", f.get_default(call_default_factory=True), _help(f)) for k, f in fields.items()
        ]

    for name, field in Config.model_fields.items():
        if name not in SELECTED:
            cls = field.default_factory
            yield name, _intro(cls), rows(name, cls.model_fields)
            continue
        registry, key = SELECTED[name]
        common = registry.base.model_fields
        yield name, _intro(registry.base), rows(name, {key: common[key], **common})  # the pick first
        for choice, entry in registry.items():
            own = {k: f for k, f in entry.config.model_fields.items() if k not in registry.base.model_fields}
            if own:
                yield f"{name}.{key}={choice}", _intro(entry.config), rows(name, own)


def _intro(cls: type[Section]) -> str:
    return " ".join((cls.__doc__ or "").split("\n\n")[0].split())


def _help(field) -> str:
    """The field's help, and its choices when it is one of a few names."""
    args = get_args(field.annotation) if get_origin(field.annotation) is Literal else ()
    return field.description + (f" [{' | '.join(args)}]" if args else "")


def help_text() -> str:
    """Every field with its default and meaning, for `emapg train --help`; where the quickstart
    (what a plain `emapg train` runs) sets a field to another value, that value too."""
    quickstart = {f"{s}.{k}": v for s, values in read_config("quickstart").items() for k, v in values.items()}
    lines = []
    for title, _, rows in reference():
        lines.append(f"{title}:")
        for name, default, text in rows:
            given = quickstart.get(name, default)
            also = f" (quickstart: {given!r})" if given != default else ""
            lines.append(f"  {name} = {default!r}{also}  -- {text}")
    return "\n".join(lines)


def _md_value(value) -> str:
    """A default as one would write it in a YAML file or an override, in a code span."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = value if value else '""'
    elif isinstance(value, list | dict):
        text = yaml.safe_dump(value, default_flow_style=True).strip()
    else:
        text = repr(value)
    return "`" + text.replace("|", "\\|") + "`"


def _md_text(text: str) -> str:
    """Help text in a table cell: no raw |, <, > or * for the markdown renderer to take."""
    for raw, escaped in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*")):
        text = text.replace(raw, escaped)
    return text


def markdown_reference() -> str:
    """docs/configuration.md: every section as a table of field, default and meaning."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the settings classes; do not edit. Regenerate: {REGENERATE} -->",
        "",
        "Each part of emapg declares its own section next to its code (`kl.KLSettings`,",
        "`anchor.AnchorSettings`, each task's settings ...); `emapg.training.config.Config` composes them.",
        f"This page is generated from those classes. Regenerate it with `{REGENERATE}`;",
        "`tests/test_docs.py` fails when it is stale.",
        "",
        "A run's config is built in three layers: the defaults below, then a YAML file",
        "(`--config NAME` for a shipped config in `src/emapg/configs/`, or a path), then dotted",
        "overrides on the command line (`kl.k=16 anchor.eta=0.95`). A YAML file mirrors the",
        "sections (`kl: {estimator: topk, k: 32}`); override values are read as YAML",
        "(`task.train_files=[a.jsonl,b.jsonl]`). The `task` section holds the settings every task",
        "has and then those of the task `task.name` picks; `rollout` likewise by `rollout.engine`.",
        "An unknown key, a wrong type or an out-of-range value stops with one line naming the",
        "field. `emapg train --help` prints the same list.",
        "",
    ]
    for title, intro, rows in reference():
        lines += [f"{'###' if '=' in title else '##'} {title}", "", _md_text(intro), ""]
        lines += ["| field | default | meaning |", "|---|---|---|"]
        lines += [f"| `{name}` | {_md_value(default)} | {_md_text(text)} |" for name, default, text in rows]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_reference(), end="")
