#!/usr/bin/env bash
# The last command of a GPU visit (../shared/GPU.md): bring the last part of the wheels, then run
# benchmarks/gpu_suite.sh in phases under one time budget, packing the results into $OUT after
# each phase, so that a visit cut short keeps what finished (at most 8 files come back:
# results.tgz, the kernel cache as warpcache.partNN of 15 MB, stages.log).
#   BUDGET=540 bash benchmarks/gpu_visit.sh .gpup/part4 [.gpuvisit/warpcache.tgz]
# Prepared here in one command, which prints the calls below: bash benchmarks/gpu_prepare.sh (the
# wheels in four parts, omegaconf as .whl/, Warp's CUDA kernels compiled without a GPU as
# .gpuvisit/warpcache.tgz; a last visit's cache, packed the same way, does as well).
# Carry .gpup/partK alone in calls 1..K-1, then this.
# A cache too large to travel beside the last part (64 MiB a call) comes in a call of its own,
# unpacked there, since ignored paths stay between calls:
#   mkdir -p .warpcache && tar -C .warpcache -xzf .gpuvisit/warpcache.tgz   (then no 2nd argument)
# PHASES (default "warp cluster learning"): the warp stages (what is left, less 200 s when other
# phases follow), cluster_gpu (240 s where 400 are left), each a deadline the suite cuts its
# stages' limits to (no process outlives its phase), then LEARN_TASKS (default "push pick")
# sharing the rest equally
# (runner.max_minutes from each one's share, at most 5). A visit for learning alone:
#   PHASES=learning LEARN_TASKS=push BUDGET=420 bash benchmarks/gpu_visit.sh .gpup/part4
#   PHASES=learning LEARN_TASKS=pick BUDGET=420 bash benchmarks/gpu_visit.sh -   (the next call)
set -uo pipefail
: "${OUT:?set OUT: the folder whose files come back from the GPU machine}"
last_part=$1
cache=${2:-}
start=$(date +%s)
deadline=$((start + ${BUDGET:-540}))
left() { echo $((deadline - $(date +%s))); }
R=/tmp/res
mkdir -p "$R"
pack_results() {  # written aside, then renamed: a call cut mid-pack returns the last whole one
  local aside="$OUT/.results.$BASHPID.tgz"  # (the periodic packer's own: it may overlap a pack)
  tar -C "$R" -czf "$aside" --exclude='*.pt' --exclude='warpcache.tar.gz*' . \
    && mv "$aside" "$OUT/results.tgz"
  cp "$R/stages.log" "$OUT/" 2>/dev/null
}
pack() {
  pack_results
  if [ -f "$R/warpcache.tar.gz" ]; then
    (cd "$OUT" && rm -f warpcache.part* && split -b 15M -d "$R/warpcache.tar.gz" warpcache.part)
    local parts
    parts=$(ls "$OUT"/warpcache.part* | wc -l)
    if [ "$parts" -gt 5 ]; then echo "[visit] the cache is $parts parts: not all come back"; fi
  fi
  echo "[visit] packed at $(($(date +%s) - start)) s; $(left) s left"
}
suite() {  # suite SECONDS [VAR=VALUE ...]: the suite under a deadline SECONDS away (none if < 30)
  local seconds=$1
  shift
  if [ "$seconds" -lt 30 ]; then
    echo "[visit] $*: skipped, $seconds s left"
    return
  fi
  # the results so far packed every 45 s as well: a call that outruns the device time, or is cut
  # short, still returns what finished (a phase's own pack comes only at its end)
  (while sleep 45; do pack_results; done) &
  local packer=$!
  env "$@" DEADLINE=$(($(date +%s) + seconds)) bash benchmarks/gpu_suite.sh "$R"
  kill "$packer" 2>/dev/null
  wait "$packer" 2>/dev/null
  pack
}
if [ "$last_part" != - ]; then  # (-: a later call on the same machine, the parts in place)
  bash "$last_part/take.sh" || { echo "[visit] the parts did not install"; exit 3; }
fi
if [ ! -f /tmp/site/.gpup-done ]; then  # (take.sh says "k of N parts" and exits 0)
  echo "[visit] the wheels are not installed: a part is missing (every warp stage would skip)"
  exit 3
fi
export PYTHONPATH=/tmp/site
if [ -n "$cache" ]; then mkdir -p .warpcache && tar -C .warpcache -xzf "$cache"; fi
phases=" ${PHASES:-warp cluster learning} "
later=0  # what the warp phase leaves to the phases after it
if [[ $phases == *" cluster "* || $phases == *" learning "* ]]; then later=200; fi
if [[ $phases == *" warp "* ]]; then
  suite $(($(left) - later)) \
    STAGES="device warp_compile warp_throughput warp_tests warp_rgb_profile warp_peaks warp_update
      warp_cache runner_tests"
fi
if [[ $phases == *" cluster "* ]]; then
  suite $(($(left) > 400 ? 240 : $(left) - 160)) STAGES=cluster_gpu
fi
tasks=(${LEARN_TASKS:-push pick})
for i in "${!tasks[@]}"; do
  [[ $phases == *" learning "* ]] || break
  share=$((($(left) - 15) / (${#tasks[@]} - i)))
  minutes=$(python3 -c "print(round(min(5.0, max(0.0, ($share - 60) / 60)), 2))")
  echo "[visit] ${tasks[$i]}: $share s, runner.max_minutes=$minutes"
  if python3 -c "import sys; sys.exit(0 if $minutes >= 0.5 else 1)"; then
    suite "$share" STAGES=warp_learning LEARN_TASKS="${tasks[$i]}" LEARN_MINUTES="$minutes"
  fi
done
echo "[visit] done at $(($(date +%s) - start)) s"
