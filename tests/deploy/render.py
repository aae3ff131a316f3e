"""A small `kustomize build` for deploy/k8s (CI has neither kustomize nor kubectl): resources
(files and folders with a kustomization), components (their resources and RFC 6902 patches), the
namespace and the images transformers, which is everything deploy/k8s uses. Anything else in a
kustomization is an error here rather than silently ignored. test_schemas.py compares the result
with `kubectl kustomize` where kubectl is installed.

    python3 render.py deploy/overlays/tls > objects.json
"""

import copy
import json
import os
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import manifest_check  # noqa: E402

_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "components", "namespace", "images",
                       "patches"}
_CLUSTER_SCOPED = {"Namespace"}


def _kustomization(folder):
    k = yaml.safe_load(open(os.path.join(folder, "kustomization.yaml"))) or {}
    unknown = set(k) - _KUSTOMIZATION_KEYS
    if unknown:
        raise ValueError("%s: render.py does not implement %s" % (folder, sorted(unknown)))
    return k


def _documents(path):
    return [d for d in yaml.safe_load_all(open(path)) if d]


def _resources(folder, k):
    objects = []
    for r in k.get("resources") or []:
        path = os.path.normpath(os.path.join(folder, r))
        if os.path.isdir(path) and os.path.commonpath([path, folder]) == path:
            raise ValueError("%s: resource %s contains the kustomization itself (kustomize: "
                             "cycle detected); put overlays outside the base" % (folder, r))
        objects += render(path) if os.path.isdir(path) else _documents(path)
    return objects


def _apply_patches(folder, k, objects):
    for p in k.get("patches") or []:
        ops = yaml.safe_load(open(os.path.join(folder, p["path"])))
        if not isinstance(ops, list):
            raise ValueError("%s: only RFC 6902 (list) patches are implemented" % p["path"])
        target = p.get("target") or {}
        hits = 0
        for i, o in enumerate(objects):
            if (o.get("kind") == target.get("kind")
                    and o.get("metadata", {}).get("name") == target.get("name")):
                objects[i] = manifest_check.apply_json_patch(o, ops)
                hits += 1
        if hits == 0:
            raise ValueError("%s: patch %s matches no object" % (folder, p["path"]))
    return objects


def render(folder):
    k = _kustomization(folder)
    objects = copy.deepcopy(_resources(folder, k))
    objects = _apply_patches(folder, k, objects)
    for c in k.get("components") or []:
        cfolder = os.path.normpath(os.path.join(folder, c))
        ck = _kustomization(cfolder)
        objects += _resources(cfolder, ck)
        objects = _apply_patches(cfolder, ck, objects)
    if k.get("namespace"):
        for o in objects:
            if o.get("kind") not in _CLUSTER_SCOPED:
                o.setdefault("metadata", {})["namespace"] = k["namespace"]
    for image in k.get("images") or []:
        for o in objects:
            pod = o.get("spec", {}).get("template", {}).get("spec", {})
            for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
                if c.get("image", "").split(":")[0] == image["name"]:
                    c["image"] = "%s:%s" % (image.get("newName", image["name"]),
                                            image.get("newTag", "latest"))
    return objects


if __name__ == "__main__":
    json.dump(render(sys.argv[1]), sys.stdout, indent=1)
