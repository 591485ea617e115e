"""Helpers for the GLM-DSA tests: tiny checkpoints in the released naming and the transformers reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ascend_adapters.glm_dsa.tiny import make_tiny


def add_released_extras(ckpt: Path, seed: int = 7) -> list[str]:
    """Add what released GLM-5.1 exports carry beyond the transformers model and its MTP layer (which
    ``make_tiny`` writes): the top-level MTP-only ``rot.weight``, and the MTP layer's copies of the
    embedding and LM head."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((ckpt / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    mtp = f"model.layers.{n}."
    extras = {"rot.weight": torch.randn(h, h, generator=torch.Generator().manual_seed(seed))}
    if mtp + "enorm.weight" in tensors:
        extras[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        extras[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors.update(extras)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return sorted(extras)


def add_tensor(ckpt: Path, name: str, shape=(4, 4)) -> None:
    from safetensors.torch import load_file, save_file

    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    tensors[name] = torch.zeros(*shape)
    save_file(tensors, str(path), metadata={"format": "pt"})


def build(tmp: Path, name: str, **overrides) -> Path:
    out = make_tiny(tmp / name, **overrides)
    add_released_extras(out)
    return out


def kv8_write_cache(config, cache_dtype: str = "fp8"):
    """transformers' DynamicCache whose writes (the latent ``k_pass`` / ``k_rot`` rows and the indexer keys)
    go through ``testing.kv8_reference.ROUND_TRIPS[cache_dtype]``: every later read of the cache sees the
    8-bit rows, as the adapter's attention does."""
    from transformers import DynamicCache

    from ascend_adapters.testing.kv8_reference import ROUND_TRIPS

    round_trip = ROUND_TRIPS[cache_dtype]

    class Kv8WriteCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(round_trip(key_states), round_trip(value_states), layer_idx, *args, **kwargs)

        def update_indexer(self, indexer_key_states, layer_idx):
            return super().update_indexer(round_trip(indexer_key_states), layer_idx)

    return Kv8WriteCache(config=config)


class Reference:
    """transformers' own GlmMoeDsaForCausalLM on the same checkpoint (float32, eager); ``kv8``: its cache
    written in 8 bits (``kv8_write_cache``; ``kv8``: the 8-bit ``--kv-cache-dtype``)."""

    def __init__(self, ckpt: Path, kv8: str | None = None, **config_overrides):
        from transformers import GlmMoeDsaForCausalLM

        self.model = GlmMoeDsaForCausalLM.from_pretrained(
            str(ckpt), dtype=torch.float32, attn_implementation="eager", **config_overrides
        ).eval()
        self.kv8 = kv8

    def __call__(self, ids: list[int]) -> torch.Tensor:
        cache = kv8_write_cache(self.model.config, self.kv8) if self.kv8 else None
        with torch.no_grad():
            return self.model(torch.tensor([ids]), past_key_values=cache).logits[0]

    def topk_boundary_gap(self, ids: list[int]) -> float:
        """Smallest gap between the k-th and (k+1)-th indexer score over all queries and full layers
        that have more than index_topk causal keys (docs/references.md#dsa-indexer-ties: a reference is only meaningful
        without ties)."""
        captured = []
        hooks = []
        for layer in self.model.model.layers:
            idx = layer.self_attn.indexer
            if idx is None:
                continue
            hooks.append(
                idx.register_forward_hook(
                    lambda mod, args, kwargs, out: captured.append((mod, args, kwargs)), with_kwargs=True
                )
            )
        try:
            self(ids)
        finally:
            for h in hooks:
                h.remove()
        gap = float("inf")
        for mod, args, kwargs in captured:
            with torch.no_grad():
                scores = _index_scores(mod, *args, **kwargs)  # [S, T]
            k = mod.index_topk
            for s in range(scores.shape[0]):
                if s + 1 <= k:
                    continue
                top = scores[s, : s + 1].topk(k + 1).values
                gap = min(gap, float(top[k - 1] - top[k]))
        return gap


def _index_scores(mod, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, past_key_values=None):
    """The indexer's pre-top-k scores, following transformers' GlmMoeDsaIndexer.forward."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = mod.wq_b(q_resid).view(b, s, mod.n_heads, mod.head_dim)
    q_rot, q_pass = torch.split(q, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
    k = mod.k_norm(mod.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * mod.softmax_scale)
    weights = mod.weights_proj(hidden_states).float() * (mod.n_heads**-0.5)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)[0]


def random_prompts(lengths, seed: int = 1, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def common_metadata(
    query_lens: list[int], seq_lens: list[int], blocks_per_request: int = 2, block_table: torch.Tensor | None = None
):
    """vLLM's common attention metadata of a step of requests r (16 tokens a block; unless ``block_table``
    is given, request r has blocks ``r * blocks_per_request + 1`` on, block 0 being the null block) with
    ``query_lens[r]`` new tokens ending a context of ``seq_lens[r]``, its host copies filled as the engines
    fill them (``seq_lens_cpu_upper_bound`` exact)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n, b = len(query_lens), blocks_per_request
    qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    if block_table is None:
        block_table = (torch.arange(n * b, dtype=torch.int32) + 1).view(n, b)
    slots = torch.cat(
        [
            block_table[r, torch.arange(s - q, s) // 16].long() * 16 + torch.arange(s - q, s) % 16
            for r, (q, s) in enumerate(zip(query_lens, seq_lens))
        ]
    )
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=lens,
        seq_lens_cpu_upper_bound=lens.clone(),
        num_reqs=n,
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=slots,
    )


def step_metadata(query_lens: list[int], seq_lens: list[int], decode_query_max: int = 1, blocks_per_request: int = 2):
    """The adapter's metadata of that step (``backend.step_metadata``, as its builder makes it when vLLM
    treats requests of up to ``decode_query_max`` query tokens as decodes)."""
    from ascend_adapters.glm_dsa.backend import step_metadata as build

    return build(common_metadata(query_lens, seq_lens, blocks_per_request), decode_query_max, 16)
