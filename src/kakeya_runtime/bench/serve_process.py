"""`kakeya serve` in a child process, for benches (and tests) that must be able to kill it the hard way."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence


def read_metrics(url: str) -> str:
    """The text of a server's /metrics at `url`."""
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


class ServeProcess:
    """Starts `kakeya serve --port 0 --metrics-port 0 ARGS` and waits until it serves: the address is the last
    stdout line, the metrics port is on stderr."""

    def __init__(self, args: Sequence[str], *, start_timeout_s: float = 120.0) -> None:
        self.args = list(args)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kakeya_runtime.cli", "serve", "--port", "0", "--metrics-port", "0", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.address = ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if re.fullmatch(r"127\.0\.0\.1:\d+", line.strip()):
                self.address = line.strip()
                break
        if not self.address:
            self.proc.wait(10)
            raise RuntimeError(f"kakeya serve did not start: {self.log[-2000:]}")
        deadline = time.monotonic() + start_timeout_s  # stderr is drained by a thread: its lines may trail stdout's
        while not (port := re.search(r"Metrics on http://127\.0\.0\.1:(\d+)/metrics", self.log)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"kakeya serve printed no metrics port: {self.log[-2000:]}")
            time.sleep(0.05)
        self.metrics_port = int(port.group(1))

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    @property
    def log(self) -> str:
        return "".join(self.stderr)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def metrics(self) -> str:
        return read_metrics(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def rss_bytes(self) -> int:
        """The server's resident set now (0 once it has exited)."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (a graceful stop: snapshots are written) and wait; the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
