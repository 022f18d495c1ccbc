#!/usr/bin/env bash
# The upstream PRs' checks that need a GPU, in under 10 minutes, from a checkout of this
# repository on a machine with a CUDA device and torch 2.15.0:
#
#   PY=python tools/upstream/gpu_check.sh
#
# 1. check.py --gpu: PR 2a's new tests fail on unpatched torch; on the stack of the three
#    patches, under torch's harness: PR 2a's new tests, PR 2b's test file, and PR 1's new
#    tests (they need 2 devices and skip with 1); with 2 or more devices, PR 1's whole test
#    file with NCCL, each failure rerun on unpatched torch, where it must fail too.
# 2. gpu_checkpoint_rng_bench.py: PR 2a's per-region overhead, patched vs unpatched (its table goes
#    into PR-2a.md's cost paragraph).
#
# With OUT set (a folder), each part's output is also written there (check_gpu.log, bench.log).
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-python}
LOGS=${OUT:-$(mktemp -d)}
export TORCH_FSDP_EXT_DISABLE=1
status=0
timeout 420 "$PY" tools/upstream/check.py --gpu 2>&1 | tee "$LOGS/check_gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 150 "$PY" tools/upstream/gpu_checkpoint_rng_bench.py 2>&1 | tee "$LOGS/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
