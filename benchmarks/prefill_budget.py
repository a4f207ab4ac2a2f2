"""The scheduler's one-second prefill bound against fixed 2,048-token chunks, side by side in one
process: a lone 4,000-token prompt of the embedded model prefilled by `Engine.step` with
each budget, alternating for two rounds.

    python benchmarks/prefill_budget.py
"""
import time
import dflash2_mlx  # first: it picks the BLAS before MLX loads
from dflash2_mlx.decode.sampling import Sampling
from dflash2_mlx.server.scheduler import Scheduler
pipe = dflash2_mlx.load()
text = open('dflash2_mlx/batch.py').read() * 2
ids = pipe.encode(text, chat_template=False)[:4000]
sched = Scheduler(pipe, max_batch=4)
def run(bounded):
    eng = pipe.batch_engine(4)
    pipe.add_to_batch(eng, ids, 1, Sampling(0.0, 1.0, 0), 1, pipe.batch_correction(), lookup=False, stop_ids=pipe.stop_ids(), seed=0)
    tic = time.perf_counter(); steps = 0
    while eng.waiting or eng.running:
        b = sched.prefill_budget(eng.running, eng.waiting, pipe.prefill_step_size, eng.last_prefill if bounded else None)
        eng.step(prefill_budget=b); steps += 1
    return time.perf_counter() - tic, steps
for r in range(2):
    for bounded in (False, True):
        s, n = run(bounded)
        print(f"round {r} {'1-s bound (new)' if bounded else '2048 chunks (old)'}: {len(ids)} tokens in {s:.1f} s, {n} steps", flush=True)
