#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devcarry/base and .devcarry/corpus-bpe, the BPE corpus
# built here with `moec corpus -o .devcarry/corpus-bpe --tokenizer bpe --vocab-size 4096`):
#   bash bench/kv_quality_small_gpu.sh SHA [ROWS]
# trains `small` once into /tmp/small (about 4 minutes), then measures the KV-cache policies at a
# 4096-token context with the reference decoder on the GPU (about 30 s a row). Every JSON lands in
# $OUT with its own command; the later ones reuse /tmp/small from the first. ROWS picks the runs
# (default all, in this order; the machine's 600 s limit fits the table and about 4 more):
#   table      bf16, FP8, 2-bit, tiered by mass, by key norm, random seeds 0 and 1 (65,536 tokens)
#   moments    tiered and 2-bit with the plain moments fit of the 2-bit statistics
#   page32     tier-2 pages of 32 tokens (finer key statistics)
#   t1-0.3     a 30% tier-1 budget
#   demote-k   keys alone demoted to 2-bit (values stay FP8)
#   demote-v   values alone demoted to 2-bit
set -u
SHA=$1
ROWS=${2:-table,moments,page32,t1-0.3,demote-k,demote-v}
source bench/device_env.sh > "$OUT/env.log" 2>&1 || exit 1
K="--device cuda --context 4096 --batch-size 32 --recent 64 --sink 4 --page-tokens 128 --commit $SHA"
A="--max-tokens 32768 --score uniform"
[ -d /tmp/small ] || python3 -m moec.compiler.cli train-reference --size small -o /tmp/small --device cuda \
    --corpus .devcarry/corpus-bpe --export none > "$OUT/train.log" 2>&1 || exit 1
for row in ${ROWS//,/ }; do
  case $row in
    table)    args="$K --max-tokens 65536 --score uniform,keynorm --random-seeds 0,1 --modes bf16,fp8,2bit,tiered,tiered-random" ;;
    moments)  args="$K $A --fit moments --modes bf16,2bit,tiered" ;;
    page32)   args="${K/--page-tokens 128/--page-tokens 32} $A --modes bf16,2bit,tiered" ;;
    t1-0.3)   args="$K $A --tier1-fraction 0.3 --random-seeds 0 --modes bf16,tiered,tiered-random" ;;
    demote-k) args="$K $A --demote k --modes bf16,tiered" ;;
    demote-v) args="$K $A --demote v --modes bf16,tiered" ;;
    *) echo "unknown row $row"; exit 2 ;;
  esac
  python3 bench/kv_quality.py /tmp/small $args --json "$OUT/kv_quality_gpu_small_$row.json" >> "$OUT/log" 2>&1
done
