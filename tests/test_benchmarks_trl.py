"""benchmarks/throughput_vs_trl.py at a tiny size: both trainers run and are measured on the same
prompts, and chat-templated prompts (what --model smollm2 trains on) reach TRL as emapg's token ids."""

import re
import sys

import pytest
from transformers.utils import logging as hf_logging

from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.tasks import make_task
from emapg.training.config import load_config
from helpers import ROOT

pytest.importorskip("trl")
sys.path.insert(0, str(ROOT / "benchmarks"))
import throughput_vs_trl as bench  # noqa: E402

TINY = ["--rounds", "1", "--steps", "2", "--prompts", "2", "--group", "2", "--max-new-tokens", "4"]
# A chat template in the character tokenizer's alphabet, BOS written by the template itself (as
# SmolLM2's writes <|im_start|>): tokenizing the rendered text with special tokens doubles it.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(autouse=True)
def _transformers_logging():
    """The script quiets transformers for the whole process; the tests after this one get it back."""
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    yield
    hf_logging.set_verbosity(verbosity)
    if bars:
        hf_logging.enable_progress_bar()


def test_tiny_run_measures_both_sides_on_the_same_prompts(monkeypatch, capsys):
    model = ["--hidden", "32", "--layers", "1", "--heads", "2"]
    monkeypatch.setattr(sys, "argv", ["throughput_vs_trl.py", *TINY, *model])
    bench.main()  # TRL's token ids and its per-step prompt token count are checked inside: raises if unequal
    out = capsys.readouterr().out

    rates = dict(re.findall(r"^(emapg|TRL GRPOTrainer): ([\d,]+) response tokens/s", out, re.M))
    assert set(rates) == {"emapg", "TRL GRPOTrainer"}
    assert all(float(r.replace(",", "")) > 0 for r in rates.values())
    per_step = [int(n.replace(",", "")) for n in re.findall(r"and ([\d,]+) response tokens per step", out)]
    assert len(per_step) == 2 and all(0 < n <= 2 * 2 * 4 for n in per_step)  # prompts x group x new tokens

    # Both sides' prompts: the arithmetic task's first two, each sampled twice a step, plain text.
    task = make_task(load_config("quickstart", ["task.num_train=2", "task.num_eval=8"]).task, "")
    ids = build_tiny_tokenizer()([e.prompt for e in task.train_examples()])["input_ids"]
    assert f"plain text, {2 * sum(map(len, ids))} prompt tokens per step" in out
    assert re.search(r"^model: random Llama, .*, [\d.]+M parameters, vocab 57", out, re.M)
    assert re.search(r"^throughput emapg / TRL = [\d.]+x", out, re.M)
    assert out.count("load average") == 2


def test_chat_prompts_reach_trl_as_emapgs_token_ids(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2)
    model_dir = str(tmp_path / "model")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    assert bench.parameter_count(model_dir) == sum(p.numel() for p in model.parameters())

    args = bench.parse_args(TINY)
    work = bench.make_workload(bench.emapg_config(model_dir, args, str(tmp_path), 0), tokenizer)
    assert work.chat and len(work.examples) == 2
    prompts = bench.trl_prompts(work)
    assert prompts[0] == [{"role": "user", "content": work.examples[0].prompt}]
    assert [i.count(tokenizer.bos_token_id) for i in work.ids] == [1, 1]  # the template's BOS, once

    trainer = bench.trl_trainer(model_dir, args, str(tmp_path), 0, work, tokenizer)  # checks the ids
    assert trainer._tokenize_prompts(prompts)[0] == work.ids
    with pytest.raises(RuntimeError, match="tokenize prompt 0 differently"):
        bench.check_prompt_ids(trainer, [e.prompt for e in work.examples], work)  # no template: other ids

    reward = bench.trl_reward(work)  # TRL hands chat completions over as messages
    right, wrong = ([{"role": "assistant", "content": text}] for text in (work.examples[1].answer, "x"))
    assert reward([right, wrong], index=[1, 1]) == [1.0, 0.0]
