"""The docs stay true to the code: generated pages are fresh, links resolve, hints name real extras."""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from emapg.training.config_reference import REGENERATE, markdown_reference

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "benchmarks").glob("*.md")),
]


def test_configuration_reference_is_up_to_date():
    page = ROOT / "docs" / "configuration.md"
    assert page.is_file(), f"docs/configuration.md is missing; generate it: {REGENERATE}"
    assert page.read_text() == markdown_reference(), (
        f"docs/configuration.md is stale (the config's fields or help strings changed); regenerate it: {REGENERATE}"
    )


@pytest.mark.slow
def test_regenerate_command_prints_the_reference():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [sys.executable, "-m", "emapg.training.config_reference"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert out == markdown_reference()


def test_reference_lists_every_field_of_every_section_and_choice_once():
    """A table per section, and per registered task and engine with settings of their own; every
    field of each settings class once in its table."""
    from emapg.training.config import SELECTED, Config

    text = markdown_reference()
    tables = {block.split("\n", 1)[0]: block for block in re.split(r"\n#{2,3} ", text)[1:]}
    for name, field in Config.model_fields.items():
        if name not in SELECTED:
            classes = {name: field.default_factory}
        else:
            registry, key = SELECTED[name]
            classes = {name: registry.base} | {f"{name}.{key}={c}": e.config for c, e in registry.items()}
        for title, cls in classes.items():
            own = [f for f in cls.model_fields if title == name or f not in classes[name].model_fields]
            if own:
                assert title in tables, title
            for f in own:
                assert tables[title].count(f"| `{name}.{f}` |") == 1, f"{title}: {name}.{f}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links only outside code blocks
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"


def test_install_hints_name_defined_extras():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    files = [*SRC.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"), *PAGES]
    for file in files:
        for extra in re.findall(r"emapg\[([\w,-]+)\]", file.read_text()):
            for name in extra.split(","):
                assert name in extras, (
                    f"{file.relative_to(ROOT)} names the extra emapg[{name}], not in pyproject.toml"
                )


def test_readme_quick_start():
    readme = (ROOT / "README.md").read_text()
    assert "python3 -m pip install -e . && emapg train" in readme
    assert 'python3 -m pip install -e ".[dev]" && python3 -m pytest' in readme
    assert "eval/accuracy A% before training -> B% after (+C points); run: runs/quickstart" in readme


# Time limit: the longest run, the TRL example's, measured 111 s at load 3-4; x6 (then rounded up).
def _run(
    cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 720
) -> subprocess.CompletedProcess:
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        cmd, cwd=cwd, env={**environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_readme_custom_rewards_command_runs_as_written(tmp_path):
    """The README's `task.reward_fns=[my_rewards:exact]`: a module in the current directory, as
    `python -m` finds one (it failed with "cannot import 'my_rewards'")."""
    line = next(s for s in (ROOT / "README.md").read_text().splitlines() if "my_rewards:exact" in s)
    command = line.split("#")[0].split()
    (tmp_path / "my_rewards.py").write_text(
        "def exact(completions, answer, **kwargs):\n"
        "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"
    )
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fast = ["train.steps=1", "task.num_eval=4", "eval.samples=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=3", "warmstart.steps=2", "warmstart.target_accuracy=0",
            f"warmstart.cache_dir={tmp_path / 'cache'}", "train.progress=false", "train.tensorboard=false"]  # fmt: skip
    script = shutil.which(command[0])  # the console script: its sys.path, unlike `python -m`'s, lacks the cwd
    assert script, "the emapg script is not installed (pip install -e .)"
    done = _run([script, *command[1:], *fast], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "run: runs/quickstart" in done.stdout


@pytest.mark.slow
def test_trl_doc_example_runs_as_written(smollm2, tmp_path):
    """docs/trl.md's example, as written (it failed on 'path/to/local/model'); the converted
    SmolLM2 of this session is reached through the default cache of a temporary HOME."""
    pytest.importorskip("trl")
    code = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "trl.md").read_text(), flags=re.S).group(1)
    cache, _ = smollm2
    home = tmp_path / "home"
    (home / ".cache" / "emapg").mkdir(parents=True)
    (home / ".cache" / "emapg" / "gguf").symlink_to(cache / "gguf")
    done = _run([sys.executable, "-c", code], tmp_path, env={"HOME": str(home), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    (checkpoint,) = (tmp_path / "runs" / "trl-ema-pg").glob("checkpoint-2")
    assert (checkpoint / "anchor.safetensors").is_file()
