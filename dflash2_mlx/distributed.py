"""Speculative decoding over a pipeline-sharded target (`mx.distributed`: ring, JACCL or MPI).

The target's decoder layers are split across the ranks of a group; each rank holds only its
layers' weights. The stages form a ring, and rank 0 sits at both ends of it:

    rank 0: embedding, layers [0, k0) ... (ring) ... final norm, head, drafter, draft-verify loop
    rank r: layers [k_{r-1}, k_r), nothing else

Why rank 0 at both ends: the drafter needs the target's embedding (its block input) AND its head
(its output), so the rank that runs it holds both, loaded once (one matrix when they are tied);
the drafts are made where the next verify embeds them (no draft message); the rank that decides
acceptance is the one that writes the text; and the ring backend links rank N-1 to rank 0
directly. Rank 0 runs the unchanged engine over a `ShardedTarget`; the other ranks run
`Stage.follow()`, a small loop that never sees tokens.

Messages per target forward of T rows (one forward per draft-verify cycle, whatever its width):

    r -> r+1 (r < N-1)   control  int32 [8]                           32 bytes
                         hidden   [1, T, H * (1 + f_r)]               T * H * (1 + f_r) * bytes
    N-1 -> 0             hidden   [1, T, H * (1 + f)]

f_r counts the drafter's feature layers (`target_layer_ids`) owned by ranks 1..r: each stage
appends the features it captured to the hidden state it passes on, so they reach rank 0 in the
stage's own message. The control word carries the shape of the hidden state that follows and
rank 0's position (rows its cache held before this forward): the one small broadcast of what
rank 0 decided after the previous verify. A rank whose cache is longer drops the rejected rows
before it runs (attention caches trim; recurrent layers restore their snapshot and replay the
kept rows), so acceptance, rollback and the next anchor are decided once, on rank 0.

We never patch mlx-lm classes nor the model: each rank runs its layer range through a shallow
view of the model (as `target.TargetAdapter` does), whose decoder stack holds only that range
plus a stand-in at the end (rank 0: one that sends the hidden state round the ring and returns
what comes back; others: one that stops the forward and hands the hidden state out).
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import json
import os
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from .target import LayerTap, TargetAdapter, find_stack_path

# Decoder stacks whose forward we know runs a layer range correctly: masks come from
# `cache[0]` or from the index attributes below, recomputed for the range. Keyed by the
# mlx-lm module (mistral loads as llama; GGUF targets are llama).
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_5", "qwen3_next")
INDEX_ATTRS = {                      # stack attribute -> which layers it must point at
    "fa_idx": lambda l: not getattr(l, "use_sliding", False) and not getattr(l, "is_linear",
                                                                               False),
    "swa_idx": lambda l: getattr(l, "use_sliding", False),
    "ssm_idx": lambda l: getattr(l, "is_linear", False),
}
FORWARD, CLONE, FREE, STOP = 1, 2, 3, 4
CONTROL = 8                          # int32 words: op, cache, B, T, position, dtype, source, 0
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
DEFAULT_TIMEOUT = 60.0


class PipelineError(RuntimeError):
    """A rank died, hung, never connected, or was started on something else."""


# --------------------------------------------------------------------------- the split


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """'--pipeline-split 20,12' -> (20, 12); None -> None (even split)."""
    if text is None or text == "":
        return None
    try:
        parts = tuple(int(p) for p in str(text).split(","))
    except ValueError:
        raise ValueError(f"--pipeline-split {text!r}: expected layer counts per rank, "
                         "comma-separated, e.g. 20,12") from None
    return parts


def plan_stages(num_layers: int, size: int, split: tuple[int, ...] | None = None
                ) -> list[tuple[int, int]]:
    """[(start, end)] layer range of each rank; even by default (the low ranks get the extra
    layers). A split that does not fit (wrong count, a rank without layers, a sum other than
    the model's layer count) raises ValueError before anything loads."""
    if size > num_layers:
        raise ValueError(f"--pipeline: {size} ranks for a target of {num_layers} layers; each "
                         "rank needs at least one layer (use fewer hosts)")
    if split is None:
        base, extra = divmod(num_layers, size)
        split = tuple(base + (r < extra) for r in range(size))
    if len(split) != size or any(s < 1 for s in split) or sum(split) != num_layers:
        raise ValueError(f"--pipeline-split {','.join(map(str, split))}: expected {size} "
                         f"positive layer counts (one per rank) summing to the target's "
                         f"{num_layers} layers")
    bounds, start = [], 0
    for s in split:
        bounds.append((start, start + s))
        start += s
    return bounds


def target_shape(path: Path) -> tuple[int, int]:
    """(decoder layers, hidden size) of a target, from its config (mlx-lm folder) or metadata
    (GGUF), without reading any weight."""
    if path.suffix == ".gguf":
        meta = read_gguf_header(path)
        arch = meta.get("general.architecture")
        keys = (f"{arch}.block_count", f"{arch}.embedding_length")
        missing = [k for k in keys if k not in meta]
        if missing:
            raise ValueError(f"{path}: GGUF metadata has no '{missing[0]}'")
        return int(meta[keys[0]]), int(meta[keys[1]])
    config = json.loads((path / "config.json").read_text())
    for cfg in (config, config.get("text_config") or {}):
        if "num_hidden_layers" in cfg and "hidden_size" in cfg:
            return int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    raise ValueError(f"{path / 'config.json'}: no num_hidden_layers / hidden_size")


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_header(path: Path) -> dict:
    """The scalar metadata of a GGUF file (arrays skipped), read without touching tensors."""
    import struct

    def read(fmt):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, f.read(size))[0]

    def string():
        return f.read(read("<Q")).decode("utf-8", "replace")

    def value(kind, keep=True):
        if kind == 8:
            return string()
        if kind == 9:
            inner, count = read("<I"), read("<Q")
            if inner in _GGUF_SCALARS:                # skip numeric arrays in one seek
                f.seek(count * struct.calcsize(_GGUF_SCALARS[inner]), 1)
            else:
                for _ in range(count):
                    value(inner, keep=False)
            return None
        return read(_GGUF_SCALARS[kind])

    meta = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        read("<I")
        read("<Q")
        for _ in range(read("<Q")):
            key = string()
            meta[key] = value(read("<I"))
    return meta


# --------------------------------------------------------------------------- watchdog


_WATCHDOG = r"""
import os, select, signal, sys, time
parent, term_fd, prefix, GRACE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
deadline, what, quiet, term_at = None, "", False, None
STOPPED = ("stopped: mlx.launch ends every rank when one exits with an error (the other "
           "rank's line says why)")

def end(line):
    if not quiet:
        sys.stderr.write(prefix + line + "\n")
        sys.stderr.flush()
    os.kill(parent, signal.SIGKILL)
    sys.exit(1)

while True:
    ends = [t for t in (deadline, term_at and term_at + GRACE) if t]
    wait = max(0.0, min(ends) - time.monotonic()) if ends else None
    ready, _, _ = select.select([sys.stdin] + ([term_fd] if term_at is None else []), [], [],
                                wait)
    if term_fd in ready:                  # SIGTERM: let the rank say why it stops, then end it
        os.read(term_fd, 64)
        term_at = time.monotonic()
    elif ready:
        line = sys.stdin.readline()
        if not line:
            sys.exit(0)                   # the rank ended: nothing to watch
        if line == "quiet\n":
            quiet = True
            continue
        seconds, _, what = line.rstrip("\n").partition(" ")
        deadline = None if seconds == "-" else time.monotonic() + float(seconds)
    elif term_at and time.monotonic() >= term_at + GRACE:
        end(STOPPED)
    elif deadline is not None and time.monotonic() >= deadline:
        end(what)
"""


class Watchdog:
    """Ends this rank with one error line when a distributed step outlasts its bound.

    A child process, because the blocking step may hold the GIL (`mx.distributed.init` does),
    so no thread of ours would run; arming and disarming are one pipe write each. It also
    takes over SIGTERM, which `mlx.launch` sends every rank as soon as one fails: the rank gets
    a moment to print its own line (a lost connection) before the watchdog ends it, so rank 0's
    reason is never cut off, and a rank that cannot answer still ends (`grace` seconds after
    SIGTERM: a server's graceful shutdown needs longer). `quiet()` (at exit): the rank has
    said what it had to say."""

    def __init__(self, prefix: str, grace: float = 2.0):
        import signal

        read, write = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()),
                                      str(read), prefix, str(grace)], stdin=subprocess.PIPE,
                                     text=True, env={}, pass_fds=(read,))
        os.close(read)
        os.set_blocking(write, False)
        try:       # the C-level handler writes the signal to `write` even while MLX blocks
            signal.signal(signal.SIGTERM, lambda signum, frame: None)
            signal.set_wakeup_fd(write)
        except ValueError:            # not the main thread: SIGTERM keeps its default
            os.close(write)
        atexit.register(self.quiet)

    def _write(self, line: str) -> None:
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def arm(self, seconds: float, what: str) -> None:
        self._write(f"{seconds} {what}\n")

    def disarm(self) -> None:
        self._write("- \n")

    def quiet(self) -> None:
        self._write("quiet\n")


_watchdog: Watchdog | None = None


def watchdog(rank: int | None = None, grace: float = 2.0) -> Watchdog:
    global _watchdog
    if _watchdog is None:
        who = "" if rank in (None, 0) else f" (rank {rank})"
        _watchdog = Watchdog(f"dflash2-mlx: error{who}: pipeline: ", grace)
    return _watchdog


def init_group(timeout: float = DEFAULT_TIMEOUT, backend: str = "any",
               grace: float = 2.0) -> mx.distributed.Group:
    """`mx.distributed.init` bounded by `timeout` (it waits forever for a rank that never
    connects). Outside mlx.launch: a group of one. grace: seconds a rank may take to stop
    after SIGTERM (see `Watchdog`)."""
    if not mx.distributed.is_available():
        raise PipelineError("--pipeline: this MLX build has no distributed backend")
    launched = any(k in os.environ for k in ("MLX_HOSTFILE", "MLX_RANK", "OMPI_COMM_WORLD_RANK",
                                             "PMI_RANK", "MLX_JACCL_DEVICES"))
    if not launched:
        return mx.distributed.init(strict=False)
    dog = watchdog(int(os.environ.get("MLX_RANK", 0)), grace)
    dog.arm(timeout, f"could not connect to all ranks within {timeout:g} s (a host is down, "
                     "unreachable, or was not started); stopping")
    group = mx.distributed.init(strict=True, backend=backend)
    dog.disarm()
    return group


def availability() -> str:
    """One line for `dflash2-mlx doctor`: whether `--pipeline` can run here, over which
    backend. Never starts a backend (that would wait for ranks that are not there)."""
    import ctypes.util
    import platform

    if not mx.distributed.is_available():
        return "not available (this MLX build has no distributed backend)"
    backends = ["ring (TCP; mlx.launch --backend ring)"]
    backends.append("mpi" + ("" if ctypes.util.find_library("mpi") else " (libmpi not found)"))
    backends.append("jaccl" + ("" if platform.system() == "Darwin"
                               else " (macOS with Thunderbolt 5 RDMA only)"))
    if "MLX_RANK" in os.environ:
        hostfile = os.environ.get("MLX_HOSTFILE")
        where = f"launched as rank {os.environ['MLX_RANK']}" + (
            f" (ring hostfile {hostfile})" if hostfile else "")
    else:
        where = "not launched (one process; run under mlx.launch for --pipeline)"
    return f"available: {', '.join(backends)}; {where}"


# --------------------------------------------------------------------------- messages


@dataclass
class Link:
    """This rank's sends and receives, each bounded by the watchdog, with the ring backend's
    errors turned into one line; counts messages and bytes sent (for tests and benchmarks)."""

    group: mx.distributed.Group
    timeout: float = DEFAULT_TIMEOUT
    # (destination rank, kind) -> [messages, bytes]; kinds: "control" and "hidden" (one each
    # per forward and boundary), "op" (a cache copied or dropped, "stop")
    sent: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)   # "send hidden", "recv hidden", ...: time
    broken: bool = False                          # a peer went away: nothing more to send

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def _run(self, what: str, fn, bounded: bool = True, timeout: float | None = None):
        dog, timeout = watchdog(self.rank), timeout or self.timeout
        if bounded:
            dog.arm(timeout, f"no answer within {timeout:g} s while {what} (a rank died or "
                             "hung); stopping")
        try:
            return fn()
        except RuntimeError as e:
            if "[ring]" in str(e) or "[mpi]" in str(e) or "[jaccl]" in str(e):
                self.broken = True
                raise PipelineError(f"pipeline: lost the connection to another rank while "
                                    f"{what} ({e}); a rank exited or its host went away") \
                    from None
            raise
        finally:
            if bounded:
                dog.disarm()

    def send(self, x: mx.array, dst: int, what: str, kind: str) -> None:
        """Evaluating the send also computes x: its time includes the stage's own layers."""
        tic = time.perf_counter()
        self._run(what, lambda: mx.eval(mx.distributed.send(x, dst, group=self.group)))
        self._clock(f"send {kind}", tic)
        count = self.sent.setdefault((dst, kind), [0, 0])
        count[0] += 1
        count[1] += x.nbytes

    def recv(self, shape, dtype, src: int, what: str, bounded: bool = True,
             kind: str = "hidden") -> mx.array:
        def get():
            x = mx.distributed.recv(shape, dtype, src, group=self.group)
            mx.eval(x)
            return x
        tic = time.perf_counter()
        out = self._run(what, get, bounded)
        self._clock(f"recv {kind}", tic)
        return out

    def _clock(self, key: str, tic: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - tic

    def agree(self, values: list[int], what: str, timeout: float | None = None) -> mx.array:
        """Every rank's `values` (int32), gathered: [size, len(values)]."""
        def gather():
            out = mx.distributed.all_gather(mx.array(values, dtype=mx.int32), group=self.group)
            mx.eval(out)
            return out
        return self._run(what, gather, timeout=timeout).reshape(self.size, len(values))


def _digest(*parts) -> int:
    h = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def _config_text(path: Path | None) -> str:
    if path is None:
        return "none"
    if path.is_file():                           # a GGUF: its scalar metadata and size
        meta = read_gguf_header(path)
        return json.dumps(meta, sort_keys=True, default=str) + str(path.stat().st_size)
    files = [path / "config.json", path / "draft_vocab.json"]
    return "".join(f.read_text() for f in files if f.exists())


def check_same_everywhere(link: Link, facts: dict[str, tuple[str, str]]) -> None:
    """All ranks must run the same code on the same target, drafter, split and precision.
    facts: name -> (what is compared, what to show); digests are compared across ranks and the
    first difference is one error line (on every rank)."""
    from . import __version__

    facts = {"dflash2-mlx version": (__version__, __version__), **facts}
    names = list(facts)
    table = link.agree([_digest(facts[n][0]) for n in names], "comparing what each rank loads")
    rows = table.tolist()
    for r, row in enumerate(rows[1:], start=1):
        for name, first, theirs in zip(names, rows[0], row):
            if first != theirs:
                mine = f"; rank {link.rank}: {facts[name][1]}" if link.rank in (0, r) else ""
                raise PipelineError(f"pipeline: rank {r} has a different {name} than rank 0"
                                    f"{mine}; start every rank with the same --model, --draft, "
                                    "--pipeline-split and precision flags")


# --------------------------------------------------------------------------- views


class _Incoming:
    """Stands in for the embedding on ranks > 0: the forward starts from the received state."""

    def __init__(self):
        self.x = None

    def __call__(self, ids):
        return self.x


class _StageEnd(Exception):
    def __init__(self, x):
        self.x = x


class _End:
    """Stands in for the layers after this rank's range. On rank 0 `relay` sends the hidden
    state round the ring and returns what comes back (the forward then applies the final norm
    and head); elsewhere it stops the forward and hands the hidden state out."""

    def __init__(self, layer, relay=None):
        self.layer, self.relay = layer, relay

    def __call__(self, x, *args, **kwargs):
        if self.relay is None:
            raise _StageEnd(x)
        return self.relay(x)

    def __getattr__(self, name):   # the forward reads layer attributes (use_sliding, ...)
        return getattr(self.layer, name)


def _family(model: nn.Module) -> str:
    return type(model).__module__.rsplit(".", 1)[-1]


def check_family(model: nn.Module, source: str = "target") -> None:
    family = _family(model)
    if family not in FAMILIES:
        raise ValueError(f"--pipeline: {source} is a '{family}' model; pipeline sharding "
                         f"supports {', '.join(FAMILIES)} (and llama GGUF files)")


def _stage_view(model, path, layers: list, embed=None) -> nn.Module:
    """A shallow copy of the model whose stack runs `layers` (parameters shared), with the
    stack's index attributes (first full-attention / sliding / linear layer, used to pick the
    cache a mask is made from) recomputed for that list; one that finds no layer points at the
    stand-in at the end, whose cache is None (that mask is then never used)."""
    chain = [copy.copy(model)]
    for name in path:
        child = copy.copy(chain[-1][name])
        chain[-1][name] = child
        chain.append(child)
    stack = chain[-1]
    stack["layers"] = layers
    if embed is not None:
        stack["embed_tokens"] = embed
    real = layers[:-1]
    for attr, wanted in INDEX_ATTRS.items():
        if attr in vars(stack):
            setattr(stack, attr, next((i for i, l in enumerate(real) if wanted(l)),
                                      len(layers) - 1))
    return chain[0]


class StageCache(list):
    """Rank 0's caches of its own layers (local order), known to the other ranks by `id`.
    A deep copy (`engine.DecodeState.copy`) gets a new id, and the other ranks copy theirs;
    when it is garbage-collected they drop theirs."""

    def __init__(self, caches, owner: "ShardedTarget"):
        super().__init__(caches)
        self.owner, self.rows = owner, 0       # rows: what the target has seen (see position)
        self.id = owner._register(self)

    @property
    def position(self) -> int:
        """Rows the target has seen. Attention caches tell it even after someone trimmed them
        directly (`DecodeState.trim`); the other ranks trim theirs to it before a forward."""
        for c in self:
            if c.is_trimmable():
                return c.offset
        return self.rows

    def __deepcopy__(self, memo):
        twin = StageCache([copy.deepcopy(c, memo) for c in self], self.owner)
        twin.rows = self.rows
        self.owner._ops.append((CLONE, twin.id, self.id))
        return twin


@dataclass(frozen=True)
class StagePlan:
    """Who runs what: `bounds[r]` = (start, end) layers of rank r; `layer_ids`: the drafter's
    feature layers (global indices, drafter order); `hidden_size`: the target's H."""

    rank: int
    size: int
    bounds: tuple[tuple[int, int], ...]
    layer_ids: tuple[int, ...]
    hidden_size: int

    @property
    def start(self) -> int:
        return self.bounds[self.rank][0]

    @property
    def end(self) -> int:
        return self.bounds[self.rank][1]

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def features_after(self, rank: int) -> list[int]:
        """Feature layers owned by ranks 1..rank, ascending: what rank's message carries."""
        hi = self.bounds[rank][1] if rank > 0 else self.bounds[0][0]
        return sorted(i for i in set(self.layer_ids) if self.bounds[0][1] <= i < hi)


class _StageRunner:
    """This rank's layer range of the model: caches, taps (features, recurrent inputs),
    snapshot and rollback, shared by rank 0's `ShardedTarget` and the followers."""

    def __init__(self, model: nn.Module, plan: StagePlan):
        self.model, self.plan = model, plan
        self.path = find_stack_path(model)
        self.all_layers = TargetAdapter._descend(model, self.path)["layers"]
        self.lo, self.hi = plan.start, plan.end
        self.full_cache = TargetAdapter(model).make_cache     # cache types of every layer
        probe = self.full_cache()
        self.recurrent = tuple(i for i in range(self.lo, self.hi)
                               if not probe[i].is_trimmable())
        self.own_features = sorted(i for i in set(plan.layer_ids) if self.lo <= i < self.hi)
        self.inputs: dict[int, mx.array] = {}
        self._slots: list = [None] * len(self.own_features)

    def taps(self) -> list:
        out = []
        for i in range(self.lo, self.hi):
            layer = self.all_layers[i]
            slot = self.own_features.index(i) if i in self.own_features else None
            if slot is not None or i in self.recurrent:
                layer = LayerTap(layer, i, slot, self._slots,
                                 self.inputs if i in self.recurrent else None)
            out.append(layer)
        return out

    def captured(self) -> list[mx.array]:
        return list(self._slots)

    def new_caches(self) -> list:
        return self.full_cache()[self.lo:self.hi]

    def snapshot(self, cache: list) -> dict:
        """Recurrent layers' state (array references: cheap), by global layer index."""
        return {i: [list(s) if isinstance(s, list) else s for s in cache[i - self.lo].state]
                for i in self.recurrent}

    def rollback(self, cache: list, snapshot: dict | None, kept: int, total: int,
                 inputs: dict | None = None) -> None:
        """As `target.Snapshot.rollback`, for this rank's layers (global i -> cache[i - lo]):
        the last forward fed `total` rows (recurrent layers' inputs: `inputs`, by default the
        latest recorded); keep the first `kept`."""
        inputs = self.inputs if inputs is None else inputs
        if kept == total:
            return
        for j, c in enumerate(cache):
            i = self.lo + j
            if i in self.recurrent:
                if snapshot is None:
                    raise PipelineError(f"pipeline: layer {i} (recurrent) cannot go back "
                                        f"{total - kept} rows without a snapshot")
                c.state = snapshot[i]
                if kept:
                    self.all_layers[i](inputs[i][:, :kept], mask=None, cache=c)
            else:
                c.trim(total - kept)


class _StageSnapshot:
    """What `ShardedTarget.snapshot` returns (the engine's `Snapshot` protocol): rolls back
    rank 0's layers; the other ranks follow from the position sent with the next forward."""

    def __init__(self, target: "ShardedTarget", cache: StageCache):
        self.target, self.cache = target, cache
        self.recurrent = target.runner.snapshot(cache)

    def rollback(self, kept: int, total: int) -> None:
        self.target.runner.rollback(self.cache, self.recurrent, kept, total)
        self.cache.rows -= total - kept


# --------------------------------------------------------------------------- rank 0


class ShardedTarget:
    """The target adapter of rank 0 in a pipeline: the interface of `target.TargetAdapter`
    (forward -> logits and features; make_cache; snapshot -> rollback; embed / head for the
    drafter), with layers [k0, L) run by the other ranks.

    `forward(tokens [B, T], cache)` -> (logits [B, T, V], features [B, T, len(layer_ids) * H]).
    """

    def __init__(self, model: nn.Module, plan: StagePlan, link: Link):
        if not plan.leader:
            raise ValueError("ShardedTarget runs on rank 0; other ranks run Stage.follow()")
        self.plan, self.link = plan, link
        self.local = TargetAdapter(model)         # embed, head, shapes (rank 0 holds them)
        self.model = model
        self.layer_ids = tuple(plan.layer_ids)
        self.runner = _StageRunner(model, plan)
        self.recurrent = self.local.recurrent
        self.remote_features = plan.features_after(plan.size - 1)
        relay = _End(self.runner.all_layers[plan.end - 1], relay=self._round_trip)
        self._view = _stage_view(model, self.runner.path, self.runner.taps() + [relay])
        self._ids = 0
        self._ops: list[tuple] = []                # CLONE / FREE for the other ranks
        self._back: mx.array | None = None
        self._cache: StageCache | None = None     # the cache of the forward under way
        self._closed = False
        self.forwards = 0

    def __getattr__(self, name):      # embed, head, head_rows, embed_tokens, hidden_size, ...
        if name == "local":           # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def num_layers(self) -> int:
        return self.local.num_layers

    # ---- caches: local caches, mirrored on the other ranks under the same id
    def _register(self, cache: StageCache) -> int:
        self._ids += 1
        weakref.finalize(cache, self._ops.append, (FREE, self._ids, 0))
        return self._ids

    def make_cache(self) -> StageCache:
        return StageCache(self.runner.new_caches(), self)

    def check_rollback(self, cache: list) -> None:
        self.local.check_rollback(self.local.make_cache())

    def snapshot(self, cache: StageCache) -> _StageSnapshot:
        return _StageSnapshot(self, cache)

    # ---- messages
    def _send_control(self, op: int, cid: int = 0, B: int = 0, T: int = 0, position: int = 0,
                      dtype=mx.float32, source: int = 0) -> None:
        word = [op, cid, B, T, position, DTYPES.index(dtype), source, 0]
        self.link.send(mx.array(word, dtype=mx.int32), 1, "sending a step to rank 1",
                       "control" if op == FORWARD else "op")

    def _flush_ops(self) -> None:
        while self._ops:
            op, cid, source = self._ops.pop(0)
            self._send_control(op, cid, source=source)

    def _round_trip(self, x: mx.array) -> mx.array:
        """x [B, T, H] after rank 0's layers -> the hidden state after the last layer, and the
        features the other ranks captured (kept for `forward`). The control word goes first,
        back to back with the hidden state: the receivers learn its shape and dtype from it
        (both are known before x is computed)."""
        B, T, H = x.shape
        cache = self._cache
        self._send_control(FORWARD, cache.id, B, T, cache.position - T, x.dtype)
        self.link.send(x, 1, "sending the hidden state to rank 1", "hidden")
        width = H * (1 + len(self.remote_features))
        back = self.link.recv((B, T, width), x.dtype, self.plan.size - 1,
                              f"waiting for rank {self.plan.size - 1}'s hidden state")
        self._back = back[..., H:]
        return back[..., :H]

    def forward(self, tokens: mx.array, cache: StageCache) -> tuple[mx.array, mx.array | None]:
        self._flush_ops()
        self.forwards += 1
        self._cache = cache
        cache.rows += tokens.shape[1]
        logits = self._view(tokens, cache=list(cache) + [None])
        self._cache = None
        if not self.layer_ids:
            return logits, None
        found = dict(zip(self.runner.own_features, self.runner.captured()))
        H = self.hidden_size
        for k, i in enumerate(self.remote_features):
            found[i] = self._back[..., k * H:(k + 1) * H]
        return logits, mx.concatenate([found[i] for i in self.layer_ids], axis=-1)

    def close(self) -> None:
        """Tell the other ranks to stop (idempotent)."""
        if self.plan.size > 1 and not self._closed and not self.link.broken:
            self._closed = True
            self._flush_ops()
            self._send_control(STOP)


# --------------------------------------------------------------------------- ranks > 0


@dataclass
class _Mirror:
    """A follower's copy of one of rank 0's caches."""

    caches: list
    rows: int = 0
    last: int = 0                      # rows of the last forward
    snapshot: dict | None = None       # recurrent state before the last forward
    inputs: dict = field(default_factory=dict)   # recurrent layers' inputs in that forward


class Follower:
    """Ranks > 0: run this rank's layers whenever rank 0 asks, until it says stop."""

    def __init__(self, model: nn.Module, plan: StagePlan, link: Link):
        self.plan, self.link = plan, link
        self.runner = _StageRunner(model, plan)
        self.incoming = _Incoming()
        end = _End(self.runner.all_layers[plan.end - 1])
        self._view = _stage_view(model, self.runner.path, self.runner.taps() + [end],
                                 embed=self.incoming)
        self.mirrors: dict[int, _Mirror] = {}
        self.forwards, self.compute_s = 0, 0.0       # this rank's layers: forwards, seconds

    def follow(self) -> None:
        r, n = self.plan.rank, self.plan.size
        prev, nxt = r - 1, (r + 1) % n
        while True:
            # idle: rank 0 may wait for a request as long as it likes (a server)
            ctrl = self.link.recv((CONTROL,), mx.int32, prev, "waiting for rank 0",
                                  bounded=False, kind="control")
            op, cid, B, T, position, dt, source, _ = ctrl.tolist()
            if nxt != 0:
                self.link.send(ctrl, nxt, f"passing a step to rank {nxt}",
                               "control" if op == FORWARD else "op")
            if op == STOP:
                return
            if op == FREE:
                self.mirrors.pop(cid, None)
            elif op == CLONE:
                src = self.mirrors.get(source)
                self.mirrors[cid] = (_Mirror(copy.deepcopy(src.caches), src.rows) if src
                                     else _Mirror(self.runner.new_caches()))
            elif op == FORWARD:
                m = self.mirrors.get(cid)
                if m is None:
                    m = self.mirrors[cid] = _Mirror(self.runner.new_caches())
                self._catch_up(m, position)
                m.snapshot = self.runner.snapshot(m.caches)
                self._forward(m.caches, B, T, DTYPES[dt], prev, nxt)
                m.rows, m.last, m.inputs = m.rows + T, T, dict(self.runner.inputs)

    def _catch_up(self, m: _Mirror, position: int) -> None:
        """Drop the rows rank 0 dropped since the last forward (a rejected draft suffix, a
        trimmed prefix cache): rank 0's position is the one broadcast of its decisions."""
        if position > m.rows:
            raise PipelineError(f"pipeline: rank {self.plan.rank} is behind rank 0 ({m.rows} "
                                f"rows, rank 0 {position}); the ranks fell out of step")
        drop = m.rows - position
        if drop:
            keep_last = m.last - drop
            if keep_last >= 0:
                self.runner.rollback(m.caches, m.snapshot, keep_last, m.last, m.inputs)
            else:                                     # past the last forward: trims only
                self.runner.rollback(m.caches, None, 0, drop)
            m.rows, m.last, m.snapshot = position, max(keep_last, 0), None

    def _forward(self, cache, B, T, dtype, prev, nxt) -> None:
        H = self.plan.hidden_size
        upstream = self.plan.features_after(self.plan.rank - 1)
        x = self.link.recv((B, T, H * (1 + len(upstream))), dtype, prev,
                           f"waiting for rank {prev}'s hidden state")
        tic = time.perf_counter()
        self.incoming.x = x[..., :H]
        try:
            self._view(mx.zeros((B, T), dtype=mx.uint32), cache=list(cache) + [None])
            raise RuntimeError("the target's forward pass never reached the end of this "
                               "rank's layers")
        except _StageEnd as end:
            h = end.x
        parts = [h] + ([x[..., H:]] if upstream else []) + self.runner.captured()
        out = mx.concatenate(parts, axis=-1) if len(parts) > 1 else h
        mx.eval(out, [c.state for c in cache])
        self.compute_s += time.perf_counter() - tic
        self.link.send(out, nxt, f"sending the hidden state to rank {nxt}", "hidden")
        self.forwards += 1
        if self.forwards % 64 == 0:
            mx.clear_cache()


# --------------------------------------------------------------------------- loading


@dataclass
class Stage:
    """This rank's part of a pipeline (`Pipeline.stage`): which layers it runs, and on ranks
    > 0 the loop that runs them. Rank 0 generates (`Pipeline.generate` / `stream`) and calls
    `close()` at the end; every other rank calls `follow()`, which returns when rank 0 closes.
    A server (`serve --pipeline`) does the same: rank 0 serves, the others follow."""

    plan: StagePlan
    link: Link
    target: ShardedTarget | None = None
    follower: Follower | None = None
    weight_mib: list[float] = field(default_factory=list)   # weights each rank holds

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def size(self) -> int:
        return self.plan.size

    @property
    def leader(self) -> bool:
        return self.plan.leader

    @property
    def layers(self) -> range:
        return range(self.plan.start, self.plan.end)

    def follow(self) -> None:
        if self.follower is None:
            raise ValueError("Stage.follow() is for ranks > 0; rank 0 generates")
        self.follower.follow()

    def close(self) -> None:
        """Rank 0: tell the others to stop (also run at exit, so a script or command that
        ends, or fails, never leaves them waiting); a broken link has nobody left to tell."""
        if self.target is not None:
            try:
                self.target.close()
            except PipelineError:
                pass

    def describe(self) -> dict:
        return {"ranks": self.size, "split": [e - s for s, e in self.plan.bounds],
                "layers": [list(b) for b in self.plan.bounds], "weight_mib": self.weight_mib}


def prepare(group, target_path: Path, draft_dir: Path | None, split: str | tuple | None,
            precision: str, timeout: float = DEFAULT_TIMEOUT) -> tuple[StagePlan, Link]:
    """Before any weight loads: plan the split from the target's config and check that every
    rank is about to load the same target, drafter, split and precision."""
    from .config import DrafterArgs

    split = parse_split(split) if isinstance(split, (str, type(None))) else tuple(split)
    num_layers, hidden = target_shape(target_path)
    bounds = tuple(plan_stages(num_layers, group.size(), split))
    layer_ids = DrafterArgs.from_file(draft_dir).target_layer_ids if draft_dir else ()
    link = Link(group, timeout)
    check_same_everywhere(link, {
        "target": (_config_text(target_path), str(target_path)),
        "drafter": (_config_text(draft_dir), str(draft_dir)),
        "split": (str(bounds), ",".join(str(e - s) for s, e in bounds)),
        "precision": (precision, precision)})
    return StagePlan(group.rank(), group.size(), bounds, tuple(layer_ids), hidden), link


def keep_only_stage(model: nn.Module, plan: StagePlan) -> int:
    """Drop the weights this rank does not run (other ranks' layers; on ranks > 0 also the
    embedding, final norm and head), then load the rest. -> bytes of weights kept.

    Other layers' modules stay (their structure gives the cache types) with empty arrays, so
    nothing can bring their weights back by accident."""
    path = find_stack_path(model)
    prefix = ".".join(path + ("layers",)) + "."

    def needed(name: str) -> bool:
        if name.startswith(prefix):
            return plan.start <= int(name[len(prefix):].split(".", 1)[0]) < plan.end
        return plan.leader

    model.update(tree_map_with_path(
        lambda name, v: v if needed(name) else mx.zeros((0,), v.dtype), model.parameters()))
    kept = [v for n, v in tree_flatten(model.parameters()) if needed(n)]
    mx.eval(kept)
    return sum(v.nbytes for v in kept)


def build(model: nn.Module, plan: StagePlan, link: Link) -> Stage:
    """This rank's stage of a lazily loaded target: keep (and read) only its weights, wait
    until every rank has loaded its own (loading may take minutes: a longer bound)."""
    check_family(model)
    kept = keep_only_stage(model, plan)
    sizes = link.agree([kept // 1024], "waiting for every rank to load its layers",
                       timeout=max(10 * link.timeout, 600.0))
    if plan.leader:
        stage = Stage(plan, link, target=ShardedTarget(model, plan, link))
        atexit.register(stage.close)
    else:
        stage = Stage(plan, link, follower=Follower(model, plan, link))
    stage.weight_mib = [round(v / 1024, 1) for v in sizes[:, 0].tolist()]
    return stage


def follow_unless_leader(pipe) -> bool:
    """The hook for commands and servers (`generate --pipeline`, `serve --pipeline`): right
    after `load(..., pipeline=group)`, a rank > 0 serves its layers until rank 0 closes the
    pipeline and this returns True (the caller then returns without output); on rank 0, or
    without a pipeline, it returns False at once and the caller generates or serves (rank 0
    closes at exit, or explicitly with `pipe.stage.close()`)."""
    if pipe.stage is None or pipe.stage.leader:
        return False
    pipe.stage.follow()
    return True


class FollowerTarget:
    """What `Pipeline.adapter` is on ranks > 0: shapes, and a clear error for generating."""

    def __init__(self, model, stage: Stage):
        self.local, self.stage = TargetAdapter(model), stage

    def __getattr__(self, name):
        if name in ("local", "stage"):
            raise AttributeError(name)
        if name in ("forward", "make_cache"):
            raise ValueError(f"rank {self.stage.rank} of {self.stage.size} runs layers "
                             f"{self.stage.plan.start}..{self.stage.plan.end - 1} for rank 0: "
                             "call pipe.stage.follow() there (rank 0 generates)")
        return getattr(self.local, name)


__all__ = ["PipelineError", "Stage", "StagePlan", "ShardedTarget", "Follower", "Link",
           "init_group", "parse_split", "plan_stages", "prepare", "build", "keep_only_stage",
           "target_shape", "read_gguf_header", "availability", "follow_unless_leader"]
