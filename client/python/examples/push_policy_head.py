#!/usr/bin/env python3
"""Push a new policy head every training step (LoadHead), then score pinned to that version.

Each "step" uploads the trainer's current LM-head weight [V, H] as head "policy-live" (version 0
= current + 1; the server validates the upload and swaps it in atomically; requests already
running finish on the old weights). Scoring then pins head_version to the version just
installed, so a result can never come from a stale or a newer head: a mismatch is
FAILED_PRECONDITION. The weights here are random stand-ins for an optimizer's updates.
"""

import numpy as np

import logitserve
from _demo import parse_args, server_address

LIVE_HIDDEN = 128   # a small hidden size keeps each upload at 8 MB of bf16
STEPS = 3
ROWS = 6


def main():
    args = parse_args(__doc__.splitlines()[0])
    rng = np.random.default_rng(2)

    with server_address(args) as address, \
            logitserve.Client(address, token=args.token) as client:
        reference = client.list_heads()["reference"]  # the live head must match its vocabulary
        weight = rng.normal(0, 0.05, (reference.vocab_size, LIVE_HIDDEN)).astype(np.float32)
        hidden = rng.normal(0, 1, (ROWS, LIVE_HIDDEN)).astype(np.float32)
        ref_hidden = rng.normal(0, 1, (ROWS, reference.hidden_size)).astype(np.float32)
        ids = rng.integers(0, reference.vocab_size, ROWS)
        versions = []
        print("step  version  mean log p(ids)   mean KL(p||q)   head dtype")
        for step in range(1, STEPS + 1):
            weight += rng.normal(0, 0.02, weight.shape).astype(np.float32)  # "optimizer step"
            info = client.load_head("policy-live", weight, dtype="bf16")   # rounded to bf16
            versions.append(info.version)
            r = client.score(head="policy-live", hidden=hidden, target_ids=ids,
                             head_version=info.version, reference_head="reference",
                             reference_hidden=ref_hidden, reverse_kl=True)
            assert r.head_version == info.version
            print("%4d  %7d  %15.4f  %14.4f   %s [%d, %d]" % (
                step, info.version, r.target_logprobs.mean(), r.reverse_kl.mean(), info.dtype,
                info.vocab_size, info.hidden_size))
        assert versions == sorted(versions) and len(set(versions)) == STEPS
        try:
            client.score(head="policy-live", hidden=hidden, head_version=versions[0])
            raise SystemExit("a stale version pin was accepted")
        except logitserve.FailedPrecondition as e:
            print("pinning the old version %d fails as it should: %s" % (versions[0], e.details))
        live = client.list_heads()["policy-live"]
        print("ListHeads: %r (source: %s)" % (live, live.source))


if __name__ == "__main__":
    main()
