#!/usr/bin/env bash
# Issue 21 (the OpenAI-compatible server) on the GPU machine, from the repository root (carry .whl as for
# run_gpu_machine.sh, whose stages these are):
#     bash tests/gpu/serve_stage.sh                    build serve bench-serve soak: about 10 minutes with SOAK_MIN=5
#     bash tests/gpu/serve_stage.sh build serve bench-serve          about 4-5 minutes (one device command)
#     SOAK_MIN=5 bash tests/gpu/serve_stage.sh soak                  about 6 minutes
#     SOAK_MIN=10 bash tests/gpu/serve_stage.sh soak-bg   then, >= 11 minutes later, on the still-held machine:
#     bash tests/gpu/serve_stage.sh soak-log                         (the issue's 10 minutes; a command lasts <= 10)
# Stages:
#   serve        tests/gpu/test_serve_gpu.py (concurrent greedy requests through batched CUDA graphs = alone), and on
#                this CPU (AMX): tests/test_batch_invariance.py (a row's numbers whatever its batch: the router, the
#                native experts per quant, the demo model) and the scheduler's unit tests              (~1 minute)
#   bench-serve  python -m ktinject.bench serve: Qwen3-30B-A3B shapes, 16 of 48 layers, bf16 and int4, 1/4/8/16
#                streams; the table, then "N s in all"                                                  (~3 minutes)
#   soak         tests/gpu/soak_serve.py for $SOAK_MIN minutes (default 5): 16 streams, $SOAK_DISCONNECTS (default
#                100) clients gone mid-stream, the demo model on CUDA with graphs ($SOAK_ARGS adds options, e.g.
#                "--bench-layers 8 --quant int4"); ends with its checks and "soak PASSED" or "soak FAILED"
#   soak-bg      the same, detached, $SOAK_MIN default 10, logging to /tmp/ktinject-soak.log; soak-log copies that
#                log to $OUT and prints its end
# Logs: $OUT/<stage>.log; a summary line per stage last.
[ $# -eq 0 ] && set -- build serve bench-serve soak
exec bash "$(dirname "$0")/run_gpu_machine.sh" "$@"
