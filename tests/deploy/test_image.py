"""The CPU container image, built and run for real where podman is installed and the test is
asked for (`LOGITSERVE_IMAGE_TEST=1 ctest -L image`; ctest deploy_image). Skipped, and reported
so, otherwise, e.g. in CI: CI runs on a machine that has podman but no registry, and a
from-scratch image build takes about a third of its time budget. scripts/build-image.sh builds it; the server
then starts from the image, through `podman run` where the runtime allows it, else by chroot into
the mounted image as the image's user (10001), serving a head file the test wrote; health and
one Score are checked against the fp64 reference.

Base images: $LOGITSERVE_TEST_BUILD_IMAGE / $LOGITSERVE_TEST_RUNTIME_IMAGE (default debian:12 and
debian:12-slim; e.g. images imported from a debootstrap tarball where no registry is reachable).
$LOGITSERVE_SKIP_IMAGE_TEST=1 still skips it."""

import os
import queue
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

REPO = os.environ.get("LOGITSERVE_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python", "tests"))
import reference as ref  # noqa: E402
from support import write_safetensors  # noqa: E402

TAG = "localhost/logitserve:cpu-test"
V, H = 257, 16


def _podman():
    if os.environ.get("LOGITSERVE_IMAGE_TEST") != "1" or \
            os.environ.get("LOGITSERVE_SKIP_IMAGE_TEST") == "1":
        pytest.skip("the image test runs only with LOGITSERVE_IMAGE_TEST=1 (it builds the image)")
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("podman is not installed: the container image is not built here")
    if os.geteuid() != 0:
        pytest.skip("building and mounting the image needs root")
    return podman


def _wait_listening(proc, timeout=120):
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l.decode(errors="replace").strip())
                                     for l in proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is None:
            return None
        if line.startswith("logitserve listening on "):
            return line.split()[-1]


def _serve(podman, heads_dir, stack):
    args = ["--listen", "127.0.0.1:0", "--backend", "cpu", "--threads", "1"]
    head = ["--head", "policy=/mnt/head.safetensors:policy"]  # /mnt: in every Debian image
    # 1. Through the container runtime.
    proc = subprocess.Popen([podman, "run", "--rm", "--network", "host", "--entrypoint",
                             "/usr/local/bin/logitserve", "-v", heads_dir + ":/mnt:ro", TAG]
                            + args + head, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stack.append(proc)
    address = _wait_listening(proc, timeout=60)
    if address:
        return address, "podman run"
    proc.kill()
    # 2. The runtime refuses (e.g. crun cannot set rlimits here): chroot into the mounted image,
    #    as the image's user, with the heads bind-mounted where the image expects them.
    root = subprocess.run([podman, "image", "mount", TAG], check=True, capture_output=True,
                          text=True).stdout.strip()
    stack.append(lambda: subprocess.run([podman, "image", "unmount", TAG], check=False))
    for src, dst in [(heads_dir, "mnt"), ("/dev", "dev"), ("/proc", "proc")]:
        target = os.path.join(root, dst)
        if not os.path.isdir(target):
            pytest.fail("the image lacks /%s to mount onto" % dst)
        subprocess.run(["mount", "--bind", src, target], check=True)
        stack.append(lambda t=target: subprocess.run(["umount", "-l", t], check=False))
    proc = subprocess.Popen(["chroot", "--userspec=10001:10001", root,
                             "/usr/local/bin/logitserve"] + args + head,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stack.append(proc)
    address = _wait_listening(proc)
    assert address, "the image's server did not start (podman run nor chroot)"
    return address, "chroot into the image"


def test_cpu_image_builds_and_serves(tmp_path):
    podman = _podman()
    build = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "build-image.sh"), "--cpu", "--engine", "podman",
         "--tag", TAG,
         "--build-image", os.environ.get("LOGITSERVE_TEST_BUILD_IMAGE", "debian:12"),
         "--runtime-image", os.environ.get("LOGITSERVE_TEST_RUNTIME_IMAGE", "debian:12-slim")],
        cwd=REPO, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]

    rng = np.random.default_rng(3)
    weight = rng.normal(0, 0.3, (V, H)).astype(np.float32)
    heads_dir = tmp_path / "heads"
    heads_dir.mkdir()
    os.chmod(heads_dir, 0o755)
    write_safetensors(str(heads_dir / "head.safetensors"), {"policy": ("F32", weight)})
    os.chmod(heads_dir / "head.safetensors", 0o644)

    import logitserve
    stack = []
    try:
        address, how = _serve(podman, str(heads_dir), stack)
        with logitserve.Client(address, timeout=30) as client:
            assert client.health() == "SERVING", how
            hidden = rng.normal(0, 1, (5, H)).astype(np.float32)
            ids = rng.integers(0, V, 5)
            r = client.score(head="policy", hidden=hidden, target_ids=ids, entropy=True)
        z = ref.logits64(hidden.astype(np.float64), weight.astype(np.float64))
        lp = ref.log_softmax(z)
        dz = ref.gemm_error_bound(hidden.astype(np.float64), weight.astype(np.float64))
        want = ref.target_logprobs(lp, ids)
        assert np.all(np.abs(r.target_logprobs - want) <= ref.logprob_tol(V, dz, want)), how
        z_range = np.max(z, axis=-1) - np.min(z, axis=-1)
        assert np.all(np.abs(r.entropy - ref.entropy(lp)) <= ref.stat_tol(V, dz, z_range)), how
    finally:
        for item in reversed(stack):
            if callable(item):
                item()
            elif item.poll() is None:
                item.terminate()
                item.wait(timeout=30)
