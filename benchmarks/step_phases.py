"""Time per training step split by phase (rollout, scoring, anchor pass, update, EMA).

Runs the real trainer on a config (default: the quickstart, warm start cached) for a few
steps and prints the mean seconds and share of each phase, from the run's metrics.jsonl.

    python benchmarks/step_phases.py [--config quickstart] [--steps 6] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from emapg.config import load_config
from emapg.trainer import train

PHASES = ("rollout", "scoring", "anchor", "update", "ema")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="quickstart")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=1, help="first steps left out (warm-up)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            args.config,
            [*args.overrides, f"train.output_dir={out}", f"train.steps={args.steps}",
             f"train.eval_every={args.steps}", f"train.save_every={args.steps}", "train.tensorboard=false"],
        )  # fmt: skip
        train(cfg)
        lines = (Path(out) / cfg.train.name / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["step"] > args.skip]
    mean = {p: sum(r[f"time/{p}_s"] for r in records) / len(records) for p in PHASES}
    total = sum(mean.values())
    seqs = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    print(f"\n{cfg.train.name}: {seqs} sequences/step, kl={cfg.kl.estimator}, anchor={cfg.anchor.kind}, "
          f"mean of steps {args.skip + 1}..{args.steps}")  # fmt: skip
    print(f"{'phase':<10}{'seconds':>10}{'share':>8}")
    for phase in PHASES:
        print(f"{phase:<10}{mean[phase]:>10.3f}{mean[phase] / total:>8.1%}")
    print(f"{'step':<10}{total:>10.3f}{1:>8.0%}")


if __name__ == "__main__":
    main()
