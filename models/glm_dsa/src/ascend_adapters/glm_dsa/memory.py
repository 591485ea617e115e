"""Memory of GLM-5.x DSA on this adapter, derived from a config (``ascend-adapters plan``).

* The KV cache: each attention layer declares one latent row per token to vLLM (``model.py``,
  ``GlmDsaAttention.get_kv_cache_spec``: an ``MLAAttentionSpec`` of one KV head, never sharded by TP, in
  the model dtype, or 8-bit under ``--kv-cache-dtype fp8`` / ``int8_per_token_head``: a byte a value and a
  float32 scale a part):
  ``kv_lora_rank + qk_rope_head_dim`` values, plus the indexer key (``index_head_dim``) on the sparse
  path, which ``config.choose_attention_mode`` takes when ``max_model_len`` exceeds ``index_topk``. A block holds ``block_size`` rows; vLLM reserves
  ``ceil(max_model_len / block_size)`` blocks per layer and request (``max_memory_usage_bytes`` of a
  full-attention spec).
* The weights per rank, as ``model.py`` builds them: ``q_b_proj``, ``kv_b_proj``, ``o_proj``, the dense
  MLPs and shared experts split by TP; the routed experts split by TP or EP (the same bytes per rank);
  ``q_a_proj``, ``kv_a_proj_with_mqa``, the indexer and the router replicated (router weight, its
  correction bias and ``indexer.weights_proj`` float32); the absorbed ``W_UK^T`` / ``W_UV`` copies of
  ``kv_b_proj`` this rank's heads; one rotary table per stage (cos/sin in the model dtype, ``get_rope``
  shares it between layers); embedding and head vocabulary-parallel (padded to a multiple of 64).
"""

from __future__ import annotations

from ascend_adapters.common.plan import (
    EIGHT_BIT_CACHE_DTYPES,
    ModelMemory,
    PlanError,
    Request,
    StageMemory,
    cdiv,
    check_layout,
    pad_vocab,
    pp_partitions,
)
from ascend_adapters.common.policy import INT8_CACHE_DTYPES, eight_bit_row_bytes


def config_from_dict(raw: dict):
    from transformers import GlmMoeDsaConfig

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "auto_map")}
    try:
        return GlmMoeDsaConfig(**fields)
    except Exception as exc:
        raise PlanError(f"not a valid GLM-5 DSA config ({type(exc).__name__}: {exc})") from None


def sparse_path(cfg, max_model_len: int) -> bool:
    from ascend_adapters.glm_dsa.config import AttentionMode, GlmDsaConfigError, choose_attention_mode

    try:
        return choose_attention_mode(cfg, max_model_len) is AttentionMode.SPARSE
    except GlmDsaConfigError as exc:
        raise PlanError(str(exc)) from None


# the 8-bit latent cache is served (``--kv-cache-dtype fp8`` / ``int8_per_token_head``): ``plan`` takes the flag
EIGHT_BIT_CACHE = True


def row_parts(cfg, sparse: bool) -> tuple[int, ...]:
    """The parts of one token's cache row: ``kv_c``, ``k_pe`` and, on the sparse path, the indexer key."""
    return (int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)) + ((int(cfg.index_head_dim),) if sparse else ())


def row_width(cfg, sparse: bool) -> int:
    """Values in one token's cache row (``GlmDsaAttention.row_dim``)."""
    return sum(row_parts(cfg, sparse))


def row_bytes(cfg, sparse: bool, req: Request) -> int:
    """Bytes of one token's cache row as ``req`` serves it: the row in the served dtype, or 8-bit (one byte a
    value and a float32 scale a part, ``kernels.kv8``: ``GlmDsaAttention.cache_rows``)."""
    parts = row_parts(cfg, sparse)
    if req.kv_cache_dtype in EIGHT_BIT_CACHE_DTYPES:
        return eight_bit_row_bytes(parts)
    return sum(parts) * req.dtype_bytes


def _indexer_full(cfg, layer: int) -> bool:
    types = getattr(cfg, "indexer_types", None)
    return types is None or layer >= len(types) or types[layer] == "full"


def _sparse_mlp(cfg, layer: int) -> bool:
    types = getattr(cfg, "mlp_layer_types", None)
    if types and layer < len(types):
        return types[layer] == "sparse"
    return layer >= int(cfg.first_k_dense_replace)


def layer_bytes(cfg, layer: int, tp: int, sparse: bool, dtype_bytes: int) -> int:
    """Bytes of decoder layer ``layer`` on one rank."""
    h, nh = int(cfg.hidden_size), int(cfg.num_attention_heads)
    ql, kl, rope = int(cfg.q_lora_rank), int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
    nope, v = int(cfg.qk_nope_head_dim), int(cfg.v_head_dim)
    bias = bool(getattr(cfg, "attention_bias", False))
    n = 2 * h  # input and post-attention RMSNorms
    n += h * ql + ql + h * (kl + rope) + kl  # q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm
    if bias:
        n += ql + kl + rope + h  # q_a / kv_a biases (replicated), o_proj's (added once, replicated)
    n += ql * nh * (nope + rope) // tp + kl * nh * (nope + v) // tp + nh * v * h // tp  # q_b, kv_b, o_proj
    n += nh // tp * kl * (nope + v)  # W_UK^T and W_UV absorbed from kv_b_proj
    f32 = 0
    if sparse and _indexer_full(cfg, layer):
        ih, idim = int(cfg.index_n_heads), int(cfg.index_head_dim)
        n += ql * ih * idim + h * idim + 2 * idim  # wq_b, wk, k_norm
        f32 += h * ih  # weights_proj, float32
    if _sparse_mlp(cfg, layer):
        e, inter = int(cfg.n_routed_experts), int(cfg.moe_intermediate_size)
        shared = inter * int(cfg.n_shared_experts or 0)
        n += e * 3 * h * inter // tp + 3 * h * shared // tp  # routed (TP or EP) and shared experts
        f32 += e * h + e  # router weight and its correction bias, float32
    else:
        n += 3 * h * int(cfg.intermediate_size) // tp
    return n * dtype_bytes + f32 * 4


def rope_table_bytes(cfg, dtype_bytes: int) -> int:
    """The cos/sin table of ``get_rope`` in the model dtype (one per stage: vLLM caches the module):
    positions x rope dim."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    positions = int(cfg.max_position_embeddings)
    if params.get("rope_type", params.get("type", "default")) == "yarn":
        positions = int(params["original_max_position_embeddings"] * params["factor"])
    return positions * int(cfg.qk_rope_head_dim) * dtype_bytes


def memory_plan(raw: dict, req: Request) -> ModelMemory:
    cfg = config_from_dict(raw)
    for name in ("index_topk", "kv_lora_rank", "qk_rope_head_dim", "q_lora_rank"):
        if getattr(cfg, name, None) is None:
            raise PlanError(f"config.json has no {name!r}")
    h, layers = int(cfg.hidden_size), int(cfg.num_hidden_layers)
    check_layout(req, layers, {"attention heads": int(cfg.num_attention_heads)})
    if req.max_model_len > int(cfg.max_position_embeddings):
        raise PlanError(
            f"--max-model-len {req.max_model_len} exceeds max_position_embeddings {cfg.max_position_embeddings}"
        )
    sparse = sparse_path(cfg, req.max_model_len)
    width = row_width(cfg, sparse)
    page = req.block_size * row_bytes(cfg, sparse, req)
    per_layer = cdiv(req.max_model_len, req.block_size) * page
    vocab = pad_vocab(int(cfg.vocab_size)) // req.tp * h * req.dtype_bytes
    parts = pp_partitions(layers, req.pp)
    stages = []
    for s, (start, end) in enumerate(parts):
        nbytes = sum(layer_bytes(cfg, i, req.tp, sparse, req.dtype_bytes) for i in range(start, end))
        nbytes += rope_table_bytes(cfg, req.dtype_bytes)
        if s == 0:
            nbytes += vocab  # embed_tokens
        if s == len(parts) - 1:
            nbytes += vocab + h * req.dtype_bytes  # lm_head, final norm
        stages.append(StageMemory((start, end), nbytes, (end - start) * per_layer, page))
    path = (
        f"sparse DSA path (max_model_len {req.max_model_len} > index_topk {cfg.index_topk}): latent "
        f"{cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim} + indexer key {cfg.index_head_dim}"
        if sparse
        else f"dense path (max_model_len <= index_topk {cfg.index_topk}): latent {cfg.kv_lora_rank} + rope "
        f"{cfg.qk_rope_head_dim}"
    )
    code = "int8" if req.kv_cache_dtype in INT8_CACHE_DTYPES else "e4m3"
    stored = req.dtype if req.kv_cache_dtype == "auto" else f"8-bit ({code}, a float32 scale a part)"
    notes = [
        f"KV cache: one {width}-value {stored} row per token and layer ({path}), {page} bytes a block, "
        "the same on every TP rank (one latent head, not split)",
        "MTP speculative decoding adds the checkpoint's MTP layer (weights and its cache); not counted here",
    ]
    if raw.get("quantization_config") is not None:
        notes.append(
            "config.json has a quantization_config: the weights above are counted unquantized (an upper bound)"
        )
    return ModelMemory("GlmMoeDsaForCausalLM", "KV cache", stages, notes)


def glm5_request_cache(length: int) -> dict[str, int]:
    """Bytes one request of ``length`` tokens reserves on GLM-5's shape (transformers' GlmMoeDsaConfig defaults;
    bfloat16, block 128, one rank), per ``--kv-cache-dtype`` (``auto`` and ``fp8``). Past the shape's
    max_position_embeddings the arithmetic goes on linearly (for comparison with longer-context models)."""
    from transformers import GlmMoeDsaConfig

    raw = {**GlmMoeDsaConfig().to_dict(), "architectures": ["GlmMoeDsaForCausalLM"]}
    raw["max_position_embeddings"] = max(raw["max_position_embeddings"], length)
    out = {}
    for cache in ("auto", "fp8"):
        req = Request(tp=1, pp=1, max_model_len=length, dtype="bfloat16", block_size=128, kv_cache_dtype=cache)
        out[cache] = memory_plan(raw, req).stages[0].request_cache_bytes
    return out


def status_notes(lengths: tuple[int, ...] = (4096, 131072)) -> list[str]:
    """The lines ``ascend-adapters status`` prints for GLM-DSA (``STATUS_NOTES`` in the hook)."""
    from transformers import GlmMoeDsaConfig

    cfg = GlmMoeDsaConfig()
    lines = [
        f"KV cache (GLM-5 shape, memory.py; sparse path, block 128): one latent row per token and layer (kv_c "
        f"{cfg.kv_lora_rank} + k_pe {cfg.qk_rope_head_dim} + indexer key {cfg.index_head_dim} values)"
    ]
    for n in lengths:
        per = glm5_request_cache(n)
        lines.append(
            f"  {n // 1024}k tokens: {per['auto'] / (1 << 30):.2f} GiB per request in bfloat16; "
            f"--kv-cache-dtype fp8 or int8_per_token_head: {per['fp8'] / (1 << 30):.2f} GiB "
            f"({per['fp8'] / per['auto']:.2f}x)"
        )
    return lines
