"""Memory of DeepSeek-V4 on this adapter, derived from a config (no hand-entered numbers).

* ``layer_caches``: the paged caches an attention layer of each type declares to vLLM (one KV-cache
  spec each, ``CacheGeometry.kv_cache_spec``): sliding layers the window; CSA layers the window, the
  compressor's and the indexer's states of their last two windows, one entry and one indexer key per
  ``rate`` tokens; HCA layers the window, the compressor's running summary of its window at the last
  positions (float32) and one entry per ``rate`` tokens. Every block spans HIT_TOKENS positions (full caches)
  or a divisor of it (sliding caches): a prefix-cache hit every HIT_TOKENS tokens (``hit_tokens``).
* ``cache_groups``: how vLLM groups these caches, and the bytes of one block id (every group's pages).
* ``request_cache_bytes``: the blocks vLLM holds for one request of ``tokens`` tokens (a full cache's
  blocks up to its last token; a sliding cache's blocks of its last window), a block id's bytes each;
  the memory bench compares it with the blocks vLLM's scheduler really holds.
* ``weight_bytes_per_device``: parameters as served (dequantized to ``dtype_bytes``; mHC and router
  float32), with the routed experts split over ``ep`` devices and the attention / shared / embedding
  weights over ``tp`` (the shared K=V head, compressors, indexer, router and mHC weights replicated),
  plus vLLM's float32 rotary cos/sin tables (one per rope set, ``rope_table_bytes``).
* ``concurrency``: requests of a length whose caches fit a device after its weights (the caches are
  replicated on every tensor-parallel rank: one shared K=V head).
"""

from __future__ import annotations

import dataclasses
import math

from ascend_adapters.common.policy import eight_bit_row_bytes
from ascend_adapters.deepseek_v4.config import (
    LAYER_CSA,
    LAYER_HCA,
    LAYER_SLIDING,
    compressed_enabled,
    vllm_rope_parameters,
)

# The paged caches of one attention layer (attention.py declares one vLLM KV-cache spec for each):
WINDOW = "window"  # shared K=V of every position, of which a query reads the last sliding_window
# the compressor's state of every position. CSA: its KV projection and its gate (position bias added), from
# which the token that closes a window pools the window's entry; the indexer's own compressor likewise. HCA:
# the running summary of its window up to the position (compressor.py), read at the position before a step
STATE = "state"
INDEX_STATE = "index_state"
ENTRIES = "entries"  # compressed KV entries, one per rate positions
INDEX = "index"  # the indexer's compressed keys (CSA), one per rate positions
# A prefix-cache hit starts at a multiple of every cache group's block span (vLLM's ``kv lcm block sizes``):
# the full caches (entries, indexer keys) span HIT_TOKENS tokens a block, or a multiple of a compression rate
# that does not divide it; every sliding cache's block divides that span.
HIT_TOKENS = 128
# Every sliding cache has one page size, SLIDING_PAGE_ROWS rows of the lcm of their widths: two sliding caches
# with the same block and window then have the same width, so vLLM never groups rows of different shapes.
SLIDING_PAGE_ROWS = 8
# the caches stored 8-bit under an 8-bit --kv-cache-dtype (a CSA compressor's states stay in the model dtype, an HCA
# summary float32: they are pooled, not attended, and a softmax gate moves by its absolute error, which an 8-bit
# code of a large gate makes large), each row one part with a float32 scale (``common.kernels.kv8``)
EIGHT_BIT_KINDS = (WINDOW, ENTRIES, INDEX)
# ``ascend-adapters plan`` takes an 8-bit --kv-cache-dtype (fp8, int8_per_token_head) for this adapter
EIGHT_BIT_CACHE = True
# Positions a block of an HCA summary cache: a request holds the blocks of its last two positions, one or two
# whatever the size, but vLLM reserves a block per SUMMARY_BLOCK positions of a scheduler step, and a block id
# spans every group's pages: the largest block that keeps every HCA layer's pages in one group, within the full
# group's page. On Flash (20 HCA layers, 4 KiB a row): 8 in bf16 (640 of 860 KiB), 4 under an 8-bit cache
# (320 of 435 KiB). By cache: model dtype, 8-bit.
SUMMARY_BLOCK = {False: 8, True: 4}


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    width: int  # values per row
    tokens_per_row: int  # 1: a row per position; rate: a compressed entry per rate positions
    block_size: int  # positions per block
    sliding_window: int | None  # a step reads the sliding_window - 1 positions before its first; None: all
    # stored 8-bit (an 8-bit --kv-cache-dtype: the window, the entries, the indexer keys; common.kernels.kv8): a
    # byte a value and one float32 scale a row, whatever the model dtype
    eight_bit: bool = False
    float32: bool = False  # stored float32 whatever the model dtype (an HCA compressor's summaries)

    @property
    def rows_per_block(self) -> int:
        return self.block_size // self.tokens_per_row

    @property
    def stored_width(self) -> int:
        """A row's width in its storage dtype: values, or bytes when 8-bit (``kv8.row_bytes``)."""
        return eight_bit_row_bytes((self.width,)) if self.eight_bit else self.width

    def page_bytes(self, dtype_bytes: int) -> int:
        return self.rows_per_block * self.stored_width * (1 if self.eight_bit else 4 if self.float32 else dtype_bytes)

    def kv_cache_spec(self, dtype):
        """vLLM's KV-cache spec of this cache: a full cache an MLA spec of a row per ``tokens_per_row``
        positions, a sliding cache a sliding-window MLA spec of a row per position (bytes when 8-bit)."""
        import torch

        from ascend_adapters.common import compat

        dtype = torch.uint8 if self.eight_bit else torch.float32 if self.float32 else dtype
        if self.sliding_window is None:
            return compat.compressed_attention_spec(
                block_size=self.block_size, head_size=self.stored_width, dtype=dtype, tokens_per_row=self.tokens_per_row
            )
        return compat.sliding_window_row_spec(
            block_size=self.block_size, head_size=self.stored_width, dtype=dtype, sliding_window=self.sliding_window
        )

    def blocks(self, tokens: int) -> int:
        """Blocks vLLM holds for a request whose cache reaches ``tokens`` positions (the next token's
        slot included): a full cache every block up to there; a sliding cache the blocks of its last
        ``sliding_window`` positions (vLLM frees the blocks wholly behind them)."""
        if tokens <= 0:
            return 0
        first = 0 if self.sliding_window is None else max(0, tokens - self.sliding_window)
        return (tokens - 1) // self.block_size - first // self.block_size + 1


def state_width(head_dim: int, overlap: bool) -> int:
    """A compressor's state row. CSA (``overlap``): its KV projection and its gate, ``2 x head_dim`` each (a
    token feeds two entries). HCA: its window's summary, the pooling and the log of the softmax's denominator,
    ``head_dim`` each."""
    return 2 * (2 if overlap else 1) * head_dim


def full_block_tokens(config) -> int:
    """Positions per block of the full caches: HIT_TOKENS, or the least multiple of every compression rate."""
    kinds = set(config.layer_types) - {LAYER_SLIDING}
    return math.lcm(HIT_TOKENS, *(int(config.compress_rates[k]) for k in kinds))


def sliding_page_values(config) -> int:
    """Values in a page of every sliding cache in the model dtype: SLIDING_PAGE_ROWS rows of the lcm of their
    widths (window, and the CSA compressors' states if the checkpoint has CSA layers, whether served or not)."""
    hd, kinds = int(config.head_dim), set(config.layer_types)
    widths = [hd]
    if LAYER_CSA in kinds:
        widths += [state_width(hd, True), state_width(int(config.index_head_dim), True)]
    return SLIDING_PAGE_ROWS * math.lcm(*widths)


def _sliding(config, width: int, window: int) -> CacheGeometry:
    block = sliding_page_values(config) // width
    if full_block_tokens(config) % block:
        raise ValueError(
            f"DeepSeek-V4: a sliding cache of {width}-value rows would span {block} positions a block, which does "
            f"not divide the full caches' {full_block_tokens(config)} (config head_dim={config.head_dim}, "
            f"index_head_dim={config.index_head_dim}): prefix-cache hits would align to neither"
        )
    return CacheGeometry(width, 1, block, window)


def layer_caches(config, layer_type: str, eight_bit: bool = False) -> dict[str, CacheGeometry]:
    """The caches an attention layer of ``layer_type`` holds: sliding layers the window only; CSA layers
    window + the compressor's and the indexer's states (the two windows an overlapping entry pools) +
    entries + indexer keys; HCA layers window + the compressor's summaries (the last two positions) + entries.
    ``eight_bit``: the EIGHT_BIT_KINDS stored 8-bit (the same positions a block)."""
    caches = _layer_caches(config, layer_type, eight_bit)
    if eight_bit:
        caches = {k: dataclasses.replace(g, eight_bit=k in EIGHT_BIT_KINDS) for k, g in caches.items()}
    return caches


def _layer_caches(config, layer_type: str, eight_bit: bool) -> dict[str, CacheGeometry]:
    hd = int(config.head_dim)
    caches = {WINDOW: _sliding(config, hd, int(config.sliding_window))}
    if layer_type == LAYER_SLIDING:
        return caches
    rate = int(config.compress_rates[layer_type])
    csa = layer_type == LAYER_CSA
    full = full_block_tokens(config)
    if csa:
        caches[STATE] = _sliding(config, state_width(hd, True), 2 * rate)
    else:
        caches[STATE] = CacheGeometry(state_width(hd, False), 1, SUMMARY_BLOCK[eight_bit], 2, float32=True)
    caches[ENTRIES] = CacheGeometry(hd, rate, full, None)
    if csa:
        idim = int(config.index_head_dim)
        caches[INDEX_STATE] = _sliding(config, state_width(idim, True), 2 * rate)
        caches[INDEX] = CacheGeometry(idim, rate, full, None)
    return caches


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    geometry: CacheGeometry  # of a sliding group; of the full group, its block span (rows vary by cache)
    page_bytes: int  # the group's pages of one block id, summed over its caches
    layers: tuple[int, ...]  # the decoder layers whose caches it holds (a full group: one per cache)


def cache_groups(
    config, layer_types: list[str], dtype_bytes: int, stage: tuple[int, int] | None = None, eight_bit: bool = False
) -> tuple[list[CacheGroup], int]:
    """How vLLM groups the caches of ``layer_types`` (0.27.1, 0.28.0 and 0.32.0 alike, the backend declaring
    a block-outermost layout), and the bytes of one block id: every full cache in one group; the sliding
    caches by geometry, a geometry dealt out layer by layer into as many groups as it takes to keep each
    group's pages within the full group's. One block id spans every group's pages, whichever group holds
    it. ``stage``: a pipeline stage's layers ``[start, end)``: vLLM groups the whole model, then keeps each
    group's caches of the stage (a group without any is left out here: it holds no block there). Returns the
    groups and a block id's bytes (the largest group's pages). ``eight_bit``: under --kv-cache-dtype fp8.

    0.27/0.28 split by layer counts, not bytes (``compat.packed_groups_split_by_bytes``); on every shape
    tested (``test_cache_groups_are_vllms``) their split equals the byte rule on the model-dtype pages, which
    is what is applied there to the 8-bit caches too."""
    from ascend_adapters.common import compat

    by_bytes = compat.packed_groups_split_by_bytes()
    full, sliding = [], {}
    for i, t in enumerate(layer_types):
        for g in layer_caches(config, t, eight_bit).values():
            if g.sliding_window is None:
                full.append((i, g))
            else:
                sliding.setdefault(g, []).append(i)

    def split_bytes(g: CacheGeometry) -> int:  # the page that decides a split
        return (
            g.page_bytes(dtype_bytes) if by_bytes else dataclasses.replace(g, eight_bit=False).page_bytes(dtype_bytes)
        )

    full_bytes = sum(split_bytes(g) for _, g in full)
    split_at = full_bytes or max(split_bytes(g) * len(ls) for g, ls in sliding.items())
    members = [(full[0][1], [(i, g.page_bytes(dtype_bytes)) for i, g in full])] if full else []
    for g, ls in sliding.items():
        split = -(-split_bytes(g) * len(ls) // split_at)
        members += [(g, [(i, g.page_bytes(dtype_bytes)) for i in ls[k::split]]) for k in range(split)]
    groups = []
    for g, caches in members:
        if stage is not None:
            caches = [(i, p) for i, p in caches if stage[0] <= i < stage[1]]
        if caches:
            groups.append(CacheGroup(g, sum(p for _, p in caches), tuple(i for i, _ in caches)))
    return groups, max(g.page_bytes for g in groups)


def hit_tokens(config) -> int:
    """The granularity of a prefix-cache hit: the lcm of every cache's block span."""
    return math.lcm(*(g.block_size for t in set(served_layer_types(config)) for g in layer_caches(config, t).values()))


def served_layer_types(config) -> list[str]:
    """Each layer's attention type as served (all sliding with the compressed branches switched off)."""
    return list(config.layer_types) if compressed_enabled() else [LAYER_SLIDING] * len(config.layer_types)


def request_cache_bytes(config, tokens: int, dtype_bytes: int = 2, eight_bit: bool = False) -> int:
    """Bytes of the blocks vLLM holds for one request of ``tokens`` positions, every layer: each group's
    blocks, a slab each (``cache_groups``)."""
    groups, slab = cache_groups(config, served_layer_types(config), dtype_bytes, eight_bit=eight_bit)
    return slab * sum(g.geometry.blocks(tokens) for g in groups)


def parameter_counts(config) -> dict:
    """Parameters by placement: ``experts`` (routed, split by EP), ``tp`` (split by TP), ``replicated``,
    and ``float32`` (mHC and router, replicated, kept float32 whatever the model dtype)."""
    h, hd, nh = int(config.hidden_size), int(config.head_dim), int(config.num_attention_heads)
    ql, og, ol = int(config.q_lora_rank), int(config.o_groups), int(config.o_lora_rank)
    e, inter = int(config.n_routed_experts), int(config.moe_intermediate_size)
    ih, idim, n = int(config.index_n_heads), int(config.index_head_dim), int(config.hc_mult)
    shared = inter * max(1, int(config.n_shared_experts))
    experts = tp = rep = f32 = 0
    for kind in config.layer_types:
        tp += ql * nh * hd + nh * hd * ol + og * ol * h + 3 * h * shared  # wq_b, wo_a, wo_b, shared expert
        rep += h * ql + h * hd  # wq_a, wkv
        f32 += e * h + 2 * (2 + n) * n * n * h  # router, attn_hc, ffn_hc
        experts += e * 3 * h * inter
        if kind == LAYER_CSA:
            rep += 2 * (2 * hd) * h + ql * ih * idim + h * ih + 2 * (2 * idim) * h  # compressor + indexer
        elif kind == LAYER_HCA:
            rep += 2 * hd * h
    tp += 2 * int(config.vocab_size) * h  # embedding + head (vocab-parallel)
    f32 += n * n * h  # hc_head
    return {"experts": experts, "tp": tp, "replicated": rep, "float32": f32}


def rope_table_bytes(config) -> int:
    """vLLM's rotary tables: per rope set, float32 cos and sin for original_max_position_embeddings x
    factor positions (``deepseek_v4_rope``)."""
    total = 0
    for label in ("main", "compress"):
        p = vllm_rope_parameters(config, label)
        total += math.ceil(p["original_max_position_embeddings"] * p["factor"]) * p["rope_dim"] * 4
    return total


def weight_bytes_per_device(config, tp: int, ep: int, dtype_bytes: int = 2) -> int:
    c = parameter_counts(config)
    per_device = (c["experts"] // ep + c["tp"] // tp + c["replicated"]) * dtype_bytes + c["float32"] * 4
    return per_device + rope_table_bytes(config)


def concurrency(
    config, tokens: int, device_bytes: int, tp: int, ep: int, dtype_bytes: int = 2, eight_bit: bool = False
) -> int:
    """Requests of ``tokens`` tokens whose caches fit one device after its weights."""
    free = device_bytes - weight_bytes_per_device(config, tp, ep, dtype_bytes)
    return max(0, free // request_cache_bytes(config, tokens, dtype_bytes, eight_bit))


def flash_config():
    """DeepSeek-V4-Flash's published shape (docs/references.md#deepseek-v4-shape) as transformers' config.

    The vocabulary is not in that summary; 129280 (DeepSeek-V3's) is assumed, ~1 GB of 284 B.
    """
    from transformers import DeepseekV4Config

    n = 43
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(n - 2)]
    kind = {0: LAYER_SLIDING, 4: LAYER_CSA, 128: LAYER_HCA}
    return DeepseekV4Config(
        vocab_size=129280,
        hidden_size=4096,
        num_hidden_layers=n,
        num_attention_heads=64,
        num_key_value_heads=1,
        head_dim=512,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=6,
        moe_intermediate_size=2048,
        sliding_window=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        hc_mult=4,
        layer_types=[kind[r] for r in ratios],
        compress_rates={LAYER_CSA: 4, LAYER_HCA: 128},
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * (n - 3),
        max_position_embeddings=1048576,
    )


def flash_table(device_gib: int = 64, tp: int = 16, ep: int = 16) -> list[dict]:
    cfg = flash_config()
    rows = []
    for length in (4096, 131072, 1048576):
        rows.append(
            {
                "tokens": length,
                "request_cache_bytes": request_cache_bytes(cfg, length, 2),
                "concurrency": concurrency(cfg, length, device_gib << 30, tp, ep),
                "request_cache_bytes_8bit": request_cache_bytes(cfg, length, 2, eight_bit=True),
                "concurrency_8bit": concurrency(cfg, length, device_gib << 30, tp, ep, eight_bit=True),
            }
        )
    return rows


def _size(n: int) -> str:
    if n >= 1 << 30:
        g = n / (1 << 30)
        return f"{g:.2f} GiB" if g < 10 else f"{g:.1f} GiB"
    m = n / (1 << 20)
    return f"{m:.0f} MiB" if m >= 100 else f"{m:.1f} MiB"


def _length(tokens: int) -> str:
    return f"{tokens >> 20}M" if tokens >= 1 << 20 else f"{tokens >> 10}k"


def status_notes(device_gib: int = 64, tp: int = 16, ep: int = 16, short: int = 100) -> list[str]:
    """The lines ``ascend-adapters status`` prints for DeepSeek-V4 (``STATUS_NOTES`` in the hook)."""
    cfg = flash_config()
    weights = weight_bytes_per_device(cfg, tp, ep)
    lines = [
        f"attention state (DeepSeek-V4-Flash shape, memory.py): paged by vLLM, bf16, each layer only what its "
        f"type needs for the request's own tokens (sliding: window; CSA: window, compressor and indexer states, an "
        f"entry and an indexer key per 4 tokens; HCA: window, the compressor's summary of its window at the last "
        f"positions (float32), an entry per 128 tokens); requests fitting a {device_gib} GiB device after "
        f"{_size(weights)} of weights at TP{tp}/EP{ep}:"
    ]
    for r in flash_table(device_gib, tp, ep):
        lines.append(
            f"  {_length(r['tokens'])} tokens: {_size(r['request_cache_bytes'])} per request, "
            f"{r['concurrency']} request(s) per device; --kv-cache-dtype fp8 or int8_per_token_head: "
            f"{_size(r['request_cache_bytes_8bit'])}, {r['concurrency_8bit']}"
        )
    lines.append(f"  a {short}-token request holds {_size(request_cache_bytes(cfg, short))}, whatever max_model_len")
    lines.append(
        f"  prefix caching: a hit covers the shared prefix in whole multiples of {hit_tokens(cfg)} tokens (every "
        f"cache's block span divides it)"
    )
    return lines


# --- ascend-adapters plan (common/plan.py): per pipeline stage, vLLM's admission count --------------------


def reserved_blocks(geometry: CacheGeometry, max_model_len: int, max_num_batched_tokens: int) -> int:
    """Blocks vLLM 0.32 reserves for one request of ``max_model_len`` tokens in a cache of ``geometry``
    (``KVCacheSpec.max_memory_usage_bytes``, its start-up check and its "Maximum concurrency" line): a full
    cache every block up to max_model_len; a sliding one its window and one scheduler step, plus a block
    (``SlidingWindowSpec.max_admission_blocks_per_request``)."""
    if geometry.sliding_window is None:
        return -(-max_model_len // geometry.block_size)
    tokens = min(geometry.sliding_window - 1 + max_num_batched_tokens, max_model_len)
    return -(-tokens // geometry.block_size) + 1


def stage_parameter_bytes(config, start: int, end: int, first: bool, last: bool, tp: int, dtype_bytes: int) -> int:
    """Bytes of layers ``[start, end)`` on one rank as ``weight_bytes_per_device`` counts them (routed experts
    split over ``tp`` ranks, by TP or EP alike), the embedding on the first stage and the head and hc_head
    on the last (vocabulary padded to a multiple of 64 and split), one rotary table set per stage, and the
    norms, attention sinks and compressor position biases that function leaves out."""
    import types

    from ascend_adapters.common.plan import pad_vocab

    h, n = int(config.hidden_size), int(config.hc_mult)
    kinds = list(config.layer_types)[start:end]
    sub = types.SimpleNamespace(**{**config.to_dict(), "layer_types": kinds, "vocab_size": 0})
    c = parameter_counts(sub)
    f32 = c["float32"] - n * n * h  # hc_head counted below, on the last stage
    # per layer, beside parameter_counts: the attn/ffn norms, q_norm, kv_norm, this rank's attention sinks,
    # the compressors' norms and position biases, the router's correction bias (model dtype); the mHC
    # base and scale (float32); a hash layer's token -> experts table (int64)
    small = 0
    hd, ql, e = int(config.head_dim), int(config.q_lora_rank), int(config.n_routed_experts)
    mlp_types = list(getattr(config, "mlp_layer_types", None) or [])[start:end]
    extra = 0
    for i, kind in enumerate(kinds):
        small += 2 * h + ql + hd + int(config.num_attention_heads) // tp
        f32 += 2 * ((2 + n) * n + 3)
        if i < len(mlp_types) and mlp_types[i] == "hash_moe":
            extra += int(config.vocab_size) * int(config.num_experts_per_tok) * 8
        else:
            small += e
        if kind != LAYER_SLIDING:
            rate = int(config.compress_rates[kind])
            csa = kind == LAYER_CSA
            small += rate * (2 if csa else 1) * hd + hd  # position bias, norm
            if csa:
                idim = int(config.index_head_dim)
                small += rate * 2 * idim + idim
    nbytes = (c["experts"] // tp + c["tp"] // tp + c["replicated"] + small) * dtype_bytes + f32 * 4 + extra
    vocab = pad_vocab(int(config.vocab_size)) // tp * h * dtype_bytes
    if first:
        nbytes += vocab
    if last:
        nbytes += vocab + h * dtype_bytes + (n * n * h + n + 1) * 4  # head, norm, hc_head fn/base/scale
    return nbytes + rope_table_bytes(config)


def memory_plan(raw: dict, req):
    """``ascend-adapters plan``: weights and the caches one request of ``req.max_model_len`` reserves, per
    stage (``common.plan.Request`` in, ``common.plan.ModelMemory`` out)."""
    from ascend_adapters.common.plan import (
        EIGHT_BIT_CACHE_DTYPES,
        ModelMemory,
        PlanError,
        StageMemory,
        check_layout,
        pp_partitions,
    )
    from ascend_adapters.deepseek_v4.config import load_transformers_config

    try:
        config = load_transformers_config("config.json", config_dict=raw)
    except ValueError as exc:
        raise PlanError(str(exc).replace("config.json/config.json", "config.json")) from None
    layers = int(config.num_hidden_layers)
    check_layout(
        req, layers, {"attention heads": int(config.num_attention_heads), "output groups": int(config.o_groups)}
    )
    if req.max_model_len > int(config.max_position_embeddings):
        raise PlanError(
            f"--max-model-len {req.max_model_len} exceeds max_position_embeddings {config.max_position_embeddings}"
        )
    served = served_layer_types(config)
    eight_bit = req.kv_cache_dtype in EIGHT_BIT_CACHE_DTYPES
    parts = pp_partitions(layers, req.pp)
    stages = []
    for s, (start, end) in enumerate(parts):
        weights = stage_parameter_bytes(config, start, end, s == 0, s == len(parts) - 1, req.tp, req.dtype_bytes)
        groups, slab = cache_groups(config, served, req.dtype_bytes, stage=(start, end), eight_bit=eight_bit)
        blocks = sum(reserved_blocks(g.geometry, req.max_model_len, req.max_num_batched_tokens) for g in groups)
        stages.append(StageMemory((start, end), weights, blocks * slab, slab))
    held = request_cache_bytes(config, req.max_model_len, req.dtype_bytes, eight_bit)
    notes = [
        f"KV cache: every cache a layer declares (sliding window; CSA/HCA compressor states, entries, indexer keys"
        f"{'; window, entries and indexer keys 8-bit' if eight_bit else ''}), "
        f"grouped by vLLM into blocks of {stages[0].page_bytes} bytes (every group's pages, whichever group holds "
        f"the block), replicated on every TP rank (one shared K=V head); the count is vLLM's reservation (sliding "
        f"caches: window + {req.max_num_batched_tokens} scheduled tokens); a request of {req.max_model_len} tokens "
        f"holds {held / (1 << 20):.1f} MiB of it over all layers; prefix-cache hits every {hit_tokens(config)} tokens",
        "the grouping is vLLM's and may differ across engine versions: the count is an upper bound",
        "MTP speculative decoding adds the checkpoint's MTP layer (weights and its cache); not counted here",
    ]
    return ModelMemory("DeepseekV4ForCausalLM", "KV cache", stages, notes, exact_concurrency=False)
