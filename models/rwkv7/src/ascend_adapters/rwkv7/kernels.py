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

NPU twins: torch_npu documents no op for either hot op of RWKV-7.
* WKV state update: ``npu_recurrent_gated_delta_rule`` / ``npu_chunk_gated_delta_rule`` take one
  scalar decay per head and token (npu_chunk_gated_delta_rule.md 功能说明: alpha_t in R) and remove
  along the written key (I - beta k k^T); RWKV-7 decays per key channel (diag(w_t)) with its own
  a, b vectors, so neither op computes it.
* Token shift (``model._token_shift``, the previous token's row per sequence): a row copy, no op.
"""

from __future__ import annotations

import torch

from ascend_adapters.common import dispatch

DEFAULT_CHUNK = 32
# chunks whose intra-chunk algebra runs in one batch (about 0.8 MB per operand at H = 12, N = 64)
_TILE_CHUNKS = 16


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
    cu_seqlens_cpu=None,
):
    """Chunked parallel form for a flat batch of sequences (prompts or prompt chunks), in one call.

    The signature follows flash-linear-attention's ``chunk_rwkv7``: r, w, k, v, a, b are the
    sequences concatenated, ``[T, H, N]``; ``cu_seqlens`` ``[B + 1]`` holds each sequence's start
    offset (``None``: one sequence), ``cu_seqlens_cpu`` the same on the host (fla's name; a sequence
    of ints reads nothing from a device), which the kernel plans its chunks from when given (else it
    reads ``cu_seqlens``); with both, the sequences' bounds on the device come from ``cu_seqlens`` (no
    copy from the host: a model passes both, once per step, to every layer); ``initial_state`` ``[B, H, N, N]`` float32 (value, key; fla
    keeps key first) is each sequence's state before its tokens (``None``: zeros). ``w`` is the
    decay itself, not its log. Returns ``(y [T, H, N] float32, final state [B, H, N, N] or None)``;
    the inputs are not modified.

    Chunks never straddle two sequences. The sequences advance together, chunk position by chunk
    position (longest first, so the ones still running are a leading slice); a group of positions
    is gathered for all of them at once, its intra-chunk algebra runs as batched matmuls, then the
    ``[N, N]`` state update steps through the group's positions. A sequence that has run out is
    fed identity transitions (w = 1, zero r/k/v/a/b), which change neither its state nor any
    output, and its padding rows are written to a spare output row (a fixed-shape scatter, no
    boolean-mask gather). Groups hold about ``_TILE_CHUNKS`` chunks so the working set stays in cache.
    """
    T, H, N = r.shape
    L = chunk_size
    dev = r.device
    bounds = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    cu = [0, T] if bounds is None else [int(x) for x in bounds]
    B = len(cu) - 1
    n_chunks = [(cu[i + 1] - cu[i] + L - 1) // L for i in range(B)]
    order = sorted(range(B), key=lambda i: -n_chunks[i])
    # the same order and bounds on the device: from ``cu_seqlens`` when given (no copy from the host; a
    # stable sort, like the host's), else copied once from the host plan
    if cu_seqlens is not None:
        cu_dev = cu_seqlens.to(device=dev, dtype=torch.long)
        order_dev = torch.argsort((cu_dev[1:] - cu_dev[:-1] + L - 1) // L, descending=True, stable=True)
    else:
        cu_dev = torch.tensor(cu, device=dev)
        order_dev = torch.tensor(order, device=dev)
    starts, ends = cu_dev[:-1][order_dev], cu_dev[1:][order_dev]
    S = torch.zeros(B, H, N, N, dtype=torch.float32, device=dev) if initial_state is None else initial_state.float()
    S = S[order_dev]  # a copy: the inputs are not modified
    y = torch.empty(T + 1, H, N, dtype=torch.float32, device=dev)  # row T: where padding positions go
    idx = torch.arange(L, device=dev)
    strict = idx[:, None] > idx[None, :]  # s < t
    incl = idx[:, None] >= idx[None, :]  # s <= t
    eye = torch.eye(L, device=dev, dtype=torch.float32)
    j0, total = 0, max(n_chunks, default=0)
    while j0 < total:
        n_seq = sum(1 for i in order if n_chunks[i] > j0)
        G = min(max(1, _TILE_CHUNKS // n_seq), total - j0)
        pos = starts[:n_seq, None] + j0 * L + torch.arange(G * L, device=dev)[None]  # [n_seq, G L]
        valid = pos < ends[:n_seq, None]
        pad = ~valid.view(n_seq, G, L, 1, 1)
        src = pos.clamp(max=T - 1)
        # [T, H, N] -> [n_seq, G, H, L, N]; padding: zero r/k/v/a/b and w = 1 (log w = 0)
        rc, kc, vc, ac, bc = (
            t[src].float().view(n_seq, G, L, H, N).masked_fill_(pad, 0.0).transpose(2, 3) for t in (r, k, v, a, b)
        )
        lw = torch.log(w[src].float().view(n_seq, G, L, H, N).masked_fill_(pad, 1.0)).transpose(2, 3)
        cl = lw.cumsum(dim=3)  # log of prod_{i<=t} w_i
        cl_prev = cl - lw  # prod_{i<t} w_i
        # With RWKV-7's decay (log w >= -exp(-0.5) per token) the factors exp(+-cl) stay within
        # exp(0.61 * L) inside a chunk, so the pairwise decay exp(cl_t - cl_s) can be split into
        # two scaled operands and every intra-chunk product becomes one batched matmul.
        inv = torch.exp(-cl)
        b_in, k_in = bc * inv, kc * inv  # b_s / prod_{i<=s} w_i
        a_dec = ac * torch.exp(cl_prev)  # a_t * prod_{i<t} w_i
        r_dec = rc * torch.exp(cl)  # r_t * prod_{i<=t} w_i
        m_ab = (a_dec @ b_in.transpose(-1, -2)).masked_fill_(~strict, 0.0)
        m_ak = (a_dec @ k_in.transpose(-1, -2)).masked_fill_(~strict, 0.0)
        m_rb = (r_dec @ b_in.transpose(-1, -2)).masked_fill_(~incl, 0.0)
        m_rk = (r_dec @ k_in.transpose(-1, -2)).masked_fill_(~incl, 0.0)
        # u_t = S_{t-1} a_t for all t of a chunk: (I - M_ab) U = A~ S0^T + M_ak V
        tri = eye - m_ab
        u_v = torch.linalg.solve_triangular(tri, m_ak @ vc, upper=False, unitriangular=True)
        u_s = torch.linalg.solve_triangular(tri, a_dec, upper=False, unitriangular=True)
        # outputs: Y = Y_v + Y_s S0^T
        y_v = m_rb @ u_v + m_rk @ vc
        y_s = r_dec + m_rb @ u_s
        # state after the chunk: S0 G + Hc
        last = cl[..., -1:, :]  # [n_seq, G, H, 1, N]
        to_end = torch.exp(last - cl)  # decay from after s to the chunk end
        b_end, k_end = bc * to_end, kc * to_end
        g = torch.diag_embed(torch.exp(last.squeeze(-2))) + u_s.transpose(-1, -2) @ b_end  # [n_seq, G, H, N, N]
        h = u_v.transpose(-1, -2) @ b_end + vc.transpose(-1, -2) @ k_end  # [n_seq, G, H, N(v), N(k)]
        ys = torch.empty_like(y_v)
        s_now = S[:n_seq]
        for c in range(G):
            ys[:, c] = y_v[:, c] + y_s[:, c] @ s_now.transpose(-1, -2)
            s_now = s_now @ g[:, c] + h[:, c]
        S[:n_seq] = s_now
        y[torch.where(valid, pos, T).view(-1)] = ys.transpose(2, 3).reshape(n_seq * G * L, H, N)
        j0 += G
    if not output_final_state:
        return y[:T], None
    final = torch.empty_like(S)
    final[order_dev] = S
    return y[:T], final
