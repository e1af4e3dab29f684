#!/usr/bin/env bash
# Expert deferral on the GPU machine (issue 20), one device call of about 5 minutes: build, the deferral GPU tests
# (graph decode with deferral == eager decode with deferral, batch 1 and 2; int4 + hot experts; host-callback
# fallback; a new d captures anew), then bench decode --defer on Qwen3-30B-A3B shapes, int4 first (the target), then
# bf16, each cut off after BENCH_S seconds (rows print as they are measured). Logs under $OUT (run_gpu_machine.sh's
# stages build, defer, bench-defer). From the repository root:  bash tests/gpu/defer_stage.sh
# Knobs: DEFER (settings, default 0,1,2,3), TOKENS (decode tokens per timing, 32), ROUNDS (3), BENCH_S (130),
# QUANTS ("int4 bf16").
exec bash "$(dirname "$0")/run_gpu_machine.sh" build defer bench-defer
