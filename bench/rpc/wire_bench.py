#!/usr/bin/env python3
"""The user's view through the project's Python client (issue 12): per request size, the
server's compute-only rate vs the client's end-to-end rate, one pipelined large request, and
shared-memory inputs; the Python twin of logitserve-wire-bench (same request: bf16 [N, H] hidden
states, int32 target ids [N], entropy).

  compute   the server's compute_us of the request sent alone, unsplit (median): rate N / compute
  e2e       closed-loop tokens/s with C threads (default clamp(4096 / N, 2, 32)), client defaults
            (pipelining on); ratio e2e / compute >= 0.90 meets target 1
  single    wall time of one pipelined score() of the N rows; with --transfer-json (the C++
            bench's JSON, which times the raw transfer) also single / max(compute, transfer),
            <= 1.15 meets target 2
  unpiped   one unsplit score() (pipelining off)
  cli_*     this process's CPU ms per single pipelined / unsplit call (time.process_time: all
            threads, grpcio's included): with the GIL, what bounds the e2e rate of one process;
            cli/MiB the pipelined one per MiB of request
  shm       one score() reading the same values from a SharedMemoryRegion; shm / compute <= 1.1
            meets target 3. shm_cmp: the server's compute_us of those calls; shm_fixed: the rest
            of each call's wall time (wall - queue_us - compute_us, median), what a call costs
            beyond the server's compute; rtt_ms: a grpc.health.v1 Check (median), the unary
            round trip; cli_shm: this process's CPU ms per shm call. The shm calls go over
            shared-memory call channels (--shm-channels, the client's default 8; 0 = off),
            else session streams (--session-streams, the client's default 8; 0 = unary calls)
  --shm-only  just compute + the shm path (no pipelined or rate runs): the fixed cost per call
Pipelined and shared-memory results must equal the unsplit one bit for bit (`wrong` otherwise).

  python3 bench/rpc/wire_bench.py --target 127.0.0.1:50051 --rows 64,1024,8192 [--json F]
  python3 bench/rpc/wire_bench.py --rows 64,256 --iters 401 --shm-only --session-streams 0|8
  python3 bench/rpc/wire_bench.py --rows 64,256 --iters 401 --shm-only --shm-channels 0|8
"""

import argparse
import inspect
import json
import os
import statistics
import sys
import threading
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--head", default="policy")
    ap.add_argument("--rows", default="64,256,1024,4096,8192")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=0)
    ap.add_argument("--rate-seconds", type=float, default=2.0)
    ap.add_argument("--pipeline-chunk-bytes", type=int, default=4 << 20)
    ap.add_argument("--pipeline-depth", type=int, default=4)
    ap.add_argument("--pipeline-streams", type=int, default=2)
    ap.add_argument("--token", default=None)
    ap.add_argument("--no-shm", action="store_true")
    ap.add_argument("--shm-only", action="store_true",
                    help="only compute and the shared-memory calls (fixed cost per call)")
    ap.add_argument("--session-streams", type=int, default=8,
                    help="Client(session_streams=): shm calls over kept-open ScoreStreams; "
                         "0 = unary")
    ap.add_argument("--shm-channels", type=int, default=8,
                    help="Client(shm_channels=): shm calls over shared-memory call channels "
                         "(before session streams); 0 = off")
    ap.add_argument("--shm-channel-spin-us", type=int, default=0,
                    help="Client(shm_channel_spin_us=): how long a channel call spins for its "
                         "answer before it sleeps on the futex (0 = sleep at once)")
    ap.add_argument("--native", choices=("auto", "on", "off"), default="auto",
                    help="Client(native=): array bytes through the package's native library "
                         "(auto: when it loads)")
    ap.add_argument("--transfer-json", help="logitserve-wire-bench --json output (transfer_ms)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.shm_only and args.no_shm:
        print("--shm-only and --no-shm exclude each other", file=sys.stderr)
        return 2
    try:
        global np
        import numpy as np
        import logitserve
    except ImportError as e:
        print("wire_bench.py: the logitserve package (grpcio, protobuf, numpy) is not importable: "
              "%s" % e)
        return 2

    # A package from before shared-memory channels takes no shm_channels (A/B runs against it).
    channel_args = {}
    client_params = inspect.signature(logitserve.Client).parameters
    if "shm_channels" in client_params:
        channel_args["shm_channels"] = args.shm_channels
    if "shm_channel_spin_us" in client_params:
        channel_args["shm_channel_spin_us"] = args.shm_channel_spin_us
    if "native" in client_params:
        channel_args["native"] = {"auto": None, "on": True, "off": False}[args.native]
    transfer = {}
    if args.transfer_json:
        for r in json.load(open(args.transfer_json))["results"]:
            transfer[r["rows"]] = r["transfer_ms"]
    piped = logitserve.Client(args.target, token=args.token, timeout=600,
                              pipeline_chunk_bytes=args.pipeline_chunk_bytes,
                              pipeline_depth=args.pipeline_depth,
                              pipeline_streams=args.pipeline_streams,
                              session_streams=args.session_streams,
                              **channel_args)
    unpiped = logitserve.Client(args.target, token=args.token, timeout=600,
                                pipeline_chunk_bytes=0, session_streams=args.session_streams,
                                **channel_args)
    heads = unpiped.list_heads()
    head = heads[args.head]
    V, H = head.vocab_size, head.hidden_size
    try:
        from logitserve._malloc import state as malloc_state
    except ImportError:  # a package from before the policy (A/B runs against an older client)
        malloc_state = lambda: "n/a"  # noqa: E731
    print("backend %s, head %s (V = %d, H = %d), Python client, pipelining %d-byte chunks x %d "
          "in flight x %d streams; %d iterations (medians), rates over >= %.1f s; large "
          "allocations kept: %s; session streams: %d; shm channels: %s (spin %s us); native send "
          "path: %s%s" % (
              heads.backend, args.head, V, H, args.pipeline_chunk_bytes, args.pipeline_depth,
              args.pipeline_streams, args.iters, args.rate_seconds, malloc_state(),
              args.session_streams, channel_args.get("shm_channels", "n/a"),
              channel_args.get("shm_channel_spin_us", "n/a"),
              getattr(piped, "native", "n/a"),
              "; shm only" if args.shm_only else ""))
    print("%6s %7s %10s %11s %11s %4s %7s %9s %10s %11s %7s %8s %7s %7s %9s %6s %7s %6s %9s "
          "%11s %7s" % (
              "rows", "MiB", "compute_ms", "compute_t/s", "e2e_t/s", "C", "e2e/cmp", "single_ms",
              "unpiped_ms", "transfer_ms", "sgl/max", "shm_ms", "shm/cmp", "shm_cmp",
              "shm_fixed", "rtt_ms", "cli_shm", "wrong", "cli_piped", "cli_unpiped", "cli/MiB"))
    results = []
    total_wrong = 0
    for n in [int(x) for x in args.rows.split(",")]:
        rng = np.random.default_rng(11)
        bits = logitserve.to_bf16_bits(rng.normal(0, 1, (n, H)).astype(np.float32))
        ids = ((np.arange(n, dtype=np.int64) * 7919) % V).astype(np.int32)
        req = dict(head=args.head, hidden=bits, target_ids=ids, entropy=True)
        wrong = 0

        def same(a, b):
            return (np.array_equal(a.entropy.view(np.uint32), b.entropy.view(np.uint32)) and
                    np.array_equal(a.target_logprobs.view(np.uint32),
                                   b.target_logprobs.view(np.uint32)))

        ref = unpiped.score(**req)  # warm-up and reference bits
        compute, unp, single, shm = [], [], [], []
        shm_compute, shm_fixed, rtt, cli_shm = [], [], [], None
        cpu0 = time.process_time()
        for _ in range(args.iters):
            t0 = time.perf_counter()
            r = unpiped.score(**req)
            unp.append((time.perf_counter() - t0) * 1e3)
            compute.append(r.compute_us / 1e3)
        cpu_unpiped = (time.process_time() - cpu0) * 1e3 / args.iters
        cpu_piped = None
        if not args.shm_only:
            piped.score(**req)
            cpu0 = time.process_time()
            for _ in range(args.iters):
                t0 = time.perf_counter()
                r = piped.score(**req)
                single.append((time.perf_counter() - t0) * 1e3)
                wrong += 0 if same(r, ref) else 1
            cpu_piped = (time.process_time() - cpu0) * 1e3 / args.iters
        if not args.no_shm:
            with logitserve.SharedMemoryRegion(unpiped, bits.nbytes + ids.nbytes + 128) as region:
                h = region.put(bits)
                t = region.put(ids, offset=h.end)
                unpiped.score(head=args.head, hidden=h, target_ids=t, entropy=True)
                for i in range(-1, args.iters):  # -1: warm-up
                    t0 = time.perf_counter()
                    unpiped.health()
                    if i >= 0:
                        rtt.append((time.perf_counter() - t0) * 1e3)
                cpu0 = time.process_time()
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    r = unpiped.score(head=args.head, hidden=h, target_ids=t, entropy=True)
                    wall = (time.perf_counter() - t0) * 1e3
                    shm.append(wall)
                    shm_compute.append(r.compute_us / 1e3)
                    shm_fixed.append(wall - (r.queue_us + r.compute_us) / 1e3)
                    wrong += 0 if same(r, ref) else 1
                cli_shm = (time.process_time() - cpu0) * 1e3 / args.iters
        threads = args.concurrency or int(min(32, max(2, 4096 // n)))
        if args.shm_only:
            threads = 0
        scored = [0]
        lock = threading.Lock()
        stop = threading.Event()
        errors = []

        def worker():
            while not stop.is_set():
                try:
                    r = piped.score(**req)
                except Exception as e:  # counted, reported once
                    errors.append(e)
                    return
                with lock:
                    scored[0] += len(r.entropy)

        e2e = None
        if threads:
            t0 = time.perf_counter()
            pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
            for p in pool:
                p.start()
            while (time.perf_counter() - t0 < args.rate_seconds or
                   scored[0] < 4 * n * threads) and not errors:
                time.sleep(0.02)
            stop.set()
            for p in pool:
                p.join()
            elapsed = time.perf_counter() - t0
            if errors:
                print("e2e error: %s" % errors[0], file=sys.stderr)
                wrong += len(errors)
            e2e = scored[0] / elapsed
        median = lambda v: statistics.median(v) if v else None  # noqa: E731
        c_ms = statistics.median(compute)
        s_ms = median(single)
        x_ms = transfer.get(n)
        m_ms = median(shm)
        rate = n / (c_ms / 1e3)
        mib = (bits.nbytes + ids.nbytes) / 2 ** 20
        sgl = s_ms / max(c_ms, x_ms) if x_ms and s_ms else None
        fmt = lambda v, f: (f % v) if v is not None else "-"  # noqa: E731
        print("%6d %7.2f %10.3f %11.0f %11s %4d %7s %9s %10.3f %11s %7s %8s %7s %7s %9s %6s %7s "
              "%6d %9s %11.1f %7s" % (
                  n, mib, c_ms, rate, fmt(e2e, "%.0f"), threads,
                  fmt(e2e / rate if e2e else None, "%.3f"), fmt(s_ms, "%.3f"),
                  statistics.median(unp), fmt(x_ms, "%.3f"), fmt(sgl, "%.3f"), fmt(m_ms, "%.3f"),
                  fmt(m_ms / c_ms if m_ms else None, "%.3f"), fmt(median(shm_compute), "%.3f"),
                  fmt(median(shm_fixed), "%.3f"), fmt(median(rtt), "%.3f"),
                  fmt(cli_shm, "%.3f"), wrong, fmt(cpu_piped, "%.1f"), cpu_unpiped,
                  fmt(cpu_piped / mib if cpu_piped is not None else None, "%.3f")))
        sys.stdout.flush()
        results.append(dict(rows=n, compute_ms=c_ms, compute_tokens_per_s=rate,
                            e2e_tokens_per_s=e2e, e2e_threads=threads,
                            e2e_over_compute=e2e / rate if e2e else None,
                            single_ms=s_ms, unpipelined_ms=statistics.median(unp),
                            transfer_ms=x_ms, single_over_max_compute_transfer=sgl, shm_ms=m_ms,
                            shm_over_compute=m_ms / c_ms if m_ms else None,
                            shm_compute_ms=median(shm_compute), shm_fixed_ms=median(shm_fixed),
                            health_rtt_ms=median(rtt), client_cpu_ms_shm=cli_shm, wrong=wrong,
                            client_cpu_ms_pipelined=cpu_piped,
                            client_cpu_ms_unpipelined=cpu_unpiped,
                            client_cpu_ms_per_mib_pipelined=(cpu_piped / mib
                                                             if cpu_piped is not None else None)))
        total_wrong += wrong
    print("targets: e2e/cmp >= 0.90 (1), sgl/max <= 1.15 (2), shm/cmp <= 1.10 (3)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(client="python", backend=heads.backend, head=args.head, vocab_size=V,
                           hidden_size=H, iters=args.iters, pid=os.getpid(),
                           session_streams=args.session_streams,
                           shm_channels=channel_args.get("shm_channels"), shm_only=args.shm_only,
                           large_allocations_kept=malloc_state(), results=results),
                      f, indent=2)
    piped.close()
    unpiped.close()
    return 0 if total_wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
