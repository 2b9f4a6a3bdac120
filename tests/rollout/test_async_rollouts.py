"""Async rollouts (rollout.mode=async): real worker processes on loopback, over the gloo link.

Exact equalities here are not tolerances that happen to pass: a worker runs the trainer's own
code on the same CPU with the same thread count (rollout.worker_threads=2, the suite's), so
its kernels see the same inputs and return the same bits; the weights travel as raw bytes.
"""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import emapg
from emapg.errors import EmapgError
from emapg.model.models import load_model_and_tokenizer
from emapg.rollout.remote import link
from emapg.rollout.remote.workers import RolloutWorkers
from emapg.training import checkpoint
from emapg.training import loop as trainer
from emapg.training.config import load_config
from emapg.training.setup import worker_spec

FAST = ["task.num_train=64", "task.num_eval=16", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=5", "algo.micro_batch_size=8", "train.progress=false",
        "train.tensorboard=false", "rollout.worker_threads=2"]  # fmt: skip
ASYNC = ["rollout.mode=async"]


def config(tmp_path, model_dir, *extra):
    return load_config(None, [f"model.path={model_dir}", f"train.output_dir={tmp_path}", *FAST, *extra])


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without(recs, *prefixes):
    return [{k: v for k, v in r.items() if not k.startswith(prefixes)} for r in recs]


@pytest.mark.slow
def test_staleness_zero_gives_the_synchronous_run(tmp_path, tiny_model_dir):
    common = ["train.steps=4", "train.eval_every=2", "train.save_every=4", "algo.old_logp=recompute"]
    trainer.train(config(tmp_path / "sync", tiny_model_dir, *common))
    trainer.train(config(tmp_path / "async", tiny_model_dir, *common, *ASYNC, "rollout.max_staleness=0"))
    sync, done = records(tmp_path / "sync" / "quickstart"), records(tmp_path / "async" / "quickstart")
    assert [r.get("rollout/version") for r in done] == [None, 0, 1, 2, 3]
    assert all(r["rollout/staleness_max"] == 0 for r in done[1:])
    assert without(sync, "time/") == without(done, "time/", "rollout/")  # eval and the anchor's too

    def weights(root):
        return load_model_and_tokenizer(str(root / "quickstart/checkpoints/step_4/policy"))[0].state_dict()

    a, b = weights(tmp_path / "sync"), weights(tmp_path / "async")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_batches_stay_within_the_staleness_bound_over_two_workers(tmp_path, tiny_model_dir):
    cfg = config(tmp_path, tiny_model_dir, *ASYNC, "rollout.max_staleness=2", "rollout.workers=2",
                 "train.steps=6", "train.eval_every=6", "train.save_every=2", "train.keep_checkpoints=3")  # fmt: skip
    trainer.train(cfg)
    steps = records(tmp_path / "quickstart")[1:]
    # The checkpoint after step 2 resumes the prompts from step 3 on (8 taken: 2 steps of 4),
    # though the batches of steps 3 and 4 had already been asked for.
    saved = json.loads((tmp_path / "quickstart/checkpoints/step_2/state.json").read_text())
    assert saved["sampler"] == {"epoch": 0, "position": 8}
    # Checked from the logged versions: a batch trained at step t was drawn with the weights after
    # `version` steps, and at most 2 steps old; the workers stay as far ahead as allowed.
    assert [t["step"] - 1 - t["rollout/version"] for t in steps] == [0, 1, 2, 2, 2, 2]
    assert all(t["rollout/staleness_max"] == t["step"] - 1 - t["rollout/version"] for t in steps)
    assert all(t["rollout/worker_tokens_per_s"] > 0 and t["time/wait_for_rollout_s"] >= 0 for t in steps)


@pytest.mark.slow
def test_pushed_weights_arrive_bit_exact(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(link, "BUCKET_BYTES", 4096)  # several buckets (the trainer cuts them)
    cfg = config(tmp_path, tiny_model_dir, *ASYNC, "rollout.workers=1")
    model = load_model_and_tokenizer(tiny_model_dir)[0]
    workers = RolloutWorkers(worker_spec(cfg), tiny_model_dir)
    try:
        g = torch.Generator().manual_seed(0)
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3)
            workers.sync_weights(model, version)
            got = workers.parameters(1)
            assert all(torch.equal(got[n], p) for n, p in model.named_parameters())
        name, first = next(iter(model.named_parameters()))
        pushed = first.detach().clone()
        with torch.no_grad():  # the same version again is not pushed
            first.add_(1.0)
        workers.sync_weights(model, 2)
        assert torch.equal(workers.parameters(1)[name], pushed)
    finally:
        workers.close()
    assert all(p.exitcode == 0 for p in workers.processes.values())


@pytest.mark.slow
def test_a_killed_worker_stops_the_run_and_the_last_checkpoint_resumes(tmp_path, tiny_model_dir, monkeypatch):
    common = [*ASYNC, "train.steps=6", "train.eval_every=6", "train.save_every=2"]
    step = trainer.training_step

    def kill_at_step_3(run, n, params):
        if n == 3:
            for process in run.engine.processes.values():
                os.kill(process.pid, signal.SIGKILL)
        return step(run, n, params)

    monkeypatch.setattr(trainer, "training_step", kill_at_step_3)
    with pytest.raises(EmapgError, match=r"rollout worker 1 stopped \(exit code -9\); the run stops here"):
        trainer.train(config(tmp_path, tiny_model_dir, *common))
    ckpts = tmp_path / "quickstart" / "checkpoints"
    assert [p.name for p in checkpoint.list_checkpoints(ckpts)] == ["step_2"]
    monkeypatch.setattr(trainer, "training_step", step)
    trainer.train(config(tmp_path, tiny_model_dir, *common), resume=True)
    recs = records(tmp_path / "quickstart")
    assert [r["step"] for r in recs] == list(range(7))
    # The resumed run keeps the bound: its first batch is drawn with the checkpoint's weights.
    assert [r["step"] - 1 - r["rollout/version"] for r in recs[1:]] == [0, 1, 0, 1, 1, 1]
    assert [p.name for p in checkpoint.list_checkpoints(ckpts)][-1] == "step_6"


@pytest.mark.slow
def test_a_worker_started_by_hand_joins_the_run(tmp_path, tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config(tmp_path, tiny_model_dir, *ASYNC, "rollout.workers=0", "rollout.remote_workers=1",
                 f"rollout.address=127.0.0.1:{port}", "train.steps=2", "train.eval_every=2")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(emapg.__file__).parents[1])}
    worker = subprocess.Popen(
        [sys.executable, "-m", "emapg", "rollout-worker", "--address", f"127.0.0.1:{port}", "--rank", "1",
         "--threads", "2"], env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        trainer.train(cfg)
        # Time limit: the test measured 13 s at load 3-4; x6 (then rounded up).
        assert worker.wait(timeout=90) == 0, worker.stderr.read()[-2000:]
    finally:
        worker.kill()
    assert [r.get("rollout/version") for r in records(tmp_path / "quickstart")] == [None, 0, 0]


@pytest.mark.slow
def test_a_worker_with_a_wrong_rank_says_so(tmp_path, tiny_model_dir):
    workers = RolloutWorkers(worker_spec(config(tmp_path, tiny_model_dir, *ASYNC)), tiny_model_dir)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "emapg", "rollout-worker", "--address", workers.address, "--rank", "2"],
            # Time limit: the test measured 19 s at load 3-4; 120 s is x6.
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        workers.close()
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"emapg: error: rank 2: the run at {workers.address} has workers of ranks 1 to 1"
    )


@pytest.mark.slow
def test_a_worker_that_cannot_start_stops_the_run_with_its_reason(tmp_path, tiny_model_dir):
    """The engine fails inside the worker (vLLM is not installed in the default environment, or
    here a missing model directory): the trainer's one line carries the worker's own."""
    cfg = config(tmp_path, tiny_model_dir, *ASYNC)
    with pytest.raises(
        EmapgError, match=r"rollout worker 1 stopped \(exit code 1\): \w+Error: .*no-such-dir"
    ):
        RolloutWorkers(worker_spec(cfg), str(tmp_path / "no-such-dir"))


@pytest.mark.parametrize(
    "extra,message",
    [
        (["algo.old_logp=engine"], "algo.old_logp=engine with rollout.mode=async"),
        (["algo.dynamic_sampling=true"], "algo.dynamic_sampling is not supported with rollout.mode=async"),
        (["lora.r=4"], "lora.r is not supported with rollout.mode=async"),
        (["rollout.workers=0"], "rollout.mode=async needs rollout.workers or rollout.remote_workers > 0"),
        (["rollout.remote_workers=1"], "rollout.remote_workers=1 need a fixed port in rollout.address"),
    ],
)
def test_unsupported_async_settings_fail_in_one_line(extra, message):
    with pytest.raises(EmapgError, match=message.replace("(", r"\(")):
        load_config(None, [*ASYNC, *extra])


def test_async_needs_one_trainer_process():
    with pytest.raises(EmapgError, match="rollout.mode=async trains in one process"):
        load_config(None, ASYNC).check_world(2)


@pytest.mark.slow
@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="the quickstart pins AVX2"
)
def test_async_quickstart_learns(tmp_path):
    """The quickstart's own warm start and settings, one step off-policy: held-out accuracy rises
    by 5 points in 40 steps (800 held-out problems: a standard error of 1.7 points). Measured:
    33.4% -> 44.6% after 20 steps when written; on an AMX Xeon, whose warm start ends elsewhere
    (tests/training/test_first_steps.py), 23.5% -> 25.6% after 20 and 31.8% after 40 (+8.3), so 40 steps."""
    out = tmp_path / "runs"
    subprocess.run(
        [sys.executable, "-m", "emapg", "train", f"train.output_dir={out}", f"warmstart.cache_dir={tmp_path}",
         "train.steps=40", "train.eval_every=20", "train.progress=false", "train.tensorboard=false",
         "rollout.mode=async", "rollout.max_staleness=1"],
        # Time limit: the test measured 350 s at load 3-4 (600 s failed at load 4-6); x6.
        check=True, capture_output=True, timeout=2100,
    )  # fmt: skip
    recs = records(out / "quickstart")
    assert recs[-1]["eval/accuracy"] >= recs[0]["eval/accuracy"] + 0.05
    assert [r["step"] - 1 - r["rollout/version"] for r in recs[1:]] == [0] + [1] * 39
