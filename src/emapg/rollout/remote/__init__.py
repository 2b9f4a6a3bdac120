"""Async rollouts (`rollout.mode=async`): worker processes with engines of their own sample the
next batches while the trainer updates; weights reach them over a torch.distributed group.

link.py is the group and what travels over it, worker.py a worker's process, workers.py the
trainer's side of them (docs/training.md, "Async rollouts"; docs/design.md says why it is built so).
"""
