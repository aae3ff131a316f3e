"""Independent fp64 numpy reference of every logitserve output, and the tolerances the tests use.

Written from the definitions (SPEC section 3, docs/math.md), not from the server code: full
softmax over the vocabulary in float64 from the exact input values (bf16 / fp16 upcast exactly).
"""

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2^-23, unit roundoff of fp32 is EPS32 / 2


def bf16_round(x):
    """Reference bf16 rounding in float64 arithmetic (independent of logitserve._tensors): the
    nearest bf16 value, ties to the even mantissa, for finite float32 inputs."""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    out = np.empty_like(x)
    for i, v in enumerate(x.reshape(-1)):
        if v == 0 or not np.isfinite(v):
            out.reshape(-1)[i] = v
            continue
        e = max(int(np.floor(np.log2(abs(v)))), -126)
        ulp = 2.0 ** (e - 7)  # bf16 keeps 8 significant bits (7 stored)
        q = v / ulp
        lo = np.floor(q)
        frac = q - lo
        if frac > 0.5 or (frac == 0.5 and lo % 2 == 1):
            lo += 1
        out.reshape(-1)[i] = lo * ulp
    return out


def logits64(hidden, weight, bias=None):
    """z = h W^T (+ bias) in float64 from the exact values sent."""
    z = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64).T
    if bias is not None:
        z = z + np.asarray(bias, np.float64)
    return z


def log_softmax(z, temperature=1.0):
    z = np.asarray(z, np.float64) / temperature
    m = np.max(z, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        sh = z - m
        return sh - np.log(np.sum(np.exp(sh), axis=-1, keepdims=True))


def _plogp(lp_a, lp_b):
    """Per-token p_a (lp_a - lp_b), 0 where p_a = 0 (masked), +inf where b masks a's token."""
    pa = np.exp(lp_a)
    with np.errstate(invalid="ignore"):
        t = pa * (lp_a - lp_b)
    t = np.where(np.isneginf(lp_a), 0.0, t)
    return t


def entropy(lp):
    p = np.exp(lp)
    return -np.sum(np.where(np.isneginf(lp), 0.0, p * lp), axis=-1)


def kl(lp_a, lp_b):
    """KL(a || b) per row."""
    return np.sum(_plogp(lp_a, lp_b), axis=-1)


def jsd(lp_p, lp_q, beta):
    """Generalized JSD: m = (1-beta) p + beta q, beta KL(q || m) + (1-beta) KL(p || m); the
    endpoints are the published TRL / DeepSpeed convention: beta = 0 -> KL(q || p) (forward),
    beta = 1 -> KL(p || q) (reverse)."""
    if beta == 0.0:
        return kl(lp_q, lp_p)
    if beta == 1.0:
        return kl(lp_p, lp_q)
    log_m = np.logaddexp(np.log1p(-beta) + lp_p, np.log(beta) + lp_q)
    return beta * kl(lp_q, log_m) + (1.0 - beta) * kl(lp_p, log_m)


def target_logprobs(lp, ids, ignore_index=-100):
    ids = np.asarray(ids)
    two_d = ids.ndim == 2
    ids2 = ids if two_d else ids[:, None]
    out = np.zeros(ids2.shape, np.float64)
    for r in range(ids2.shape[0]):
        for c in range(ids2.shape[1]):
            if ids2[r, c] != ignore_index:
                out[r, c] = lp[r, ids2[r, c]]
    return out if two_d else out[:, 0]


def top_k(lp, k):
    """k largest per row, descending, ties broken by the smaller id (stable sort on -lp)."""
    order = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
    return order, np.take_along_axis(lp, order, axis=-1)


def sequence_stats(values, lengths, counted):
    """Per-sequence (sums, means, counts) of per-row values ([N] or [N, K]) over counted rows."""
    values = np.asarray(values, np.float64)
    sums, means, counts = [], [], []
    row = 0
    for n in lengths:
        sel = values[row:row + n][counted[row:row + n]]
        s = sel.sum(axis=0)
        sums.append(s)
        counts.append(len(sel))
        means.append(s / len(sel) if len(sel) else np.full_like(s, np.nan))
        row += n
    return np.array(sums), np.array(means), np.array(counts)


# ---- tolerances ----------------------------------------------------------------------------
# The server computes z in fp32 (GEMM of H products) and then the statistics in fp32 over V terms.

def gemm_error_bound(hidden, weight):
    """Per-row bound on |z_fp32 - z_exact|: a dot product of H terms accumulated in fp32 has error
    <= H * u * sum|h_i w_i| (u = EPS32 / 2); max over the row's V logits, times 2 for margin."""
    h = np.abs(np.asarray(hidden, np.float64))
    w = np.abs(np.asarray(weight, np.float64))
    H = h.shape[1]
    return 2.0 * H * (EPS32 / 2) * np.max(h @ w.T, axis=-1)


def logprob_tol(V, dz, lp):
    """|lp error| <= 2 dz (z_t and M) + V u (relative error of the fp32 sum S, through log) +
    |lp| u (final subtraction), with 2x margin."""
    return 2.0 * (2.0 * dz + V * EPS32 / 2 + np.abs(lp) * EPS32 / 2)


def stat_tol(V, dz, z_range):
    """Entropy / KL / JSD: L and W/S each carry V u (1 + range of z - M) from the fp32 sums plus
    2 dz from the logits; two such terms per distribution pair, with 2x margin."""
    return 2.0 * 2.0 * (V * EPS32 / 2 * (1.0 + z_range) + 2.0 * dz)
