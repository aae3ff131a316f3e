"""The rendered manifests (base, deploy/overlays/tls, deploy/overlays/monitoring) against the
Kubernetes API schemas with unknown-field detection (tests/tooling/k8s_validate.js:
kubernetes-models), the renderer against `kubectl kustomize` where kubectl is installed, and the
validator against broken copies (a misspelt field, a wrong type, an unknown kind must fail)."""

import copy
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import render  # noqa: E402

REPO = os.environ.get("LOGITSERVE_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
VALIDATOR = os.path.join(REPO, "tests", "tooling", "k8s_validate.js")
FOLDERS = ["deploy/k8s", "deploy/overlays/tls", "deploy/overlays/monitoring"]
NODE = shutil.which("node") or shutil.which("nodejs")


def validate(objects, tmp_path):
    if NODE is None:
        pytest.skip("node is not installed (scripts/install-deps.sh)")
    path = tmp_path / "objects.json"
    path.write_text(json.dumps(objects))
    r = subprocess.run([NODE, VALIDATOR, str(path)], capture_output=True, text=True, timeout=120)
    if r.returncode == 77:
        pytest.skip(r.stdout.strip())
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("folder", FOLDERS)
def test_rendered_manifests_match_the_kubernetes_schemas(folder, tmp_path):
    objects = render.render(os.path.join(REPO, folder))
    rc, out = validate(objects, tmp_path)
    assert rc == 0, out
    assert "%d objects, 0 problems" % len(objects) in out


def test_overlays_hold_what_they_promise():
    kinds = lambda folder: sorted(o["kind"] for o in render.render(os.path.join(REPO, folder)))
    base = kinds("deploy/k8s")
    assert "NetworkPolicy" in base
    assert kinds("deploy/overlays/monitoring") == sorted(
        base + ["ServiceMonitor", "HorizontalPodAutoscaler"])
    tls = [o for o in render.render(os.path.join(REPO, "deploy/overlays/tls"))
           if o["kind"] == "Deployment"][0]
    args = tls["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--tls-cert=/etc/logitserve/tls/tls.crt" in args


@pytest.mark.parametrize("folder", FOLDERS)
def test_renderer_matches_kubectl_kustomize(folder):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the renderer is not compared with kustomize here")
    out = subprocess.run([kubectl, "kustomize", os.path.join(REPO, folder)], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    key = lambda o: (o["kind"], o["metadata"]["name"])
    theirs = {key(o): o for o in yaml.safe_load_all(out) if o}
    mine = {key(o): o for o in render.render(os.path.join(REPO, folder))}
    assert mine == theirs


def _deployment(objects):
    return [o for o in objects if o["kind"] == "Deployment"][0]


@pytest.mark.parametrize("edit, message", [
    (lambda o: _deployment(o)["spec"]["template"]["spec"]["containers"][0].update(
        readinesProbe=_deployment(o)["spec"]["template"]["spec"]["containers"][0]
        .pop("readinessProbe")), "containers[0].readinesProbe: unknown field"),
    (lambda o: _deployment(o)["spec"].update(replicas="two"), "replicas must be integer"),
    (lambda o: [x for x in o if x["kind"] == "ServiceMonitor"][0]["spec"]["endpoints"][0]
        .update(intervall="15s"), "endpoints[0].intervall: unknown field"),
    (lambda o: o.append({"apiVersion": "v1", "kind": "Sevice", "metadata": {"name": "x"}}),
     "no schema for v1 Sevice"),
])
def test_broken_manifests_are_rejected(edit, message, tmp_path):
    objects = copy.deepcopy(render.render(os.path.join(REPO, "deploy/overlays/monitoring")))
    edit(objects)
    rc, out = validate(objects, tmp_path)
    assert rc == 1, out
    assert message in out, out


def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(ValueError, match="commonLabels"):
        render.render(str(tmp_path))
