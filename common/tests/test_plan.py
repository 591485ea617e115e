"""``ascend-adapters plan``: bad inputs refused in one line, what does not fit said, and the figures checked
against the ones vLLM itself reports on each adapter's tiny checkpoint.

The served test starts one engine per adapter (in a subprocess, vLLM's engine core in process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), float32, eager, a fixed KV-cache size, and reads back:

* the weights: every parameter, buffer and tensor attribute of the loaded model (``LLM.apply_model``),
  each storage counted once;
* the cache: vLLM's own ``kv_cache_config`` (its groups, each layer's spec: page bytes, block size and
  ``max_memory_usage_bytes``, what it reserves for one request of ``max_model_len``) and the maximum
  concurrency it logs ("Maximum concurrency for N tokens per request").

and compares them with ``memory_plan`` of the adapter's ``memory.py`` for the same layout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_adapters.common import plan as P
from ascend_adapters.common.cli import main as cli_main

MAX_MODEL_LEN = 512
BATCHED = 256  # max_num_batched_tokens: sizes the sliding caches' reservation (DeepSeek-V4)
KV_BYTES = 64 << 20  # the KV cache given to vLLM (kv_cache_memory_bytes)
KV8_CACHE_DTYPE = "fp8"  # GLM-DSA and DeepSeek-V4 served a second time with their 8-bit caches (*_kv8)


# --- no engine -------------------------------------------------------------------------------------------


def _run_cli(*argv, capsys):
    rc = cli_main(["plan", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _write_config(d: Path, cfg: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def configs():
    """config.json of each tiny checkpoint, as its maker writes it (no weights needed)."""
    from ascend_adapters.deepseek_v4.tiny import TINY_CONFIG as DSV4
    from ascend_adapters.glm_dsa.tiny import TINY_CONFIG as GLM

    rwkv7 = {
        "architectures": ["RWKV7ForCausalLM"],
        "model_type": "rwkv7",
        "hidden_size": 64,
        "head_dim": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "vocab_size": 65536,
        "decay_low_rank_dim": 16,
        "a_low_rank_dim": 16,
        "v_low_rank_dim": 8,
        "gate_low_rank_dim": 32,
        "torch_dtype": "float32",
    }
    return {
        "rwkv7": rwkv7,
        "glm_dsa": {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", **GLM},
        "deepseek_v4": {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **DSV4},
    }


@pytest.mark.parametrize(
    "case, cfg_text, args, expect",
    [
        ("missing", None, [], "config.json: unreadable"),
        ("garbage", "{not json", [], "not valid JSON"),
        ("array", "[1, 2]", [], "not a JSON object"),
        ("no_arch", json.dumps({"model_type": "x"}), [], "names no architectures"),
        ("unknown", json.dumps({"architectures": ["LlamaForCausalLM"]}), [], "is not one of the installed adapters'"),
    ],
)
def test_bad_config_refused_in_one_line(tmp_path, capsys, case, cfg_text, args, expect):
    d = tmp_path / case
    d.mkdir()
    if cfg_text is not None:
        (d / "config.json").write_text(cfg_text)
    rc, out, err = _run_cli(d, "--device", "910B", "--tp", 1, "--max-model-len", 4096, *args, capsys=capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("ascend-adapters plan: ") and expect in err, err


@pytest.mark.parametrize(
    "model, args, expect",
    [
        ("rwkv7", ["--tp", 4], "--tp 4 does not divide the 2 heads"),
        ("glm_dsa", ["--tp", 3], "--tp 3 does not divide the 4 attention heads"),
        ("deepseek_v4", ["--tp", 3], "--tp 3 does not divide"),
        ("rwkv7", ["--tp", 1, "--pp", 3], "--pp 3 exceeds the 2 layers"),
        ("glm_dsa", ["--tp", 1, "--max-model-len", 1 << 20], "exceeds max_position_embeddings"),
        ("rwkv7", ["--tp", 0], "must be at least 1"),
    ],
)
def test_bad_layout_refused_in_one_line(tmp_path, capsys, configs, model, args, expect):
    d = _write_config(tmp_path / model, configs[model])
    if "--max-model-len" not in args:
        args = [*args, "--max-model-len", 512]
    rc, out, err = _run_cli(d, "--device", "910C", *args, capsys=capsys)
    assert rc == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and expect in err, err


@pytest.mark.parametrize(
    "model, field, value",
    [("rwkv7", "hidden_size", "wide"), ("glm_dsa", "kv_lora_rank", [512]), ("deepseek_v4", "layer_types", 7)],
)
def test_bad_config_field_refused_in_one_line(tmp_path, capsys, configs, model, field, value):
    d = _write_config(tmp_path / model, {**configs[model], field: value})
    rc, out, err = _run_cli(d, "--device", "910B", "--tp", 1, "--max-model-len", 512, capsys=capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("ascend-adapters plan: "), err


def test_bad_device_refused_by_argparse(tmp_path, capsys, configs):
    d = _write_config(tmp_path / "r", configs["rwkv7"])
    with pytest.raises(SystemExit) as exc:
        cli_main(["plan", str(d), "--device", "H100", "--tp", "1", "--max-model-len", "512"])
    assert exc.value.code == 2
    assert "invalid choice: 'H100'" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["rwkv7", "glm_dsa", "deepseek_v4"])
def test_plan_answers_and_counts_requests(tmp_path, capsys, configs, model):
    d = _write_config(tmp_path / model, configs[model])
    rc, out, err = _run_cli(
        d, "--device", "910B", "--tp", 2, "--pp", 2, "--max-model-len", 512, "--json", capsys=capsys
    )
    assert rc == 0, err
    p = json.loads(out)
    assert p["devices"] == 4 and len(p["stages"]) == 2 and not p["problems"]
    assert p["usable_bytes"] == int(64 * P.GIB * 0.9)
    for s in p["stages"]:
        # the count is the floor of what is left after the weights over one request's cache
        assert (
            s["requests"] * s["request_cache_bytes"] <= s["free_bytes"] < (s["requests"] + 1) * s["request_cache_bytes"]
        )
    assert p["requests"] == min(s["requests"] for s in p["stages"])


def test_kv_cache_dtype_fp8_for_glm_dsa_and_refused_by_rwkv7(tmp_path, capsys, configs):
    """``--kv-cache-dtype fp8`` (and ``int8_per_token_head``, the same bytes): GLM-DSA's rows one byte a value
    plus a float32 scale a part (kv_c, k_pe, indexer key: ``kv_lora_rank + rope + index_head_dim + 12`` bytes
    against ``2x`` the values in bfloat16); RWKV-7, whose recurrent state is stored in the served dtype only,
    refuses it in one line (exit 2)."""
    d = _write_config(tmp_path / "glm", configs["glm_dsa"])
    args = [d, "--device", "910B", "--tp", 1, "--max-model-len", 1024, "--dtype", "bfloat16", "--json"]
    plans = {}
    for dtype in ("auto", "fp8", "int8_per_token_head"):
        rc, out, err = _run_cli(*args, "--kv-cache-dtype", dtype, capsys=capsys)
        assert rc == 0, err
        plans[dtype] = json.loads(out)["stages"][0]
    cfg = configs["glm_dsa"]
    values = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + cfg["index_head_dim"]  # 1024 > index_topk: sparse
    pages = -(-1024 // P.BLOCK_SIZE) * cfg["num_hidden_layers"] * P.BLOCK_SIZE
    assert plans["auto"]["request_cache_bytes"] == pages * values * 2
    assert plans["fp8"]["request_cache_bytes"] == pages * (values + 3 * 4)
    assert plans["int8_per_token_head"]["request_cache_bytes"] == plans["fp8"]["request_cache_bytes"]
    d = _write_config(tmp_path / "rwkv7", configs["rwkv7"])
    for dtype in ("fp8", "int8_per_token_head"):
        rc, out, err = _run_cli(d, *args[1:-1], "--kv-cache-dtype", dtype, capsys=capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert f"--kv-cache-dtype {dtype}: " in err and "stored in the served dtype only" in err, err


def test_what_does_not_fit_is_said(tmp_path, capsys, configs):
    """A device with room for the weights and half a request: exit 1, the line names the cache, what is left
    and the longest max_model_len that fits (which itself fits, and one block more does not); a device
    with room for half the weights: exit 1, the weights named."""
    from ascend_adapters.glm_dsa.memory import memory_plan

    d = _write_config(tmp_path / "glm", configs["glm_dsa"])
    length = 1024
    stage = memory_plan(configs["glm_dsa"], P.Request(1, 1, length, "float32", 16)).stages[0]
    # device memory (GiB) whose 0.9 holds the weights and half of one request's cache
    gib = (stage.weight_bytes + stage.request_cache_bytes // 2) / P.GPU_MEMORY_UTILIZATION / P.GIB
    common = ["--device", "910B", "--tp", 1, "--dtype", "float32", "--block-size", 16, "--device-memory-gib", gib]
    rc, out, _ = _run_cli(d, *common, "--json", "--max-model-len", length, capsys=capsys)
    p = json.loads(out)
    assert rc == 1 and len(p["problems"]) == 1, p
    line = p["problems"][0]
    assert f"one request of {length} tokens does not fit" in line and "--max-model-len" in line, line
    longest = int(line.split("--max-model-len ")[1].split()[0])
    assert 0 < longest < length
    for n, fits in ((longest, True), (longest + 16, False)):
        rc, out, _ = _run_cli(d, *common, "--json", "--max-model-len", n, capsys=capsys)
        assert (rc == 0) == fits and (json.loads(out)["requests"] >= 1) == fits, n
    half = stage.weight_bytes / 2 / P.GIB
    rc, out, _ = _run_cli(d, *common[:-1], half, "--max-model-len", length, capsys=capsys)
    assert rc == 1 and "DOES NOT FIT: the weights do not fit" in out, out


def test_deepseek_v4_plan_agrees_with_the_memory_table(tmp_path):
    """On DeepSeek-V4-Flash's shape (``memory.flash_config``) at TP8 (the adapter's widest: TP must divide its
    8 output groups) the cache a request of L reserves is at
    least what it holds (``request_cache_bytes``: the sliding caches reserve a scheduler step more), and the
    weights per rank are within 1% of ``weight_bytes_per_device`` (the plan also counts the norms, sinks and
    compressor biases that function leaves out, and pads the vocabulary)."""
    from ascend_adapters.deepseek_v4 import memory as M

    cfg = M.flash_config()
    raw = {"architectures": ["DeepseekV4ForCausalLM"], **cfg.to_dict()}
    req = P.Request(tp=8, pp=1, max_model_len=131072, dtype="bfloat16")
    mm = M.memory_plan(raw, req)
    stage = mm.stages[0]
    assert stage.request_cache_bytes >= M.request_cache_bytes(cfg, 131072)
    ref = M.weight_bytes_per_device(cfg, 8, 8)
    assert abs(stage.weight_bytes - ref) / ref < 0.01, (stage.weight_bytes, ref)


DOCS = Path(__file__).resolve().parents[2] / "docs"
PLAN_BLOCK = re.compile(r"```console\n\$ ascend-adapters plan (.*?)\n(.*?)\n\$ echo \$\?\n(\d+)\n```", re.S)


def _published_configs(root: Path) -> None:
    """config.json of the shapes the quickstarts plan, from their cited sources: GLM-5 is transformers'
    GlmMoeDsaConfig defaults (docs/references.md#glm5-shape), DeepSeek-V4-Flash ``memory.flash_config``
    (docs/references.md#deepseek-v4-shape)."""
    from transformers import GlmMoeDsaConfig

    from ascend_adapters.deepseek_v4.memory import flash_config

    for name, arch, cfg in (
        ("GLM-5", "GlmMoeDsaForCausalLM", GlmMoeDsaConfig()),
        ("DeepSeek-V4-Flash", "DeepseekV4ForCausalLM", flash_config()),
    ):
        _write_config(root / name, {**cfg.to_dict(), "architectures": [arch]})


def test_quickstart_plans_are_plan_output(tmp_path, capsys, monkeypatch):
    """Every ``ascend-adapters plan`` block of the quickstarts is what the command prints, exit status
    included, on the published shape it names: no figure there is typed by hand."""
    _published_configs(tmp_path)
    monkeypatch.chdir(tmp_path)
    blocks = [
        (doc.name, *m.groups())
        for doc in sorted(DOCS.glob("quickstart-*.md"))
        for m in PLAN_BLOCK.finditer(doc.read_text())
    ]
    assert len(blocks) >= 4, blocks
    for doc, args, shown, status in blocks:
        rc, out, err = _run_cli(*args.split(), capsys=capsys)
        assert (out + err).rstrip("\n") == shown and rc == int(status), f"{doc}: plan {args}\n{out}{err}"


# --- served: vLLM's own figures ------------------------------------------------------------------------


def _held_bytes(model) -> int:
    """Every parameter, buffer and plain tensor attribute of the model (e.g. GLM-DSA's absorbed
    ``W_UK^T``/``W_UV``), each storage once. vLLM's CPU linears hand their weight to a packed GEMM
    (oneDNN, sgl) and leave an empty tensor (``dispatch_cpu_unquantized_gemm``): those are counted at the
    size vLLM built them, this rank's partition (``input_size_per_partition`` x ``output_size_per_partition``,
    or the whole input / output of a replicated linear) in the layer's dtype."""
    import torch

    seen, total = set(), 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if getattr(m, "cpu_linear", None) is not None and isinstance(w, torch.Tensor) and w.numel() == 0:
            rows = getattr(m, "output_size_per_partition", None) or m.output_size
            cols = getattr(m, "input_size_per_partition", None) or m.input_size
            total += rows * cols * w.element_size()
    tensors = list(model.parameters()) + list(model.buffers())
    for m in model.modules():  # the KV cache views bound to attention layers are not weights
        tensors += [v for k, v in vars(m).items() if isinstance(v, torch.Tensor) and k != "kv_cache"]
    for t in tensors:
        if t.device.type == "meta" or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def worker(model_dir: str, out: str, kv_cache_dtype: str = "auto") -> None:
    from vllm import LLM

    llm = LLM(
        model=model_dir,
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=KV_BYTES,
        max_num_batched_tokens=BATCHED,
        max_num_seqs=4,
        enforce_eager=True,
        skip_tokenizer_init=True,
    )
    engine = llm.llm_engine
    vllm_config = engine.vllm_config
    kv = engine.engine_core.engine_core.scheduler.kv_cache_config
    groups = []
    for g in kv.kv_cache_groups:
        spec = g.kv_cache_spec
        groups.append(
            {
                "layers": len(g.layer_names),
                "type": type(spec).__name__,
                "block_size": spec.block_size,
                "page_bytes": spec.page_size_bytes,
                "max_memory_usage_bytes": spec.max_memory_usage_bytes(vllm_config),
            }
        )
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    strides = {getattr(t, "block_stride", None) for t in kv.kv_cache_tensors}
    res = {
        "weights": llm.apply_model(_held_bytes)[0],
        "num_blocks": kv.num_blocks,
        # 0.32's packed layout (DeepSeek-V4's unequal pages): the tensors views at offsets inside one block id
        "block_stride": strides.pop() if len(strides) == 1 and None not in strides else None,
        "packed": any(t.offset for t in kv.kv_cache_tensors),
        "tensor_bytes": sum(t.size for t in kv.kv_cache_tensors),
        "groups": groups,
        "max_concurrency": get_max_concurrency_for_kv_cache_config(vllm_config, kv),
        "block_size": vllm_config.cache_config.block_size,
    }
    Path(out).write_text(json.dumps(res))


@pytest.fixture(scope="module")
def vllm_figures(tmp_path_factory):
    """Each adapter's tiny checkpoint served once, one engine at a time; what vLLM reports."""
    from ascend_adapters.deepseek_v4.tiny import make_tiny as dsv4
    from ascend_adapters.glm_dsa.tiny import make_tiny as glm
    from ascend_adapters.rwkv7.tiny import make_tiny as rwkv7

    root = tmp_path_factory.mktemp("plan")
    out = {}
    makers = {"rwkv7": rwkv7, "glm_dsa": glm, "glm_dsa_kv8": glm, "deepseek_v4": dsv4, "deepseek_v4_kv8": dsv4}
    for name, make in makers.items():
        model_dir = make(root / name)
        res = root / f"{name}.json"
        kv_cache_dtype = KV8_CACHE_DTYPE if name.endswith("_kv8") else "auto"
        # ASCEND_ADAPTERS_PORTABLE_EXPERTS=on: float routed experts on common's portable op, whose weights stay
        # the FusedMoE tensors; vLLM-CPU's prepacked per-expert GEMM (chosen by default on this engine) moves
        # them into GEMM handles no tensor shows, a CPU-only form the NPU does not take
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "ASCEND_ADAPTERS_PORTABLE_EXPERTS": "on",
        }
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", str(model_dir), str(res), kv_cache_dtype],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, f"{name}: " + "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        out[name] = (model_dir, json.loads(res.read_text()))
    return out


# vllm, not gate: the comparison reads vLLM 0.32's own accounting (``max_memory_usage_bytes``, the
# concurrency function), which the older engines of `nox -s compat` lay out differently; it writes no record
@pytest.mark.vllm
@pytest.mark.parametrize("model", ["rwkv7", "glm_dsa", "glm_dsa_kv8", "deepseek_v4", "deepseek_v4_kv8"])
def test_plan_matches_what_vllm_reports(vllm_figures, model):
    model_dir, v = vllm_figures[model]
    raw = json.loads((model_dir / "config.json").read_text())
    arch, memory = P.adapter_memory_module(raw, str(model_dir))
    req = P.Request(
        tp=1,
        pp=1,
        max_model_len=MAX_MODEL_LEN,
        dtype="float32",
        block_size=v["block_size"],
        max_num_batched_tokens=BATCHED,
        kv_cache_dtype=KV8_CACHE_DTYPE if model.endswith("_kv8") else "auto",
    )
    stage = memory.memory_plan(raw, req).stages[0]
    # the weights: exact. Both sides count the same tensors at float32; the tiny checkpoints load every
    # parameter as vLLM builds it (no repacking on this path: the layers are float32, eager)
    assert stage.weight_bytes == v["weights"], (stage.weight_bytes, v["weights"])
    blocks = [-(-g["max_memory_usage_bytes"] // g["page_bytes"]) for g in v["groups"]]
    if v["packed"]:
        # packed (DeepSeek-V4's unequal pages): a block id spans every group's pages, whichever group holds it; a request takes
        # b_g blocks of each group g, vLLM's count is num_blocks / sum(b_g), num_blocks = floor(KV_BYTES /
        # block bytes). The plan: floor(KV_BYTES / (block bytes x sum(b_g))): one floor of the same quotient
        assert stage.request_cache_bytes == sum(blocks) * v["block_stride"], (stage.request_cache_bytes, v)
        assert v["num_blocks"] == KV_BYTES // v["block_stride"], v
        assert KV_BYTES // stage.request_cache_bytes == int(v["max_concurrency"]), v
        return
    # the cache one request of max_model_len reserves: vLLM's specs, every layer of every group (a group's
    # spec is each of its layers'), in whole pages
    reserved = sum(g["layers"] * b * g["page_bytes"] for g, b in zip(v["groups"], blocks))
    assert stage.request_cache_bytes == reserved, (stage.request_cache_bytes, v["groups"])
    # requests that fit in the KV_BYTES vLLM was given. vLLM (``get_kv_cache_config_from_groups``,
    # ``get_max_concurrency_for_kv_cache_config``): its groups of G layers share G tensors, so a block id
    # costs G pages (every cache here has one page size) and num_blocks = floor(KV_BYTES / (G x page)); a
    # request takes b_g blocks of each group g, so vLLM's count is num_blocks / sum(b_g). The plan:
    # floor(KV_BYTES / sum over layers of b x page). When every group holds G layers the two are one
    # floor of the same quotient (floor(floor(x / a) / b) = floor(x / (a b))): equal. A group with fewer
    # layers (vLLM pads it) makes vLLM's count smaller, by at most the padded over the used pages.
    pages = {g["page_bytes"] for g in v["groups"]}
    assert len(pages) == 1, v["groups"]
    widest = max(g["layers"] for g in v["groups"])
    planned = KV_BYTES // stage.request_cache_bytes
    vllm = int(v["max_concurrency"])
    if all(g["layers"] == widest for g in v["groups"]):
        assert planned == vllm, (planned, v["max_concurrency"])
    else:
        padded = widest * sum(blocks) / sum(g["layers"] * b for g, b in zip(v["groups"], blocks))
        assert vllm <= planned <= (vllm + 1) * padded, (planned, v)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(*sys.argv[2:])
