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


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
