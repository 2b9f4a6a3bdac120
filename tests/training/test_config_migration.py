"""Every shipped config loads to the values it had before the settings moved into their parts.

tests/data/shipped_configs_before.json holds each shipped config as the previous build loaded it
(its dataclass config, every field) and that build's defaults. Since then the search task's
`retriever` section is part of the `task` section, and a task's or an engine's section holds
only its own settings: a field of another task (or of vLLM in an hf run) is gone from the
config, which is right only if the old config left it at its default (nothing set is dropped).
"""

import json
import sys

import pytest

from emapg.tasks import TASKS
from emapg.training.config import CONFIG_DIR, load_config
from helpers import DATA, ROOT, placeholders

BEFORE = json.loads((DATA / "shipped_configs_before.json").read_text())
# Fields added since, at the value that does what the previous build did (arithmetic's operators:
# "+" was fixed; the policy-gradient menu's choices), the dual clip verl applies (issue 30), and
# evaluation's additions (issues 27, 28), off unless set, and the search client's limits (issue
# 29: queries cut at the server's default cap, a busy server retried for ten minutes), and the real
# model's (issue 39: where GGUF models are converted, no warm start of a pretrained model, the
# math task's word problems), and a group's prompt computed once (issue 42: the values the previous
# build computed, to float32 rounding).
NEW = {"task.ops": ["+"], "algo.loss": "ppo_clip", "algo.ratio_level": "token", "algo.dual_clip": 3.0,
       "algo.dynamic_sampling": False, "algo.max_sampling_rounds": 10, "algo.overlong_buffer": 0,
       "algo.overlong_penalty": 1.0, "eval.anchor": "auto", "eval.kl": False, "eval.datasets": [],
       "task.max_query_chars": 1000, "task.busy_timeout_s": 600.0, "rollout.mode": "sync",
       "rollout.max_staleness": 1, "rollout.workers": 1, "rollout.remote_workers": 0,
       "rollout.worker_threads": 0, "rollout.address": "127.0.0.1:0", "rollout.worker_timeout_s": 600.0,
       "model.cache_dir": "~/.cache/emapg", "warmstart.pretrained": False, "task.samples": "word_problems",
       "algo.share_prompts": True, "train.allow_lost_updates": False}  # fmt: skip
# model.dtype set weights and compute alike; it is train.precision now (issue 54), where the configs
# meant for GPUs moved on purpose from pure bfloat16 to float32 master weights (bf16-mixed), which
# the paper's own trainer (verl's FSDP actor) runs.
PRECISION_OF = {"float32": "fp32", "bfloat16": "bf16-true"}
NOW_MIXED = {"math_qwen", "search_qwen", *(f"paper/{p.stem}" for p in (CONFIG_DIR / "paper").glob("*.yaml"))}


def flat(config: dict) -> dict:
    return {f"{section}.{key}": value for section, values in config.items() for key, value in values.items()}


def moved(old: dict) -> dict:
    """The old fields under today's names: a search run's retriever.* are its task.* now, and
    model.dtype is train.precision."""
    search = old["task.name"] == "search"
    out = {k: v for k, v in old.items() if not k.startswith("retriever.") and k != "model.dtype"}
    out["train.precision"] = PRECISION_OF[old["model.dtype"]]
    for key, value in old.items():
        if key.startswith("retriever."):
            field = key.replace("retriever.", "task.")
            out[field if search else key] = value
    return out


@pytest.fixture
def calculator_registered(monkeypatch):
    """The calculator example's task, which its module registers (`--import`), for one test."""
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "calculator"))
    with TASKS.registered("calculator", lambda cfg: None):
        __import__("calculator")
        yield
    sys.modules.pop("calculator", None)


@pytest.mark.parametrize("name", sorted(BEFORE["configs"]))
def test_shipped_config_loads_to_the_values_it_had(name, tmp_path, monkeypatch, calculator_registered):
    monkeypatch.chdir(ROOT)  # the examples name their files from the repository's root
    path = ROOT / name if name.startswith("examples/") else CONFIG_DIR / f"{name}.yaml"
    entry = BEFORE["configs"][name]
    placeholder_keys = [k.replace("retriever.", "task.") for k in entry["overrides"]]  # set per machine
    overrides = placeholders(path, tmp_path) if placeholder_keys else []
    assert sorted(o.split("=")[0] for o in overrides) == sorted(placeholder_keys)
    new = flat(json.loads(json.dumps(load_config(str(path), overrides).model_dump())))
    old, defaults = moved(flat(entry["values"])), moved(flat(BEFORE["defaults"]))
    if name in NOW_MIXED:
        assert old["train.precision"] == "bf16-true", name
        old["train.precision"] = "bf16-mixed"
    same_task = old["task.name"] == new["task.name"]
    for key, value in new.items():
        if key in placeholder_keys or (key.startswith("task.") and not same_task):
            continue
        assert key in old or key in NEW, f"{name}: {key} is new"
        assert value == old.get(key, NEW.get(key)), f"{name}: {key}"
    for key, value in old.items():
        if key not in new and key not in placeholder_keys and (same_task or not key.startswith("task.")):
            assert value == defaults.get(key, value), f"{name}: {key}={value!r} was set and is gone"
