#!/usr/bin/env python3
"""On-policy distillation with generalized JSD(beta), forward and reverse KL from logitserve.

Student = model p (head "policy"), teacher = reference q (head "reference"). The student
generated the tokens (on-policy); the loss per token is one of
  forward_kl = KL(q || p)   (teacher-weighted, mode covering; GKD beta = 0),
  reverse_kl = KL(p || q)   (student-weighted, mode seeking; GKD beta = 1),
  jsd (beta) = beta KL(q || m) + (1 - beta) KL(p || m),  m = (1 - beta) p + beta q,
all over the full vocabulary, in nats. The endpoints are exact: jsd(0) == forward_kl and
jsd(1) == reverse_kl bit for bit (TRL's GKD / DeepSpeed convention). Per-sequence means give the
loss of each sequence; a distillation temperature is applied to both sides separately.
"""

import numpy as np

import logitserve
from _demo import parse_args, server_address, stand_in_reference

SEQUENCES, LENGTH = 3, 5
TEMPERATURE = 1.0


def main():
    args = parse_args(__doc__.splitlines()[0])
    rng = np.random.default_rng(1)
    n = SEQUENCES * LENGTH
    lengths = [LENGTH] * SEQUENCES

    with server_address(args) as address, logitserve.Client(address, token=args.token) as client:
        heads = client.list_heads()  # hidden sizes come from the server
        student_hidden = rng.normal(0, 1, (n, heads["policy"].hidden_size)).astype(np.float32)
        teacher_hidden = stand_in_reference(rng, student_hidden, heads["reference"].hidden_size,
                                            0.5)
        common = dict(head="policy", hidden=student_hidden, reference_head="reference",
                      reference_hidden=teacher_hidden, sequence_lengths=lengths, dtype="bf16",
                      temperature=TEMPERATURE, reference_temperature=TEMPERATURE)
        kl = client.score(forward_kl=True, reverse_kl=True, entropy=True, reference_entropy=True,
                          **common)
        jsd = {beta: client.score(jsd_beta=beta, **common) for beta in (0.0, 0.1, 0.5, 0.9, 1.0)}

    print("On-policy distillation: student p = 'policy', teacher q = 'reference', %d tokens" % n)
    print("per-sequence means (nats):")
    print("seq   H(p)     H(q)   KL(q||p)  KL(p||q)  " + "  ".join("JSD(%.1f)" % b for b in jsd))
    for s in range(SEQUENCES):
        m = kl.sequence_means
        print("%3d %7.4f %8.4f %9.4f %9.4f  " % (s, m.entropy[s], m.reference_entropy[s],
                                                m.forward_kl[s], m.reverse_kl[s])
              + "  ".join("%8.4f" % jsd[b].sequence_means.jsd[s] for b in jsd))
    assert np.array_equal(jsd[0.0].jsd, kl.forward_kl), "beta = 0 must be forward KL exactly"
    assert np.array_equal(jsd[1.0].jsd, kl.reverse_kl), "beta = 1 must be reverse KL exactly"
    print("checked: JSD(0) == KL(q||p) and JSD(1) == KL(p||q), bit for bit, on every token")
    loss = jsd[0.5].sequence_means.jsd.mean()
    print("loss (JSD beta=0.5, mean over sequences): %.5f nats" % loss)


if __name__ == "__main__":
    main()
