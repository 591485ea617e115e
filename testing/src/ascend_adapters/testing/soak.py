"""Soak: one adapter's tiny checkpoint behind ``vllm serve`` under concurrent mixed traffic (issue #49, item 1).

``python -m ascend_adapters.testing.soak --model rwkv7 --minutes 10 --evidence-dir evidence`` (``nox -s soak``).

The server runs as a user deploys it: the OpenAI server, prefix caching on, the adapter's speculative method
where it combines with prefix caching (GLM-DSA and DeepSeek-V4: their own MTP layer; RWKV-7 refuses n-gram
drafts with prefix caching, see its policy), twice as many concurrent clients as ``--max-num-seqs``, so requests
queue (preemptions, where the KV cache runs short, are counted). Each client sends a bounded, seeded mix
(``traffic``):

* greedy completions from a fixed pool (``GREEDY_POOL`` requests): streaming or not, prompts of 1 token to
  several times the model's longest window, many sharing one of three prefixes, some with stop strings, some
  as chat messages. A pool entry is sent many times, in different batches and with and without prefix hits;
* sampled requests with ``n`` = 2 and a seed;
* streams the client hangs up on after two chunks;
* bad requests (an out-of-vocabulary id, a prompt over ``max_model_len``), which must get a 4xx.

After the run every greedy pool entry is served once more alone (one request in flight); every completed
greedy answer of the run must equal it token for token, unless the two first differ where the alone run's
two best tokens are within ``TIE_LOGPROB`` of each other (then the order of float32 reductions, which
differs with the batch, may pick either; counted and recorded). No answer may be a 5xx. RSS of every server
process is sampled; after warm-up it must grow by less than ``rss_bound_bytes`` (derivation there). vLLM's
own counters (prefix-cache queries and hits, preemptions, drafts proposed and accepted, requests by finish
reason) go into the record.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

MODELS = ("rwkv7", "glm_dsa", "deepseek_v4")
CLIENTS = 32
MAX_NUM_SEQS = 16
MAX_MODEL_LEN = 1024
GREEDY_POOL = 48
LONG_PREFIX = 400
CHAT_WORDS = 100  # a chat message's words at most: with the chat template it stays well inside MAX_MODEL_LEN
SAMPLE_EVERY_S = 2.0
# Two float32 runs of one request in different batches reduce in different orders: each logit moves by about
# k * 2**-24 * sum|terms| for a k-term sum. The tiny models' logits are O(10) and their sums run over a few
# hundred terms, so a logit moves by well under 1e-3; two candidate tokens closer than that may swap.
TIE_LOGPROB = 1e-3
# Warm-up: the first part of a run fills the prefix cache, the allocator's pools and vLLM's own caches.
WARMUP_FRACTION = 0.25
# RSS is checked on runs this long or longer: the workers' RSS settles over the first minutes (in the 10-minute
# records, DeepSeek-V4's worker rose from 1,371 MiB at 30 s to 1,434 MiB at 240 s and stayed there), so a
# shorter run's growth is still its warm-up; its RSS is recorded, the check is left to `nox -s soak`.
RSS_CHECK_MINUTES = 5.0


@dataclass
class ServedModel:
    name: str
    model_dir: Path
    serve_args: list[str]
    vocab_size: int
    longest_window: int
    window_what: str
    speculative: dict | None
    not_run: list[tuple[str, str]] = field(default_factory=list)


def make_checkpoint(name: str, out: Path, speculative: bool = True, eager: bool = False) -> ServedModel:
    """The adapter's tiny checkpoint with a tokenizer (stop strings and chat need one) and its serve flags."""
    args = [
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--enable-prefix-caching",
        *(["--enforce-eager"] if eager else []),
    ]  # fmt: skip
    not_run = []
    if name == "rwkv7":
        from ascend_adapters.rwkv7.tiny import make_tiny

        model_dir = make_tiny(out)
        spec = None
        window, what = 16, "vLLM's prefix-cache block (RWKV-7 keeps its state at block boundaries)"
        args += ["--block-size", "16", "--kv-cache-memory-bytes", "16M"]
        not_run.append(
            (
                "speculative decoding",
                "RWKV-7 refuses n-gram drafts with prefix caching (its policy: vLLM's 'align' mode moves accepted "
                "drafts' state rows for hybrid models only); the soak keeps prefix caching",
            )
        )
    elif name == "glm_dsa":
        from ascend_adapters.glm_dsa.tiny import make_tiny

        model_dir = make_tiny(out, tokenizer=True, mtp=True)
        spec = {"method": "mtp", "num_speculative_tokens": 1}
        cfg = json.loads((model_dir / "config.json").read_text())
        window, what = int(cfg["index_topk"]), "index_topk (the sparse attention's selected keys)"
        args += ["--kv-cache-memory-bytes", "8M"]
    elif name == "deepseek_v4":
        from ascend_adapters.deepseek_v4.tiny import make_tiny

        model_dir = make_tiny(out, mtp=True)
        spec = {"method": "mtp", "num_speculative_tokens": 1}
        cfg = json.loads((model_dir / "config.json").read_text())
        ratios = [int(r) for r in (cfg.get("compress_rates") or {}).values()]
        window = max([int(cfg["sliding_window"]), *ratios])
        what = "the sliding window and the compression windows"
        args += ["--kv-cache-memory-bytes", "32M"]
    else:
        raise SystemExit(f"soak: unknown model {name!r}; one of {', '.join(MODELS)}")
    if spec is not None and not speculative:
        not_run.append(("speculative decoding", "--no-speculative"))
        spec = None
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    return ServedModel(name, model_dir, args, vocab, window, what, spec, not_run)


# -- traffic -----------------------------------------------------------------------------------------------


def greedy_pool(served: ServedModel, seed: int) -> list[dict]:
    """``GREEDY_POOL`` greedy requests: prompt lengths from 1 token to several times the longest window, two
    thirds sharing one of three prefixes, some with stop strings, some as chat messages."""
    rng = random.Random(seed)
    ids = range(3, min(served.vocab_size, 512))
    w = served.longest_window
    # the longest shared prefix spans whole cache blocks past the last one a draft method drops (GLM-DSA's are 128
    # tokens; with MTP vLLM keeps a hit one block short), so its hits show in vLLM's counters
    prefixes = [[rng.choice(ids) for _ in range(n)] for n in (w // 2 + 1, 3 * w, max(12 * w, LONG_PREFIX))]
    longest = MAX_MODEL_LEN - 64
    pool = []
    for i in range(GREEDY_POOL):
        tail_len = rng.choice([1, rng.randint(2, w), rng.randint(w, 4 * w), rng.randint(4 * w, 20 * w)])
        prefix = rng.choice(prefixes) if rng.random() < 2 / 3 else []
        prompt = (prefix + [rng.choice(ids) for _ in range(tail_len)])[:longest]
        req = {"max_tokens": rng.choice([1, 4, 16, 40]), "temperature": 0.0, "logprobs": 2}
        if rng.random() < 0.25:
            req["stop"] = [rng.choice(["e", "a", " t", "s"])]
        if i % 8 == 7:
            req = {"kind": "chat", "messages": [{"role": "user", "content": f"item {i}: " + "word " * min(tail_len, CHAT_WORDS)}],
                   "max_tokens": req["max_tokens"], "temperature": 0.0, "logprobs": True, "top_logprobs": 2}  # fmt: skip
        else:
            req = {"kind": "completion", "prompt": prompt, **req}
        pool.append(req)
    return pool


@dataclass
class Outcome:
    kind: str
    status: int | None
    pool_index: int | None = None
    tokens: list | None = None
    finish: str | None = None
    error: str | None = None
    seconds: float = 0.0


def _sse_events(resp):
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            yield json.loads(data)


def _tokens_of(choice: dict, chat: bool) -> list[tuple[str, list[tuple[str, float]]]]:
    """(token, [(candidate, logprob), ...]) per generated position, from an OpenAI choice's logprobs."""
    lp = choice.get("logprobs") or {}
    if chat:
        return [
            (e["token"], [(c["token"], c["logprob"]) for c in e.get("top_logprobs") or []])
            for e in lp.get("content") or []
        ]
    tops = lp.get("top_logprobs") or []
    return [(t, sorted((top or {}).items(), key=lambda kv: -kv[1])) for t, top in zip(lp.get("tokens") or [], tops)]


class Client:
    def __init__(self, port: int, model: str, timeout: float = 600.0):
        self.port, self.model, self.timeout = port, model, timeout

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)

    def post(self, path: str, body: dict | bytes, *, stream: bool = False, hang_up_after: int | None = None):
        """(status, parsed body or list of stream events or error text)."""
        conn = self._conn()
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200 or not stream:
                text = resp.read().decode("utf-8", "replace")
                try:
                    return resp.status, json.loads(text)
                except json.JSONDecodeError:
                    return resp.status, text
            events = []
            for event in _sse_events(resp):
                events.append(event)
                if hang_up_after is not None and len(events) >= hang_up_after:
                    conn.sock.close()  # the client goes away mid-stream
                    return resp.status, events
            return resp.status, events
        finally:
            conn.close()

    def greedy(self, req: dict, stream: bool) -> tuple[int, list | None, str | None, str]:
        """(status, per-position tokens with candidates, finish reason, error text)."""
        chat = req["kind"] == "chat"
        body = {k: v for k, v in req.items() if k != "kind"} | {"model": self.model, "stream": stream}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        status, resp = self.post(path, body, stream=stream)
        if status != 200:
            return status, None, None, str(resp)[:300]
        if not stream:
            choice = resp["choices"][0]
            return status, _tokens_of(choice, chat), choice.get("finish_reason"), ""
        tokens, finish = [], None
        for event in resp:
            for choice in event.get("choices") or []:
                tokens += _tokens_of(choice, chat)
                finish = choice.get("finish_reason") or finish
        return status, tokens, finish, ""


# The share of each kind of request in a client's draws, in the order drawn.
MIX = {"greedy": 0.70, "sampled_n2": 0.12, "hang_up": 0.12, "bad": 0.06}


def traffic(client: Client, served: ServedModel, pool: list[dict], seed: int, deadline: float, out: list,
            mix: dict | None = None) -> None:  # fmt: skip
    """One client's loop until ``deadline``: a seeded draw of request kinds, one request at a time."""
    rng = random.Random(seed)
    shares = mix or MIX
    total = sum(shares.values())
    edges, acc = {}, 0.0
    for kind in MIX:
        acc += shares.get(kind, 0.0) / total
        edges[kind] = acc
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        draw = rng.random()
        try:
            if draw < edges["greedy"]:
                i = rng.randrange(len(pool))
                stream = rng.random() < 0.5
                status, tokens, finish, err = client.greedy(pool[i], stream)
                out.append(Outcome("greedy_stream" if stream else "greedy", status, i, tokens, finish, err or None))
            elif draw < edges["sampled_n2"]:
                prompt = [rng.randrange(3, min(served.vocab_size, 512)) for _ in range(rng.randint(1, 200))]
                body = {"model": client.model, "prompt": prompt, "max_tokens": rng.randint(1, 24), "n": 2,
                        "temperature": 0.8, "seed": rng.randrange(2**31)}  # fmt: skip
                status, resp = client.post("/v1/completions", body)
                ok = status == 200 and len(resp.get("choices", [])) == 2
                out.append(Outcome("sampled_n2", status, error=None if ok else str(resp)[:300]))
            elif draw < edges["hang_up"]:
                i = rng.randrange(len(pool))
                req = pool[i]
                path = "/v1/chat/completions" if req["kind"] == "chat" else "/v1/completions"
                body = {k: v for k, v in req.items() if k != "kind"} | {
                    "model": client.model,
                    "stream": True,
                    "max_tokens": 40,
                    "stop": None,
                }
                status, _ = client.post(path, body, stream=True, hang_up_after=2)
                out.append(Outcome("hang_up", status))
            else:
                if rng.random() < 0.5:
                    prompt, what = [1, served.vocab_size + rng.randrange(1000)], "out_of_vocab"
                else:
                    prompt, what = [5] * (MAX_MODEL_LEN + rng.randint(1, 100)), "over_max_model_len"
                status, resp = client.post(
                    "/v1/completions", {"model": client.model, "prompt": prompt, "max_tokens": 2}
                )
                out.append(Outcome(f"bad_{what}", status, error=None if 400 <= status < 500 else str(resp)[:300]))
        except Exception as exc:  # a dropped connection or a timeout is an outcome, not a crash of the client
            out.append(Outcome("transport", None, error=f"{type(exc).__name__}: {exc}"[:300]))
        out[-1].seconds = time.monotonic() - t0


# -- measurements ---------------------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


class RssSampler(threading.Thread):
    def __init__(self, pgid: int):
        super().__init__(daemon=True)
        self.pgid, self.samples, self.names, self.stop_event = pgid, [], {}, threading.Event()

    def run(self) -> None:
        from ascend_adapters.common.server import group_members

        t0 = time.monotonic()
        while not self.stop_event.is_set():
            now = time.monotonic() - t0
            for pid in group_members(self.pgid):
                rss = rss_bytes(pid)
                if pid not in self.names:
                    self.names[pid] = process_name(pid)
                if rss is not None:
                    self.samples.append((now, pid, rss))
            self.stop_event.wait(SAMPLE_EVERY_S)


def samples_by_pid(samples: list, from_s: float = 0.0) -> dict[int, list]:
    """The (seconds, bytes) samples of each process, those at ``from_s`` or later."""
    by_pid: dict[int, list] = {}
    for t, pid, rss in samples:
        if t >= from_s:
            by_pid.setdefault(pid, []).append((t, rss))
    return by_pid


def rss_series_mib(samples: list, points: int = 20) -> dict[int, list]:
    """Per process, about ``points`` (seconds, MiB) pairs spread over the run: the record's view of any creep."""
    out = {}
    for pid, series in samples_by_pid(samples).items():
        rounded = [(round(t), round(rss / 2**20, 1)) for t, rss in series]
        out[pid] = rounded[:: max(1, len(rounded) // points)] + rounded[-1:]
    return out


def rss_growth(samples: list, warm_from_s: float, end_s: float) -> dict[int, dict]:
    """Per process: the median RSS of the first and of the last minute-or-tenth after warm-up, and the growth."""
    span = max(SAMPLE_EVERY_S * 3, min(60.0, (end_s - warm_from_s) / 10))
    out = {}
    for pid, series in samples_by_pid(samples, warm_from_s).items():
        first = [r for t, r in series if t < warm_from_s + span]
        last = [r for t, r in series if t > end_s - span]
        if first and last:
            first_mid, last_mid = statistics.median(first), statistics.median(last)
            out[pid] = {"first": first_mid, "last": last_mid, "growth": last_mid - first_mid,
                        "peak": max(r for _, r in series)}  # fmt: skip
    return out


def rss_bound_bytes(requests_after_warmup: int, mean_prompt_tokens: float) -> tuple[int, str]:
    """What the allocator may keep without a leak, plus half what the smallest per-request leak would add.

    Allocator: glibc returns freed memory at the top of a heap to the kernel only above M_TRIM_THRESHOLD, which
    it raises to twice the largest chunk freed from mmap, up to 2 x DEFAULT_MMAP_THRESHOLD_MAX = 2 x 32 MiB on
    64-bit (mallopt(3)); the tensors of a step (logits, activations of a prefill chunk) are such chunks, so a
    process may hold 64 MiB more after warm-up and leak nothing. Leak: a server that kept any object of a
    finished request keeps at least its prompt's token ids, 8 bytes per id in a Python list's pointer array, so
    N requests of P tokens on average leak at least 8*N*P bytes; half of that is added.
    """
    allocator = 64 * 2**20
    leak = 8 * requests_after_warmup * mean_prompt_tokens
    bound = int(allocator + leak / 2)
    why = (
        f"64 MiB (glibc's largest untrimmed heap top, 2 x DEFAULT_MMAP_THRESHOLD_MAX, mallopt(3)) + half of "
        f"8 B x {requests_after_warmup} requests after warm-up x {mean_prompt_tokens:.0f} prompt tokens on average "
        f"({leak / 2 / 2**20:.1f} MiB): retaining every finished request's prompt ids exceeds it"
    )
    return bound, why


def rss_mib_per_hour(samples: list, from_s: float) -> dict[int, float]:
    """Per process, the least-squares slope of RSS over the samples after ``from_s``, in MiB per hour."""
    out = {}
    for pid, series in samples_by_pid(samples, from_s).items():
        ts, rs = [t for t, _ in series], [r for _, r in series]
        if len(set(ts)) >= 2:
            out[pid] = round(statistics.linear_regression(ts, rs).slope * 3600 / 2**20, 2)
    return out


def prometheus_totals(text: str) -> dict[str, float]:
    """Sum of every sample of each metric in vLLM's /metrics text, by metric name (labels summed over)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            totals[name] = totals.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return totals


def finish_reasons(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            labels, _, value = line.rpartition(" ")
            reason = labels.split('finished_reason="', 1)[-1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


VLLM_COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
    "spec_decode_drafts": "vllm:spec_decode_num_drafts_total",
    "spec_decode_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "spec_decode_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
}


# -- comparison -----------------------------------------------------------------------------------------------


def compare(run: list, alone: list) -> tuple[bool, str]:
    """Equal token for token, or first different where the alone run's two best are within TIE_LOGPROB."""
    for pos, ((tok, _), (alone_tok, alone_cands)) in enumerate(zip(run, alone)):
        if tok != alone_tok:
            lps = [lp for _, lp in alone_cands[:2]]
            tokens = [t for t, _ in alone_cands[:2]]
            if len(lps) == 2 and tok in tokens and abs(lps[0] - lps[1]) <= TIE_LOGPROB:
                return True, f"near tie at position {pos}: {tokens} logprobs {lps}"
            return False, f"position {pos}: run {tok!r}, alone {alone_tok!r} (alone's best two {alone_cands[:2]})"
    if len(run) != len(alone):
        return False, f"lengths differ: run {len(run)} tokens, alone {len(alone)}"
    return True, ""


# -- the run --------------------------------------------------------------------------------------------------


def soak(
    name: str,
    minutes: float,
    workdir: Path,
    evidence_dir: Path | None,
    seed: int = 0,
    gate: str = "soak",
    speculative: bool = True,
    mix: dict | None = None,
    eager: bool = False,
):
    from ascend_adapters.common.evidence import EvidenceRecord
    from ascend_adapters.common.server import VllmServer

    workdir.mkdir(parents=True, exist_ok=True)
    served = make_checkpoint(name, workdir / "ckpt", speculative, eager)
    rec = EvidenceRecord(model=name, gate=gate)
    pool = greedy_pool(served, seed)
    srv = VllmServer(served.model_dir, served.serve_args, startup_timeout=900, log_path=workdir / "serve.log",
                     served_model_name=name)  # fmt: skip
    rec.command(srv.cmd)
    for what, why in served.not_run:
        rec.skip(what, why)
    outcomes: list[Outcome] = []
    with srv:
        client = Client(srv.port, name)
        sampler = RssSampler(srv.proc.pid)
        sampler.start()
        t_start = time.monotonic()
        deadline = t_start + minutes * 60
        lists = [[] for _ in range(CLIENTS)]
        threads = [threading.Thread(target=traffic, args=(client, served, pool, seed * 1000 + c, deadline, lists[c], mix))
                   for c in range(CLIENTS)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        end_s = time.monotonic() - t_start
        sampler.stop_event.set()
        sampler.join()
        _, metrics_text = srv.request("/metrics")
        metrics_text = metrics_text if isinstance(metrics_text, str) else ""
        alone = []
        for req in pool:
            status, tokens, finish, err = client.greedy(req, stream=False)
            alone.append((status, tokens, finish, err))
        alive_after = srv.alive
    server_rc = srv.proc.returncode
    log = srv.log_text()

    for lst in lists:
        outcomes += lst
    kinds = Counter(o.kind for o in outcomes)
    statuses = Counter(str(o.status) for o in outcomes)
    five_xx = [o for o in outcomes if o.status is not None and o.status >= 500]
    transport = [o for o in outcomes if o.kind == "transport"]
    bad = [o for o in outcomes if o.kind.startswith("bad_")]
    unanswered_bad = [o for o in bad if not (o.status and 400 <= o.status < 500)]
    failed_good = [
        o for o in outcomes if o.kind in ("greedy", "greedy_stream", "sampled_n2") and (o.status != 200 or o.error)
    ]
    hang_ups = [o for o in outcomes if o.kind == "hang_up"]

    prompt_lens = [len(r["prompt"]) if r["kind"] == "completion" else 8 for r in pool]
    compared, equal, ties, mismatches = 0, 0, [], []
    alone_failed = [i for i, a in enumerate(alone) if a[0] != 200]
    for o in outcomes:
        if o.kind.startswith("greedy") and o.status == 200 and alone[o.pool_index][0] == 200:
            compared += 1
            a_status, a_tokens, a_finish, _ = alone[o.pool_index]
            same, detail = compare(o.tokens, a_tokens)
            if same and o.finish != a_finish:
                same, detail = False, f"finish reason {o.finish!r}, alone {a_finish!r}"
            if same:
                equal += 1
                if detail:
                    ties.append({"pool_index": o.pool_index, "kind": o.kind, "detail": detail})
            else:
                mismatches.append({"pool_index": o.pool_index, "kind": o.kind, "detail": detail})

    warm_from = WARMUP_FRACTION * end_s
    after_warm = [o for o in outcomes if o.kind != "transport"]
    n_after = int(len(after_warm) * (1 - WARMUP_FRACTION))
    bound, bound_why = rss_bound_bytes(n_after, statistics.mean(prompt_lens))
    growth = rss_growth(sampler.samples, warm_from, end_s)
    label = {pid: f"{sampler.names.get(pid, '?')}[{pid}]" for pid in sampler.names}
    rss = {label[pid]: {k: int(v) for k, v in g.items()} for pid, g in growth.items()}
    worst = max((g["growth"] for g in growth.values()), default=None)

    totals = prometheus_totals(metrics_text)
    counters = {k: totals.get(v) for k, v in VLLM_COUNTERS.items()}
    if counters["prefix_cache_queries"]:
        counters["prefix_cache_hit_rate"] = round(counters["prefix_cache_hits"] / counters["prefix_cache_queries"], 4)
    if counters.get("spec_decode_draft_tokens"):
        counters["draft_acceptance_rate"] = round(
            counters["spec_decode_accepted_tokens"] / counters["spec_decode_draft_tokens"], 4
        )

    rec.metric("minutes", minutes)
    rec.metric("seconds_of_traffic", round(end_s, 1))
    rec.metric("clients", CLIENTS)
    rec.metric("mix", mix or MIX)
    rec.metric("serve_args", served.serve_args)
    rec.metric("speculative", served.speculative)
    rec.metric("longest_window", {"tokens": served.longest_window, "what": served.window_what})
    rec.metric("greedy_pool", {"requests": len(pool), "prompt_tokens_max": max(prompt_lens),
                               "prompt_tokens_min": min(prompt_lens), "seed": seed})  # fmt: skip
    rec.metric("requests_by_kind", dict(kinds))
    rec.metric("responses_by_status", dict(statuses))
    rec.metric("requests_per_s", round(len(outcomes) / end_s, 2) if end_s else None)
    rec.metric("greedy_compared_with_alone", compared)
    rec.metric("greedy_near_ties", ties[:20])
    rec.metric("rss_after_warmup", rss)
    rec.metric("rss_mib_over_time", {label[pid]: v for pid, v in rss_series_mib(sampler.samples).items()})
    half = warm_from + (end_s - warm_from) / 2
    rec.metric(
        "rss_mib_per_hour_last_half", {label[pid]: v for pid, v in rss_mib_per_hour(sampler.samples, half).items()}
    )
    rec.metric("rss_bound_bytes", bound)
    rec.metric("rss_bound_derivation", bound_why)
    rec.metric("vllm_counters", counters)
    rec.metric("vllm_finish_reasons", finish_reasons(metrics_text))
    rec.metric("startup_s", round(srv.timings.startup_s or 0, 1))

    rec.check("no_5xx", not five_xx, [o.error for o in five_xx[:5]] or None)
    rec.check("no_dropped_connection", not transport, [o.error for o in transport[:5]] or None)
    rec.check(
        "good_requests_answered", not failed_good, [f"{o.kind}: {o.status} {o.error}" for o in failed_good[:5]] or None
    )
    rec.check("bad_requests_get_4xx", bool(bad) and not unanswered_bad,
              {"bad": len(bad), "not_4xx": [f"{o.kind}: {o.status} {o.error}" for o in unanswered_bad[:5]]})  # fmt: skip
    rec.check("hang_ups_sent", bool(hang_ups), {"hang_ups": len(hang_ups)})
    rec.check("alone_answers", not alone_failed, {"failed_pool_indices": alone_failed})
    by_entry = Counter(m["pool_index"] for m in mismatches)
    mismatched_entries = {
        i: {"times": n, "prompt_tokens": prompt_lens[i], "max_tokens": pool[i]["max_tokens"]}
        for i, n in by_entry.most_common()
    }
    rec.check("greedy_equals_alone", compared > 0 and not mismatches, {"compared": compared, "equal": equal,
              "near_ties": len(ties), "mismatches": mismatches[:10], "mismatched_pool_entries": mismatched_entries})  # fmt: skip
    if minutes >= RSS_CHECK_MINUTES:
        rec.check("rss_growth_within_bound", worst is not None and worst < bound,
                  {"worst_growth_bytes": worst, "bound_bytes": bound})  # fmt: skip
    else:
        rec.skip("rss_growth_within_bound", f"a {minutes:.2f}-minute run ends inside the workers' warm-up; "
                 f"checked on runs of {RSS_CHECK_MINUTES:.0f} minutes or more (nox -s soak)")  # fmt: skip
    rec.check("every_vllm_counter_read", all(counters[k] is not None for k in ("prefix_cache_queries", "preemptions")),
              {k: v for k, v in counters.items() if v is None} or None)  # fmt: skip
    if served.speculative:
        rec.check(
            "drafts_proposed", bool(counters.get("spec_decode_draft_tokens")), counters.get("spec_decode_draft_tokens")
        )
    rec.check("server_served_to_the_end", alive_after, None if alive_after else log[-2000:])
    rec.check("server_stopped_cleanly", server_rc == 0, {"returncode": server_rc})
    if evidence_dir is not None:
        path = rec.write(evidence_dir)
        print(f"soak {name}: record {path}")
    return rec


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m ascend_adapters.testing.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", choices=MODELS, help="repeatable; default: all three")
    parser.add_argument("--minutes", type=float, default=10.0, help="traffic per model (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gate", default="soak", help="the record's name (default soak)")
    parser.add_argument("--evidence-dir", type=Path, default=None)
    parser.add_argument("--mix", type=json.loads, default=None, help=f"shares of request kinds (default {MIX})")
    parser.add_argument("--no-speculative", action="store_true", help="serve without the adapter's draft method")
    parser.add_argument("--workdir", type=Path, default=None, help="keep checkpoints and server logs here")
    args = parser.parse_args(argv)
    failed = []
    for name in args.model or MODELS:
        with tempfile.TemporaryDirectory(prefix=f"soak-{name}-") as tmp:
            tmp = args.workdir / name if args.workdir else Path(tmp)
            rec = soak(
                name,
                args.minutes,
                Path(tmp),
                args.evidence_dir,
                seed=args.seed,
                gate=args.gate,
                speculative=not args.no_speculative,
                mix=args.mix,
            )
            for c in rec.checks:
                print(f"  {'PASS' if c['passed'] else 'FAIL'} {c['name']}: {json.dumps(c['detail'])[:400]}")
            print(
                f"soak {name}: {'PASSED' if rec.passed else 'FAILED'}; counters {json.dumps(rec.metrics['vllm_counters'])}"
            )
            if not rec.passed:
                failed.append(name)
                print((Path(tmp) / "serve.log").read_text(errors="replace")[-3000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
