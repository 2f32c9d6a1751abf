"""A moto S3 server on 127.0.0.1 for the pipeline and flow tests (import its fixtures; no conftest needed).

    from s3_server import s3_server, s3_bucket, job_llm   # noqa: F401  (pytest fixtures)

`s3_server` (session): starts `moto.server.ThreadedMotoServer` on a free
loopback port and sets the standard AWS environment variables (endpoint,
dummy keys, region) that boto3, s3fs and polars read; restores them after.
`s3_bucket`: a fresh bucket per test, returned as its name.
`job_llm`: the session's engine, reused by jobs with default engine options.
`s3_proxy`: a loopback TCP proxy in front of the server that can stall, reset or slow connections.
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



@pytest.fixture
def job_llm(llm):
    """The session's engine (conftest's `llm`, default settings), registered so that every job whose
    spec leaves the engine options at their defaults (run_job, the CLI, the flow's tasks) reuses it:
    the whole test session loads the model once."""
    from pipeline import JobSpec, cache_llm

    cache_llm(JobSpec(input="-", output="-"), llm)
    return llm


@pytest.fixture
def s3_proxy(s3_server):
    """A `tcp_proxy.FaultProxy` in front of the moto server (its `url` is the endpoint to use)."""
    try:
        from tests.tcp_proxy import FaultProxy
    except ImportError:  # tests/ is not a package: pytest puts it on sys.path
        from tcp_proxy import FaultProxy

    port = int(s3_server.rsplit(":", 1)[1])
    with FaultProxy(("127.0.0.1", port)) as proxy:
        yield proxy
