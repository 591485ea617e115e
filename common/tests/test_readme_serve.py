"""The README's `vllm serve DIR`, run as written from the environment the README's commands make, answers over
HTTP (issue #48, item 1).

The command line is read from README.md (its "Set-up" section: the `vllm serve` line of the block that
activates the environment), DIR replaced by the demo's tiny RWKV-7. `vllm` is the environment's own command
(its bin folder first on PATH, as `source .../bin/activate` does). Only `--host`/`--port` are appended, so
that the test does not take port 8000, and the KV cache is sized through the environment
(`VLLM_CPU_KVCACHE_SPACE`, docs/serve.md's advice for small CPU machines): the command line is the README's.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from ascend_adapters.common.server import ServerStartError, VllmServer

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def readme_serve_line() -> list[str]:
    """The README's `vllm serve ...` command (its comment dropped), split as a shell would."""
    text = (ROOT / "README.md").read_text()
    setup = text[text.index("## Set-up") : text.index("\n## ", text.index("## Set-up") + 1)]
    blocks = re.findall(r"```bash\n(.*?)```", setup, flags=re.S)
    lines = [line for block in blocks for line in block.splitlines() if line.strip().startswith("vllm serve ")]
    assert len(lines) == 1, f"expected one `vllm serve` line in README.md's Set-up section, found {lines}"
    return shlex.split(lines[0], comments=True)


def test_readme_names_the_command_and_the_environment():
    text = (ROOT / "README.md").read_text()
    assert readme_serve_line() == ["vllm", "serve", "DIR"]
    assert "source .nox/env-all/bin/activate" in text


@pytest.fixture(scope="module")
def tiny_rwkv7(tmp_path_factory) -> Path:
    from ascend_adapters.rwkv7.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("readme") / "tiny-rwkv7")


def test_readme_vllm_serve_answers_completions(tiny_rwkv7, tmp_path):
    bin_dir = Path(sys.executable).parent
    argv = [str(tiny_rwkv7) if a == "DIR" else a for a in readme_serve_line()]
    exe = shutil.which(argv[0], path=str(bin_dir))
    assert exe == str(bin_dir / "vllm"), f"no `vllm` command in {bin_dir}"
    env = {
        "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),
        "VIRTUAL_ENV": str(bin_dir.parent),
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes most of this machine's memory
        "HF_HUB_OFFLINE": "1",
    }
    srv = VllmServer(tiny_rwkv7, [], env=env, startup_timeout=600, log_path=tmp_path / "serve.log")
    srv.cmd = [exe, *argv[1:], "--host", "127.0.0.1", "--port", str(srv.port)]
    try:
        with srv:
            body = srv.complete("The", max_tokens=4)
            log = srv.log_text()
    except ServerStartError as exc:
        pytest.fail(f"`{shlex.join(argv)}` did not start:\n{exc}")
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] == "length", body
    assert body["usage"]["completion_tokens"] == 4, body
    assert "PackageNotFoundError" not in log
    # the adapter served it (vLLM's own registry has no RWKV-7)
    assert "Rwkv7ForCausalLM" in log or "RWKV7ForCausalLM" in log, log[-3000:]
