"""The 8-bit KV cache's reference quantisation and the served gates' judgement (GLM-DSA, DeepSeek-V4).

``e4m3_round_trip`` (``--kv-cache-dtype fp8``) is the documented quantisation written from the OCP 8-bit
floating point spec, not through torch's float8 cast nor the adapters' ``common.kernels.kv8``;
``int8_round_trip`` (``int8_per_token_head``) is written from torch_npu's ``npu_dynamic_quant`` page. The
references (transformers' models) pass what they cache through one of them as they store it
(``ROUND_TRIPS``).

Bound. Both sides store the same 8-bit value whenever they quantise the same float value: its code is
fixed by ``x / scale`` alone (``common/tests/test_kv8`` holds the adapters' codes to the OCP table). The
float rows agree only to float32's accuracy through the layers before them (relative ~1e-6), so a code
can differ where ``x / scale`` lies within that of a rounding midpoint: E4M3 midpoints are ``2**-4``
(relative) from a code, so about ``1e-6 / 2**-4 ~ 2e-5`` of the values, each then read back one step
(``2**-3 |x|``) apart, where the quantisation itself moves every value by up to half a step. Linearised,
such flips move the logits by about ``2 * 2e-5`` of the quantisation's whole effect ``D`` (the float
reference against the 8-bit one on the same tokens). The served logits must be within
``max(TOL, D / FLIP_SHARE)`` of the 8-bit reference (``TOL``: the float gates' 1e-3; ``D / 20`` leaves
three orders of magnitude over the linearised flips, since one value of a heavily attended row weighs
more than the average) with the greedy tokens equal, and ``D`` must exceed ten times the served logits'
distance from the 8-bit reference and ten times ``FLOAT_NOISE``: the served cache is read back as 8-bit
rows, not as the float ones.

The int8 form: midpoints are half a step from a code, ``scale = a / 127``, so values near the part's largest
``a`` flip where ``x / scale`` (up to 127) is within ``127 * 1e-6`` of a midpoint: about ``3e-4`` of them.
A float32 row is rounded to bfloat16 first (npu_dynamic_quant's input), whose midpoints catch about
``2 * 1e-6 / 2**-7 ~ 3e-4`` of the values, each then one bfloat16 step (``2**-7 |x|``, about a step of the
code at the part's largest values) apart. Linearised, ``2 * 6e-4 D ~ D / 800``: ``D / 20`` holds with over an
order of magnitude to spare. A bfloat16 value over its float32 scale is often a half-integer exactly (about
8e-4 of them): both sides divide in float32 and round half to even, so such ties go the same way (divided in
float64 instead, the reference disagreed on them and a greedy token with it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TOL = 1e-3  # the float parity gates' bound
FLIP_SHARE = 20  # codes that differ move the logits by at most D / FLIP_SHARE (module doc)
# the float paths agree to about this on the tiny checkpoints (float32 through a few layers: the float gates'
# records show 1e-6 to 1e-5); D must exceed ten times it and ten times the served distance
FLOAT_NOISE = 1e-5


def e4m3_round_trip(x: torch.Tensor) -> torch.Tensor:
    """Each row (last dimension) of ``x`` quantised and read back: the row's scale is ``max|row| / 448``
    (448: E4M3's largest finite value; in float32; 1 for a row of zeros), each value over it rounded to the
    nearest E4M3 value (3 mantissa bits; below the smallest normal 2**-6, steps of 2**-9; ties to even) and
    multiplied back, in ``x``'s dtype."""
    y = x.double()
    amax = y.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float().double()
    v = y / scale
    step = torch.pow(2.0, torch.floor(torch.log2(v.abs().clamp(min=2.0**-6))) - 3)
    q = (torch.round(v / step) * step).clamp(-448.0, 448.0)  # torch.round: half to even
    return (q * scale).to(x.dtype)


def int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """Each row (last dimension) of ``x`` quantised to int8 and read back (torch_npu-npu_dynamic_quant.md
    功能说明: ``scale = rowMax(abs(x)) / 127``, ``y = round(x / scale)``, ``y`` int8; its input float16 or
    bfloat16 (参数说明 x), so a float32 row is first rounded to bfloat16; the scale is returned float32 (返回值
    说明) and ``x / scale`` taken in float32, where a bfloat16 value over it is often a half-integer exactly;
    rounding half to even; a row of zeros reads back zeros), read back in float32, in ``x``'s dtype."""
    y = x.to(torch.bfloat16).float() if x.dtype == torch.float32 else x.float()
    scale = (y.double().abs().amax(dim=-1, keepdim=True) / 127.0).float()
    codes = torch.round(y / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(-128, 127)
    return (codes * scale).to(x.dtype)


# the reference quantisation of each 8-bit --kv-cache-dtype (policy.EIGHT_BIT_CACHE_DTYPES)
ROUND_TRIPS = {"fp8": e4m3_round_trip, "fp8_e4m3": e4m3_round_trip, "int8_per_token_head": int8_round_trip}
# the served parity gates' record per format (GLM-DSA's and DeepSeek-V4's alike)
PARITY_GATES = {"fp8": "kv8_parity", "int8_per_token_head": "kv8_int8_parity"}


def served_on_the_npu_path(rec, model_dir, label: str, prompts: list, max_tokens: int, kwargs: dict, workdir):
    """The int8 gates' NPU-path run: ``prompts`` batched, then the last alone, served with the torch_npu CONTRACT
    EMULATOR as ``torch_npu`` in the engine's processes and the NPU kernel path on (``npu_emulator.served_env``;
    a contract check on CPU, not an NPU run). The command into ``rec`` (``label``: how it names the model) and
    a check that the cache writes took ``npu_dynamic_quant``. Returns the batches and that check."""
    from ascend_adapters.common.platform import EMULATOR_ENV
    from ascend_adapters.testing.engine_worker import engine_run
    from ascend_adapters.testing.npu_emulator import served_env

    kwargs = {**kwargs, "kv_cache_dtype": "int8_per_token_head"}
    env, called = served_env(workdir)
    batches = engine_run(model_dir, [prompts, [prompts[-1]]], max_tokens, kwargs, env)
    rec.command(
        f"vllm.LLM({label}, {kwargs}) with torch_npu = testing.npu_emulator and {EMULATOR_ENV}=1, greedy "
        f"{max_tokens} tokens: prompts of {tuple(len(p) for p in prompts)} tokens batched, the longest alone"
    )
    return batches, rec.check("the cache writes took npu_dynamic_quant", "npu_dynamic_quant" in called(), str(called()))


Reference = Callable[[list[int]], torch.Tensor]  # token ids -> logits [len(ids), V]


def judge(rec, label: str, batches: list[dict], kv8: Reference, plain: Reference, shared: int | None = None) -> bool:
    """Every generated step of ``batches`` (``testing.engine_worker.engine_run``'s: prompts batched, then the
    last of them alone, then, with ``shared``, a prompt repeating its first ``shared`` tokens) against the
    8-bit reference ``kv8`` within the module doc's bound, greedy tokens equal, ``D`` (``kv8`` against the
    float ``plain`` on the same token sequences) past its floor, the batched tokens the lone ones, and the
    shared prompt's hit all ``shared`` tokens; metrics and checks into ``rec``."""
    worst, quantisation, identical = 0.0, 0.0, True
    for batch in batches:
        for row in batch["rows"]:
            t, ids = len(row["prompt_ids"]), row["prompt_ids"] + row["gen_ids"][:-1]
            want = kv8(ids)
            quantisation = max(quantisation, float((want - plain(ids)).abs().max()))
            vocab = min(want.shape[-1], row["logits"].shape[-1])
            worst = max(worst, float((row["logits"][:, :vocab] - want[t - 1 :, :vocab]).abs().max()))
            identical &= row["gen_ids"] == want[t - 1 :, :vocab].argmax(-1).tolist()
    bound = max(TOL, quantisation / FLIP_SHARE)
    rec.metric(f"{label}_max_abs_diff_vs_8bit_reference", worst)
    rec.metric(f"{label}_quantisation_effect_D", quantisation)
    ok = rec.check(
        f"{label}: logits within max({TOL}, D / {FLIP_SHARE}) = {bound:.4g} of the 8-bit reference at every "
        "generated step",
        worst <= bound,
        worst,
    )
    ok &= rec.check(f"{label}: greedy tokens are the 8-bit reference's", identical)
    floor = 10 * max(worst, FLOAT_NOISE)
    ok &= rec.check(
        f"{label}: the quantisation moves the reference's logits by D > 10 x max(the served distance, "
        f"{FLOAT_NOISE}) = {floor:.3g} (the cache is read back as 8-bit rows)",
        quantisation > floor,
        quantisation,
    )
    same = batches[0]["rows"][-1]["gen_ids"] == batches[1]["rows"][0]["gen_ids"]
    ok &= rec.check(f"{label}: batched tokens equal the single-prompt tokens", same)
    if shared:
        cached = batches[2]["rows"][0]["num_cached_tokens"]
        rec.metric(f"{label}_shared_prompt_cached_tokens", cached)
        ok &= rec.check(f"{label}: the prompt sharing {shared} tokens hits them in the 8-bit cache", cached == shared)
    return ok
