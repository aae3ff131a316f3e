"""The Deployment's server arguments, resolved through the ConfigMap as the kubelet does, start the
real logitserve binary of this build: flag names, value syntax and ranges are checked by the server
itself, not by a copy of its rules. Only what a CI machine lacks is swapped: the head file becomes
a small synthetic head of the same name (--synthetic-head), --backend becomes cpu, the token files
become temporary files, and the ports become 127.0.0.1:0. Then the Dockerfile's HEALTHCHECK command
must report SERVING, and SIGTERM must drain and exit 0 within the manifest's drain timeout. The
TLS component's flags and exec probe commands run the same way against a TLS server."""

import copy
import os
import re
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dockerfile_check  # noqa: E402
import manifest_check  # noqa: E402

REPO = os.environ.get("LOGITSERVE_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
SERVER = os.environ.get("LOGITSERVE_SERVER_BINARY", "")
CLI = os.environ.get("LOGITSERVE_CLI_BINARY", "")
BUNDLE = manifest_check.load(os.path.join(REPO, "deploy", "k8s"))


def resolved_args(bundle):
    """The container's args with $(VAR) expanded from its ConfigMap envFrom and env."""
    deployment = manifest_check.objects(bundle, "Deployment")[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {}
    configmaps = {c["metadata"]["name"]: c.get("data") or {}
                  for c in manifest_check.objects(bundle, "ConfigMap")}
    for source in container.get("envFrom") or []:
        env.update(configmaps[source["configMapRef"]["name"]])
    for e in container.get("env") or []:
        env[e["name"]] = e.get("value", "")
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a)
            for a in container["args"]]


def local_args(args, tmp_path):
    out = []
    for arg in args:
        name, _, value = arg.partition("=")
        if name == "--head":
            head_name = value.split("=", 1)[0]
            out.append(f"--synthetic-head={head_name}:vocab=64,hidden=8,seed=1")
        elif name == "--backend":
            out.append("--backend=cpu")
        elif name in ("--auth-token-file", "--admin-token-file"):
            path = tmp_path / name.strip("-")
            path.write_text("token-" + name.strip("-") + "\n")
            out.append(f"{name}={path}")
        elif name == "--metrics-listen":
            out.append("--metrics-listen=127.0.0.1:0")
        else:
            out.append(arg)
    return out


def dockerfile_healthcheck():
    """The exec-form CMD of the Dockerfile's HEALTHCHECK."""
    import json

    text = open(os.path.join(REPO, "Dockerfile")).read()
    checks = [rest for keyword, rest in dockerfile_check.parse_instructions(text)
              if keyword == "HEALTHCHECK"]
    assert len(checks) == 1, checks
    return json.loads(checks[0][checks[0].index("CMD") + 3:].strip())


def drain_seconds(args):
    for arg in args:
        name, _, value = arg.partition("=")
        if name in manifest_check.DRAIN_FLAGS:
            return float(value)
    raise AssertionError("no drain flag in the args")


def test_binaries_are_given():
    assert SERVER and os.access(SERVER, os.X_OK), "LOGITSERVE_SERVER_BINARY is not set by ctest"
    assert CLI and os.access(CLI, os.X_OK), "LOGITSERVE_CLI_BINARY is not set by ctest"


def test_server_starts_with_the_manifest_args_and_drains_on_sigterm(tmp_path):
    args = resolved_args(BUNDLE)
    assert any(a.startswith("--head=") for a in args)
    argv = [SERVER, "--listen", "127.0.0.1:0"] + local_args(args, tmp_path)
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = None
        for line in server.stdout:  # ends when the server exits (a rejected flag)
            m = re.match(r"logitserve listening on (\S+)", line)
            if m:
                address = m.group(1)
                break
        if address is None:
            server.wait(timeout=30)
            raise AssertionError(f"the server did not start with {argv}: exit "
                                 f"{server.returncode}\n{server.stderr.read()}")
        # The image's HEALTHCHECK command, binary and port mapped to this build and server.
        command = [w.replace("/usr/local/bin/logitserve-cli", CLI)
                   .replace("127.0.0.1:50051", address) for w in dockerfile_healthcheck()]
        assert command[0] == CLI and address in command, command
        health = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert health.returncode == 0, health.stdout + health.stderr
        assert "SERVING" in health.stdout
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=drain_seconds(args) + 10) == 0, server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_bad_value_is_rejected_by_the_server(tmp_path):
    """The check above would notice a value the server refuses (here: out of range)."""
    bundle = copy.deepcopy(BUNDLE)
    configmap = manifest_check.objects(bundle, "ConfigMap")[0]
    configmap["data"]["LOGITSERVE_WORKERS"] = "-1"
    argv = [SERVER, "--listen", "127.0.0.1:0"] + local_args(resolved_args(bundle), tmp_path)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "--workers" in result.stdout + result.stderr


def test_tls_component_args_and_probe_commands_work(tmp_path):
    """The TLS component's server flags and its exec probe commands, run for real: a self-signed
    certificate for `localhost` (openssl), the server started with the patched args, and every
    probe command (paths mapped into tmp_path) must exit 0."""
    import yaml

    folder = os.path.join(REPO, "deploy", "k8s", "components", "tls")
    component = yaml.safe_load(open(os.path.join(folder, "kustomization.yaml")))
    bundle = copy.deepcopy(BUNDLE)
    for patch in component["patches"]:
        operations = yaml.safe_load(open(os.path.join(folder, patch["path"])))
        bundle["documents"]["deployment.yaml"] = [manifest_check.apply_json_patch(
            manifest_check.objects(bundle, "Deployment")[0], operations)]
    deployment = manifest_check.objects(bundle, "Deployment")[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    mount = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "tls"][0]

    tls_dir = tmp_path / "tls"
    tls_dir.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(tls_dir / "tls.key"), "-out", str(tls_dir / "tls.crt")],
                   check=True, capture_output=True)
    (tls_dir / "ca.crt").write_text((tls_dir / "tls.crt").read_text())

    def local(word):
        return word.replace(mount, str(tls_dir)).replace("/usr/local/bin/logitserve-cli", CLI)

    args = [local(a) for a in local_args(resolved_args(bundle), tmp_path)]
    assert any(a.startswith("--tls-cert=") for a in args)
    server = subprocess.Popen([SERVER, "--listen", "127.0.0.1:0"] + args, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in server.stdout:
            m = re.match(r"logitserve listening on \S+:(\d+)", line)
            if m:
                port = m.group(1)
                break
        assert port is not None, server.stderr.read()
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            command = [local(w).replace("localhost:50051", "localhost:" + port)
                       for w in container[probe]["exec"]["command"]]
            result = subprocess.run(command, capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, (probe, command, result.stdout + result.stderr)
            assert "SERVING" in result.stdout
        # Plaintext against the TLS port fails: the probes above really spoke TLS.
        plain = subprocess.run([CLI, "health", "--target", "localhost:" + port, "--timeout", "3",
                                "--attempts", "1"], capture_output=True, text=True, timeout=60)
        assert plain.returncode != 0
    finally:
        server.kill()
        server.wait()
