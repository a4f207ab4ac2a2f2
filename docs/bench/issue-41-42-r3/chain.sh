#!/usr/bin/env bash
# Issue 41/42 closing measurements; each step skipped when its output exists (resumable).
set -u
M=/tmp/m; PY=/work/main/.venv/bin/python; W=/work/main/.venv/bin/dflash2-mlx
USER_CACHE=$HOME/.cache/dflash2-mlx
fresh() {  # fresh cache dir $1 with the target linked and calibration $2 (optional) copied in
  rm -rf "$1"; mkdir -p "$1"; ln -s "$USER_CACHE/smollm2" "$1/smollm2"
  [ -n "${2:-}" ] && cp "$2" "$1/calibration.json"; true
}
bench() {  # code dir, calibration file, sets, prompts, tokens, out
  [ -f "$6/bench.md" ] && return
  fresh $M/cache-run "$2"
  (cd "$1" && DFLASH2_CACHE=$M/cache-run PYTHONPATH="$1" $W bench --prompt-sets "$3" --prompts "$4" \
     --block-sizes auto --temperatures 0 --max-tokens "$5" --no-reference --out "$6" > "$6.log" 2>&1)
}
# 1. busy calibration (final), the generate.py prompts, settled for later runs
if [ ! -f $M/calibration_load_busy.txt ]; then
  rm -rf $M/busy
  (cd /tmp/final && PYTHONPATH=/tmp/final $PY benchmarks/calibration_load.py --rounds 3 --settle --cache $M/busy > $M/calibration_load_busy.tmp 2>&1) && mv $M/calibration_load_busy.tmp $M/calibration_load_busy.txt
  cp $M/busy/calibration.json $M/busy-calibration.json
fi
# 2. long 2k sets from the busy calibration (final)
for s in long-edit-2k long-log-2k long-agent-2k long-quote-2k; do
  bench /tmp/final $M/busy-calibration.json $s 2 64 $M/$s-busy-final
done
# 3. quiet calibration (final), the generate.py prompts
if [ ! -f $M/calibration_load_quiet.txt ]; then
  (cd /tmp/final && PYTHONPATH=/tmp/final $PY benchmarks/calibration_load.py --rounds 3 --quiet --cache $M/quiet > $M/calibration_load_quiet.tmp 2>&1) && mv $M/calibration_load_quiet.tmp $M/calibration_load_quiet.txt
  cp $M/quiet/calibration.json $M/quiet-final.json
fi
# 4. before 42 (7263739) takes its own quiet calibration
if [ ! -f $M/quiet-before42.json ]; then
  fresh $M/cache-run
  (cd /tmp/before42 && DFLASH2_CACHE=$M/cache-run PYTHONPATH=/tmp/before42 $W generate --prompt "Hello" --max-tokens 8 > $M/before42-calibrate.log 2>&1)
  cp $M/cache-run/calibration.json $M/quiet-before42.json
fi
# 5. quiet side by side, two rounds, order alternated: short sets (final, bc04a4c, 7263739), long sets (final, 7263739)
for r in 1 2; do
  for s in humaneval agent chat; do
    if [ $r = 1 ]; then order="final base41 before42"; else order="before42 base41 final"; fi
    for c in $order; do
      cal=$M/quiet-final.json; [ $c = before42 ] && cal=$M/quiet-before42.json
      bench /tmp/$c $cal $s 4 96 $M/$s-quiet-$c-r$r
    done
  done
  for s in long-edit-2k long-log-2k long-agent-2k long-quote-2k; do
    if [ $r = 1 ]; then order="final before42"; else order="before42 final"; fi
    for c in $order; do
      cal=$M/quiet-final.json; [ $c = before42 ] && cal=$M/quiet-before42.json
      bench /tmp/$c $cal $s 2 64 $M/$s-quiet-$c-r$r
    done
  done
done
touch $M/chain.done
