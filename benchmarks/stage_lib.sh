# Sourced by benchmarks/prefill_stage.sh, peer_stage.sh and ab_*.sh (from the repository root on a GPU machine): the
# set-up they share. stage_setup: $OUT (default /tmp/ktinject-out), this tree built (run_gpu_machine.sh build: pip
# -e, and the wheels of a ./.whl folder, where there is one, installed into /tmp/site), the usual environment;
# stage_base COMMIT: COMMIT built in place in a worktree at /tmp/base; steal: the host's steal time from /proc/stat.
stage_setup() {
  OUT=${OUT:-/tmp/ktinject-out}; mkdir -p "$OUT"
  bash benchmarks/run_gpu_machine.sh build > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
  grep -q "^build rc=0" "$OUT/setup.log" || { tail -30 "$OUT/setup.log"; exit 1; }
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  [ -d .whl ] && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  return 0
}
stage_base() {
  rm -rf /tmp/base; git worktree prune
  git worktree add -f /tmp/base "$1" > /dev/null 2>&1 || { echo "no worktree of $1"; exit 1; }
  local build=ktinject/native/build.py; [ -f /tmp/base/$build ] || build=ktinject/_build.py  # (before the native/ package)
  (cd /tmp/base && PYTHONPATH=/tmp/site python3 $build > "$OUT/base-build.log" 2>&1) \
    || { tail -20 "$OUT/base-build.log"; exit 1; }
}
steal() { awk '/^cpu /{printf "steal %d of %d jiffies", $9, $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat; }
