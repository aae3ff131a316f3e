#!/usr/bin/env bash
# The package as a user installs it, offline: a brand-new virtualenv gets the wheel the build made
# (DIST_DIR) with pip --no-index; a second one builds and installs the sdist with no code
# generator reachable ($PROTOC / $GRPC_PYTHON_PLUGIN point nowhere, no grpcio-tools), which works
# only because the sdist ships the generated stubs. PyPI is not reachable from CI, so the venvs use
# --system-site-packages for the dependencies (Debian's python3-grpcio, -protobuf, -numpy, -pytest);
# the logitserve package itself comes only from the wheel / sdist.
# With `native`, the wheel must ship the native send path's library and its venv must load it.
#   ci/install.sh PYTHON3 VENV_DIR DIST_DIR [native]
set -euo pipefail
PYTHON3="$1"; VENV="$2"; DIST="$3"; NATIVE="${4:-}"
wheel=$(ls "$DIST"/logitserve-*.whl)
sdist=$(ls "$DIST"/logitserve-*.tar.gz)
for archive in "$wheel" "$sdist"; do
  "$PYTHON3" - "$archive" <<'PY'
import sys, tarfile, zipfile
path = sys.argv[1]
names = (zipfile.ZipFile(path).namelist() if path.endswith(".whl")
         else tarfile.open(path).getnames())
for stub in ("logitserve/v1/logitserve_pb2.py", "logitserve/v1/logitserve_pb2_grpc.py"):
    if not any(n.endswith(stub) for n in names):
        sys.exit("%s lacks %s" % (path, stub))
print("stubs shipped in", path.rsplit("/", 1)[-1])
PY
done

rm -rf "$VENV" "$VENV-sdist"
"$PYTHON3" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --quiet --no-index --no-deps "$wheel"

"$PYTHON3" -m venv --system-site-packages "$VENV-sdist"
PROTOC=/nonexistent/protoc GRPC_PYTHON_PLUGIN=/nonexistent/grpc_python_plugin \
  "$VENV-sdist/bin/python" -m pip install --quiet --no-index --no-deps --no-build-isolation "$sdist"

if [ "$NATIVE" = native ]; then
  (cd "$VENV" && "$VENV/bin/python" -c "
import logitserve._native as n
assert n.library() is not None, n.load_error()
assert n.library_path().startswith('$VENV'), n.library_path()
print('native send path:', n.library_path())")
fi

for v in "$VENV" "$VENV-sdist"; do
  (cd "$v" && "$v/bin/python" -c "
import logitserve, logitserve.v1.logitserve_pb2_grpc as g
assert logitserve.__file__.startswith('$v'), logitserve.__file__
print('installed', logitserve.__version__, logitserve.__file__)")
done
