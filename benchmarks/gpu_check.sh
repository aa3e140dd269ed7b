#!/usr/bin/env bash
# One call on a GPU machine: the gpu-marked tests, then the benchmarks; a short
# table last. Run from the checkout: PYTHONPATH=. bash benchmarks/gpu_check.sh
# (no install step; the machine's python3 has torch, triton, numpy, pytest, hypothesis).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp/gpukv-gpu-check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())'
t0=$(date +%s)
# One device call may run 600 s: each part gets its own cap, and never more than what is left of the budget
# (a part with under 10 s left is skipped, saying so), so the table always prints.
budget=${GPU_CHECK_BUDGET:-540}
capped() {  # capped SECONDS COMMAND...: run COMMAND under the smaller of SECONDS and the budget left
  local left=$((budget - ($(date +%s) - t0)))
  if [ "$left" -lt 10 ]; then echo "skipped: the check's ${budget} s budget is spent"; return 124; fi
  timeout "$((left < $1 ? left : $1))" "${@:2}"
}
capped 240 python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
t1=$(date +%s)
capped 120 python3 benchmarks/bench_step.py --steps 30 --running 256 --new 16 --json "$out/bench_step.json" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
t2=$(date +%s)
capped 240 python3 benchmarks/bench_host.py --steps 50 --json "$out/bench_host.json" 2>&1 | tee "$out/bench_host.log"
capped 120 python3 -m gpukv replay --backend device --json "$out/replay_device.json" 2>&1 | tee "$out/replay.log"
replay_rc=${PIPESTATUS[0]}
t3=$(date +%s)
# gpukv's worker (vLLM 0.33+, whose Model Runner V2 it drives): the differential against vLLM's own
# BlockTables with real CUDA kernels, then the step's block-table cost with and without the worker. The
# machine's image has no vLLM: carry its Python tree and pure-Python needs (README's wheels recipe) on
# PYTHONPATH; without it both are skipped and the table says so.
if python3 -c 'import vllm.v1.worker.gpu.block_table' >/dev/null 2>&1; then
  capped 150 python3 -m pytest -q -p no:cacheprovider tests/test_vllm033/test_worker.py 2>&1 | tee "$out/worker_tests.log"
  worker_rc=${PIPESTATUS[0]}
  capped 90 python3 benchmarks/bench_worker.py --steps 30 --json "$out/bench_worker.json" 2>&1 | tee "$out/bench_worker.log"
  worker_bench_rc=${PIPESTATUS[0]}
else
  echo "skipped: vLLM 0.33+ is not importable" | tee "$out/worker_tests.log" "$out/bench_worker.log"
  worker_rc=- worker_bench_rc=-
fi
t4=$(date +%s)
echo
echo "| check | result | seconds |"
echo "| --- | --- | --- |"
echo "| gpu tests | $(tail -n 1 "$out/gpu_tests.log") (rc $tests_rc) | $((t1 - t0)) |"
echo "| step benchmark | $(grep 'ratio' "$out/bench.log" | sed 's/^ *//') (rc $bench_rc) | $((t2 - t1)) |"
echo "| host cost (decode B=1..1024, prefill) | see bench_host.log | - |"
echo "| replay (device) | $(grep 'manager time/step' "$out/replay.log" | sed 's/  */ /g') (rc $replay_rc) | $((t3 - t2)) |"
echo "| worker differential (CUDA) | $(tail -n 1 "$out/worker_tests.log") (rc $worker_rc) | $((t4 - t3)) |"
echo "| worker step, with and without | see bench_worker.log (rc $worker_bench_rc) | - |"
