"""Speculative decoding over a pipeline-sharded target (`mx.distributed`: ring, JACCL or MPI).

The target's decoder layers are split across the ranks of a group; each rank holds only its
layers' weights. The stages form a ring, and rank 0 sits at both ends of it:

    rank 0: embedding, layers [0, k0) ... (ring) ... final norm, head, drafter, draft-verify loop
    rank r: layers [k_{r-1}, k_r), nothing else

Rank 0 runs the unchanged engine over a `ShardedTarget` (a `target.Target`); the other ranks
run `Stage.follow()`, a small loop that never sees tokens. Before each forward rank 0 sends a
control word (`link.Control`) with the shape of the hidden state that follows and its position
(rows its cache held): a rank whose cache is longer drops the rejected rows first, so
acceptance and rollback are decided once, on rank 0. docs/distributed.md gives the reasons,
the message pattern and the faults.

Modules: `plan` (the split, and the check that every rank loads the same thing), `link`
(connecting, the control word, bounded sends and receives), `watchdog` (the child process that
bounds them), `stages` (rank 0's target, the followers' loop), `shard` (loading a rank's share
of the weights: `keep_only_stage` empties, in the model object, the weights the rank does not
run). Views and rollbacks come from `dflash2_mlx.model.views`, as for the single process.
"""

from ..lazy import exports

# Public names, imported on first use (PEP 562): `python -m dflash2_mlx.distributed.watchdog`
# imports this package and must start without MLX.
_EXPORTS = {
    "PipelineError": "link", "Link": "link", "Control": "link", "init_group": "link",
    "availability": "link", "DEFAULT_TIMEOUT": "link", "FORWARD": "link", "CLONE": "link",
    "FREE": "link", "STOP": "link",
    "StagePlan": "plan", "parse_split": "plan", "plan_stages": "plan",
    "target_shape": "plan", "check_same_everywhere": "plan",
    "Stage": "stages", "ShardedTarget": "stages", "Follower": "stages",
    "FollowerTarget": "stages", "StageCache": "stages", "follow_unless_leader": "stages",
    "prepare": "shard", "build": "shard", "keep_only_stage": "shard", "check_family": "shard",
    "FAMILIES": "shard",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS, globals())
