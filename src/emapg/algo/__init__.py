"""The algorithm: KL estimators, advantages, policy losses, rollout correction; pure tensor functions."""
