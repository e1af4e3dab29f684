#!/usr/bin/env bash
# Build the native sources of one or more trees as shared objects and run pool_noise.c on them (interleaved A/B of
# pool variants, quiet and with background copy processes). Not a test. Usage:
#   bash native/tests/probes/pool_noise.sh "OPTIONS" [TREE[:CFLAGS]...]   (TREE: a directory holding native/,
#   default .; CFLAGS: extra compiler flags of that build, e.g. .:-DKTKI_CHUNK_YIELD_US=100)
# e.g.  bash native/tests/probes/pool_noise.sh "-t 15 -n 1 -r 5" /tmp/old .
set -eu
opts=$1; shift || true
trees=("$@"); [ ${#trees[@]} -gt 0 ] || trees=(.)
d=${POOL_NOISE_DIR:-/tmp/pool_noise.d}; mkdir -p "$d"
libs=()
for tf in "${trees[@]}"; do
  t=${tf%%:*}; flags=""; [ "$t" = "$tf" ] || flags=${tf#*:}
  name=$(cd "$t" && pwd | tr / _)$(echo "$flags" | tr -c 'A-Za-z0-9_=\n' _)
  # shellcheck disable=SC2086
  gcc -std=c11 -O2 -fPIC -shared -Wl,-Bsymbolic -pthread $flags -I"$t/native/include" -I"$t/native/src" \
      $(find "$t/native/src" -name '*.c') -o "$d/lib$name.so" -lm
  libs+=("$d/lib$name.so")
done
gcc -std=c11 -O2 -pthread -Inative/include native/tests/probes/pool_noise.c -o "$d/pool_noise" -ldl
# shellcheck disable=SC2086
exec "$d/pool_noise" $opts "${libs[@]}"
