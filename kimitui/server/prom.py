"""Prometheus text exposition: written by the server, read back by the remote client.

llama-server's metric names are used where the meaning is the same, so dashboards built for
it keep working; the streaming engine's own counters are ``kimitui_*``. A value nobody has
measured is left out rather than written as 0.
"""

from __future__ import annotations

import math

from kimitui.engine.metrics import Snapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _line(out: list[str], name: str, kind: str, help_text: str, value: float | None) -> None:
    if value is None:
        return
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")
    out.append(f"{name} {value:d}" if isinstance(value, int) else f"{name} {value!r}")


def render(snap: Snapshot, *, processing: int, deferred: int) -> str:
    out: list[str] = []
    _line(out, "llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", snap.prompt_tokens_total)
    _line(out, "llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.", snap.tokens_total)
    _line(out, "llamacpp:predicted_tokens_seconds", "gauge", "Generation throughput of the latest reply in tokens/s.", snap.decode_tok_s)
    _line(out, "llamacpp:requests_processing", "gauge", "Number of requests processing.", processing)
    _line(out, "llamacpp:requests_deferred", "gauge", "Number of requests deferred (waiting in line).", deferred)
    _line(out, "kimitui_requests_total", "counter", "Generations started by the engine (API and app together).", snap.requests_total)
    _line(out, "kimitui_rss_bytes", "gauge", "Resident set size of the server process.", snap.rss_bytes)
    _line(out, "kimitui_rss_peak_bytes", "gauge", "Peak resident set size of the server process.", snap.rss_peak_bytes)
    _line(out, "kimitui_read_bytes_total", "counter", "Bytes the server process read from storage.", snap.process_read_bytes)
    _line(out, "kimitui_budget_bytes", "gauge", "Memory budget of the streaming engine.", snap.budget_bytes)
    _line(out, "kimitui_token_latency_p50_seconds", "gauge", "Median per-token latency over the recent window.", snap.p50_s)
    _line(out, "kimitui_token_latency_p95_seconds", "gauge", "95th percentile per-token latency over the recent window.", snap.p95_s)
    _line(out, "kimitui_ttft_seconds", "gauge", "Time to first token of the latest reply.", snap.ttft_s)
    s = snap.streaming
    if s is not None:
        _line(out, "kimitui_cache_hits_total", "counter", "Weight reads served from the streaming cache.", s.cache_hits)
        _line(out, "kimitui_cache_misses_total", "counter", "Weight reads that went to storage.", s.cache_misses)
        _line(out, "kimitui_prefetch_queue_depth", "gauge", "Prefetch requests waiting.", s.prefetch_queue_depth)
        _line(out, "kimitui_prefetch_inflight_bytes", "gauge", "Bytes being prefetched right now.", s.prefetch_inflight_bytes)
        _line(out, "kimitui_prefetch_used_total", "counter", "Reads ahead that compute then used.", s.prefetch_used)
        _line(out, "kimitui_prefetch_wasted_bytes_total", "counter", "Bytes read ahead and dropped unused.", s.prefetch_wasted_bytes)
        _line(out, "kimitui_page_cache_fallback_bytes_total", "counter", "Shard bytes meant for a direct read that went through the page cache.", s.page_cache_fallback_bytes)
        _line(out, "kimitui_stall_seconds_total", "counter", "Time decoding waited on storage.", s.stall_s)
    return "\n".join(out) + "\n"


def parse(text: str) -> dict[str, float]:
    """Sample name -> value for unlabelled samples (what llama-server and kimitui expose)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_part, _, rest = line.partition(" ")
        if "{" in name_part:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if not math.isnan(value):
            values[name_part] = value
    return values
