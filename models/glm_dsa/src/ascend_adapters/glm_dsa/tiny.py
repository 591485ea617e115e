"""Tiny GLM-5.x DSA checkpoints saved by transformers itself (tests, demo, bench).

Head sizes are CPU-friendly (qk head 64 = 48 nope + 16 rope, v head 64) and the
indexer has 16 heads so the top-k boundary has no ties (docs/references.md#dsa-indexer-ties).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    kv_lora_rank=32,
    q_lora_rank=64,
    qk_rope_head_dim=16,
    v_head_dim=64,
    qk_nope_head_dim=48,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    max_position_embeddings=1024,
    index_topk=8,
    index_head_dim=32,
    index_n_heads=16,
    first_k_dense_replace=1,
    indexer_types=["full", "full", "shared"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def make_tiny(
    out_dir: str | Path, seed: int = 0, std: float = 0.08, tokenizer: bool = True, mtp: bool = True, **overrides
) -> Path:
    """Write a random tiny ``GlmMoeDsaForCausalLM`` with ``save_pretrained`` (float32).

    ``std`` sets the init scale (larger than the default 0.02 so logits are not
    flat); ``overrides`` change config fields (e.g. ``index_topk=64``). ``mtp``: add the
    MTP layer as released checkpoints carry it (``add_mtp_layer``; transformers does not build it).
    """
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY_CONFIG, initializer_range=std)
    cfg.update(overrides)
    config = GlmMoeDsaConfig(**cfg)
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(config).float().eval()
    _spread_vectors(model, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10)
    model.save_pretrained(str(out))
    if mtp and config.num_nextn_predict_layers:
        add_mtp_layer(out, seed=seed + 2, std=std)
    if tokenizer:
        from ascend_adapters.common.tokenizer import write_tokenizer

        write_tokenizer(out, vocab_size=config.vocab_size)
    # record the tiny-model provenance next to the weights
    (out / "tiny_glm_dsa.json").write_text(
        json.dumps({"seed": seed, "std": std, "overrides": overrides}, default=str, indent=2)
    )
    return out


def _spread_vectors(model, g) -> None:
    """Router biases around 0 and norms around 1 (not exactly 1), so every vector matters."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias") or (p.dim() == 1 and "bias" in name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif p.dim() == 1:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)


def mtp_layer_config(config: dict) -> dict:
    """The config of a one-layer model whose layer 0 is the MTP layer of ``config`` (a 'full' DSA layer
    with the MoE of a layer after ``first_k_dense_replace``): how transformers builds the layer."""
    n = config["num_hidden_layers"]
    return dict(
        config,
        num_hidden_layers=1,
        indexer_types=["full"],
        layer_types=(config.get("layer_types") or ["indexed_attention"])[-1:],
        mlp_layer_types=["sparse" if n >= config.get("first_k_dense_replace", 0) else "dense"],
        first_k_dense_replace=0,
        num_nextn_predict_layers=0,
    )


def add_mtp_layer(ckpt: str | Path, seed: int = 2, std: float = 0.08) -> list[str]:
    """Add the checkpoint's MTP layer in the released layout, ``model.layers.<num_hidden_layers>.*``: a full
    decoder layer (made by transformers, see ``mtp_layer_config``) plus ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head.norm``. Returns the names added."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    ckpt = Path(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    torch.manual_seed(seed)
    layer_cfg = GlmMoeDsaConfig(**{k: v for k, v in mtp_layer_config(cfg).items() if k != "architectures"})
    donor = GlmMoeDsaForCausalLM(layer_cfg).float()
    g = torch.Generator().manual_seed(seed + 1)
    _spread_vectors(donor, g)
    with tempfile.TemporaryDirectory() as tmp:
        donor.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    prefix = f"model.layers.{n}."
    added = {prefix + k[len("model.layers.0.") :]: v for k, v in saved.items() if k.startswith("model.layers.0.")}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        added[f"{prefix}{name}.weight"] = 1.0 + torch.randn(h, generator=g) * 0.1
    added[prefix + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * std
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(added)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return sorted(added)


def fit_mtp(
    ckpt: str | Path,
    *,
    sequences: int = 48,
    prompt_len: int = 8,
    gen_len: int = 56,
    steps: int = 200,
    lr: float = 3e-3,
    seed: int = 0,
) -> dict:
    """Train the checkpoint's MTP layer, as MTP layers are trained, to predict its own model's token after
    next, and write it back in place. The data are the model's greedy continuations of random prompts
    (``sequences`` of ``prompt_len`` + ``gen_len`` tokens); the loss is cross-entropy on the generated
    tokens; the embedding and head stay the model's. Returns the final training loss and the top-1 accuracy
    on an eighth of the sequences held out of the fit. Runs on one torch thread, so the fitted weights do
    not depend on the caller's thread count (the tests' and the bench's checkpoints are the same)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _fit_mtp(Path(ckpt), sequences, prompt_len, gen_len, steps, lr, seed)
    finally:
        torch.set_num_threads(threads)


def _fit_mtp(ckpt: Path, sequences: int, prompt_len: int, gen_len: int, steps: int, lr: float, seed: int) -> dict:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GlmMoeDsaForCausalLM

    cfg = json.loads((ckpt / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    prefix = f"model.layers.{n}."
    torch.manual_seed(seed)
    main = GlmMoeDsaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager").eval()
    prompts = torch.randint(
        1, cfg["vocab_size"], (sequences, prompt_len), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        ids = main.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=gen_len,
            min_new_tokens=gen_len,
            do_sample=False,
        )
        hidden = main.model(ids).last_hidden_state
        embeds = main.model.embed_tokens(ids[:, 1:-1])
    embeds[:, 0] = 0.0  # position 0, as served
    targets = ids[:, 2:].clone()
    targets[:, : prompt_len - 2] = -100  # the random prompt tokens cannot be predicted
    tensors = load_file(str(ckpt / "model.safetensors"))
    mtp = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    layer = {
        f"model.layers.0.{k}": v
        for k, v in mtp.items()
        if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))
    }
    layer.update(
        {
            "model.norm.weight": mtp["shared_head.norm.weight"],
            "model.embed_tokens.weight": tensors["model.embed_tokens.weight"],
            "lm_head.weight": tensors["lm_head.weight"],
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(mtp_layer_config(cfg)))
        save_file(layer, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        block = GlmMoeDsaForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
    block.train()
    block.lm_head.weight.requires_grad_(False)
    block.model.embed_tokens.weight.requires_grad_(False)
    enorm = torch.nn.Parameter(mtp["enorm.weight"].clone())
    hnorm = torch.nn.Parameter(mtp["hnorm.weight"].clone())
    eh_proj = torch.nn.Parameter(mtp["eh_proj.weight"].clone())
    eps = cfg["rms_norm_eps"]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    trained = [enorm, hnorm, eh_proj, *(p for p in block.parameters() if p.requires_grad)]
    opt = torch.optim.Adam(trained, lr=lr)
    held = max(1, sequences // 8)  # held out: the accuracy on continuations the fit did not see

    def draft_logits(rows):
        x = torch.cat([rms(embeds[rows], enorm), rms(hidden[rows, :-2], hnorm)], dim=-1) @ eh_proj.T
        return block(inputs_embeds=x).logits

    train = slice(held, None)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(draft_logits(train).flatten(0, 1), targets[train].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        mask = targets[:held] >= 0
        accuracy = float((draft_logits(slice(0, held)).argmax(-1) == targets[:held])[mask].float().mean())
    with tempfile.TemporaryDirectory() as tmp:
        block.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    for k, v in saved.items():
        if k.startswith("model.layers.0."):
            tensors[prefix + k[len("model.layers.0.") :]] = v.detach().contiguous()
    tensors[prefix + "shared_head.norm.weight"] = saved["model.norm.weight"].detach().contiguous()
    for name, p in (("enorm", enorm), ("hnorm", hnorm), ("eh_proj", eh_proj)):
        tensors[f"{prefix}{name}.weight"] = p.detach().contiguous()
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    return {"loss": float(loss.detach()), "held_out_accuracy": accuracy, "steps": steps, "sequences": sequences}


# the MTP-fitted checkpoint (tests and bench): a small init scale, so the next token depends mostly on the
# current one and the token after next is learnable by one MTP layer from a few thousand tokens. Its greedy
# text repeats itself, so indexer keys repeat and top-k scores nearly tie; index_topk 128 keeps every row of
# contexts up to 128 tokens (the sparse path runs, the selection cannot flip on a near-tie).
MTP_FITTED = dict(std=0.02, index_topk=128)
MTP_FIT = dict(sequences=128, steps=150, lr=1e-2)


def make_mtp_fitted(out_dir: str | Path, tokenizer: bool = False, **overrides) -> tuple[Path, dict]:
    """A tiny checkpoint whose MTP layer was fitted (``fit_mtp``) to its own model; returns it and the fit's
    summary. ``overrides`` change config fields (e.g. a deeper stack)."""
    out = make_tiny(out_dir, tokenizer=tokenizer, **{**MTP_FITTED, **overrides})
    return out, fit_mtp(out, **MTP_FIT)
