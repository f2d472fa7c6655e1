"""Spawning worker processes and killing process trees. No asyncio, no sockets."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from typing import Any

import psutil

from .config import DEVICE_ENV_VARS

__all__ = ["WorkerProcess", "device_env", "kill_tree", "tail", "CONFIG_ENV"]

logger = logging.getLogger(__name__)

CONFIG_ENV = "ROLLFLEET_WORKER_CONFIG"


def device_env(device: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables that pin a worker to ``device`` ('cpu', 'cuda:1', 'npu:0').

    The parent's own value is read with .get, so a missing variable is never an error;
    when the parent already restricts devices (CUDA_VISIBLE_DEVICES=4,5), index 1 maps to
    physical device 5.
    """
    environ = os.environ if environ is None else environ
    kind, _, index = device.partition(":")
    var = DEVICE_ENV_VARS.get(kind)
    if var is None:
        return {}
    index = index or "0"
    visible = environ.get(var, "")
    if visible.strip():
        choices = [v.strip() for v in visible.split(",") if v.strip()]
        if index.isdigit() and int(index) < len(choices):
            index = choices[int(index)]
    return {var: index}


def tail(path: str, max_bytes: int = 4000) -> str:
    """The end of a log file, for error messages."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def kill_tree(pid: int, sig: int = signal.SIGKILL, include_parent: bool = True) -> None:
    """Send ``sig`` to a process and all its descendants; vanished processes are fine."""
    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True)
        if include_parent:
            procs.append(parent)
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


class WorkerProcess:
    """One worker OS process: start it, watch it through a pidfd, stop it."""

    def __init__(self, worker_id: str, config: dict[str, Any], env: dict[str, str], log_path: str):
        self.worker_id = worker_id
        self.log_path = log_path
        # The worker holds the read end of this pipe; when this process dies (even by
        # SIGKILL) the write end closes, the read returns EOF, and the worker exits.
        death_r, self._death_w = os.pipe()
        config = dict(config, death_fd=death_r, parent_pid=os.getpid())
        child_env = dict(os.environ)
        child_env.update(env)
        child_env[CONFIG_ENV] = json.dumps(config)
        self._log = open(log_path, "ab")
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "rollfleet.actors.worker"],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=child_env,
                pass_fds=(death_r,),
                close_fds=True,
            )
        finally:
            os.close(death_r)
        self.pid = self.popen.pid
        self._descendants: dict[int, psutil.Process] = {}
        try:
            self.pidfd: int | None = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # old kernel: the supervisor polls instead
            self.pidfd = None

    def remember_descendants(self) -> None:
        """Note the worker's descendants, so they can be killed even after the worker is
        gone (orphans are re-parented away and no longer show up as its children)."""
        try:
            for child in psutil.Process(self.pid).children(recursive=True):
                self._descendants[child.pid] = child
        except psutil.NoSuchProcess:
            pass

    def kill_descendants(self) -> None:
        for proc in list(self._descendants.values()):
            try:
                if proc.is_running():  # also guards against pid reuse (compares create time)
                    proc.kill()
            except psutil.Error:
                pass

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def terminate(self) -> None:
        if self.alive():
            kill_tree(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        # Descendants matter: vLLM's engine core runs in a grandchild.
        self.remember_descendants()
        kill_tree(self.pid, signal.SIGKILL)
        self.kill_descendants()

    def close(self) -> None:
        """Reap the process and release fds. Call after it has exited (or been killed)."""
        self.kill_descendants()
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            self.popen.wait(timeout=5)
        for fd in (self.pidfd, self._death_w):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.pidfd = None
        self._death_w = -1
        self._log.close()

    def stderr_tail(self) -> str:
        return tail(self.log_path)
