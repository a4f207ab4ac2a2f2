"""One draft-verify cycle over a pipeline-sharded target against the single process.

    python benchmarks/pipeline_cycle.py [--model M --draft D] [--widths 1,2,4,8] [--reps 12]

Runs the single process here, then itself under `mlx.launch --backend ring -n 2` on loopback
(`--rank` mode), and reports per width w (w = 1: plain decoding, no drafter pass):
ms per cycle, split by stage (drafter on rank 0; rank 0's layers and send; rank 1's layers;
waiting and transfer; rank 0's head), and messages and bytes per cycle on each boundary.
A cycle here is one drafter pass (w > 1) plus one verify forward of w rows after a
`--context`-token prompt, rolled back each time (like `calibration.measure_costs`).
Writes `pipeline_cycle.json` in the current folder (or `--out`) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dflash2_mlx  # noqa: E402
import mlx.core as mx  # noqa: E402

from dflash2_mlx.model.sampling import Sampling  # noqa: E402


def setup(pipe, context: int):
    """A `context`-token prompt through the target: (cache, drafter cache, features, anchor)."""
    target, drafter = pipe.adapter, pipe.drafter
    ids = mx.array([[(17 * i + 3) % target.vocab_size for i in range(context)]], mx.uint32)
    cache, dcache = target.make_cache(), drafter.make_cache()
    _, feats = target.forward(ids, cache)
    mx.eval(feats, [c.state for c in cache])
    return cache, dcache, feats, ids[:, -1:]


def measure(pipe, state, w: int, reps: int) -> dict:
    """Median ms of the drafter pass and of the verify forward of w rows (rolled back)."""
    target, drafter = pipe.adapter, pipe.drafter
    cache, dcache, feats, anchor = state
    draft, verify = [], []
    for rep in range(reps):
        t0 = time.perf_counter()
        if w > 1:
            p = drafter.propose(target, anchor, feats[:, :0], dcache, w, Sampling(),
                                mx.random.key(rep))
            mx.eval(p.tokens)
        t1 = time.perf_counter()
        snap = target.snapshot(cache)
        mx.eval(target.forward(mx.repeat(anchor, w, axis=1), cache))
        t2 = time.perf_counter()
        snap.rollback(1, w)
        draft.append(t1 - t0)
        verify.append(t2 - t1)
    return {"draft_ms": 1e3 * statistics.median(draft),
            "verify_ms": 1e3 * statistics.median(verify),
            "verify_mean_ms": 1e3 * statistics.mean(verify), "reps": reps}


def time_cycles(pipe, widths, reps: int, context: int) -> dict:
    state = setup(pipe, context)
    for w in widths:                                   # warm up every width first
        measure(pipe, state, w, 1)
    return {w: measure(pipe, state, w, reps) for w in widths}


def rank_main(args) -> None:
    """Rank 0 measures each width, then stops rank 1's loop so both can exchange figures."""
    from dflash2_mlx.distributed import STOP, Control, init_group

    group = init_group(60)
    pipe = dflash2_mlx.load(args.model, args.draft, pipeline=group,
                            pipeline_split=args.split)
    stage, link = pipe.stage, pipe.stage.link

    def phase(run):
        link.sent.clear()
        link.seconds.clear()
        if stage.leader:
            stage.target.forwards = 0
            result = run()
            link.send_control(Control(STOP), 1, "pausing rank 1")
            mine = [stage.target.forwards, 0]
        else:
            stage.follower.forwards, stage.follower.compute_s = 0, 0.0
            stage.follow()
            result, mine = None, [stage.follower.forwards, int(1e6 * stage.follower.compute_s)]
        sent = {f"{d}/{k}": v for (d, k), v in link.sent.items()}
        mine += [int(1e6 * link.seconds.get("send hidden", 0)),
                 int(1e6 * link.seconds.get("recv hidden", 0)),
                 sent.get("1/control", [0, 0])[0] + sent.get("1/hidden", [0, 0])[0],
                 sent.get("1/control", [0, 0])[1] + sent.get("1/hidden", [0, 0])[1],
                 sent.get("0/hidden", [0, 0])[0], sent.get("0/hidden", [0, 0])[1],
                 int(1e6 * link.seconds.get("send control", 0))]
        return result, link.agree(mine, "exchanging the figures").tolist()

    state = None

    def warm():
        nonlocal state
        state = setup(pipe, args.context)
        for w in args.widths:
            measure(pipe, state, w, 1)

    phase(warm if stage.leader else None)
    rows = {}
    for w in args.widths:
        result, (r0, r1) = phase((lambda w=w: measure(pipe, state, w, args.reps))
                                 if stage.leader else None)
        if stage.leader:
            n = r0[0]
            rows[w] = {**result, "forwards": n, "rank0_layers_ms": r0[2] / 1e3 / n,
                       "rank1_layers_ms": r1[1] / 1e3 / n, "wait_ms": (r0[3] - r1[1]) / 1e3 / n,
                       "msgs_0to1": r0[4] / n, "bytes_0to1": r0[5] / n,
                       "msgs_1to0": r1[6] / n, "bytes_1to0": r1[7] / n,
                       "control_ms": r0[8] / 1e3 / n}
    if stage.leader:
        stage.target.close()
        Path(args.rank_out).write_text(json.dumps({"rows": rows,
                                                   "weight_mib": stage.weight_mib}))


# --------------------------------------------------------------------------- cost model
# Assumptions, all parameters (docs/distributed.md says where they come from): a Mac's memory
# bandwidth bounds a forward of few rows (each weight byte read once per forward, stages run
# one after another for one sequence); a verify of w rows costs VERIFY[w] x one row; link
# latency per message and bandwidth; bf16 activations.
LINKS = {"Thunderbolt 5, ring (TCP)": (100e-6, 6e9), "Thunderbolt 5, JACCL (RDMA)": (10e-6, 8e9),
         "10 GbE, ring (TCP)": (150e-6, 1.1e9)}
TARGETS = {   # weight bytes, H, layers, drafter feature layers, drafter pass seconds
    "27B dense, 4-bit": (15e9, 5120, 64, (5, 19, 33, 47, 61), 2.5e-3),
    "235B dense, 4-bit": (125e9, 12288, 96, (2, 25, 48, 71, 94), 5e-3),
}
MEMORY_BW = 800e9                   # bytes/s (M3 Ultra class)
VERIFY = {1: 1.0, 4: 1.05, 8: 1.15, 16: 1.3}
TAU = {4: 3.0, 8: 4.0, 16: 5.5}     # DFlash 2-class acceptance (the published figures)


def network_s(w: int, n: int, hidden: int, layers: int, feats, latency: float, bw: float,
              act_bytes: int = 2) -> float:
    """Seconds of one forward's messages on the ring: n hidden-state hops (rank r carries the
    features of ranks 1..r); the control words travel ahead and hide behind compute."""
    bounds = [(r * layers // n, (r + 1) * layers // n) for r in range(n)]
    total = 0.0
    for r in range(n):
        carried = [i for i in feats if bounds[0][1] <= i < bounds[r][1]] if r else []
        total += latency + w * hidden * act_bytes * (1 + len(carried)) / bw
    return total


def cost_model() -> str:
    lines = ["| target | Macs | link | plain ms/token | network ms/forward | w=8: ms/cycle, "
             "speedup | w=16: ms/cycle, speedup |", "|" + "---|" * 7]
    for name, (weights, hidden, layers, feats, draft_s) in TARGETS.items():
        compute = weights / MEMORY_BW
        for n in (2, 4):
            for link, (lat, bw) in LINKS.items():
                net = lambda w: network_s(w, n, hidden, layers, feats, lat, bw)  # noqa: E731
                plain = compute + net(1)
                cells = []
                for w in (8, 16):
                    cycle = draft_s + VERIFY[w] * compute + net(w)
                    cells.append(f"{1e3 * cycle:.1f}, {TAU[w] * plain / cycle:.2f}x")
                lines.append(f"| {name} | {n} | {link} | {1e3 * plain:.1f} | "
                             f"{1e3 * net(1):.2f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def markdown(single: dict, sharded: dict, meta: dict) -> str:
    lines = ["ms/cycle: medians; the stage columns: means over the same forwards.", "",
             "| w | 1 process ms/cycle | 2 ranks ms/cycle | drafter | rank 0 layers+send | "
             "control word | rank 1 layers | wait+transfer | head and rest | "
             "msgs 0->1 / 1->0 per cycle | bytes 0->1 / 1->0 per cycle |", "|" + "---|" * 11]
    for w, s in single.items():
        d = sharded[str(w)] if str(w) in sharded else sharded[w]
        one = s["draft_ms"] * (w > 1) + s["verify_ms"]
        two = d["draft_ms"] * (w > 1) + d["verify_ms"]
        # the stage figures are means over the forwards: the rest is taken from the mean too
        rest = (d["verify_mean_ms"] - d["rank0_layers_ms"] - d["wait_ms"]
                - d["rank1_layers_ms"] - d["control_ms"])
        lines.append(
            f"| {w} | {one:.1f} | {two:.1f} | {d['draft_ms'] * (w > 1):.1f} | "
            f"{d['rank0_layers_ms']:.1f} | {d['control_ms']:.1f} | "
            f"{d['rank1_layers_ms']:.1f} | {d['wait_ms']:.1f} | "
            f"{rest:.1f} | {d['msgs_0to1']:.0f} / {d['msgs_1to0']:.0f} | "
            f"{d['bytes_0to1']:.0f} / {d['bytes_1to0']:.0f} |")
    lines.append("")
    lines.append(f"Weights per rank: {meta['weight_mib']} MiB; load average before / after: "
                 f"{meta['load_before']} / {meta['load_after']} ({os.cpu_count()} cores).")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--split")
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("pipeline_cycle.json"))
    ap.add_argument("--hostfile", help="run the ranks on these hosts (mlx.launch --hostfile) "
                    "instead of two on loopback")
    ap.add_argument("--cost-model", action="store_true",
                    help="print the cost-model table (docs/distributed.md) and exit")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.widths = [int(w) for w in str(args.widths).split(",")]
    if args.rank:
        return rank_main(args)
    if args.cost_model:
        return print(cost_model())

    load_before = [round(x, 1) for x in os.getloadavg()]
    single = time_cycles(dflash2_mlx.load(args.model, args.draft), args.widths, args.reps,
                         args.context)
    rank_out = args.out.with_suffix(".ranks.json")
    where = ["--hostfile", args.hostfile] if args.hostfile else ["-n", "2"]
    cmd = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", *where,
           "--env", f"PYTHONPATH={ROOT}", "--python", sys.executable, __file__, "--rank",
           "--rank-out", str(rank_out), "--widths", ",".join(map(str, args.widths)),
           "--reps", str(args.reps), "--context", str(args.context)]
    # the ranks run like this process
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "DFLASH2_BLAS", "DFLASH2_CACHE"):
        if var in os.environ:
            cmd[1:1] = ["--env", f"{var}={os.environ[var]}"]
    for flag in ("model", "draft", "split"):
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    subprocess.run(cmd, check=True)
    sharded = json.loads(rank_out.read_text())
    rank_out.unlink()
    meta = {"weight_mib": sharded["weight_mib"], "load_before": load_before,
            "load_after": [round(x, 1) for x in os.getloadavg()], "model": args.model,
            "draft": args.draft, "context": args.context, "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"single": single, "two_ranks": sharded["rows"],
                                    "meta": meta}, indent=1) + "\n")
    print(markdown(single, sharded["rows"], meta))


if __name__ == "__main__":
    dflash2_mlx.use_fast_blas()      # MLX's float32 matmuls on MKL / OpenBLAS (Linux)
    main()
