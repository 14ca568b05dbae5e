#!/usr/bin/env bash
# Profile the fused kernel at one shape with Nsight Compute (device machine, repository root).
# Usage: bash bench/ncu_kernel.sh [N,C,D,H,W] [variant] [precision] [extra ncu args...]
# Prints duration, pipe utilisation, occupancy, bank conflicts and the warp stall breakdown (cycles per
# issued instruction by reason). With REPORT=path also saves the report and writes path.sass.csv: per SASS
# instruction, its stall samples and excessive shared-memory wavefronts.
set -uo pipefail
SHAPE=${1:-128,3,16,32,32}
VARIANT=${2:-0}
PRECISION=${3:-fp32}
shift $(( $# < 3 ? $# : 3 ))
ncu --clock-control none -k regex:fused_ -c 1 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SourceCounters \
  ${REPORT:+-o $REPORT -f} \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__inst_executed.sum" "$@" \
  python3 - "$SHAPE" "$VARIANT" "$PRECISION" <<'PY' 2>&1 | grep -v "^==PROF==" | grep -vi "^ *----" | sed -e 's/  */ /g'
import sys
import torch
from voxserve.kernels import cuda, reference_weights
shape = tuple(int(v) for v in sys.argv[1].split(","))
w, b = (t.cuda() for t in reference_weights())
x = torch.randn(shape, device="cuda")
cuda.forward(x, w, b, int(sys.argv[2]), sys.argv[3])
torch.cuda.synchronize()
PY
if [ -n "${REPORT:-}" ]; then
  ncu --import "$REPORT.ncu-rep" 2>&1 | grep -vi "^ *----" | sed -e 's/  */ /g'
  ncu --import "$REPORT.ncu-rep" --page source --csv --print-source sass > "$REPORT.sass.csv" 2>&1
fi
