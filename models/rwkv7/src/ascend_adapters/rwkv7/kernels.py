"""The WKV-7 recurrence: a plain reference, a batched token step and a chunked
parallel form for prompts.

Per head, with the state ``S`` of shape ``[N(value), N(key)]`` (float32)::

    S_t = S_{t-1} diag(w_t) + (S_{t-1} a_t) b_t^T + v_t k_t^T
    y_t = S_t r_t

where ``w`` is the per-key decay in (0, 1), ``a = -kk`` and ``b = kk * a_gate``
(RWKV-7's in-context learning rate). All three forms compute the same thing:

* ``wkv7_reference``: the loop above, token by token (checks the other two);
* ``wkv7_step``: one token for a batch of sequences, each with its own state
  (decode);
* ``wkv7_chunk``: the prompt form. Inside a chunk of ``L`` tokens the state
  dependence is solved in matrix form (a unit lower-triangular solve, the WY
  form of the product of ``diag(w) + a b^T`` transitions) for all chunks at
  once; only a ``[N, N]`` state update per chunk is sequential.

The step and chunk functions are kernel ops of ``ascend_adapters.common.dispatch``
(``rwkv7.wkv_step``, ``rwkv7.wkv_chunk``) so an NPU kernel can replace them.
"""

from __future__ import annotations

import torch

from ascend_adapters.common import dispatch

DEFAULT_CHUNK = 32


def wkv7_reference(r, w, k, v, a, b, state):
    """Plain recurrence for one sequence.

    r, w, k, v, a, b: ``[T, H, N]``; state: ``[H, N, N]`` float32 (value, key).
    Returns ``(y [T, H, N] float32, final state)``; the input state is not modified.
    """
    S = state.float().clone()
    r, w, k, v, a, b = (t.float() for t in (r, w, k, v, a, b))
    ys = []
    for t in range(r.shape[0]):
        sa = torch.einsum("hvk,hk->hv", S, a[t])
        S = S * w[t][:, None, :] + sa[:, :, None] * b[t][:, None, :] + v[t][:, :, None] * k[t][:, None, :]
        ys.append(torch.einsum("hvk,hk->hv", S, r[t]))
    return torch.stack(ys), S


@dispatch.portable("rwkv7.wkv_step")
def wkv7_step(r, w, k, v, a, b, state):
    """One token for each of B sequences.

    r, w, k, v, a, b: ``[B, H, N]``; state: ``[B, H, N, N]`` float32, updated in place.
    Returns ``y [B, H, N]`` float32.
    """
    r, w, k, v, a, b = (t.float() for t in (r, w, k, v, a, b))
    sa = torch.einsum("bhvk,bhk->bhv", state, a)
    state.mul_(w.unsqueeze(-2))
    state.add_(sa.unsqueeze(-1) * b.unsqueeze(-2))
    state.add_(v.unsqueeze(-1) * k.unsqueeze(-2))
    return torch.einsum("bhvk,bhk->bhv", state, r)


@dispatch.portable("rwkv7.wkv_chunk")
def wkv7_chunk(r, w, k, v, a, b, state, chunk_size: int = DEFAULT_CHUNK):
    """Chunked parallel form for one sequence (a prompt or a prompt chunk).

    r, w, k, v, a, b: ``[T, H, N]``; state: ``[H, N, N]`` float32, updated in place.
    Returns ``y [T, H, N]`` float32.
    """
    T, H, N = r.shape
    L = chunk_size
    n_chunks = (T + L - 1) // L
    pad = n_chunks * L - T
    r, w, k, v, a, b = (t.float() for t in (r, w, k, v, a, b))
    logw = torch.log(w)
    if pad:
        # identity transitions with no input: they change neither state nor outputs
        r, k, v, a, b, logw = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (r, k, v, a, b, logw))

    def chunks(t):  # [T, H, N] -> [C, H, L, N]
        return t.view(n_chunks, L, H, N).transpose(1, 2)

    r, k, v, a, b, logw = (chunks(t) for t in (r, k, v, a, b, logw))
    cl = logw.cumsum(dim=2)  # log of prod_{i<=t} w_i, [C, H, L, N]
    cl_prev = cl - logw  # prod_{i<t} w_i
    # With RWKV-7's decay (log w >= -exp(-0.5) per token) the factors exp(+-cl) stay within
    # exp(0.61 * L) inside a chunk, so the pairwise decay exp(cl_t - cl_s) can be split into
    # two scaled operands and every intra-chunk product becomes one batched matmul.
    idx = torch.arange(L, device=r.device)
    strict = idx[:, None] > idx[None, :]  # s < t
    incl = idx[:, None] >= idx[None, :]  # s <= t
    inv = torch.exp(-cl)
    b_in, k_in = b * inv, k * inv  # b_s / prod_{i<=s} w_i
    a_dec = a * torch.exp(cl_prev)  # a_t * prod_{i<t} w_i
    r_dec = r * torch.exp(cl)  # r_t * prod_{i<=t} w_i
    m_ab = (a_dec @ b_in.transpose(-1, -2)).masked_fill(~strict, 0.0)
    m_ak = (a_dec @ k_in.transpose(-1, -2)).masked_fill(~strict, 0.0)
    m_rb = (r_dec @ b_in.transpose(-1, -2)).masked_fill(~incl, 0.0)
    m_rk = (r_dec @ k_in.transpose(-1, -2)).masked_fill(~incl, 0.0)
    eye = torch.eye(L, device=r.device, dtype=r.dtype)
    # u_t = S_{t-1} a_t for all t of a chunk: (I - M_ab) U = A~ S0^T + M_ak V
    tri = eye - m_ab
    u_v = torch.linalg.solve_triangular(tri, m_ak @ v, upper=False, unitriangular=True)
    u_s = torch.linalg.solve_triangular(tri, a_dec, upper=False, unitriangular=True)
    # outputs: Y = Y_v + Y_s S0^T
    y_v = m_rb @ u_v + m_rk @ v
    y_s = r_dec + m_rb @ u_s
    # state after the chunk: S0 G + Hc
    last = cl[:, :, -1:, :]  # [C, H, 1, N]
    to_end = torch.exp(last - cl)  # decay from after s to the chunk end
    b_end, k_end = b * to_end, k * to_end
    g = torch.diag_embed(torch.exp(last.squeeze(2))) + u_s.transpose(-1, -2) @ b_end  # [C, H, N, N]
    h = u_v.transpose(-1, -2) @ b_end + v.transpose(-1, -2) @ k_end  # [C, H, N(v), N(k)]
    ys = torch.empty_like(y_v)
    S = state
    for c in range(n_chunks):
        ys[c] = y_v[c] + y_s[c] @ S.transpose(-1, -2)
        S.copy_(S @ g[c] + h[c])
    y = ys.transpose(1, 2).reshape(n_chunks * L, H, N)
    return y[:T]
