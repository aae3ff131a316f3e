"""deploy/k8s against manifest_check.py, yamllint over deploy/, the TLS component applied to the
Deployment, and every check against a broken copy (a check that cannot fail is caught here)."""

import copy
import os
import shutil
import subprocess
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import manifest_check  # noqa: E402

REPO = os.environ.get("LOGITSERVE_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
K8S = os.path.join(REPO, "deploy", "k8s")
BUNDLE = manifest_check.load(K8S)


def check(bundle=BUNDLE, **kwargs):
    return manifest_check.check_manifests(bundle, REPO, **kwargs)


def mutated(edit):
    bundle = copy.deepcopy(BUNDLE)
    edit(bundle)
    return bundle


def deployment(bundle):
    return manifest_check.objects(bundle, "Deployment")[0]


def container(bundle):
    return deployment(bundle)["spec"]["template"]["spec"]["containers"][0]


def service(bundle, name):
    return [s for s in manifest_check.objects(bundle, "Service")
            if s["metadata"]["name"] == name][0]


def expect_problem(bundle, text, **kwargs):
    problems = check(bundle, **kwargs)
    assert any(text in p for p in problems), f"expected a problem with {text!r}, got {problems}"


def test_manifests_pass():
    assert check() == []


def test_every_kind_is_present():
    kinds = {d["kind"] for docs in BUNDLE["documents"].values() for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds


def test_yamllint_passes():
    result = subprocess.run(["yamllint", "-s", "-c", os.path.join(REPO, "deploy", ".yamllint"),
                             os.path.join(REPO, "deploy")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_yamllint_catches_a_broken_file(tmp_path):
    shutil.copytree(os.path.join(REPO, "deploy"), tmp_path / "deploy")
    broken = tmp_path / "deploy" / "k8s" / "pdb.yaml"
    broken.write_text(broken.read_text().replace("  maxUnavailable: 1", "  maxUnavailable: 1   "))
    result = subprocess.run(["yamllint", "-s", "-c", str(tmp_path / "deploy" / ".yamllint"),
                             str(tmp_path / "deploy")], capture_output=True, text=True)
    assert result.returncode != 0 and "trailing-spaces" in result.stdout


def test_unlisted_manifest_is_reported():
    def edit(b):
        b["kustomization"]["resources"].remove("pdb.yaml")
    expect_problem(mutated(edit), "does not list pdb.yaml")

    def edit_extra(b):
        b["kustomization"]["resources"].append("gone.yaml")
    expect_problem(mutated(edit_extra), "lists gone.yaml, which is not in the folder")


def test_image_must_be_set_by_the_kustomization():
    def edit(b):
        container(b)["image"] = "registry.example.com/other:1"
    expect_problem(mutated(edit), "is not in the kustomization's images")


def test_missing_gpu_limit_is_reported():
    def edit(b):
        del container(b)["resources"]["limits"]["nvidia.com/gpu"]
    expect_problem(mutated(edit), "nvidia.com/gpu limit")


def test_non_grpc_probe_is_reported():
    def edit(b):
        container(b)["livenessProbe"] = {"tcpSocket": {"port": 50051}}
    expect_problem(mutated(edit), "livenessProbe is not a native gRPC probe")

    def edit_port(b):
        container(b)["readinessProbe"]["grpc"]["port"] = 50052
    expect_problem(mutated(edit_port), "readinessProbe probes port 50052")

    def edit_service(b):
        container(b)["readinessProbe"]["grpc"]["service"] = "logitserve.v2.Scorer"
    expect_problem(mutated(edit_service), "readinessProbe asks about service")

    def edit_missing(b):
        del container(b)["readinessProbe"]
    expect_problem(mutated(edit_missing), "no readinessProbe")


def test_shm_must_be_memory_backed_and_mounted():
    def edit(b):
        for v in deployment(b)["spec"]["template"]["spec"]["volumes"]:
            if v["name"] == "dshm":
                v["emptyDir"] = {}
    expect_problem(mutated(edit), "/dev/shm is not a memory-backed emptyDir")

    def edit_unmounted(b):
        c = container(b)
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != "/dev/shm"]
    expect_problem(mutated(edit_unmounted), "/dev/shm is not mounted")


def test_grace_period_must_cover_prestop_and_drain():
    spec = deployment(BUNDLE)["spec"]["template"]["spec"]
    prestop = float(container(BUNDLE)["lifecycle"]["preStop"]["exec"]["command"][-1])
    configmap = manifest_check.objects(BUNDLE, "ConfigMap")[0]
    drain = float(configmap["data"]["LOGITSERVE_DRAIN_TIMEOUT"])
    assert spec["terminationGracePeriodSeconds"] >= prestop + drain

    def edit(b):
        deployment(b)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = int(
            prestop + drain) - 1
    expect_problem(mutated(edit), "terminationGracePeriodSeconds")

    def edit_drain(b):  # a longer drain in the ConfigMap must be seen through $(VAR)
        manifest_check.objects(b, "ConfigMap")[0]["data"]["LOGITSERVE_DRAIN_TIMEOUT"] = "600"
    expect_problem(mutated(edit_drain), "terminationGracePeriodSeconds")

    def edit_no_prestop(b):
        del container(b)["lifecycle"]
    expect_problem(mutated(edit_no_prestop), "no preStop sleep")


def test_unknown_flag_and_undefined_variable_are_reported():
    def edit(b):
        container(b)["args"].append("--drain-deadline=5")
    expect_problem(mutated(edit), "--drain-deadline: the server defines no such flag")

    def edit_no_drain(b):
        c = container(b)
        c["args"] = [a for a in c["args"] if not a.startswith("--drain-timeout")]
    expect_problem(mutated(edit_no_drain), "no --drain-timeout in the args")

    def edit_alias(b):  # the old name is an alias the checker must still read
        c = container(b)
        c["args"] = [a.replace("--drain-timeout=", "--drain-seconds=") for a in c["args"]]
        deployment(b)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 5
    expect_problem(mutated(edit_alias), "terminationGracePeriodSeconds 5 < preStop")

    def edit_var(b):
        container(b)["args"].append("--workers=$(NOT_IN_THE_CONFIGMAP)")
    expect_problem(mutated(edit_var), "$(NOT_IN_THE_CONFIGMAP) is not defined")


def test_security_context_is_enforced():
    def edit(b):
        container(b)["securityContext"]["readOnlyRootFilesystem"] = False
        container(b)["securityContext"]["capabilities"]["drop"] = []
        deployment(b)["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] = False
        container(b)["securityContext"]["allowPrivilegeEscalation"] = True
    problems = check(mutated(edit))
    for text in ("readOnlyRootFilesystem", "drop ALL", "runAsNonRoot", "allowPrivilegeEscalation"):
        assert any(text in p for p in problems), (text, problems)


def test_services_must_select_the_pods_and_expose_grpc():
    def edit(b):
        service(b, "logitserve-headless")["spec"]["selector"]["app.kubernetes.io/name"] = "other"
    expect_problem(mutated(edit), "Service logitserve-headless does not select")

    def edit_port(b):
        service(b, "logitserve-headless")["spec"]["ports"][0]["targetPort"] = "http"
    problems = check(mutated(edit_port))
    assert any("logitserve-headless does not expose the gRPC port" in p for p in problems)
    assert any("targets port 'http'" in p for p in problems)

    def edit_not_headless(b):
        del service(b, "logitserve-headless")["spec"]["clusterIP"]
    expect_problem(mutated(edit_not_headless), "no headless Service")


def test_pdb_must_select_the_pods():
    def edit(b):
        pdb = manifest_check.objects(b, "PodDisruptionBudget")[0]
        pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "worker"
    expect_problem(mutated(edit), "PodDisruptionBudget logitserve does not select")


def test_metrics_annotation_must_match_the_port():
    def edit(b):
        deployment(b)["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = "8080"
    expect_problem(mutated(edit), "prometheus.io/port")


def test_tls_component_applies_and_keeps_the_rules():
    folder = os.path.join(K8S, "components", "tls")
    component = yaml.safe_load(open(os.path.join(folder, "kustomization.yaml")))
    assert component["kind"] == "Component"
    bundle = copy.deepcopy(BUNDLE)
    for patch in component["patches"]:
        assert patch["target"]["kind"] == "Deployment"
        assert patch["target"]["name"] == deployment(bundle)["metadata"]["name"]
        operations = yaml.safe_load(open(os.path.join(folder, patch["path"])))
        patched = manifest_check.apply_json_patch(deployment(bundle), operations)
        bundle["documents"]["deployment.yaml"] = [patched]
    # With TLS the kubelet's plaintext gRPC probe cannot connect: exec probes instead.
    assert check(bundle, grpc_probes=False) == []
    args = container(bundle)["args"]
    assert any(a.startswith("--tls-cert=") for a in args)
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert "--tls" in container(bundle)[probe]["exec"]["command"]
    mounts = {m["mountPath"] for m in container(bundle)["volumeMounts"]}
    assert "/etc/logitserve/tls" in mounts
    # The exec-probe rule can fail too.
    container(bundle)["readinessProbe"]["exec"]["command"] = ["/bin/true"]
    expect_problem(bundle, "readinessProbe is neither gRPC nor", grpc_probes=False)
