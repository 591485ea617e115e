"""GLM-5.x DSA (``GlmMoeDsaForCausalLM``) for platforms without a native sparse-MLA path.

Reads like vLLM's own model files: attention (MLA + lightning indexer), the MoE
router adaptation, decoder layer, model, then the causal-LM wrapper with
``load_weights``. The MLP and MoE blocks are vLLM's DeepSeek-V2 ones
(``DeepseekV2MLP``, ``DeepseekV2MoE``), as in vLLM's own DSA model; this file
owns only what differs from DeepSeek-V2: the DSA indexer, IndexShare ('shared'
layers) and the absorbed sparse attention in the latent space.

Attention: MLA projections as in the checkpoint; per token the layer caches one
latent row ``[kv_c | k_pe | indexer_k]`` in its own paged cache (a vLLM
attention-like layer with an ``MLAAttentionSpec``) and attends in the latent
space, as vLLM's own MLA does: ``kv_b_proj`` is split after loading into
``W_UK`` (folded into the query) and ``W_UV`` (applied to the output), so the
cache is never re-expanded. Each query attends either to all previous tokens
(dense path: exact while every context is at most ``index_topk``) or only to
the ``index_topk`` rows the lightning indexer selects, gathered from the paged
cache (portable sparse path); "shared" layers reuse the previous full layer's
selection. A step's decodes (and a speculative step's 1 + k tokens per request)
are one batched pass, their requests and contexts derived on the device from
vLLM's metadata tensors, so a decode step can be captured as a graph (see
``backend.py``); a prefill chunk selects over its request's rows in a call of
its own, and on the sparse path every token then attends its selected rows in
one call. See ``config.py`` for how the path is chosen.

Compilation (vLLM's ``@support_torch_compile`` on ``GlmDsaModel``): the cache
write and the attention over the cache are one registered custom op that writes
its outputs in place (``vllm::glm_dsa_attention``; the policy lists it as a
splitting op, as vLLM does for its own MLA), and the compiled graph holds the
projections, the indexer's projections, rotary, norms and the MoE between them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLP, DeepseekV2MoE
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index, make_layers, maybe_prefix
from vllm.sequence import IntermediateTensors
from vllm.v1.kv_cache_interface import KVCacheSpec

from ascend_adapters.common import compat, dispatch
from ascend_adapters.common.attention_backend import register_layer, token_requests
from ascend_adapters.common.kernels.kv8 import CacheRows
from ascend_adapters.common.loading import load_checkpoint, load_module_tensors
from ascend_adapters.glm_dsa import kernels, remap  # importing kernels registers the kernel ops
from ascend_adapters.glm_dsa.backend import GlmDsaPortableBackend, decode_context, selected_slots
from ascend_adapters.glm_dsa.config import (
    AttentionMode,
    GlmDsaConfigError,
    check_raw_config,
    choose_attention_mode,
    raw_config_dict,
    require_field,
)
from ascend_adapters.glm_dsa.remap import STACKED_PARAMS

# the kernel ops the layers call, looked up once
_rope = dispatch.op("common.rope_interleaved")
_cache_write = dispatch.op("glm_dsa.cache_write")
_cache_gather = dispatch.op("glm_dsa.cache_gather")
_latent_attention = dispatch.op("glm_dsa.latent_attention")
_cache_rows = dispatch.op("glm_dsa.cache_rows")
_indexer_topk = dispatch.op("glm_dsa.indexer_topk")

# the key of the previous stage's top-k selection in the tensors handed between pipeline stages
SELECTION_KEY = "topk_indices"

# a child of vLLM's logger, so the path choice and the skipped weights show in vLLM's log
logger = logging.getLogger("vllm.ascend_adapters.glm_dsa")


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
    params.setdefault("rope_type", "default")
    return params


def _indexer_types(config) -> list[str]:
    types = getattr(config, "indexer_types", None)
    if types is None:
        return ["full"] * config.num_hidden_layers
    if len(types) < config.num_hidden_layers:
        raise GlmDsaConfigError(
            f"config.json indexer_types has {len(types)} entries for {config.num_hidden_layers} layers"
        )
    if types[0] != "full":
        raise GlmDsaConfigError(
            "config.json indexer_types[0] must be 'full' (a 'shared' layer reuses the previous one)"
        )
    return list(types)


def glm_dsa_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    rows: torch.Tensor,
    q_idx: torch.Tensor | None,
    w_idx: torch.Tensor | None,
    selection: torch.Tensor | None,
    out: torch.Tensor,
    layer_name: str,
) -> None:
    """``out`` ([T, H, kv_lora_rank]): the latent attention output of every token of the step (see
    ``GlmDsaAttention.attend``). Reads the step's metadata from the forward context and the layer's paged
    cache, so it is a splitting op (the hook module's ``SPLITTING_OPS``): vLLM runs it eagerly between
    compiled graph pieces, and a captured decode step holds its body."""
    get_forward_context().no_compile_layers[layer_name].attend(q_lat, q_pe, rows, q_idx, w_idx, selection, out)


compat.register_opaque_op("glm_dsa_attention", glm_dsa_attention, mutates_args=["selection", "out"])


class GlmDsaRotary(nn.Module):
    """cos/sin from vLLM's rope cache (default and YaRN), applied by common's ``common.rope_interleaved`` op.

    vLLM's CPU rotary custom op is wrong for 3-D multi-head inputs in eager
    mode, so the rotation itself goes through the dispatch layer.
    """

    def __init__(self, config, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim
        self.rotary_emb = get_rope(
            rope_dim,
            max_position=config.max_position_embeddings,
            is_neox_style=False,
            rope_parameters=_rope_parameters(config),
        )

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.rotary_emb.cos_sin_cache
        cos_sin = cache.index_select(0, positions.to(torch.long).flatten())
        return cos_sin.chunk(2, dim=-1)


class GlmDsaIndexer(nn.Module):
    """Lightning indexer projections: ``wq_b`` (from the q latent), ``wk`` + LayerNorm, head weights."""

    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = int(config.index_topk)
        self.wq_b = ReplicatedLinear(
            config.q_lora_rank,
            self.n_heads * self.head_dim,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.wq_b",
        )
        self.wk = ReplicatedLinear(
            config.hidden_size, self.head_dim, bias=False, quant_config=quant_config, prefix=f"{prefix}.wk"
        )
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # kept in float32 like the reference (_keep_in_fp32_modules)
        self.weights_proj = ReplicatedLinear(
            config.hidden_size,
            self.n_heads,
            bias=False,
            quant_config=None,
            params_dtype=torch.float32,
            prefix=f"{prefix}.weights_proj",
        )
        self.softmax_scale = self.head_dim**-0.5

    def project(self, hidden_states, q_c, cos, sin):
        t = hidden_states.shape[0]
        rope = _rope
        q = self.wq_b(q_c)[0].view(t, self.n_heads, self.head_dim)
        k = self.wk(hidden_states)[0]
        k = nn.functional.layer_norm(
            k.float(), (self.head_dim,), self.k_norm.weight.float(), self.k_norm.bias.float(), self.k_norm.eps
        ).to(k.dtype)
        q = torch.cat([rope(q[..., : self.rope_dim], cos, sin), q[..., self.rope_dim :]], dim=-1)
        k = torch.cat([rope(k[:, None, : self.rope_dim], cos, sin)[:, 0], k[:, self.rope_dim :]], dim=-1)
        w = self.weights_proj(hidden_states.float())[0].float() * (self.n_heads**-0.5)
        return q, k, w


class GlmDsaAttention(nn.Module, AttentionLayerBase):
    """MLA with DSA selection; owns its paged latent cache (see module doc)."""

    def __init__(self, vllm_config: VllmConfig, config, layer_idx: int, mode: AttentionMode, prefix: str):
        super().__init__()
        quant_config = vllm_config.quant_config
        cache_config = vllm_config.cache_config
        tp = get_tensor_model_parallel_world_size()
        if config.q_lora_rank is None:
            raise GlmDsaConfigError("config.json q_lora_rank is null; GLM-5.x DSA checkpoints use a q LoRA rank")
        self.layer_idx = layer_idx
        self.mode = mode
        self.num_heads = config.num_attention_heads // tp
        self.nope = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_head_dim = self.nope + self.rope_dim
        rope_params = _rope_parameters(config)
        scale = self.qk_head_dim**-0.5
        if rope_params.get("rope_type", "default") != "default" and rope_params.get("mscale_all_dim"):
            m = _yarn_mscale(rope_params["factor"], rope_params["mscale_all_dim"])
            scale = scale * m * m
        self.scaling = scale

        self.q_a_proj = ReplicatedLinear(
            config.hidden_size,
            config.q_lora_rank,
            bias=config.attention_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.q_a_proj",
        )
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=1e-6)
        self.q_b_proj = ColumnParallelLinear(
            config.q_lora_rank,
            config.num_attention_heads * self.qk_head_dim,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.q_b_proj",
        )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            config.hidden_size,
            self.kv_lora_rank + self.rope_dim,
            bias=config.attention_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.kv_a_proj_with_mqa",
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank,
            config.num_attention_heads * (self.nope + self.v_dim),
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.kv_b_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.v_dim,
            config.hidden_size,
            bias=config.attention_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary = GlmDsaRotary(config, self.rope_dim)
        # W_UK^T [H, R, nope] and W_UV [H, v, R], split from kv_b_proj after loading (absorb_weights)
        self.w_uk_t = torch.zeros(self.num_heads, self.kv_lora_rank, self.nope)
        self.w_uv = torch.zeros(self.num_heads, self.v_dim, self.kv_lora_rank)

        types = _indexer_types(config)  # an MTP layer, after the main stack, is a 'full' one
        self.shared_topk = layer_idx < len(types) and types[layer_idx] == "shared"
        self.index_topk = int(config.index_topk)
        self.indexer = None
        if mode is AttentionMode.SPARSE and not self.shared_topk:
            self.indexer = GlmDsaIndexer(config, quant_config, prefix=f"{prefix}.indexer")
        # latent row: kv_c | k_pe | indexer key (sparse path only; same width for every layer)
        self.index_dim = config.index_head_dim if mode is AttentionMode.SPARSE else 0
        self.row_dim = self.kv_lora_rank + self.rope_dim + self.index_dim
        # stored in the model dtype, or 8-bit (an 8-bit --kv-cache-dtype: each part its own scale)
        parts = (self.kv_lora_rank, self.rope_dim) + ((self.index_dim,) if self.index_dim else ())
        self.cache_rows = CacheRows(parts, torch.get_default_dtype(), cache_config.cache_dtype)

        # attention-like layer: vLLM gives it a paged cache and per-step metadata
        self.layer_name = f"{prefix}.attn"
        self.block_size = cache_config.block_size
        self.kv_cache = torch.tensor([])
        register_layer(self.layer_name, self)

    # -- AttentionLayerBase -------------------------------------------------
    def get_attn_backend(self):
        return GlmDsaPortableBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return compat.mla_attention_spec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=self.cache_rows.width,
            dtype=self.cache_rows.dtype,
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = compat.latent_layer_cache(kv_cache)

    # -- forward ------------------------------------------------------------
    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, prev_selection: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Projections (compiled), then ``vllm::glm_dsa_attention`` (cache write and attention, run
        eagerly between graph pieces), then the output projection (compiled)."""
        t = hidden_states.shape[0]
        rope = _rope
        cos, sin = self.rotary.cos_sin(positions)

        q_c = self.q_a_layernorm(self.q_a_proj(hidden_states)[0])
        q = self.q_b_proj(q_c)[0].view(t, self.num_heads, self.qk_head_dim)
        q = torch.cat([q[..., : self.nope], rope(q[..., self.nope :], cos, sin)], dim=-1)
        latent = self.kv_a_proj_with_mqa(hidden_states)[0]
        kv_c = self.kv_a_layernorm(latent[:, : self.kv_lora_rank].contiguous())
        k_pe = rope(latent[:, None, self.kv_lora_rank :], cos, sin)[:, 0]
        parts = [kv_c, k_pe]
        q_idx = w_idx = None
        if self.indexer is not None:
            q_idx, k_idx, w_idx = self.indexer.project(hidden_states, q_c, cos, sin)
            parts.append(k_idx)
        elif self.index_dim:
            parts.append(kv_c.new_zeros(t, self.index_dim))
        rows = torch.cat(parts, dim=-1)

        q_lat = kernels.absorb_query(q[..., : self.nope], self.w_uk_t)  # [T, H, R]
        out = q_lat.new_zeros(t, self.num_heads, self.kv_lora_rank)
        if self.mode is AttentionMode.DENSE:
            selection = None
        elif self.indexer is not None:  # this layer selects; a following 'shared' layer reuses it
            selection = torch.full((t, self.index_topk), -1, dtype=torch.long, device=q.device)
        elif prev_selection is None:
            raise RuntimeError(f"{self.layer_name}: a 'shared' DSA layer needs the previous layer's top-k")
        else:
            selection = prev_selection
        torch.ops.vllm.glm_dsa_attention(
            q_lat,
            q[..., self.nope :],
            rows,
            q_idx,
            w_idx,
            selection,
            out,
            self.layer_name,
        )
        return self._output(out), selection

    def attend(self, q_lat, q_pe, rows, q_idx, w_idx, selection, out) -> None:
        """The body of ``vllm::glm_dsa_attention``: cache the step's latent rows, then attend, writing ``out``
        (and, in a layer with an indexer, its top-k into ``selection``; ``forward`` passes none on the dense
        path). The step's decodes (one query token per request, or the 1 + k of a speculative step) are one
        batched call, their requests and contexts derived on the device (``backend.decode_context``); each
        prefill chunk selects over its request's rows in a call of its own. On the sparse path every token
        of the step then attends its selected rows in one call."""
        md = get_forward_context().attn_metadata
        if isinstance(md, dict):
            md = md.get(self.layer_name)
        if md is None or self.kv_cache.numel() == 0:  # profiling / dummy run: nothing cached yet
            return
        _cache_write(self.kv_cache, md.slot_mapping, self.cache_rows.encode(rows))
        if self.mode is AttentionMode.DENSE:
            self._dense(md, q_lat, q_pe, out)
            return
        if self.indexer is not None:
            self._select_step(md, q_idx, w_idx, selection)
        self._sparse(md, q_lat, q_pe, selection, out)

    def _output(self, out_lat: torch.Tensor) -> torch.Tensor:
        """``W_UV`` on the latent attention output, then ``o_proj``."""
        out = kernels.expand_output(out_lat, self.w_uv)  # [T, H, v]
        return self.o_proj(out.reshape(out.shape[0], -1))[0]

    def _prefill_context(self, md, r: int, qs: int, qe: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill chunk's (request ``r``, tokens ``qs:qe``) context rows ``[width, C]`` and each token's
        causal mask over them ``[S, width]``: token ``t`` sees its sequence less the ``qe - 1 - t`` after it."""
        ctx = self.cache_rows.decode(_cache_gather(self.kv_cache, md.block_table[r], width))
        lengths = md.seq_lens[r] - qe + 1 + torch.arange(qs, qe, device=ctx.device)
        return ctx, torch.arange(width, device=ctx.device)[None, :] < lengths[:, None]

    def _dense(self, md, q_lat, q_pe, out) -> None:
        """Every decode token over its whole context in one call; each prefill chunk over its request's rows."""
        attend = _latent_attention
        d = md.num_decode_tokens
        if d:
            slots, valid = decode_context(md, self.block_size)
            rows = self.cache_rows.decode(_cache_rows(self.kv_cache, slots))  # [D, W, C]
            out[:d] = attend(q_lat[:d, None], q_pe[:d, None], rows, valid[:, None], self.scaling)[:, 0]
        for r, qs, qe, width in md.prefills:
            ctx, causal = self._prefill_context(md, r, qs, qe, width)
            out[qs:qe] = attend(q_lat[None, qs:qe], q_pe[None, qs:qe], ctx[None], causal[None], self.scaling)[0]

    def _select(self, q_idx, w_idx, keys, valid) -> torch.Tensor:
        """Top-k context positions ``[N, S, index_topk]`` (``-1`` = none) from this layer's indexer."""
        top = _indexer_topk(q_idx * self.indexer.softmax_scale, w_idx, keys, valid, self.index_topk)
        if top.shape[-1] < self.index_topk:
            top = torch.nn.functional.pad(top, (0, self.index_topk - top.shape[-1]), value=-1)
        return top

    def _select_step(self, md, q_idx, w_idx, selection) -> None:
        """The indexer's top-k of every token into ``selection``: the decodes in one call over their contexts'
        indexer keys, each prefill chunk over its request's."""
        index_keys = slice(self.kv_lora_rank + self.rope_dim, None)
        d = md.num_decode_tokens
        if d:
            slots, valid = decode_context(md, self.block_size)
            keys = self.cache_rows.decode(_cache_rows(self.kv_cache, slots))[..., index_keys]  # [D, W, Di]
            selection[:d] = self._select(q_idx[:d, None], w_idx[:d, None], keys, valid[:, None])[:, 0]
        for r, qs, qe, width in md.prefills:
            ctx, causal = self._prefill_context(md, r, qs, qe, width)
            selection[qs:qe] = self._select(
                q_idx[None, qs:qe], w_idx[None, qs:qe], ctx[None, :, index_keys], causal[None]
            )[0]

    def _sparse(self, md, q_lat, q_pe, selection, out) -> None:
        """Every token of the step in one call over the rows it selected, gathered from the paged cache (no
        other row is read). A token selects at most ``min(index_topk, its context)`` rows, first in its
        selection (``-1`` after them), so ``context_width`` columns hold them all."""
        n = md.num_attended_tokens
        top = selection[:n, : min(self.index_topk, md.context_width)]
        req = token_requests(md.query_start_loc[: md.num_reqs + 1], n)
        slots = selected_slots(md.block_table[req], top, self.block_size)
        rows = self.cache_rows.decode(_cache_rows(self.kv_cache, slots))  # [T, k, C]
        attend = _latent_attention
        out[:n] = attend(q_lat[:n, None], q_pe[:n, None], rows, (top >= 0)[:, None], self.scaling)[:, 0]

    def absorb_weights(self) -> None:
        """Split ``kv_b_proj`` into ``W_UK`` / ``W_UV`` (see kernels.absorb_kv_b). Called at the end of
        ``load_weights``: vLLM's CPU linear later repacks the weight and drops the plain tensor."""
        if not isinstance(self.kv_b_proj.quant_method, UnquantizedLinearMethod):
            raise GlmDsaConfigError(
                f"{self.kv_b_proj.prefix}: quantized ({type(self.kv_b_proj.quant_method).__name__}); attention "
                "runs in the latent space, which folds kv_b_proj into the query and output, so it must be a "
                "float tensor (released GLM-5.x W8A8 exports keep it BF16)"
            )
        self.w_uk_t, self.w_uv = kernels.absorb_kv_b(self.kv_b_proj.weight.data, self.num_heads, self.nope, self.v_dim)


class GlmDsaRoutingConfig:
    """The config as vLLM's ``DeepseekV2MoE`` reads it, with GLM-5's router made explicit.

    ``DeepseekV2MoE`` takes the scoring function from ``scoring_func`` (default softmax) and builds the
    ``e_score_correction_bias`` only when ``topk_method == "noaux_tc"``; GLM-5 configs need not carry
    either, because transformers' ``GlmMoeDsaTopkRouter`` always scores with a sigmoid plus that bias
    (n_group / topk_group group-limited, ``norm_topk_prob``, ``routed_scaling_factor``: read as they are).
    A config that names another scoring or top-k method is not this router and is refused.
    """

    ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}

    def __init__(self, config):
        for name, value in self.ROUTER.items():
            declared = getattr(config, name, None)
            if declared is not None and declared != value:
                raise GlmDsaConfigError(
                    f"config.json {name}={declared!r}: GLM-5's router (transformers' GlmMoeDsaTopkRouter) "
                    f"is {name}={value!r}"
                )
        self._config = config

    def __getattr__(self, name):
        if name in GlmDsaRoutingConfig.ROUTER:
            return GlmDsaRoutingConfig.ROUTER[name]
        return getattr(self._config, name)


def make_moe(vllm_config: VllmConfig, config, prefix: str) -> DeepseekV2MoE:
    """vLLM's DeepSeek-V2 MoE block (FusedMoE routed experts, shared experts as ``DeepseekV2MLP``) with
    GLM-5's router (see ``GlmDsaRoutingConfig``), computing its logits in float32 as transformers'
    ``GlmMoeDsaTopkRouter`` does (``F.linear`` of the float32-cast input and weight): vLLM's block builds
    its ``GateLinear`` in the model dtype, so ``compat.force_fp32_compute`` gives it what
    ``force_fp32_compute=True`` gives DeepSeek-V4's gate (in bfloat16 the product would otherwise round
    before the sigmoid and can change which experts are chosen)."""
    moe = DeepseekV2MoE(
        config=GlmDsaRoutingConfig(config),
        parallel_config=vllm_config.parallel_config,
        quant_config=vllm_config.quant_config,
        prefix=prefix,
    )
    compat.force_fp32_compute(moe.gate)
    return moe


def expert_params_mapping(module: nn.Module, config) -> list[tuple[str, str, int, str]]:
    """(param name, checkpoint name, expert id, shard id) of every routed expert below ``module``."""
    return fused_moe_make_expert_params_mapping(
        module,
        ckpt_gate_proj_name="gate_proj",
        ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj",
        num_experts=config.n_routed_experts,
    )


def load_layer_tensors(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Checkpoint tensors (names below ``model.``) into a stack of decoder layers (``module`` has ``config``
    and ``expert_params_mapping``), as vLLM's deepseek_v2 does: ``gate_proj``/``up_proj`` into the stacked
    ``gate_up_proj``, per-expert tensors into FusedMoE."""
    return load_module_tensors(
        module,
        weights,
        stacked_params=STACKED_PARAMS,
        expert_mapping=module.expert_params_mapping,
        num_experts=module.config.n_routed_experts,
    )


class GlmDsaDecoderLayer(nn.Module):
    """One decoder layer: vLLM's ``DeepseekV2MLP`` / ``DeepseekV2MoE`` behind this adapter's attention.

    Not vLLM's ``DeepseekV2DecoderLayer``: its constructor builds vLLM's own MLA attention (and registers
    that attention layer's cache), and its attention call returns only hidden states, where a DSA layer
    here also hands its top-k selection to the next 'shared' layer. vLLM's own DSA model
    (``deepseek_v32``) keeps a decoder layer of its own for the same reason.
    """

    def __init__(self, vllm_config: VllmConfig, config, layer_idx: int, mode: AttentionMode, prefix: str):
        super().__init__()
        quant_config = vllm_config.quant_config
        self.self_attn = GlmDsaAttention(vllm_config, config, layer_idx, mode, prefix=f"{prefix}.self_attn")
        types = getattr(config, "mlp_layer_types", None)
        if types and layer_idx < len(types):
            sparse_mlp = types[layer_idx] == "sparse"
        else:  # no mlp_layer_types, or an MTP layer after the main stack
            sparse_mlp = layer_idx >= config.first_k_dense_replace
        if sparse_mlp:
            self.mlp = make_moe(vllm_config, config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = DeepseekV2MLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=quant_config,
                prefix=f"{prefix}.mlp",
            )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual, prev_selection):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states, selection = self.self_attn(positions, hidden_states, prev_selection)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual, selection


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class GlmDsaModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.prefix = prefix
        mc = vllm_config.model_config
        check_raw_config(raw_config_dict(mc.model, getattr(mc, "revision", None)))
        self.mode = choose_attention_mode(config, vllm_config.model_config.max_model_len)
        logger.info(
            "GLM-DSA attention path: %s (max_model_len=%d, index_topk=%s)",
            self.mode.value,
            vllm_config.model_config.max_model_len,
            config.index_topk,
        )
        for name in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"):
            require_field(config, name)
        if self.mode is AttentionMode.SPARSE:
            for name in ("index_n_heads", "index_head_dim"):
                require_field(config, name)
        if config.hidden_act != "silu":
            raise GlmDsaConfigError(f"config.json hidden_act={config.hidden_act!r}: only silu is supported")
        pp = get_pp_group()
        if pp.is_first_rank or (getattr(config, "tie_word_embeddings", False) and pp.is_last_rank):
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "embed_tokens")
            )
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: GlmDsaDecoderLayer(
                vllm_config, config, extract_layer_index(prefix), self.mode, prefix=prefix
            ),
            prefix=maybe_prefix(prefix, "layers"),
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if pp.is_last_rank else PPMissingLayer()
        # IndexShare across a stage boundary: a 'shared' layer reads the top-k of the last 'full' layer
        # before it; when that layer sits on the previous stage, the selection travels with the hidden
        # states (see make_empty_intermediate_tensors).
        types = _indexer_types(config)
        sparse = self.mode is AttentionMode.SPARSE
        self.receives_selection = sparse and self.start_layer > 0 and types[self.start_layer] == "shared"
        self.sends_selection = (
            sparse and self.end_layer < config.num_hidden_layers and types[self.end_layer] == "shared"
        )
        self.expert_params_mapping = expert_params_mapping(self, config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """What this stage receives: hidden states and residual, and the previous stage's last top-k
        selection (``[tokens, index_topk]`` context positions, ``-1`` = none; int32, as positions stay
        below ``max_model_len``) when this stage starts with a 'shared' layer.

        Sending the selection rather than refusing such a split: GLM-5.x schedules make most layers
        'shared' (``index_topk_freq``), so refusing would leave few layer partitions; and the selection is
        ``index_topk`` int32 per token: 8 KiB for GLM-5 (index_topk 2048) beside the 24 KiB of its
        bfloat16 hidden state and residual (2 x 6144 x 2 bytes)."""
        tensors = {
            "hidden_states": torch.zeros(batch_size, self.config.hidden_size, dtype=dtype, device=device),
            "residual": torch.zeros(batch_size, self.config.hidden_size, dtype=dtype, device=device),
        }
        if self.receives_selection:
            tensors[SELECTION_KEY] = torch.full(
                (batch_size, int(self.config.index_topk)), -1, dtype=torch.int32, device=device
            )
        return IntermediateTensors(tensors)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        selection = None
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
            if self.receives_selection:
                selection = intermediate_tensors[SELECTION_KEY].long()
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual, selection = layer(positions, hidden_states, residual, selection)
        if not get_pp_group().is_last_rank:
            tensors = {"hidden_states": hidden_states, "residual": residual}
            if self.sends_selection:
                if selection is None:  # profiling / dummy run: no layer selected anything
                    selection = torch.full((hidden_states.shape[0], int(self.config.index_topk)), -1)
                tensors[SELECTION_KEY] = selection.to(device=hidden_states.device, dtype=torch.int32)
            return IntermediateTensors(tensors)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_layer_tensors(self, weights)


class GlmMoeDsaForCausalLM(nn.Module, SupportsPP):
    """vLLM entry point for ``GlmMoeDsaForCausalLM`` checkpoints (BF16/FP32 and ModelSlim W8A8 exports).

    Pipeline parallel as vLLM's own models: each stage holds its ``make_layers`` range (the others are
    ``PPMissingLayer``, their checkpoint tensors skipped at load), the first stage the embeddings, the
    last the final norm and ``lm_head``."""

    # checkpoint shards fused into one vLLM module (quantization configs look types up per shard)
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    hf_to_vllm_mapper = remap.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.vllm_config = vllm_config
        self.model = GlmDsaModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, quant_config=None, prefix=maybe_prefix(prefix, "lm_head")
            )
            if getattr(config, "tie_word_embeddings", False):
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self.logits_processor = LogitsProcessor(config.vocab_size)
        # the drops that depend on the config: MTP layers, indexers the chosen path does not use
        types = _indexer_types(config)
        self.skip_rules = remap.skip_rules(
            config.num_hidden_layers,
            int(getattr(config, "num_nextn_predict_layers", 0) or 0),
            [i for i, t in enumerate(types[: config.num_hidden_layers]) if t == "shared"],
            dense=self.model.mode is AttentionMode.DENSE,
        )
        self.skipped_weights: dict[str, str] = {}

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # -- weights ------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_checkpoint(
            self,
            weights,
            what="GLM-DSA",
            mapper=self.hf_to_vllm_mapper,
            skips=self.skip_rules,
            stacked_params=STACKED_PARAMS,
            expert_mapping=self.model.expert_params_mapping,
            error=remap.GlmDsaWeightsError,
        )
        for layer in islice(self.model.layers, self.model.start_layer, self.model.end_layer):
            layer.self_attn.absorb_weights()
        return loaded
