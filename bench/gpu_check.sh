#!/usr/bin/env bash
# GPU check (bench/gpu_check.py): the GPU unit tests (copy engine, the pinned asynchronous hand-offs,
# host synchronisations per step); a preflight on a toy model through attention on the host with 8
# micro-batches and hot-expert residency, and attention on the device; then our stack against (b) its
# own overlap-off schedule and against transformers with accelerate offloading, on a
# Mixtral-8x7B-shaped 4-layer bf16 checkpoint built on the GPU (fewer layers when /dev/shm is small).
# Takes under 8 minutes on one H200. Writes $OUT/gpu_check.json (./gpu_check.json when OUT is unset),
# with the bench's JSON, its Chrome trace and gpu_check-logs/ next to it. Arguments are passed on to
# gpu_check.py (e.g. --num-prompts 32, --micro-batches 8).
#
# The H200 image (Python 3.12, CUDA torch, transformers, accelerate, safetensors, tokenizers, grpcio,
# protobuf, pyarrow, prometheus-client) cannot reach a package registry and lacks some of our
# dependencies. Fetch their wheels beforehand on the dev machine, from the repository root:
#     bash ../shared/gpu-check/wheels.sh posix-ipc grpcio protobuf pytest pluggy iniconfig pygments
# (wheels.sh always fetches structlog, grpcio-health-checking and grpcio-reflection; posix-ipc is a
# dependency of ours too; grpcio and protobuf because our generated code refuses older runtimes,
# grpcio < 1.85.1 or protobuf < 7.35.1, and the image's are likely older; pytest and its dependencies
# for the GPU unit tests, which are skipped and reported when pytest is missing. The wheels in .whl/
# come first on PYTHONPATH; gpu_check.py reports any import that still fails.)
# Then run this script through the device tool with the ignored .whl folder carried:
#     run(command="bash bench/gpu_check.sh", carry=[".whl"])
#
# /dev/shm holds the weight arena (~12 GB in bf16 at 4 layers) plus cpu_attention's KV cache (4 GiB) and
# the hand-off channels: `df` below shows it; gpu_check.py cuts the model to the layers that fit (and
# says so in the report), and stops with a clear message when not even one layer does.
set -uo pipefail
cd "$(dirname "$0")/.."

if compgen -G ".whl/*.whl" > /dev/null; then
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl; then
    echo "gpu_check.sh: installing .whl/*.whl into /tmp/site failed" >&2
    exit 3
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  echo "gpu_check.sh: no .whl/ folder; the image must then have structlog, grpcio-health-checking," \
    "grpcio-reflection and posix-ipc (see the top of this script)" >&2
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# Not installed (no build backend offline): the services run as `python -m services.<name>` (see
# moe_lightning/launcher.py), which only needs the repository on PYTHONPATH.

echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(hostname), $(nproc) CPUs, $(python3 --version)"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2> /dev/null || echo "nvidia-smi: not available"
df -h /dev/shm "${TMPDIR:-/tmp}"

out_dir=${OUT:-.}
# gpu_check.py keeps its own deadline (440 s, shared by its phases). This is the backstop: SIGINT
# makes it stop the running phase and write what it has; SIGKILL follows 20 s later.
timeout -s INT -k 20 465 python3 bench/gpu_check.py --json "$out_dir/gpu_check.json" "$@"
rc=$?
echo "gpu_check.sh: exit $rc; report in $out_dir/gpu_check.json"
exit $rc
