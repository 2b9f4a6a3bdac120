"""Evaluation: held-out accuracy during training, the paper's protocols on files, run reports."""
