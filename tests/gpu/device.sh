#!/usr/bin/env bash
# The GPU lane's commands on the GPU machine (the device tool runs them in a copy of this repository):
#
#   bash tests/gpu/device.sh receive N      keep .gpu/parts/part-NN (carried by this call) in /var/tmp/lane
#   bash tests/gpu/device.sh run LANE-ARGS  join the parts (sha256 checked) and install the wheels once into
#                                           /var/tmp/lane/site, then python3 -m tests.gpu.lane LANE-ARGS
#   bash tests/gpu/device.sh call NAME      the parts this call carries, the same install, then the recipe's call
#                                           NAME (tests/gpu/recipe.py): its runs, each packed whole under $OUT
#   bash tests/gpu/device.sh flags OUT.json the same install, then vLLM's serve options (tests/gpu/flags.py) and
#                                           the image probe's facts in that environment (OUT-image-probe.json)
#   bash tests/gpu/device.sh nccl ARGS      the fabric gate's NCCL test on the machine's own torch: only the
#                                           config's wheels (pydantic…, carried as .gpu/nccl), no vLLM
#
# Files stay on the machine only while it is warm (about 30 s after a call): make the calls back to back.
# The calls, in order: `venv/bin/python -m tests.gpu.recipe` (docs/measurements.md shows them); tests/gpu/pack.py
# makes the parts.
set -euo pipefail
LANE=${SPARK_VLLM_LANE_DIR:-/var/tmp/lane}  # another only where a test runs this script beside others
mkdir -p "$LANE/parts"
case "${1:-}" in
  receive)
    part=$(printf '.gpu/parts/part-%02d' "$2")
    mv "$part" "$LANE/parts/"
    [ -f .gpu/parts/SHA256 ] && cp .gpu/parts/SHA256 "$LANE/parts/"
    echo "device: $(ls "$LANE/parts" | grep -c part-) part(s) here, $(du -sm "$LANE/parts" | cut -f1) MiB"
    if [ "$2" = 0 ]; then
      nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || echo "device: no nvidia-smi"
      python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, torch.cuda.is_available())' \
        || echo "device: no torch"
      df -h /var/tmp | tail -1; nproc; free -g | head -2
    fi
    ;;
  run|flags|call)
    what=$1
    shift
    if [ "$what" = call ]; then  # the parts this call carries (the last travels with the first call)
      for part in .gpu/parts/part-*; do [ -e "$part" ] && mv "$part" "$LANE/parts/"; done
      [ -f .gpu/parts/SHA256 ] && cp .gpu/parts/SHA256 "$LANE/parts/"
    fi
    if [ ! -f "$LANE/site/.installed" ]; then
      start=$(date +%s)
      cat "$LANE"/parts/part-* > "$LANE/wheels.tar"
      (cd "$LANE" && sha256sum -c --quiet parts/SHA256)
      tar -C "$LANE" -xf "$LANE/wheels.tar"
      rm -f "$LANE/wheels.tar"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$LANE/site" "$LANE"/wheels/*.whl
      # Bytecode, as an image built with pip has it: the machine runs Python with -B (PYTHONDONTWRITEBYTECODE),
      # so without it each of vLLM's processes (API server, engine core, workers) compiles vLLM's sources
      # again at every start (~20 s each, seen on the H200 on 2026-12-01). The machine's own packages
      # (torch, transformers, ...) came without bytecode too: `import torch` took 4.6 s, 1.4 s once compiled
      # (2026-12-02).
      # SPARK_VLLM_LANE_COMPILE=site: the lane's own only (a machine whose packages came compiled).
      machine=$([ "${SPARK_VLLM_LANE_COMPILE:-all}" = site ] || python3 -c 'import site; print(*site.getsitepackages())')
      python3 -m compileall -q -j 0 "$LANE/site" $machine >/dev/null 2>&1 || true
      touch "$LANE/site/.installed"
      echo "device: installed $(ls "$LANE"/wheels | wc -l) wheels in $(( $(date +%s) - start )) s"
    fi
    export PYTHONPATH="$LANE/site:$PWD" PATH="$LANE/site/bin:$PATH" PYTHONUNBUFFERED=1
    # The edge's haproxy travelled in the parts (tests/gpu/pack.py): the machine has no apt sources to fetch it.
    if [ -x "$LANE/haproxy/usr/sbin/haproxy" ]; then
      export SPARK_VLLM_HAPROXY_ROOT="$LANE/haproxy"
      echo "device: the edge's haproxy from $SPARK_VLLM_HAPROXY_ROOT"
    fi
    # NVLink multicast stays off wherever the lane runs (shared GPUs; see the device docs).
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    if [ "$what" = flags ]; then
      # vLLM's serve options, then the image probe in this environment (what docs/measurements.md shows as checked)
      python3 -m tests.gpu.flags "$1"
      python3 - < components/scripts/image_probe.py | tee "${1%.json}-image-probe.json"
      exit 0
    fi
    if [ "$what" = call ]; then
      exec python3 -u -m tests.gpu.recipe call "$@"   # the recipe's runs, packed under $OUT (tests/gpu/recipe.py)
    fi
    exec python3 -u -m tests.gpu.lane "$@"
    ;;
  nccl)
    shift
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$LANE/nccl-site" .gpu/nccl/*.whl
    export PYTHONPATH="$LANE/nccl-site:$PWD" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
    exec python3 -u -m tests.gpu.nccl "$@"
    ;;
  *)
    echo "usage: $0 receive N | call NAME | run LANE-ARGS | flags OUT.json | nccl ARGS" >&2
    exit 2
    ;;
esac
