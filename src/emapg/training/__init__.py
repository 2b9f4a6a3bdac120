"""Training: the config, the run, the loop and its update, checkpoints, the warm start."""
