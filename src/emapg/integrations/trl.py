"""EMA-PG inside TRL: `EMAPGConfig` / `EMAPGTrainer` extend `trl.GRPOConfig` / `trl.GRPOTrainer`.

Everything TRL does stays TRL's (generation, rewards, advantages, the policy loss, logging);
two things change:

- the KL term: TRL's built-in k3 is replaced by any `emapg.algo.kl` estimator (`kl_estimator`,
  `kl_direction`, `kl_topk`), aggregated like TRL aggregates its loss for `loss_type`;
- the reference model: TRL's `ref_model` becomes an `emapg.model.anchor.Anchor` updated in place,
  anchor <- eta * anchor + (1 - eta) * policy every `anchor_update_period` optimiser steps
  (`anchor_ema_eta`; eta = 1 is TRL's frozen reference).

Override points: `_generate_and_score_completions` (anchor statistics for the top-k
estimators), `_get_per_token_logps_and_entropies` (to keep the policy log-probs of the loss
pass), `_compute_loss` (TRL's loss with its KL switched off, plus ours), a callback for
the EMA step, and `_save_checkpoint` / `_load_optimizer_and_scheduler` (the anchor's weights
and update count in each checkpoint, restored on resume). TRL's `bf16=True` (accelerate's autocast
over the weights as loaded) is honoured: loaded in float32, policy, AdamW state and the EMA anchor
stay float32 while the passes compute in bfloat16. Supported: text-only models, no PEFT (the anchor must be a separate model); the
top-k estimators need an LM head that `emapg.model.lm_head.head_of` reproduces exactly (plain,
Cohere's scale, Granite's scaling, Gemma 2's soft-cap).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model
from torch import Tensor
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

from emapg.algo import kl
from emapg.algo.kl import KLSettings
from emapg.algo.topk import Summary
from emapg.errors import EmapgError
from emapg.model.anchor import Anchor, EMASchedule
from emapg.model.lm_head import backbone, final_hidden, head_of
from emapg.settings import validated


@dataclass
class EMAPGConfig(GRPOConfig):
    """`trl.GRPOConfig` plus the EMA-PG fields; `beta` is the KL coefficient as in TRL."""

    beta: float = field(
        default=1e-3,
        metadata={"help": "KL coefficient (the paper's default 1e-3). Must be > 0: EMA-PG is its KL term."},
    )
    kl_estimator: str = field(
        default="topk",
        metadata={
            "help": "Token-level KL estimator from emapg.algo.kl: k1, k2, k3, k3pp, k4, k5 (sampled token only), "
            "exact, topk (exact on the top-k tokens plus a sampled tail; unbiased value and gradient), "
            "topk_paper (as printed in the paper, gradient-biased), truncated (top-k head only)."
        },
    )
    kl_direction: str = field(
        default="reverse",
        metadata={
            "help": "reverse = KL(policy || anchor), forward = KL(anchor || policy). The sampled estimators "
            "have a fixed direction (k5 is forward, the others reverse)."
        },
    )
    kl_topk: int = field(
        default=32,
        metadata={
            "help": "k of the top-k estimators: the top-k set of the sampling policy (reverse) or of the "
            "anchor (forward)."
        },
    )
    anchor_ema_eta: float = field(
        default=0.9,
        metadata={
            "help": "EMA rate of the anchor: anchor <- eta * anchor + (1 - eta) * policy. 1 = frozen "
            "reference (plain GRPO), 0 = copy of the policy."
        },
    )
    anchor_update_period: int = field(
        default=10, metadata={"help": "Optimiser steps between two EMA updates of the anchor."}
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={
            "help": "Must stay False: EMA-PG weights the KL by s = sg(pi / pi_old) itself. TRL's True (its "
            "default) is kl_estimator='k3pp' here: the same value and gradient."
        },
    )

    def __post_init__(self):
        names = {f: f"EMAPGConfig.kl_{f}" for f in ("estimator", "direction")} | {"k": "EMAPGConfig.kl_topk"}
        values = {"estimator": self.kl_estimator, "direction": self.kl_direction, "k": self.kl_topk}
        validated(KLSettings, values, "kl", names)
        EMASchedule.of(
            self.anchor_ema_eta,
            self.anchor_update_period,
            {"eta": "EMAPGConfig.anchor_ema_eta", "update_period": "EMAPGConfig.anchor_update_period"},
        )
        if self.beta <= 0:
            raise EmapgError(f"EMAPGConfig.beta must be > 0 (the KL coefficient); got {self.beta}")
        if self.sync_ref_model:
            raise EmapgError(
                "EMAPGConfig.sync_ref_model must be False: the anchor's EMA (anchor_ema_eta, "
                "anchor_update_period) replaces TRL's reference sync"
            )
        if self.use_bias_correction_kl:
            raise EmapgError(
                "EMAPGConfig.use_bias_correction_kl must be False: EMA-PG applies its own importance "
                "weight s = sg(pi / pi_old); TRL's bias-corrected k3 is kl_estimator='k3pp'"
            )
        super().__post_init__()


class _AnchorStep(TrainerCallback):
    """Runs the anchor's EMA after every optimiser step (global_step is 1-based there)."""

    def __init__(self, trainer: EMAPGTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.trainer.anchor.step(self.trainer.accelerator.unwrap_model(model), state.global_step)


ANCHOR_FILE = "anchor.safetensors"  # the anchor's weights in each checkpoint-N folder


class EMAPGTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` with EMA-PG's anchor and KL estimators; takes the same arguments."""

    def __init__(self, model, reward_funcs, args: EMAPGConfig | None = None, **kwargs):
        if not isinstance(args, EMAPGConfig):
            raise EmapgError(f"EMAPGTrainer: args must be an EMAPGConfig; got {type(args).__name__}")
        super().__init__(model, reward_funcs, args=args, **kwargs)
        if self.ref_model is None:
            raise EmapgError(
                "EMAPGTrainer needs a separate reference model to serve as the anchor; PEFT models are "
                "not supported"
            )
        policy = self.accelerator.unwrap_model(self.model)
        self.anchor = Anchor(
            policy,
            args.anchor_ema_eta,
            args.anchor_update_period,
            model=self.accelerator.unwrap_model(self.ref_model),
        )
        self.add_callback(_AnchorStep(self))
        self.kl_estimator, self.kl_direction = args.kl_estimator, args.kl_direction
        self.q_source = kl.q_source(args.kl_estimator, args.kl_direction)
        self.uses_topk = self.q_source != "none"
        vocab = policy.get_output_embeddings().weight.shape[0]
        # "exact" is the top-k estimator with q = the whole vocabulary (O(V) per token, as exact KL is).
        self.kl_topk = vocab if self.q_source == "vocab" else args.kl_topk
        if self.uses_topk:
            for model in (policy, self.anchor.model):
                self._head(model)
        self._loss_capture: dict | None = None

    # ---- checkpoints: the anchor is part of the training state -------------------------------

    def _save_checkpoint(self, model, trial):
        # Written before TRL's files, trainer_state.json last: a checkpoint a kill cut short
        # either has no trainer state (transformers refuses it) or has its anchor.
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        if self.args.should_save:
            os.makedirs(folder, exist_ok=True)
            save_model(
                self.anchor.model, os.path.join(folder, ANCHOR_FILE), {"updates": str(self.anchor.updates)}
            )
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Called on resume only (as TRL restores its own extra state), after the policy is loaded.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, ANCHOR_FILE)
        if not os.path.isfile(path):
            raise EmapgError(
                f"EMAPGTrainer: {checkpoint} has no {ANCHOR_FILE} (written by another trainer, or an older "
                "emapg), so its EMA anchor is lost; restarting the anchor from the initial model would "
                "train a different algorithm"
            )
        try:
            load_model(self.anchor.model, path)
            with safe_open(path, "pt") as f:
                self.anchor.updates = int(f.metadata()["updates"])
        except (OSError, RuntimeError, SafetensorError, KeyError) as e:
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise EmapgError(f"EMAPGTrainer: {path} cannot be loaded into the anchor: {detail}") from None

    @staticmethod
    def _head(model):
        """The model's LM head for the chunked top-k pass; an error when it cannot be reproduced."""
        head = head_of(model)
        if head is None:
            raise EmapgError(
                f"EMAPGTrainer: the top-k KL estimators recompute the LM head from hidden states, and "
                f"{type(model).__name__}'s head is not one emapg.model.lm_head reproduces exactly (a bias, an "
                "unknown logit modifier, or logits that differ from softcap(scale * hidden @ W.T)); use a "
                "sampled estimator such as k3 instead"
            )
        return head

    @contextmanager
    def _trl_kl_off(self):
        """TRL adds its own k3 term and runs its own reference pass when beta != 0; hide beta from it."""
        beta, self.beta = self.beta, 0.0
        try:
            yield
        finally:
            self.beta = beta

    # ---- rollout: anchor statistics -------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        if not self.uses_topk:
            return super()._generate_and_score_completions(inputs)  # TRL's ref pass gives ref log pi(p)
        # TRL's reference pass keeps only the sampled token's log-prob; ours (below) replaces it.
        with self._trl_kl_off():
            out = super()._generate_and_score_completions(inputs)
        if any(key in out for key in ("pixel_values", "token_type_ids", "mm_token_type_ids")):
            raise EmapgError("EMAPGTrainer: the top-k KL estimators support text-only models")
        out.update(self._anchor_statistics(out))
        return out

    def _completion_hidden(
        self, model, input_ids: Tensor, attention_mask: Tensor, completion_len: int
    ) -> Tensor:
        """Last hidden states that predict the completion tokens, [B, T, H] (no grad, in micro-batches)."""
        model = self.accelerator.unwrap_model(model)
        step = self.args.per_device_train_batch_size
        parts = []
        for a in range(0, input_ids.shape[0], step):
            with self.accelerator.autocast():
                fused = final_hidden(
                    model, input_ids=input_ids[a : a + step], attention_mask=attention_mask[a : a + step]
                )
            if fused is None:  # the head did not reproduce the model's own logits
                self._head(model)
            parts.append(fused[0][:, -completion_len - 1 : -1])
        return torch.cat(parts)

    def _head_summary(self, model, hidden: Tensor, ids: Tensor, topk: int = 0) -> Summary:
        """Summary of the tempered LM-head distribution from `hidden`, in chunks of tokens (never [T, V]).
        Under TRL's bf16=True (accelerate's autocast) the head's operands are bfloat16 and its products
        float32 (`lm_head.Head`), for the anchor's pass as for the loss's."""
        head = self._head(self.accelerator.unwrap_model(model))
        with self.accelerator.autocast():
            return head.summarize(hidden, ids, topk=topk, temperature=self.temperature)

    @torch.no_grad()
    def _anchor_statistics(self, out: dict) -> dict:
        """The top-k set q per completion token and the anchor's log-probs at the token and at q."""
        input_ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention_mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        tokens = out["completion_ids"].unsqueeze(-1)
        completion_len = tokens.shape[1]
        ref_hidden = self._completion_hidden(self.ref_model, input_ids, attention_mask, completion_len)
        if self.q_source == "anchor":  # the anchor's own top-k: one anchor pass gives everything
            ref = self._head_summary(self.ref_model, ref_hidden, tokens, topk=self.kl_topk)
            head_ids, ref_logp, ref_head_logp = ref.topk_ids, ref.logp()[..., 0], ref.topk_logp
        else:
            # EXTRA PASS: q is the top-k of the *sampling* policy's distribution, and TRL (on-policy)
            # never runs the policy over the completions after generating them; it keeps only the
            # sampled ids. So this costs one more no-grad policy forward per rollout.
            hidden = self._completion_hidden(self.model, input_ids, attention_mask, completion_len)
            head_ids = self._head_summary(self.model, hidden, tokens, topk=self.kl_topk).topk_ids
            ref = self._head_summary(self.ref_model, ref_hidden, torch.cat([tokens, head_ids], dim=-1))
            logp = ref.logp()
            ref_logp, ref_head_logp = logp[..., 0], logp[..., 1:]
        return {"ref_per_token_logps": ref_logp, "kl_head_ids": head_ids, "kl_ref_head_logps": ref_head_logp}

    # ---- update: the loss -------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
    ):
        if self._loss_capture is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        # Inside the loss: keep the policy log-probs (and, for top-k, the hidden states) it computes.
        hook = None
        if self.uses_topk:
            hook = backbone(self.accelerator.unwrap_model(model)).register_forward_hook(
                lambda _m, _i, o: self._loss_capture.setdefault("hidden", []).append(o.last_hidden_state)
            )
        try:
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        finally:
            if hook is not None:
                hook.remove()
        self._loss_capture["logps"] = out[0]
        return out

    def _compute_loss(self, model, inputs):
        self._loss_capture = {}
        try:
            with self._trl_kl_off():
                loss = super()._compute_loss(model, inputs)
            capture = self._loss_capture
        finally:
            self._loss_capture = None
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        per_token_kl = self._per_token_kl(model, capture, inputs)
        mode = "train" if self.model.training else "eval"
        totals = self.accelerator.reduce(
            torch.stack([(per_token_kl.detach() * mask).sum(), mask.sum().float()])
        )
        self._metrics[mode]["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        return loss + self.beta * self._aggregate(per_token_kl, mask, inputs, mode)

    def _per_token_kl(self, model, capture: dict, inputs: dict) -> Tensor:
        """[B, T] KL estimate; s = sg(pi / pi_old) only when TRL kept old log-probs (off-policy)."""
        logp = capture["logps"]
        sampling_logp = inputs.get("old_per_token_logps")
        if not self.uses_topk:
            weight = None if sampling_logp is None else kl.importance_weight(logp, sampling_logp)
            return kl.from_logprobs(
                logp,
                inputs["ref_per_token_logps"],
                estimator=self.kl_estimator,
                direction=self.kl_direction,
                weight=weight,
            )
        # The fused LM head of TRL returns log pi(p) only, so the policy's logits at q cost a
        # second, chunked LM-head pass (forward and backward) over the captured hidden states.
        tokens = inputs["completion_ids"].unsqueeze(-1)
        hidden = torch.cat(capture["hidden"])[:, -tokens.shape[1] - 1 : -1]
        head_ids = inputs["kl_head_ids"]
        policy = self._head_summary(model, hidden, torch.cat([tokens, head_ids], dim=-1))
        return kl.from_summary(
            policy,
            (head_ids == tokens).any(-1),
            inputs["ref_per_token_logps"],
            inputs["kl_ref_head_logps"],
            estimator=self.kl_estimator,
            direction=self.kl_direction,
            sampling_logp=sampling_logp,
        )

    def _aggregate(self, per_token: Tensor, mask: Tensor, inputs: dict, mode: str) -> Tensor:
        """Reduce [B, T] to the loss exactly as TRL reduces its per-token loss for `loss_type`."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        masked = per_token * mask
        if self.loss_type in ("grpo", "sapo"):
            return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        if self.loss_type == "bnpo":
            return masked.sum() / mask.sum().clamp(min=1.0) / accumulation
        if self.loss_type == "dr_grpo":
            return masked.sum() / (per_token.size(0) * self.max_completion_length) / accumulation
        if self.loss_type in ("cispo", "dapo", "vespo"):
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * accumulation / self.args.steps_per_generation
            return masked.sum() / normalizer
        if self.loss_type == "luspo":
            return masked.sum(-1).mean() / accumulation
        raise EmapgError(f"EMAPGTrainer: loss_type {self.loss_type!r} is not supported")
