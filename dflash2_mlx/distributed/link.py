"""Connecting the ranks, and the messages between them: the control word that precedes every
step (`Control`) and this rank's bounded sends and receives (`Link`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx

from . import watchdog

DEFAULT_TIMEOUT = 60.0
FORWARD, CLONE, FREE, STOP = 1, 2, 3, 4      # control word ops
JOIN, KEEP, RELEASE, FILTER = 5, 6, 7, 8     # a batch's rows changed (`stages.ShardedRows`)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
WORDS = 8            # int32 words on the wire: the fields of `Control`, then zeros


class PipelineError(RuntimeError):
    """A rank died, hung, never connected, or was started on something else."""


class Control(NamedTuple):
    """What rank 0 sends before each step, passed on hop by hop (int32 [8] on the wire).
    FORWARD: the shape and dtype of the hidden state that follows, and `position`, the rows
    rank 0's cache held before this forward; CLONE: `cache` becomes a copy of `source`; FREE:
    drop `cache`; STOP: return from `follow()`. A batch's rows (`cache`: the batch's id), each
    with an int32 payload after the word (`payload_shape`): JOIN `batch` sequences (payload
    [batch, 2]: their cache ids and positions); KEEP, after a forward of `rows` rows per row,
    each row's first keep[b] (payload [batch]); RELEASE row `position` of batch `source` as
    cache `cache`, of `rows` rows; FILTER: keep rows stay (payload [batch]), in that order."""

    op: int
    cache: int = 0                   # the id of one of rank 0's caches (`StageCache.id`)
    batch: int = 0                   # B
    rows: int = 0                    # T
    position: int = 0
    dtype: mx.Dtype = mx.float32
    source: int = 0

    def encode(self) -> mx.array:
        word = [self.op, self.cache, self.batch, self.rows, self.position,
                DTYPES.index(self.dtype), self.source]
        return mx.array(word + [0] * (WORDS - len(word)), dtype=mx.int32)

    def payload_shape(self) -> tuple[int, ...] | None:
        """The shape of the int32 array that follows this word, or None."""
        return {JOIN: (self.batch, 2), KEEP: (self.batch,), FILTER: (self.batch,)}.get(self.op)

    @classmethod
    def decode(cls, word: mx.array) -> "Control":
        op, cache, batch, rows, position, dtype, source = word.tolist()[:7]
        return cls(op, cache, batch, rows, position, DTYPES[dtype], source)


def init_group(timeout: float = DEFAULT_TIMEOUT, backend: str = "any",
               grace: float = 2.0) -> mx.distributed.Group:
    """`mx.distributed.init` bounded by `timeout` (it waits forever for a rank that never
    connects). Outside mlx.launch: a group of one. grace: seconds a rank may take to stop
    after SIGTERM (the watchdog's)."""
    if not mx.distributed.is_available():
        raise PipelineError("--pipeline: this MLX build has no distributed backend")
    launched = any(k in os.environ for k in ("MLX_HOSTFILE", "MLX_RANK", "OMPI_COMM_WORLD_RANK",
                                             "PMI_RANK", "MLX_JACCL_DEVICES"))
    if not launched:
        return mx.distributed.init(strict=False)
    dog = watchdog.get(int(os.environ.get("MLX_RANK", 0)), grace)
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


@dataclass
class Link:
    """This rank's sends and receives, each bounded by the watchdog, with the ring backend's
    errors turned into one line; counts messages and bytes sent (for tests and benchmarks)."""

    group: mx.distributed.Group
    timeout: float = DEFAULT_TIMEOUT
    # (destination rank, kind) -> [messages, bytes]; kinds: "control" and "hidden" (one each
    # per forward and boundary), "op" (a cache copied or dropped, a batch's rows changed,
    # "stop"), "rows" (the payload of a batch's change)
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
        dog, timeout = watchdog.get(self.rank), timeout or self.timeout
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

    def send_control(self, word: Control, dst: int, what: str,
                     payload: mx.array | None = None) -> None:
        """The word, then its payload (int32, of `word.payload_shape()`) when it has one."""
        self.send(word.encode(), dst, what, "control" if word.op == FORWARD else "op")
        if payload is not None:
            self.send(payload, dst, what, "rows")

    def recv_control(self, src: int, what: str) -> tuple[Control, mx.array | None]:
        """-> (the word, its payload or None). Unbounded: between requests rank 0 may wait as
        long as it likes (a server)."""
        word = Control.decode(self.recv((WORDS,), mx.int32, src, what, bounded=False,
                                        kind="control"))
        shape = word.payload_shape()
        return word, (None if shape is None else
                      self.recv(shape, mx.int32, src, what, kind="rows"))

    def _clock(self, key: str, tic: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - tic

    def agree(self, values: list[int], what: str, timeout: float | None = None) -> mx.array:
        """Every rank's `values` (int32), gathered: [size, len(values)]."""
        def gather():
            out = mx.distributed.all_gather(mx.array(values, dtype=mx.int32), group=self.group)
            mx.eval(out)
            return out
        return self._run(what, gather, timeout=timeout).reshape(self.size, len(values))
