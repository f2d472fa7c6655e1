"""Spawning worker processes and killing process trees. No asyncio, no sockets."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil

from .boot import BLOCKED_AT_SPAWN, CONFIG_ENV
from .config import DEVICE_ENV_VARS

__all__ = ["WorkerProcess", "device_env", "kill_tree", "is_resource_tracker", "tail", "CONFIG_ENV",
           "record_shm", "shm_names_mapped", "shm_names_now", "sweep_shm_lists", "unlink_shm", "kmp_names",
           "claim_private_dir", "sweep_private_dirs", "sweep_stale_segments", "remove_private_dir", "remove_with",
           "unlink_if_same", "unlink_segments_of", "sampling_seed"]

logger = logging.getLogger(__name__)


def sampling_seed(base: Any, worker_id: str) -> int:
    """The seed of a worker's draws for requests that bring no seed of their own, in [0, 2**31).

    Worker ids name a slot and its restart count, so no two workers of a fleet (nor a worker
    and the one that replaced it) draw the same samples. ``base`` is the engine option
    ``sampling_seed``, else ``seed``: with one, a fleet started the same way draws the same way
    (fleets of different ranks should then be given different ``sampling_seed``s); with
    neither, the OS's randomness.
    """
    if base is None:
        return int.from_bytes(os.urandom(4), "little") >> 1
    digest = hashlib.blake2b(f"{int(base)}/{worker_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 1


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


# Shared memory that an engine's own child processes make through Python's multiprocessing
# (vLLM's queues and locks: ``psm_*`` segments, ``sem.mp-*`` semaphores) is unlinked by those
# processes when they end cleanly, and left in /dev/shm when they are killed. A worker lists
# such names in ``<private dir>/shm-<its pid>.list`` (one per line; its engine adds its own
# processes'); whoever sees that process gone unlinks them: the engine itself after reaping
# its children, the supervisor after a worker died or at its shutdown, and the next
# supervisor's sweep of a dead fleet's private directory.
# Intel's OpenMP runtime (libiomp5, which vLLM's CPU guide has users preload) registers each
# process that loads it as ``__KMP_REGISTERED_LIB_<pid>_<uid>`` and unlinks that at a normal
# exit only: see kmp_names.
SHM_DIR = "/dev/shm"
KMP_PREFIX = "__KMP_REGISTERED_LIB_"
SHM_PREFIXES = ("psm_", "sem.mp-", KMP_PREFIX)


def kmp_names(pids: list[int]) -> set[str]:
    """The names libiomp5 registers ``pids`` under (this user's), whether or not they loaded it."""
    uid = os.getuid()
    return {f"{KMP_PREFIX}{pid}_{uid}" for pid in pids}


def shm_names_mapped(pids: list[int]) -> set[str]:
    """Multiprocessing shared-memory names (see SHM_PREFIXES) that ``pids`` have mapped.

    Found by file (inode), not by the path a mapping shows: glibc's sem_open makes a semaphore
    as a temporary file that it maps and then links as ``sem.mp-*``, so its creator's mapping
    reads ``sem.XXXXXX (deleted)``; only processes that opened it later show its name.
    """
    inodes = _shm_inodes_mapped(pids)
    try:
        with os.scandir(SHM_DIR) as entries:
            return {e.name for e in entries if e.name.startswith(SHM_PREFIXES) and e.inode() in inodes}
    except OSError:
        return set()


def _shm_inodes_mapped(pids: list[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.split(None, 5)  # address perms offset dev inode path
                    if len(fields) == 6 and fields[5].startswith(SHM_DIR + "/"):
                        out.add(int(fields[4]))
        except (OSError, ValueError):
            continue  # gone, or not ours to read
    return out


def shm_names_now() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIXES)}
    except OSError:
        return set()


def record_shm(private_dir: str, names: set[str]) -> str:
    """Write this process's list of leftover-prone shared-memory names, its own OpenMP
    registration always among them (killed with its supervisor, a process leaves nobody else
    who knows its pid); returns its path."""
    names = set(names) | kmp_names([os.getpid()])
    path = os.path.join(private_dir, f"shm-{os.getpid()}.list")
    with open(path, "w") as f:
        f.write("".join(f"{n}\n" for n in sorted(names)))
    return path


def unlink_shm(names: set[str] | list[str]) -> list[str]:
    """Unlink these /dev/shm names (multiprocessing's only); returns those that were there."""
    gone = []
    for name in names:
        if "/" in name or not name.startswith(SHM_PREFIXES):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            gone.append(name)
        except OSError:
            pass
    return gone


def sweep_shm_lists(private_dir: str | None, everything: bool = False) -> list[str]:
    """Unlink the names listed by engine processes of ``private_dir`` that are gone (all of
    them with ``everything``, at shutdown), and drop their lists. Returns what was unlinked."""
    if not private_dir:
        return []
    try:
        files = [f for f in os.listdir(private_dir) if f.startswith("shm-") and f.endswith(".list")]
    except OSError:
        return []
    gone: list[str] = []
    for fname in files:
        pid = fname[len("shm-"):-len(".list")]
        if not pid.isdigit() or (not everything and psutil.pid_exists(int(pid))):
            continue
        path = os.path.join(private_dir, fname)
        try:
            with open(path) as f:
                gone += unlink_shm([line.strip() for line in f if line.strip()])
            os.unlink(path)
        except OSError:
            continue
    if gone:
        logger.info("unlinked %d shared-memory names left by engine processes: %s", len(gone), ", ".join(gone))
    return gone


# A supervisor's private directory names its owner (``owner``: pid and start time), so that
# a directory left by a supervisor that died while none of its workers, nor its sentinel
# (actors.sentinel), lived to remove it is removed by the next supervisor that starts there.
OWNER_FILE = "owner"


def claim_private_dir(private_dir: str) -> None:
    """Write this process's pid and start time into its private directory."""
    me = psutil.Process()
    with open(os.path.join(private_dir, OWNER_FILE), "w") as f:
        f.write(f"{me.pid} {me.create_time()!r}\n")


# A directory with nothing in it but an owner file that is empty or missing is one whose
# supervisor was killed while making it: removed once it is this old (seconds), when no
# supervisor can still be about to write it.
UNCLAIMED_AGE_S = 60.0


# Paths outside a private directory that go with it (``remove_with``): one JSON line each,
# [inode, path].
REMOVE_WITH_FILE = "remove-with"


def remove_with(private_dir: str, path: str) -> None:
    """Have ``path`` (a file or directory) removed with ``private_dir``: by whoever removes the
    directory (its supervisor's shutdown, its workers or its sentinel once that supervisor is
    gone, the sweep of the next supervisor started beside it), if ``path`` is still the same file
    then."""
    path = os.path.abspath(path)
    inode = os.lstat(path).st_ino
    with open(os.path.join(private_dir, REMOVE_WITH_FILE), "a", encoding="utf-8") as f:
        f.write(json.dumps([inode, path]) + "\n")


def _remove_listed(private_dir: str) -> None:
    try:
        with open(os.path.join(private_dir, REMOVE_WITH_FILE), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        try:
            inode, path = json.loads(line)
            st = os.lstat(path)
            if st.st_ino != inode:
                continue  # another file there now
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except (OSError, ValueError, TypeError):
            continue


def remove_private_dir(path: str) -> None:
    """Remove a fleet's private directory, unlinking first the shm names its engines listed and
    what it was asked to take with it (``remove_with``)."""
    sweep_shm_lists(path, everything=True)
    _remove_listed(path)
    shutil.rmtree(path, ignore_errors=True)


def unlink_segments_of(pid: int) -> None:
    """Unlink the weight-update segments a dead process created (``weights.shm`` names them
    ``rf-<pid>-...``): it can no longer, and they hold memory until unlinked."""
    prefix = f"rf-{pid}-"
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, name))


def unlink_if_same(path: str, inode: int) -> None:
    """Unlink ``path`` if it is still the file of that inode (not one bound there since)."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)


def sweep_private_dirs(root: str, prefix: str = "rollfleet-") -> list[str]:
    """Remove the private directories under ``root`` whose owner process (a supervisor, a
    node agent) is gone (their socket files and logs), unlinking first the shm names their
    engines listed, and those left empty by an owner killed while making one. Other
    directories without an owner file (not ours) and other users' are left alone."""
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        return []
    for name in names:
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, OWNER_FILE)) as f:
                pid_text, start_text = f.read().split()
            pid, start = int(pid_text), float(start_text)
        except (OSError, ValueError):
            if _unclaimed(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        if _alive(pid, start):
            continue
        remove_private_dir(path)
        removed.append(path)
    if removed:
        logger.warning("removed %d private directories left by dead supervisors or node agents: %s", len(removed), ", ".join(removed))
    return removed


def sweep_stale_segments() -> list[str]:
    """Unlink the shm transport's segments whose creator is gone: a supervisor killed with its
    workers during a weight update (its process group sent SIGKILL) left them, as nobody was
    left to unlink them; until this, only the next shm update swept them."""
    from ..weights.shm_names import sweep_stale

    gone = sweep_stale()
    if gone:
        logger.warning("unlinked %d shared-memory segments left by dead processes: %s", len(gone), ", ".join(gone))
    return gone


def _unclaimed(path: str) -> bool:
    try:
        st = os.stat(path)
        if st.st_uid != os.getuid() or time.time() - st.st_mtime < UNCLAIMED_AGE_S:
            return False
        entries = os.listdir(path)
        return all(e == OWNER_FILE and os.path.getsize(os.path.join(path, e)) == 0 for e in entries)
    except OSError:
        return False


def _alive(pid: int, start_time: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - start_time) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def is_resource_tracker(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a Python multiprocessing resource tracker: once every process that
    writes to it is gone, it unlinks what they registered and did not release (semaphores,
    shared memory) and exits. Killing it first leaves those in /dev/shm."""
    try:
        return any("multiprocessing.resource_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def kill_tree(pid: int, sig: int = signal.SIGKILL, include_parent: bool = True,
              spare: Callable[[psutil.Process], bool] | None = None) -> None:
    """Send ``sig`` to a process and all its descendants (but those ``spare(proc)`` is true
    for); vanished processes are fine."""
    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True)
        if include_parent:
            procs.append(parent)
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        if spare is not None and spare(proc):
            continue
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
        # The child inherits the mask: the signals that would end it before its handlers are in
        # place wait for them (actors.boot unblocks them).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED_AT_SPAWN) if hasattr(signal, "pthread_sigmask") \
            else None
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "rollfleet.actors.boot"],  # its first steps hold signals (actors.boot)
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=child_env,
                pass_fds=(death_r,),
                close_fds=True,
            )
        finally:
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
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

    def kill_descendants(self, spare: Callable[[psutil.Process], bool] | None = None) -> None:
        for proc in list(self._descendants.values()):
            try:
                # (is_running also tells a reused pid: it compares creation times)
                if proc.is_running() and not (spare is not None and spare(proc)):
                    proc.kill()
            except psutil.Error:
                pass

    def _end_trackers(self, grace_s: float = 1.0) -> None:
        """The resource trackers kill() spared exit by themselves, cleaning up, once the
        worker and its other descendants are gone; any still running after ``grace_s`` is
        killed."""
        left = []
        for proc in self._descendants.values():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(proc)
            except psutil.Error:
                pass
        if left:
            _, alive = psutil.wait_procs(left, timeout=grace_s)
            for proc in alive:
                try:
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
            # First say on the death pipe that this SIGTERM is ours: a worker sent SIGTERM by
            # anyone else waits a moment to see whether its supervisor is going too.
            try:
                os.write(self._death_w, b"t")
            except OSError:
                pass
            kill_tree(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        # Descendants matter: vLLM's engine core runs in a grandchild. Resource trackers are
        # left to clean up after the others (close() ends them).
        self.remember_descendants()
        kill_tree(self.pid, signal.SIGKILL, spare=is_resource_tracker)
        self.kill_descendants(spare=is_resource_tracker)

    def close(self) -> None:
        """Reap the process and release fds. Call after it has exited (or been killed)."""
        self.kill_descendants(spare=is_resource_tracker)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            self.popen.wait(timeout=5)
        self._end_trackers()
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
