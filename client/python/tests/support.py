"""Test support: a minimal safetensors writer and a real logitserve server process."""

import json
import os
import queue
import signal
import struct
import subprocess
import threading

import numpy as np

LISTEN_PREFIX = "logitserve listening on "
METRICS_PREFIX = "logitserve metrics on "
START_TIMEOUT_S = 60.0


def write_safetensors(path, tensors):
    """Writes {name: (dtype_name, array)} with dtype_name "BF16" (array = uint16 bits), "F16" or
    "F32": 8-byte little-endian header length, JSON header, then the raw little-endian bytes."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, array) in tensors.items():
        np_dtype = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}[dtype]
        raw = np.ascontiguousarray(array, dtype=np_dtype).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def server_binary():
    path = os.environ.get("LOGITSERVE_SERVER_BINARY")
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError("set LOGITSERVE_SERVER_BINARY to the logitserve server binary "
                           "(got %r)" % path)
    return path


class Server:
    """A logitserve process on 127.0.0.1 (port 0 unless given); `address` once listening."""

    def __init__(self, args, port=0, log_path=None):
        self.args = list(args)
        self.port = port
        self.log_path = log_path
        self.proc = None
        self.address = None
        self.metrics_address = None  # with --metrics-listen

    def start(self):
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [server_binary(), "--backend", "cpu", "--threads", "1",
             "--listen", "127.0.0.1:%d" % self.port] + self.args,
            stdout=subprocess.PIPE, stderr=log)
        lines = queue.Queue()

        def read():
            for line in self.proc.stdout:
                lines.put(line.decode(errors="replace").strip())
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                self.stop()
                raise RuntimeError("logitserve did not report listening within %.0f s" % START_TIMEOUT_S)
            if line is None:
                rc = self.proc.wait()
                raise RuntimeError("logitserve exited with %d before listening (args %s)" % (rc, self.args))
            if line.startswith(METRICS_PREFIX):
                self.metrics_address = line[len(METRICS_PREFIX):]
            if line.startswith(LISTEN_PREFIX):
                self.address = line[len(LISTEN_PREFIX):]
                self.port = int(self.address.rsplit(":", 1)[1])
                return self

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode if self.proc else None

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def finished_rpcs(metrics_address, method, code="OK"):
    """logitserve_requests_total{method=~METHOD, code=CODE} from the server's Prometheus text."""
    import urllib.request
    text = urllib.request.urlopen("http://%s/metrics" % metrics_address, timeout=10).read().decode()
    total = 0
    for line in text.splitlines():
        if line.startswith("logitserve_requests_total{") and 'code="%s"' % code in line:
            labels = line[line.index("{") + 1:line.index("}")]
            name = labels.split('method="', 1)[1].split('"', 1)[0]
            if name.rsplit("/", 1)[-1] == method:
                total += int(float(line.rsplit(" ", 1)[1]))
    return total


def in_flight_rpcs(metrics_address):
    """logitserve_requests_in_flight (RPCs accepted and not yet finished) from the metrics."""
    import urllib.request
    text = urllib.request.urlopen("http://%s/metrics" % metrics_address, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("logitserve_requests_in_flight "):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("no logitserve_requests_in_flight in the server's metrics")


def settled_rpcs(metrics_address, method, codes, quiet_s=1.0, timeout_s=15.0):
    """{code: finished RPCs} once the server has no RPC in flight and the counts have not moved
    for quiet_s. A client's cancelled calls can reach the server after it looked idle (their
    headers still in the socket, or on a sender thread, when the client cancelled); counting
    before they land would put them into whatever the caller measures next."""
    import time
    end = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while True:
        idle = in_flight_rpcs(metrics_address) == 0
        now = {k: finished_rpcs(metrics_address, method, k) for k in codes}
        if not idle or now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        if time.monotonic() > end:
            raise AssertionError("the server's %s counts did not settle in %.0f s: %s"
                                 % (method, timeout_s, now))
        time.sleep(0.05)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def concurrent_calls(score, want, inputs, threads, calls):
    """Runs `calls` score(**inputs(k)) calls on each of `threads` threads at once (thread k asks
    for want[k]'s rows: an answer given to the wrong caller shows); returns (wrong answers per
    thread, errors). An answer is right when its entropy bits and top-k ids are want[k]'s."""
    wrong, failed = [0] * threads, []
    start = threading.Barrier(threads)

    def bits(a):
        return np.asarray(a, dtype=np.float32).view(np.uint32)

    def run(k):
        start.wait()
        for _ in range(calls):
            try:
                got = score(**inputs(k))
            except Exception as e:  # noqa: BLE001 - every failure is reported to the test
                failed.append(e)
                continue
            if len(got.entropy) != len(want[k].entropy) or not (
                    np.array_equal(bits(got.entropy), bits(want[k].entropy)) and
                    np.array_equal(got.top_k_ids, want[k].top_k_ids)):
                wrong[k] += 1

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return wrong, failed


def random_inputs(n, seed, hidden, vocab):
    """bf16 bit patterns of N(0, 1) hidden states [n, hidden] and int32 ids [n] below vocab."""
    import logitserve  # the installed package (this module is imported before it elsewhere)
    rng = np.random.default_rng(seed)
    bits = logitserve.to_bf16_bits(rng.normal(0, 1, (n, hidden)).astype(np.float32))
    ids = rng.integers(0, vocab, n).astype(np.int32)
    return bits, ids


def assert_same_bits(got, want):
    """Every per-row output of two ScoreResults is the same bits."""
    def bits(a):
        return None if a is None else a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint8)

    for name in ("target_logprobs", "entropy", "top_k_ids", "top_k_logprobs"):
        np.testing.assert_array_equal(bits(getattr(got, name)), bits(getattr(want, name)),
                                      err_msg=name)
