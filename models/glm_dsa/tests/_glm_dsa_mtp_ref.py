"""An independent reference of GLM-5.x's MTP layer, from transformers' modules and DeepSeek-V3's published
MTP definition (arXiv:2412.19437 section 2.2; GLM-5 follows it), with the input order of the released
``eh_proj`` weights ([embedding; hidden], as vLLM, SGLang and vllm-ascend read them) and the embedding at
position 0 zeroed, as those servers do.

It imports nothing of the adapter. The MTP decoder layer is transformers' own ``GlmMoeDsaDecoderLayer``:
the checkpoint's ``model.layers.<n>.*`` tensors are written, renamed to ``model.layers.0.*``, into a
one-layer ``GlmMoeDsaForCausalLM`` checkpoint whose final norm is the MTP layer's ``shared_head.norm``
and whose head is the target's ``lm_head``, so that model's logits on the MTP inputs are the MTP logits.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch


class MtpReference:
    def __init__(self, ckpt: Path):
        from safetensors.torch import load_file, save_file
        from transformers import GlmMoeDsaForCausalLM

        ckpt = Path(ckpt)
        self.main = GlmMoeDsaForCausalLM.from_pretrained(
            str(ckpt), dtype=torch.float32, attn_implementation="eager"
        ).eval()
        cfg = json.loads((ckpt / "config.json").read_text())
        n = cfg["num_hidden_layers"]
        tensors = load_file(str(ckpt / "model.safetensors"))
        prefix = f"model.layers.{n}."
        mtp = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        layer = {
            f"model.layers.0.{k}": v
            for k, v in mtp.items()
            if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))
        }
        layer["model.norm.weight"] = mtp["shared_head.norm.weight"]
        layer["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        layer["lm_head.weight"] = tensors["lm_head.weight"]
        one_layer = dict(
            cfg,
            num_hidden_layers=1,
            indexer_types=["full"],
            layer_types=cfg["layer_types"][-1:],
            mlp_layer_types=["sparse" if n >= cfg["first_k_dense_replace"] else "dense"],
            first_k_dense_replace=0,
            num_nextn_predict_layers=0,
        )
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(one_layer))
            save_file(layer, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            self.block = GlmMoeDsaForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        eps = cfg["rms_norm_eps"]
        self.enorm = _rms(mtp["enorm.weight"], eps)
        self.hnorm = _rms(mtp["hnorm.weight"], eps)
        self.eh_proj = mtp["eh_proj.weight"]

    def hidden(self, ids: list[int]) -> torch.Tensor:
        """The target's final hidden states (after its final norm), ``[L, H]``."""
        with torch.no_grad():
            return self.main.model(torch.tensor([ids])).last_hidden_state[0]

    def __call__(self, ids: list[int]) -> torch.Tensor:
        """Draft logits ``[L - 1, V]``: row ``i`` predicts token ``i + 2`` from the target's hidden state at
        ``i`` and token ``i + 1``."""
        with torch.no_grad():
            h = self.hidden(ids)[:-1]
            e = self.main.model.embed_tokens(torch.tensor(ids[1:])).clone()
            e[0] = 0.0
            x = torch.cat([self.enorm(e), self.hnorm(h)], dim=-1) @ self.eh_proj.T
            return self.block(inputs_embeds=x[None]).logits[0]


def _rms(weight: torch.Tensor, eps: float):
    def norm(x: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    return norm
