#!/usr/bin/env bash
# GPU check (bench/gpu_check.py, issues 5 and 26): our stack against (b) its own overlap-off schedule
# and against transformers with accelerate offloading (all of its GPU memory capped at our budget), on
# a Mixtral-8x7B-shaped 4-layer bf16 checkpoint built on the GPU (fewer layers when /dev/shm is small),
# at the batch the HRM picks for that link-bound budget, next to the HRM's prediction; then, in the
# time left, the GPU unit tests, the expert formats, two tensor-parallel ranks and attention on the
# device, each skipped (and recorded so) when time runs short.
#
# It fits a lease of the device tool (15 minutes, its 1-2 minute start included; 8 files back from
# $OUT, 2 folders deep): the script ends within 6 minutes on one H200, so a rerun fits too, and
# writes two files, $OUT/gpu_check.json (every figure, rewritten after every phase, the summary in
# it) and $OUT/gpu_check-logs.tar.gz (log tails, bench JSONs, our Chrome trace). The main
# comparison's summary is printed the moment it ends. Arguments go on to gpu_check.py (e.g.
# --batch-cap 512, --skip formats,device-attention; `--help` lists them).
#
# The image cannot reach a package registry and lacks some of our dependencies (structlog,
# grpcio-health-checking, grpcio-reflection, posix-ipc; newer grpcio/protobuf; pytest). Fetch their
# wheels into the ignored .whl/ folder beforehand, on the dev machine:
#     bash bench/gpu_wheels.sh
# then run this script through the device tool with that folder carried:
#     run(command="bash bench/gpu_check.sh", carry=[".whl"])
#
# /dev/shm holds the weight arena (~12 GB in bf16 at 4 layers) plus cpu_attention's KV cache (sized
# for the batch) and the hand-off channels: `df` below shows it; gpu_check.py cuts the model to the
# layers that fit (and says so in the report), and stops with a clear message when none does.
set -uo pipefail
cd "$(dirname "$0")/.."
SCRIPT_SECONDS=360      # the whole script, wheel install included
export GPU_CHECK_STARTED=$(date +%s.%N) # the report counts its times from here (first measurement <= 180 s)
export PYTHONUNBUFFERED=1 # a run cut off still shows how far it got (the phases inherit it)

if compgen -G ".whl/*.whl" > /dev/null; then
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    echo "gpu_check.sh: installing .whl/*.whl into /tmp/site failed" >&2
    exit 3
  fi
  export PYTHONPATH=/tmp/site:$PWD # the wheels first: they shadow the image's older grpcio/protobuf
else
  echo "gpu_check.sh: no .whl/ folder; the image must then have structlog, grpcio-health-checking," \
    "grpcio-reflection and posix-ipc (bash bench/gpu_wheels.sh fetches them; carry .whl)" >&2
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# Not installed (no build backend offline): the services run as `python -m services.<name>` (see
# moe_lightning/launcher.py), which only needs the repository on PYTHONPATH.

echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(hostname), $(nproc) CPUs, $(python3 --version)"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2> /dev/null || echo "nvidia-smi: not available"
df -h /dev/shm "${TMPDIR:-/tmp}"

out=() # the device tool's $OUT; without one, gpu_check.py writes to a folder in its private work dir
[ -n "${OUT:-}" ] && out=(--out "$OUT")
left=$((SCRIPT_SECONDS - SECONDS))
# gpu_check.py keeps its own deadline, 30 s short of the script's end: its phases' timeouts come
# from it, and the summary and the archive are written after it. The outer timeout is the backstop:
# SIGINT 10 s before the end makes it stop the running phase and write what it has; SIGKILL follows.
timeout -s INT -k 10 $((left - 10)) python3 -u bench/gpu_check.py "${out[@]}" --deadline $((left - 30)) "$@"
rc=$?
echo "gpu_check.sh: exit $rc after $SECONDS s; gpu_check.json and gpu_check-logs.tar.gz in ${OUT:-the work dir (see above)}"
exit $rc
