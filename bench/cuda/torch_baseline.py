#!/usr/bin/env python3
"""PyTorch baselines for logitserve-kernel-bench (SPEC §9), same ops and shapes, same GPU.

Logits mode, bf16 [N x V] (default 8192 x 75968): logprobs of one target id per row, entropy,
top-64, forward + reverse KL, JSD(beta = 0.5) -- each in eager mode and under torch.compile,
written the way trainers write them (upcast to fp32, log_softmax, exp). Hidden mode (8192 x 4096 x
151936, bf16 heads): two bare matmuls, and matmul + logprobs + entropy of both heads + forward KL,
eager and compiled. Every timing is the best of --iters CUDA-event timings after warm-up; the
extra memory column is the peak allocation above the inputs.

Usage: bench/cuda/torch_baseline.py [--rows 8192] [--vocab 75968] [--iters 10] [--no-hidden]
                                   [--json out.json]
"""
import argparse
import json
import math

import torch

try:  # the Triton peer (triton_peer.py beside this file)
    import triton_peer
except ImportError as e:  # no Triton: the peer rows print as missing
    triton_peer = None
    print(f"triton peer unavailable: {e}")


def best_ms(fn, iters, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def peak_extra_mb(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e6


def logprobs(z, ids):
    return torch.log_softmax(z.float(), dim=-1).gather(-1, ids[:, None]).squeeze(-1)


def entropy(z):
    lp = torch.log_softmax(z.float(), dim=-1)
    return -(lp.exp() * lp).sum(-1)


def topk(z, k=64):
    return torch.log_softmax(z.float(), dim=-1).topk(k, dim=-1)


def topk1024(z):
    return topk(z, 1024)


def kl_both(z_model, z_ref):
    lm = torch.log_softmax(z_model.float(), dim=-1)
    lr = torch.log_softmax(z_ref.float(), dim=-1)
    fwd = (lr.exp() * (lr - lm)).sum(-1)
    rev = (lm.exp() * (lm - lr)).sum(-1)
    return fwd, rev


def jsd(z_student, z_teacher, beta=0.5):
    ls = torch.log_softmax(z_student.float(), dim=-1)
    lt = torch.log_softmax(z_teacher.float(), dim=-1)
    lm = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), dim=0)
    return beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)


def hidden_ops(h1, w1, h2, w2, ids):
    z1 = h1 @ w1.t()
    z2 = h2 @ w2.t()
    l1 = torch.log_softmax(z1.float(), dim=-1)
    l2 = torch.log_softmax(z2.float(), dim=-1)
    lp = l1.gather(-1, ids[:, None]).squeeze(-1)
    e1 = -(l1.exp() * l1).sum(-1)
    e2 = -(l2.exp() * l2).sum(-1)
    fkl = (l2.exp() * (l2 - l1)).sum(-1)
    return lp, e1, e2, fkl


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=75968)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--hidden-rows", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--hidden-vocab", type=int, default=151936)
    p.add_argument("--no-hidden", action="store_true")
    p.add_argument("--no-logits", action="store_true", help="hidden mode only")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    print(f"torch {torch.__version__} on {out['device']}")

    g = torch.Generator(device=dev).manual_seed(0)
    if not args.no_logits:
        n, v = args.rows, args.vocab
        a = (torch.randn(n, v, device=dev, generator=g) * 3).to(torch.bfloat16)
        b = (torch.randn(n, v, device=dev, generator=g) * 3).to(torch.bfloat16)
        ids = torch.randint(0, v, (n,), device=dev, generator=g)
        copy_ms = best_ms(lambda: a.clone(), args.iters)
        one_read = copy_ms / 2  # a copy reads and writes the same bytes
        gb = a.numel() * 2 / 1e9
        print(f"\nlogits mode bf16 [{n} x {v}] ({gb:.2f} GB per tensor); D2D clone {copy_ms:.3f} ms "
              f"-> one-read estimate {one_read:.3f} ms ({gb / one_read * 1e3:.0f} GB/s)")
        ops = [
            ("logprobs", 1, lambda f: f(a, ids), logprobs),
            ("entropy", 1, lambda f: f(a), entropy),
            ("top_k=64", 1, lambda f: f(a), topk),
            ("top_k=1024", 1, lambda f: f(a), topk1024),
            ("kl (fwd+rev)", 2, lambda f: f(a, b), kl_both),
            ("jsd(0.5)", 2, lambda f: f(a, b), jsd),
        ]
        print(f"{'op':14s} {'eager_ms':>9s} {'extra_MB':>9s} {'compile_ms':>10s} {'extra_MB':>9s} "
              f"{'floor_ms':>9s} {'eager/fl':>8s} {'comp/fl':>8s}")
        out["logits"] = []
        for name, reads, call, fn in ops:
            floor = one_read * reads
            eager = best_ms(lambda: call(fn), args.iters)
            eager_mb = peak_extra_mb(lambda: call(fn))
            comp, comp_mb = float("nan"), float("nan")
            if not args.no_compile:
                cfn = torch.compile(fn)
                comp = best_ms(lambda: call(cfn), args.iters, warmup=3)
                comp_mb = peak_extra_mb(lambda: call(cfn))
            print(f"{name:14s} {eager:9.3f} {eager_mb:9.0f} {comp:10.3f} {comp_mb:9.0f} {floor:9.3f} "
                  f"{eager / floor:8.2f} {comp / floor:8.2f}")
            out["logits"].append({"op": name, "eager_ms": eager, "eager_extra_mb": eager_mb,
                                  "compile_ms": comp, "compile_extra_mb": comp_mb, "floor_ms": floor})
        if triton_peer is not None:
            # Checked against eager fp32 torch on the same inputs before timing.
            lp_t, ent_t = triton_peer.lp_entropy(a, ids)
            _, e_a, e_b, fwd_t, rev_t = triton_peer.pair_stats(a, b, ids)
            fwd_ref, rev_ref = kl_both(a, b)
            err = max((lp_t - logprobs(a, ids)).abs().max().item(),
                      (ent_t - entropy(a)).abs().max().item(),
                      (e_b - entropy(b)).abs().max().item(),
                      (fwd_t - fwd_ref).abs().max().item(), (rev_t - rev_ref).abs().max().item())
            t1 = best_ms(lambda: triton_peer.lp_entropy(a, ids), args.iters)
            t2 = best_ms(lambda: triton_peer.pair_stats(a, b, ids), args.iters)
            print(f"triton peer (one program per row, chunk {triton_peer.BLOCK}; max |err| vs eager "
                  f"{err:.2e}):")
            print(f"{'logprobs+entropy':18s} {t1:9.3f} ms  {t1 / one_read:6.2f} x one read")
            print(f"{'kl (fwd+rev)+ent':18s} {t2:9.3f} ms  {t2 / (2 * one_read):6.2f} x two reads")
            out["triton"] = {"lp_entropy_ms": t1, "pair_ms": t2, "max_abs_err": err}
        del a, b
        torch.cuda.empty_cache()

    if not args.no_hidden:
        hn, hh, hv = args.hidden_rows, args.hidden, args.hidden_vocab
        h1 = torch.randn(hn, hh, device=dev, generator=g).to(torch.bfloat16)
        h2 = torch.randn(hn, hh, device=dev, generator=g).to(torch.bfloat16)
        w1 = (torch.randn(hv, hh, device=dev, generator=g) * (3 / hh ** 0.5)).to(torch.bfloat16)
        w2 = (torch.randn(hv, hh, device=dev, generator=g) * (3 / hh ** 0.5)).to(torch.bfloat16)
        hids = torch.randint(0, hv, (hn,), device=dev, generator=g)
        iters = max(2, args.iters // 3)
        bare = best_ms(lambda: (h1 @ w1.t(), h2 @ w2.t()), iters)
        tflops = 2 * 2 * hn * hh * hv / (bare * 1e9)
        print(f"\nhidden mode N={hn} H={hh} V={hv}: two bare matmuls {bare:.3f} ms ({tflops:.0f} TFLOP/s)")
        eager = best_ms(lambda: hidden_ops(h1, w1, h2, w2, hids), iters)
        eager_mb = peak_extra_mb(lambda: hidden_ops(h1, w1, h2, w2, hids))
        print(f"eager   matmuls + logprobs + entropy x2 + KL: {eager:.3f} ms = {eager / bare:.2f} x bare, "
              f"extra {eager_mb:.0f} MB")
        out["hidden"] = {"bare_ms": bare, "eager_ms": eager, "eager_extra_mb": eager_mb}
        if triton_peer is not None:
            ref = hidden_ops(h1, w1, h2, w2, hids)
            got = triton_peer.hidden_stock_parts(h1, w1, h2, w2, hids)
            err = max((x - y).abs().max().item() for x, y in zip(got, ref))
            sp = best_ms(lambda: triton_peer.hidden_stock_parts(h1, w1, h2, w2, hids), iters)
            sp_mb = peak_extra_mb(lambda: triton_peer.hidden_stock_parts(h1, w1, h2, w2, hids))
            print(f"stock parts (matmul bf16 tiles of 512 rows + triton): {sp:.3f} ms = "
                  f"{sp / bare:.2f} x bare, extra {sp_mb:.0f} MB, max |err| vs eager {err:.2e}")
            out["hidden"].update({"stock_parts_ms": sp, "stock_parts_extra_mb": sp_mb})
        if not args.no_compile:
            cfn = torch.compile(hidden_ops)
            comp = best_ms(lambda: cfn(h1, w1, h2, w2, hids), iters, warmup=3)
            comp_mb = peak_extra_mb(lambda: cfn(h1, w1, h2, w2, hids))
            print(f"compile matmuls + logprobs + entropy x2 + KL: {comp:.3f} ms = {comp / bare:.2f} x bare, "
                  f"extra {comp_mb:.0f} MB")
            out["hidden"].update({"compile_ms": comp, "compile_extra_mb": comp_mb})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
