"""A real tritonserver with trusted keys in its environment (``KILNLM_TRUSTED_KEYS``, as an operator starts
``scripts/launch_triton.py``): it serves the tiny engine signed by a trusted key and refuses to start with
the same engine unsigned, naming the missing signature in its log (kilnlm.runtime.signing)."""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from servers import running_tritonserver

from kilnlm.runtime.signing import TRUSTED_KEYS_ENV, sign_engine

pytestmark = [pytest.mark.triton, pytest.mark.e2e]


def test_tritonserver_serves_only_trusted_engines(tiny_engine_dir, tmp_path):
    key = Ed25519PrivateKey.generate()
    trusted = tmp_path / "trusted.pem"
    trusted.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    env = {TRUSTED_KEYS_ENV: str(trusted)}
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, engine)

    with pytest.raises(pytest.fail.Exception, match=r"manifest\.sig is missing: the engine is unsigned"):
        with running_tritonserver(tmp_path / "unsigned", engine_dir=engine, extra_env=env):
            pass

    sign_engine(engine, key)
    with running_tritonserver(tmp_path / "signed", engine_dir=engine, extra_env=env) as server:
        body = {"input_ids": [1, 2, 3], "input_lengths": 3, "request_output_len": 4}
        request = urllib.request.Request(f"{server.http_url}/v2/models/tensorrt_llm/generate",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert 3 < len(json.loads(reply.read())["output_ids"]) <= 3 + 4  # the prompt, then what it generated
