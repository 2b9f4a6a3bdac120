"""LoRA (lora.r > 0): only the policy adapter trains, the base stays bit-identical, the EMA
anchor is an adapter following the formula, the frozen anchor is the base, the anchor's memory
is the adapter's bytes, resume is exact and the saved policy is the merged model.

The tiny random model earns no reward, so the runs here use the k1 estimator, whose sampled
gradient is non-zero even where policy and anchor agree: the adapters do move."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from emapg.errors import EmapgError
from emapg.model import lora
from emapg.model.lora import TARGETS
from emapg.model.models import load_model_and_tokenizer
from emapg.training import loop as trainer
from emapg.training.config import load_config

pytest.importorskip("peft")

ARGS = ["task.num_train=32", "task.num_eval=4", "eval.samples=1", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.max_new_tokens=4", "algo.micro_batch_size=8", "train.progress=false",
        "train.tensorboard=false", "kl.estimator=k1", "kl.beta=1.0", "lora.r=4", "lora.lr=0.01"]  # fmt: skip
ETA = 0.5


def config(out, model_dir, *extra):
    return load_config(None, [f"model.path={model_dir}", f"train.output_dir={out}", *ARGS, *extra])


def _ids():
    return torch.tensor([[1, 5, 6, 14, 7, 17], [1, 9, 9, 14, 2, 3]])


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """Two rollouts of 4 optimiser steps each, EMA every 2 steps: 4 anchor updates, with the
    policy adapter recorded at each."""
    out = tmp_path_factory.mktemp("lora")
    cfg = config(
        out, tiny_model_dir, f"anchor.eta={ETA}", "anchor.update_period=2", "anchor.period_unit=optimizer_steps",
        "algo.epochs=2",
        "algo.minibatches=2", "train.steps=2", "train.eval_every=2", "train.save_every=2",
    )  # fmt: skip
    run = trainer.setup(cfg, False, torch.device("cpu"))
    start = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    anchor_start = [t.clone() for t in run.anchor.mine]
    snapshots, real_step = [], run.anchor.step

    def step(policy, n):
        if n % run.anchor.update_period == 0:
            snapshots.append([p.detach().clone() for p in run.anchor.theirs])
        return real_step(policy, n)

    run.anchor.step = step
    try:
        trainer.train_loop(run)
    finally:
        run.close()
    return run, start, anchor_start, snapshots


@pytest.mark.slow
def test_only_the_policy_adapter_trains_and_holds_optimizer_state(trained, tiny_model_dir):
    run, start, _, _ = trained
    policy = lora.adapter_params(run.model, lora.POLICY)
    assert policy and all(".lora_A." in n or ".lora_B." in n for n in policy)
    in_optimizer = [p for group in run.optimizer.param_groups for p in group["params"]]
    assert sorted(map(id, in_optimizer)) == sorted(id(p) for p in policy.values())
    assert sorted(map(id, run.optimizer.state)) == sorted(id(p) for p in policy.values())
    assert all("exp_avg" in s for s in run.optimizer.state.values())
    base = load_model_and_tokenizer(tiny_model_dir)[0].state_dict()
    for name, p in run.model.named_parameters():
        if name in policy or f".{lora.ANCHOR}." in name:
            continue  # the anchor adapter: test_ema_anchor_adapter_equals_the_formula
        assert torch.equal(p, start[name]), name  # the base is bit-identical
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(p, base[plain]), name
    assert all(not torch.equal(p, start[n]) for n, p in policy.items())
    assert all(p.requires_grad for p in policy.values())


@pytest.mark.slow
def test_ema_anchor_adapter_equals_the_formula(trained):
    run, _, anchor_start, snapshots = trained
    assert run.anchor.updates == len(snapshots) == 4
    expected = anchor_start
    for snap in snapshots:
        expected = [ETA * e + (1 - ETA) * s for e, s in zip(expected, snap, strict=True)]
    for got, want in zip(run.anchor.mine, expected, strict=True):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-8)
    assert any(not torch.equal(a, b) for a, b in zip(run.anchor.mine, anchor_start, strict=True))
    assert not any(t.requires_grad for t in run.anchor.mine)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's
def test_saved_policy_is_the_merged_model_and_adapters_are_saved(trained, tiny_model_dir):
    from peft import PeftModel

    run, *_ = trained
    ckpt = run.run_dir / "checkpoints" / "step_2"
    merged = load_model_and_tokenizer(str(ckpt / "policy"))[0].eval()
    run.model.eval()
    with torch.no_grad():
        want = run.model(input_ids=_ids()).logits
        assert torch.allclose(merged(input_ids=_ids()).logits, want, atol=1e-5)
        base = load_model_and_tokenizer(tiny_model_dir)[0]
        again = PeftModel.from_pretrained(base, str(ckpt / "adapters" / lora.POLICY)).eval()
        assert torch.allclose(again(input_ids=_ids()).logits, want, atol=1e-6)
        plain = load_model_and_tokenizer(tiny_model_dir)[0]
        assert not torch.allclose(plain(input_ids=_ids()).logits, want, atol=1e-3)  # the adapter matters
    saved = load_file(str(ckpt / "adapters" / lora.ANCHOR / "adapter_model.safetensors"))
    assert len(saved) == len(run.anchor.mine)
    live = {
        n.replace(f".{lora.ANCHOR}.", "."): p for n, p in lora.adapter_params(run.model, lora.ANCHOR).items()
    }
    assert all(torch.equal(saved[n], live[n]) for n in saved)
    assert not (ckpt / "anchor.safetensors").exists()


def _wrapped(model_dir, r=4):
    model = load_model_and_tokenizer(model_dir)[0]
    return lora.wrap(model, load_config(None, [f"lora.r={r}"]).lora)


def _perturb(params, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def test_anchor_pass_switches_adapters_and_restores_the_policy(tiny_model_dir):
    base = load_model_and_tokenizer(tiny_model_dir)[0].eval()
    with torch.no_grad():
        base_logits = base(input_ids=_ids()).logits
    for eta in (1.0, 0.9):
        model = _wrapped(tiny_model_dir).train()
        _perturb(lora.adapter_params(model, lora.POLICY).values(), 0)  # the anchor starts from this
        anchor = lora.AdapterAnchor(model, eta, 1)
        with torch.no_grad():
            start_logits = model(input_ids=_ids()).logits
        _perturb(lora.adapter_params(model, lora.POLICY).values(), 1)
        with torch.no_grad(), anchor.active() as ref:
            assert not ref.training
            got = ref(input_ids=_ids()).logits
        if eta == 1.0:  # frozen: the base with adapters off, no adapter of its own
            assert torch.equal(got, base_logits)
            assert anchor.extra_bytes() == 0 and list(model.peft_config) == [lora.POLICY]
        else:
            assert torch.equal(got, start_logits)
        assert model.training
        assert all(p.requires_grad for p in lora.adapter_params(model, lora.POLICY).values())
        assert not any(p.requires_grad for p in lora.adapter_params(model, lora.ANCHOR).values())
        with torch.no_grad():
            assert not torch.allclose(model(input_ids=_ids()).logits, got)  # the policy is back


def test_anchor_memory_is_the_adapter_bytes(tiny_model_dir):
    r = 4
    plain = load_model_and_tokenizer(tiny_model_dir)[0]
    dims = [
        (m.in_features, m.out_features)
        for name, m in plain.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS
    ]
    assert len(dims) == 7  # q, k, v, o, gate, up, down of the one layer
    full = sum(p.numel() * p.element_size() for p in plain.parameters())
    model = _wrapped(tiny_model_dir, r)
    anchor = lora.AdapterAnchor(model, 0.9, 10)
    assert anchor.extra_bytes() == 4 * r * sum(i + o for i, o in dims)  # fp32: A is r x in, B out x r
    assert lora.adapter_bytes(model, lora.ANCHOR) == anchor.extra_bytes()
    base = lora.unwrap(model).named_parameters()  # tied ones once
    assert sum(p.numel() * p.element_size() for n, p in base if ".lora_" not in n) == full
    assert anchor.extra_bytes() < full / 5
    print(f"anchor extra memory: {anchor.extra_bytes()} bytes; a full copy: {full} bytes")


def _read(root):
    run = root / "quickstart"
    records = [
        {k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    ckpt = run / "checkpoints" / "step_4"
    files = [ckpt / "policy" / "model.safetensors"] + [
        ckpt / "adapters" / a / "adapter_model.safetensors" for a in (lora.POLICY, lora.ANCHOR)
    ]
    return records, [load_file(str(f)) for f in files], json.loads((ckpt / "state.json").read_text())


@pytest.mark.slow
def test_resume_with_lora_is_exact(tmp_path, tiny_model_dir):
    common = ["train.steps=4", "train.eval_every=2", "train.save_every=2", "anchor.update_period=1"]
    trainer.train(config(tmp_path / "a", tiny_model_dir, *common))
    trainer.train(config(tmp_path / "b", tiny_model_dir, *common, "train.steps=2"))
    trainer.train(config(tmp_path / "b", tiny_model_dir, *common), resume=True)
    rec_a, files_a, state_a = _read(tmp_path / "a")
    rec_b, files_b, state_b = _read(tmp_path / "b")
    assert [r["step"] for r in rec_b] == [0, 1, 2, 3, 4]
    assert rec_a == rec_b
    assert all(r["grad_norm"] > 0 for r in rec_a[1:])  # the adapters did move
    for a, b in zip(files_a, files_b, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert state_a["anchor"] == state_b["anchor"] == {"updates": 4}


def test_lora_settings_checked_before_any_work(monkeypatch, tiny_model_dir):

    with pytest.raises(EmapgError, match="lora.r: input should be greater than or equal to 0"):
        load_config(None, ["lora.r=-1"])
    with pytest.raises(EmapgError, match="lora.target_modules"):
        load_config(None, ["lora.r=4", "lora.target_modules=[]"])
    with pytest.raises(EmapgError, match="not supported"):
        load_config(None, ["lora.r=4"]).check_world(2)
    with pytest.raises(EmapgError, match="no_such_proj"):
        bad = load_config(None, ["lora.r=4", "lora.target_modules=[no_such_proj]"])
        lora.wrap(load_model_and_tokenizer(tiny_model_dir)[0], bad.lora)
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # as if not installed
    with pytest.raises(EmapgError, match=r"^lora.r=4 needs peft: pip install 'emapg\[lora\]'$"):
        lora.require_peft(4)
