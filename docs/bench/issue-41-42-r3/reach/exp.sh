#!/usr/bin/env bash
# exp4 = a worktree of final with `4 * tried` in AdaptiveWidth.alphas (reach 4); final = reach 2; outputs renamed reach4/reach2 here
set -u
M=/tmp/m; PY=/work/main/.venv/bin/python; W=/work/main/.venv/bin/dflash2-mlx; USER_CACHE=$HOME/.cache/dflash2-mlx
fresh() { rm -rf "$1"; mkdir -p "$1"; ln -s "$USER_CACHE/smollm2" "$1/smollm2"; [ -n "${2:-}" ] && cp "$2" "$1/calibration.json"; true; }
bench() {
  [ -f "$6/bench.md" ] && return
  fresh $M/cache-run "$2"
  (cd "$1" && DFLASH2_CACHE=$M/cache-run PYTHONPATH="$1" $W bench --prompt-sets "$3" --prompts "$4" \
     --block-sizes auto --temperatures 0 --max-tokens "$5" --no-reference --out "$6" > "$6.log" 2>&1)
}
for r in 1 2; do
  for s in long-edit-2k long-agent-2k; do
    if [ $r = 1 ]; then order="exp4 final"; else order="final exp4"; fi
    for c in $order; do bench /tmp/$c $M/quiet-final.json $s 2 64 $M/exp/$s-$c-r$r; done
  done
done
if [ ! -f $M/exp/calibration_load_quiet_exp4.txt ]; then
 (cd /tmp/exp4 && PYTHONPATH=/tmp/exp4 $PY benchmarks/calibration_load.py --rounds 3 --quiet --trace --cache $M/exp/q4 > $M/exp/cl.tmp 2>&1) && mv $M/exp/cl.tmp $M/exp/calibration_load_quiet_exp4.txt
fi
for r in 1 2; do
  if [ $r = 1 ]; then order="exp4 final"; else order="final exp4"; fi
  for c in $order; do bench /tmp/$c $M/quiet-final.json long-quote-2k 2 64 $M/exp/long-quote-2k-$c-r$r; done
done
touch $M/exp/done2
