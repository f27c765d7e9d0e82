"""Start a server as a subprocess for a sweep, wait for /health, and stop it (only the process we started)."""

from __future__ import annotations

import contextlib
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# {python} {port} {chunk} {budget} {trace} are filled in per setting.
DEFAULT_SERVER_CMD = ("{python} -m mixserve serve --port {port} --prefill-chunk {chunk} "
                      "--max-batch-tokens {budget} --step-trace {trace}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(template: str, *, port: int, chunk: int, budget: int, trace: str | Path,
                   extra_args: str = "") -> list[str]:
    """The argv of one server: the template with its fields filled, then extra_args."""
    filled = template.format(python=shlex.quote(sys.executable), port=port, chunk=chunk, budget=budget,
                             trace=shlex.quote(str(trace)))
    return shlex.split(filled) + shlex.split(extra_args)


class ServerProcess:
    """A server subprocess with its output in a log file; use as a context manager."""

    def __init__(self, argv: list[str], port: int, log_path: str | Path, startup_timeout_s: float = 300.0):
        self.argv, self.port, self.log_path = argv, port, Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Launch the server and return once /health answers 200; raise with its log tail if it cannot."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"server exited with {code} before /health:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.25)  # polling a process we do not control; no event to wait on
        raise RuntimeError(f"server not healthy after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGINT (a clean shutdown, which flushes the step trace), then SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
