"""Fixtures of the engine-cache tests (and of the deploy tests that reuse them).

``s3_server``: a real S3-protocol server (moto in server mode) on a free loopback port for the whole
session, with the standard AWS environment variables pointing at it (``AWS_ENDPOINT_URL``, dummy
credentials, region), so s3fs -- and any subprocess (the ``kilnlm`` CLI, tritonserver) -- talks to it.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

import pytest


@dataclass
class S3Server:
    """A running moto S3 server. ``endpoint_url``: ``http://127.0.0.1:<port>``."""

    endpoint_url: str

    def client(self):
        """A boto3 S3 client for the server (to inspect or tamper with objects in tests)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url)

    def make_bucket(self, name: str | None = None) -> str:
        """Create a fresh bucket (a unique name unless ``name``) and return ``s3://<bucket>``."""
        name = name or f"kilnlm-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    pytest.importorskip("s3fs", reason="s3:// caches need s3fs (pip install 'kilnlm[s3]')")
    server_mod = pytest.importorskip("moto.server", reason="the S3 test server needs moto[server]")
    port = _free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        try:
            yield S3Server(endpoint_url=env["AWS_ENDPOINT_URL"])
        finally:
            server.stop()
