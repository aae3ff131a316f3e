"""Build of the logitserve Python package.

The gRPC stubs (logitserve/v1/logitserve_pb2.py, logitserve_pb2_grpc.py) are generated from
logitserve/v1/logitserve.proto and never committed. An sdist (and every wheel) ships them, so
installing one needs no code generator. Building from the repository (or from a tree without
stubs) generates them with the grpcio-tools package (`grpc_tools.protoc`, what pip / conda users
have) when it is importable, else with protoc + grpc_python_plugin (Debian: protobuf-compiler
protobuf-compiler-grpc; override with $PROTOC, $GRPC_PYTHON_PLUGIN). The proto is found in
`protos/` (an sdist carries a copy there) or in the repository's `proto/` two levels up.
Without network, build with `pip install --no-build-isolation ...` (pip's isolated build would
fetch setuptools).
"""

import os
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_FILE = os.path.join("logitserve", "v1", "logitserve.proto")
PROTO_ROOTS = [
    os.path.join(HERE, "protos"),  # inside an sdist
    os.path.join(HERE, "..", "..", "proto"),  # inside the repository
]
STUBS = ("logitserve_pb2.py", "logitserve_pb2_grpc.py")
SHIPPED_STUBS = os.path.join(HERE, "logitserve", "v1")


def find_proto_root():
    for root in PROTO_ROOTS:
        if os.path.isfile(os.path.join(root, PROTO_FILE)):
            return os.path.normpath(root)
    raise RuntimeError(
        "cannot find %s in any of %s" % (PROTO_FILE, ", ".join(os.path.normpath(r) for r in PROTO_ROOTS)))


def have_shipped_stubs():
    return all(os.path.isfile(os.path.join(SHIPPED_STUBS, s)) for s in STUBS)


def _system_tool(env, name):
    path = os.environ.get(env) or shutil.which(name)
    if not path and os.path.exists("/usr/bin/" + name):
        path = "/usr/bin/" + name
    return path


def generate_stubs(out):
    """Writes logitserve/v1/{__init__,logitserve_pb2,logitserve_pb2_grpc}.py under `out`."""
    proto_root = find_proto_root()
    proto = os.path.join(proto_root, PROTO_FILE)
    try:
        # grpcio-tools: protoc and the plugin in one package, matching the installed protobuf.
        import grpc_tools  # noqa: F401
        cmd = [sys.executable, "-m", "grpc_tools.protoc"]
    except ImportError:
        protoc = _system_tool("PROTOC", "protoc")
        plugin = _system_tool("GRPC_PYTHON_PLUGIN", "grpc_python_plugin")
        if not (protoc and plugin):
            raise RuntimeError(
                "cannot generate the gRPC stubs: install grpcio-tools (pip), or protoc and "
                "grpc_python_plugin (Debian: protobuf-compiler protobuf-compiler-grpc), or build "
                "from an sdist, which ships them") from None
        cmd = [protoc, "--plugin=protoc-gen-grpc_python=" + plugin]
    subprocess.check_call(cmd + ["--proto_path=" + proto_root, "--python_out=" + out,
                                 "--grpc_python_out=" + out, proto])
    with open(os.path.join(out, "logitserve", "v1", "__init__.py"), "w") as f:
        f.write("# Generated gRPC stubs of logitserve.v1 (see setup.py).\n")


class BuildPyWithStubs(build_py):
    """build_py that also puts the stubs into the build tree: the shipped ones, else generated."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "logitserve", "v1")
        if have_shipped_stubs():
            os.makedirs(dst, exist_ok=True)
            for name in STUBS + ("__init__.py",):
                src = os.path.join(SHIPPED_STUBS, name)
                if os.path.isfile(src):
                    shutil.copyfile(src, os.path.join(dst, name))
        else:
            generate_stubs(self.build_lib)


class SdistWithProtosAndStubs(sdist):
    """sdist that carries the proto (it lives outside this folder in the repository) and the
    generated stubs (so installing the sdist needs no code generator)."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        src = os.path.join(find_proto_root(), PROTO_FILE)
        dst = os.path.join(base_dir, "protos", PROTO_FILE)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
        os.makedirs(os.path.join(base_dir, "logitserve", "v1"), exist_ok=True)
        if have_shipped_stubs():
            for name in STUBS + ("__init__.py",):
                shutil.copyfile(os.path.join(SHIPPED_STUBS, name),
                                os.path.join(base_dir, "logitserve", "v1", name))
        else:
            generate_stubs(base_dir)


NATIVE_LIB = os.path.join("_native", "liblogitserve_native.so")
HAVE_NATIVE = os.path.isfile(os.path.join(HERE, "logitserve", NATIVE_LIB))
cmdclass = {"build_py": BuildPyWithStubs, "sdist": SdistWithProtosAndStubs}
distclass = Distribution
if HAVE_NATIVE:
    # The build put the native send path's library into the package (ci/build_dist.sh): a wheel
    # for this platform (platlib), for any Python 3 (the library is loaded with ctypes, not
    # imported as a module, so no interpreter ABI tag).
    from wheel.bdist_wheel import bdist_wheel

    class DistributionWithNativeLibrary(Distribution):
        def has_ext_modules(self):
            return True

    class BdistWheelAnyPython(bdist_wheel):
        def get_tag(self):
            return ("py3", "none") + tuple(super().get_tag()[2:])

    distclass = DistributionWithNativeLibrary
    cmdclass["bdist_wheel"] = BdistWheelAnyPython

# logitserve.v1 (the stubs) is a package of its own once shipped; otherwise build_py writes it.
setup(packages=["logitserve"] + (["logitserve.v1"] if have_shipped_stubs() else []),
      package_data={"logitserve": [NATIVE_LIB]} if HAVE_NATIVE else {},
      cmdclass=cmdclass, distclass=distclass)
