#!/usr/bin/env bash
set -u
M=/tmp/m; PY=/work/main/.venv/bin/python; W=/work/main/.venv/bin/dflash2-mlx; USER_CACHE=$HOME/.cache/dflash2-mlx
fresh() { rm -rf "$1"; mkdir -p "$1"; ln -s "$USER_CACHE/smollm2" "$1/smollm2"; [ -n "${2:-}" ] && cp "$2" "$1/calibration.json"; true; }
(cd /tmp/r4 && PYTHONPATH=/tmp/r4 $PY benchmarks/calibration_load.py --rounds 3 --settle --cache $M/r4/busy > $M/r4/calibration_load_busy.txt 2>&1)
for s in long-edit-2k long-agent-2k long-log-2k long-quote-2k; do
  fresh $M/cache-run $M/r4/busy/calibration.json
  (cd /tmp/r4 && DFLASH2_CACHE=$M/cache-run PYTHONPATH=/tmp/r4 $W bench --prompt-sets $s --prompts 2 \
     --block-sizes auto --temperatures 0 --max-tokens 64 --no-reference --out $M/r4/$s-busy > $M/r4/$s.log 2>&1)
done
touch $M/r4/done
