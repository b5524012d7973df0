"""A child process driven by JSON lines: the tests' way to put an endpoint in another process.

The child prints one JSON object per line (its first names its address or addresses); each request is one
JSON line on its stdin, ``{"op": ..., **args}``, answered by one line. Other output is ignored, so the
child's logging cannot be taken for a reply.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["JsonPeer"]


class JsonPeer:
    """``script`` run with ``args`` under this tree's ``src``; ``self.first`` is its first reply."""

    def __init__(self, script: Path, args: list[str], ready_timeout: float, timeout: float) -> None:
        env = {**os.environ, "PYTHONPATH": str(script.parent.parent / "src")}
        self.proc = subprocess.Popen([sys.executable, str(script), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.timeout = timeout
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.first = self._next(ready_timeout)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(line)
        self._lines.put("")

    def _next(self, timeout: float) -> dict[str, Any]:
        line = self._lines.get(timeout=timeout)
        if not line:
            raise AssertionError(f"peer exited with {self.proc.wait(5)}")
        return json.loads(line)

    def __call__(self, op: str, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = self._next(self.timeout if timeout is None else timeout)
        assert "error" not in reply, reply
        return reply

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self, wait: float = 10) -> None:
        """Ask the child to exit; kill it if it does not within ``wait`` seconds."""
        if self.proc.poll() is None:
            with contextlib.suppress(AssertionError, queue.Empty, BrokenPipeError):
                self("exit", timeout=wait)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                self.kill()
