#!/usr/bin/env python3
"""GRPO-style KL penalty with exact reference log-probs from logitserve.

A group of G rollouts for one prompt, packed into one request of N rows (sequence_lengths). For
each completion token the server returns, from the policy p (head "policy") and the reference q
(head "reference"):
  - target_logprobs: log p(token) of the sampled tokens (prompt rows use ignore_index = -100);
  - a second call gives log q(token) (the reference head as the model);
  - reverse_kl = KL(p || q) over the full vocabulary, exactly, per token.
GRPO's penalty uses the k3 estimator of KL(p || q) on the sampled token:
  k3 = q/p - log(q/p) - 1 = exp(lq - lp) - (lq - lp) - 1   (unbiased for tokens drawn from p, >= 0).
We print both per sequence: the k3 sample estimate and the exact KL. The hidden states here are
random stand-ins for the policy's and the reference model's final hidden states.
"""

import numpy as np

import logitserve
from _demo import parse_args, server_address, stand_in_reference

G, PROMPT, COMPLETION = 4, 3, 6   # group size, prompt rows, completion rows per sequence
L = PROMPT + COMPLETION
BETA_KL = 0.04                    # GRPO's KL coefficient


def main():
    args = parse_args(__doc__.splitlines()[0])
    rng = np.random.default_rng(0)
    n = G * (PROMPT + COMPLETION)
    lengths = [PROMPT + COMPLETION] * G

    with server_address(args) as address, logitserve.Client(address, token=args.token) as client:
        heads = client.list_heads()  # vocab and hidden sizes come from the server
        vocab = heads["policy"].vocab_size
        policy_hidden = rng.normal(0, 1, (n, heads["policy"].hidden_size)).astype(np.float32)
        ref_hidden = stand_in_reference(rng, policy_hidden, heads["reference"].hidden_size, 0.3)
        # Sample the completion tokens from p restricted to its top 64 (a stand-in for the
        # rollout engine's sampler), prompts masked with ignore_index.
        top = client.score(head="policy", hidden=policy_hidden, top_k=64, dtype="bf16")
        probs = np.exp(top.top_k_logprobs.astype(np.float64))
        probs /= probs.sum(axis=1, keepdims=True)
        sampled = np.array([rng.choice(top.top_k_ids[i], p=probs[i]) for i in range(n)])
        is_prompt = np.tile(np.arange(PROMPT + COMPLETION) < PROMPT, G)
        ids = np.where(is_prompt, -100, sampled)

        pol = client.score(head="policy", hidden=policy_hidden, target_ids=ids,
                           reference_head="reference", reference_hidden=ref_hidden,
                           reverse_kl=True, sequence_lengths=lengths, dtype="bf16")
        ref = client.score(head="reference", hidden=ref_hidden, target_ids=ids,
                           sequence_lengths=lengths, dtype="bf16")

    log_ratio = ref.target_logprobs.astype(np.float64) - pol.target_logprobs  # log q/p
    k3 = np.where(is_prompt, 0.0, np.exp(log_ratio) - log_ratio - 1.0)
    exact = np.where(is_prompt, 0.0, pol.reverse_kl)  # KL(p || q) per token, nats
    print("GRPO KL penalty: policy p = head 'policy', reference q = head 'reference', "
          "vocab %d, %d sequences x %d completion tokens" % (vocab, G, COMPLETION))
    print("seq  tokens  mean log p   mean log q   k3 estimate  exact KL(p||q)  penalty")
    row = 0
    for s, length in enumerate(lengths):
        sl = slice(row, row + length)
        count = pol.sequence_means.token_count[s]
        k3_mean = k3[sl].sum() / count
        print("%3d  %6d  %11.4f  %11.4f  %11.4f  %14.4f  %7.4f" % (
            s, count, pol.sequence_means.target_logprobs[s], ref.sequence_means.target_logprobs[s],
            k3_mean, pol.sequence_means.reverse_kl[s], BETA_KL * pol.sequence_means.reverse_kl[s]))
        row += length
    # The server's per-sequence means count only rows with a non-ignored target (the completion).
    assert np.all(pol.sequence_means.token_count == COMPLETION)
    assert np.allclose(pol.sequence_sums.reverse_kl, [exact[row:row + L].sum() for row in range(0, n, L)],
                       rtol=1e-5)
    assert np.all(k3[~is_prompt] >= 0) and np.all(pol.reverse_kl >= 0)
    print("k3 is a one-sample estimate on the sampled token; exact KL sums over all %d tokens." % vocab)


if __name__ == "__main__":
    main()
