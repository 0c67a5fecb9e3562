#!/usr/bin/env bash
# Fetches into .whl/ (ignored by git) the wheels the GPU machine's image lacks, so they can travel
# with the working tree to bench/gpu_check.sh: run it on the dev machine, from anywhere in the repo,
#     bash bench/gpu_wheels.sh [MORE_PACKAGES...]
# then carry the folder: run(command="bash bench/gpu_check.sh", carry=[".whl"]).
#
# The image (Python 3.12, x86-64, CUDA torch, transformers, accelerate, safetensors, tokenizers,
# grpcio, protobuf, pyarrow, prometheus-client, ...) has no structlog, grpcio-health-checking,
# grpcio-reflection or posix-ipc, and cannot reach a package registry. grpcio and protobuf come too:
# our generated code refuses older runtimes (grpcio < 1.85.1, protobuf < 7.35.1) and the image's may
# be older; pytest and its dependencies (pluggy, iniconfig, pygments) for the GPU unit tests. Each
# is pinned to the version in .venv when it is installed there (what the tests ran against), so
# the generated code and its runtime match; only one version of each is kept (pip refuses two).
set -euo pipefail
cd "$(dirname "$0")/.."

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
py=.venv/bin/python
[ -x "$py" ] || py=python3

mkdir -p .whl
for pkg in structlog grpcio-health-checking grpcio-reflection posix-ipc grpcio protobuf \
  pytest pluggy iniconfig pygments "$@"; do
  # NAME==VERSION as installed in .venv (NAME alone when it is not), and the wheel's file-name stem
  read -r spec stem < <("$py" - "$pkg" << 'EOF'
import re
import sys
from importlib.metadata import PackageNotFoundError, version

name = sys.argv[1]
base = re.split(r"[=<>!~ ]", name, maxsplit=1)[0]
try:
    spec = name if base != name else f"{name}=={version(name)}"
except PackageNotFoundError:
    spec = name
print(spec, re.sub(r"[-_.]+", "_", base).lower())
EOF
  )
  rm -f .whl/"$stem"-[0-9]*.whl  # an older download of it: two versions stop the whole install
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$spec"
done
ls .whl
du -sh .whl
echo
echo 'Carry it to the GPU machine: run(command="bash bench/gpu_check.sh", carry=[".whl"])'
