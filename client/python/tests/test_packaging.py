"""The package as users meet it: its version is the server's (one source tree, one release), the
README's Python snippet runs as written, and torch CPU tensors go in wherever numpy arrays do."""

import os
import re
from importlib import metadata

import numpy as np
import pytest

import logitserve

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "README.md")


def test_version_is_the_installed_distributions_and_the_servers(client):
    assert re.fullmatch(r"\d+\.\d+\.\d+", logitserve.__version__)
    assert metadata.version("logitserve") == logitserve.__version__
    # ListHeads.server_info: the server of this source tree has the same release version.
    heads = client.list_heads()
    assert heads.server_version == logitserve.__version__
    assert heads.server_git_commit


def _readme_snippet():
    text = open(README).read()
    section = text[text.index("## For RL users"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_snippet_runs_as_written(server, heads):
    code = _readme_snippet()
    assert code.count('"127.0.0.1:50051"') == 1
    code = code.replace('"127.0.0.1:50051"', repr(server.address))
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - the documented snippet itself
    try:
        r, lengths = ns["r"], ns["lengths"]
        kl = ns["kl_penalty"]
        assert kl.shape == (len(lengths),)
        assert np.all(np.isfinite(kl)) and np.all(kl >= 0)
        # The per-sequence mean is the mean of the per-token values it reports.
        per_token = r.reverse_kl.astype(np.float64)
        bounds = np.cumsum([0] + list(lengths))
        for s in range(len(lengths)):
            np.testing.assert_allclose(kl[s], per_token[bounds[s]:bounds[s + 1]].mean(), rtol=1e-5)
    finally:
        ns["client"].close()


def test_torch_cpu_tensors_score_like_numpy(client, heads):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    rng = np.random.default_rng(5)
    from conftest import H, V
    hidden = rng.normal(0, 1, (6, H)).astype(np.float32)
    ids = rng.integers(0, V, 6)
    want = client.score(head="policy", hidden=hidden, target_ids=ids, entropy=True)
    got = client.score(head="policy", hidden=torch.from_numpy(hidden),
                       target_ids=torch.from_numpy(ids), entropy=True)
    np.testing.assert_array_equal(got.target_logprobs, want.target_logprobs)
    np.testing.assert_array_equal(got.entropy, want.entropy)
    # torch.bfloat16 travels as BFLOAT16 bits: the same values as numpy rounded to bf16.
    bf16 = client.score(head="policy", hidden=torch.from_numpy(hidden).to(torch.bfloat16),
                        target_ids=ids, entropy=True)
    rounded = client.score(head="policy", hidden=hidden, target_ids=ids, entropy=True,
                           dtype="bf16")
    np.testing.assert_array_equal(bf16.entropy, rounded.entropy)
    if torch.cuda.is_available():  # a GPU tensor is refused with a clear message
        with pytest.raises(TypeError, match="CPU tensor"):
            client.score(head="policy", hidden=torch.from_numpy(hidden).cuda(), target_ids=ids)
