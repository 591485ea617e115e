"""common.policy: one way to hook vLLM's per-architecture config checks (vLLM's real table)."""

from __future__ import annotations

import pytest
from vllm.model_executor.models.config import MODELS_CONFIG_MAP, MambaModelConfig, VerifyAndUpdateConfig

from ascend_adapters.common.policy import EXPERT_OPS, install_policy

ARCH = "AscendAdaptersPolicyTestForCausalLM"


@pytest.fixture
def table_entry():
    """A made-up architecture in vLLM's table, with a vLLM-side class that records its calls."""
    calls = []

    class VllmSide(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            calls.append(("vllm", vllm_config))

        @staticmethod
        def verify_and_update_model_config(model_config) -> None:
            calls.append(("vllm-model", model_config))

    MODELS_CONFIG_MAP[ARCH] = VllmSide
    try:
        yield VllmSide, calls
    finally:
        MODELS_CONFIG_MAP.pop(ARCH, None)


def test_parent_first_then_adapter(table_entry):
    vllm_side, calls = table_entry

    def check(vllm_config):
        calls.append(("adapter", vllm_config))

    def check_model(model_config):
        calls.append(("adapter-model", model_config))

    assert install_policy([ARCH], check, check_model=check_model, name="TestPolicy") == [ARCH]
    cls = MODELS_CONFIG_MAP[ARCH]
    assert issubclass(cls, vllm_side) and cls.__name__ == "TestPolicy"
    cls.verify_and_update_model_config("mc")
    cls.verify_and_update_config("vc")
    assert calls == [("vllm-model", "mc"), ("adapter-model", "mc"), ("vllm", "vc"), ("adapter", "vc")]


def test_refusal_propagates_after_vllm_ran(table_entry):
    _, calls = table_entry

    def check(vllm_config):
        raise ValueError("adapter refuses: the reason and the fix")

    install_policy([ARCH], check)
    with pytest.raises(ValueError, match="adapter refuses"):
        MODELS_CONFIG_MAP[ARCH].verify_and_update_config("vc")
    assert calls == [("vllm", "vc")]


def test_idempotent_and_kept_under_a_subclass(table_entry):
    def check(vllm_config):
        pass

    assert install_policy([ARCH], check) == [ARCH]
    first = MODELS_CONFIG_MAP[ARCH]
    assert install_policy([ARCH], check) == []
    assert MODELS_CONFIG_MAP[ARCH] is first

    class SomeoneElses(first):  # another plugin wrapped ours: ours still runs, so leave it
        pass

    MODELS_CONFIG_MAP[ARCH] = SomeoneElses
    assert install_policy([ARCH], check) == []
    assert MODELS_CONFIG_MAP[ARCH] is SomeoneElses


def test_base_joins_the_mapped_class(table_entry):
    vllm_side, calls = table_entry
    seen = []

    def check(vllm_config):
        seen.append(vllm_config.cache_config.mamba_block_size)

    install_policy([ARCH], check, base=MambaModelConfig)
    cls = MODELS_CONFIG_MAP[ARCH]
    assert issubclass(cls, vllm_side) and issubclass(cls, MambaModelConfig)

    class Cfg:  # only the attributes MambaModelConfig reads and writes
        class model_config:
            max_model_len = 77
            architecture = ARCH

        class cache_config:
            enable_prefix_caching = False
            mamba_cache_mode = "none"
            mamba_block_size = None

    cls.verify_and_update_config(Cfg)
    # vLLM's entry ran, then MambaModelConfig sized the state block, then the adapter's check
    assert calls == [("vllm", Cfg)] and seen == [77]


def test_base_runs_when_the_mapped_class_has_no_hook_of_its_own():
    class ModelOnly(VerifyAndUpdateConfig):  # like vLLM's DeepseekV4ForCausalLMConfig
        pass

    MODELS_CONFIG_MAP[ARCH] = ModelOnly
    seen = []
    try:
        install_policy([ARCH], lambda c: seen.append(c.cache_config.mamba_block_size), base=MambaModelConfig)

        class Cfg:
            class model_config:
                max_model_len = 77
                architecture = ARCH

            class cache_config:
                enable_prefix_caching = False
                mamba_cache_mode = "none"
                mamba_block_size = None

        MODELS_CONFIG_MAP[ARCH].verify_and_update_config(Cfg)
        assert seen == [77]  # MambaModelConfig sized the state block before the adapter's check ran
    finally:
        MODELS_CONFIG_MAP.pop(ARCH, None)


def test_no_vllm_entry_gives_a_plain_hook():
    MODELS_CONFIG_MAP.pop(ARCH, None)
    seen = []
    try:
        install_policy([ARCH], seen.append)
        cls = MODELS_CONFIG_MAP[ARCH]
        assert cls.__mro__[1] is VerifyAndUpdateConfig
        cls.verify_and_update_model_config("mc")
        cls.verify_and_update_config("vc")
        assert seen == ["vc"]
    finally:
        MODELS_CONFIG_MAP.pop(ARCH, None)


def test_speculation_refusal_names_the_method_and_what_is_served():
    from types import SimpleNamespace

    from ascend_adapters.common.policy import speculation_refusal

    assert speculation_refusal(SimpleNamespace(speculative_config=None), ()) is None
    ngram = SimpleNamespace(speculative_config=SimpleNamespace(method="ngram"))
    assert speculation_refusal(ngram, ("ngram",)) is None
    why = speculation_refusal(ngram, ("mtp",))
    assert "'ngram' is not served" in why and "served: mtp" in why
    assert "served: none" in speculation_refusal(ngram, ())


def test_status_reports_what_each_adapter_class_serves():
    """Pipeline parallelism is read from the class (vLLM's SupportsPP); the speculative methods are the
    ones the adapter's start-up policy accepts (its SPECULATIVE_METHODS); the graph mode from the
    model module's classes under @support_torch_compile and the hook's SPLITTING_OPS."""
    import importlib

    from vllm.model_executor.models.interfaces import supports_pp

    from ascend_adapters.common.registry import ADAPTER, serving_report
    from ascend_adapters.common.status import format_status, status

    rows = [r for r in serving_report() if r["serves"] == ADAPTER]
    assert {r["arch"] for r in rows} >= {"RWKV7ForCausalLM", "GlmMoeDsaForCausalLM", "DeepseekV4ForCausalLM"}
    for r in rows:
        module, _, cls = r["target"].partition(":")
        hook = importlib.import_module(module.rsplit(".", 1)[0])
        want = bool(supports_pp(getattr(importlib.import_module(module), cls)))
        cap = r["capabilities"]
        assert cap["pipeline_parallel"] == want and cap["speculative_methods"] == list(hook.SPECULATIVE_METHODS)
        # graph mode: compiled exactly when the adapter names the ops vLLM must run between pieces
        assert bool(cap["compiled_classes"]) == bool(getattr(hook, "SPLITTING_OPS", ())), r
        # the adapter's ops first, then common's routed-expert ops: the list compile_split_at gives vLLM
        own = list(getattr(hook, "SPLITTING_OPS", ()))
        assert cap["splitting_ops"] == ([*own, *EXPERT_OPS] if own else []), r
    by_arch = {r["arch"]: r["capabilities"] for r in rows}
    assert by_arch["RWKV7ForCausalLM"]["compiled_classes"] == ["Rwkv7Model"]
    assert by_arch["GlmMoeDsaForCausalLM"]["compiled_classes"] == ["GlmDsaModel"]
    assert by_arch["DeepseekV4ForCausalLM"]["compiled_classes"] == ["DeepseekV4Model"]
    text = format_status(status())
    assert "pipeline parallelism: supported (SupportsPP)" in text
    for r in rows:
        hook = importlib.import_module(r["target"].partition(":")[0].rsplit(".", 1)[0])
        methods = ", ".join(hook.SPECULATIVE_METHODS) or "none (refused at start-up)"
        assert f"speculative decoding: {methods}" in text, r["arch"]
    assert "graph mode: compiled by vLLM unless --enforce-eager (@support_torch_compile on GlmDsaModel)" in text
    from ascend_adapters.common.status import _graph_mode

    assert _graph_mode({"compiled_classes": [], "splitting_ops": []}).startswith("eager")


def test_compile_split_at_keeps_compilation_on_and_adds_the_ops(monkeypatch):
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CompilationMode

    from ascend_adapters.common.policy import compile_split_at

    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    cfg = SimpleNamespace(compilation_config=CompilationConfig())
    compile_split_at(cfg, ["vllm::adapter_op"])
    ops = cfg.compilation_config.splitting_ops

    n = len(CompilationConfig._attention_ops)
    assert ops == [*CompilationConfig._attention_ops, "vllm::adapter_op", *EXPERT_OPS]
    assert len(ops) == n + 1 + len(EXPERT_OPS)
    compile_split_at(cfg, ["vllm::adapter_op"])  # idempotent
    assert cfg.compilation_config.splitting_ops == ops
    # vLLM's by-name breakable-graph default (compilation off) is declined, a user's choice is kept
    import os

    assert os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "0"
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    compile_split_at(cfg, [])
    assert os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "1"
    # eager (enforce_eager, mode none): nothing to split
    eager = SimpleNamespace(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    compile_split_at(eager, ["vllm::adapter_op"])
    assert (
        not eager.compilation_config.splitting_ops or "vllm::adapter_op" not in eager.compilation_config.splitting_ops
    )


def _config_asking(**cache):
    from types import SimpleNamespace

    import torch

    cache = {"cache_dtype": "auto", "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", **cache}
    return SimpleNamespace(
        model_config=SimpleNamespace(
            dtype=torch.bfloat16,
            hf_config=SimpleNamespace(hidden_size=64, head_dim=32, num_hidden_layers=2),
            model="/nonexistent",
        ),
        cache_config=SimpleNamespace(enable_prefix_caching=False, **cache),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=None,
    )


@pytest.mark.parametrize(
    "flag, attr, value",
    [
        ("--kv-cache-dtype", "cache_dtype", "fp8"),
        ("--kv-cache-dtype", "cache_dtype", "int8_per_token_head"),
        ("--kv-cache-dtype", "cache_dtype", "fp8_e5m2"),
        ("--kv-cache-dtype", "cache_dtype", "fp8_ds_mla"),
        ("--mamba-ssm-cache-dtype", "mamba_ssm_cache_dtype", "float32"),
    ],
)
def test_every_adapter_refuses_a_cache_dtype_it_does_not_store(flag, attr, value):
    """A cache-dtype flag is honoured or refused at start-up in one line naming the flag and what is served;
    'auto' and the model dtype itself pass, and GLM-DSA's and DeepSeek-V4's 8-bit --kv-cache-dtype fp8 (e4m3)
    and int8_per_token_head (int8) (kernels.kv8)."""
    from ascend_adapters.common.policy import cache_dtype_refusal
    from ascend_adapters.deepseek_v4.policy import check_startup as deepseek_v4_check
    from ascend_adapters.glm_dsa.policy import check_startup as glm_dsa_check
    from ascend_adapters.rwkv7.policy import unsupported_reasons

    config = _config_asking(**{attr: value})
    if value in ("fp8", "int8_per_token_head"):  # GLM-DSA's and DeepSeek-V4's 8-bit caches
        assert cache_dtype_refusal(config, "x", eight_bit=True) is None
    else:
        for check in (glm_dsa_check, deepseek_v4_check):
            with pytest.raises(
                Exception,
                match=rf"{flag} {value} is not served: .* model dtype \(bfloat16\) or 8-bit "
                rf"\(--kv-cache-dtype fp8 / fp8_e4m3 / int8_per_token_head\); serve with {flag} auto"
                if attr == "cache_dtype"
                else rf"{flag} {value} is not served: .* model dtype \(bfloat16\); serve with {flag} auto",
            ):
                check(config)
    assert any(f"{flag} {value} is not served: the recurrent state" in r for r in unsupported_reasons(config))
    assert cache_dtype_refusal(_config_asking(), "x") is None
    assert cache_dtype_refusal(_config_asking(cache_dtype="bfloat16", mamba_cache_dtype="bfloat16"), "x") is None
    assert not unsupported_reasons(_config_asking())


def test_policy_refusal_is_one_line_before_it_propagates(capsys):
    """A start-up refusal is one line on stderr before vLLM's traceback (#48 item 5)."""
    from ascend_adapters.common.policy import REFUSAL_PREFIX, policy_class

    def check(vllm_config):
        raise ValueError("RWKV-7 adapter: 2 heads are not divisible by\n  tensor_parallel_size=4")

    def check_model(model_config):
        raise ValueError("checkpoint and config.json disagree:\n  missing tensor 'x'")

    policy = policy_class(None, check, check_model=check_model)
    with pytest.raises(ValueError, match="not divisible"):
        policy.verify_and_update_config(object())
    assert (
        capsys.readouterr().err
        == f"{REFUSAL_PREFIX} RWKV-7 adapter: 2 heads are not divisible by tensor_parallel_size=4\n"
    )
    with pytest.raises(ValueError, match="disagree"):
        policy.verify_and_update_model_config(object())
    assert capsys.readouterr().err == f"{REFUSAL_PREFIX} checkpoint and config.json disagree: missing tensor 'x'\n"


def test_eight_bit_cache_refused_on_an_npu(monkeypatch):
    """On an Ascend NPU the float8 e4m3 cache is refused at start-up, in one line naming the int8 form: e4m3
    rows have no documented torch_npu kernel on Atlas A2/A3, so it would fail at the first cache write."""
    from ascend_adapters.common import platform
    from ascend_adapters.common.policy import cache_dtype_refusal

    config = _config_asking(cache_dtype="fp8")
    assert cache_dtype_refusal(config, "x", eight_bit=True) is None
    monkeypatch.setattr(platform, "kernel_path", lambda: platform.KernelPath.NPU)
    line = cache_dtype_refusal(config, "the latent cache", eight_bit=True)
    assert line and "\n" not in line and line.startswith("--kv-cache-dtype fp8 is not served on an Ascend NPU"), line
    assert "--kv-cache-dtype int8_per_token_head" in line, line  # the 8-bit form an NPU serves is named
    assert cache_dtype_refusal(_config_asking(), "x", eight_bit=True) is None
    # the int8 form is what npu_dynamic_quant writes: served on an NPU as everywhere
    assert cache_dtype_refusal(_config_asking(cache_dtype="int8_per_token_head"), "x", eight_bit=True) is None
