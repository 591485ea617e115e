"""The WKV-7 recurrence: a plain reference, a batched token step and a chunked
parallel form for prompts.

Per head, with the state ``S`` of shape ``[N(value), N(key)]`` (float32)::

    S_t = S_{t-1} diag(w_t) + (S_{t-1} a_t) b_t^T + v_t k_t^T
    y_t = S_t r_t

where ``w`` is the per-key decay in (0, 1), ``a = -kk`` and ``b = kk * a_gate``
(RWKV-7's in-context learning rate). All three forms compute the same thing:

* ``wkv7_reference``: the loop above, token by token (checks the other two;
  ``wkv7_reference_varlen`` runs it over each sequence of a flat batch);
* ``wkv7_step``: one token for a batch of sequences, each with its own state
  (decode);
* ``wkv7_chunk``: the prompt form, for a whole flat batch of sequences in one
  call (flash-linear-attention's ``cu_seqlens`` / ``initial_state`` /
  ``output_final_state`` signature). Inside a chunk of ``L`` tokens the state
  dependence is solved in matrix form (a unit lower-triangular solve, the WY
  form of the product of ``diag(w) + a b^T`` transitions) for all chunks of all
  sequences at once; only a ``[N, N]`` state update per chunk position is
  sequential, batched over the sequences.

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


def wkv7_reference_varlen(r, w, k, v, a, b, initial_state, cu_seqlens):
    """``wkv7_reference`` over each sequence of a flat batch (the reference for ``wkv7_chunk``)."""
    ys, finals = [], []
    bounds = [int(x) for x in cu_seqlens]
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        y, S = wkv7_reference(r[s:e], w[s:e], k[s:e], v[s:e], a[s:e], b[s:e], initial_state[i])
        ys.append(y)
        finals.append(S)
    return torch.cat(ys), torch.stack(finals)


@dispatch.portable("rwkv7.wkv_chunk")
def wkv7_chunk(
    r,
    w,
    k,
    v,
    a,
    b,
    initial_state=None,
    output_final_state: bool = True,
    cu_seqlens=None,
    chunk_size: int = DEFAULT_CHUNK,
):
    """Chunked parallel form for a flat batch of sequences (prompts or prompt chunks), in one call.

    The signature follows flash-linear-attention's ``chunk_rwkv7``: r, w, k, v, a, b are the
    sequences concatenated, ``[T, H, N]``; ``cu_seqlens`` ``[B + 1]`` holds each sequence's start
    offset (``None``: one sequence); ``initial_state`` ``[B, H, N, N]`` float32 (value, key; fla
    keeps key first) is each sequence's state before its tokens (``None``: zeros). ``w`` is the
    decay itself, not its log. Returns ``(y [T, H, N] float32, final state [B, H, N, N] or None)``;
    the inputs are not modified.

    Chunks never straddle two sequences: each sequence is padded to whole chunks (padding is the
    identity transition with no input), the intra-chunk algebra runs for every chunk of every
    sequence at once, and the sequential state pass walks chunk positions, advancing all
    sequences that have a chunk there together.
    """
    T, H, N = r.shape
    L = chunk_size
    dev = r.device
    if cu_seqlens is None:
        cu = [0, T]
    else:
        cu = [int(x) for x in cu_seqlens]
    B = len(cu) - 1
    lens = [cu[i + 1] - cu[i] for i in range(B)]
    n_chunks = [(n + L - 1) // L for n in lens]
    first_chunk = [0] * B
    for i in range(1, B):
        first_chunk[i] = first_chunk[i - 1] + n_chunks[i - 1]
    C = sum(n_chunks)
    S = torch.zeros(B, H, N, N, dtype=torch.float32, device=dev) if initial_state is None else initial_state.float()
    S = S.clone()
    if T == 0 or C == 0:
        return torch.zeros(T, H, N, dtype=torch.float32, device=dev), (S if output_final_state else None)
    # padded slot of every token: sequence i's token j sits at first_chunk[i] * L + j
    dest = torch.cat([torch.arange(lens[i], device=dev) + first_chunk[i] * L for i in range(B) if lens[i]])

    def chunked(t, fill=0.0):  # [T, H, N] -> [C, H, L, N]
        out = torch.full((C * L, H, N), fill, dtype=torch.float32, device=dev)
        out[dest] = t.float()
        return out.view(C, L, H, N).transpose(1, 2)

    # padding: identity transitions with no input (log w = 0, zero r/k/v/a/b): they change
    # neither the state nor any output
    r, k, v, a, b = (chunked(t) for t in (r, k, v, a, b))
    logw = chunked(torch.log(w.float()))
    cl = logw.cumsum(dim=2)  # log of prod_{i<=t} w_i, [C, H, L, N]
    cl_prev = cl - logw  # prod_{i<t} w_i
    # With RWKV-7's decay (log w >= -exp(-0.5) per token) the factors exp(+-cl) stay within
    # exp(0.61 * L) inside a chunk, so the pairwise decay exp(cl_t - cl_s) can be split into
    # two scaled operands and every intra-chunk product becomes one batched matmul.
    idx = torch.arange(L, device=dev)
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
    eye = torch.eye(L, device=dev, dtype=torch.float32)
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
    for j in range(max(n_chunks)):
        seqs = [i for i in range(B) if n_chunks[i] > j]
        ids = torch.tensor([first_chunk[i] + j for i in seqs], device=dev)
        if len(seqs) == B:
            s_now = S
        else:
            sel = torch.tensor(seqs, device=dev)
            s_now = S[sel]
        ys[ids] = y_v[ids] + y_s[ids] @ s_now.transpose(-1, -2)
        s_next = s_now @ g[ids] + h[ids]
        if len(seqs) == B:
            S = s_next
        else:
            S[sel] = s_next
    y = ys.transpose(1, 2).reshape(C * L, H, N)[dest]
    return y, (S if output_final_state else None)
