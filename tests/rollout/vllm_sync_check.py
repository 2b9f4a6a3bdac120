"""Run under torchrun by tests/rollout/test_vllm_training.py: train through vLLM and, after every
`sync_weights`, check this rank's engine against the policy it should now hold.

    torchrun --nproc_per_node 2 tests/rollout/vllm_sync_check.py OUT_JSON emapg-overrides...

vLLM on CPU repacks its linear layers' weights into GEMM kernel layouts (the parameters it
keeps are empty), so the check is twofold: the weights vLLM stores as they are (embedding,
norms) must equal the gathered policy's exactly, and a probe sampled from the engine must
have the top-k sets of the policy's own forward and its log-probs to float32 rounding (which
covers every layer): each float32 forward's error is measured against a float64 forward of the
same weights.
Writes OUT_JSON.rank<R>: one record per sync.
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

import emapg
from emapg import distributed
from emapg.rollout.base import SamplingParams
from emapg.rollout.vllm import VllmEngine

PROBE = SamplingParams(max_new_tokens=8, temperature=0.7, topk=4, seed=5)


def stored_weights(worker) -> dict[str, torch.Tensor]:
    """Inside vLLM's worker (through collective_rpc): the parameters it keeps as loaded."""
    return {n: p.detach().float().clone() for n, p in worker.get_model().named_parameters() if p.numel()}


def probe_logp(model, out, dtype):
    with torch.no_grad():
        logits = model(input_ids=out.sequences, attention_mask=out.attention_mask).logits
    return torch.log_softmax(logits[:, out.prompt_len - 1 : -1].to(dtype) / PROBE.temperature, -1)


def probe_against_policy(engine, model, policy: dict) -> dict:
    """The engine's log-probs against the sharded float32 policy's forward and against a float64
    forward of the same (gathered) weights, the exact numbers both float32 forwards round."""
    prompts = [engine.tokenizer(t)["input_ids"] for t in ("1+2=", "7*3=", "9-4=", "5+5=")]
    out = engine.sample(prompts, PROBE)
    logp = probe_logp(model, out, torch.float32)  # the same shapes on every rank (FSDP)
    exact_model = AutoModelForCausalLM.from_config(model.config).double()
    exact_model.load_state_dict({n: t.double() for n, t in policy.items()}, strict=False)
    exact_model.tie_weights()
    exact = probe_logp(exact_model, out, torch.float64)
    mask, tokens = out.response_mask, out.responses.unsqueeze(-1)
    token_logp, token_exact = logp.gather(-1, tokens).squeeze(-1), exact.gather(-1, tokens).squeeze(-1)
    topk = logp.topk(PROBE.topk, -1).indices.sort(-1).values
    return {
        "engine_error": (out.sampling_logp.double() - token_exact)[mask].abs().max().item(),
        "policy_error": (token_logp.double() - token_exact)[mask].abs().max().item(),
        "topk_equal": torch.equal(out.topk_ids.sort(-1).values[mask], topk[mask]),
        "sequences": out.sequences.tolist(),
    }


records = []
push = VllmEngine.sync_weights


def sync_and_check(self, model, version):
    pushed = version != self.version
    push(self, model, version)
    policy = {n: distributed.full(p.detach()).float() for n, p in model.named_parameters()}
    stored = self.llm.collective_rpc(stored_weights)[0]
    # vLLM pads the vocabulary dimension (57 -> 64): compare the real rows
    diffs = {
        n: (policy[n] - t[: len(policy[n])]).abs().max().item() for n, t in stored.items() if n in policy
    }
    records.append(
        {"version": version, "pushed": pushed, "compared": sorted(diffs), "stored_max_abs_diff": max(diffs.values()),
         "embedding_sum": stored["model.embed_tokens.weight"].double().sum().item(),
         **probe_against_policy(self, model, policy)}
    )  # fmt: skip


VllmEngine.sync_weights = sync_and_check
out, overrides = sys.argv[1], sys.argv[2:]
emapg.train(None, overrides)
with open(f"{out}.rank{os.environ['RANK']}", "w") as f:
    json.dump(records, f)
