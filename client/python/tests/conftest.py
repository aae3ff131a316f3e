"""Fixtures: real logitserve servers (binary from LOGITSERVE_SERVER_BINARY) serving heads whose
weights the tests wrote themselves (safetensors), so every output has an fp64 reference."""

import os

import numpy as np
import pytest

import logitserve
from support import Server, write_safetensors

V = 3001  # two vocabulary blocks of 2048, the second partial
H = 64
H_REF = 48


class Heads:
    """Weights (as the exact float64 values the server holds) of the heads served."""

    def __init__(self, directory):
        rng = np.random.default_rng(1234)
        self.policy_bits = logitserve.to_bf16_bits(rng.normal(0, 0.3, (V, H)).astype(np.float32))
        self.policy = logitserve.bf16_bits_to_f32(self.policy_bits).astype(np.float64)
        self.reference = rng.normal(0, 0.35, (V, H_REF)).astype(np.float32)
        self.policy16 = rng.normal(0, 0.3, (V, H)).astype(np.float16)
        path = os.path.join(directory, "heads.safetensors")
        write_safetensors(path, {
            "policy": ("BF16", self.policy_bits),
            "reference": ("F32", self.reference),
            "policy16": ("F16", self.policy16),
        })
        self.path = path
        self.weights = {"policy": self.policy, "reference": self.reference.astype(np.float64),
                        "policy16": self.policy16.astype(np.float64)}

    def flags(self):
        return ["--head", "policy=%s:policy" % self.path,
                "--head", "reference=%s:reference" % self.path,
                "--head", "policy16=%s:policy16" % self.path]


@pytest.fixture(scope="session")
def heads(tmp_path_factory):
    return Heads(str(tmp_path_factory.mktemp("heads")))


@pytest.fixture(scope="session")
def server(heads, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    with Server(heads.flags() + ["--max-top-k", "64"], log_path=log) as s:
        yield s


@pytest.fixture()
def client(server):
    with logitserve.Client(server.address, timeout=30) as c:
        yield c
