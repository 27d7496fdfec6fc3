"""Numbers from a trace: per request and overall, plus the slowest tokens and why.

Definitions (seconds unless said otherwise):

- TTFT: token 0's wall time (prompt evaluation included). tok/s, p50 and p95 cover the decode
  tokens (index >= 1), whose wall time is one forward pass each.
- time split of a request's wall time (its tokens plus the stretch after the last one):
  I/O wait = stall (compute waiting for storage reads), compute = each token's time inside
  llama_decode less its stall, other = the rest (sampling, detokenizing, Python, a re-pin from
  live tuning; after the last token: the end-of-generation token, final flush).
- bytes per token: storage bytes read over the request (tokens and tail) / tokens.
- hit rate = hits / (hits + misses); prefetch accuracy = prefetch used / prefetch issued.
- read rate: bytes of the read records / the time at least one read was in flight.

Counter-based numbers are None for requests of a model that was not streamed.
"""

from __future__ import annotations

from kimitui.engine.metrics import percentile
from kimitui.trace.reader import RequestTrace, Trace
from kimitui.trace.writer import COUNTERS

STALL_DOMINATED = 0.5  # share of a token's wall time spent waiting on storage


def _sum_counters(parts: list[dict]) -> dict:
    return {k: sum(p[k] for p in parts) for k in COUNTERS}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _busy_seconds(reads: list[dict]) -> float:
    """Length of the union of the reads' [start, start + duration] intervals."""
    total, end = 0.0, None
    for start, stop in sorted((r["start_s"], r["start_s"] + r["dur_s"]) for r in reads):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def _reads(groups: list[list[dict]]) -> dict:
    """Each group's start times are relative to its own request: busy time adds up per group."""
    total = sum(r["bytes"] for g in groups for r in g)
    busy = sum(_busy_seconds(g) for g in groups)
    return {"count": sum(len(g) for g in groups), "bytes": total, "busy_s": busy, "rate_bytes_s": _ratio(total, busy)}


def _metrics(tokens: list[dict], tails: list[dict | None], after_s: float, streamed: bool, ttft: float | None) -> dict:
    """The numbers shared by a request and the overall view, from tokens and their tails."""
    decode = [t["wall_s"] for t in tokens if t["i"] > 0]
    decode_s = sum(decode)
    wall = sum(t["wall_s"] for t in tokens) + after_s
    out = {
        "tokens": len(tokens),
        "ttft_s": ttft,
        "decode_tok_s": _ratio(len(decode), decode_s),
        "p50_s": percentile(decode, 50),
        "p95_s": percentile(decode, 95),
        "wall_s": wall,
        "streamed": streamed,
    }
    if streamed:
        totals = _sum_counters([{k: t[k] for k in COUNTERS} for t in tokens] + [t for t in tails if t is not None])
        io_wait = totals["stall_s"]
        compute = sum(t["compute_s"] for t in tokens)
        other = max(0.0, wall - io_wait - compute)
        out.update(
            io_wait_s=io_wait, compute_s=compute, other_s=other,
            io_wait_share=_ratio(io_wait, wall), compute_share=_ratio(compute, wall), other_share=_ratio(other, wall),
            bytes_read=totals["bytes_read"], bytes_from_cache=totals["bytes_from_cache"],
            bytes_per_token=_ratio(totals["bytes_read"], len(tokens)),
            cache_bytes_per_token=_ratio(totals["bytes_from_cache"], len(tokens)),
            hits=totals["hits"], misses=totals["misses"], hit_rate=_ratio(totals["hits"], totals["hits"] + totals["misses"]),
            prefetch_issued=totals["prefetch_issued"], prefetch_used=totals["prefetch_used"],
            prefetch_wasted=totals["prefetch_wasted"],
            prefetch_accuracy=_ratio(totals["prefetch_used"], totals["prefetch_issued"]),
        )
    else:
        for key in (
            "io_wait_s", "compute_s", "other_s", "io_wait_share", "compute_share", "other_share", "bytes_read",
            "bytes_from_cache", "bytes_per_token", "cache_bytes_per_token", "hits", "misses", "hit_rate",
            "prefetch_issued", "prefetch_used", "prefetch_wasted", "prefetch_accuracy",
        ):
            out[key] = None
    return out


def _streamed(r: RequestTrace) -> bool:
    return bool(r.tokens) and all(t["stall_s"] is not None for t in r.tokens)


def _ttft(r: RequestTrace) -> float | None:
    return r.tokens[0]["wall_s"] if r.tokens and r.tokens[0]["i"] == 0 else None


def request_summary(r: RequestTrace) -> dict:
    end = r.end
    out = {
        "id": r.id,
        "session": r.session,
        "model": r.model,
        "settings": r.settings,
        "finish": None if end is None else end["finish"],
        "error": None if end is None else end["error"],
        "prompt_tokens": None if end is None else end["prompt_tokens"],
        "completion_tokens": None if end is None else end["completion_tokens"],
    }
    tail = None if end is None else end["tail"]
    out.update(_metrics(r.tokens, [tail], 0.0 if end is None else end["after_s"], _streamed(r), _ttft(r)))
    out["reads"] = _reads([r.reads])
    return out


def why(token: dict) -> str:
    wall = token["wall_s"]
    stall = token["stall_s"] or 0.0
    if wall > 0 and stall / wall >= STALL_DOMINATED:
        return "stall-dominated"
    compute = token["compute_s"]
    if wall > 0 and compute is not None and (wall - stall - compute) / wall >= STALL_DOMINATED:
        return "other-dominated (sampling, Python, a re-pin)"
    return "compute-dominated" if token["stall_s"] is not None else "not streamed: compute-dominated"


def slowest_tokens(trace: Trace, n: int) -> list[dict]:
    decode = [(r, t) for r in trace.requests for t in r.tokens if t["i"] > 0]
    median = percentile([t["wall_s"] for _, t in decode], 50)
    ranked = sorted(decode, key=lambda rt: rt[1]["wall_s"], reverse=True)[:n]
    return [
        {
            "req": r.id, "i": t["i"], "wall_s": t["wall_s"], "stall_s": t["stall_s"], "compute_s": t["compute_s"],
            "bytes_read": t["bytes_read"], "hits": t["hits"], "misses": t["misses"],
            "x_median": t["wall_s"] / median if median else None, "why": why(t),
        }
        for r, t in ranked
    ]


def settings_of(trace: Trace) -> list[dict]:
    """The distinct settings the requests ran with, in order of first use."""
    seen: list[dict] = []
    for r in trace.requests:
        if r.settings not in seen:
            seen.append(r.settings)
    return seen


def overall(trace: Trace) -> dict:
    requests = trace.requests
    streamed = [r for r in requests if _streamed(r)]
    # Counter-based numbers come from the streamed requests; times from all of them.
    pool = streamed or requests
    tokens = [t for r in pool for t in r.tokens]
    tails = [r.end["tail"] for r in pool if r.end is not None]
    after = sum(r.end["after_s"] for r in pool if r.end is not None)
    ttfts = [x for x in (_ttft(r) for r in requests) if x is not None]
    out = _metrics(tokens, tails, after, bool(streamed), sum(ttfts) / len(ttfts) if ttfts else None)
    # Times over every request, whatever the counters cover.
    every = _metrics([t for r in requests for t in r.tokens], [], 0.0, False, None)
    out.update({k: every[k] for k in ("tokens", "decode_tok_s", "p50_s", "p95_s")})
    out["requests"] = len(requests)
    out["streamed_requests"] = len(streamed)
    stray: dict[str | None, list[dict]] = {}
    for read in trace.stray_reads:
        stray.setdefault(read["req"], []).append(read)
    out["reads"] = _reads([r.reads for r in requests] + list(stray.values()))
    out["idle_bytes_read"] = sum(i["bytes_read"] for i in trace.idle) if trace.idle else None
    return out


def summarize(trace: Trace, slowest: int = 5) -> dict:
    return {
        "files": [str(p) for p in trace.paths],
        "models": sorted({r.model for r in trace.requests}),
        "settings": settings_of(trace),
        "requests": [request_summary(r) for r in trace.requests],
        "overall": overall(trace),
        "slowest": slowest_tokens(trace, slowest),
    }
