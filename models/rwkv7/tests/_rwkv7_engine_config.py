"""Subprocess: build vLLM's engine config for each case and report the outcome as JSON.

``python _rwkv7_engine_config.py CASES_JSON OUT_JSON`` where each case is
``[name, model_dir, engine_kwargs]``. Only the configuration stage runs (the
same code path `vllm serve` and `vllm.LLM` take before starting an engine).
"""

import json
import sys


def main(cases_path, out_path):
    from vllm.engine.arg_utils import EngineArgs

    base = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20}
    out = {}
    for name, model, kwargs in json.loads(open(cases_path).read()):
        try:
            EngineArgs(model=model, **{**base, **kwargs}).create_engine_config()
            out[name] = "OK"
        except Exception as exc:  # the message is what the user sees
            out[name] = f"{type(exc).__name__}: {exc}"
    open(out_path, "w").write(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
