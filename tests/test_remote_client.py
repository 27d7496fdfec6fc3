"""RemoteEngine against our own server over loopback, with the real default model."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass

import httpx
import pytest
from starlette.responses import JSONResponse

from kimitui.config import Settings, load_settings
from kimitui.engine.metrics import EngineMetrics
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.engine.state import EngineError, EngineState
from kimitui.model import default_model_path
from kimitui.server.app import create_app
from kimitui.server.client import RemoteEngine, RemoteSampler
from kimitui.server.runner import ServerThread, bind_socket

from helpers import wait_for

TIMEOUT = 180.0
KEY = "remote-key"
MESSAGES = [{"role": "user", "content": "Say hi"}]
GREEDY = Sampling(temperature=0, max_tokens=12)


@dataclass
class Served:
    settings: Settings
    engine: Engine
    url: str
    keyed_url: str
    plain_url: str  # behind a wrapper that hides everything an OpenAI server lacks
    plain_bodies: list[bytes]


def openai_only(app, bodies: list[bytes]):
    """What a plain OpenAI-compatible server offers: /v1 routes only; records request bodies."""

    async def wrapped(scope, receive, send):
        if scope["type"] == "http" and not scope["path"].startswith("/v1/"):
            await JSONResponse({"error": {"message": "Not Found"}}, 404)(scope, receive, send)
            return

        async def recording():
            message = await receive()
            if message["type"] == "http.request":
                bodies.append(message.get("body", b""))
            return message

        await app(scope, recording, send)

    return wrapped


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "config.toml"
    config.write_text("")  # all defaults, whatever the environment says
    settings = load_settings(config, explicit=True)
    engine = Engine(default_model_path(), n_ctx=1024, n_threads=1, metrics=EngineMetrics())
    engine.load()
    bodies: list[bytes] = []
    servers = [
        ServerThread(create_app(engine, settings), bind_socket("127.0.0.1", 0)).start(),
        ServerThread(create_app(engine, settings, api_key=KEY), bind_socket("127.0.0.1", 0)).start(),
        ServerThread(openai_only(create_app(engine, settings), bodies), bind_socket("127.0.0.1", 0)).start(),
    ]
    yield Served(settings, engine, servers[0].url, servers[1].url, servers[2].url, bodies)
    for server in servers:
        server.stop()
    engine.close()


@pytest.fixture
def remote(served):
    client = RemoteEngine(served.url)
    client.load()
    yield client
    client.close()


def test_load_learns_the_model(served, remote):
    assert remote.state is EngineState.READY
    info = remote.info
    assert info.model_id == default_model_path().name
    assert info.name == served.engine.info.name
    assert info.file_bytes == served.engine.info.file_bytes
    assert info.n_ctx == remote.n_ctx == 1024
    assert remote.llama_like


def test_openai_base_url_works_too(served):
    client = RemoteEngine(served.url + "/v1/")
    client.load()
    assert client.url == served.url
    client.close()


def test_chat_streams_the_same_reply_as_the_engine(served, remote):
    local = served.engine.chat(MESSAGES, GREEDY)
    expected = "".join(e.text for e in local)
    before = remote.metrics.view()["tokens_total"]
    generation = remote.chat(MESSAGES, GREEDY)
    events = list(generation)
    result = generation.result
    assert "".join(e.text for e in events) == result.text == expected
    assert [e.index for e in events] == list(range(len(events)))
    assert result.finish_reason == "length"
    assert result.completion_tokens == 12 and result.prompt_tokens == local.result.prompt_tokens
    assert result.prompt_s > 0 and result.decode_s > 0
    assert generation.queue_position == 0
    view = remote.metrics.view()
    assert view["tokens_total"] - before == len(events)
    assert view["ttft_s"] is not None and view["requests_total"] >= 1
    assert remote.state is EngineState.READY


def test_complete(remote):
    generation = remote.complete("The capital of France is", Sampling(temperature=0, max_tokens=4))
    assert "".join(e.text for e in generation).startswith(" Paris")
    assert generation.result.completion_tokens == 4


def test_cancel_mid_reply_frees_the_server(served, remote):
    generation = remote.complete("The capital of France is", Sampling(temperature=0, max_tokens=400))
    received = 0
    for _ in generation:
        received += 1
        if received == 3:
            generation.cancel()
    assert generation.result.finish_reason == "cancelled"
    assert received < 400
    wait_for(lambda: served.engine.turns.waiting == 0, "the server's engine to be free")


def test_cancel_while_queued_on_the_server(served, remote):
    blocker = served.engine.complete("Once upon a time", Sampling(temperature=0, max_tokens=200))
    held = iter(blocker)
    next(held)  # the engine's turn stays taken while this generation is suspended
    generation = remote.chat(MESSAGES, GREEDY)
    events: list = []
    reader = threading.Thread(target=lambda: events.extend(generation))
    try:
        reader.start()
        wait_for(lambda: served.engine.turns.waiting == 2, "the remote request to queue")
        wait_for(lambda: generation.queue_position == 1, "the client to read its queue position")
        generation.cancel()  # the reader is blocked in a socket read: cancel must wake it
        reader.join(TIMEOUT)
        assert not reader.is_alive()
        assert events == [] and generation.result.finish_reason == "cancelled"
        wait_for(lambda: served.engine.turns.waiting == 1, "the server to drop the queued request")
    finally:
        blocker.cancel()
        for _ in held:
            pass


def test_server_side_errors_are_engine_errors(remote):
    with pytest.raises(EngineError, match=r"refused the request \(400\): max_tokens: expected an integer between 1 and 2048"):
        list(remote.chat(MESSAGES, Sampling(max_tokens=0)))


def test_unreachable_server():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again before the client tries it
    client = RemoteEngine(f"http://127.0.0.1:{port}")
    with pytest.raises(EngineError, match=f"cannot reach http://127.0.0.1:{port}"):
        client.load()
    assert client.state is EngineState.FAILED


def test_api_key(served):
    with pytest.raises(EngineError, match="wants an API key"):
        RemoteEngine(served.keyed_url).load()
    with pytest.raises(EngineError, match="rejected the API key"):
        RemoteEngine(served.keyed_url, api_key="wrong").load()
    client = RemoteEngine(served.keyed_url, api_key=KEY)
    client.load()
    assert "".join(e.text for e in client.chat(MESSAGES, Sampling(temperature=0, max_tokens=3)))
    assert client.remote_snapshot().rss_bytes > 0  # /metrics is scraped with the key too
    client.close()


def test_waits_while_the_server_loads(served):
    loading = Engine(default_model_path(), n_ctx=512, n_threads=1)
    server = ServerThread(create_app(loading, served.settings), bind_socket("127.0.0.1", 0)).start()
    client = RemoteEngine(server.url)
    progress: list[float] = []
    connected = threading.Thread(target=client.load, args=(progress.append,))
    try:
        connected.start()
        wait_for(lambda: progress, "the client to see the server loading")
        assert client.state is EngineState.LOADING and progress[0] == 0.0
        loading.load()
        connected.join(TIMEOUT)
        assert client.state is EngineState.READY and progress[-1] == 1.0
        assert client.n_ctx == 512
    finally:
        client.abort_load()
        client.close()
        server.stop()
        loading.close()


def test_remote_snapshot_reads_the_servers_metrics(served, remote):
    list(remote.chat(MESSAGES, Sampling(temperature=0, max_tokens=3)))
    first = remote.remote_snapshot()
    server_total = httpx.get(served.url + "/metrics").text
    assert f"llamacpp:tokens_predicted_total {first.tokens_total}" in server_total
    assert first.rss_bytes > 50e6 and first.rss_peak_bytes >= first.rss_bytes
    assert first.process_read_bytes is not None and first.process_read_rate is None  # a rate needs two scrapes
    assert first.p50_s is not None and first.ttft_s is not None and first.decode_tok_s is not None
    assert first.streaming is None  # no streaming engine on the server: "—", not 0
    assert first.cpu_percent is None and first.disk_read_rate is None
    second = remote.remote_snapshot()
    assert second.process_read_rate is not None and second.process_read_rate >= 0
    assert len(second.rss_history) == 2
    served.engine.metrics.streaming_source = lambda: dict(cache_hits=9, cache_misses=1, stall_s=0.25)
    try:
        streaming = remote.remote_snapshot().streaming
        assert (streaming.cache_hits, streaming.cache_misses, streaming.stall_s) == (9, 1, 0.25)
    finally:
        served.engine.metrics.streaming_source = None


def test_plain_openai_server(served):
    """No /health, /props or /metrics: chat still works; server-side panels are None."""
    client = RemoteEngine(served.plain_url)
    client.load()
    assert not client.llama_like and client.info.model_id == default_model_path().name
    served.plain_bodies.clear()
    text = "".join(e.text for e in client.chat(MESSAGES, Sampling(temperature=0, max_tokens=5)))
    assert text and client.metrics.view()["tokens_total"] >= 5
    sent = json.loads(b"".join(served.plain_bodies))
    assert sent["max_tokens"] == 5 and sent["stream"] is True
    assert not {"top_k", "min_p", "repeat_penalty"} & set(sent)  # OpenAI refuses fields it does not know
    snap = client.remote_snapshot()
    assert snap.rss_bytes is None and snap.process_read_bytes is None and snap.streaming is None
    assert snap.latencies and snap.p50_s is not None  # what the client timed itself
    client.close()


def test_remote_sampler_feeds_subscribers(remote):
    sampler = RemoteSampler(remote, interval=0.05)
    seen = []
    sampler.subscribe(seen.append)
    sampler.start()
    try:
        wait_for(lambda: len(seen) >= 2, "two remote snapshots")
    finally:
        sampler.stop()
    assert seen[-1].rss_bytes > 0 and sampler.latest is not None
