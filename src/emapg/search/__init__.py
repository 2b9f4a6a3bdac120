"""Agentic search: tag parsing and QA metrics, retrieval (BM25 / HTTP), the multi-turn rollout."""
