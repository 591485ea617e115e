"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed entries, with sinks and
a grouped output projection.

vLLM's paged attention cannot express it (one shared K=V head, per-head sinks, a sliding window *plus*
compressed entries selected per query by the lightning indexer, all in one softmax), so the layer
attends itself (``vllm::dsv4_attention``, a splitting op run eagerly between compiled pieces) over
caches that vLLM pages: each attention layer owns up to four ``DeepseekV4Cache`` layers
(``memory.layer_caches``), each with a KV-cache spec of its own, so a request holds only what its
layer type needs for its own length:

* ``window``  one row of ``head_dim`` per position (the shared K=V), sliding window W;
* ``pending`` one row of ``hidden`` per position (the layer input) for the compressor, sliding window
  2*rate (CSA: an entry pools two windows) or rate (HCA);
* ``entries`` one compressed KV entry per ``rate`` positions, entry w at row w;
* ``index``   the indexer's compressed key per ``rate`` positions (CSA).

Rows are addressed by position (entry number), not modulo a ring: a rejected draft token's rows are
rewritten when its position is computed again, and exactness does not depend on how a prompt is split
into chunks: each token reads only positions of its own request written before.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear

from ascend_adapters.common import compat, dispatch
from ascend_adapters.deepseek_v4.backend import DeepseekV4CacheBackend
from ascend_adapters.deepseek_v4.compressor import DeepseekV4Compressor
from ascend_adapters.deepseek_v4.config import LAYER_CSA, LAYER_HCA, LAYER_SLIDING, compressed_enabled
from ascend_adapters.deepseek_v4.indexer import DeepseekV4Indexer
from ascend_adapters.deepseek_v4.memory import ENTRIES, INDEX, PENDING, WINDOW, CacheGeometry, layer_caches
from ascend_adapters.deepseek_v4.rope import apply_rope, deepseek_v4_rope

op = dispatch.op
# queries per attention call of one request (see DeepseekV4Attention._seq)
QUERY_TILE = 256


def _sharded_loader(dim: int):
    """Weight loader for a parameter split evenly along ``dim`` across the tensor-parallel ranks."""

    def loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        size = param.shape[dim]
        if loaded.shape[dim] != size * tp:
            raise ValueError(f"shape {tuple(loaded.shape)} does not split into {tp} x {tuple(param.shape)}")
        param.data.copy_(loaded.narrow(dim, rank * size, size))

    return loader


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
    window and compressed entries (``DeepseekV4Attention.attend``), writing the step's rows into the
    layer's caches. It walks the requests on the host, so it is a splitting op (the hook module's
    ``SPLITTING_OPS``): vLLM runs it eagerly between compiled graph pieces."""
    get_forward_context().no_compile_layers[layer_name].attend(x, q, kv, qr, positions, out)


compat.register_opaque_op("dsv4_attention", dsv4_attention, mutates_args=["out"])


class DeepseekV4Cache(nn.Module, AttentionLayerBase):
    """One paged cache of an attention layer: vLLM allocates it from its spec, binds it as
    ``[blocks, rows per block, width]`` and builds its group's metadata (``backend.py``) every step."""

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype, layer_name: str):
        super().__init__()
        self.geometry, self.dtype, self.layer_name = geometry, dtype, layer_name
        self.rows_per_block = geometry.block_size // geometry.tokens_per_row
        self.kv_cache = torch.tensor([])
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if layer_name in ctx:
            raise ValueError(f"Duplicate layer name: {layer_name}")
        ctx[layer_name] = self

    def get_attn_backend(self) -> type[DeepseekV4CacheBackend]:
        return DeepseekV4CacheBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig):
        g = self.geometry
        if g.sliding_window is None:
            return compat.compressed_attention_spec(
                block_size=g.block_size, head_size=g.width, dtype=self.dtype, tokens_per_row=g.tokens_per_row
            )
        return compat.sliding_window_row_spec(
            block_size=g.block_size, head_size=g.width, dtype=self.dtype, sliding_window=g.sliding_window
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        # 0.32: [blocks, 1 head, rows, width]; 0.27/0.28: [blocks, rows, width]
        self.kv_cache = kv_cache.squeeze(1) if kv_cache.dim() == 4 else kv_cache


class RequestCaches:
    """One request's view of a layer's caches: rows by position (or entry number) through its block tables."""

    def __init__(self, caches: dict[str, DeepseekV4Cache], block_tables: dict[str, torch.Tensor]):
        self.caches, self.block_tables = caches, block_tables

    def _where(self, kind: str, rows: torch.Tensor):
        cache = self.caches[kind]
        per_block = cache.rows_per_block
        return cache.kv_cache, self.block_tables[kind][rows // per_block], rows % per_block

    def read(self, kind: str, rows: torch.Tensor) -> torch.Tensor:
        t, block, offset = self._where(kind, rows)
        return t[block, offset]

    def write(self, kind: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        t, block, offset = self._where(kind, rows)
        t[block, offset] = values.to(t.dtype)


class DeepseekV4Attention(nn.Module):
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
        # the caches are children named as their layers (``<prefix>.window_cache``, ...), in the model's dtype:
        # every value cached is a model-dtype tensor of the reference's arithmetic
        self.caches: dict[str, DeepseekV4Cache] = {}
        for kind, geometry in layer_caches(config, self.layer_type).items():
            cache = DeepseekV4Cache(geometry, torch.get_default_dtype(), f"{prefix}.{kind}_cache")
            setattr(self, f"{kind}_cache", cache)
            self.caches[kind] = cache
        cc = vllm_config.compilation_config
        if prefix in cc.static_forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        cc.static_forward_context[prefix] = self

    # -- one request -------------------------------------------------------------------------
    def _seq(self, x, q, kv, qr, pos0: int, caches: RequestCaches | None):
        """Attention for one request's ``n`` new tokens at positions pos0..pos0+n-1 (``caches`` None:
        a stateless profile run of this chunk alone). Queries go ``QUERY_TILE`` at a time, each tile
        over its own window keys and the entries, so a long chunk's score matrix stays
        ``QUERY_TILE x (W - 1 + QUERY_TILE + entries)``."""
        n = x.shape[0]
        dev = x.device
        qpos = torch.arange(pos0, pos0 + n, device=dev)
        W = self.window
        # sliding-window keys: the W-1 positions before pos0 (from the window cache) + the new ones
        prev_pos = torch.arange(max(0, pos0 - W + 1), pos0, device=dev)
        if caches is not None and prev_pos.numel():
            prev_kv = caches.read(WINDOW, prev_pos).to(kv.dtype)
        else:
            prev_pos = prev_pos[:0]
            prev_kv = kv.new_zeros((0, kv.shape[1]))
        window_keys = torch.cat([prev_kv, kv], 0)
        window_pos = torch.cat([prev_pos, qpos])
        first = pos0 - prev_kv.shape[0]  # position of window_keys[0]
        if self.compressor is not None:
            entries, idx_entries, n_entries = self._compress(x, pos0, caches)
        out = []
        for a in range(0, n, QUERY_TILE):
            b = min(n, a + QUERY_TILE)
            tpos = qpos[a:b]
            lo, hi = max(0, pos0 + a - W + 1 - first), pos0 + b - first
            keys, kpos = window_keys[lo:hi], window_pos[lo:hi]
            allowed = (kpos[None, :] <= tpos[:, None]) & (tpos[:, None] - kpos[None, :] < W)
            if self.compressor is not None:
                visible = torch.arange(n_entries, device=dev)[None, :] < ((tpos + 1) // self.rate)[:, None]
                if self.layer_type == LAYER_CSA and n_entries:
                    visible = self._index(x[a:b], qr[a:b], tpos, idx_entries, visible)
                keys = torch.cat([keys, entries], 0)
                allowed = torch.cat([allowed, visible], 1)
            out.append(op("dsv4.sink_attention")(q[a:b], keys, allowed, self.sinks, self.scale))
        if caches is not None:
            caches.write(WINDOW, qpos, kv)
        return torch.cat(out, 0)

    def _compress(self, x, pos0: int, caches: RequestCaches | None):
        """Emit the entries of windows that close in this chunk; return all entries so far."""
        comp, m = self.compressor, self.rate
        n = x.shape[0]
        dev = x.device
        overlap = self.layer_type == LAYER_CSA
        w_first, w_end = pos0 // m, (pos0 + n) // m  # windows closing here: w_first..w_end-1
        new_c = new_i = None
        if w_end > w_first:
            start_w = max(0, w_first - 1) if overlap else w_first
            has_prev = overlap and w_first > 0
            start = start_w * m
            stop = w_end * m
            if start < pos0:
                if caches is None:
                    raise RuntimeError("DeepSeek-V4 compressor needs earlier positions but no cache is bound")
                old = caches.read(PENDING, torch.arange(start, pos0, device=dev)).to(x.dtype)
                rows = torch.cat([old, x[: stop - pos0]], 0)
            else:
                rows = x[start - pos0 : stop - pos0]
            new_c = comp.pool(rows, start, self.compress_rotary_emb, has_prev)
            if overlap:
                new_i = comp.indexer.pool(rows, start, self.compress_rotary_emb, has_prev)
        if caches is None:  # stateless (profile) run: this chunk alone, from position pos0
            ent = new_c if new_c is not None else x.new_zeros((0, self.head_dim))
            return ent, new_i, ent.shape[0]
        if new_c is not None:
            closing = torch.arange(w_first, w_end, device=dev)
            caches.write(ENTRIES, closing, new_c)
            if new_i is not None:
                caches.write(INDEX, closing, new_i)
        caches.write(PENDING, torch.arange(pos0, pos0 + n, device=dev), x)
        every = torch.arange(w_end, device=dev)
        ent = caches.read(ENTRIES, every).to(x.dtype)
        return ent, (caches.read(INDEX, every).to(x.dtype) if overlap else None), w_end

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
        """The body of ``vllm::dsv4_attention``: each request of the step over its own caches (its
        boundaries and first position from the metadata builder, on the host), written into ``out``."""
        md = get_forward_context().attn_metadata
        window = self.caches[WINDOW]
        md = md if isinstance(md, dict) and window.layer_name in md else None
        if md is None or window.kv_cache.numel() == 0:  # profile / dummy run: one stateless sequence
            out.copy_(self._seq(x, q, kv, qr, int(positions[0]), None))
            return
        qsl, first = md[window.layer_name].query_start_loc, md[window.layer_name].first_positions
        tables = {kind: md[cache.layer_name].block_table for kind, cache in self.caches.items()}
        for i in range(len(qsl) - 1):
            a, b = qsl[i], qsl[i + 1]
            if b <= a:
                continue
            caches = RequestCaches(self.caches, {kind: t[i] for kind, t in tables.items()})
            out[a:b] = self._seq(x[a:b], q[a:b], kv[a:b], qr[a:b], first[i], caches)

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
