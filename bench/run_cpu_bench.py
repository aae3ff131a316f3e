#!/usr/bin/env python3
"""CPU benchmarks of SPEC §9 with their peers, in one run:

1. logitserve-cpu-bench: the CPU backend on fp32 [2048 x 32000] logits (logprobs, entropy,
   top-k, KL, JSD) against the memory-read floor it measures itself;
2. numpy (Debian python3-numpy, OpenBLAS) doing the same math on the same shape;
3. hidden mode end to end over gRPC (N=2048, H=1024, V=32000: logprobs + entropy) against
   numpy + OpenBLAS doing the matmul and the log-softmax.

Usage: bench/run_cpu_bench.py [--build build] [--iters 5] [--json out.json]
Run it on an otherwise idle machine; it prints one table per part.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

N, V, H = 2048, 32000, 1024


def best_ms(fn, iters):
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def log_softmax(z):
    m = z.max(axis=1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))


def numpy_ops(iters):
    rng = np.random.default_rng(7)
    a = rng.normal(0, 3, (N, V)).astype(np.float32)
    b = rng.normal(0, 3, (N, V)).astype(np.float32)
    ids = (np.arange(N) * 7919) % V
    rows = np.arange(N)

    def logprobs():
        return log_softmax(a)[rows, ids]

    def entropy():
        lp = log_softmax(a)
        return -(np.exp(lp) * lp).sum(axis=1)

    def top_k():
        lp = log_softmax(a)
        idx = np.argpartition(-lp, 8, axis=1)[:, :8]
        return np.take_along_axis(lp, idx, axis=1)

    def kl():
        la, lb = log_softmax(a), log_softmax(b)
        pa, pb = np.exp(la), np.exp(lb)
        return (pb * (lb - la)).sum(axis=1), (pa * (la - lb)).sum(axis=1)

    def jsd():
        beta = np.float32(0.5)
        la, lb = log_softmax(a), log_softmax(b)
        pa, pb = np.exp(la), np.exp(lb)
        lm = np.logaddexp(np.log1p(-beta) + la, np.log(beta) + lb)
        return beta * (pb * (lb - lm)).sum(axis=1) + (1 - beta) * (pa * (la - lm)).sum(axis=1)

    return {
        "logprobs": best_ms(logprobs, iters),
        "entropy": best_ms(entropy, iters),
        "top_k=8": best_ms(top_k, iters),
        "kl (fwd+rev)": best_ms(kl, iters),
        "jsd(0.5)": best_ms(jsd, iters),
    }


def numpy_hidden(iters):
    rng = np.random.default_rng(3)
    h = rng.normal(0, 1, (N, H)).astype(np.float32)
    w = (rng.normal(0, 1, (V, H)) / np.sqrt(H) * 3).astype(np.float32)
    ids = (np.arange(N) * 7919) % V
    rows = np.arange(N)
    wt = np.ascontiguousarray(w.T)
    matmul = best_ms(lambda: h @ wt, iters)

    def full():
        lp = log_softmax(h @ wt)
        return lp[rows, ids], -(np.exp(lp) * lp).sum(axis=1)

    return matmul, best_ms(full, iters)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {}

    with tempfile.TemporaryDirectory() as tmp:
        kj = os.path.join(tmp, "kernels.json")
        subprocess.run([os.path.join(args.build, "bench/logitserve-cpu-bench"), "--iters",
                        str(args.iters), "--json", kj], check=True)
        kernels = json.load(open(kj))
    out["kernels"] = kernels
    np_ms = numpy_ops(args.iters)
    out["numpy"] = np_ms
    print("\nlogits mode vs numpy (same shape, fp32):")
    print(f"{'op':14s} {'logitserve_ms':>14s} {'numpy_ms':>10s} {'speedup':>8s} {'ratio_to_floor':>15s}")
    for op in kernels["ops"]:
        n = np_ms[op["op"]]
        print(f"{op['op']:14s} {op['ms']:14.2f} {n:10.1f} {n / op['ms']:8.1f} {op['ratio']:15.2f}")

    # Hidden mode end to end over gRPC.
    server = subprocess.Popen(
        [os.path.join(args.build, "server/logitserve"), "--backend", "cpu", "--listen",
         "127.0.0.1:0", "--synthetic-head", f"policy:vocab={V},hidden={H},seed=1"],
        stdout=subprocess.PIPE, text=True)
    try:
        addr = None
        for line in server.stdout:
            if "listening on" in line:
                addr = line.strip().split()[-1]
                break
        if addr is None:
            sys.exit("server did not start")
        with tempfile.TemporaryDirectory() as tmp:
            hj = os.path.join(tmp, "hidden.json")
            subprocess.run([os.path.join(args.build, "bench/logitserve-hidden-bench"), "--target",
                            addr, "--head", "policy", "--rows", str(N), "--iters", str(args.iters),
                            "--json", hj], check=True)
            hidden = json.load(open(hj))
    finally:
        server.terminate()
        server.wait(timeout=30)
    np_matmul, np_full = numpy_hidden(args.iters)
    out["hidden"] = {"logitserve": hidden, "numpy_matmul_ms": np_matmul, "numpy_full_ms": np_full}
    print("\nhidden mode end to end (N=2048, H=1024, V=32000; logprobs + entropy):")
    print(f"  logitserve over gRPC {hidden['ms']:.1f} ms (server compute {hidden['compute_ms']:.1f} ms, "
          f"{hidden['gflop'] / hidden['ms'] * 1e3:.0f} GFLOP/s)")
    print(f"  numpy+OpenBLAS       {np_full:.1f} ms (its fp32 matmul alone {np_matmul:.1f} ms = "
          f"{hidden['gflop'] / np_matmul * 1e3:.0f} GFLOP/s)")
    print(f"  speedup vs numpy     {np_full / hidden['ms']:.2f}x; "
          f"ratio to numpy's bare matmul {hidden['ms'] / np_matmul:.2f}")
    if args.json:
        json.dump(out, open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
