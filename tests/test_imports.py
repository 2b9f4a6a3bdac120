"""What a run imports: a run that is not math imports neither math-verify nor emapg's grader.
(SymPy itself is imported by torch.distributed.tensor, which transformers' model loading
imports, so no emapg change can keep it out.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import emapg
from helpers import FAST

RUN = """
import json, sys
import emapg
emapg.train(None, sys.argv[1:])
print(json.dumps([name for name in ("math_verify", "emapg.tasks.math_grader") if name in sys.modules]))
"""


@pytest.mark.slow
def test_an_arithmetic_run_imports_no_math_grading(tmp_path, tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(Path(emapg.__file__).parents[1])}
    args = [f"model.path={tiny_model_dir}", f"train.output_dir={tmp_path}", *FAST, "train.steps=1"]
    # Time limit: the test measured 13 s at load 3-4; 300 s is over x20.
    done = subprocess.run(
        [sys.executable, "-c", RUN, *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
