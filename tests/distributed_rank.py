"""One rank of a pipeline test, run by `mlx.launch` (tests/test_distributed.py writes the plan).

    mlx.launch --backend ring -n 2 --python PY tests/distributed_rank.py PLAN.json

Each job loads a target (and drafter) with `pipeline=` the launched group; rank 0 runs the
job's cases and writes tokens, statistics and message counts; the other ranks follow. Every
rank writes `rank{r}.json` beside the plan. A case may carry the single-process greedy output
(`truth`): rank 0 then drafts with `OracleDrafter`, which proposes it corrupted at random
positions, so partial acceptances (rollbacks on every rank) are certain. A job's "kv" holds
`load`'s kv_bits and kv_group_size; each rank reports its layers' cache types ("caches")."""

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import dflash2_mlx  # noqa: E402

dflash2_mlx.use_fast_blas()      # before MLX loads: it binds to that BLAS as it loads
import mlx.core as mx  # noqa: E402

from dflash2_mlx.distributed import PipelineError, init_group  # noqa: E402


def counts(link) -> dict:
    return {f"{dst}/{kind}": list(v) for (dst, kind), v in link.sent.items()}


def delta(after: dict, before: dict) -> dict:
    return {k: [a - b for a, b in zip(v, before.get(k, [0, 0]))] for k, v in after.items()}


def run_case(pipe, case: dict) -> dict:
    from test_exactness import OracleDrafter

    target = pipe.adapter
    real = pipe.drafter
    if case.get("truth") is not None:
        pipe.drafter = OracleDrafter(len(case["prompt"]), case["truth"], target.vocab_size,
                                     seed=case.get("oracle_seed", 0))
    before, forwards = counts(target.link), target.forwards
    try:
        gen = pipe.generate(case["prompt"], max_tokens=case["max_tokens"],
                            block_size=case.get("block_size"), lookup=case.get("lookup", False),
                            temperature=case.get("temperature", 0.0), seed=case.get("seed"))
    finally:
        pipe.drafter = real
    return {"tokens": gen.tokens, "stats": gen.stats.to_dict(),
            "sent": delta(counts(target.link), before), "forwards": target.forwards - forwards}


def run_batch(pipe, batch: dict) -> dict:
    """The prompts of `batch` at once on rank 0's batch engine (`generate_batch`)."""
    target = pipe.adapter
    before, forwards = counts(target.link), target.forwards
    gens = pipe.generate_batch(batch["prompts"], max_tokens=batch["max_tokens"],
                               block_size=batch.get("block_size"), lookup=batch.get("lookup"),
                               max_batch=batch.get("max_batch"),
                               prefill_budget=batch.get("prefill_budget"))
    return {"tokens": [g.tokens for g in gens], "forwards": target.forwards - forwards,
            "cycles": sum(len(g.stats.steps) for g in gens),
            "sent": delta(counts(target.link), before)}


def main(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    out = Path(plan_path).parent
    group = init_group(plan.get("timeout", 30))
    rank = group.rank()
    report = {"rank": rank, "jobs": []}
    try:
        for job in plan["jobs"]:
            draft = job.get("draft_by_rank", {}).get(str(rank), job.get("draft"))
            pipe = dflash2_mlx.load(job["model"], draft, pipeline=group,
                                    pipeline_split=job.get("split"),
                                    pipeline_timeout=plan.get("timeout", 30), **job.get("kv", {}))
            stage = pipe.stage
            done = {"name": job["name"], "layers": list(stage.layers),
                    "weight_mib": stage.weight_mib, "active_mib": mx.get_active_memory() / 2**20}
            ours = (stage.target if stage.leader else stage.follower).range.make_cache()
            done["caches"] = [[type(c).__name__, getattr(c, "bits", None),
                               getattr(c, "group_size", None)] for c in ours]
            die = job.get("die")
            if stage.leader:
                done["cases"] = [run_case(pipe, case) for case in job["cases"]]
                done["batches"] = [run_batch(pipe, b) for b in job.get("batches", [])]
                stage.close()
            else:
                if die and die["rank"] == rank:
                    follower, forward = stage.follower, stage.follower._forward
                    def dying(*args, _n=[0]):
                        _n[0] += 1
                        if _n[0] > die["after_forwards"]:
                            os._exit(17)           # a rank that dies mid-generation
                        return forward(*args)
                    follower._forward = dying
                stage.follow()
                done["forwards"] = stage.follower.forwards
            done["sent"] = counts(stage.link)
            report["jobs"].append(done)
    except PipelineError as e:
        report["error"] = str(e)
        print(f"dflash2-mlx: error{'' if rank == 0 else f' (rank {rank})'}: {e}",
              file=sys.stderr, flush=True)
        return 1
    except Exception as e:   # noqa: BLE001 - e.g. the oracle's check: output diverged
        report["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
        raise
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
