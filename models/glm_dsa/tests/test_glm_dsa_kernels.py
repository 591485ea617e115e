"""The latent-space (absorbed) attention kernels against the re-expanding form, at GLM-5's real head
dimensions (kv_lora_rank 512, qk_nope 192 + rope 64, v 256; random weights, a few heads), and the
batched decode layout against one request at a time. No vLLM: the served tests check the whole model
against transformers."""

from __future__ import annotations

import torch

from ascend_adapters.common import dispatch
from ascend_adapters.glm_dsa import kernels
from ascend_adapters.glm_dsa.backend import context_slots
from ascend_adapters.testing.mla_reference import mla_reference

R, NOPE, P, V = 512, 192, 64, 256  # GLM-5 (docs/references.md#glm5-shape)


def _case(h=4, length=300, t=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(length, R + P, generator=g, dtype=dtype)
    w_kv_b = torch.randn(h * (NOPE + V), R, generator=g, dtype=dtype) * R**-0.5
    q = torch.randn(t, h, NOPE + P, generator=g, dtype=dtype)
    return rows, w_kv_b, q


def _absorbed(q, rows, w_kv_b, mask, scale):
    h = q.shape[1]
    w_uk_t, w_uv = kernels.absorb_kv_b(w_kv_b, h, NOPE, V)
    q_lat = kernels.absorb_query(q[..., :NOPE], w_uk_t)
    out = dispatch.op("glm_dsa.latent_attention")(q_lat[None], q[None, ..., NOPE:], rows[None], mask[None], scale)[0]
    return kernels.expand_output(out, w_uv)


def test_absorbed_equals_reexpanded():
    rows, w_kv_b, q = _case(dtype=torch.float32)
    length, t = rows.shape[0], q.shape[0]
    g = torch.Generator().manual_seed(3)
    causal = torch.arange(length)[None, :] <= torch.arange(length - t, length)[:, None]
    sparse = causal & (torch.rand(t, length, generator=g) < 0.3)  # a selection: some rows only
    scale = (NOPE + P) ** -0.5
    for mask in (causal, sparse):
        ref = mla_reference(q, rows, w_kv_b, mask, scale, NOPE, V)
        got = _absorbed(q, rows, w_kv_b, mask, scale)
        # Same sums in another order (q.(W_UK kv_c) == (q W_UK).kv_c), both computed in float32. Scores of
        # magnitude ~|q||k| ~ 3e1 over 512-term sums carry ~3e1 * 2**-24 * sqrt(512) ~ 4e-5 absolute error;
        # scaled by 0.06 that is ~3e-6 in the exponent, i.e. ~3e-6 relative on outputs of magnitude ~0.1:
        # bound 1e-5 absolute.
        assert float((got - ref).abs().max()) < 1e-5


def test_masked_rows_do_not_matter():
    """A row outside the mask cannot change the output (what lets the sparse path read only the selection)."""
    rows, w_kv_b, q = _case(dtype=torch.float32, length=64, t=1)
    mask = torch.zeros(1, 64, dtype=torch.bool)
    mask[0, ::3] = True
    a = _absorbed(q, rows, w_kv_b, mask, 0.1)
    rows2 = rows.clone()
    rows2[~mask[0]] = 1e3
    b = _absorbed(q, rows2, w_kv_b, mask, 0.1)
    gathered = _absorbed(q, rows[mask[0]], w_kv_b, torch.ones(1, int(mask.sum()), dtype=torch.bool), 0.1)
    assert torch.equal(a, b)
    assert float((a - gathered).abs().max()) < 1e-5  # float32: same terms, different softmax length


def test_batched_decodes_equal_single_requests():
    """Paged cache, three requests of different lengths decoded together == each one alone."""
    g = torch.Generator().manual_seed(5)
    block, nblocks, h = 16, 40, 2
    cache = torch.randn(nblocks, block, R + P, generator=g)
    lengths = torch.tensor([5, 37, 100])
    perm = torch.randperm(nblocks, generator=g)
    table = torch.stack([perm[0:8], perm[8:16], perm[16:24]])
    slots, valid = context_slots(table, lengths, int(lengths.max()), block)
    _, w_kv_b, q = _case(h=h, t=3, dtype=torch.float32)
    w_uk_t, _ = kernels.absorb_kv_b(w_kv_b, h, NOPE, V)
    q_lat = kernels.absorb_query(q[..., :NOPE], w_uk_t)
    rows = dispatch.op("glm_dsa.cache_rows")(cache, slots)
    batched = dispatch.op("glm_dsa.latent_attention")(q_lat[:, None], q[:, None, :, NOPE:], rows, valid[:, None], 0.1)
    for i, n in enumerate(lengths.tolist()):
        ctx = dispatch.op("glm_dsa.cache_gather")(cache, table[i], n)
        one = dispatch.op("glm_dsa.latent_attention")(
            q_lat[None, i : i + 1], q[None, i : i + 1, :, NOPE:], ctx[None], torch.ones(1, 1, n, dtype=torch.bool), 0.1
        )
        assert torch.equal(rows[i, :n], ctx)
        # padding rows are masked out; the softmax over the same terms may round differently in the last bit
        assert float((batched[i, 0] - one[0, 0]).abs().max()) < 1e-6


def test_indexer_topk_matches_transformers_rule():
    """Top-k among causal keys; a query with fewer causal keys than k keeps all of them (-1 beyond)."""
    g = torch.Generator().manual_seed(7)
    length, hi, d, k = 20, 16, 32, 8
    q = torch.randn(1, length, hi, d, generator=g)
    keys = torch.randn(1, length, d, generator=g)
    w = torch.randn(1, length, hi, generator=g)
    causal = torch.arange(length)[None, :] <= torch.arange(length)[:, None]
    top = dispatch.op("glm_dsa.indexer_topk")(q, w, keys, causal[None], k)[0]
    # transformers' GlmMoeDsaIndexer: relu(q.k) summed with head weights, -inf outside the causal mask, topk
    scores = torch.einsum("sh,shl->sl", w[0], torch.relu(torch.einsum("shd,ld->shl", q[0], keys[0])))
    scores = scores.masked_fill(~causal, float("-inf"))
    ref = scores.topk(k, dim=-1).indices
    for s in range(length):
        got = set(top[s][top[s] >= 0].tolist())
        want = set(ref[s].tolist()) & set(range(s + 1))
        assert got == want, s
