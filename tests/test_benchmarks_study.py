"""benchmarks/study.py's run_one, which every study and grid trains through: a finished run is
reused, and a run is reused or resumed only under the settings it was trained with."""

import json
import sys

import pytest
import yaml

from emapg.training.config import load_config
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from study import run_one  # noqa: E402


def finished_run(out, name, overrides):
    """A run folder as a finished run leaves it: its config.yaml and wall_time.json's steps."""
    cfg = load_config("quickstart", [*overrides, f"train.name={name}", f"train.output_dir={out}"])
    (out / name).mkdir(parents=True)
    (out / name / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    (out / name / "wall_time.json").write_text(json.dumps({"seconds": 1.0, "steps": cfg.train.steps}))


def test_a_finished_run_is_reused_only_under_its_own_settings(tmp_path):
    finished_run(tmp_path / "a", "r", ["optim.lr=1e-4"])
    assert run_one("r", "quickstart", ["optim.lr=1e-4"], tmp_path / "a") == 0.0  # reused, not trained
    (tmp_path / "a").rename(tmp_path / "moved")  # a grid's folder may move and still be reused
    assert run_one("r", "quickstart", ["optim.lr=1e-4"], tmp_path / "moved") == 0.0
    with pytest.raises(SystemExit, match=r"other settings .*optim\.lr: 0\.0001 -> 0\.0003"):
        run_one("r", "quickstart", ["optim.lr=3e-4"], tmp_path / "moved")
