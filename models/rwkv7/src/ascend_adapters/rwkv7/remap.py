"""BlinkDL ``.pth`` names (what the ``rwkv`` package loads) to the HF/flash-linear-attention
layout, as declarative rules for common's remap: used by the offline converter only.

Serving loads the HF layout the vLLM way (``Rwkv7ForCausalLM.hf_to_vllm_mapper`` and
``AutoWeightsLoader``). Every name either matches a rule or is reported as unmapped (an error).
"""

from __future__ import annotations

from ascend_adapters.common.remap import Remapper, rename, skip

_L = r"^blocks\.(\d+)\."
_M = r"model.layers.\1."

BLINKDL_TO_HF = [
    skip(
        r"^blocks\.0\.att\.v[012]$",
        "layer 0 has no value-residual LoRA (v_first is taken there); the rwkv package ignores these too",
    ),
    rename(r"^emb\.weight$", "model.embeddings.weight"),
    rename(r"^ln_out\.(weight|bias)$", r"model.norm.\1"),
    rename(r"^head\.weight$", "lm_head.weight"),
    rename(_L + r"ln0\.(weight|bias)$", _M + r"pre_norm.\2"),
    rename(_L + r"ln1\.(weight|bias)$", _M + r"attn_norm.\2"),
    rename(_L + r"ln2\.(weight|bias)$", _M + r"ffn_norm.\2"),
    rename(_L + r"att\.receptance\.weight$", _M + "attn.r_proj.weight"),
    rename(_L + r"att\.key\.weight$", _M + "attn.k_proj.weight"),
    rename(_L + r"att\.value\.weight$", _M + "attn.v_proj.weight"),
    rename(_L + r"att\.output\.weight$", _M + "attn.o_proj.weight"),
    rename(_L + r"att\.ln_x\.(weight|bias)$", _M + r"attn.g_norm.\2"),
    rename(_L + r"att\.([wav])0$", _M + r"attn.\2_lora.lora.2.bias", "flatten"),
    rename(_L + r"att\.([wavg])1$", _M + r"attn.\2_lora.lora.0.weight", "transpose"),
    rename(_L + r"att\.([wavg])2$", _M + r"attn.\2_lora.lora.2.weight", "transpose"),
    rename(_L + r"att\.(k_k|k_a)$", _M + r"attn.\2", "flatten"),
    rename(_L + r"att\.(x_[rwkvag]|r_k)$", _M + r"attn.\2"),
    rename(_L + r"ffn\.x_k$", _M + "ffn.x_k", "flatten"),
    rename(_L + r"ffn\.(key|value)\.weight$", _M + r"ffn.\2.weight"),
]


def blinkdl_remapper(targets=None) -> Remapper:
    return Remapper(list(BLINKDL_TO_HF), targets=targets, source="BlinkDL .pth")
