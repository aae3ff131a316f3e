"""Static checks of the Kubernetes manifests in deploy/k8s (CI has no cluster and no kustomize).

load(folder) reads the kustomization and every manifest; check_manifests(bundle, repo) returns a
list of problems (empty = fine). What it checks, so that the manifests cannot silently rot:
  - the kustomization lists every manifest file of the folder, and only existing ones; its
    `images` entry names the container's image;
  - the Deployment's selector matches its pod labels; the container asks for an nvidia.com/gpu
    limit, has cpu and memory requests and a memory limit;
  - startup/liveness/readiness probes are native gRPC probes on the container's gRPC port; the
    readiness probe asks about the service name the server registers (server/server.cc);
  - /dev/shm is a mounted memory-backed emptyDir;
  - terminationGracePeriodSeconds >= preStop sleep + the server's drain flag value
    (--drain-timeout, alias --drain-seconds; read from the args, `$(VAR)` resolved from the
    ConfigMap);
  - every `--flag` in the args is a flag the server defines; every `$(VAR)` resolves;
  - security context: non-root, read-only root filesystem, no privilege escalation, ALL
    capabilities dropped;
  - the headless Service (clusterIP None) and the regular Service select the pod labels and
    expose the gRPC port by a name or number the container declares; the PDB selects the pods;
  - the Prometheus scrape annotations name the container's metrics port.
"""

import copy
import glob
import os
import re

import yaml

# Where the server declares its flags (CLI11 add_option("--name", ...)).
SERVER_SOURCES = ("server/*.cc", "server/service/*.cc")  # main.cc declares the flags
GRPC_PORT_NAME = "grpc"
DRAIN_FLAGS = ("--drain-timeout", "--drain-seconds")


def load(folder):
    kustomization = yaml.safe_load(open(os.path.join(folder, "kustomization.yaml")))
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.yaml"))
                   if os.path.basename(p) != "kustomization.yaml")
    documents = {}
    for name in files:
        documents[name] = [d for d in yaml.safe_load_all(open(os.path.join(folder, name))) if d]
    return {"kustomization": kustomization, "files": files, "documents": documents}


def objects(bundle, kind):
    return [d for docs in bundle["documents"].values() for d in docs if d.get("kind") == kind]


def server_flags(repo):
    """Every long flag the server declares (`"--name"` string literals in its sources)."""
    flags = set()
    for path in [p for pattern in SERVER_SOURCES for p in glob.glob(os.path.join(repo, pattern))]:
        # CLI11 names: "--name", or aliases "-n,--name,--other".
        for names in re.findall(r'add_(?:option|flag)\(\s*"([^"]+)"', open(path).read()):
            flags |= {n.strip() for n in names.split(",") if n.strip().startswith("--")}
    return flags


def server_service_name(repo):
    text = open(os.path.join(repo, "server/server.cc")).read()
    m = re.search(r'kServiceName\s*=\s*"([^"]+)"', text)
    return m.group(1) if m else None


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _seconds_of_prestop(lifecycle):
    pre = (lifecycle or {}).get("preStop") or {}
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    command = (pre.get("exec") or {}).get("command") or []
    if command and os.path.basename(command[0]) == "sleep" and len(command) == 2:
        return float(command[1])
    if len(command) == 3 and command[1] == "-c":
        m = re.fullmatch(r"\s*sleep\s+(\d+(?:\.\d+)?)\s*", command[2])
        if m:
            return float(m.group(1))
    return None


def check_manifests(bundle, repo, grpc_probes=True):
    problems = []
    listed = (bundle["kustomization"] or {}).get("resources") or []
    for name in bundle["files"]:
        if name not in listed:
            problems.append(f"kustomization.yaml does not list {name}")
    for name in listed:
        if name not in bundle["files"] and not name.endswith("/"):
            problems.append(f"kustomization.yaml lists {name}, which is not in the folder")

    deployments = objects(bundle, "Deployment")
    if len(deployments) != 1:
        return problems + [f"expected one Deployment, found {len(deployments)}"]
    deployment = deployments[0]
    pod = deployment["spec"]["template"]
    pod_labels = (pod.get("metadata") or {}).get("labels") or {}
    spec = pod["spec"]
    if not selects(deployment["spec"].get("selector", {}).get("matchLabels"), pod_labels):
        problems.append("Deployment selector does not match its pod labels")
    containers = spec.get("containers") or []
    if len(containers) != 1:
        return problems + ["expected one container in the Deployment"]
    c = containers[0]
    images = [i.get("name") for i in (bundle["kustomization"] or {}).get("images") or []]
    if c.get("image", "").split(":")[0] not in images:
        problems.append(f"container image {c.get('image')!r} is not in the kustomization's images "
                        f"(`kustomize edit set image` would not reach it)")
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
    grpc_port = ports.get(GRPC_PORT_NAME)
    if grpc_port is None:
        problems.append(f"the container declares no port named {GRPC_PORT_NAME}")

    # Resources.
    resources = c.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    gpu = limits.get("nvidia.com/gpu")
    if gpu is None or int(gpu) < 1:
        problems.append("no nvidia.com/gpu limit >= 1 on the container")
    if "nvidia.com/gpu" in requests and requests["nvidia.com/gpu"] != gpu:
        problems.append("nvidia.com/gpu request differs from its limit")
    for key in ("cpu", "memory"):
        if key not in requests:
            problems.append(f"no {key} request")
    if "memory" not in limits:
        problems.append("no memory limit")

    # Probes.
    service_name = server_service_name(repo)
    for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
        probe = c.get(probe_name)
        if probe is None:
            if probe_name != "startupProbe":
                problems.append(f"no {probe_name}")
            continue
        if grpc_probes:
            if set(probe) & {"httpGet", "tcpSocket", "exec"} or "grpc" not in probe:
                problems.append(f"{probe_name} is not a native gRPC probe")
                continue
            if probe["grpc"].get("port") != grpc_port:
                problems.append(f"{probe_name} probes port {probe['grpc'].get('port')}, "
                                f"not the gRPC port {grpc_port}")
            if probe_name == "readinessProbe" and probe["grpc"].get("service") != service_name:
                problems.append(f"readinessProbe asks about service "
                                f"{probe['grpc'].get('service')!r}; the server registers "
                                f"{service_name!r}")
        else:
            command = (probe.get("exec") or {}).get("command") or []
            if "health" not in command or not any("logitserve-cli" in w for w in command):
                problems.append(f"{probe_name} is neither gRPC nor `logitserve-cli health`")

    # /dev/shm.
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    shm = [m for m in c.get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"]
    if not shm:
        problems.append("/dev/shm is not mounted")
    else:
        volume = volumes.get(shm[0]["name"]) or {}
        if (volume.get("emptyDir") or {}).get("medium") != "Memory":
            problems.append("/dev/shm is not a memory-backed emptyDir")
    for mount in c.get("volumeMounts") or []:
        if mount["name"] not in volumes:
            problems.append(f"volumeMount {mount['name']} has no volume")

    # Args: flags the server knows, variables that resolve.
    env = {}
    configmaps = {cm["metadata"]["name"]: cm.get("data") or {}
                  for cm in objects(bundle, "ConfigMap")}
    for source in c.get("envFrom") or []:
        name = (source.get("configMapRef") or {}).get("name")
        if name is not None:
            if name not in configmaps:
                problems.append(f"envFrom names ConfigMap {name}, which is not in the manifests")
            env.update(configmaps.get(name, {}))
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = e["value"]
    known = server_flags(repo)
    args = []
    for arg in c.get("args") or []:
        def resolve(m):
            if m.group(1) not in env:
                problems.append(f"arg {arg}: $({m.group(1)}) is not defined")
                return ""
            return str(env[m.group(1)])
        args.append(re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", resolve, arg))
    for arg in args:
        flag = arg.split("=")[0]
        if flag.startswith("--") and flag not in known:
            problems.append(f"arg {flag}: the server defines no such flag")

    # Grace period >= preStop + drain (the server's flag, under either of its names).
    drain = None
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in DRAIN_FLAGS:
            drain = float(value) if value else float(args[i + 1]) if i + 1 < len(args) else None
    prestop = _seconds_of_prestop(c.get("lifecycle"))
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if drain is None:
        problems.append("no --drain-timeout in the args (the server's default is not assumed)")
    if prestop is None:
        problems.append("no preStop sleep")
    if drain is not None and prestop is not None and grace < prestop + drain:
        problems.append(f"terminationGracePeriodSeconds {grace} < preStop {prestop:g} + "
                        f"drain {drain:g}")

    # Security context.
    sc, psc = c.get("securityContext") or {}, spec.get("securityContext") or {}
    if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
        problems.append("runAsNonRoot is not set")
    if sc.get("readOnlyRootFilesystem") is not True:
        problems.append("readOnlyRootFilesystem is not true")
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append("allowPrivilegeEscalation is not false")
    if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
        problems.append("capabilities do not drop ALL")

    # Services.
    services = objects(bundle, "Service")
    headless = [s for s in services if s["spec"].get("clusterIP") == "None"]
    if not headless:
        problems.append("no headless Service (clusterIP: None)")
    if not [s for s in services if s["spec"].get("clusterIP") != "None"]:
        problems.append("no regular Service")
    for s in services:
        name = s["metadata"]["name"]
        if not selects(s["spec"].get("selector"), pod_labels):
            problems.append(f"Service {name} does not select the Deployment's pods")
        exposed = [p for p in s["spec"].get("ports") or []
                   if p.get("targetPort") in (GRPC_PORT_NAME, grpc_port) and grpc_port is not None]
        if not exposed:
            problems.append(f"Service {name} does not expose the gRPC port")
        for p in s["spec"].get("ports") or []:
            target = p.get("targetPort", p.get("port"))
            if isinstance(target, str) and target not in ports:
                problems.append(f"Service {name} targets port {target!r}, which the container "
                                f"does not name")

    # PodDisruptionBudget.
    pdbs = objects(bundle, "PodDisruptionBudget")
    if not pdbs:
        problems.append("no PodDisruptionBudget")
    for pdb in pdbs:
        if not selects((pdb["spec"].get("selector") or {}).get("matchLabels"), pod_labels):
            problems.append(f"PodDisruptionBudget {pdb['metadata']['name']} does not select the "
                            f"Deployment's pods")

    # Prometheus annotations.
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if annotations.get("prometheus.io/scrape") == "true":
        if str(ports.get("metrics")) != str(annotations.get("prometheus.io/port")):
            problems.append("prometheus.io/port is not the container's metrics port")
        listen = [a for a in args if a.startswith("--metrics-listen=")]
        if not listen or not listen[0].endswith(":" + str(ports.get("metrics"))):
            problems.append("--metrics-listen does not serve on the metrics port")
    return problems


def apply_json_patch(document, operations):
    """RFC 6902 `add` and `replace` (what the components use) on a copy of `document`."""
    document = copy.deepcopy(document)
    for op in operations:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = document
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        if op["op"] == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), op["value"])
            else:
                parent[last] = op["value"]
        elif op["op"] == "replace":
            if isinstance(parent, list):
                parent[int(last)] = op["value"]
            elif last not in parent:
                raise KeyError(f"replace of missing {op['path']}")
            else:
                parent[last] = op["value"]
        else:
            raise ValueError(f"unsupported op {op['op']}")
    return document
