"""Remote mode: a model served over HTTP, driven through the same calls as the local Engine.

The common path is OpenAI's streaming ``/v1/chat/completions``, which kimitui, llama-server
and every OpenAI-compatible server speak. llama.cpp-only sampling fields are sent only to
servers that show llama-server's ``/props``; OpenAI itself refuses unknown fields.
Panels read ``remote_snapshot()``: what the server's ``/metrics`` exposes, what this client
observed itself (per-token timings), and None for everything else.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import httpx

from kimitui import __version__
from kimitui.engine.interface import PinOutcome
from kimitui.engine.metrics import HISTORY_SAMPLES, EngineMetrics, Sampler, Snapshot, StreamingCounters, percentile
from kimitui.engine.generation import GenerationResult, Sampling, TokenEvent
from kimitui.engine.state import EngineError, EngineState, Lifecycle
from kimitui.server import prom

STREAMING_METRICS = {
    "kimitui_cache_hits_total": "cache_hits",
    "kimitui_cache_misses_total": "cache_misses",
    "kimitui_prefetch_queue_depth": "prefetch_queue_depth",
    "kimitui_prefetch_inflight_bytes": "prefetch_inflight_bytes",
    "kimitui_prefetch_used_total": "prefetch_used",
    "kimitui_prefetch_wasted_bytes_total": "prefetch_wasted_bytes",
    "kimitui_page_cache_fallback_bytes_total": "page_cache_fallback_bytes",
    "kimitui_stall_seconds_total": "stall_s",
}


@dataclass(frozen=True)
class RemoteModelInfo:
    """What the server says about its model; None where it does not say."""

    name: str
    model_id: str  # sent back as "model" in requests
    url: str
    file_bytes: int | None
    context_length: int | None  # trained context
    n_ctx: int | None  # the server's context


def _sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The data of each server-sent event (several data lines join with newlines)."""
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
        # comments (":") and event/id/retry fields carry nothing for us
    if data:
        yield "\n".join(data)


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:200] or response.reason_phrase
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    if isinstance(error, str):
        return error
    return json.dumps(body)[:200]


class RemoteEngine:
    """A server's engine for the app (engine.interface.ChatEngine): load, chat, metrics; its
    pinned set and its tuning are the server's own."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        metrics: EngineMetrics | None = None,
        timeout: float = 10.0,
    ) -> None:
        root = url.rstrip("/")
        # An OpenAI base URL (".../v1") works as well as the server's root.
        self.url = root[:-3] if root.endswith("/v1") else root
        self.metrics = metrics or EngineMetrics()
        self.lifecycle = Lifecycle()
        self.load_progress = 0.0
        self.load_s: float | None = None
        self.info: RemoteModelInfo | None = None
        self.n_ctx: int | None = None
        self.llama_like = False  # kimitui or llama-server: /props, llama.cpp sampling fields
        self._abort = threading.Event()
        headers = {"User-Agent": f"kimitui/{__version__}"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        # No read timeout: a reply may wait its turn behind other clients for a long time.
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, read=None))
        self._has_key = bool(api_key)
        self._prev_read: tuple[float, float] | None = None
        self._rss_history: deque[int] = deque(maxlen=HISTORY_SAMPLES)
        self._rate_history: deque[float] = deque(maxlen=HISTORY_SAMPLES)

    # -- plumbing ------------------------------------------------------------------------

    def _get(self, path: str, timeout: float | None = None) -> httpx.Response:
        try:
            return self._client.get(path, timeout=timeout or httpx.USE_CLIENT_DEFAULT)
        except httpx.HTTPError as exc:
            raise EngineError(f"cannot reach {self.url}: {exc}") from None

    def _check_auth(self, response: httpx.Response) -> None:
        if response.status_code in (401, 403):
            if self._has_key:
                raise EngineError(f"{self.url} rejected the API key ({_error_message(response)})")
            raise EngineError(f"{self.url} wants an API key: pass --api-key KEY")

    # -- Engine's surface -----------------------------------------------------------------

    def load(self, on_progress: Callable[[float], None] | None = None) -> None:
        """Connect and learn the model; waits while the server is still loading it."""
        started = time.perf_counter()
        self.lifecycle.move(EngineState.LOADING)
        try:
            self._wait_healthy(on_progress)
            self.info = self._model_info()
        except EngineError as exc:
            self.lifecycle.fail(str(exc))
            raise
        self.n_ctx = self.info.n_ctx
        self.load_s = time.perf_counter() - started
        self.load_progress = 1.0
        if on_progress is not None:
            on_progress(1.0)
        self.lifecycle.move(EngineState.READY)

    def _wait_healthy(self, on_progress: Callable[[float], None] | None) -> None:
        # /health is llama-server's and ours; a plain OpenAI server has none (404), which is fine.
        while True:
            response = self._get("/health")
            if response.status_code != 503:
                return
            try:
                progress = float(response.json().get("progress", 0.0))
            except (ValueError, AttributeError, TypeError):
                progress = 0.0
            self.load_progress = progress
            if on_progress is not None:
                on_progress(progress)
            if self._abort.wait(0.5):
                raise EngineError("loading cancelled")

    def _model_info(self) -> RemoteModelInfo:
        response = self._get("/v1/models")
        self._check_auth(response)
        if response.status_code != 200:
            raise EngineError(f"{self.url}/v1/models answered {response.status_code}: {_error_message(response)}")
        try:
            entry = response.json()["data"][0]
            model_id = str(entry["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise EngineError(f"{self.url} does not answer like an OpenAI-compatible server (/v1/models)") from None
        meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
        n_ctx = meta.get("n_ctx")
        props = self._get("/props")
        self._check_auth(props)  # /v1/models is public on llama-server and here: the key is tried on /props
        if props.status_code == 200:
            try:
                body = props.json()
                settings = body["default_generation_settings"]
                self.llama_like = True
                n_ctx = body.get("n_ctx") or settings.get("n_ctx") or n_ctx
            except (ValueError, KeyError, TypeError, AttributeError):
                pass  # some other server's /props: not llama-server's
        # llama-server names a model by the path it loaded: the file's name is what says which.
        return RemoteModelInfo(
            name=str(meta.get("name") or model_id).rsplit("/", 1)[-1],
            model_id=model_id,
            url=self.url,
            file_bytes=meta.get("size"),
            context_length=meta.get("n_ctx_train"),
            n_ctx=n_ctx,
        )

    @property
    def state(self) -> EngineState:
        return self.lifecycle.state

    def abort_load(self) -> None:
        self._abort.set()

    def label(self) -> tuple[str, int | None]:
        if self.info is None:
            return f"remote {self.url}", None
        return f"{self.info.name} @ {self.url}", self.info.file_bytes

    def notices(self) -> list[str]:
        return []

    def pin(self, on_progress=None) -> PinOutcome:
        return PinOutcome(0, None, whole_model=False)  # the server pins its own

    def tuning(self) -> None:
        return None  # tuned on the server

    def lossy_setting(self) -> None:
        return None  # the server's own setting

    def retune(self, **changes) -> str:
        raise EngineError("remote mode: the server's engine is tuned on the server")

    def close(self) -> None:
        self.abort_load()
        self._client.close()
        self.lifecycle.close()

    def _body(self, sampling: Sampling) -> dict:
        if self.info is None:
            raise EngineError("not connected yet")
        s = sampling
        body = {
            "model": self.info.model_id,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
        }
        if s.seed is not None:
            body["seed"] = s.seed
        if s.stop:
            body["stop"] = list(s.stop)
        if self.llama_like:
            body.update(top_k=s.top_k, min_p=s.min_p, repeat_penalty=s.repeat_penalty)
        return body

    def resumes(self, key: str) -> bool:
        return False  # the server keeps its own context; nothing is saved from here

    def forget_state(self, key: str) -> None:
        pass

    def chat(self, messages: list[dict], sampling: Sampling, keep: str | None = None) -> "RemoteGeneration":
        body = self._body(sampling)
        body["messages"] = [{"role": m["role"], "content": m["content"]} for m in messages]
        return RemoteGeneration(self, "/v1/chat/completions", body)

    def complete(self, prompt: str, sampling: Sampling) -> "RemoteGeneration":
        body = self._body(sampling)
        body["prompt"] = prompt
        return RemoteGeneration(self, "/v1/completions", body)

    # -- metrics -------------------------------------------------------------------------

    def scrape(self) -> dict[str, float] | None:
        """The remote /metrics, or None when it exposes neither kimitui nor llama-server metrics."""
        try:
            response = self._client.get("/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None  # llama-server without --metrics says 501; OpenAI servers 404
        values = prom.parse(response.text)
        known = {k: v for k, v in values.items() if k.startswith(("kimitui_", "llamacpp:"))}
        return known or None

    def remote_snapshot(self) -> Snapshot:
        """A Snapshot for the panels. Server-side values come from /metrics (None when not
        exposed); latencies are what this client timed itself, network included."""
        remote = self.scrape() or {}
        now = time.monotonic()
        view = self.metrics.view()
        latencies = view["latencies"]

        def num(name: str) -> float | None:
            return remote.get(name)

        def count(name: str, local: int) -> int:
            value = num(name)
            return local if value is None else int(value)

        def as_int(value: float | None) -> int | None:
            return None if value is None else int(value)

        rss = as_int(num("kimitui_rss_bytes"))
        if rss is not None:
            self._rss_history.append(rss)
        read_bytes = num("kimitui_read_bytes_total")
        read_rate = None
        if read_bytes is not None:
            if self._prev_read is not None:
                t0, r0 = self._prev_read
                read_rate = max(0.0, read_bytes - r0) / max(now - t0, 1e-6)
                self._rate_history.append(read_rate)
            self._prev_read = (now, read_bytes)
        streaming = None
        if any(name in remote for name in STREAMING_METRICS):
            streaming = StreamingCounters(
                **{field: (remote.get(name, 0) if field == "stall_s" else int(remote.get(name, 0)))
                   for name, field in STREAMING_METRICS.items()}
            )
        p50, p95, ttft = num("kimitui_token_latency_p50_seconds"), num("kimitui_token_latency_p95_seconds"), num("kimitui_ttft_seconds")
        kimitui = any(name.startswith("kimitui_") for name in remote)
        return Snapshot(
            time=now,
            rss_bytes=rss,
            rss_peak_bytes=as_int(num("kimitui_rss_peak_bytes")),
            cpu_percent=None,
            process_read_bytes=as_int(read_bytes),
            process_read_rate=read_rate,
            disk_name=None,
            disk_read_rate=None,
            budget_bytes=as_int(num("kimitui_budget_bytes")),
            latencies=latencies,
            p50_s=p50 if p50 is not None else percentile(latencies, 50),
            p95_s=p95 if p95 is not None else percentile(latencies, 95),
            ttft_s=ttft if ttft is not None else view["ttft_s"],
            # From the tokens that arrived: llama-server's predicted_tokens_seconds is a rate since
            # its last scrape, 0 between replies.
            decode_tok_s=view["decode_tok_s"],
            tokens_total=count("llamacpp:tokens_predicted_total", view["tokens_total"]),
            requests_total=count("kimitui_requests_total", view["requests_total"]),
            prompt_tokens_total=count("llamacpp:prompt_tokens_total", view["prompt_tokens_total"]),
            streaming=streaming,
            rss_history=list(self._rss_history),
            read_rate_history=list(self._rate_history),
            read_counted_by="process" if read_bytes is not None else None,
            reported_by="kimitui" if kimitui else "llama-server" if self.llama_like else "an OpenAI-compatible server",
        )


class RemoteSampler(Sampler):
    """The local Sampler's thread and subscribers, fed by ``RemoteEngine.remote_snapshot``."""

    def __init__(self, remote: RemoteEngine, *, interval: float = 1.0) -> None:
        super().__init__(remote.metrics, interval=interval)
        self.remote = remote

    def sample(self) -> Snapshot:
        snap = self.remote.remote_snapshot()
        self.latest = snap
        return snap


class RemoteGeneration:
    """One streamed reply. Iterate for TokenEvents (token_id is -1: servers do not send ids);
    read ``result`` afterwards. ``cancel()`` is safe from any thread and also interrupts a
    read blocked while the reply waits its turn on the server."""

    def __init__(self, engine: RemoteEngine, path: str, body: dict) -> None:
        self.engine = engine
        self.path = path
        self.body = body
        self.result = GenerationResult()
        self.queue_position: int | None = None  # from the server's X-Queue-Position, if sent
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._response: httpx.Response | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()
        with self._lock:
            response = self._response
            if response is None:
                return
            # Closing a socket does not wake a thread blocked reading it; shutting it down does.
            stream = response.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed

    def __iter__(self) -> Iterator[TokenEvent]:
        engine, result, metrics = self.engine, self.result, self.engine.metrics
        started = last = time.perf_counter()
        parts: list[str] = []
        finish = "stop"
        usage: dict = {}
        server_timings: dict = {}
        engine.lifecycle.begin_reply()
        metrics.request_started()
        try:
            with engine._client.stream("POST", self.path, json=self.body) as response:
                with self._lock:
                    self._response = response
                try:
                    if response.status_code != 200:
                        response.read()
                        engine._check_auth(response)
                        raise EngineError(f"the server refused the request ({response.status_code}): {_error_message(response)}")
                    header = response.headers.get("X-Queue-Position")
                    self.queue_position = int(header) if header and header.isdigit() else None
                    for data in _sse_data(response.iter_lines()):
                        if self._cancel.is_set() or data == "[DONE]":
                            break
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            raise EngineError(f"the server sent something that is not JSON: {data[:80]!r}") from None
                        if chunk.get("error"):
                            error = chunk["error"]
                            raise EngineError(f"the server failed: {error.get('message') if isinstance(error, dict) else error}")
                        usage = chunk.get("usage") or usage
                        server_timings = chunk.get("timings") or server_timings
                        for choice in chunk.get("choices") or []:
                            finish = choice.get("finish_reason") or finish
                            delta = choice.get("delta") or {}
                            text = delta.get("content") if "delta" in choice else choice.get("text")
                            if text is None or (text == "" and "role" in delta):
                                continue  # the role-only opening chunk, or a finish-only one
                            now = time.perf_counter()
                            wall, last = now - last, now
                            if not result.timings:
                                result.prompt_s = wall
                            result.timings.append(wall)
                            metrics.token(wall)
                            parts.append(text)
                            yield TokenEvent(text, -1, len(result.timings) - 1, wall)
                finally:
                    # Cleared before the connection goes back to the pool, so cancel() never shuts
                    # down a connection another request is using.
                    with self._lock:
                        self._response = None
            if self._cancel.is_set():
                finish = "cancelled"
        except httpx.HTTPError as exc:
            if not self._cancel.is_set():
                finish = "error"
                result.error = f"lost the connection to {engine.url}: {exc}"
                raise EngineError(result.error) from None
            finish = "cancelled"
        except EngineError as exc:
            finish, result.error = "error", str(exc)
            raise
        except GeneratorExit:
            finish = "cancelled"
            raise
        finally:
            result.text = "".join(parts)
            result.finish_reason = finish if finish in ("stop", "length", "cancelled", "error") else "stop"
            result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            result.completion_tokens = int(usage.get("completion_tokens") or len(result.timings))
            if "prompt_ms" in server_timings and "predicted_ms" in server_timings:
                result.prompt_s = server_timings["prompt_ms"] / 1000
                result.decode_s = server_timings["predicted_ms"] / 1000
            else:
                result.decode_s = max(0.0, last - started - result.prompt_s)
            if result.prompt_tokens:
                metrics.prompt_evaluated(result.prompt_tokens)
            metrics.request_finished()
            engine.lifecycle.end_reply()
