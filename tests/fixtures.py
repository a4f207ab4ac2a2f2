"""The tests' fixtures: the random-weight checkpoints of `dflash2_mlx.testing` (shared with the
benchmarks; a target that always calls a tool among them), re-exported under the names the test
files import; and, for the tests only, `Server`, a `dflash2-mlx serve` subprocess on loopback
(conftest.py's `server` fixture runs one with the limits below).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from dflash2_mlx.testing import (CHAT_TEMPLATE, HIDDEN, SMOLLM2_DRAFTER, TARGET_LAYERS,
                                 TOOL_CALL, TOOL_TEMPLATE, VOCAB, drafter_args, random_drafter,
                                 smollm2_drafter_args, target_config, write_drafter,
                                 write_target, write_tool_target)

__all__ = ["CHAT_TEMPLATE", "HIDDEN", "SMOLLM2_DRAFTER", "TARGET_LAYERS", "VOCAB", "drafter_args",
           "random_drafter", "smollm2_drafter_args", "target_config", "write_drafter",
           "write_target", "write_tool_target", "Server", "TOOL_CALL", "TOOL_TEMPLATE", "KEY",
           "CAP", "CONTEXT", "BODY", "BLOCK"]


# --------------------------------------------------------------------------- servers

KEY = "test-key-123"
CAP = 96                 # --max-tokens
CONTEXT = 512            # --context-length
BODY = 64 * 1024         # --max-body-bytes
BLOCK = 8                # a fixed width: "auto" would time cycles, so seeded runs could differ


class Server:
    """A `dflash2-mlx serve` subprocess; `url` once it printed its address."""

    def __init__(self, *args):
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash2_mlx.cli", "serve", "--port", "0", "--block-size",
             str(BLOCK), *map(str, args)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        deadline = time.time() + 120
        self.url = None
        while self.url is None:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("the server exited before it was ready:\n" + "".join(self.log))
            self.log.append(line)
            if m := re.search(r"serving \S+ on (http://\S+)", line):
                self.url = m.group(1)
            if time.time() > deadline:
                raise RuntimeError("the server did not get ready:\n" + "".join(self.log))
        self._drain = threading.Thread(target=lambda: self.log.extend(self.proc.stderr),
                                       daemon=True)
        self._drain.start()

    def stop(self, sig=signal.SIGTERM, timeout=30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self._drain.join(5)
        return rc

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/health", timeout=10).json()
