"""Starting a real damacyd, as users do (the ``damacyd`` command)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from damacy_runtime.probe import ping


def damacyd_command() -> list[str]:
    exe = shutil.which("damacyd", path=os.path.dirname(sys.executable)) or shutil.which("damacyd")
    assert exe, "the damacyd command is not installed (pip install -e .)"
    return [exe]


class DaemonProcess:
    def __init__(
        self, folder: Path, allow_roots: list[Path], extra: list[str] = (), name: str = "d.sock", preexec_fn=None, env=None
    ) -> None:
        self.folder = Path(folder)
        self.endpoint = f"ipc://{self.folder / name}"
        self.log_path = self.folder / f"{name}.log"
        args = [*damacyd_command(), "--endpoint", self.endpoint, "--heartbeat-timeout", "3", "--log-level", "debug"]
        for root in allow_roots:
            args += ["--allow-root", str(root)]
        args += list(extra)
        self.log = open(self.log_path, "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn, env=env)
        while not ping(self.endpoint, timeout_s=0.2):
            if self.proc.poll() is not None:
                raise RuntimeError(f"damacyd exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            if time.monotonic() - t0 > 60:  # a loaded machine starts it slowly
                self.proc.kill()
                raise RuntimeError(f"damacyd did not answer within 60 s:\n{self.log_path.read_text()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def shm_segments(pid: int | None = None) -> list[str]:
    names = [n for n in os.listdir("/dev/shm") if n.startswith("damacy-")]
    if pid is not None:
        names = [n for n in names if n.startswith(f"damacy-{pid}-")]
    return names


def wait_for(predicate, timeout=30.0, what="condition"):
    """Poll ``predicate`` until it returns something true (returned), or fail naming ``what``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
