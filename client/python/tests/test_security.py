"""Bearer tokens (user and admin) and TLS / mutual TLS through the Python client."""

import shutil
import subprocess

import numpy as np
import pytest

import logitserve
from support import Server

LOGITS = np.array([[0.0, 1.0, 2.0]], np.float32)


@pytest.fixture(scope="module")
def auth_server(heads, tmp_path_factory):
    d = tmp_path_factory.mktemp("auth")
    (d / "user").write_text("user-secret\n")
    (d / "admin").write_text("admin-secret\n")
    with Server(heads.flags() + ["--auth-token-file", str(d / "user"),
                                 "--admin-token-file", str(d / "admin")]) as s:
        yield s


def test_tokens(auth_server):
    with logitserve.Client(auth_server.address) as anon:
        assert anon.health() == "SERVING"  # probes stay open
        with pytest.raises(logitserve.Unauthenticated):
            anon.score(logits=LOGITS, entropy=True)
    with logitserve.Client(auth_server.address, token="wrong") as bad:
        with pytest.raises((logitserve.Unauthenticated, logitserve.PermissionDenied)):
            bad.list_heads()
    w = np.ones((3, 2), np.float32)
    with logitserve.Client(auth_server.address, token="user-secret") as user:
        assert user.score(logits=LOGITS, entropy=True).entropy.shape == (1,)
        with pytest.raises(logitserve.PermissionDenied):
            user.load_head("sec", w)  # LoadHead needs the admin token
    with logitserve.Client(auth_server.address, token="user-secret", admin_token="admin-secret") as c:
        assert c.load_head("sec", w).version >= 1  # admin token on LoadHead only
        assert c.list_heads()["sec"].vocab_size == 3


def _openssl(*args):
    subprocess.run(["openssl"] + list(args), check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is required (scripts/install-deps.sh installs it)")
    d = tmp_path_factory.mktemp("tls")
    p = lambda name: str(d / name)  # noqa: E731
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", p("ca.key"), "-out", p("ca.pem"))
    for who, san in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                     ("client", "subjectAltName=DNS:client")):
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=" + who,
                 "-keyout", p(who + ".key"), "-out", p(who + ".csr"))
        with open(p(who + ".ext"), "w") as f:
            f.write(san + "\n")
        _openssl("x509", "-req", "-in", p(who + ".csr"), "-CA", p("ca.pem"), "-CAkey", p("ca.key"),
                 "-CAcreateserial", "-days", "2", "-extfile", p(who + ".ext"), "-out", p(who + ".pem"))
    return p


def test_mutual_tls(heads, certs):
    with Server(heads.flags() + ["--tls-cert", certs("server.pem"), "--tls-key", certs("server.key"),
                                 "--tls-client-ca", certs("ca.pem")]) as s:
        tls = logitserve.TlsConfig.from_files(certs("ca.pem"), certs("client.pem"), certs("client.key"))
        with logitserve.Client(s.address, tls=tls) as c:
            assert c.score(logits=LOGITS, target_ids=[2]).target_logprobs.shape == (1,)
        # Without a client certificate the handshake is refused.
        no_cert = logitserve.TlsConfig.from_files(certs("ca.pem"))
        with logitserve.Client(s.address, tls=no_cert, max_retries=0) as c:
            with pytest.raises(logitserve.Unavailable):
                c.list_heads()
