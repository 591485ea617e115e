"""RWKV-7 ("Goose", x070) for vLLM: attention-free, per-sequence recurrent state.

Layout follows vLLM's own model files: the time-mix and channel-mix layers,
the block (one vLLM state layer per block), the model, then the causal-LM
head with ``load_weights``.

State: each block owns four per-sequence tensors in vLLM's state cache
(``MambaBase`` with ``mamba_type`` LINEAR): the time-mix shift vector ``[C]``,
the WKV matrix ``[H, N, N]`` (float32), the channel-mix shift vector ``[C]``
and the count of tokens the state has consumed (``[1]`` int64, for speculative
decoding). Memory per sequence does not depend on the context length. A
request's state is read as zero when it starts (no context yet), whatever its
slot holds, so a reused slot never leaks another request's state, and a
preempted request restarts from zero.

Batches come with decodes first (one token each: batched ``wkv_step``), then
prefills (one ``wkv_chunk`` call over all of them, each starting from its
stored state when the prompt is continued by chunked prefill).

Speculative decoding (n-gram drafts): vLLM gives each request ``1 + k`` state rows
and a decode up to ``1 + k`` tokens (the last sampled one and its drafts). The
state after the decode's ``j``-th token goes to row ``j``, with the count of
tokens it has consumed (a fourth state entry); the next step resumes from the
row whose count equals the tokens accepted so far, so rejected drafts roll back.

Tensor parallelism splits the heads: each rank holds ``H / tp`` heads of every
time-mix (and their ``[H / tp, N, N]`` WKV states) and a column slice of the
channel-mix; the two row-parallel projections all-reduce.

Pipeline parallelism splits the layers (vLLM's ``make_layers``): the first stage
holds the embedding (and layer 0's ``pre_norm``), the last the final norm and the
head, and each stage the state cache of its own layers only. A stage hands the
next one the residual stream and ``v_first``, layer 0's value, which every later
time-mix mixes in.

Compilation (vLLM's ``@support_torch_compile`` on ``Rwkv7Model``): everything that reads
or writes the per-sequence state is one of two registered custom ops that write their
outputs in place (``vllm::rwkv7_token_shift``, ``vllm::rwkv7_wkv``; the policy lists them
as splitting ops, like vLLM's ``linear_attention``), and the compiled graph holds the
projections, norms and mixes between them. Both ops read the step from the state backend's
metadata (``Rwkv7StateMetadataBuilder``), which takes its host values from vLLM's host copies
(``query_start_loc_cpu``): no step reads a device value on the host, inside the ops too. A step
whose requests all have the same query length (single-token decode, or a verification step of
``1 + k`` tokens) uses no host value beyond its shapes, so it replays captured as one graph on new
tokens, sequence lengths, state rows and state contents; the builder declares ``UNIFORM_BATCH``.
A step with prefills plans its WKV chunks on host values from the builder (those steps run the ops
eagerly between graph pieces).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
)
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader, sharded_weight_loader
from vllm.model_executor.models.interfaces import (
    HasInnerState,
    IsAttentionFree,
    SupportsMambaPrefixCaching,
    SupportsPP,
)
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    WeightsMapper,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.sequence import IntermediateTensors
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.linear_attn import (
    LinearAttentionBackend,
    LinearAttentionMetadata,
    LinearAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID, mamba_get_block_table_tensor

from ascend_adapters.common import compat, dispatch
from ascend_adapters.common.attention_backend import register_layer
from ascend_adapters.common.loading import load_checkpoint
from ascend_adapters.rwkv7 import kernels  # noqa: F401  (registers the kernel ops)
from ascend_adapters.rwkv7.config import check_checkpoint_dir, validate_config

# the kernel ops the state ops call, looked up once
_wkv_step = dispatch.op("rwkv7.wkv_step")
_wkv_chunk = dispatch.op("rwkv7.wkv_chunk")

# exp(-0.5): RWKV-7's decay is w = exp(-exp(-0.5) * sigmoid(.)), so log w >= -0.6065 per token
_DECAY_SCALE = 0.6065306597126334


def state_shapes(config, tp_size: int = 1) -> tuple[tuple[int], tuple[int, int, int], tuple[int], tuple[int]]:
    """Per rank: the two shift vectors hold the (replicated) layer input, the WKV matrix this rank's heads;
    the last entry counts the tokens the row's state has consumed (which row to resume from)."""
    c, n = config.hidden_size, config.head_dim
    return (c,), (c // n // tp_size, n, n), (c,), (1,)


def state_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype, torch.dtype]:
    return model_dtype, torch.float32, model_dtype, torch.int64


def state_bytes_per_sequence(config, model_dtype: torch.dtype = torch.float32) -> int:
    """Formula: layers x (2 C x sizeof(dtype) + H N^2 x 4 + 8)."""
    c, n = config.hidden_size, config.head_dim
    per_layer = 2 * c * torch.finfo(model_dtype).bits // 8 + (c // n) * n * n * 4 + 8
    return config.num_hidden_layers * per_layer


class Rwkv7StateBackend(LinearAttentionBackend):
    """vLLM's linear-attention state backend (one state row per request, or ``1 + num_speculative_tokens``
    under speculation), with RWKV-7's own metadata builder."""

    @staticmethod
    def get_name() -> str:
        return "RWKV7_STATE"

    @staticmethod
    def get_builder_cls() -> type[Rwkv7StateMetadataBuilder]:
        return Rwkv7StateMetadataBuilder


@dataclass
class Rwkv7StateMetadata(LinearAttentionMetadata):
    # [num_reqs, 1 + num_speculative_tokens] (None without speculation): after a step that accepted some
    # drafts, the state to resume from can be in any of a request's rows
    state_rows: torch.Tensor | None = None
    # the longest decode of the step (host int, <= 1 + num_speculative_tokens): the token positions stepped
    decode_width: int = 1
    # a step with prefills: each prefill's token offsets from the first prefill token, host ints from
    # vLLM's host copy of the query starts (the WKV chunk plans on them); None for a decode-only step,
    # which uses no host value
    prefill_bounds: tuple[int, ...] | None = None
    # how the step's tokens split into sequences: made by the step's first state op, from the first layer's
    # token counts before any layer rewrites them, and read by every layer of the group (they share this object)
    split: _Batch | None = field(default=None, init=False, repr=False, compare=False)


class Rwkv7StateMetadataBuilder(LinearAttentionMetadataBuilder):
    """vLLM's linear-attention metadata (decodes first, each request's state row) plus the state rows under
    speculation and the host values a step needs, read from the host copies vLLM hands every builder
    (``query_start_loc_cpu``), never from the device tensors.

    Under speculation a request of at most ``1 + num_speculative_tokens`` tokens is a decode (vLLM orders
    the batch by the same threshold), whether or not the step carries drafts: the decode path steps each
    token from the row whose count matches (``_Batch.from_metadata``), so it needs neither vLLM's count of
    accepted drafts nor a per-engine rule for when it is handed.

    Graph support: ``UNIFORM_BATCH``. A step whose requests all have the same query length (single-token
    decode, or a verification step of ``1 + k`` tokens each) uses no host value beyond that length and
    the batch size, and vLLM's padding requests of a captured batch (no tokens, sequence length 0) go
    to the null block, so it replays captured on new tokens, sequence lengths, state rows and state
    contents (``tests/test_rwkv7_capture.py``)."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.num_spec_tokens: int = vllm_config.num_speculative_tokens
        self._init_reorder_batch_threshold(1, self.num_spec_tokens > 0)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False) -> Rwkv7StateMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        rows = None
        if self.num_spec_tokens:
            rows = mamba_get_block_table_tensor(
                common_attn_metadata.block_table_tensor,
                common_attn_metadata.seq_lens,
                self.kv_cache_spec,
                self.vllm_config.cache_config.mamba_cache_mode,
            )[:, : 1 + self.num_spec_tokens]
        width, bounds = self.host_values(
            common_attn_metadata.query_start_loc_cpu, md.num_decodes, md.num_prefills, rows is not None
        )
        return Rwkv7StateMetadata(**vars(md), state_rows=rows, decode_width=width, prefill_bounds=bounds)

    @staticmethod
    def host_values(query_start_loc_cpu: torch.Tensor, num_decodes: int, num_prefills: int, speculative: bool):
        """``(decode_width, prefill_bounds)`` of a step, from vLLM's host copy of the query starts."""
        q, nd = query_start_loc_cpu, num_decodes
        width = int((q[1 : nd + 1] - q[:nd]).max()) if speculative and nd else 1
        bounds = None
        if num_prefills:
            starts = q[nd : nd + num_prefills + 1]
            bounds = tuple((starts - starts[0]).tolist())
        return width, bounds


@dataclass
class _Batch:
    """How the flat token batch splits into sequences, from the state backend's metadata.

    Decodes come first: request ``i`` has ``0..W`` tokens (``W``: the step's longest decode, at most
    ``1 + num_speculative_tokens``; no token: a padding request of a captured batch);
    its stored state is read from row ``decode_src[i]`` and the state after its ``j``-th token is
    written to row ``decode_dst[i, j]``. Everything about decodes is a device tensor (capture-safe);
    the one host value beyond the shapes is ``prefill_bounds``, for a step with prefills.
    """

    num_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    decode_src: torch.Tensor  # [nd] state-cache row each decode starts from
    decode_dst: torch.Tensor  # [nd, W] row that receives the state after token j
    decode_tok: torch.Tensor  # [nd, W] flat index of token j (clamped into the decode tokens)
    decode_active: torch.Tensor  # [nd, W] bool: request i has a j-th token
    decode_req: torch.Tensor  # [num_decode_tokens] request of each decode token
    decode_pos: torch.Tensor  # [num_decode_tokens] its position j within the request
    decode_computed: torch.Tensor  # [nd] tokens before this step (0: the state starts at zero)
    prefill_slots: torch.Tensor  # [np]
    prefill_computed: torch.Tensor  # [np]
    prefill_seq_lens: torch.Tensor  # [np] tokens consumed after this step
    prefill_first: torch.Tensor  # [np] flat index of each prefill's first token
    prefill_last: torch.Tensor  # [np] and of its last
    prefill_cu: torch.Tensor  # [np + 1] device: prefill starts relative to the first prefill (the chunk kernel's)
    prefill_bounds: tuple[int, ...] | None = None  # [np + 1] host: prefill starts relative to the first prefill

    @property
    def decode_fresh(self) -> torch.Tensor:
        return self.decode_computed <= 0

    @property
    def prefill_fresh(self) -> torch.Tensor:
        return self.prefill_computed <= 0

    @property
    def width(self) -> int:
        return self.decode_dst.shape[1]

    @classmethod
    def from_metadata(cls, md: Rwkv7StateMetadata, tokens_state: torch.Tensor) -> _Batch:
        nd, npf, ndt = md.num_decodes, md.num_prefills, md.num_decode_tokens
        num_reqs = nd + npf
        dev = md.state_indices_tensor.device
        qsl = md.query_start_loc[: num_reqs + 1].to(dev, torch.long)
        seq_lens = md.seq_lens[:num_reqs].to(dev, torch.long)
        computed = seq_lens - (qsl[1:] - qsl[:-1])
        # vLLM pads a captured decode batch with requests of no tokens and sequence length 0, whose block
        # table rows are the null block: their state
        # reads and writes go to the null block, which no request owns
        pad = (seq_lens[:nd] == 0).unsqueeze(1)
        if md.state_rows is not None:
            # speculation: resume from the row whose state has consumed exactly the tokens before this
            # step (vLLM hands its count of accepted drafts only to hybrid models' backends, so each row
            # records its own count). Every step rewrites rows 0..width-1 (a row without a token gets
            # count -1), so the right row is the first match: a later row can still hold an equal count
            # from a rejected draft or an earlier owner, never an earlier one.
            rows = torch.where(pad, NULL_BLOCK_ID, md.state_rows[:nd].long())
            matches = tokens_state[rows].view(rows.shape) == computed[:nd].unsqueeze(1)
            src = rows.gather(1, matches.int().argmax(1, keepdim=True)).squeeze(1)
            rows = rows[:, : md.decode_width]
        else:
            rows = torch.where(pad, NULL_BLOCK_ID, md.state_indices_tensor[:nd].long().unsqueeze(1))
            src = rows[:, 0]
        j = torch.arange(rows.shape[1], device=dev)
        tok = qsl[:nd].unsqueeze(1) + j
        t = torch.arange(ndt, device=dev)
        # a token past the last request's (the padding of a captured batch) counts as the last request's
        decode_req = torch.searchsorted(qsl[1 : nd + 1], t, right=True).clamp(max=max(nd - 1, 0))
        batch = dict(
            num_tokens=ndt + md.num_prefill_tokens,
            num_decodes=nd,
            num_decode_tokens=ndt,
            num_prefills=npf,
            decode_src=src,
            decode_dst=rows,
            decode_tok=tok.clamp(max=max(ndt - 1, 0)),
            decode_active=tok < qsl[1 : nd + 1].unsqueeze(1),
            decode_req=decode_req,
            decode_pos=(t - qsl[decode_req]).clamp(max=rows.shape[1] - 1),
            decode_computed=computed[:nd],
            prefill_slots=md.state_indices_tensor[nd:num_reqs].long(),
            prefill_computed=computed[nd:],
            prefill_seq_lens=seq_lens[nd:],
            prefill_first=qsl[nd:num_reqs],
            prefill_last=qsl[nd + 1 :] - 1,
            prefill_cu=qsl[nd:] - qsl[nd],
        )
        return cls(**batch, prefill_bounds=md.prefill_bounds if npf else None)


def _stored(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """The stored state rows of ``slots``; zero for a fresh request, whatever its slot holds (a finished
    request's state, or anything else: selected, not multiplied, so inf or NaN there cannot leak)."""
    rows = state[slots]
    return torch.where(fresh.view(-1, *([1] * (rows.dim() - 1))), rows.new_zeros(()), rows)


def _store_decodes(state: torch.Tensor, batch: _Batch, rows: torch.Tensor) -> None:
    """``rows`` ``[nd, W, ...]``: the state after each decode's ``j``-th token, into its row ``j``; a
    decode without a ``j``-th token keeps that row."""
    dst = batch.decode_dst.reshape(-1)
    rows = rows.reshape(-1, *rows.shape[2:]).to(state.dtype)
    if batch.width == 1:  # no speculation: one token per decode
        state[dst] = rows
        return
    active = batch.decode_active.reshape(-1, *([1] * (rows.dim() - 1)))
    state[dst] = torch.where(active, rows, state[dst])


def rwkv7_token_shift(x: torch.Tensor, prev: torch.Tensor, layer_name: str, state_index: int) -> None:
    """``prev``: the previous token's ``x`` for every token; a sequence's first token takes its stored
    one, and its last token's ``x`` is stored (state ``state_index`` of the layer's cache)."""
    get_forward_context().no_compile_layers[layer_name].token_shift(x, prev, state_index)


def rwkv7_wkv(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    layer_name: str,
) -> None:
    """``y`` ([T, H, N] float32): the WKV-7 output of every token, each sequence from its stored state."""
    get_forward_context().no_compile_layers[layer_name].wkv(r, w, k, v, a, b, y)


# registered as SPLITTING_OPS (the hook module) names them; the policy adds them to vLLM's splitting ops
compat.register_opaque_op("rwkv7_token_shift", rwkv7_token_shift, mutates_args=["prev"])
compat.register_opaque_op("rwkv7_wkv", rwkv7_wkv, mutates_args=["y"])


class Rwkv7LoRA(nn.Module):
    """``up(act(down(x)))``: fla's ``lora.0`` / ``lora.2``.

    ``down`` is replicated (its input is the full hidden state); ``up`` is column-parallel, so each
    rank gets the channels of its own heads.
    """

    def __init__(self, c: int, rank: int, bias: bool, quant_config, prefix: str):
        super().__init__()
        self.down = ReplicatedLinear(c, rank, bias=False, quant_config=quant_config, prefix=f"{prefix}.down")
        self.up = ColumnParallelLinear(rank, c, bias=bias, quant_config=quant_config, prefix=f"{prefix}.up")

    def forward(self, x: torch.Tensor, act=None) -> torch.Tensor:
        h, _ = self.down(x)
        if act is not None:
            h = act(h)
        out, _ = self.up(h)
        return out


def _param(*shape: int, loader) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(*shape), requires_grad=False)
    set_weight_attrs(p, {"weight_loader": loader})
    return p


def _flat_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """The HF layout stores the token-shift mixes as ``[1, 1, C]``."""
    default_weight_loader(param, loaded.reshape(param.shape))


class Rwkv7GroupNorm(nn.Module):
    """``ln_x``: a group norm with one group per head; each rank normalises its own heads."""

    def __init__(self, num_heads: int, channels: int, eps: float):
        super().__init__()
        self.num_heads, self.eps = num_heads, eps
        self.weight = _param(channels, loader=sharded_weight_loader(0))
        self.bias = _param(channels, loader=sharded_weight_loader(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, self.num_heads, self.weight, self.bias, self.eps)


class Rwkv7TimeMix(nn.Module):
    """Heads are split across tensor-parallel ranks: r/k/v and the LoRA up-projections are
    column-parallel, the per-channel vectors of k and the group norm hold this rank's heads, and
    ``o_proj`` is row-parallel (its all-reduce is the layer's only communication). The token-shift
    mixes act on the replicated layer input and stay whole.
    """

    def __init__(self, config, layer_id: int, quant_config, prefix: str):
        super().__init__()
        c, n = config.hidden_size, config.head_dim
        tp = get_tensor_model_parallel_world_size()
        self.layer_id = layer_id
        self.hidden_size, self.head_dim = c, n
        self.num_heads = c // n // tp  # this rank's heads
        self.group_norm_eps = config.head_dim * config.norm_eps
        for x in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            setattr(self, x, _param(c, loader=_flat_loader))
        self.k_k = _param(c // tp, loader=sharded_weight_loader(0))
        self.k_a = _param(c // tp, loader=sharded_weight_loader(0))
        self.r_k = _param(self.num_heads, n, loader=sharded_weight_loader(0))
        self.r_proj = ColumnParallelLinear(c, c, bias=False, quant_config=quant_config, prefix=f"{prefix}.r_proj")
        self.k_proj = ColumnParallelLinear(c, c, bias=False, quant_config=quant_config, prefix=f"{prefix}.k_proj")
        self.v_proj = ColumnParallelLinear(c, c, bias=False, quant_config=quant_config, prefix=f"{prefix}.v_proj")
        self.o_proj = RowParallelLinear(c, c, bias=False, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.w_lora = Rwkv7LoRA(c, config.decay_low_rank_dim, True, quant_config, f"{prefix}.w_lora")
        self.a_lora = Rwkv7LoRA(c, config.a_low_rank_dim, True, quant_config, f"{prefix}.a_lora")
        if layer_id > 0:
            self.v_lora = Rwkv7LoRA(c, config.v_low_rank_dim, True, quant_config, f"{prefix}.v_lora")
        self.g_lora = Rwkv7LoRA(c, config.gate_low_rank_dim, False, quant_config, f"{prefix}.g_lora")
        self.g_norm = Rwkv7GroupNorm(self.num_heads, self.num_heads * n, self.group_norm_eps)

    def forward(self, x: torch.Tensor, v_first: torch.Tensor | None, layer_name: str):
        T = x.shape[0]
        H, N = self.num_heads, self.head_dim
        prev = torch.empty_like(x)
        torch.ops.vllm.rwkv7_token_shift(x, prev, layer_name, 0)
        xx = prev - x
        xr, xw, xk, xv, xa, xg = (
            torch.addcmul(x, xx, m) for m in (self.x_r, self.x_w, self.x_k, self.x_v, self.x_a, self.x_g)
        )
        r, _ = self.r_proj(xr)
        k, _ = self.k_proj(xk)
        v, _ = self.v_proj(xv)
        w = torch.exp(-_DECAY_SCALE * torch.sigmoid(self.w_lora(xw, torch.tanh).float()))
        a = torch.sigmoid(self.a_lora(xa))
        g = self.g_lora(xg, torch.sigmoid)
        kk = F.normalize((k * self.k_k).view(T, H, N), dim=-1, p=2.0).view(T, -1)
        k = k * (1 + (a - 1) * self.k_a)
        if self.layer_id == 0:
            v_first = v
        else:
            v = v + (v_first - v) * torch.sigmoid(self.v_lora(xv))
        y = torch.empty(T, H, N, dtype=torch.float32, device=x.device)
        r3, w3, k3, v3, a3, b3 = (t.reshape(T, H, N) for t in (r, w, k, v, -kk, kk * a))
        torch.ops.vllm.rwkv7_wkv(r3, w3, k3, v3, a3, b3, y, layer_name)
        y = self.g_norm(y.reshape(T, H * N).to(x.dtype))
        y = y + ((r * k * self.r_k.view(-1)).view(T, H, N).sum(-1, keepdim=True) * v.view(T, H, N)).view(T, -1)
        out, _ = self.o_proj(y * g)
        return out, v_first


class Rwkv7ChannelMix(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        c, i = config.hidden_size, config.intermediate_size
        self.x_k = nn.Parameter(torch.zeros(c), requires_grad=False)
        self.key = ColumnParallelLinear(c, i, bias=False, quant_config=quant_config, prefix=f"{prefix}.key")
        self.value = RowParallelLinear(i, c, bias=False, quant_config=quant_config, prefix=f"{prefix}.value")

    def forward(self, x: torch.Tensor, layer_name: str):
        prev = torch.empty_like(x)
        torch.ops.vllm.rwkv7_token_shift(x, prev, layer_name, 2)
        xk = torch.addcmul(x, prev - x, self.x_k)
        h, _ = self.key(xk)
        out, _ = self.value(torch.relu(h).square())
        return out


class Rwkv7Block(nn.Module, MambaBase):
    """One RWKV-7 layer and its per-sequence state (a vLLM state layer)."""

    def __init__(self, config, layer_id: int, model_dtype: torch.dtype, quant_config, prefix: str):
        super().__init__()
        c, eps = config.hidden_size, config.ln_eps if hasattr(config, "ln_eps") else config.norm_eps
        self.config, self.layer_id, self.prefix, self.model_dtype = config, layer_id, prefix, model_dtype
        if layer_id == 0:
            self.pre_norm = nn.LayerNorm(c, eps=eps)
        self.attn_norm = nn.LayerNorm(c, eps=eps)
        self.ffn_norm = nn.LayerNorm(c, eps=eps)
        self.attn = Rwkv7TimeMix(config, layer_id, quant_config, f"{prefix}.attn")
        self.ffn = Rwkv7ChannelMix(config, quant_config, f"{prefix}.ffn")
        self.kv_cache = ()
        register_layer(prefix, self)

    # --- vLLM state-layer interface
    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def get_state_shape(self):
        return state_shapes(self.config, get_tensor_model_parallel_world_size())

    def get_state_dtype(self):
        return state_dtypes(self.model_dtype)

    def get_attn_backend(self):
        return Rwkv7StateBackend

    # --- the state ops' bodies (run outside the compiled graph pieces)
    def _step(self) -> _Batch | None:
        md = get_forward_context().attn_metadata
        if isinstance(md, dict):
            md = md.get(self.prefix)
        if md is None or not self.kv_cache:  # dummy/profiling run: one sequence, fresh state, nothing stored
            return None
        if md.split is None:  # the step's first state op: every later one reads the same split
            md.split = _Batch.from_metadata(md, self.kv_cache[3])
        return md.split

    def token_shift(self, x: torch.Tensor, prev: torch.Tensor, state_index: int) -> None:
        batch = self._step()
        prev[0].zero_()
        prev[1:] = x[:-1]
        if batch is None:
            return
        shift_state = self.kv_cache[state_index]
        if batch.num_decodes:
            # a decode's first token takes its stored row: a gather over the decode tokens (a scatter by
            # request would let a padding request of a captured batch overwrite a real token's row)
            nt = batch.num_decode_tokens
            stored = _stored(shift_state, batch.decode_src, batch.decode_fresh).to(x.dtype)
            first = (batch.decode_pos == 0).unsqueeze(1)
            prev[:nt] = torch.where(first, stored[batch.decode_req], prev[:nt])
            _store_decodes(shift_state, batch, x[batch.decode_tok])
        if batch.num_prefills:
            slots = batch.prefill_slots
            prev[batch.prefill_first] = _stored(shift_state, slots, batch.prefill_fresh).to(x.dtype)
            shift_state[slots] = x[batch.prefill_last].to(shift_state.dtype)

    def wkv(self, r, w, k, v, a, b, y: torch.Tensor) -> None:
        batch = self._step()
        if batch is None:
            y.copy_(_wkv_chunk(r, w, k, v, a, b, output_final_state=False)[0])
            return
        wkv_state = self.kv_cache[1]
        nd, nt, n = batch.num_decodes, batch.num_decode_tokens, batch.num_tokens
        y[n:].zero_()  # padding rows
        if nd:
            # token j of every decode in one batched step; under speculation the state after each token
            # is kept in its own row, so the next step starts from the last accepted one
            width = batch.width
            rd, wd, kd, vd, ad, bd = (t[batch.decode_tok] for t in (r, w, k, v, a, b))  # [nd, W, H, N]
            state = _stored(wkv_state, batch.decode_src, batch.decode_fresh)
            y_decode = y.new_empty(nd, width, *y.shape[1:])
            states = state.new_empty(nd, width, *state.shape[1:]) if width > 1 else state.unsqueeze(1)
            for j in range(width):
                y_decode[:, j] = _wkv_step(rd[:, j], wd[:, j], kd[:, j], vd[:, j], ad[:, j], bd[:, j], state)
                if width > 1:
                    states[:, j] = state
            _store_decodes(wkv_state, batch, states)
            # a row without a j-th token is marked unused (-1), so no stale count can match next step
            j = torch.arange(width, device=y.device)
            tokens = torch.where(batch.decode_active, batch.decode_computed.unsqueeze(1) + j + 1, -1)
            self.kv_cache[3][batch.decode_dst.reshape(-1)] = tokens.reshape(-1, 1)
            y[:nt] = y_decode[batch.decode_req, batch.decode_pos]
        if batch.num_prefills:  # every prefill of the step in one call
            slots = batch.prefill_slots
            y[nt:n], final = _wkv_chunk(
                r[nt:n],
                w[nt:n],
                k[nt:n],
                v[nt:n],
                a[nt:n],
                b[nt:n],
                _stored(wkv_state, slots, batch.prefill_fresh),
                cu_seqlens=batch.prefill_cu,
                cu_seqlens_cpu=batch.prefill_bounds,
            )
            wkv_state[slots] = final
            self.kv_cache[3][slots] = batch.prefill_seq_lens.unsqueeze(1)

    def forward(self, x: torch.Tensor, v_first: torch.Tensor | None):
        h = self.pre_norm(x) if self.layer_id == 0 else x
        a, v_first = self.attn(self.attn_norm(h), v_first, self.prefix)
        h = h + a
        h = h + self.ffn(self.ffn_norm(h), self.prefix)
        return h, v_first


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class Rwkv7Model(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.config = config
        pp = get_pp_group()
        if pp.is_first_rank:
            self.embeddings = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "embeddings")
            )
        else:
            self.embeddings = PPMissingLayer()
        dtype = vllm_config.model_config.dtype
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: Rwkv7Block(config, extract_layer_index(prefix), dtype, quant_config, prefix=prefix),
            prefix=maybe_prefix(prefix, "layers"),
        )
        if pp.is_last_rank:
            eps = config.ln_eps if hasattr(config, "ln_eps") else config.norm_eps
            self.norm = nn.LayerNorm(config.hidden_size, eps=eps)
        else:
            self.norm = PPMissingLayer()
        # v_first travels whole ([tokens, C]): vLLM sends each tensor between stages split across the
        # tensor-parallel ranks and all-gathers it on arrival, so it must be the same on every rank
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "v_first"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            v_first = None
        else:
            x = intermediate_tensors["hidden_states"]
            v_first = _rank_channels(intermediate_tensors["v_first"])
        for layer in self.layers[self.start_layer : self.end_layer]:
            x, v_first = layer(x, v_first)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": x, "v_first": _all_channels(v_first)})
        return self.norm(x)


def _rank_channels(v_first: torch.Tensor) -> torch.Tensor:
    """This tensor-parallel rank's channels (its heads' values) of a whole ``v_first``."""
    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return v_first
    width = v_first.shape[-1] // tp
    rank = get_tensor_model_parallel_rank()
    return v_first[:, rank * width : (rank + 1) * width].contiguous()


def _all_channels(v_first: torch.Tensor) -> torch.Tensor:
    return v_first if get_tensor_model_parallel_world_size() == 1 else tensor_model_parallel_all_gather(v_first, -1)


class Rwkv7ForCausalLM(nn.Module, HasInnerState, IsAttentionFree, SupportsPP, SupportsMambaPrefixCaching):
    """vLLM model class for ``RWKV7ForCausalLM`` checkpoints in the HF/fla layout.

    Prefix caching uses vLLM's "align" mode for recurrent state: the state cache has one
    slot per ``block_size`` tokens of a request, prefill chunks end at block boundaries, the
    state after each whole block stays in that block's slot, and a request whose prompt
    shares whole blocks with an earlier one starts from the state copied out of the last
    shared block (the four state tensors are copied whole).
    """

    # the HF/fla layout: LoRA ``Sequential`` indices become ``down``/``up``
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_regex={
            re.compile(r"\.([wavg])_lora\.lora\.0\."): r".\1_lora.down.",
            re.compile(r"\.([wavg])_lora\.lora\.2\."): r".\1_lora.up.",
        }
    )

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return state_shapes(vllm_config.model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return state_dtypes(vllm_config.model_config.dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return (get_temporal_copy_spec,) * 4  # token-shift [C], WKV [H, N, N], token-shift [C], tokens [1]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        validate_config(config, source=f"{vllm_config.model_config.model}/config.json")
        self.config = config
        self.vllm_config = vllm_config
        self.model = Rwkv7Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self._check_checkpoint_shapes()
        return load_checkpoint(self, weights, what="RWKV-7", mapper=self.hf_to_vllm_mapper)

    def _check_checkpoint_shapes(self) -> None:
        """Compare safetensors headers with config.json before loading anything (local dirs only)."""
        check_checkpoint_dir(self.config, self.vllm_config.model_config.model)
