#!/usr/bin/env bash
# Prints the versions of python3, grpcio, protobuf (and its implementation) and numpy on this
# machine, then imports the bundle's Python package (python/ beside bin/, generated stubs
# included). When the default protobuf implementation refuses the stubs, tries the pure-Python one
# (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python) and prints the setting that worked, so that
# run_wire_bench.sh can use it. Exit 1 when neither imports.
#   [PYTHON=python3] python-check.sh [PACKAGE_DIR]   (default: ../python beside this folder)
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="${1:-$here/python}:${PYTHONPATH:-}"
"${PYTHON:-python3}" - <<'PY'
import sys
print("python", sys.version.split()[0])
for m in ("grpc", "google.protobuf", "numpy"):
    try:
        mod = __import__(m, fromlist=["__version__"])
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING:", e)
try:
    from google.protobuf.internal import api_implementation
    print("protobuf implementation", api_implementation.Type())
except Exception as e:
    print("protobuf implementation unknown:", e)
PY
for impl in default python; do
  if env $([ "$impl" = python ] && echo PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python) "${PYTHON:-python3}" -B -c \
      'import logitserve, logitserve.v1.logitserve_pb2_grpc; print("logitserve", logitserve.__version__, "from", logitserve.__file__)'; then
    echo "python-check: stubs import (protobuf implementation: $impl)"
    exit 0
  fi
done
echo "python-check: the Python package does not import here"
exit 1
