#!/usr/bin/env bash
# Run the cuda backend's tests and benchmarks on a lent NVIDIA machine (the `run` tool of
# this workplace; see docs/CUDA.md).
#
#   scripts/cuda_device_run.sh prepare       # HERE: download + split the MLX CUDA wheels, print the calls
#   scripts/cuda_device_run.sh stage1        # DEVICE, call 1 (carry .whl):  park part 1 in /tmp
#   scripts/cuda_device_run.sh snapshot      # HERE: export the committed tree (HEAD) to .clean/, so that
#                                            #   measurements ignore uncommitted edits; then call 2 is
#                                            #   run(carry=[".whl2", ".clean"], command="bash .clean/scripts/cuda_device_run.sh stage2 ...")
#   scripts/cuda_device_run.sh stage2 [what...] # DEVICE, call 2 (carry .whl2): install, then run
#                                            #   what = tests | bench | overhead | probe | probes | host | ncu | none | all
#                                            #   (default all = tests bench; probes = every scripts/probe_*.py)
#   scripts/cuda_device_run.sh env           # DEVICE: print the exports stage2 uses (eval it)
#
# Why two calls: a call carries at most 64 MiB and the mlx-cuda-13 wheel is ~90 MB. It is
# split in two parts; call 1 carries the first (with the small mlx wheel) and copies it
# to /tmp, call 2 (sent at once, while the machine is still warm: ~30 s) carries the
# second, reassembles the wheel and unpacks both into /tmp/site. The machine's own
# nvidia-* CUDA 13 libraries (PyTorch's) are linked in as /tmp/site/nvidia, where
# libmlx.so's RPATH looks for them.
set -uo pipefail

MLX_VERSION="${MLX_VERSION:-0.32.4}"
PART_SIZE="${PART_SIZE:-}"  # bytes of the wheel's first part (split -b syntax); default: half the wheel
CARRY_LIMIT=$((64 << 20))  # what one device call carries: the working tree plus its carry paths
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
W=/tmp/xk-whl          # device: parts and wheels
SITE=/tmp/site         # device: unpacked mlx + mlx_cuda_13
OUT="${OUT:-/tmp/xk-out}"
TEST_FILES=(tests/emulate/test_emulator_features.py tests/test_gemm.py tests/test_norm.py tests/test_rope.py
            tests/test_attention.py tests/test_mlstm.py tests/test_slstm.py tests/test_fused.py
            tests/test_repeatability.py tests/test_cuda_text.py tests/test_cuda_constants.py tests/test_concurrency.py
            tests/test_callcache.py tests/test_copy_rate.py)
[ -n "${XK_TEST_FILES:-}" ] && read -ra TEST_FILES <<<"$XK_TEST_FILES"  # override: "tests/a.py tests/b.py"

prepare() {
  cd "$ROOT"
  local git_dir
  git_dir="$(git rev-parse --git-dir)"
  mkdir -p "$git_dir/info"
  for d in /.whl/ /.whl2/ /.whl-cache/; do
    grep -qxF "$d" "$git_dir/info/exclude" 2>/dev/null || echo "$d" >>"$git_dir/info/exclude"
  done
  mkdir -p .whl-cache
  local plat=(--platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl-cache "mlx==$MLX_VERSION" "mlx-cuda-13==$MLX_VERSION" || return 1
  local cuda_whl mlx_whl
  cuda_whl="$(ls .whl-cache/mlx_cuda_13-"$MLX_VERSION"-*.whl | head -1)"
  mlx_whl="$(ls .whl-cache/mlx-"$MLX_VERSION"-cp312-*.whl | head -1)"
  # Each call carries the working tree (tracked and untracked files git does not ignore)
  # beside its part: the parts are halves of the wheel unless PART_SIZE says otherwise, and
  # both calls must stay within CARRY_LIMIT.
  local tree whl_bytes mlx_bytes part
  tree="$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)"
  whl_bytes="$(stat -c %s "$cuda_whl")"
  mlx_bytes="$(stat -c %s "$mlx_whl")"
  part="${PART_SIZE:-$(((whl_bytes + 1) / 2))}"
  rm -rf .whl .whl2 && mkdir -p .whl .whl2
  cp "$mlx_whl" .whl/
  split -b "$part" -d "$cuda_whl" ".whl/$(basename "$cuda_whl").part-"
  mv .whl/"$(basename "$cuda_whl")".part-01 .whl2/
  if ls .whl/*.part-02 >/dev/null 2>&1; then
    echo "the wheel needs more than two parts; raise PART_SIZE (each call carries <= 64 MiB)" >&2
    return 1
  fi
  local d size
  for d in .whl .whl2; do
    size=$((tree + $(du -cb "$d" | tail -1 | cut -f1)))
    if [ "$size" -gt "$CARRY_LIMIT" ]; then
      echo "the call carrying $d would carry $((size >> 20)) MiB (working tree $((tree >> 20)) MiB + $d), over" \
           "the $((CARRY_LIMIT >> 20)) MiB a call carries: set PART_SIZE (now $part bytes) or shrink the tree" >&2
      return 1
    fi
  done
  (cd .whl-cache && sha256sum "$(basename "$cuda_whl")") >.whl2/SHA256SUMS
  du -sh .whl .whl2
  cat <<EOF
Two device calls, the second sent right after the first (the machine stays warm ~30 s):
  run(carry=[".whl"],  timeout_s=120, command="bash scripts/cuda_device_run.sh stage1")
  run(carry=[".whl2"], timeout_s=480, command="bash scripts/cuda_device_run.sh stage2 all")
Logs and results come back under \$OUT (tests.log, junit.xml, bench.log, bench.tgz, env.txt).
EOF
}

stage1() {
  mkdir -p "$W" "$OUT"
  cp .whl/* "$W"/ || return 1
  {
    echo "== stage1 $(date -u +%FT%TZ)"
    nvidia-smi -L 2>&1
    python3 --version
    python3 -c 'import numpy, pytest; print("numpy", numpy.__version__, "pytest", pytest.__version__)'
    python3 -c 'import nvidia, os; p = os.path.dirname(list(nvidia.__path__)[0]); print(p); print(sorted(os.listdir(os.path.join(p, "nvidia"))))'
    python3 -m pip list 2>/dev/null | grep -i -E "xdist|timeout|nvidia-(cublas|cudnn|nccl|cuda-nvrtc|cufft|cusolver|cuda-runtime)"
    ls -la "$W"
  } 2>&1 | tee "$OUT/stage1.txt"
}

device_env() {
  local sp
  sp="$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null)"
  echo "export PYTHONPATH=$SITE:$ROOT PYTHONUNBUFFERED=1 MLX_ENABLE_TF32=\${MLX_ENABLE_TF32:-0}"
  echo "# nvidia libs: $sp/nvidia"
}

install_mlx() {
  mkdir -p "$W"
  cp .whl2/* "$W"/ 2>/dev/null || cp ../.whl2/* "$W"/ 2>/dev/null  # (a snapshot in .clean/: the parts are one up)
  local parts
  parts=("$W"/mlx_cuda_13-*.whl.part-*)
  [ -e "${parts[0]}" ] || { echo "no wheel parts in $W: run stage1 first (same warm machine)"; return 1; }
  local whl="$W/$(basename "${parts[0]%.part-*}")"
  cat "${parts[@]}" >"$whl"
  (cd "$W" && sha256sum -c SHA256SUMS) || return 1
  rm -rf "$SITE" && mkdir -p "$SITE"
  python3 -m zipfile -e "$W"/mlx-*-cp312-*.whl "$SITE" && python3 -m zipfile -e "$whl" "$SITE" || return 1
  local sp
  sp="$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))')" || return 1
  ln -sfn "$sp/nvidia" "$SITE/nvidia"
  # metal_src/ and tuning/ are installed as xlstm_kernels.metal_src / .tuning (package-dir
  # mapping in pyproject.toml); without an install, links make the source tree importable.
  ln -sfn ../metal_src "$ROOT/xlstm_kernels/metal_src"
  ln -sfn ../tuning "$ROOT/xlstm_kernels/tuning"
  export PYTHONPATH="$SITE:$ROOT" PYTHONUNBUFFERED=1
  python3 - <<'EOF'
import mlx.core as mx
print("mlx", mx.__version__, "cuda available:", mx.cuda.is_available(), "device:", mx.default_device())
print(mx.device_info() if hasattr(mx, "device_info") else "")
a = mx.ones((4, 4)); print("ones sum", (a @ a).sum().item())
EOF
}

run_tests() {
  export MLX_ENABLE_TF32="${MLX_ENABLE_TF32:-0}"  # references that use mx.matmul: full fp32
  local budget="${TEST_TIMEOUT:-570}" jobs="${TEST_JOBS:-16}"
  timeout -k 10 "$budget" python3 -m pytest "${TEST_FILES[@]}" --backend cuda -q -n "$jobs" -p no:cacheprovider \
    --timeout 200 -o junit_family=xunit1 --junitxml="$OUT/junit.xml" -rfE 2>&1 | tee "$OUT/tests.log" | tail -150
  echo "tests exit: ${PIPESTATUS[0]}"
}

run_bench() {
  unset MLX_ENABLE_TF32  # MLX as shipped: float32 matmul on TF32 tensor cores
  local budget="${BENCH_TIMEOUT:-170}" dir="$OUT/bench"
  mkdir -p "$dir"
  local py='import sys; from xlstm_kernels.cli import main; sys.exit(main(sys.argv[1:]))'
  local t0=$SECONDS
  for spec in ${BENCH_SPECS:-"gemm:float32,bfloat16" "norm:float32,bfloat16" "rope:bfloat16" "attention:float16" "mlstm:float32" "slstm:float32"}; do
    local ops="${spec%%:*}" dts="${spec#*:}" left=$((budget - (SECONDS - t0)))
    [ "$left" -gt 15 ] || { echo "bench: no time left for $ops"; continue; }
    local extra=()
    [ "$ops" = gemm ] && extra=(--shapes "${BENCH_GEMM_SHAPES:-1x4096x4096,512x1024x4096,2048x2048x2048,4096x4096x1024}")
    timeout -k 5 "$left" python3 -c "$py" --backend cuda bench --ops "$ops" --dtypes "$dts" "${extra[@]}" \
      --repeats "${BENCH_REPEATS:-10}" --out "$dir/${ops}_${dts//,/_}" 2>&1 | tee -a "$OUT/bench.log"
  done
  tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$dir"
}

run_probe() {
  unset MLX_ENABLE_TF32
  timeout -k 5 "${PROBE_TIMEOUT:-240}" python3 scripts/cuda_probe.py --only "${PROBE_ONLY:-copy,norm,gemm}" \
    --out "$OUT/probe.json" 2>&1 | tee "$OUT/probe.log"
}

run_overhead() {
  unset MLX_ENABLE_TF32
  timeout -k 5 "${OVERHEAD_TIMEOUT:-90}" python3 scripts/cuda_launch_overhead.py --out "$OUT/overhead.json" 2>&1 |
    tee "$OUT/overhead.log"
}

run_probes() {  # every scripts/probe_*.py (or those named in PROBES): one JSON and log each under $OUT
  unset MLX_ENABLE_TF32
  local f name
  for f in scripts/probe_*.py; do
    [ -e "$f" ] || continue
    name="$(basename "$f" .py)"
    # PROBES="rms decode": only scripts/probe_rms.py and probe_decode.py
    [ -z "${PROBES:-}" ] || [[ " $PROBES " == *" ${name#probe_} "* ]] || continue
    echo "== $f"
    timeout -k 5 "${PROBES_TIMEOUT:-170}" python3 "$f" --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | tail -80
  done
}

run_ncu() {  # Nsight Compute reports of scripts/profile_ncu.py's cases (ours and MLX's op side by side)
  unset MLX_ENABLE_TF32
  local line name regex warm
  local cases="${NCU_CASES:-}" extra=()
  read -ra extra <<<"${NCU_EXTRA:-}"  # more ncu options, e.g. "--print-details all"
  python3 scripts/profile_ncu.py list >"$OUT/ncu-cases.txt" || return 1
  while read -r name regex warm; do
    [ -z "$cases" ] || [[ " $cases " == *" $name "* ]] || continue
    echo "== ncu $name ($regex)" | tee -a "$OUT/ncu.txt"
    local save=()
    [ -n "${NCU_SOURCE:-}" ] && save=(-o "/tmp/ncu-$name" -f)
    timeout -k 5 "${NCU_TIMEOUT:-150}" ncu --set "${NCU_SET:-full}" --clock-control none --import-source no "${extra[@]}" \
      "${save[@]}" --kernel-name "regex:$regex" --launch-skip "$warm" --launch-count 1 \
      python3 scripts/profile_ncu.py run "$name" >>"$OUT/ncu.txt" 2>&1
    echo "exit $?" >>"$OUT/ncu.txt"
    if [ -n "${NCU_SOURCE:-}" ]; then  # NCU_SOURCE=1: per-SASS-instruction metrics (stall samples) as CSV
      ncu -i "/tmp/ncu-$name.ncu-rep" --page details >>"$OUT/ncu.txt" 2>&1
      ncu -i "/tmp/ncu-$name.ncu-rep" --page source --print-source sass --csv >"$OUT/ncu-source-$name.csv" 2>&1
    fi
  done <"$OUT/ncu-cases.txt"
  grep -E "^== ncu|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Block Size|Grid Size" "$OUT/ncu.txt" | head -150
}

run_ncutime() {  # kernel durations (ncu, one metric, warm caches) of the decode cases in NCU_TIME_CASES
  # NCU_TIME_CASES="ours,1,32,8,16384,128,512 mlx,1,32,8,16384,128": profile_ncu.py's decode:<case>
  unset MLX_ENABLE_TF32
  local c calls="${NCU_TIME_CALLS:-10}"
  for c in ${NCU_TIME_CASES:-}; do
    local re="regex:attention"
    [[ "$c" == mlx,* ]] && re="regex:sdpa|cudnn|flash|fmha"
    timeout -k 5 "${NCU_TIMEOUT:-150}" ncu --metrics gpu__time_duration.sum --print-units base --cache-control none --clock-control none \
      --kernel-name "$re" --csv python3 scripts/profile_ncu.py timed "decode:$c" "$calls" >"$OUT/ncutime.csv" 2>&1
    python3 - "$c" "$OUT/ncutime.csv" "$calls" <<'PY' | tee -a "$OUT/ncutime.txt"
import csv, statistics, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[2]) if l.startswith('"'))]
if not rows:
    print(sys.argv[1], "no kernels"); sys.exit()
head = rows[0]; ki, vi = head.index("Kernel Name"), head.index("Metric Value")
by = collections.defaultdict(list)
for r in rows[1:]:
    by[r[ki][:60]].append(float(r[vi].replace(",", "")) / 1e3)
by = {k: v[-int(sys.argv[3]):] for k, v in by.items()}  # the timed calls (after the warm-up ones)
tot = sum(statistics.median(v) for v in by.values())
print(f"{sys.argv[1]:34s} total {tot:7.2f} us  " + "  ".join(f"{k}: {statistics.median(v):.2f} (n={len(v)})" for k, v in by.items()))
PY
  done
}

run_host() {
  unset MLX_ENABLE_TF32
  timeout -k 5 "${HOST_TIMEOUT:-120}" python3 scripts/cuda_host_cost.py --out "$OUT/host.json" 2>&1 | tee "$OUT/host.log"
}

snapshot() {
  cd "$ROOT" || return 1
  local git_dir
  git_dir="$(git rev-parse --git-dir)"
  grep -qxF "/.clean/" "$git_dir/info/exclude" 2>/dev/null || echo "/.clean/" >>"$git_dir/info/exclude"
  rm -rf .clean && mkdir .clean && git archive HEAD | tar -x -C .clean || return 1
  echo "exported $(git rev-parse --short HEAD) to .clean/ ($(du -sh .clean | cut -f1))"
  echo 'call 2: run(carry=[".whl2", ".clean"], command="bash .clean/scripts/cuda_device_run.sh stage2 <what>")'
}

stage2() {
  local what=("$@")
  [ "${#what[@]}" -gt 0 ] || what=(all)
  mkdir -p "$OUT"
  { echo "== stage2 ${what[*]} $(date -u +%FT%TZ)"; install_mlx; } 2>&1 | tee "$OUT/env.txt"
  export PYTHONPATH="$SITE:$ROOT" PYTHONUNBUFFERED=1
  for w in "${what[@]}"; do
    case "$w" in
      tests) run_tests ;;
      bench) run_bench ;;
      overhead) run_overhead ;;
      probe) run_probe ;;
      host) run_host ;;
      probes) run_probes ;;
      ncu) run_ncu ;;
      ncutime) run_ncutime ;;
      none) ;;
      all) run_tests; run_bench ;;
      *) echo "unknown: $w"; return 2 ;;
    esac
  done
}

cmd="${1:-}"
shift || true
case "$cmd" in
  prepare) prepare "$@" ;;
  snapshot) snapshot ;;
  stage1) cd "$ROOT" && stage1 ;;
  stage2) cd "$ROOT" && stage2 "$@" ;;
  env) device_env ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
