#!/usr/bin/env bash
# One call on a lent GPU machine (no registry there, nothing kept between calls): install the wheels that
# ../shared/gpu/fetch-wheels.sh put in .whl/, then `hcache check --save` under a time limit of its own, its
# log under $OUT as it is written and its report (rewritten after every case and benchmark) copied there
# when the check ends or its time is up, so a call's limit never takes what was measured. Run by the device
# tool from the repository's root with carry=[".whl"]:
#   bash scripts/gpu_check.sh [SECONDS the check may run, default 540]
set -uo pipefail
: "${OUT:?set by the device tool: the folder whose files come back}"
source .whl/gpu-setup.sh
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
# SIGINT, not SIGTERM: Python unwinds, so the benchmark in flight is stopped and temporary stores removed.
timeout -s INT "${1:-540}" python3 -m hcache check --save 2>&1 | tee "$OUT/check.log"
cp benchmarks/results/check-*-"$(date +%F)".json benchmarks/results/check-*-"$(date +%F)".md "$OUT/" 2>/dev/null
ls -l "$OUT"
