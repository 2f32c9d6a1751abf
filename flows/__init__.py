"""Prefect orchestration of tokenmill jobs: `batch_generate` (flows/batch_generate.py) and its scheduler (flows/deploy.py)."""
from flows.batch_generate import batch_generate, generate_shard

__all__ = ["batch_generate", "generate_shard"]
