"""Build of the logitserve Python package.

The gRPC stubs (logitserve/v1/logitserve_pb2.py, logitserve_pb2_grpc.py) are generated at build
time by protoc with Debian's grpc_python_plugin; they are never committed. The proto is found in
`protos/` (an sdist carries a copy there) or in the repository's `proto/` two levels up.
Environment overrides: PROTOC, GRPC_PYTHON_PLUGIN.
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_FILE = os.path.join("logitserve", "v1", "logitserve.proto")
PROTO_ROOTS = [
    os.path.join(HERE, "protos"),  # inside an sdist
    os.path.join(HERE, "..", "..", "proto"),  # inside the repository
]


def find_proto_root():
    for root in PROTO_ROOTS:
        if os.path.isfile(os.path.join(root, PROTO_FILE)):
            return os.path.normpath(root)
    raise RuntimeError(
        "cannot find %s in any of %s" % (PROTO_FILE, ", ".join(os.path.normpath(r) for r in PROTO_ROOTS)))


def find_tool(env, name):
    path = os.environ.get(env) or shutil.which(name)
    if not path and os.path.exists("/usr/bin/" + name):
        path = "/usr/bin/" + name
    if not path:
        raise RuntimeError(
            "%s not found: install protoc and grpc_python_plugin (Debian: protobuf-compiler "
            "protobuf-compiler-grpc) or set %s" % (name, env))
    return path


class BuildPyWithStubs(build_py):
    """build_py that also writes the generated stubs into the build tree."""

    def run(self):
        super().run()
        out = self.build_lib
        proto_root = find_proto_root()
        protoc = find_tool("PROTOC", "protoc")
        plugin = find_tool("GRPC_PYTHON_PLUGIN", "grpc_python_plugin")
        subprocess.check_call([
            protoc,
            "--proto_path=" + proto_root,
            "--python_out=" + out,
            "--grpc_python_out=" + out,
            "--plugin=protoc-gen-grpc_python=" + plugin,
            os.path.join(proto_root, PROTO_FILE),
        ])
        init = os.path.join(out, "logitserve", "v1", "__init__.py")
        with open(init, "w") as f:
            f.write("# Generated gRPC stubs of logitserve.v1 (see setup.py).\n")


class SdistWithProtos(sdist):
    """sdist that carries the proto (it lives outside this folder in the repository)."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        src = os.path.join(find_proto_root(), PROTO_FILE)
        dst = os.path.join(base_dir, "protos", PROTO_FILE)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProtos})
