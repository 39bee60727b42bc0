"""Run ``mlx_lm.server`` the way users do - a subprocess listening on loopback - and talk to it.

``serve(model, *args, env=..., python=...)`` starts ``python -m mlx_lm.server --model MODEL
--host 127.0.0.1 --port PORT *args`` on a free port, waits until ``/health`` answers, yields a
:class:`Server` and stops the process (terminate, then kill) when the block ends::

    with serve("path/to/model", "--draft-model", "path/to/draft", env=env) as server:
        client = server.client()              # openai.OpenAI(base_url=server.base_url, ...)
        reply = client.chat.completions.create(model="default_model", messages=[...])
        body = server.post("/v1/chat/completions", {...})   # raw JSON, every field the release sends

The server's stdout and stderr go to one log file; :meth:`Server.log_tail` shows its end (tests
attach it to failure reports). If the process exits before it is ready, :class:`ServerExited`
carries its return code and log tail. Nothing here waits without a timeout.

``serve(model, ..., ranks=2)`` starts it the way distributed users do: ``mlx.launch -n 2 --backend
ring -- python -m mlx_lm.server ...`` on this machine (every rank a local process; rank 0 serves
HTTP, the others follow it through MLX collectives). The launcher and its ranks share a new process
group, which :meth:`Server.stop` ends as a whole (``mlx.launch`` does not pass a SIGTERM on to its
ranks). ``entry`` replaces ``-m mlx_lm.server`` (a test's own script that runs its ``main()``).

``python -m mlx_lm.server`` with the package installed runs the patched module (the package's
bootstrap makes ``-m mlx_lm.X`` run the imported module's ``main()``); pass
``env=dict(..., MLX_LM_PATCHES="0")`` for stock mlx-lm. ``openai`` is imported only by
:meth:`Server.client`.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Mapping, Optional

__all__ = ["Server", "ServerExited", "free_port", "launcher", "run_ranks", "serve", "server_flags"]

HOST = "127.0.0.1"


class ServerExited(RuntimeError):
    """The server process ended, or never became ready, or says it cannot generate (``/health``
    503: its generation thread died, 0.32+). The message ends with the log's tail; ``log`` is
    the whole log."""

    def __init__(self, message: str, returncode: Optional[int], log: str):
        super().__init__(f"{message}\n--- mlx_lm.server log (tail) ---\n{_tail(log, 60)}")
        self.returncode = returncode
        self.log = log
        self.log_tail = _tail(log, 60)


def _tail(log: str, lines: int) -> str:
    """The last ``lines`` lines of a server log, without the readiness polls (``GET /health``)."""
    kept = [line for line in log.splitlines() if '"GET /health ' not in line]
    return "\n".join(kept[-lines:])


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(count: int, host: str = HOST) -> int:
    """The first of ``count`` consecutive TCP ports that can all be bound right now, below the
    kernel's ephemeral range. ``mlx.launch --backend ring`` listens on ``--starting-port`` and the
    ports after it; a port the OS picked (``free_port``) is in the ephemeral range, so the ones
    after it can be taken at any moment by another process's outgoing connections (in CI: the
    other matrix row's HTTP clients), and a rank then fails with "Couldn't bind socket"."""
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, 32000 - count)
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind((host, port))
            except OSError:
                continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports found on {host}")


@functools.lru_cache(maxsize=None)
def server_flags(python: Optional[str] = None) -> frozenset:
    """The command-line flags ``mlx_lm.server`` of ``python``'s environment accepts (from its
    ``--help``, asked once per interpreter): ``--draft-model``, ``--prefill-step-size``, ...
    differ between releases."""
    proc = subprocess.run([python or sys.executable, "-m", "mlx_lm.server", "--help"],
                          capture_output=True, text=True, timeout=120, cwd="/")
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", proc.stdout))


def launcher(python: Optional[str] = None) -> str:
    """The ``mlx.launch`` script of ``python``'s environment (beside the interpreter)."""
    return str(pathlib.Path(python or sys.executable).parent / "mlx.launch")


class Server:
    """A running ``mlx_lm.server`` subprocess."""

    def __init__(self, process: subprocess.Popen, port: int, log_path: pathlib.Path,
                 host: str = HOST, group: bool = False, ranks: int = 1):
        self.process = process
        self.group = group  # the process leads a process group of its own (``mlx.launch``)
        self.ranks = ranks
        self.calmed = False  # the launcher's own threads run at the lowest priority
        self.host = host
        self.port = port
        self.log_path = log_path
        self.base_url = f"http://{host}:{port}/v1"

    # -- talking to it ------------------------------------------------------------------------
    def client(self, timeout: float = 120.0, max_retries: int = 0):
        """An ``openai.OpenAI`` client for this server (no retries: a failure shows at once)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="x", timeout=timeout,
                             max_retries=max_retries)

    def request(self, method: str, path: str, body=None, timeout: float = 120.0):
        """``(status, raw bytes)`` of one HTTP request; ``body`` is sent as JSON."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def post(self, path: str, body: Mapping, timeout: float = 120.0) -> dict:
        """POST ``body`` as JSON and return the decoded JSON answer; raises ``RuntimeError``
        with the status and body on a non-200 answer."""
        status, raw = self.request("POST", path, dict(body), timeout=timeout)
        if status != 200:
            raise RuntimeError(f"POST {path} -> HTTP {status}: {raw[:2000].decode(errors='replace')}")
        return json.loads(raw)

    # -- its state ----------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        """The end of the log, without the readiness polls."""
        return _tail(self.log(), lines) if self.log_path.exists() else "(no log)"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        """Until ``/health`` answers 200; raises :class:`ServerExited` if the process ends,
        ``/health`` answers 503 (the generation thread died, 0.32+) or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if self.ranks > 1 and not self.calmed:
                self.calmed = _calm_launcher(self.process.pid, self.ranks)
            if not self.alive():
                raise ServerExited(f"mlx_lm.server exited with code {self.process.returncode} "
                                   "before it was ready", self.process.returncode, self.log())
            try:
                status, body = self.request("GET", "/health", timeout=2.0)
                if status == 200:
                    return
                if status == 503:
                    raise ServerExited(f"mlx_lm.server is up but cannot generate (/health: "
                                       f"{body.decode(errors='replace')})", None, self.log())
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ServerExited(f"mlx_lm.server not ready after {timeout:.0f}s", None, self.log())
            time.sleep(0.1)

    def group_alive(self) -> bool:
        """Whether any process of the launcher's group (a rank) is still running."""
        if self.alive() or not self.group:  # poll() also reaps an exited launcher
            return self.alive()
        try:
            os.killpg(self.process.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """Terminate the process (kill it if it does not exit within ``timeout``); with ranks,
        the launcher's whole process group."""
        if self.group:
            return self._stop_group(timeout)
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        return self.process.returncode

    def _stop_group(self, timeout: float) -> Optional[int]:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + timeout
            while self.group_alive() and time.monotonic() < deadline:
                if self.alive():
                    try:
                        self.process.wait(0.1)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    time.sleep(0.1)
            if not self.group_alive():
                break
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        return self.process.returncode


def _calm_launcher(pid: int, ranks: int) -> bool:
    """Once ``mlx.launch`` (``pid``) has started its ``ranks`` processes, lower the priority of
    its own threads to the lowest (nice 19); the ranks, already running, keep theirs. Its
    output-forwarding loops never block (they ``select`` on the ranks' always-writable stdin
    pipes, and on our stdin): it takes more than a core for as long as it runs, taken from the
    ranks and from whatever else runs on the machine (in CI: another matrix row). Whether the
    ranks had started (so that it is done)."""
    children = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = pathlib.Path(entry.path, "stat").read_text()
            except OSError:
                continue
            children += int(stat.rpartition(")")[2].split()[1]) == pid
    if children < ranks:
        return False
    with contextlib.suppress(OSError):
        for task in os.scandir(f"/proc/{pid}/task"):  # niceness is per thread on Linux
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(task.name), 19)
    return True


def run_ranks(script, *args: str, ranks: int = 2, env: Optional[Mapping[str, str]] = None,
              python: Optional[str] = None, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """Run ``python SCRIPT *args`` on ``ranks`` local ranks (``mlx.launch -n RANKS --backend
    ring``) to the end; their output (stdout and stderr, merged) in ``.stdout``. The whole process
    group is killed after ``timeout`` seconds (``returncode`` None then). ``mlx.launch`` exits 0
    when a rank failed (it only warns); ``returncode`` is 1 then."""
    python = python or sys.executable
    env = dict(os.environ if env is None else env)
    env.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryFile() as out:
        process = subprocess.Popen(_launch_argv(python, ranks, str(script), *map(str, args)), stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=subprocess.STDOUT, env=env, cwd="/", start_new_session=True)
        deadline, calmed, code = time.monotonic() + timeout, False, None
        while code is None and time.monotonic() < deadline:
            calmed = calmed or _calm_launcher(process.pid, ranks)
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = process.wait(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        out.seek(0)
        output = out.read().decode(errors="replace")
        if code == 0 and re.search(r"Node with rank \d+ (exited with code|was killed)", output):
            code = 1
        return subprocess.CompletedProcess(process.args, code, output)


def _launch_argv(python: str, ranks: int, script: str, *args: str) -> list:
    """``mlx.launch`` running ``python SCRIPT *args`` on ``ranks`` local ranks, each through
    ``rank_main.py`` (a kernel cache of its own)."""
    chosen = ["--python", python] if "--python" in _launcher_flags(launcher(python)) else []  # mlx >= 0.30
    return [launcher(python), "-n", str(ranks), "--backend", "ring", *chosen,
            "--starting-port", str(free_ports(ranks)), "--", str(RANK_MAIN), script, *args]


@functools.lru_cache(maxsize=None)
def _launcher_flags(path: str) -> frozenset:
    """The options an ``mlx.launch`` accepts (from its ``--help``, asked once per launcher)."""
    proc = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
    return frozenset(re.findall(r"--[a-z][a-z-]+", proc.stdout))


RANK_MAIN = pathlib.Path(__file__).with_name("rank_main.py")  # each rank: a kernel cache of its own


def _script(python: str, entry) -> str:
    """The script that runs ``python *entry`` (``-m mlx_lm.server``: its console script). Every
    ``mlx.launch`` runs a script file with ``--python PYTHON`` (mlx 0.30+; before, with its own
    interpreter: the one beside it); those before mlx 0.32 take any existing file as the script,
    the interpreter's own path included, so ``-- python -m mlx_lm.server`` does not work there."""
    if tuple(entry) == ("-m", "mlx_lm.server"):
        return str(pathlib.Path(python).parent / "mlx_lm.server")
    if len(entry) == 1 and pathlib.Path(entry[0]).is_file():
        return str(pathlib.Path(entry[0]).resolve())
    raise ValueError(f"mlx.launch cannot run {python} {' '.join(entry)}: give a script file")


@contextlib.contextmanager
def serve(model, *args: str, env: Optional[Mapping[str, str]] = None,
          python: Optional[str] = None, port: Optional[int] = None,
          ready_timeout: float = 180.0, log_dir=None, cwd="/", ranks: int = 1,
          entry=("-m", "mlx_lm.server")) -> Iterator[Server]:
    """Start ``python -m mlx_lm.server --model MODEL --host 127.0.0.1 --port PORT *args``.

    Args:
        model: Model folder (or anything ``--model`` accepts).
        args: More command-line arguments (``"--draft-model", path``, ...).
        env: The whole environment of the process (default: this one with
            ``HF_HUB_OFFLINE=1``). Tests pass a clean one.
        python: Interpreter (default: this one).
        port: Port (default: a free one).
        ready_timeout: Seconds to wait for ``/health``.
        log_dir: Where the log file goes (default: a temporary directory, removed afterwards).
        cwd: Working directory of the server (default ``/``: no stray ``mtp`` folder).
        ranks: More than 1: ``mlx.launch -n RANKS --backend ring`` (the ``mlx.launch`` beside
            ``python``) runs that many local ranks.
        entry: What follows ``python`` (default ``-m mlx_lm.server``).
    """
    env = dict(os.environ if env is None else env)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="mlx-lm-server-"))
        log_path = pathlib.Path(log_dir) / f"server-{os.getpid()}-{time.monotonic_ns()}.log"
        port = port or free_port()
        python = python or sys.executable
        argv = [python, *entry, "--model", str(model), "--host", HOST, "--port", str(port),
                *map(str, args)]
        if ranks > 1:
            argv = _launch_argv(python, ranks, _script(python, entry), *argv[1 + len(entry):])
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file,
                                       stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                       start_new_session=ranks > 1)
        server = Server(process, port, log_path, group=ranks > 1, ranks=ranks)
        try:
            server.wait_ready(ready_timeout)
            yield server
        finally:
            server.stop()

