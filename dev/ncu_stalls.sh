#!/usr/bin/env bash
# On the GPU machine: warp stall reasons (per issued instruction), pipe utilization, shared-memory
# wavefronts / bank conflicts and instruction counts of the prepare kernel, one ncu run per
# prebuilt tree on one case (clocks not locked). Compares occupancy settings: per-warp cycles per
# instruction that grow with the resident warps mean a shared limit, not latency.
#   TREES="main exp" CASE=P4 dev/ncu_stalls.sh      (trees under .deps/, built by dev/prebuild.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
M=""
for s in barrier long_scoreboard short_scoreboard mio_throttle lg_throttle math_pipe_throttle wait not_selected \
         selected dispatch_stall tex_throttle no_instruction branch_resolving membar misc drain imc_miss sleeping; do
  M="$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"
done
M="${M#,},l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
M="$M,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"
M="$M,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_global_ld.sum"
M="$M,smsp__inst_executed_op_global_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts.sum"
M="$M,breakdown:sm__throughput.avg.pct_of_peak_sustained_elapsed,breakdown:l1tex__throughput.avg.pct_of_peak_sustained_elapsed"
M="$M,sm__inst_executed_pipe_xu.sum,sm__inst_executed_pipe_lsu.sum,sm__inst_executed_pipe_alu.sum,sm__inst_executed_pipe_fma.sum"
M="$M,sm__inst_executed_pipe_fmaheavy.sum,sm__inst_executed_pipe_uniform.sum,sm__inst_executed.sum,gpu__time_duration.sum"
for t in ${TREES:?TREES}; do
  timeout 200 ncu --clock-control none -k "regex:prepare" --launch-count 1 --metrics "$M" \
    ".deps/$t/build-gpu/bench/bench_gpu_prefill" --case "${CASE:-P4}" --no-check --iters 1 >"$OUT/ncum_$t.txt" 2>&1
  echo "== $t (rc=$?)"
  grep -E "gpu__time_duration|sm__inst_executed.sum|stalled_(barrier|long_scoreboard|short_scoreboard|mio_throttle|no_instruction|not_selected|wait)_" \
    "$OUT/ncum_$t.txt" | awk '{print $1, $NF}'
done
