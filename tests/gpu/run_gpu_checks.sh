#!/usr/bin/env bash
# What can be checked on ONE GPU (two NCCL ranks cannot share a GPU):
#   1. multi-rank gloo with CUDA tensors through the whole catalogue,
#   2. one-rank NCCL (clean), and a one-rank NCCL stall with the Flight Recorder dump,
#   3. the tracer's overhead on one-rank NCCL,
#   4. the node check (comm_health) on NCCL, one rank per GPU, and 5. its timing against a plain torch loop,
#   6. distcheck attach on a plain torchrun NCCL job with a planted hang (needs py-spy: distcheck[attach]),
#   7. the completion source on real NCCL: a call held behind a kernel is open until the stream ran it, closed
#      <= 0.1 s after; the Flight Recorder read's cost at 256 and 20,000 entries (benchmarks/completion_source.py).
# Usage (on the GPU machine, from the repo root): bash tests/gpu/run_gpu_checks.sh OUTDIR
set -uo pipefail
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())" | tee "$out/env.txt"
python -m distcheck env >> "$out/env.txt" 2>&1

echo "== 1. catalogue, 4 gloo ranks, CUDA tensors"
python -m distcheck run --nproc-per-node 4 --backend gloo --device cuda --stall-timeout 5 \
  --json "$out/gloo_cuda.json" --run-dir "$out/run_gloo_cuda" 2>&1 | tee "$out/gloo_cuda.txt" | tail -40
echo "exit code: ${PIPESTATUS[0]}" | tee -a "$out/gloo_cuda.txt"

echo "== 2a. one-rank NCCL, clean"
python -m distcheck run tests/gpu/nccl_one_rank.py --nproc-per-node 1 --backend nccl \
  --json "$out/nccl_clean.json" --run-dir "$out/run_nccl_clean" -- --mode clean 2>&1 | tail -10
echo "== 2b. one-rank NCCL, stall + Flight Recorder"
python -m distcheck run tests/gpu/nccl_one_rank.py --nproc-per-node 1 --backend nccl --stall-timeout 5 \
  --json "$out/nccl_stall.json" --run-dir "$out/run_nccl_stall" -- --mode stall 2>&1 | tail -20
python - "$out/nccl_stall.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for s in r["scenarios"]:
    for rank in s["ranks"]:
        print("rank", rank["rank"], rank["state"], "flight recorder:", rank.get("flight_recorder"))
    for f in s["findings"]:
        print(f["kind"], f["summary"])
PY

echo "== 3. tracer overhead, one-rank NCCL (target: 'tracer ×' <= 1.10 on 'all_reduce 1 elem')"
python benchmarks/tracer_overhead.py --nccl 2>&1 | tee "$out/overhead_nccl.txt" | tail -30
grep "all_reduce 1 elem" "$out/overhead_nccl.txt" | tail -1 | awk '{print "one-rank NCCL all_reduce, traced / untraced:", $6}' 

echo "== 4. node check (comm_health) on NCCL: nccl-tests' table to 1 GiB, out of place and in place, #wrong"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
# One rank per GPU: on a one-GPU machine that is one rank (busbw factor 0 for all_reduce at n=1, as
# nccl-tests prints it; no pairs); on a multi-GPU node every GPU, with the pairwise matrix.
python -m distcheck run comm_health --nproc-per-node "$gpus" --backend nccl \
  --json "$out/node_check_nccl.json" --run-dir "$out/run_node_check_nccl" 2>&1 | tee "$out/node_check_nccl.txt" | tail -60
echo "exit code: ${PIPESTATUS[0]}" | tee -a "$out/node_check_nccl.txt"
python - "$out/node_check_nccl.json" <<'PY'
import json, sys
from distcheck.knowledge import nccl_tests as bw
s = json.load(open(sys.argv[1]))["scenarios"][0]
n = json.load(open(sys.argv[1]))["run"]["world_size"]
sweep = next(t for t in s["tables"] if t["title"].startswith("Bus bandwidth"))
bad = [(r["op"], r["size"]) for r in sweep["records"] for p in (r["out_of_place"], r["in_place"]) if p
       and (p["wrong"] or abs(p["busbw"] - bw.busbw(r["op"], r["count"], 4, p["time_us"] / 1e6, n)) > 1e-9 * (1 + p["busbw"]))]
print("rows:", len(sweep["records"]), "largest size:", max(r["size"] for r in sweep["records"]), "rows off nccl-tests' formula or wrong:", bad)
PY

echo "== 5. node check timing vs a plain torch loop, NCCL on cuda:0 (target: harness / plain <= 1.05)"
python benchmarks/comm_health_overhead.py --nccl --ranks 1 --size 256M 2>&1 | tee "$out/node_check_overhead.txt" | tail -8

echo "== 6. distcheck attach, plain torchrun NCCL job, 2 ranks: rank 0 in all_reduce, rank 1 polls (expect exit 1, a hang)"
# One GPU: rank 1 never calls NCCL, so rank 0's all_reduce waits for it in the communicator's set-up (two NCCL ranks
# cannot share a GPU once both join). Two GPUs or more: also the Flight Recorder case, rank 0's thread past its
# all_reduce #6 (in torch.cuda.synchronize), the dumps joined by sequence number.
attach_case() {   # NAME MODE [ENV=VALUE...]
  local name=$1 mode=$2 dir="$out/attach_$1"; shift 2
  mkdir -p "$dir"
  env "$@" setsid python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/attach/job.py \
    "$mode" "$dir" --backend nccl > "$dir/job.txt" 2>&1 &
  local job=$!
  for _ in $(seq 240); do [ -f "$dir/ready0" ] && [ -f "$dir/ready1" ] && break; sleep 0.5; done
  timeout 120 python -m distcheck attach "$job" --json "$out/attach_$name.json" --run-dir "$dir/run" 2>&1 \
    | tee "$out/attach_$name.txt" | tail -20
  echo "exit code: ${PIPESTATUS[0]} (expected 1)" | tee -a "$out/attach_$name.txt"
  touch "$dir/release"; kill -KILL -- "-$job" 2>/dev/null; wait "$job" 2>/dev/null
}
if command -v py-spy > /dev/null; then
  attach_case allreduce allreduce
  [ "$gpus" -ge 2 ] && attach_case flight_recorder frdump TORCH_FR_BUFFER_SIZE=200 "TORCH_FR_DUMP_TEMP_FILE=$out/attach_flight_recorder/fr_"
else
  echo "skipped: py-spy is not installed (pip install 'distcheck[attach]')" | tee "$out/attach.txt"
fi

echo "== 7. NCCL's completion, one rank: open while a kernel holds the stream, closed <= 0.1 s after it ran"
timeout 120 python tests/gpu/nccl_completion.py --hold-s 2 2>&1 | tee "$out/nccl_completion.txt" | tail -5
echo "exit code: ${PIPESTATUS[0]} (expected 0)" | tee -a "$out/nccl_completion.txt"
for n in 256 20000; do
  TORCH_FR_BUFFER_SIZE=$n timeout 300 python tests/gpu/nccl_completion.py --hold-s 1 --fill $n 2>&1 | tail -1 \
    | sed "s/^/ring of $n entries: /" | tee -a "$out/nccl_completion.txt"
done
