#!/usr/bin/env bash
# Everything a session lent one GPU runs, in one command (it runs from the repository root, wherever it is called):
#
#   bash benchmarks/gpu/gpu_check.sh      # writes under $OUT (the device tool's folder), or ./gpu_out
#
# Issue 46, point 4 (offload after the host-path rework), under 8 minutes in all:
# 1. benchmarks.gpu.cuda_offload_check: offload against no offload on CUDA over NCCL (bitwise under SGD; AdamW's
#    fused CUDA and CPU kernels differ at the last bit, reported), pinned memory (about 30 s; limit 90 s);
# 2. benchmarks.gpu.bench_offload_gpu, 606M GPT in bf16-mixed at batch 16 x 512: step times of zero2, zero2_offload,
#    zero2_offload+delayed, zero3, zero3_offload (a, with the breakdown c) and the largest model under an 8 GiB cap
#    (b), within BENCH_BUDGET_S (default 250 s; limit that + 30 s);
# 3. the same step times at batch 48 x 512, where the bound says the delayed host step hides (limit 130 s);
# 4. benchmarks.offload.bench_host_path on the GPU host's CPU: the host path (landing, host AdamW, publish) at
#    1/4/8/16 threads, huge pages on and off (limit 100 s).
# Every part runs even if an earlier one failed; the exit status is the first failure's. The reports are named as in
# benchmarks/results/ (<name>.<machine>.<date>.<ext>), ready to be copied into results/gpu/ and results/offload/.
# Step time against DDP and FSDP2 on a ~1.2B GPT (not run here; about 5 minutes on an H200):
#   python3 -m benchmarks.gpu.bench_offload_gpu --parts s --budget-s 300 --out "$OUT/offload_gpu_step.$TAG.md"
set -u
cd "$(dirname "$0")/../.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH=.
export LZERO_COLLECTIVES_AT_WORLD_SIZE_1=1
PY="${PYTHON:-python3}"
BUDGET="${BENCH_BUDGET_S:-250}"
TAG="$("$PY" -c 'from benchmarks.common import machine, today; print(f"{machine()}.{today()}")')"
status=0

{
  date -u
  git log -1 --oneline 2>/dev/null
  "$PY" -c 'from benchmarks.common import run_header; print(run_header())'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c 'import torch; print("cuda", torch.version.cuda)'
  nproc; free -g
} > "$OUT/env.txt" 2>&1

part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, remember the first failure
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s (limit $limit s; 124: timed out)"
  tail -n 25 "$OUT/$name.log"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

host_path() {  # the host path alone, at each thread count, huge pages on and off (fp32: a quick forward on the CPU)
  for hp in true false; do
    for th in 1 4 8 16; do
      "$PY" -m benchmarks.offload.bench_host_path --precision fp32 --steps 5 --threads "$th" \
        --options "{\"huge_pages\": $hp}" --label "huge_pages=$hp threads=$th" \
        --json "$OUT/host_path_options.$TAG.json" || return 1
    done
  done
}

part cuda_offload_check 90 "$PY" -m benchmarks.gpu.cuda_offload_check
part bench_offload_gpu $((BUDGET + 30)) "$PY" -m benchmarks.gpu.bench_offload_gpu --budget-s "$BUDGET" \
  --precisions bf16-mixed --out "$OUT/offload_gpu.$TAG.md" --log-dir "$OUT/bench_logs"
part bench_offload_gpu_b48 130 "$PY" -m benchmarks.gpu.bench_offload_gpu --parts a --budget-s 120 --batch-size 48 \
  --precisions bf16-mixed --out "$OUT/offload_gpu_b48.$TAG.md" --log-dir "$OUT/bench_logs_b48"
export -f host_path
export PY OUT TAG
part host_path 100 bash -c host_path
exit $status
