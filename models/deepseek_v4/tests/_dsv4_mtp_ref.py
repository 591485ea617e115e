"""Independent reference of DeepSeek-V4's MTP block (``mtp.0.*``); imports nothing from the adapter.

Written from DeepSeek's published inference code (DeepSeek-V4-Flash ``inference/model.py``:
``MTPBlock.forward`` and ``ParallelHead.hc_head``/``forward``):

    e = enorm(embed(t))                    # RMSNorm, float
    x = e_proj(e)[:, None] + h_proj(hnorm(S))   # S: the target's streams [T, hc_mult, hidden], hnorm per stream
    x = Block(x)                           # the decoder block: here transformers' own DeepseekV4DecoderLayer
    y = sum_m pre_m * x_m,  pre = sigmoid(linear(flat(x), hc_head_fn) * rsqrt(mean(flat(x)^2) + eps)
                                          * hc_head_scale + hc_head_base) + hc_eps
    logits = head(norm(y))

plus one convention of vLLM's proposer that DeepSeek's code leaves to its caller: the embedding at
position 0 is zeroed. The target's streams come from transformers' ``DeepseekV4ForCausalLM`` (the input of
its ``hc_head``); the decoder block is a one-layer transformers model holding the MTP block's decoder layer
(``mtp_fit.deepseek_v4_mtp_block`` of the test layer, which the fit of the MTP layer trains through too).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ascend_adapters.testing.mtp_fit import DEEPSEEK_V4_MTP_GLUE as GLUE
from ascend_adapters.testing.mtp_fit import deepseek_v4_mtp_block

EPS = 1e-6  # DeepSeek's norm_eps and hc_eps (ParallelHead(vocab, dim, norm_eps, hc_eps))


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * weight.float()


class MtpReference:
    def __init__(self, ckpt: Path, mtp_layer_type: str = "sliding_attention", mtp_mlp_type: str = "moe"):
        from transformers import DeepseekV4ForCausalLM

        ckpt = Path(ckpt)
        tensors = load_file(str(ckpt / "model.safetensors"))
        self.target = DeepseekV4ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        self.glue = {k: tensors[f"mtp.0.{k}"].float() for k in GLUE}
        self.embed = tensors["model.embed_tokens.weight"].float()
        self.head = tensors["head.weight"].float()
        cfg = json.loads((ckpt / "config.json").read_text())
        # the one-layer model's own embedding / norm / hc head / head are never used
        self.block = deepseek_v4_mtp_block(tensors, cfg, mtp_layer_type, mtp_mlp_type)
        self.hc = int(cfg["hc_mult"])

    @torch.no_grad()
    def streams(self, ids: list[int]) -> torch.Tensor:
        """The target's streams before its hc head, ``[len(ids), hc_mult, hidden]``."""
        seen = {}
        hook = self.target.model.hc_head.register_forward_pre_hook(lambda m, args: seen.setdefault("s", args[0]))
        try:
            self.target(torch.tensor([ids]))
        finally:
            hook.remove()
        return seen["s"][0].float()

    @torch.no_grad()
    def __call__(self, ids: list[int], streams: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(ids) - 1, V]``: row i from the target's streams at position i and token i + 1
        (it predicts token i + 2)."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        g = self.glue
        n = len(ids) - 1
        pos = torch.arange(n)
        e = self.embed[torch.tensor(ids[1:])]
        e = torch.where(pos[:, None] == 0, 0.0, e)
        e = _rms(e, g["enorm.weight"]) @ g["e_proj.weight"].T
        x = e[:, None] + _rms(streams[:n], g["hnorm.weight"]) @ g["h_proj.weight"].T
        model = self.block
        dummy = torch.zeros(1, n, x.shape[-1])
        position_ids = pos[None]
        mask = create_sliding_window_causal_mask(
            config=model.config,
            inputs_embeds=dummy,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids,
        )
        rope = {t: model.rotary_emb(dummy, position_ids=position_ids, layer_type=t) for t in ("main", "compress")}
        x = model.layers[0](
            x[None],
            position_embeddings=rope,
            position_ids=position_ids,
            attention_mask=mask,
            input_ids=torch.tensor([ids[1:]]),
        )[0]
        flat = x.flatten(1).float()
        mixes = (flat @ g["hc_head_fn"].T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + EPS)
        pre = torch.sigmoid(mixes * g["hc_head_scale"] + g["hc_head_base"]) + EPS
        y = (pre[..., None] * x.float()).sum(1)
        return _rms(y, g["norm.weight"]) @ self.head.T
