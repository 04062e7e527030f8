#!/usr/bin/env bash
# Host instructions per engine step, this tree against an older one, counted by valgrind's callgrind
# (two runs of the same code agree within about 1% per step, where wall time on this VM moves 1.4x;
# the hash seed is fixed, memory addresses and threads still vary): the engine alone on the zero-cost model,
# fed in cohorts and staggered (bench.step_instructions), minus each tree's start-up and warm-up.
#   mkdir .baseline && git archive REV | tar -x -C .baseline
#   bash bench/step_instructions_ab.sh .baseline [REQUESTS]     # ~15 min on 2 cores (apt: valgrind)
# ASYNC=on counts overlapped steps (--async-scheduling on; an older tree needs this tree's
# bench/step_instructions.py copied in).
set -uo pipefail
BASE=$(cd "${1:?an older tree}" && pwd); HERE=$(pwd); N=${2:-1500}
PY=${PY:-$HERE/.venv/bin/python}
OUT=$(mktemp -d)
count() {  # tree feed requests -> "instructions steps"
  local tree=$1 feed=$2 n=$3 log="$OUT/$(basename "$1").$2.$3"
  (cd "$tree" && PYTHONHASHSEED=0 PYTHONPATH="$tree" valgrind --tool=callgrind --callgrind-out-file=/dev/null \
    "$PY" -m bench.step_instructions "$feed" "$n" --async-scheduling "${ASYNC:-off}" > "$log" 2>&1)
  echo "$(grep 'I   refs' "$log" | awk '{gsub(",", "", $NF); print $NF}') $(grep '^steps' "$log" | awk '{print $2}')"
}
for feed in zero cohorts staggered; do
  n=$N; f=$feed; [ $feed = zero ] && n=0 f=cohorts
  count "$BASE" $f $n > "$OUT/base.$feed" & count "$HERE" $f $n > "$OUT/here.$feed" & wait
done
for side in base here; do
  read z _ < "$OUT/$side.zero"
  for feed in cohorts staggered; do
    read i s < "$OUT/$side.$feed"
    echo "$side $feed $(( (i - z) / s )) instructions per step ($s steps)"
  done
done
rm -rf "$OUT"
