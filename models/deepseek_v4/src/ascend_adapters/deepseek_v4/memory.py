"""Memory of DeepSeek-V4 on this adapter, derived from a config (no hand-entered numbers).

* ``state_shapes``: the attention state of one layer (window, input ring, compressed entries,
  indexer keys), the same page for every layer; the model sizes vLLM's state cache with it.
* ``state_bytes_per_sequence``: the attention state vLLM reserves per sequence today: every layer
  carries that page (float32), sized for ``max_model_len`` whatever the request's length.
* ``paged_state_bytes``: what a paged design would hold for a sequence of ``tokens`` tokens: per
  layer only what its type needs (sliding: the window; CSA: window + ring of 2*rate inputs +
  tokens/rate entries + indexer keys; HCA: window + ring of rate inputs + tokens/rate entries), in
  ``dtype_bytes`` per value.
* ``weight_bytes_per_device``: parameters as served (dequantized to ``dtype_bytes``; mHC and router
  float32), with the routed experts split over ``ep`` devices and the attention / shared / embedding
  weights over ``tp`` (the shared K=V head, compressors, indexer, router and mHC weights replicated),
  plus vLLM's float32 rotary cos/sin tables (one per rope set, ``rope_table_bytes``).
* ``concurrency``: sequences whose state fits a device after its weights.
"""

from __future__ import annotations

import dataclasses
import math

from ascend_adapters.deepseek_v4.config import (
    LAYER_CSA,
    LAYER_HCA,
    LAYER_SLIDING,
    compressed_enabled,
    vllm_rope_parameters,
)

# The paged caches of one attention layer (attention.py declares one vLLM KV-cache spec for each):
WINDOW = "window"  # shared K=V of every position, of which a query reads the last sliding_window
PENDING = "pending"  # the layer input of every position, from which the compressor pools a closing window
ENTRIES = "entries"  # compressed KV entries, one per rate positions
INDEX = "index"  # the indexer's compressed keys (CSA), one per rate positions
# Every cache has the same page size (vLLM then groups them without resizing any block): a page holds
# PAGE_ROWS rows of the widest token row, the layer input of the pending cache.
PAGE_ROWS = 16


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    width: int  # values per row
    tokens_per_row: int  # 1: a row per position; rate: a compressed entry per rate positions
    block_size: int  # positions per block
    sliding_window: int | None  # a step reads the sliding_window - 1 positions before its first; None: all

    def blocks(self, tokens: int) -> int:
        """Blocks vLLM holds for a request of ``tokens`` positions after its last step."""
        full = -(-tokens // self.block_size)
        if self.sliding_window is None:
            return full
        return min(full, -(-(self.sliding_window - 1) // self.block_size) + 1)


def page_values(config) -> int:
    """Values in one page of every cache (see PAGE_ROWS)."""
    widths = [int(config.hidden_size), int(config.head_dim), int(config.index_head_dim)]
    return PAGE_ROWS * math.lcm(*widths)


def layer_caches(config, layer_type: str) -> dict[str, CacheGeometry]:
    """The caches an attention layer of ``layer_type`` holds: sliding layers the window only; CSA layers
    window + pending inputs (the two windows an overlapping entry pools) + entries + indexer keys; HCA
    layers window + pending inputs (one window) + entries."""
    page = page_values(config)
    hd, h = int(config.head_dim), int(config.hidden_size)
    caches = {WINDOW: CacheGeometry(hd, 1, page // hd, int(config.sliding_window))}
    if layer_type == LAYER_SLIDING:
        return caches
    rate = int(config.compress_rates[layer_type])
    caches[PENDING] = CacheGeometry(h, 1, page // h, (2 if layer_type == LAYER_CSA else 1) * rate)
    caches[ENTRIES] = CacheGeometry(hd, rate, rate * (page // hd), None)
    if layer_type == LAYER_CSA:
        idim = int(config.index_head_dim)
        caches[INDEX] = CacheGeometry(idim, rate, rate * (page // idim), None)
    return caches


def served_layer_types(config) -> list[str]:
    """Each layer's attention type as served (all sliding with the compressed branches switched off)."""
    return list(config.layer_types) if compressed_enabled() else [LAYER_SLIDING] * len(config.layer_types)


def request_cache_bytes(config, tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes of the pages vLLM holds for one request of ``tokens`` positions, every layer."""
    page = page_values(config) * dtype_bytes
    return sum(g.blocks(tokens) * page for t in served_layer_types(config) for g in layer_caches(config, t).values())


def rollback_slack(num_speculative_tokens: int) -> int:
    """Extra ring rows so rejected draft tokens never overwrite a row still read.

    A verify step writes positions up to ``p + k`` and the MTP drafter's steps up to ``p + 2k - 1``,
    while the next step may restart at ``p + 1``: the rings must keep the ``W - 1`` (window) or ``R``
    (compressor input) positions before the restart, so they need ``2k`` more rows than without
    speculation. Compressed entries and indexer keys need none: a window's entry is rewritten when
    the window closes again, before any query may see it."""
    return 2 * int(num_speculative_tokens or 0)


def state_dims(config, max_model_len: int, num_speculative_tokens: int = 0) -> dict:
    """Per-layer state sizes shared by every attention layer (uniform page)."""
    types = set(config.layer_types) if compressed_enabled() else {LAYER_SLIDING}
    rates = config.compress_rates
    csa = rates.get(LAYER_CSA, 4) if LAYER_CSA in types else None
    hca = rates.get(LAYER_HCA, 128) if LAYER_HCA in types else None
    ring = max([1] + ([2 * csa] if csa else []) + ([hca] if hca else []))
    min_rate = min([r for r in (csa, hca) if r] or [0]) or None
    entries = (max_model_len // min_rate + 1) if min_rate else 1
    slack = rollback_slack(num_speculative_tokens)
    return {
        "window": int(config.sliding_window) + slack,
        "ring": int(ring) + slack,
        "entries": int(entries),
        "index_dim": int(config.index_head_dim) if csa else 1,
    }


def state_shapes(config, max_model_len: int, num_speculative_tokens: int = 0) -> tuple[tuple[int, ...], ...]:
    d = state_dims(config, max_model_len, num_speculative_tokens)
    return (
        (d["window"], config.head_dim),
        (d["ring"], config.hidden_size),
        (d["entries"], config.head_dim),
        (d["entries"], d["index_dim"]),
    )


def state_bytes_per_sequence(config, max_model_len: int) -> int:
    per_layer = sum(math.prod(s) for s in state_shapes(config, max_model_len)) * 4  # float32 state
    return per_layer * int(config.num_hidden_layers)


def paged_state_bytes(config, tokens: int, dtype_bytes: int = 2) -> int:
    w, hd, h = int(config.sliding_window), int(config.head_dim), int(config.hidden_size)
    total = 0
    for kind in config.layer_types:
        values = min(tokens, w) * hd
        if kind != LAYER_SLIDING:
            rate = int(config.compress_rates[kind])
            entries = tokens // rate
            values += (2 * rate if kind == LAYER_CSA else rate) * h + entries * hd
            if kind == LAYER_CSA:
                values += entries * int(config.index_head_dim)
        total += values
    return total * dtype_bytes


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


def concurrency(config, max_model_len: int, device_bytes: int, tp: int, ep: int, dtype_bytes: int = 2) -> int:
    """Sequences of ``max_model_len`` whose (replicated) attention state fits one device after its weights."""
    free = device_bytes - weight_bytes_per_device(config, tp, ep, dtype_bytes)
    return max(0, free // state_bytes_per_sequence(config, max_model_len))


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
    for length in (4096, 32768, 131072, 1048576):
        rows.append(
            {
                "max_model_len": length,
                "state_bytes_per_sequence": state_bytes_per_sequence(cfg, length),
                "paged_bf16_bytes_at_full_length": paged_state_bytes(cfg, length, 2),
                "concurrency": concurrency(cfg, length, device_gib << 30, tp, ep),
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
        f"attention state (DeepSeek-V4-Flash shape, memory.py): float32, every layer, sized for max_model_len "
        f"whatever the request's length; a paged design would hold only what each layer type needs for the "
        f"request's own length (bf16); sequences fitting a {device_gib} GiB device after {_size(weights)} of "
        f"weights at TP{tp}/EP{ep}:"
    ]
    for r in flash_table(device_gib, tp, ep):
        lines.append(
            f"  max_model_len {_length(r['max_model_len'])}: {_size(r['state_bytes_per_sequence'])} per sequence "
            f"(paged at full length: {_size(r['paged_bf16_bytes_at_full_length'])}), "
            f"{r['concurrency']} sequence(s) per device"
        )
    longest = max(r["max_model_len"] for r in flash_table(device_gib, tp, ep))
    lines.append(
        f"  a {short}-token request at max_model_len {_length(longest)} reserves "
        f"{_size(state_bytes_per_sequence(cfg, longest))}; paged it would need {_size(paged_state_bytes(cfg, short))}"
    )
    return lines
