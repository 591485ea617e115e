"""A tiny RWKV-7 trained here, on text that ships with Python, so that the demo's answer reads as words.

    python -m ascend_adapters.rwkv7.train_tiny [--cache-dir DIR]     # trains once, prints the served folder

The corpus is the Zen of Python, the text of the standard library's ``this`` module (read from its source,
nothing imported). The model is the x070 architecture of real checkpoints, small (2 layers, 64 channels,
2 heads of 32), trained from scratch with a plain torch forward written here for training: the same math
as the official ``rwkv`` package's x070 model (checked against it by the tests), its WKV recurrence in a
parallel form over a window (``wkv``), so that a training step is a few dozen torch ops.
It is written in BlinkDL's ``.pth`` naming and converted by this adapter's own converter (``convert.py``),
so the folder served is what ``rwkv7-convert`` makes of a real checkpoint: World tokenizer, 65536 ids.

Only the corpus's own token ids are trained (a softmax over them, not over 65536 ids): the other ids keep a
zero embedding and a logit of ``UNUSED_LOGIT``, carried by one channel of the final layer norm held at a
constant 1 (weight 0, bias 1) with the head's column for that channel as a per-token bias. Served, the
model can then only answer with the corpus's tokens, and trained until greedy decoding reproduces the
corpus from a fresh state at every line start (as far as the words so far decide it: three lines begin
"Although"), it answers with the corpus's words.

The trained folder is cached (``default_cache_dir()``: ``$XDG_CACHE_HOME/ascend-adapters/demo``, else
``~/.cache/ascend-adapters/demo``), one subfolder per corpus and recipe; a second run reuses it at once.
Removing the folder removes every checkpoint the demo made.
"""

from __future__ import annotations

import argparse
import ast
import codecs
import contextlib
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ascend_adapters.rwkv7.tiny import WORLD_VOCAB, write_pth

# The recipe: changing a field, or RECIPE_VERSION (bump it when the code below changes what is trained), trains
# into a new cache folder.
RECIPE_VERSION = 1
SHAPE = {"n_layer": 2, "n_embd": 64, "head_size": 32, "ffn": 256, "ranks": {"w": 16, "a": 16, "v": 8, "g": 16}}
TRAIN = {"seed": 0, "window": 64, "lr": 4e-3, "lr_min": 4e-4, "max_steps": 600, "clip": 1.0}
# Training stops once every target that a window's tokens so far decide is the argmax, by this margin in
# log-probability, for CHECKS_IN_A_ROW steps in a row (or at max_steps / the time budget: then nothing is cached).
MARGIN = 4.0
CHECKS_IN_A_ROW = 3
# The logit of every id the corpus does not use (the served softmax gives them ~1e-9 of mass in all).
UNUSED_LOGIT = -30.0
# The time budget on a small CPU machine (issue #48: at most 2 minutes); training stops there, trained or not.
MAX_SECONDS = 110.0
CORPUS_NAME = "the Zen of Python (the standard library's `this` module)"
MAX_WINDOW = 128  # positions trained at once (wkv)
GROUP_NORM_EPS = 64e-5  # the rwkv package's ln_x epsilon (convert.py writes norm_eps = 64e-5 / head_size)
LAYER_NORM_EPS = 1e-5


class TrainError(RuntimeError):
    """The corpus, the cache folder or the training run is not usable; the message says which and why."""


def corpus() -> str:
    """The Zen of Python, decoded from the ``this`` module's source (importing it would print it)."""
    spec = importlib.util.find_spec("this")
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        raise TrainError("the standard library's `this` module (the Zen of Python) is not readable here")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "s":
            return codecs.decode(ast.literal_eval(node.value), "rot_13")
    raise TrainError(f"{spec.origin}: no `s = ...` text found (not the Zen of Python this module expects)")


WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")


def words(text: str) -> list[str]:
    """The words of ``text``, lower-cased (letters, with an inner apostrophe: ``aren't``)."""
    return [w.lower() for w in WORD.findall(text)]


def corpus_words() -> set[str]:
    return set(words(corpus()))


def outside_words(answer: str, *, truncated: bool = False) -> list[str]:
    """The words of ``answer`` that are not the corpus's. ``truncated``: the answer was cut by a token limit,
    so a last word that runs to its very end need only begin a corpus word ("Read" of "Readability")."""
    known = corpus_words()
    found = words(answer)
    if truncated and found and WORD.search(answer[-1]) and any(w.startswith(found[-1]) for w in known):
        found = found[:-1]
    return [w for w in found if w not in known]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ascend-adapters" / "demo"


def recipe_key(text: str) -> str:
    blob = json.dumps({"v": RECIPE_VERSION, "shape": SHAPE, "train": TRAIN, "margin": MARGIN, "text": text})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def trained_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the trained, converted checkpoint is (or will be) kept."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / f"rwkv7-zen-{recipe_key(corpus())}"


def _tokenizer():
    from ascend_adapters.rwkv7.tokenizer import RwkvWorldTokenizer, rwkv_package_vocab

    return RwkvWorldTokenizer(vocab_file=str(rwkv_package_vocab()))


# -- the model: RWKV-7 x070 in plain torch, differentiable ------------------------------------------------


def init_params(vocab: int, *, seed: int = 0, shape: dict | None = None) -> dict:
    """Trainable tensors in BlinkDL x070 naming and shapes, ``vocab`` rows in ``emb`` and ``head``."""
    import torch

    s = {**SHAPE, **(shape or {})}
    g = torch.Generator().manual_seed(seed)
    c, n = s["n_embd"], s["head_size"]
    h, ffn, r = c // n, s["ffn"], s["ranks"]

    def rnd(*dims, std):
        return torch.randn(*dims, generator=g) * std

    ramp = torch.linspace(0, 1, c).view(1, 1, c)
    p = {
        "emb.weight": rnd(vocab, c, std=1.0),
        "blocks.0.ln0.weight": torch.ones(c),
        "blocks.0.ln0.bias": torch.zeros(c),
        "ln_out.weight": torch.ones(c),
        "ln_out.bias": torch.zeros(c),
        "head.weight": rnd(vocab, c, std=0.5 * c**-0.5),
    }
    for i in range(s["n_layer"]):
        q = f"blocks.{i}."
        for ln in ("ln1", "ln2"):
            p[q + ln + ".weight"], p[q + ln + ".bias"] = torch.ones(c), torch.zeros(c)
        for x in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            p[q + "att." + x] = 0.2 + 0.6 * torch.rand(1, 1, c, generator=g)
        p[q + "att.w0"] = -5.0 + 7.0 * ramp  # slow to fast decay across channels
        p[q + "att.w1"], p[q + "att.w2"] = rnd(c, r["w"], std=0.1), torch.zeros(r["w"], c)
        p[q + "att.a0"] = torch.zeros(1, 1, c)
        p[q + "att.a1"], p[q + "att.a2"] = rnd(c, r["a"], std=0.1), torch.zeros(r["a"], c)
        if i > 0:
            p[q + "att.v0"] = torch.ones(1, 1, c)
            p[q + "att.v1"], p[q + "att.v2"] = rnd(c, r["v"], std=0.1), torch.zeros(r["v"], c)
        p[q + "att.g1"], p[q + "att.g2"] = rnd(c, r["g"], std=0.1), rnd(r["g"], c, std=0.1)
        p[q + "att.k_k"] = torch.full((1, 1, c), 0.85)
        p[q + "att.k_a"] = torch.ones(1, 1, c)
        p[q + "att.r_k"] = rnd(h, n, std=0.1)
        for proj in ("receptance", "key", "value"):
            p[q + f"att.{proj}.weight"] = rnd(c, c, std=c**-0.5)
        p[q + "att.output.weight"] = rnd(c, c, std=0.1 * c**-0.5)
        p[q + "att.ln_x.weight"], p[q + "att.ln_x.bias"] = torch.ones(c), torch.zeros(c)
        p[q + "ffn.x_k"] = 0.2 + 0.6 * torch.rand(1, 1, c, generator=g)
        p[q + "ffn.key.weight"] = rnd(ffn, c, std=c**-0.5)
        p[q + "ffn.value.weight"] = rnd(c, ffn, std=0.1 * ffn**-0.5)
    return p


def wkv(r, log_w, k, v, alpha, beta):
    """RWKV-7's WKV from a zero state, every position at once (tensors ``(batch, heads, time, head_size)``,
    at most ``MAX_WINDOW`` positions).

    The recurrence (the ``rwkv`` package's, state ``S`` indexed [value, key]) is
    ``S_t = S_{t-1} (diag(w_t) + alpha_t beta_t^T) + v_t k_t^T`` and ``o_t = S_t r_t``. With
    ``u_t = S_{t-1} alpha_t`` and ``D(s, t) = diag(w_{s+1} ... w_t)`` it unrolls to
    ``S_t = sum_{s<=t} (u_s beta_s^T + v_s k_s^T) D(s, t)``, so ``U = M_ab U + M_ak V`` with
    ``M_xy[t, s] = x_t . D(s, t-1) y_s`` (s < t), a unit lower triangular solve, and
    ``O = Q_rb U + Q_rk V`` with ``Q_xy[t, s] = x_t . D(s, t) y_s`` (s <= t). ``D(s, t)`` splits as
    ``exp(L_t - m) exp(m - L_s)`` (``L``: cumulative log-decay, ``m`` its value mid-window), so each
    matrix is one matmul; a decay is at least exp(-exp(-0.5)) per token, so over ``MAX_WINDOW`` tokens
    every factor stays well inside float32's range.
    """
    import torch

    t = r.shape[2]
    if t > MAX_WINDOW:
        raise ValueError(f"wkv: {t} positions; at most {MAX_WINDOW} at once (float32 range of the decays)")
    cum = log_w.cumsum(2)
    mid = cum[:, :, t // 2 : t // 2 + 1]
    upto_t, upto_t1, since_s = torch.exp(cum - mid), torch.exp(cum - log_w - mid), torch.exp(mid - cum)
    lower = torch.ones(t, t, dtype=r.dtype, device=r.device).tril()
    strict = lower.tril(-1)

    def mix(x, decay, y, mask):
        return ((x * decay) @ (y * since_s).transpose(-1, -2)) * mask

    m_ab, m_ak = mix(alpha, upto_t1, beta, strict), mix(alpha, upto_t1, k, strict)
    u = torch.linalg.solve_triangular(torch.eye(t) - m_ab, m_ak @ v, upper=False, unitriangular=True)
    return mix(r, upto_t, beta, lower) @ u + mix(r, upto_t, k, lower) @ v


def _shift(x):
    """x[t-1] along time (zeros before the first token: a fresh state)."""
    import torch.nn.functional as F

    return F.pad(x, (0, 0, 1, -1))


def _time_mix(p, q: str, x, v_first, layer: int, h: int, n: int):
    import torch
    import torch.nn.functional as F

    b, t, c = x.shape
    xx = _shift(x) - x
    xr, xw, xk, xv, xa, xg = (x + xx * p[q + name] for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
    r = F.linear(xr, p[q + "receptance.weight"])
    w = torch.tanh(xw @ p[q + "w1"]) @ p[q + "w2"]
    k = F.linear(xk, p[q + "key.weight"])
    v = F.linear(xv, p[q + "value.weight"])
    a = torch.sigmoid(p[q + "a0"] + (xa @ p[q + "a1"]) @ p[q + "a2"])
    g = torch.sigmoid(xg @ p[q + "g1"]) @ p[q + "g2"]
    kk = F.normalize((k * p[q + "k_k"]).view(b, t, h, n), dim=-1, p=2.0).view(b, t, c)
    k = k * (1 + (a - 1) * p[q + "k_a"])
    if layer == 0:
        v_first = v
    else:
        v = v + (v_first - v) * torch.sigmoid(p[q + "v0"] + (xv @ p[q + "v1"]) @ p[q + "v2"])
    log_w = -math.exp(-0.5) * torch.sigmoid(p[q + "w0"] + w)  # log of the decay w = exp(-e^-0.5 sigmoid(.))

    def heads(z):
        return z.view(b, t, h, n).transpose(1, 2)

    out = wkv(heads(r), heads(log_w), heads(k), heads(v), heads(-kk), heads(kk * a))
    out = out.transpose(1, 2).reshape(b, t, c)
    out = F.group_norm(out.reshape(b * t, c), h, p[q + "ln_x.weight"], p[q + "ln_x.bias"], eps=GROUP_NORM_EPS)
    out = out.view(b, t, c)
    bonus = (r * k * p[q + "r_k"].reshape(c)).view(b, t, h, n).sum(-1, keepdim=True) * v.view(b, t, h, n)
    out = out + bonus.view(b, t, c)
    return F.linear(out * g, p[q + "output.weight"]), v_first


def _channel_mix(p, q: str, x):
    import torch
    import torch.nn.functional as F

    k = x + (_shift(x) - x) * p[q + "x_k"]
    return F.linear(torch.relu(F.linear(k, p[q + "key.weight"])) ** 2, p[q + "value.weight"])


def forward(p: dict, ids, *, head_size: int | None = None, const_channel: bool = False):
    """Logits of every position of ``ids`` (batch, time), from a fresh state. ``p``: tensors in BlinkDL
    naming (as ``init_params`` or a ``.pth`` holds them). ``const_channel``: the last channel of the final
    layer norm is held at 1 (weight 0, bias 1), as the exported checkpoint holds it."""
    import torch.nn.functional as F

    c = p["emb.weight"].shape[1]
    n = head_size or p["blocks.0.att.r_k"].shape[1]
    h = c // n
    n_layer = 1 + max(int(k.split(".")[1]) for k in p if k.startswith("blocks."))
    x = F.layer_norm(p["emb.weight"][ids], (c,), p["blocks.0.ln0.weight"], p["blocks.0.ln0.bias"], LAYER_NORM_EPS)
    v_first = None
    for i in range(n_layer):
        q = f"blocks.{i}."
        xx = F.layer_norm(x, (c,), p[q + "ln1.weight"], p[q + "ln1.bias"], LAYER_NORM_EPS)
        att, v_first = _time_mix(p, q + "att.", xx, v_first, i, h, n)
        x = x + att
        xx = F.layer_norm(x, (c,), p[q + "ln2.weight"], p[q + "ln2.bias"], LAYER_NORM_EPS)
        x = x + _channel_mix(p, q + "ffn.", xx)
    w, b = p["ln_out.weight"], p["ln_out.bias"]
    if const_channel:
        keep = w.new_ones(c)
        keep[-1] = 0
        w, b = w * keep, b * keep + (1 - keep)
    return F.linear(F.layer_norm(x, (c,), w, b, LAYER_NORM_EPS), p["head.weight"])


# -- data, training, export -------------------------------------------------------------------------------


def windows(ids: list[int], ends_line: list[bool], window: int):
    """(inputs, targets, mask, decided) tensors: one window per line start (a fresh state there, as a served
    prompt starts), ``window`` tokens long, padded at the corpus's end (mask 0). ``decided``: the targets
    that the window's tokens so far determine (the first words of "Although ..." lines do not)."""
    import torch

    starts = [0] + [i + 1 for i in range(len(ids) - 1) if ends_line[i]]
    seqs = [ids[s : s + window + 1] for s in starts]
    seqs = [q for q in seqs if len(q) > 1]
    nexts: dict[tuple, set] = {}
    for q in seqs:
        for i in range(1, len(q)):
            nexts.setdefault(tuple(q[:i]), set()).add(q[i])
    rows, tgts, mask, decided = [], [], [], []
    for q in seqs:
        m, pad = len(q) - 1, window - (len(q) - 1)
        rows.append(q[:-1] + [0] * pad)
        tgts.append(q[1:] + [0] * pad)
        mask.append([1.0] * m + [0.0] * pad)
        decided.append([len(nexts[tuple(q[:i])]) == 1 for i in range(1, m + 1)] + [False] * pad)
    return torch.tensor(rows), torch.tensor(tgts), torch.tensor(mask), torch.tensor(decided)


def train(text: str, *, log=print, max_seconds: float = MAX_SECONDS) -> tuple[dict, dict]:
    """Train on ``text``; returns (the full-vocabulary BlinkDL state dict, a report)."""
    if not text.strip():
        raise TrainError("the corpus is empty: nothing to train on")
    with one_torch_thread():
        return _train(text, log=log, max_seconds=max_seconds)


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread inside the block: this model's tensors are small, and a second thread that
    waits for a busy core makes every op many times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _train(text: str, *, log, max_seconds: float) -> tuple[dict, dict]:
    import torch

    tok = _tokenizer()
    ids = tok.encode_bytes(text.encode("utf-8")) + [0]  # ends with end-of-text (id 0)
    used = sorted(set(ids))
    local = {t: i for i, t in enumerate(used)}
    ends_line = [tok.idx2bytes.get(t, b"").endswith(b"\n") for t in ids]
    x, y, mask, decided = windows([local[t] for t in ids], ends_line, TRAIN["window"])
    torch.manual_seed(TRAIN["seed"])
    params = {k: v.requires_grad_(True) for k, v in init_params(len(used), seed=TRAIN["seed"]).items()}
    opt = torch.optim.Adam(params.values(), lr=TRAIN["lr"], betas=(0.9, 0.99))
    steps, n_tok = TRAIN["max_steps"], int(mask.sum())
    log(
        f"training a tiny RWKV-7 ({SHAPE['n_layer']} layers, {SHAPE['n_embd']} channels) on {CORPUS_NAME}: "
        f"{len(ids)} tokens, {len(used)} distinct, {x.shape[0]} windows of {TRAIN['window']}; until greedy "
        f"decoding reproduces it (about 60 steps, under 20 s on 2 CPU cores; at most {steps} or {max_seconds:.0f} s)"
    )
    t0 = last_log = time.monotonic()
    in_row, status, loss_v, acc = 0, "max_steps", float("nan"), 0.0
    for step in range(1, steps + 1):
        lr = TRAIN["lr_min"] + 0.5 * (TRAIN["lr"] - TRAIN["lr_min"]) * (1 + math.cos(math.pi * (step - 1) / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        logp = torch.log_softmax(forward(params, x, head_size=SHAPE["head_size"], const_channel=True), dim=-1)
        tgt = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        loss = -(tgt * mask).sum() / n_tok
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), TRAIN["clip"])
        opt.step()
        with torch.no_grad():
            other = logp.masked_fill(torch.nn.functional.one_hot(y, len(used)).bool(), -math.inf).amax(-1)
            ok = ((tgt - other) > MARGIN)[decided]
            acc, loss_v = float(ok.float().mean()), float(loss.detach())
        in_row = in_row + 1 if bool(ok.all()) else 0
        elapsed = time.monotonic() - t0
        if in_row >= CHECKS_IN_A_ROW:
            status = "reproduces the corpus"
            break
        if elapsed > max_seconds:
            status = "time budget reached"
            break
        if time.monotonic() - last_log >= 10:
            last_log = time.monotonic()
            left = min(max_seconds - elapsed, elapsed / step * (steps - step))
            log(
                f"  step {step}/{steps}: loss {loss_v:.3f}, {acc:.1%} of tokens predicted; {elapsed:.0f} s, "
                f"at most {left:.0f} s more"
            )
    elapsed = time.monotonic() - t0
    report = {
        "corpus": CORPUS_NAME,
        "tokens": len(ids),
        "distinct_tokens": len(used),
        "steps": step,
        "seconds": round(elapsed, 1),
        "final_loss": round(loss_v, 4),
        "tokens_predicted": round(acc, 4),
        "stopped": status,
        "shape": SHAPE,
        "train": TRAIN,
        "recipe_version": RECIPE_VERSION,
    }
    log(f"  trained in {elapsed:.0f} s, {step} steps: loss {loss_v:.3f}, {acc:.1%} of tokens predicted ({status})")
    return export(params, used), report


def export(params: dict, used: list[int], vocab: int = WORLD_VOCAB) -> dict:
    """The trained tensors as a full-vocabulary BlinkDL state dict: unused ids get a zero embedding and the
    logit UNUSED_LOGIT (through the constant last channel of the final layer norm)."""
    import torch

    sd = {k: v.detach().clone().float().contiguous() for k, v in params.items()}
    c = sd["emb.weight"].shape[1]
    idx = torch.tensor(used)
    emb, head = torch.zeros(vocab, c), torch.zeros(vocab, c)
    head[:, -1] = UNUSED_LOGIT
    emb[idx], head[idx] = sd["emb.weight"], sd["head.weight"]
    sd["emb.weight"], sd["head.weight"] = emb, head
    sd["ln_out.weight"][-1], sd["ln_out.bias"][-1] = 0.0, 1.0
    return sd


def make_trained(cache_dir: str | os.PathLike | None = None, *, log=print, max_seconds: float = MAX_SECONDS) -> Path:
    """The trained tiny RWKV-7, converted for ``vllm serve``: reused from the cache, else trained (seconds on
    2 CPU cores) and cached; a run that does not reproduce the corpus is an error, nothing cached. Returns the
    folder; ``train.json`` in it is the training report."""
    from ascend_adapters.rwkv7.convert import convert

    out = trained_dir(cache_dir)
    if (out / "train.json").is_file() and (out / "config.json").is_file():
        log(f"reusing the trained checkpoint {out}")
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    except OSError as exc:
        raise TrainError(f"cannot write the demo's checkpoint cache {out.parent}: {exc}") from exc
    try:
        sd, report = train(corpus(), log=log, max_seconds=max_seconds)
        if report["stopped"] != "reproduces the corpus":
            raise TrainError(
                f"training stopped ({report['stopped']}, {report['steps']} steps, {report['seconds']} s) before "
                f"greedy decoding reproduced the corpus ({report['tokens_predicted']:.1%} of its tokens); nothing "
                "was cached. It takes about 60 steps: is the machine very busy?"
            )
        pth = write_pth(tmp / "src" / "rwkv7-zen.pth", sd)
        convert(pth, tmp / "model", overwrite=True, log=lambda *_: None)
        shutil.rmtree(tmp / "src")
        (tmp / "model" / "train.json").write_text(json.dumps(report, indent=2) + "\n")
        try:
            (tmp / "model").rename(out)  # atomic: a reader sees the whole folder or none
        except OSError:
            if not (out / "train.json").is_file():  # not another process's finished copy: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", type=Path, default=None, help=f"default: {default_cache_dir()}")
    args = ap.parse_args(argv)
    try:
        out = make_trained(args.cache_dir)
    except TrainError as exc:
        print(f"train_tiny: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
