"""Memory of RWKV-7 on this adapter, derived from a config (``ascend-adapters plan``).

* The recurrent state: each layer holds, per request and tensor-parallel rank, the four entries
  ``model.state_shapes`` declares to vLLM (two token-shift vectors ``[C]`` in the model dtype, this
  rank's WKV matrices ``[H / tp, N, N]`` float32, the consumed-token count ``[1]`` int64): one vLLM
  state block (``MambaSpec``, whose page is the sum of the entries), whatever the context length. vLLM
  0.32 reserves one block per layer and request without prefix caching (``MambaSpec.max_memory_usage_bytes``;
  ``1 + num_speculative_tokens`` with n-gram drafts, more in prefix caching's 'align' mode).
* The weights per rank, as ``model.py`` builds them: r/k/v, the LoRA up-projections, ``key`` column-parallel
  and ``o_proj``, ``value`` row-parallel (split by TP); the LoRA down-projections and token-shift mixes
  replicated; ``k_k``, ``k_a``, ``r_k`` and the group norm this rank's heads; the embedding and head
  vocabulary-parallel (padded to a multiple of 64) on the first and last stage.
"""

from __future__ import annotations

from ascend_adapters.common.plan import (
    ModelMemory,
    PlanError,
    Request,
    StageMemory,
    check_layout,
    pad_vocab,
    pp_partitions,
)


def config_from_dict(raw: dict):
    from ascend_adapters.rwkv7.config import Rwkv7Config, validate_config

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "auto_map")}
    cfg = Rwkv7Config(**fields)
    try:
        validate_config(cfg)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    return cfg


def state_page_bytes(cfg, tp: int, dtype_bytes: int) -> int:
    """One layer's state block per request on one rank (``model.state_shapes`` / ``state_dtypes``)."""
    c, n = cfg.hidden_size, cfg.head_dim
    return 2 * c * dtype_bytes + (c // n // tp) * n * n * 4 + 8


def layer_parameters(cfg, layer: int, tp: int) -> int:
    """Parameters of decoder layer ``layer`` on one rank."""
    c, i = cfg.hidden_size, cfg.intermediate_size
    ranks = [cfg.decay_low_rank_dim, cfg.a_low_rank_dim, cfg.gate_low_rank_dim] + (
        [cfg.v_low_rank_dim] if layer > 0 else []
    )
    n = 4 * c + (2 * c if layer == 0 else 0)  # attn_norm, ffn_norm (+ pre_norm), weight and bias
    n += 6 * c + c  # the time-mix token-shift mixes x_r..x_g and the channel mix's x_k (replicated)
    n += 3 * c // tp + 2 * c // tp  # k_k, k_a, r_k; the group norm (this rank's heads)
    n += 4 * c * c // tp  # r_proj, k_proj, v_proj (column), o_proj (row)
    n += sum(c * r + r * c // tp for r in ranks)  # LoRA down (replicated) and up (column)
    n += (len(ranks) - 1) * c // tp  # the up-projection biases (w, a, v; the gate LoRA has none)
    n += 2 * c * i // tp  # channel mix key (column) and value (row)
    return n


def memory_plan(raw: dict, req: Request) -> ModelMemory:
    cfg = config_from_dict(raw)
    c, heads = cfg.hidden_size, cfg.hidden_size // cfg.head_dim
    check_layout(req, cfg.num_hidden_layers, {"heads": heads})
    page = state_page_bytes(cfg, req.tp, req.dtype_bytes)
    vocab = pad_vocab(cfg.vocab_size) // req.tp * c
    stages = []
    parts = pp_partitions(cfg.num_hidden_layers, req.pp)
    for s, (start, end) in enumerate(parts):
        params = sum(layer_parameters(cfg, layer, req.tp) for layer in range(start, end))
        if s == 0:
            params += vocab  # embeddings
        if s == len(parts) - 1:
            params += vocab + 2 * c  # lm_head, final norm
        stages.append(StageMemory((start, end), params * req.dtype_bytes, (end - start) * page, page))
    notes = [
        f"recurrent state: {_kib(page)} per layer and request on each rank (2 x {c} {req.dtype} token shifts, "
        f"{heads // req.tp} heads x {cfg.head_dim}^2 float32 WKV, one int64), the same at any length",
        "n-gram speculative decoding keeps 1 + num_speculative_tokens state blocks per request; prefix caching "
        "('align') at least 2 plus one per cached block: this plan counts one",
    ]
    return ModelMemory("RWKV7ForCausalLM", "recurrent state", stages, notes)


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"
