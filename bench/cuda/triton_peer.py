"""The Triton peer of logitserve-kernel-bench: the kernels a careful user writes in an afternoon.

One program per row, the row read once in chunks of BLOCK ids, online softmax statistics rescaled
once per chunk with a scalar (never per element): max, sum exp and the centred weighted sums that
entropy and both KL directions need, plus the logit of a target id. Logits mode calls them on the
whole [N, V] tensors; the stock-parts hidden-mode peer calls them on bf16 row tiles of logits that
torch.matmul writes (the full [N, V] logits never exist).

Used by torch_baseline.py; every result is checked against torch's fp32 log_softmax there.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _lp_entropy_kernel(z_ptr, ld, ids_ptr, lp_ptr, ent_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * ld
    m = -float("inf")
    s = 0.0
    w = 0.0  # sum exp(z - m) (z - m)
    for c0 in range(0, V, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        d = tl.where(m > -float("inf"), m - m_new, 0.0)  # first chunk: s = w = 0, keep 0 * inf out
        r = tl.exp(d)
        dz = z - m_new
        e = tl.exp(dz)
        dz = tl.where(cols < V, dz, 0.0)
        w = (w + s * d) * r + tl.sum(e * dz, 0)
        s = s * r + tl.sum(e, 0)
        m = m_new
    log_s = tl.log(s)
    t = tl.load(ids_ptr + row)
    zt = tl.load(base + t).to(tl.float32)
    tl.store(lp_ptr + row, zt - m - log_s)
    tl.store(ent_ptr + row, log_s - w / s)


@triton.jit
def _pair_kernel(a_ptr, b_ptr, ld, ids_ptr, lp_ptr, ent_a_ptr, ent_b_ptr, fwd_ptr, rev_ptr, V,
                 BLOCK: tl.constexpr):
    # a = model p, b = reference q. Sums in the frame of the running maxima (ma, mb):
    # sa, wa = sum ea, sum ea (a - ma); xab = sum ea (b - mb); likewise for b.
    row = tl.program_id(0).to(tl.int64)
    pa = a_ptr + row * ld
    pb = b_ptr + row * ld
    ma = -float("inf")
    mb = -float("inf")
    sa = 0.0
    wa = 0.0
    xab = 0.0
    sb = 0.0
    wb = 0.0
    xba = 0.0
    for c0 in range(0, V, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        valid = cols < V
        a = tl.load(pa + cols, mask=valid, other=-float("inf")).to(tl.float32)
        b = tl.load(pb + cols, mask=valid, other=-float("inf")).to(tl.float32)
        ma_new = tl.maximum(ma, tl.max(a, 0))
        mb_new = tl.maximum(mb, tl.max(b, 0))
        da = tl.where(ma > -float("inf"), ma - ma_new, 0.0)
        db = tl.where(mb > -float("inf"), mb - mb_new, 0.0)
        ra = tl.exp(da)
        rb = tl.exp(db)
        ca = a - ma_new
        cb = b - mb_new
        ea = tl.exp(ca)
        eb = tl.exp(cb)
        ca = tl.where(valid, ca, 0.0)
        cb = tl.where(valid, cb, 0.0)
        wa = (wa + sa * da) * ra + tl.sum(ea * ca, 0)
        xab = (xab + sa * db) * ra + tl.sum(ea * cb, 0)
        sa = sa * ra + tl.sum(ea, 0)
        wb = (wb + sb * db) * rb + tl.sum(eb * cb, 0)
        xba = (xba + sb * da) * rb + tl.sum(eb * ca, 0)
        sb = sb * rb + tl.sum(eb, 0)
        ma = ma_new
        mb = mb_new
    la = tl.log(sa)
    lb = tl.log(sb)
    t = tl.load(ids_ptr + row)
    tl.store(lp_ptr + row, tl.load(pa + t).to(tl.float32) - ma - la)
    tl.store(ent_a_ptr + row, la - wa / sa)
    tl.store(ent_b_ptr + row, lb - wb / sb)
    # KL(q || p) = sum q (lq - lp) = wb / sb - lb - xba / sb + la; KL(p || q) likewise.
    tl.store(fwd_ptr + row, wb / sb - lb - xba / sb + la)
    tl.store(rev_ptr + row, wa / sa - la - xab / sa + lb)


BLOCK = 4096
NUM_WARPS = 8


def lp_entropy(z, ids):
    """Log-probability of ids[r] and entropy of each row of z [N, V] (any float dtype)."""
    n, v = z.shape
    lp = torch.empty(n, device=z.device, dtype=torch.float32)
    ent = torch.empty_like(lp)
    _lp_entropy_kernel[(n,)](z, z.stride(0), ids, lp, ent, v, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return lp, ent


def pair_stats(a, b, ids):
    """(logprob of ids[r] under a, H(a), H(b), KL(b || a), KL(a || b)) per row."""
    n, v = a.shape
    out = [torch.empty(n, device=a.device, dtype=torch.float32) for _ in range(5)]
    _pair_kernel[(n,)](a, b, a.stride(0), ids, *out, v, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return tuple(out)


def hidden_stock_parts(h1, w1, h2, w2, ids, tile_rows=512):
    """Stock parts, hidden mode: torch.matmul into bf16 row tiles of logits, then _pair_kernel.
    Returns target logprobs, both entropies and KL(reference || model) for all rows."""
    n = h1.shape[0]
    lp = torch.empty(n, device=h1.device, dtype=torch.float32)
    e1, e2, fkl = torch.empty_like(lp), torch.empty_like(lp), torch.empty_like(lp)
    for r0 in range(0, n, tile_rows):
        r1 = min(n, r0 + tile_rows)
        z1 = h1[r0:r1] @ w1.t()
        z2 = h2[r0:r1] @ w2.t()
        t_lp, t_e1, t_e2, t_fkl, _ = pair_stats(z1, z2, ids[r0:r1])
        lp[r0:r1], e1[r0:r1], e2[r0:r1], fkl[r0:r1] = t_lp, t_e1, t_e2, t_fkl
    return lp, e1, e2, fkl
