"""The watchdog: a child process per rank that ends the rank with one error line when a
distributed step outlasts its bound (docs/distributed.md, "Faults", says why a process).

    python -m dflash2_mlx.distributed.watchdog PARENT_PID SIGTERM_FD PREFIX GRACE_S

Standard library only: the child starts in a fraction of a second and imports no MLX. It reads
lines on stdin: "SECONDS WHAT" arms (end the parent with PREFIX + WHAT after SECONDS), "- "
disarms, "quiet" (at exit) means the rank has said what it had to say; end of input: the rank
ended. A byte on SIGTERM_FD (the parent's signal wakeup fd) is SIGTERM: the parent gets GRACE_S
seconds to print its own line, then ends with STOPPED.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

STOPPED = ("stopped: mlx.launch ends every rank when one exits with an error (the other "
           "rank's line says why)")
# where this package is imported from: the child runs the same code as its parent
_ROOT = str(Path(__file__).resolve().parents[2])


def main(parent: int, term_fd: int, prefix: str, grace: float) -> int:
    deadline, what, quiet, term_at, pending = None, "", False, None, b""

    def end(line: str) -> int:
        if not quiet:
            sys.stderr.write(prefix + line + "\n")
            sys.stderr.flush()
        os.kill(parent, signal.SIGKILL)
        return 1

    while True:
        ends = [t for t in (deadline, term_at and term_at + grace) if t]
        wait = max(0.0, min(ends) - time.monotonic()) if ends else None
        ready, _, _ = select.select([0] + ([term_fd] if term_at is None else []), [], [], wait)
        if term_fd in ready:              # SIGTERM: let the rank say why it stops, then end it
            os.read(term_fd, 64)
            term_at = time.monotonic()
        elif ready:
            # raw reads: every line that arrived counts (a buffered readline could keep a
            # disarm that came with its arm out of select's sight)
            chunk = os.read(0, 4096)
            if not chunk:
                return 0                  # the rank ended: nothing to watch
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line == b"quiet":
                    quiet = True
                    continue
                seconds, _, what = line.decode().partition(" ")
                deadline = None if seconds == "-" else time.monotonic() + float(seconds)
        elif term_at and time.monotonic() >= term_at + grace:
            return end(STOPPED)
        elif deadline is not None and time.monotonic() >= deadline:
            return end(what)


class Watchdog:
    """Bounds this rank's blocking distributed steps (a child process: a blocked
    `mx.distributed.init` holds the GIL, so no thread would run) and takes over SIGTERM."""

    def __init__(self, prefix: str, grace: float = 2.0):
        read, write = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(os.getpid()), str(read), prefix, str(grace)],
            stdin=subprocess.PIPE, text=True, env={"PYTHONPATH": _ROOT}, pass_fds=(read,))
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


def get(rank: int | None = None, grace: float = 2.0) -> Watchdog:
    """This process's watchdog, started on first use (`grace`: seconds a rank may take to stop
    after SIGTERM)."""
    global _watchdog
    if _watchdog is None:
        who = "" if rank in (None, 0) else f" (rank {rank})"
        _watchdog = Watchdog(f"dflash2-mlx: error{who}: pipeline: ", grace)
    return _watchdog


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))
