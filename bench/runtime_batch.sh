#!/usr/bin/env bash
# The runtime-only GPU runs of one round in one device call (runtime-only TVM: no compiler staging).
#
# Prepared here first (each writes its directory under .devcarry/, git-ignored):
#   python bench/tiered_decode.py prepare .devcarry/td12
#   python bench/tiered_prefill.py prepare .devcarry/tp3  (and .devcarry/tp2, prepared at 50ad451: groups widened one
#   element at a time; timed on the H100 at c23b99a)
#   python bench/tiered_rerank.py prepare .devcarry/rr6   (and .devcarry/rr, prepared at abdd814: the single-launch form;
#   rr4, d47e776's five launches with serial row copies, was timed on the H100: tiered_rerank_h100_d47e776.json)
#   python bench/grouped_experts.py prepare .devcarry/ge
#   python bench/e2e_cuda.py prepare .devcarry/e2e2
#   python bench/dense_gemm.py prepare .devcarry/dg6; python bench/grouped_experts.py prepare .devcarry/ge2  (the tiled
#   prefill GEMMs; optional: they add up to 350 s)
# Then there (carry .devcarry/base, td12, tp3, tp2, rr, rr6, e2e2, ge): bash bench/runtime_batch.sh SHA; with GE_BENCH=1
# the expert GEMMs' bench too (up to 200 s more); ge alone is profiled under ncu
# (the gathering re-rank, tiered_rerank.py prepare --stage-bytes 0, and pipelined_decode.py: in a later call)
# Each run writes $OUT/<name>.json; a failing run does not stop the others, and the exit status counts them.
# The logs come back as one archive, $OUT/logs.tgz (the device tool returns at most 8 files).
set -u
SHA=${1:?usage: bench/runtime_batch.sh COMMIT}
source bench/device_env.sh >/dev/null 2>&1 || { echo "device_env.sh failed" >&2; exit 2; }
failed=0
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)" in
  *H200*) DEV=h200 ;; *H100*) DEV=h100 ;; *) DEV=gpu ;;
esac
LOGS=$(mktemp -d)/logs
mkdir -p "$LOGS"
run() {  # run NAME SECONDS COMMAND...: one bench under a time limit, its log kept next to its JSON
  local name=$1 limit=$2
  shift 2
  echo "== $name" >&2
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1 || { echo "   $name failed (exit $?)" >&2; failed=$((failed + 1)); }
  tail -n 3 "$LOGS/$name.log" >&2
  tar czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" logs  # after every run: a call stopped at its limit keeps the logs
}
# the first GPU check of the newest kernels' numbers first, then each new form next to the one it replaces (the old
# forms, tp and rr, run where carried: on a card that timed them before, leave them out)
run e2e_cuda_$DEV 120 python3 bench/e2e_cuda.py run .devcarry/e2e2 --json "$OUT/e2e_cuda_$DEV.json" --commit "$SHA"
run tiered_rerank_$DEV 60 python3 bench/tiered_rerank.py run .devcarry/rr6 --json "$OUT/tiered_rerank_$DEV.json" --commit "$SHA"
[ -d .devcarry/rr ] && run tiered_rerank_staged_$DEV 60 python3 bench/tiered_rerank.py run .devcarry/rr --json "$OUT/tiered_rerank_staged_$DEV.json" --commit abdd814
run tiered_prefill_$DEV 100 python3 bench/tiered_prefill.py run .devcarry/tp3 --json "$OUT/tiered_prefill_$DEV.json" --commit "$SHA"
[ -d .devcarry/tp2 ] && run tiered_prefill_pr_$DEV 100 python3 bench/tiered_prefill.py run .devcarry/tp2 --json "$OUT/tiered_prefill_pr_$DEV.json" --commit 50ad451
# Hardware counters (where ncu can read them) of the decode step's two heaviest kernels at the headline point:
# the tiered decode attention (the half2 form and the paired one, compiled for one query head per KV head since b07279b) and, with .devcarry/ge, the grouped expert GEMMs.
NCU_BIN=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -n 1)
if [ -n "$NCU_BIN" ]; then
  NCU=("$NCU_BIN" --clock-control none --set full --launch-count 2)
  for v in olmoe-half2-pipe4 olmoe-half2-pipe4-t1h2-scat; do  # half2, and paired (tier 1 in pairs, scattered scores)
    run ncu_tiered_decode_${v}_$DEV 90 "${NCU[@]}" -k regex:tiered_decode \
        python3 bench/tiered_decode.py profile .devcarry/td12 --variant $v
  done
  if [ -d .devcarry/ge ]; then
    run ncu_grouped_experts_$DEV 120 "${NCU[@]}" -k 'regex:^moe_(gate_up|down)_experts_kernel$' \
        python3 bench/grouped_experts.py profile .devcarry/ge --batches 128
  fi
fi
run tiered_decode_$DEV 150 python3 bench/tiered_decode.py run .devcarry/td12 --json "$OUT/tiered_decode_$DEV.json" --commit "$SHA"
# the block-tiled prefill GEMMs against the forms the prefill entry uses (where dg6 and ge2 are carried: prepared
# by bench/dense_gemm.py and bench/grouped_experts.py, which time the `_tiled` and `tiled` forms beside the others)
[ -d .devcarry/dg6 ] && run dense_gemm_prefill_$DEV 150 python3 bench/dense_gemm.py run .devcarry/dg6 \
    --shapes olmoe_proj,mixtral_proj --tokens 128 2048 4096 --json "$OUT/dense_gemm_prefill_$DEV.json" --commit "$SHA"
[ -d .devcarry/ge2 ] && run grouped_experts_tiled_$DEV 200 python3 bench/grouped_experts.py run .devcarry/ge2 --batches 2048 \
    --no-compile --json "$OUT/grouped_experts_tiled_$DEV.json" --commit "$SHA"
if [ -d .devcarry/ge ] && [ -n "${GE_BENCH:-}" ]; then  # unchanged since grouped_experts_prefill_h100_d47e776.json: on asking
  run grouped_experts_prefill_$DEV 200 python3 bench/grouped_experts.py run .devcarry/ge --batches 128 2048 --no-compile \
      --json "$OUT/grouped_experts_prefill_$DEV.json" --commit "$SHA"
fi
tar czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" logs
echo "$failed run(s) failed" >&2
exit "$failed"
