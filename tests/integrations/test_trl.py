"""emapg.integrations.trl against TRL's own GRPOTrainer and against emapg.algo.kl.token_kl."""

import math

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402  (after the skip: datasets comes with trl)
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from emapg.algo import kl  # noqa: E402
from emapg.errors import EmapgError  # noqa: E402
from emapg.integrations.trl import EMAPGConfig, EMAPGTrainer  # noqa: E402
from emapg.model.models import build_tiny_tokenizer  # noqa: E402

BETA = 0.05
COMMON = dict(
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=5,
    report_to=[],
    use_cpu=True,
    seed=0,
    save_strategy="no",
    disable_tqdm=True,
    logging_steps=1,
    bf16=False,  # TRL's default autocasts to bf16, also on CPU; the references here are fp32
    # TRL's default turns checkpointing on under transformers' deprecated name; the tiny model needs none
    activation_checkpointing=False,
)


def _length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _trainer(
    trainer_cls, config_cls, model_dir, tmp_path, prompts=("1+2=", "3+4=", "5+5=", "2+2="), **fields
):
    args = config_cls(output_dir=str(tmp_path), **{**COMMON, **fields})
    dataset = Dataset.from_dict({"prompt": list(prompts)})
    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=_length_reward,
        args=args,
        train_dataset=dataset,
        processing_class=build_tiny_tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by train(); compute_loss is called directly here
    trainer.model.train()
    return trainer


def _batch(vocab: int, off_policy: bool = False) -> dict:
    """A fixed rollout batch: left-padded prompts, completions of lengths 5, 3, 1, 4 (right-padded)."""
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(4, vocab, (4, 3), generator=g)
    prompt_mask = torch.ones(4, 3, dtype=torch.long)
    prompt_mask[1, 0] = prompt_mask[2, :2] = 0
    completion_ids = torch.randint(4, vocab, (4, 5), generator=g)
    completion_mask = (torch.arange(5) < torch.tensor([[5], [3], [1], [4]])).long()
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.3, -0.8]),
        "num_items_in_batch": completion_mask.sum(),
        "ref_per_token_logps": -3.0 + 0.4 * torch.randn(4, 5, generator=g),
    }
    if off_policy:
        batch["old_per_token_logps"] = -3.2 + 0.3 * torch.randn(4, 5, generator=g)
    return batch


def _loss_and_grads(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, dict(inputs))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]


def _assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-7)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize(
    ("estimator", "trl_bias_correction", "off_policy"),
    [("k3", False, False), ("k3pp", True, False), ("k3pp", True, True)],
)
def test_frozen_anchor_matches_trl_loss(
    tiny_model_dir, tmp_path, loss_type, estimator, trl_bias_correction, off_policy
):
    """eta = 1: the loss and its gradient equal TRL's on the same batch. TRL's bias-corrected k3
    (its default) is k3pp with the weight s, also off-policy; its plain k3 is k3 on-policy."""
    fields = dict(beta=BETA, loss_type=loss_type)
    ours = _trainer(EMAPGTrainer, EMAPGConfig, tiny_model_dir, tmp_path, kl_estimator=estimator, anchor_ema_eta=1.0,
                    **fields)  # fmt: skip
    theirs = _trainer(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path, use_bias_correction_kl=trl_bias_correction,
                      **fields)  # fmt: skip
    inputs = _batch(len(build_tiny_tokenizer()), off_policy)
    _assert_same(_loss_and_grads(ours, inputs), _loss_and_grads(theirs, inputs))
    assert ours._metrics["train"]["kl"][-1] == pytest.approx(theirs._metrics["train"]["kl"][-1], rel=1e-5)
    assert ours._metrics["train"]["kl"][-1] > 1e-3  # the KL term is not trivially zero


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_loss_matches_token_kl_reference(tiny_model_dir, tmp_path, direction):
    """Top-k path (anchor statistics at rollout, second LM-head pass in the loss) = TRL's policy
    loss + beta * token-mean of kl.token_kl on full logits, in value and gradient."""
    k, temperature = 5, 0.7
    fields = dict(loss_type="bnpo", temperature=temperature)
    ours = _trainer(EMAPGTrainer, EMAPGConfig, tiny_model_dir, tmp_path, beta=BETA, kl_estimator="topk",
                    kl_direction=direction, kl_topk=k, **fields)  # fmt: skip
    reference = _trainer(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path, beta=0.0, **fields)
    with torch.no_grad():  # an anchor that differs from the policy
        g = torch.Generator().manual_seed(2)
        for p in ours.ref_model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    batch = _batch(len(build_tiny_tokenizer()))
    del batch["ref_per_token_logps"]
    inputs = {**batch, **ours._anchor_statistics(batch)}

    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    mask = batch["completion_mask"]

    def logits(model):
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -6:-1] / temperature

    reference.model.zero_grad()
    with torch.no_grad():
        ref_logits = logits(ours.ref_model)
    token_kl = kl.token_kl(logits(reference.model), ref_logits, batch["completion_ids"], estimator="topk",
                           direction=direction, k=k)  # fmt: skip
    expected = (
        reference.compute_loss(reference.model, dict(batch)) + BETA * (token_kl * mask).sum() / mask.sum()
    )
    expected.backward()
    want = (expected.detach(), [p.grad.clone() for p in reference.model.parameters()])
    _assert_same(_loss_and_grads(ours, inputs), want)


class _Recorder(TrainerCallback):
    """Policy and anchor weights after every optimiser step (runs after the anchor's callback)."""

    def __init__(self, trainer):
        self.trainer, self.policy, self.anchor = trainer, [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.policy.append([p.detach().clone() for p in self.trainer.model.parameters()])
        self.anchor.append([p.detach().clone() for p in self.trainer.ref_model.parameters()])


@pytest.mark.slow
@pytest.mark.parametrize("estimator, bf16", [("topk", False), ("k3", False), ("topk", True)])
def test_trains_on_cpu_and_anchor_follows_the_ema(tiny_model_dir, tmp_path, estimator, bf16):
    """With TRL's bf16=True (autocast over the float32 model) too: the passes compute in bfloat16,
    and the policy, its AdamW moments and the EMA anchor stay float32, so the EMA is exact."""
    eta, period, steps = 0.25, 2, 4
    trainer = _trainer(EMAPGTrainer, EMAPGConfig, tiny_model_dir, tmp_path, kl_estimator=estimator, kl_topk=4,
                       anchor_ema_eta=eta, anchor_update_period=period, max_steps=steps, learning_rate=0.05,
                       bf16=bf16)  # fmt: skip
    assert trainer.accelerator.mixed_precision == ("bf16" if bf16 else "no")
    start = [p.detach().clone() for p in trainer.ref_model.parameters()]
    recorder = _Recorder(trainer)
    trainer.add_callback(recorder)
    trainer.train()

    assert trainer.state.global_step == steps and trainer.anchor.updates == steps // period
    logged = [h for h in trainer.state.log_history if "kl" in h]
    assert len(logged) == steps and all(math.isfinite(h["loss"] + h["kl"]) for h in logged)
    expected = start
    for step in range(1, steps + 1):
        policy = recorder.policy[step - 1]
        if step % period == 0:
            expected = [eta * a + (1 - eta) * p for a, p in zip(expected, policy, strict=True)]
        for got, want in zip(recorder.anchor[step - 1], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(recorder.policy[-1], start, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(expected, start, strict=True))
    moments = [t for state in trainer.optimizer.state.values() for t in state.values() if t.dim()]
    assert moments and {t.dtype for t in [*moments, *recorder.policy[-1], *recorder.anchor[-1]]} == {
        torch.float32
    }


@pytest.mark.slow
def test_resume_continues_the_anchor_of_the_checkpoint(tiny_model_dir, tmp_path):
    """Killed after step 2 and resumed from its checkpoint, the run ends with the anchor (and
    policy) of the uninterrupted run, bit for bit; before, the anchor restarted from the model."""
    fields = dict(kl_estimator="k3", anchor_ema_eta=0.5, anchor_update_period=1, max_steps=4, learning_rate=0.05,
                  save_strategy="steps", save_steps=1)  # fmt: skip
    # 8 prompts, 2 a step: the 4 steps are one epoch. (Resumed past an epoch's end, TRL's own sampler
    # repeats the first epoch's prompt order, and no run would match.)
    prompts = [f"{a}+{b}=" for a, b in ((1, 2), (3, 4), (5, 5), (2, 2), (6, 1), (7, 3), (8, 8), (9, 4))]
    full = _trainer(EMAPGTrainer, EMAPGConfig, tiny_model_dir, tmp_path / "full", prompts, **fields)
    start = [p.detach().clone() for p in full.ref_model.parameters()]
    full.train()
    resumed = _trainer(EMAPGTrainer, EMAPGConfig, tiny_model_dir, tmp_path / "resumed", prompts, **fields)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))

    pairs = [*zip(resumed.ref_model.parameters(), full.ref_model.parameters(), strict=True),
             *zip(resumed.model.parameters(), full.model.parameters(), strict=True)]  # fmt: skip
    assert all(torch.equal(a, b) for a, b in pairs)
    assert any(not torch.equal(a, s) for a, s in zip(full.ref_model.parameters(), start, strict=True))
    assert resumed.anchor.updates == full.anchor.updates == 4
    # A checkpoint without the anchor's weights stops the resume instead of restarting the anchor.
    (tmp_path / "full" / "checkpoint-3" / "anchor.safetensors").unlink()
    again = _trainer(EMAPGTrainer, EMAPGConfig, tiny_model_dir, tmp_path / "again", prompts, **fields)
    with pytest.raises(EmapgError, match="checkpoint-3 has no anchor.safetensors"):
        again.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kl_estimator": "k7"}, r"^EMAPGConfig.kl_estimator: unknown 'k7'; expected one of k1, k2"),
        ({"kl_estimator": "k5"}, "estimates forward KL"),
        ({"kl_direction": "sideways"}, r"^EMAPGConfig.kl_direction: unknown 'sideways'"),
        ({"kl_topk": -1}, r"^EMAPGConfig.kl_topk: input should be greater than or equal to 0; got -1"),
        ({"anchor_ema_eta": 1.5}, r"^EMAPGConfig.anchor_ema_eta: input should be less than or equal to 1"),
        ({"anchor_update_period": 0}, r"^EMAPGConfig.anchor_update_period: input should be greater than"),
        ({"beta": 0.0}, "beta must be > 0"),
        ({"sync_ref_model": True}, "sync_ref_model must be False"),
        ({"use_bias_correction_kl": True}, "kl_estimator='k3pp'"),
    ],
)
def test_config_rejects_bad_fields(tmp_path, fields, message):
    with pytest.raises(EmapgError, match=message):
        EMAPGConfig(output_dir=str(tmp_path), **fields)


def test_trainer_requires_an_emapg_config(tiny_model_dir, tmp_path):
    with pytest.raises(EmapgError, match="args must be an EMAPGConfig; got GRPOConfig"):
        EMAPGTrainer(tiny_model_dir, _length_reward, args=GRPOConfig(output_dir=str(tmp_path), **COMMON))


def test_topk_needs_a_head_lm_head_reproduces(tiny_model_dir):
    """The shared emapg.model.lm_head decision: scaled heads are reproduced, unknown modifiers refused."""
    from transformers import AutoModelForCausalLM, GraniteConfig, GraniteForCausalLM

    granite = GraniteForCausalLM(GraniteConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2, logits_scaling=8.0))  # fmt: skip
    assert EMAPGTrainer._head(granite).scale == pytest.approx(1 / 8.0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.lm_head_multiplier = 2.0
    with pytest.raises(EmapgError, match="not one emapg.model.lm_head reproduces"):
        EMAPGTrainer._head(model)
