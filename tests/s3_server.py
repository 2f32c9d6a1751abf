"""A moto S3 server on 127.0.0.1 for the pipeline and flow tests (import its fixtures; no conftest needed).

    from s3_server import s3_server, s3_bucket   # noqa: F401  (pytest fixtures)

`s3_server` (session): starts `moto.server.ThreadedMotoServer` on a free
loopback port and sets the standard AWS environment variables (endpoint,
dummy keys, region) that boto3, s3fs and polars read; restores them after.
`s3_bucket`: a fresh bucket per test, returned as its name.
"""
from __future__ import annotations

import os
import socket
import uuid

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """The endpoint URL of a moto S3 server, with AWS_* variables pointing at it."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A new, empty bucket on the moto server; its name."""
    import boto3

    name = f"tm-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


# Engine options shared by every test that runs the real model: `pipeline.get_llm` caches one
# engine per (model, options) per process, so the whole session loads the model once.
TEST_ENGINE_FIELDS = {
    "max_model_len": 256,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 128 << 20,
    "num_threads": 1,  # two OpenMP threads collapse when other work shares the 2 cores
}
TEST_ENGINE_FLAGS = [
    "--max-model-len", "256", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
    "--kv-cache-memory-bytes", str(128 << 20), "--num-threads", "1",
]
