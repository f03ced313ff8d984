#!/usr/bin/env bash
# Kernel durations (Nsight Compute, one metric, warm caches) of one scripts/profile_ncu.py case,
# optionally with Python statements run first (a module constant patched), on the GPU machine
# after `cuda_device_run.sh stage2 none` (session 28):
#
#   OUT=/tmp/out bash scripts/ncu_times.sh CASE ["PATCH"] [LABEL]
#   bash scripts/ncu_times.sh ln_vjp_bf16_8k_ours "import xlstm_kernels.ops.norm as n; n.PARTIALS_SIMDGROUPS_CUDA=32" S32
#
# Prints one line: CASE LABEL, then each kernel's median and minimum us over NCU_TIMES_CALLS
# (default 20) evaluated calls (after profile_ncu.py's warm-up calls).
set -u
case_name=$1
patch=${2:-}
label=${3:-}
calls=${NCU_TIMES_CALLS:-20}
out=${OUT:-/tmp}/ncu_times.csv
timeout "${NCU_TIMEOUT:-150}" ncu --metrics gpu__time_duration.sum --print-units base --cache-control none \
  --clock-control none --csv python3 -c "import sys, runpy
$patch
sys.argv = ['profile_ncu.py', 'timed', '$case_name', '$calls']
runpy.run_path('scripts/profile_ncu.py', run_name='__main__')" >"$out" 2>&1
python3 - "$case_name $label" "$out" "$calls" <<'PY'
import collections, csv, statistics, sys
rows = [r for r in csv.reader(line for line in open(sys.argv[2]) if line.startswith('"'))]
if not rows:
    print(sys.argv[1], "no kernels:", open(sys.argv[2]).read()[-800:])
    sys.exit()
head = rows[0]
ki, vi = head.index("Kernel Name"), head.index("Metric Value")
by = collections.defaultdict(list)
for r in rows[1:]:
    by[r[ki][:40]].append(float(r[vi].replace(",", "")) / 1e3)
n = int(sys.argv[3])
by = {k: v[-n:] for k, v in by.items() if len(v) >= n}  # the timed calls' kernels
print(sys.argv[1], " | ".join(f"{k}: med {statistics.median(v):.2f} min {min(v):.2f}" for k, v in by.items()),
      flush=True)
PY
