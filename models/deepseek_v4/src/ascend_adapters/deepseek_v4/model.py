"""DeepSeek-V4 (``DeepseekV4ForCausalLM``) for vLLM on platforms without the native path.

Reads like vLLM's llama.py: layer classes, then the model, then the causal-LM
wrapper with ``load_weights``. All math goes through ``kernels`` (portable torch
behind common's dispatch layer), except the hyper-connection ops, which ``mhc.py``
takes from vLLM where the engine's ops serve the call.

Attention state. vLLM's paged attention cannot express DeepSeek-V4 attention
(shared K=V head, per-head sinks, a sliding window *plus* compressed entries
selected per query by the lightning indexer, all in one softmax). Each
attention layer therefore keeps its own per-request state through vLLM's
state-space-model cache (a ``MambaBase`` layer with the pure-Python
``LINEAR`` metadata builder: per-request slot, ``query_start_loc``,
``seq_lens``). The state has a fixed size given ``max_model_len``:

* ``window``  ``[W, head_dim]``: the shared K=V of the last W positions (ring, slot = pos % W);
* ``raw``     ``[R, hidden]``: the layer input of the last R positions (ring), from
  which the compressors pool a window when it closes (R = 2*csa_rate or hca_rate);
* ``entries`` ``[E, head_dim]``: compressed KV entries, entry w at row w;
* ``index``   ``[E, index_head_dim]``: the indexer's compressed keys.

Every layer carries the same shapes so vLLM allocates one uniform state page.
Exactness does not depend on how a prompt is split into chunks: each token
reads only positions of its own request that were written before.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, SupportsPP
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    extract_layer_index,
    is_pp_missing_parameter,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.linear_attn import LinearAttentionBackend, LinearAttentionMetadataBuilder
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ascend_adapters.common import cpu_patches, dispatch
from ascend_adapters.common.loading import load_checkpoint, load_module_tensors
from ascend_adapters.deepseek_v4 import kernels as _kernels  # noqa: F401  (registers the portable ops)
from ascend_adapters.deepseek_v4.config import (
    LAYER_CSA,
    LAYER_HCA,
    LAYER_SLIDING,
    RELEASE_QUANT_ATTR,
    compressed_enabled,
    vllm_rope_parameters,
)
from ascend_adapters.deepseek_v4.dequant import dequantize_release
from ascend_adapters.deepseek_v4.memory import state_dims, state_shapes
from ascend_adapters.deepseek_v4.mhc import hc_ops
from ascend_adapters.deepseek_v4.moe import DeepseekV4FloatMoEMethod, DeepseekV4MoE
from ascend_adapters.deepseek_v4.remap import (
    EXPERT_DOWN,
    EXPERT_GATE,
    EXPERT_UP,
    MTP_REASON,
    STACKED_PARAMS,
    mtp_patterns,
    weights_mapper,
)

op = dispatch.op
logger = logging.getLogger("ascend_adapters")


def _sharded_loader(dim: int):
    """Weight loader for a parameter split evenly along ``dim`` across the tensor-parallel ranks."""

    def loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        size = param.shape[dim]
        if loaded.shape[dim] != size * tp:
            raise ValueError(f"shape {tuple(loaded.shape)} does not split into {tp} x {tuple(param.shape)}")
        param.data.copy_(loaded.narrow(dim, rank * size, size))

    return loader


def deepseek_v4_rope(config, label: str, max_model_len: int) -> nn.Module:
    """vLLM's DeepSeek-V4 rotary embedding for one rope set (``main`` or ``compress``), shared by
    every layer that uses it (``get_rope`` caches it); see ``config.vllm_rope_parameters``."""
    rope = get_rope(
        config.head_dim,
        max_position=config.max_position_embeddings,
        rope_parameters=vllm_rope_parameters(config, label),
        is_neox_style=False,
    )
    if rope.cos_sin_cache.shape[0] < max_model_len:
        raise ValueError(
            f"DeepSeek-V4 rope set {label!r} covers {rope.cos_sin_cache.shape[0]} positions "
            f"(original_max_position_embeddings x factor), fewer than max_model_len={max_model_len}"
        )
    return rope


def apply_rope(rope: nn.Module, positions: torch.Tensor, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing rope channels of ``x`` (``[T, heads, D]``, or ``[T, D]`` for one head)."""
    out, _ = rope(positions, x if x.dim() == 3 else x.unsqueeze(1), None, inverse=inverse)
    return out.view_as(x)


# ---------------------------------------------------------------- compressor / indexer
class DeepseekV4Compressor(nn.Module):
    """Gated pooling of ``rate`` tokens into one KV entry (CSA: overlapping pairs of windows)."""

    def __init__(self, config, rate: int, head_dim: int, overlap: bool, quant_config, prefix: str):
        super().__init__()
        self.rate, self.head_dim, self.overlap = rate, head_dim, overlap
        width = (2 if overlap else 1) * head_dim
        self.kv_proj = ReplicatedLinear(
            config.hidden_size,
            width,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.kv_proj",
            return_bias=False,
        )
        self.gate_proj = ReplicatedLinear(
            config.hidden_size,
            width,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_proj",
            return_bias=False,
        )
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def pool(self, x: torch.Tensor, first_pos: int, rope: nn.Module, has_prev: bool) -> torch.Tensor:
        """Entries for the whole windows in ``x`` (rows from ``first_pos``, a window start).

        With overlap and ``has_prev`` the first window of ``x`` only feeds the next entry.
        """
        kv = self.kv_proj(x)
        gate = self.gate_proj(x) + self.position_bias.repeat(x.shape[0] // self.rate, 1)
        pooled, _ = op("dsv4.compress_windows")(kv, gate, self.rate, self.overlap, self.head_dim, has_prev)
        out = self.kv_norm(pooled)
        first_w = first_pos // self.rate + (1 if (self.overlap and has_prev) else 0)
        pos = torch.arange(out.shape[0], device=x.device) * self.rate + first_w * self.rate
        return apply_rope(rope, pos, out)


class DeepseekV4Indexer(DeepseekV4Compressor):
    """Lightning indexer: its own overlapping compressor at index_head_dim plus query/weight heads."""

    def __init__(self, config, rate: int, quant_config, prefix: str):
        super().__init__(config, rate, config.index_head_dim, True, quant_config, prefix)
        self.n_heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = ReplicatedLinear(
            config.q_lora_rank,
            self.n_heads * self.head_dim,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.q_b_proj",
            return_bias=False,
        )
        self.weights_proj = ReplicatedLinear(
            config.hidden_size,
            self.n_heads,
            bias=False,
            quant_config=None,
            prefix=f"{prefix}.weights_proj",
            return_bias=False,
        )
        self.softmax_scale = self.head_dim**-0.5
        self.weights_scale = self.n_heads**-0.5


# ---------------------------------------------------------------- attention
def dsv4_attention(
    x: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    qr: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    layer_name: str,
) -> None:
    """``out`` ([T, heads, head_dim]): the attention of every token of the step over its request's
    window and compressed entries (``DeepseekV4Attention.attend``). It walks the requests on the host,
    so it is a splitting op (the hook module's ``SPLITTING_OPS``): vLLM runs it eagerly between
    compiled graph pieces."""
    get_forward_context().no_compile_layers[layer_name].attend(x, q, kv, qr, positions, out)


direct_register_custom_op(op_name="dsv4_attention", op_func=dsv4_attention, mutates_args=["out"])


class DeepseekV4StateMetadataBuilder(LinearAttentionMetadataBuilder):
    """vLLM's LINEAR builder (per-request slot, ``query_start_loc``, ``seq_lens``), declaring no graph
    support, where LINEAR declares single-token decode: the attention walks the requests on the host
    (``tolist()``), so a captured decode step would replay the lengths and slots of the step it was
    captured in. With ``NEVER``, vLLM captures no full graph of any step of this model."""

    _cudagraph_support = AttentionCGSupport.NEVER


class DeepseekV4StateBackend(LinearAttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[DeepseekV4StateMetadataBuilder]:
        return DeepseekV4StateMetadataBuilder


class DeepseekV4Attention(nn.Module, MambaBase):
    """Shared-KV MQA over a sliding window + compressed entries, with sinks and a grouped output projection."""

    def __init__(self, config, layer_idx: int, quant_config=None, prefix: str = ""):
        super().__init__()
        vllm_config = get_current_vllm_config()
        self.config = config
        self.prefix = prefix
        self.layer_type = config.layer_types[layer_idx] if compressed_enabled() else LAYER_SLIDING
        tp = get_tensor_model_parallel_world_size()
        if config.num_attention_heads % tp or config.o_groups % tp:
            raise ValueError(
                f"DeepSeek-V4: tensor_parallel_size={tp} must divide num_attention_heads="
                f"{config.num_attention_heads} and o_groups={config.o_groups} (query heads and output "
                "groups are split across ranks)"
            )
        # Query heads and output groups are split across ranks; the single shared K=V head, the
        # compressors and the indexer are replicated (each rank keeps the same attention state).
        self.n_heads, self.head_dim = config.num_attention_heads // tp, config.head_dim
        self.window = config.sliding_window
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.o_groups = config.o_groups // tp
        h = config.hidden_size
        # wq_a and wkv share their input: one fused projection (also how ModelSlim ships them).
        self.wqkv_a = MergedColumnParallelLinear(
            h,
            [config.q_lora_rank, self.head_dim],
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.wqkv_a",
            return_bias=False,
            disable_tp=True,
        )
        self.q_a_norm = RMSNorm(config.q_lora_rank, self.eps)
        self.q_b_proj = ColumnParallelLinear(
            config.q_lora_rank,
            config.num_attention_heads * self.head_dim,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.q_b_proj",
            return_bias=False,
        )
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        # Grouped (block-diagonal) projection: a plain parameter read by the grouped kernel, this
        # rank's groups only (rows of group g are g*o_lora .. (g+1)*o_lora).
        self.o_a_proj = nn.Module()
        self.o_a_proj.weight = nn.Parameter(
            torch.empty(self.o_groups * config.o_lora_rank, self.n_heads * self.head_dim // self.o_groups),
            requires_grad=False,
        )
        self.o_a_proj.weight.weight_loader = _sharded_loader(0)
        self.o_b_proj = RowParallelLinear(
            config.o_groups * config.o_lora_rank,
            h,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_b_proj",
            return_bias=False,
            input_is_parallel=True,
            reduce_results=True,
        )
        self.sinks = nn.Parameter(torch.zeros(self.n_heads), requires_grad=False)
        self.sinks.weight_loader = _sharded_loader(0)
        self.compressor = None
        self.rate = None
        if self.layer_type == LAYER_CSA:
            self.rate = config.compress_rates[LAYER_CSA]
            self.compressor = DeepseekV4Compressor(
                config, self.rate, self.head_dim, True, quant_config, f"{prefix}.compressor"
            )
            self.compressor.indexer = DeepseekV4Indexer(config, self.rate, quant_config, f"{prefix}.compressor.indexer")
        elif self.layer_type == LAYER_HCA:
            self.rate = config.compress_rates[LAYER_HCA]
            self.compressor = DeepseekV4Compressor(
                config, self.rate, self.head_dim, False, quant_config, f"{prefix}.compressor"
            )
        # Checkpoint layer type: a CSA/HCA layer served window-only would silently change the model.
        self.ckpt_layer_type = config.layer_types[layer_idx]
        self.max_model_len = vllm_config.model_config.max_model_len
        label = "main" if self.ckpt_layer_type == LAYER_SLIDING else "compress"
        self.rotary_emb = deepseek_v4_rope(config, label, self.max_model_len)
        # compressed entries and the indexer's queries always take the compress set
        self.compress_rotary_emb = deepseek_v4_rope(config, "compress", self.max_model_len)
        self.num_speculative_tokens = vllm_config.num_speculative_tokens
        self._shapes = state_shapes(config, self.max_model_len, self.num_speculative_tokens)
        self._dims = state_dims(config, self.max_model_len, self.num_speculative_tokens)
        cc = vllm_config.compilation_config
        if prefix in cc.static_forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        cc.static_forward_context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    # MambaBase: vLLM sizes and hands out the per-request state from these.
    def get_state_shape(self):
        return self._shapes

    def get_state_dtype(self):
        return (torch.float32,) * len(self._shapes)

    @property
    def mamba_type(self):
        return MambaAttentionBackendEnum.LINEAR

    def get_attn_backend(self) -> type[DeepseekV4StateBackend]:
        return DeepseekV4StateBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig):
        # One state page per request also under speculation: the rings carry rollback slack
        # (memory.rollback_slack) instead of vLLM's one page per speculative position.
        return dataclasses.replace(super().get_kv_cache_spec(vllm_config), num_speculative_blocks=0)

    # -- one request -------------------------------------------------------------------------
    def _seq(self, x, q, kv, qr, pos0: int, state):
        """Attention for one request's ``n`` new tokens at positions pos0..pos0+n-1."""
        n = x.shape[0]
        dev = x.device
        qpos = torch.arange(pos0, pos0 + n, device=dev)
        W, slots = self.window, self._dims["window"]
        # sliding-window keys: the W-1 positions before pos0 (from the ring) + the new ones
        lo = max(0, pos0 - W + 1)
        prev_pos = torch.arange(lo, pos0, device=dev)
        if state is not None and prev_pos.numel():
            prev_kv = state[0][prev_pos % slots].to(kv.dtype)
        else:
            prev_pos = prev_pos[:0]
            prev_kv = kv.new_zeros((0, kv.shape[1]))
        keys = torch.cat([prev_kv, kv], 0)
        kpos = torch.cat([prev_pos, qpos])
        allowed = (kpos[None, :] <= qpos[:, None]) & (qpos[:, None] - kpos[None, :] < W)

        if self.compressor is not None:
            entries, idx_entries, n_entries = self._compress(x, pos0, state)
            visible = torch.arange(n_entries, device=dev)[None, :] < ((qpos + 1) // self.rate)[:, None]
            if self.layer_type == LAYER_CSA and n_entries:
                visible = self._index(x, qr, qpos, idx_entries, visible)
            keys = torch.cat([keys, entries], 0)
            allowed = torch.cat([allowed, visible], 1)
        if state is not None:
            keep = min(n, slots)
            state[0][qpos[-keep:] % slots] = kv[-keep:].to(state[0].dtype)
        return op("dsv4.sink_attention")(q, keys, allowed, self.sinks, self.scale)

    def _compress(self, x, pos0: int, state):
        """Emit the entries of windows that close in this chunk; return all entries so far."""
        comp, m = self.compressor, self.rate
        n = x.shape[0]
        dev = x.device
        overlap = self.layer_type == LAYER_CSA
        w_first, w_end = pos0 // m, (pos0 + n) // m  # windows closing here: w_first..w_end-1
        ring = self._dims["ring"]
        new_c = new_i = None
        if w_end > w_first:
            start_w = max(0, w_first - 1) if overlap else w_first
            has_prev = overlap and w_first > 0
            start = start_w * m
            stop = w_end * m
            if start < pos0:
                if state is None:
                    raise RuntimeError("DeepSeek-V4 compressor needs earlier positions but no state is bound")
                old = state[1][torch.arange(start, pos0, device=dev) % ring].to(x.dtype)
                rows = torch.cat([old, x[: stop - pos0]], 0)
            else:
                rows = x[start - pos0 : stop - pos0]
            new_c = comp.pool(rows, start, self.compress_rotary_emb, has_prev)
            if overlap:
                new_i = comp.indexer.pool(rows, start, self.compress_rotary_emb, has_prev)
        if state is None:  # stateless (profile) run: this chunk alone, from position pos0
            ent = new_c if new_c is not None else x.new_zeros((0, self.head_dim))
            idx = new_i if new_i is not None else None
            return ent, idx, ent.shape[0]
        if new_c is not None:
            state[2][w_first:w_end] = new_c.to(state[2].dtype)
            if new_i is not None:
                state[3][w_first:w_end] = new_i.to(state[3].dtype)
        keep = min(n, ring)
        state[1][torch.arange(pos0 + n - keep, pos0 + n, device=dev) % ring] = x[-keep:].to(state[1].dtype)
        ent = state[2][:w_end].to(x.dtype)
        return ent, (state[3][:w_end].to(x.dtype) if overlap else None), w_end

    def _index(self, x, qr, qpos, idx_entries, visible):
        """Lightning indexer: keep the top-k visible compressed entries per query."""
        ind = self.compressor.indexer
        n = x.shape[0]
        qi = apply_rope(self.compress_rotary_emb, qpos, ind.q_b_proj(qr).view(n, ind.n_heads, ind.head_dim))
        w = ind.weights_proj(x)
        scores = op("dsv4.indexer_scores")(qi, idx_entries, w, ind.softmax_scale, ind.weights_scale)
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(ind.topk, scores.shape[1])
        top = scores.topk(k, dim=-1).indices
        chosen = torch.zeros_like(visible)
        chosen.scatter_(1, top, True)
        return chosen & visible

    # -- batch -------------------------------------------------------------------------------
    def attend(self, x, q, kv, qr, positions, out) -> None:
        """The body of ``vllm::dsv4_attention``: each request of the step over its own state (the
        slot, boundaries and first position read on the host), written into ``out``."""
        md = get_forward_context().attn_metadata
        md = md.get(self.prefix) if isinstance(md, dict) else None
        if md is None:  # profile / dummy run: one stateless sequence
            out.copy_(self._seq(x, q, kv, qr, int(positions[0]), None))
            return
        qsl = md.query_start_loc.tolist()
        slots = md.state_indices_tensor.tolist()
        for i in range(len(qsl) - 1):
            a, b = qsl[i], qsl[i + 1]
            if b <= a:
                continue
            state = [s[slots[i]] for s in self.kv_cache]
            out[a:b] = self._seq(x[a:b], q[a:b], kv[a:b], qr[a:b], int(positions[a]), state)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv_a = self.wqkv_a(x)
        q_a, kv = qkv_a.split([self.config.q_lora_rank, self.head_dim], dim=-1)
        qr = self.q_a_norm(q_a)
        q = self.q_b_proj(qr).view(t, self.n_heads, self.head_dim)
        q = op("dsv4.rms_norm")(q, None, self.eps)
        q, kv = self.rotary_emb(positions, q, self.kv_norm(kv).unsqueeze(1))
        kv = kv.squeeze(1)

        out = torch.empty_like(q)
        torch.ops.vllm.dsv4_attention(x, q, kv, qr, positions, out, self.prefix)
        # K = V carried rope on its trailing slice: undo it at the query position.
        out = apply_rope(self.rotary_emb, positions, out, inverse=True)
        grouped = out.reshape(t, self.o_groups, -1)
        o = op("dsv4.grouped_linear")(grouped, self.o_a_proj.weight, self.o_groups)
        return self.o_b_proj(o)


# ---------------------------------------------------------------- decoder
class _HC(nn.Module):
    def __init__(self, config):
        super().__init__()
        n = config.hc_mult
        # float32 whatever the model dtype, as the checkpoint and transformers keep them
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.iters, self.hc_eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.ops = hc_ops(config, torch.get_default_dtype())

    def forward(self, streams):
        return self.ops.pre(
            streams,
            self.fn,
            self.base,
            self.scale,
            sinkhorn_iters=self.iters,
            hc_eps=self.hc_eps,
            norm_eps=self.norm_eps,
        )


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.self_attn = DeepseekV4Attention(config, layer_idx, quant_config, f"{prefix}.self_attn")
        self.mlp = DeepseekV4MoE(config, layer_idx, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = _HC(config)
        self.ffn_hc = _HC(config)
        self.hc_post = self.attn_hc.ops.post

    def forward(self, streams, positions, input_ids):
        post, comb, collapsed = self.attn_hc(streams)
        attn = self.self_attn(self.input_layernorm(collapsed), positions)
        streams = self.hc_post(streams, attn, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        mlp = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return self.hc_post(streams, mlp, post, comb)


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class DeepseekV4Model(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.config = config
        self.hc_mult = config.hc_mult
        pp = get_pp_group()
        # Pipeline stages: embeddings on the first, norm + hc_head on the last; the mHC streams
        # ([tokens, hc_mult, hidden]) travel between them as intermediate tensors.
        if pp.is_first_rank:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "embed_tokens")
            )
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: DeepseekV4DecoderLayer(config, extract_layer_index(prefix), quant_config, prefix),
            prefix=maybe_prefix(prefix, "layers"),
        )
        if pp.is_last_rank:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.hc_head = nn.Module()
            n, f32 = config.hc_mult, torch.float32
            self.hc_head.hc_fn = nn.Parameter(torch.empty(n, n * config.hidden_size, dtype=f32))
            self.hc_head.hc_base = nn.Parameter(torch.zeros(n, dtype=f32))
            self.hc_head.hc_scale = nn.Parameter(torch.ones(1, dtype=f32))
            self.hc_head_op = hc_ops(config, torch.get_default_dtype()).head
            # The MTP drafter reads the streams before the hc head (get_mtp_target_hidden_states).
            spec = vllm_config.speculative_config
            if spec is not None and spec.method == "mtp":
                rows = vllm_config.scheduler_config.max_num_batched_tokens
                self.register_buffer("mtp_streams", torch.empty(rows, n * config.hidden_size), persistent=False)
        else:
            self.norm = PPMissingLayer()
            self.hc_head = PPMissingLayer()
        self.expert_mapping = fused_moe_make_expert_params_mapping(
            self,
            ckpt_gate_proj_name=EXPERT_GATE,
            ckpt_down_proj_name=EXPERT_DOWN,
            ckpt_up_proj_name=EXPERT_UP,
            num_experts=config.n_routed_experts,
        )

    def make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        shape = (batch_size, self.hc_mult, self.config.hidden_size)
        return IntermediateTensors({"hidden_states": torch.zeros(shape, dtype=dtype, device=device)})

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if get_pp_group().is_first_rank:
            x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
            streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        else:
            streams = intermediate_tensors["hidden_states"]
        # every stage gets the token ids (hash-routed layers read tid2eid[token])
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            streams = layer(streams, positions, input_ids)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": streams})
        if hasattr(self, "mtp_streams"):
            self.mtp_streams[: streams.shape[0]].copy_(streams.flatten(1))
        h = self.hc_head_op(
            streams,
            self.hc_head.hc_fn,
            self.hc_head.hc_base,
            self.hc_head.hc_scale,
            hc_eps=self.config.hc_eps,
            norm_eps=self.config.rms_norm_eps,
        )
        return self.norm(h)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Mapped names (see remap.py): fused shards and routed experts stacked the vLLM way (another
        stage's tensors never reach here: the checkpoint loader skips them with the reason)."""
        return load_module_tensors(
            self,
            weights,
            stacked_params=STACKED_PARAMS,
            expert_mapping=self.expert_mapping,
            num_experts=self.config.n_routed_experts,
        )


class DeepseekV4ForCausalLM(nn.Module, HasInnerState, IsAttentionFree, SupportsPP):
    # checkpoint names -> this model's; vLLM renames a ModelSlim description with it too
    hf_to_vllm_mapper = weights_mapper()
    # fused module -> the shard names its checkpoint tensors (and description entries) keep
    packed_modules_mapping = {"wqkv_a": ["q_a_proj", "kv_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        quant_config = vllm_config.quant_config
        self.hf_to_vllm_mapper = weights_mapper(config)  # + MTP layers past num_hidden_layers
        self.model = DeepseekV4Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        pp = get_pp_group()
        if pp.world_size > 1:
            cpu_patches.enable_cpu_pipeline_receive_buffers()
        if pp.is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        else:
            self.lm_head = PPMissingLayer()
        if getattr(config, "tie_word_embeddings", False):
            if pp.world_size > 1:
                raise ValueError(
                    "DeepSeek-V4 with tie_word_embeddings: pipeline parallelism is not supported (the head "
                    "would need the embedding of the first stage on the last)"
                )
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        if quant_config is not None and getattr(quant_config, "description", None) is not None:
            _check_description_covered(self, quant_config)

    # vLLM's state-cache sizing asks the class before the model exists.
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        mc = vllm_config.model_config
        return state_shapes(mc.hf_config, mc.max_model_len, vllm_config.num_speculative_tokens)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        cfg = vllm_config.model_config.hf_config
        return (torch.float32,) * len(state_shapes(cfg, vllm_config.model_config.max_model_len))  # 4 either way

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:
        """What vLLM's proposer feeds the MTP drafter: the last step's streams before the hc head,
        ``[tokens, hc_mult * hidden]`` (rows past the step's tokens are stale)."""
        return getattr(self.model, "mtp_streams", None)

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        release = getattr(self.config, RELEASE_QUANT_ATTR, None)
        if release is not None:  # DeepSeek's FP8/FP4 release: float weights from here on
            weights = dequantize_release(weights, tuple(release["weight_block_size"]))
        return load_checkpoint(
            self,
            weights,
            what="DeepSeek-V4",
            mapper=self.hf_to_vllm_mapper,
            skips={p.pattern: MTP_REASON for p in mtp_patterns(self.config)},
            stacked_params=STACKED_PARAMS,
            expert_mapping=self.model.expert_mapping,
            required_buffers=lambda name: name.endswith(".tid2eid"),
        )


def _check_description_covered(model: nn.Module, quant_config) -> None:
    """Every quantized entry of the description must land on a module that applies it."""
    from vllm.model_executor.layers.linear import LinearBase

    covered = set()
    for name, mod in model.named_modules():
        if isinstance(mod, LinearBase) and getattr(mod, "quant_config", None) is not None:
            covered.update(quant_config.shard_prefixes(name))
        if isinstance(mod, DeepseekV4MoE) and not isinstance(mod.routed.quant_method, DeepseekV4FloatMoEMethod):
            covered.update(
                f"{name}.experts.{e}.{p}" for e in range(mod.n_experts) for p in ("gate_proj", "up_proj", "down_proj")
            )
    desc = quant_config.description
    mtp = mtp_patterns(model.config)  # skipped on load, quantized or not

    def elsewhere(p: str) -> bool:  # an MTP layer, or a layer of another pipeline stage
        return any(r.search(p) for r in mtp) or is_pp_missing_parameter(p, model)

    stray = sorted(p for p in desc.quantized_weights() if p not in covered and not elsewhere(p))
    if stray:
        raise ValueError(
            f"{desc.source}: {stray[0]}.weight is {desc.quantized_weights()[stray[0]]}, but the "
            f"DeepSeek-V4 module it belongs to runs in float only ({len(stray)} such: "
            f"{stray[:6]})"
        )


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of a loaded model (for benchmarks via ``LLM.apply_model``),
    plus the engine-held prepacked copies of W8A8_DYNAMIC linears (their plain weights are released)."""
    tensors = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    engine_linears = (getattr(m, "modelslim_engine_linear", None) for m in model.modules())
    return tensors + sum(e.nbytes for e in engine_linears if e is not None)
