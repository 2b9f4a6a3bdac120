"""emapg: EMA Policy Gradient — GRPO with an EMA anchor and the Top-k KL estimator."""

__version__ = "0.1.0"
