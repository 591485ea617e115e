"""MTP test machinery of the models that draft with their own MTP layer (GLM-DSA, DeepSeek-V4).

* ``fit_mtp``: the one fit of a tiny checkpoint's MTP layer to its own model, so that served drafts are
  accepted (and some rejected); what differs between the models is an ``MtpFitModel``.
* ``make_glm_dsa_mtp_fitted`` / ``make_deepseek_v4_mtp_fitted``: the fitted checkpoints of the MTP tests
  and benches (the acceptance floors of the served MTP gates are read from the benches' records, so both
  must build the same checkpoint: same seeds, data order, optimiser and steps).
* ``inprocess_target_and_drafter``: a target and its MTP drafter built and loaded in the test process,
  wired as vLLM's proposer wires them (the drafter-against-reference tests).

Test-layer code: nothing a user runs imports it (docs/architecture.md).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class MtpLayer:
    """An MTP layer being fitted: the parameters trained, ``logits(embeds, hidden, input_ids)`` (the draft
    logits of rows of sequences: ``embeds`` of tokens i + 1, ``hidden`` the target's at i, ``input_ids`` the
    tokens i + 1) and ``write(tensors)``, which puts the fitted weights into the checkpoint's tensors."""

    params: list[torch.nn.Parameter]
    logits: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    write: Callable[[dict], None]


@dataclass(frozen=True)
class MtpFitModel:
    """What the fit of one model's MTP layer needs of that model.

    ``load(ckpt)``: the target, a transformers ``...ForCausalLM`` (float32, eval; ``.model.embed_tokens``
    embeds). ``greedy(target, prompts, gen_len)``: prompts plus their greedy continuations. ``hidden(target,
    ids)``: what the MTP layer takes of the target at every position (``[B, T, ...]``). ``layer(cfg, tensors,
    positions)``: the MTP layer of the checkpoint's ``tensors``, built for sequences of ``positions``.
    ``first_token``: random prompts draw token ids from ``[first_token, vocab_size)``."""

    load: Callable[[Path], Any]
    greedy: Callable[[Any, torch.Tensor, int], torch.Tensor]
    hidden: Callable[[Any, torch.Tensor], torch.Tensor]
    layer: Callable[[dict, dict, int], MtpLayer]
    first_token: int


def fit_mtp(
    ckpt: str | Path,
    model: MtpFitModel,
    *,
    sequences: int = 128,
    prompt_len: int = 8,
    gen_len: int = 40,
    steps: int = 150,
    lr: float = 1e-2,
    seed: int = 0,
) -> dict:
    """Train the checkpoint's MTP layer, as MTP layers are trained, to predict its own model's token after
    next, and write it back in place. The data are the model's greedy continuations of random prompts
    (``sequences`` of ``prompt_len`` + ``gen_len`` tokens); the loss is cross-entropy on the generated
    tokens (Adam, full batch); embedding, head and the main layers stay the model's. Returns the final
    training loss and the top-1 accuracy on an eighth of the sequences held out of the fit. Runs on one
    torch thread, so the fitted weights do not depend on the caller's thread count (the tests' and the
    bench's checkpoints are the same)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _fit_mtp(Path(ckpt), model, sequences, prompt_len, gen_len, steps, lr, seed)
    finally:
        torch.set_num_threads(threads)


def _fit_mtp(
    ckpt: Path, model: MtpFitModel, sequences: int, prompt_len: int, gen_len: int, steps: int, lr: float, seed: int
) -> dict:
    from safetensors.torch import load_file, save_file

    cfg = json.loads((ckpt / "config.json").read_text())
    torch.manual_seed(seed)
    main = model.load(ckpt)
    prompts = torch.randint(
        model.first_token, cfg["vocab_size"], (sequences, prompt_len), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        ids = model.greedy(main, prompts, gen_len)
        hidden = model.hidden(main, ids)[:, :-2]  # the target's at position i
        embeds = main.model.embed_tokens(ids[:, 1:-1])  # token i + 1
    embeds[:, 0] = 0.0  # position 0, as served
    targets = ids[:, 2:].clone()  # token i + 2
    targets[:, : prompt_len - 2] = -100  # the random prompt tokens cannot be predicted
    tensors = load_file(str(ckpt / "model.safetensors"))
    layer = model.layer(cfg, tensors, hidden.shape[1])
    opt = torch.optim.Adam(layer.params, lr=lr)

    def draft_logits(rows):
        return layer.logits(embeds[rows], hidden[rows], ids[rows, 1:-1])

    held = max(1, sequences // 8)  # held out: the accuracy on continuations the fit did not see
    train = slice(held, None)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(draft_logits(train).flatten(0, 1), targets[train].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        mask = targets[:held] >= 0
        accuracy = float((draft_logits(slice(0, held)).argmax(-1) == targets[:held])[mask].float().mean())
    layer.write(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    return {"loss": float(loss.detach()), "held_out_accuracy": accuracy, "steps": steps, "sequences": sequences}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


# -- GLM-DSA: the released layout, the MTP layer at model.layers.<num_hidden_layers>.* ---------------------

# The fitted checkpoint: a small init scale, so the next token depends mostly on the current one and the token
# after next is learnable by one MTP layer from a few thousand tokens. Its greedy text repeats itself, so
# indexer keys repeat and top-k scores nearly tie; index_topk 128 keeps every row of contexts up to 128 tokens
# (the sparse path runs, the selection cannot flip on a near-tie).
GLM_DSA_FITTED = dict(std=0.02, index_topk=128)
GLM_DSA_FIT = dict(sequences=128, gen_len=56, steps=150, lr=1e-2)


def _glm_dsa_load(ckpt: Path):
    from transformers import GlmMoeDsaForCausalLM

    return GlmMoeDsaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager").eval()


def _glm_dsa_greedy(main, prompts: torch.Tensor, gen_len: int) -> torch.Tensor:
    mask = torch.ones_like(prompts)
    return main.generate(prompts, attention_mask=mask, max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False)


def _glm_dsa_layer(cfg: dict, tensors: dict, positions: int) -> MtpLayer:
    """transformers' one-layer ``GlmMoeDsaForCausalLM`` made of the MTP layer (``tiny.mtp_layer_config``; its
    final norm is the layer's ``shared_head.norm``, its head the target's, frozen), plus ``enorm``, ``hnorm``
    and ``eh_proj`` (input order [embedding; hidden], as released)."""
    from safetensors.torch import load_file, save_file
    from transformers import GlmMoeDsaForCausalLM

    from ascend_adapters.glm_dsa.tiny import mtp_layer_config

    prefix = f"model.layers.{cfg['num_hidden_layers']}."
    mtp = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    own = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
    layer = {f"model.layers.0.{k}": v for k, v in mtp.items() if not k.startswith(own)}
    layer["model.norm.weight"] = mtp["shared_head.norm.weight"]
    layer["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    layer["lm_head.weight"] = tensors["lm_head.weight"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(mtp_layer_config(cfg)))
        save_file(layer, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        block = GlmMoeDsaForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
    block.train()
    block.lm_head.weight.requires_grad_(False)
    block.model.embed_tokens.weight.requires_grad_(False)
    glue = {k: torch.nn.Parameter(mtp[f"{k}.weight"].clone()) for k in ("enorm", "hnorm", "eh_proj")}
    eps = cfg["rms_norm_eps"]

    def logits(embeds, hidden, input_ids):
        e, h = _rms(embeds, glue["enorm"], eps), _rms(hidden, glue["hnorm"], eps)
        return block(inputs_embeds=torch.cat([e, h], dim=-1) @ glue["eh_proj"].T).logits

    def write(out: dict) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            block.save_pretrained(tmp)
            saved = load_file(str(Path(tmp) / "model.safetensors"))
        for k, v in saved.items():
            if k.startswith("model.layers.0."):
                out[prefix + k[len("model.layers.0.") :]] = v.detach().contiguous()
        out[prefix + "shared_head.norm.weight"] = saved["model.norm.weight"].detach().contiguous()
        for k, p in glue.items():
            out[f"{prefix}{k}.weight"] = p.detach().contiguous()

    return MtpLayer([*glue.values(), *(p for p in block.parameters() if p.requires_grad)], logits, write)


GLM_DSA = MtpFitModel(
    load=_glm_dsa_load,
    greedy=_glm_dsa_greedy,
    hidden=lambda main, ids: main.model(ids).last_hidden_state,  # after the final norm
    layer=_glm_dsa_layer,
    first_token=1,
)


def make_glm_dsa_mtp_fitted(out_dir: str | Path, tokenizer: bool = False, **overrides) -> tuple[Path, dict]:
    """A tiny GLM-DSA checkpoint (``glm_dsa.tiny.make_tiny``, ``GLM_DSA_FITTED``) whose MTP layer was fitted
    to its own model; returns it and the fit's summary. ``overrides`` change config fields."""
    from ascend_adapters.glm_dsa.tiny import make_tiny

    out = make_tiny(out_dir, tokenizer=tokenizer, **{**GLM_DSA_FITTED, **overrides})
    return out, fit_mtp(out, GLM_DSA, **GLM_DSA_FIT)


# -- DeepSeek-V4: DeepSeek's names, the MTP layer at mtp.0.* ---------------------------------------------

# The fitted checkpoint: a small init scale, so the next token depends mostly on the current one and the token
# after next is learnable by one MTP layer from a few thousand tokens (held-out top-1 accuracy about 0.56
# here; at the tiny model's own scale, 0.1, or at 0.02 it stays near 0.1). At that scale the logits span
# about 0.35 per position, too little for a parity bound of 1e-3 to mean much; the head is scaled up so they
# span several units (greedy tokens do not change: argmax is scale-free).
DEEPSEEK_V4_FITTED = dict(initializer_range=0.005)
DEEPSEEK_V4_HEAD_SCALE = 20.0
DEEPSEEK_V4_FIT = dict(sequences=128, gen_len=40, steps=150, lr=1e-2)
# The MTP block's own tensors around its decoder layer (``mtp.0.<name>``): DeepSeek's MTPBlock glue and hc head.
DEEPSEEK_V4_MTP_GLUE = (
    "e_proj.weight",
    "h_proj.weight",
    "enorm.weight",
    "hnorm.weight",
    "norm.weight",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
)


def deepseek_v4_mtp_block(tensors: dict, cfg: dict, layer_type: str, mlp_type: str):
    """transformers' one-layer ``DeepseekV4Model`` (eval) whose layer 0 is the decoder layer of the MTP block
    (``mtp.0.*`` less ``DEEPSEEK_V4_MTP_GLUE``), of ``layer_type`` / ``mlp_type``; its embedding, norm and hc
    head are the target's (the MTP block's own are in the glue)."""
    from safetensors.torch import save_file
    from transformers import DeepseekV4ForCausalLM

    one = dict(cfg, num_hidden_layers=1, num_nextn_predict_layers=0, layer_types=[layer_type])
    one["mlp_layer_types"] = [mlp_type]
    block = {
        "model.layers.0." + k[len("mtp.0.") :]: v
        for k, v in tensors.items()
        if k.startswith("mtp.0.") and k[len("mtp.0.") :] not in DEEPSEEK_V4_MTP_GLUE
    }
    for k in ("model.embed_tokens.weight", "head.weight", "model.norm.weight"):
        block[k] = tensors[k]
    for k in ("hc_fn", "hc_base", "hc_scale"):
        block[f"model.hc_head.{k}"] = tensors[f"model.hc_head.{k}"]
    with tempfile.TemporaryDirectory() as tmp:
        save_file(block, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(one))
        return DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval().model


def _deepseek_v4_load(ckpt: Path):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


def _deepseek_v4_greedy(main, ids: torch.Tensor, gen_len: int) -> torch.Tensor:
    for _ in range(gen_len):  # a full forward per step (the tiny model has no cache to trust here)
        ids = torch.cat([ids, main(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _deepseek_v4_streams(main, ids: torch.Tensor) -> torch.Tensor:
    """The target's hc_mult streams before its hc head, ``[B, T, hc, h]``."""
    seen = {}
    hook = main.model.hc_head.register_forward_pre_hook(lambda m, args: seen.setdefault("s", args[0]))
    try:
        main(ids)
    finally:
        hook.remove()
    return seen["s"].float()


def _deepseek_v4_layer(cfg: dict, tensors: dict, positions: int) -> MtpLayer:
    """DeepSeek's MTPBlock (``_dsv4_mtp_ref`` writes out its math) around transformers' decoder layer; the
    head is the target's, frozen."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    from ascend_adapters.deepseek_v4.config import MTP_LAYER_TYPE, MTP_MLP_TYPE

    model = deepseek_v4_mtp_block(tensors, cfg, MTP_LAYER_TYPE, MTP_MLP_TYPE)
    layer = model.layers[0].train()
    glue = {k: torch.nn.Parameter(tensors[f"mtp.0.{k}"].float().clone()) for k in DEEPSEEK_V4_MTP_GLUE}
    head = tensors["head.weight"].float()
    eps = cfg["rms_norm_eps"]
    position_ids = torch.arange(positions)[None]
    dummy = torch.zeros(1, positions, cfg["hidden_size"])
    mask = create_sliding_window_causal_mask(
        config=model.config, inputs_embeds=dummy, attention_mask=None, past_key_values=None, position_ids=position_ids
    )
    rope = {k: model.rotary_emb(dummy, position_ids=position_ids, layer_type=k) for k in ("main", "compress")}

    def logits(embeds, streams, input_ids):
        e = _rms(embeds, glue["enorm.weight"], eps) @ glue["e_proj.weight"].T
        x = e[:, :, None] + _rms(streams, glue["hnorm.weight"], eps) @ glue["h_proj.weight"].T
        x = layer(x, position_embeddings=rope, position_ids=position_ids, attention_mask=mask, input_ids=input_ids)
        flat = x.flatten(2)
        mixes = (flat @ glue["hc_head_fn"].T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
        pre = torch.sigmoid(mixes * glue["hc_head_scale"] + glue["hc_head_base"]) + cfg["hc_eps"]
        return _rms((pre[..., None] * x).sum(2), glue["norm.weight"], eps) @ head.T

    def write(out: dict) -> None:
        for k, v in layer.state_dict().items():
            if f"mtp.0.{k}" in out:
                out[f"mtp.0.{k}"] = v.detach().contiguous()
        for k, p in glue.items():
            out[f"mtp.0.{k}"] = p.detach().to(out[f"mtp.0.{k}"].dtype).contiguous()

    return MtpLayer([*glue.values(), *(p for p in layer.parameters() if p.requires_grad)], logits, write)


DEEPSEEK_V4 = MtpFitModel(
    load=_deepseek_v4_load,
    greedy=_deepseek_v4_greedy,
    hidden=_deepseek_v4_streams,
    layer=_deepseek_v4_layer,
    first_token=2,
)


def make_deepseek_v4_mtp_fitted(out_dir: str | Path, seed: int = 4, **overrides) -> tuple[Path, dict]:
    """A tiny DeepSeek-V4 checkpoint with an MTP layer (``deepseek_v4.tiny.make_tiny``,
    ``DEEPSEEK_V4_FITTED``, head scaled by ``DEEPSEEK_V4_HEAD_SCALE``) fitted to its own model; returns it
    and the fit's summary."""
    from safetensors.torch import load_file, save_file

    from ascend_adapters.deepseek_v4.tiny import make_tiny

    out = make_tiny(out_dir, seed=seed, mtp=True, **{**DEEPSEEK_V4_FITTED, **overrides})
    tensors = load_file(str(out / "model.safetensors"))
    tensors["head.weight"] = tensors["head.weight"] * DEEPSEEK_V4_HEAD_SCALE
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, fit_mtp(out, DEEPSEEK_V4, **DEEPSEEK_V4_FIT)


# -- in process: a target and its MTP drafter, as vLLM's proposer wires them ------------------------------


def inprocess_target_and_drafter(ckpt: str | Path, drafter_class, max_model_len: int, **cache):
    """The target and ``drafter_class`` built and loaded from ``ckpt`` in this process (float32, no engine;
    ``cache``: ``CacheConfig`` fields, prefix caching off), the drafter given the target's embedding and
    head, as vLLM's proposer does after loading it. Returns ``(vllm_config, target, drafter)``; the
    drafter's caches are the caller's."""
    from safetensors.torch import load_file
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

    mc = ModelConfig(model=str(ckpt), dtype="float32", max_model_len=max_model_len, skip_tokenizer_init=True)
    cfg = VllmConfig(model_config=mc, cache_config=CacheConfig(**cache, enable_prefix_caching=False))
    weights = load_file(str(Path(ckpt) / "model.safetensors"))
    with set_current_vllm_config(cfg):
        ensure_single_rank_parallel_state()
        target = initialize_model(cfg)
        target.load_weights(iter(weights.items()))
        process_weights_after_loading(target, mc, torch.device("cpu"))
        drafter = drafter_class(vllm_config=cfg)
        drafter.load_weights(iter(weights.items()))
        process_weights_after_loading(drafter, mc, torch.device("cpu"))
    drafter.model.embed_tokens = target.model.embed_tokens
    for layer in drafter.model.layers.values():
        layer.shared_head.head = target.lm_head
    return cfg, target, drafter
