#!/usr/bin/env bash
# Everything a GPU visit carries, prepared here on the CPU machine in one command (from the project
# root, after scripts/setup.sh), then the visit's calls printed (../shared/GPU.md says why parts):
#   bash benchmarks/gpu_prepare.sh
# - .gpup/part1..N: MuJoCo Warp, Warp, MuJoCo and Ray wheels the image lacks (parts of 56 MiB:
#   each call carries its part and the working tree, 64 MiB in all);
# - .whl/: omegaconf and antlr4 (antlr's 4.9.3 is only an sdist: built into a wheel here);
# - .gpuvisit/warpcache.tgz: Warp's CUDA kernels for every task and the renderer, compiled here
#   without a GPU (simulators/mujoco/warp_aot.py), so that the GPU should compile none (its
#   warp_compile stage says), and the CPU kernels of Warp's CPU device (the gpu tests compare
#   with it).
# All four are ignored by git (.git/info/exclude). Prints each call's load (its part, what else
# it carries and the working tree), which must stay under 64 MiB.
set -euo pipefail
[ -x .venv/bin/python ] || { echo "gpu_prepare: run scripts/setup.sh first (.venv)"; exit 2; }
exclude=$(git rev-parse --git-path info/exclude)  # (a worktree's .git is a file)
mkdir -p "$(dirname "$exclude")"
for path in /.gpup/ /.whl/ /.warpcache/ /.gpuvisit/; do
  grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >> "$exclude"
done

echo "[prepare] wheels, in parts"
PART_MIB=56 bash ../shared/gpu/bundle_parts.sh \
  mujoco-warp==3.8.1 warp-lang==1.12.0 mujoco==3.8.1 ray==2.60.0

echo "[prepare] omegaconf into .whl/"
rm -rf .whl && mkdir -p .whl
.venv/bin/python -m pip wheel -q --no-deps -w .whl omegaconf==2.3.0 antlr4-python3-runtime==4.9.3

echo "[prepare] Warp's CUDA and CPU kernels into .warpcache/, packed as .gpuvisit/warpcache.tgz"
rm -rf .warpcache && mkdir -p .gpuvisit
# the CPU kernels too (the gpu tests compare with Warp's CPU device): Warp builds them for a fixed
# x86-64 target with AVX, not for this CPU, so they run on the GPU machine's
WARP_CACHE_PATH="$PWD/.warpcache" .venv/bin/python -m embodied.simulators.mujoco.warm \
  --cuda-cache .warpcache
# (NVRTC's precompiled headers and MathDx's LTO files serve a compile only)
tar -C .warpcache --exclude=./lto --exclude='*.pch' -czf .gpuvisit/warpcache.tgz .
rm -rf .warpcache  # carried packed

parts=$(ls -d .gpup/part* | wc -l)
tree=$(git ls-files -z --cached --others --exclude-standard \
  | { xargs -0 du -cb 2>/dev/null || true; } \
  | awk '$2 == "total" {n += $1} END {print n + 0}')  # (the working tree travels too)
load() {  # MiB a call carries: these paths and the tree
  echo $((($(du -cb "$@" | tail -1 | cut -f1) + tree + 1048575) / 1048576))
}
heavy=0
echo "[prepare] the visit, back to back (a machine idle for 30 s is given back):"
for k in $(seq 1 $((parts - 1))); do
  mib=$(load ".gpup/part$k")
  if [ "$mib" -ge 64 ]; then heavy=1; fi
  echo "  call $k ($mib MiB of 64): carry .gpup/part$k; run: bash .gpup/part$k/take.sh"
done
mib=$(load ".gpup/part$parts" .whl .gpuvisit)
if [ "$mib" -ge 64 ]; then heavy=1; fi
echo "  call $parts: carry .gpup/part$parts .whl .gpuvisit ($mib MiB of 64, tree included):"
echo "    BUDGET=430 PHASES=warp bash benchmarks/gpu_visit.sh .gpup/part$parts \\"
echo "      .gpuvisit/warpcache.tgz 2>&1 | tee \$OUT/visit.log"
echo "  then, same machine, BUDGET from status: budget_left_s less 60 (start, transfers), at most"
echo "    380: PHASES=learning LEARN_TASKS=pick BUDGET=... bash benchmarks/gpu_visit.sh - 2>&1 \\"
echo "      | tee \$OUT/learning.log"
if [ "$heavy" -eq 1 ]; then
  echo "[prepare] a call's load is over 64 MiB: smaller parts (PART_MIB), or .gpuvisit alone"
  exit 1
fi
