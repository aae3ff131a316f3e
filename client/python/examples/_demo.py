"""Shared by the examples: connect to a running server (--target, default the demo's address)
or start a private one (--server-binary) with the demo's heads: policy and reference, synthetic,
vocab 32000, hidden 1024 (scripts/demo.sh serves the same). The examples read every size from
ListHeads, so they run against any server holding heads named policy and reference."""

import argparse
import contextlib
import signal
import subprocess

import numpy as np

# Only for the private server; the examples ask the server for the sizes.
VOCAB, HIDDEN = 32000, 1024
DEMO_HEADS = ["--synthetic-head", "policy:vocab=%d,hidden=%d,seed=1" % (VOCAB, HIDDEN),
              "--synthetic-head", "reference:vocab=%d,hidden=%d,seed=2" % (VOCAB, HIDDEN)]


def parse_args(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--target", default="127.0.0.1:50051",
                   help="server address (e.g. the one scripts/demo.sh prints)")
    p.add_argument("--server-binary", help="start this logitserve binary with the demo heads")
    p.add_argument("--token", help="bearer token, if the server requires one")
    return p.parse_args()


@contextlib.contextmanager
def server_address(args):
    """Yields the address to use; stops the private server, if any, on exit."""
    if not args.server_binary:
        yield args.target
        return
    proc = subprocess.Popen([args.server_binary, "--backend", "cpu", "--listen", "127.0.0.1:0"]
                            + DEMO_HEADS, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        for line in proc.stdout:
            line = line.decode().strip()
            if line.startswith("logitserve listening on "):
                yield line[len("logitserve listening on "):]
                return
        raise RuntimeError("the server exited before listening (rc %s)" % proc.wait())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait()


def stand_in_reference(rng, hidden, width, noise):
    """Random stand-in for a reference model's hidden states [N, width]: close to `hidden` when
    the widths match (a reference near the policy), independent otherwise."""
    if width == hidden.shape[1]:
        return (hidden + rng.normal(0, noise, hidden.shape)).astype(np.float32)
    return rng.normal(0, 1, (hidden.shape[0], width)).astype(np.float32)
