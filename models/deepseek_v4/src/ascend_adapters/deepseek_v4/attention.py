"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed entries, with sinks and
a grouped output projection.

vLLM's paged attention cannot express it (one shared K=V head, per-head sinks, a sliding window *plus*
compressed entries selected per query by the lightning indexer, all in one softmax), so the layer
attends itself (``vllm::dsv4_attention``) over caches that vLLM pages: each attention layer owns up
to five ``DeepseekV4Cache`` layers (``memory.layer_caches``), each with a KV-cache spec of its own, so
a request holds only what its layer type needs for its own length:

* ``window``      one row of ``head_dim`` per position (the shared K=V), sliding window W;
* ``state``       CSA: the compressor's KV projection and gate of each position, sliding window 2*rate (an
  entry pools two windows); ``index_state`` the indexer's. HCA: each position's running summary of its
  window (``compressor.py``), float32, sliding window 2 (a step reads the position before its first);
* ``entries``     one compressed KV entry per ``rate`` positions, entry w at row w;
* ``index``       the indexer's compressed key per ``rate`` positions (CSA).

Rows are addressed by position (entry number), not modulo a ring: a rejected draft token's rows are
rewritten when its position is computed again, and exactness does not depend on how a prompt is split
into chunks: each token reads only positions of its own request written before.

A step is one pass over all its tokens: every row the step brings is written first (one scatter per
cache, slots from the block tables), then every grid of queries (``backend.Segment``: all the step's
decodes and MTP verifications in one, a prefill request in tiles) closes its compression windows (HCA: writes
its summaries and closes windows from them, grid after grid), and then each attends, reading its requests'
rows through their block tables. Positions, sequence starts and masks are device tensors; the host holds
only shapes, so a uniform decode step replays from a graph.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader

from ascend_adapters.common import compat, dispatch
from ascend_adapters.common.attention_backend import register_layer
from ascend_adapters.common.kernels.kv8 import CacheRows
from ascend_adapters.common.policy import EIGHT_BIT_CACHE_DTYPES
from ascend_adapters.deepseek_v4.backend import DeepseekV4CacheBackend
from ascend_adapters.deepseek_v4.compressor import DeepseekV4Compressor
from ascend_adapters.deepseek_v4.config import LAYER_CSA, LAYER_HCA, LAYER_SLIDING, compressed_enabled
from ascend_adapters.deepseek_v4.indexer import DeepseekV4Indexer
from ascend_adapters.deepseek_v4.memory import (
    ENTRIES,
    INDEX,
    INDEX_STATE,
    STATE,
    WINDOW,
    CacheGeometry,
    layer_caches,
)
from ascend_adapters.deepseek_v4.rope import apply_rope, deepseek_v4_rope

# the kernel ops, looked up once
_sink_attention = dispatch.op("dsv4.sink_attention")
_indexer_scores = dispatch.op("dsv4.indexer_scores")
_rms_norm = dispatch.op("dsv4.rms_norm")
_grouped_linear = dispatch.op("dsv4.grouped_linear")


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
    layer's caches. A splitting op (the hook module's ``SPLITTING_OPS``): vLLM compiles the pieces
    between these calls, as it does around its own attention ops."""
    get_forward_context().no_compile_layers[layer_name].attend(x, q, kv, qr, positions, out)


compat.register_opaque_op("dsv4_attention", dsv4_attention, mutates_args=["out"])


class DeepseekV4Cache(nn.Module, AttentionLayerBase):
    """One paged cache of an attention layer: vLLM allocates it from its spec, binds it as
    ``[blocks, rows per block, width]`` and builds its group's metadata (``backend.py``) every step."""

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype, cache_dtype: str, layer_name: str):
        super().__init__()
        dtype = torch.float32 if geometry.float32 else dtype
        self.geometry, self.dtype, self.layer_name = geometry, dtype, layer_name
        self.rows_per_block = geometry.rows_per_block
        # each row stored in the model dtype, or 8-bit with its scale (--kv-cache-dtype, memory.EIGHT_BIT_KINDS)
        self.rows = CacheRows((geometry.width,), dtype, cache_dtype if geometry.eight_bit else "auto")
        self.kv_cache = torch.tensor([])
        register_layer(layer_name, self)

    def get_attn_backend(self) -> type[DeepseekV4CacheBackend]:
        return DeepseekV4CacheBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig):
        return self.geometry.kv_cache_spec(self.dtype)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        view = compat.latent_layer_cache(kv_cache)
        if tuple(view.shape[1:]) != (self.rows_per_block, self.rows.width):
            # an engine that resized this cache's blocks would have its rows addressed with the wrong span
            raise RuntimeError(
                f"{self.layer_name}: vLLM bound blocks of {tuple(view.shape[1:])} (rows, values), its spec declares "
                f"({self.rows_per_block}, {self.rows.width})"
            )
        self.kv_cache = view


def _slots(
    cache: DeepseekV4Cache, table: torch.Tensor, requests: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of cache rows ``rows`` (position or entry numbers) of the requests ``requests``
    (their rows of the block table ``table [num_reqs, max_blocks]``, broadcast against ``rows``); rows
    outside the table read its first or last block (the caller masks what they hold)."""
    per = cache.rows_per_block
    col = (rows // per).clamp_(0, table.shape[-1] - 1)
    return table[requests, col], rows % per


def _grid_requests(rows: torch.Tensor) -> torch.Tensor:
    """The request of each cell of a grid's ``rows [R, ...]``: its leading index, broadcast over the rest."""
    return torch.arange(rows.shape[0], device=rows.device).view(-1, *[1] * (rows.dim() - 1))


def _write(cache: DeepseekV4Cache, block: torch.Tensor, offset: torch.Tensor, values: torch.Tensor) -> None:
    cache.kv_cache[block, offset] = cache.rows.encode(values).to(cache.kv_cache.dtype)


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
        self.o_a_proj.weight.weight_loader = sharded_weight_loader(0)
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
        self.sinks.weight_loader = sharded_weight_loader(0)
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
        # the caches are children named as their layers (``<prefix>.window_cache``, ...), in the model's dtype
        # (every value cached is a model-dtype tensor of the reference's arithmetic) or, under
        # an 8-bit --kv-cache-dtype, the window, entries and indexer keys 8-bit
        cache_dtype = vllm_config.cache_config.cache_dtype
        eight_bit = cache_dtype in EIGHT_BIT_CACHE_DTYPES
        self.caches: dict[str, DeepseekV4Cache] = {}
        for kind, geometry in layer_caches(config, self.layer_type, eight_bit).items():
            cache = DeepseekV4Cache(geometry, torch.get_default_dtype(), cache_dtype, f"{prefix}.{kind}_cache")
            setattr(self, f"{kind}_cache", cache)
            self.caches[kind] = cache
        register_layer(prefix, self)

    # -- a step ------------------------------------------------------------------------------
    def attend(self, x, q, kv, qr, positions, out) -> None:
        """The body of ``vllm::dsv4_attention``: every token of the step over its request's caches,
        written into ``out``. Every row the step brings is written first; then every grid of queries
        (``backend.Segment``) closes its windows; then each attends."""
        md = get_forward_context().attn_metadata
        window = self.caches[WINDOW]
        if not isinstance(md, dict) or window.layer_name not in md or window.kv_cache.numel() == 0:
            out.zero_()  # profile / dummy run: no caches to attend over
            return
        step = md[window.layer_name]
        tables = {kind: md[cache.layer_name].block_table for kind, cache in self.caches.items()}
        n = step.num_tokens
        if n == 0:
            return
        x, q, kv, qr, positions = x[:n], q[:n], kv[:n], qr[:n], positions[:n]
        req = step.token_request
        _write(window, *_slots(window, tables[WINDOW], req, positions), kv)
        states = (
            {kind: comp.states(x, positions) for kind, comp in self._compressors()}
            if self.compressor is not None
            else {}
        )
        if self.layer_type == LAYER_CSA:
            for kind, rows in states.items():
                cache = self.caches[kind]
                _write(cache, *_slots(cache, tables[kind], req, positions), rows)
        # each request's first position this step (its padding requests: the step's last token's)
        starts = positions[step.query_start_loc.clamp(max=n - 1)]
        grids = []
        for seg in step.segments:
            reqs = slice(seg.first_request, seg.first_request + seg.requests)
            seg_tables = {kind: t[reqs] for kind, t in tables.items()}
            # the grid's token rows and positions; cells past a request's last query are padding
            rows = step.query_start_loc[reqs, None] + seg.offset + torch.arange(seg.queries, device=x.device)
            valid = rows < step.query_start_loc[seg.first_request + 1 : seg.first_request + seg.requests + 1, None]
            qpos = starts[reqs, None] + seg.offset + torch.arange(seg.queries, device=x.device)
            grids.append((seg, reqs, seg_tables, rows.clamp(max=n - 1), valid, qpos))
        if self.compressor is not None:
            # every entry the step closes before any query reads: a request whose prefix-cache hit covers blocks
            # another request of the same step computes reads their entries, whichever grid comes first
            for _, _, seg_tables, rows, valid, qpos in grids:
                if self.layer_type == LAYER_CSA:
                    self._close_windows(seg_tables, qpos, valid)
                else:  # in grid order: a prefill request's tile continues the summaries of its tile before
                    self._summarise_windows(states[STATE][rows], seg_tables, qpos, valid)
        for seg, reqs, seg_tables, rows, _, qpos in grids:
            a, b = seg.token_rows
            grid = self._attend_grid(x[rows], q[rows], qr[rows], qpos, starts[reqs] + seg.offset, seg_tables, step)
            # each token of the segment from its cell of the grid
            tok = torch.arange(a, b, device=x.device)
            r = req[a:b] - seg.first_request
            cell = r * seg.queries + (tok - step.query_start_loc[req[a:b]] - seg.offset)
            out[a:b] = grid.flatten(0, 1)[cell]

    def _compressors(self):
        yield STATE, self.compressor
        if self.layer_type == LAYER_CSA:
            yield INDEX_STATE, self.compressor.indexer

    def _closed_windows(self, qpos, valid) -> tuple[torch.Tensor, torch.Tensor]:
        """The window ``w`` each cell of a grid would close (clamped at 0) and whether it closes it (its
        position is ``rate * (w + 1) - 1``)."""
        m = self.rate
        return ((qpos + 1) // m - 1).clamp(min=0), valid & ((qpos + 1) % m == 0)

    def _write_cells(self, kind: str, tables, rows, write, values) -> None:
        """``values`` (one per cell of a grid) into rows ``rows`` of cache ``kind`` where ``write``; the other
        cells write into vLLM's null block."""
        cache = self.caches[kind]
        block, offset = _slots(cache, tables[kind], _grid_requests(rows), rows)
        block = torch.where(write, block, torch.zeros_like(block))
        offset = torch.where(write, offset, torch.zeros_like(offset))
        _write(cache, block.flatten(), offset.flatten(), values)

    def _close_windows(self, tables, qpos, valid) -> None:
        """CSA: the grid's tokens that close a window pool the cached states of window ``w`` and the one
        before into entry ``w`` (and the indexer's key ``w``)."""
        m = self.rate
        w_row, closing = self._closed_windows(qpos, valid)
        for (state_kind, comp), entry_kind in zip(self._compressors(), (ENTRIES, INDEX)):
            span = self.caches[state_kind].geometry.sliding_window  # 2 * rate: the rows an entry pools
            srows = (w_row + 1)[..., None] * m - span + torch.arange(span, device=qpos.device)
            states = self._rows_of(state_kind, tables, srows.clamp(min=0))
            has_prev = ((qpos + 1) // m >= 2).flatten()
            entries = comp.pool(states.flatten(0, 1), has_prev, w_row.flatten(), self.compress_rotary_emb)
            self._write_cells(entry_kind, tables, w_row, closing, entries)

    def _summarise_windows(self, states, tables, qpos, valid) -> None:
        """HCA: every cell of the grid (``states [R, L, 2 * head_dim]``) summarises its window so far,
        continuing the cached summary before its row's first position, into the summary cache; the tokens
        that close a window write its pooling, normalised and rotated, as entry ``w``."""
        comp = self.compressor
        first = qpos[:, :1]
        prev = self._rows_of(STATE, tables, (first - 1).clamp(min=0))[:, 0]
        summary = comp.summaries(states, qpos, valid, (first % self.rate != 0).flatten(), prev)
        self._write_cells(STATE, tables, qpos, valid, summary.flatten(0, 1))
        w_row, closing = self._closed_windows(qpos, valid)
        pooled = summary[..., : self.head_dim].to(states.dtype).flatten(0, 1)
        self._write_cells(
            ENTRIES, tables, w_row, closing, comp.finish(pooled, w_row.flatten(), self.compress_rotary_emb)
        )

    def _rows_of(self, kind: str, tables, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows [R, ...]`` of cache ``kind`` of a grid's requests (``tables``: the grid's block tables)."""
        cache = self.caches[kind]
        return cache.rows.decode(cache.kv_cache[_slots(cache, tables[kind], _grid_requests(rows), rows)])

    def _attend_grid(self, x, q, qr, qpos, first, tables, step) -> torch.Tensor:
        """Attention of a grid of queries ``[R, L]`` (positions ``qpos``; ``first [R]``: each row's
        first query position) over its requests' windows and compressed entries -> ``[R, L, H, D]``."""
        dev = q.device
        L = qpos.shape[1]
        # the window keys of a row: positions first - span .. first + L - 1, span the W - 1 positions before
        # its first query, or fewer where no sequence of the step is that long (first <= max_seq_len - 1)
        span = min(self.window - 1, step.max_seq_len - 1)
        kpos = (first - span)[:, None] + torch.arange(span + L, device=dev)
        keys = self._rows_of(WINDOW, tables, kpos.clamp(min=0)).to(q.dtype)
        gap = qpos[:, :, None] - kpos[:, None, :]
        allowed = (kpos[:, None, :] >= 0) & (gap >= 0) & (gap < self.window)
        if self.compressor is None:
            return _sink_attention(q, keys, allowed, self.sinks, self.scale)
        # every entry a row's requests may hold: as many as the step's longest sequence has
        entries = self.caches[ENTRIES]
        per = entries.rows_per_block
        capacity = max(1, -(-(step.max_seq_len // self.rate) // per)) * per  # whole blocks of the table
        e = torch.arange(capacity, device=dev)
        visible = e < ((qpos + 1) // self.rate)[..., None]  # [R, L, E]
        if self.layer_type == LAYER_HCA:
            ent = self._rows_of(ENTRIES, tables, e.expand(q.shape[0], -1)).to(q.dtype)
            keys = torch.cat([keys, ent], dim=1)
            return _sink_attention(q, keys, torch.cat([allowed, visible], -1), self.sinks, self.scale)
        # CSA: the indexer scores every entry; each query attends over the top-k it selects
        ind = self.compressor.indexer
        r = q.shape[0]
        qi = ind.q_b_proj(qr.flatten(0, 1)).view(r * L, ind.n_heads, ind.head_dim)
        qi = apply_rope(self.compress_rotary_emb, qpos.flatten(), qi).view(r, L, ind.n_heads, ind.head_dim)
        w = ind.weights_proj(x.flatten(0, 1)).view(r, L, ind.n_heads)
        index_keys = self._rows_of(INDEX, tables, e.expand(r, -1)).to(q.dtype)
        scores = _indexer_scores(qi, index_keys, w, ind.softmax_scale, ind.weights_scale)
        top = scores.masked_fill(~visible, float("-inf")).topk(min(ind.topk, capacity), dim=-1).indices
        chosen = self._rows_of(ENTRIES, tables, top).to(q.dtype)  # [R, L, k, D]
        return _sink_attention(q, keys, allowed, self.sinks, self.scale, chosen, visible.gather(-1, top))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv_a = self.wqkv_a(x)
        q_a, kv = qkv_a.split([self.config.q_lora_rank, self.head_dim], dim=-1)
        qr = self.q_a_norm(q_a)
        q = self.q_b_proj(qr).view(t, self.n_heads, self.head_dim)
        q = _rms_norm(q, None, self.eps)
        q, kv = self.rotary_emb(positions, q, self.kv_norm(kv).unsqueeze(1))
        kv = kv.squeeze(1)

        out = torch.empty_like(q)
        torch.ops.vllm.dsv4_attention(x, q, kv, qr, positions, out, self.prefix)
        # K = V carried rope on its trailing slice: undo it at the query position.
        out = apply_rope(self.rotary_emb, positions, out, inverse=True)
        grouped = out.reshape(t, self.o_groups, -1)
        o = _grouped_linear(grouped, self.o_a_proj.weight, self.o_groups)
        return self.o_b_proj(o)
