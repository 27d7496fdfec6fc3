"""The HTTP API over real loopback HTTP, against the real default model (loaded once here)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
import requests

from kimitui.cli import main
from kimitui.config import Settings, load_settings
from kimitui.engine.metrics import EngineMetrics, Snapshot, StreamingCounters
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.errors import UserError
from kimitui.model import default_model_path
from kimitui.server import prom
from kimitui.server.app import create_app
from kimitui.server.runner import ServerThread, bind_socket, check_bind
from kimitui.trace.reader import read_trace

from helpers import wait_for

TIMEOUT = 180.0  # generous: the machine has 2 cores and other suites run beside this one
N_CTX = 512
MAX_N_PREDICT = 200
CONFIG = f"""
[model]
n_ctx = {N_CTX}
n_threads = 1
[server]
max_body = "16KiB"
max_n_predict = {MAX_N_PREDICT}
"""
KEY = "s3cret-key"
FRANCE = "The capital of France is"  # at temperature 0: " Paris.\n\nThe United States has ..." for 200+ tokens
CHAT_EOS = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"  # ends with <|im_end|> (EOS) early


@dataclass
class Served:
    settings: Settings
    url: str
    keyed_url: str  # the same engine behind a second app that wants KEY
    engine: Engine
    records: list[dict]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "config.toml"
    config.write_text(CONFIG)
    settings = load_settings(config, explicit=True)
    engine = Engine(default_model_path(), n_ctx=settings["model.n_ctx"], n_threads=settings["model.n_threads"], metrics=EngineMetrics())
    engine.load()
    records: list[dict] = []
    open_server = ServerThread(create_app(engine, settings, on_request=records.append), bind_socket("127.0.0.1", 0)).start()
    keyed_server = ServerThread(create_app(engine, settings, api_key=KEY), bind_socket("127.0.0.1", 0)).start()
    yield Served(settings, open_server.url, keyed_server.url, engine, records)
    open_server.stop()
    keyed_server.stop()
    engine.close()


def post(served: Served, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(served.url + path, json=body, timeout=TIMEOUT, **kwargs)


def sse_blocks(raw: bytes) -> list[str]:
    """The events of an SSE body, checking llama-server's framing: one data line per event."""
    assert raw.endswith(b"\n\n")
    blocks = raw.decode("utf-8").split("\n\n")[:-1]
    for block in blocks:
        assert block.startswith("data: ") and "\n" not in block, repr(block)
    return [block[len("data: "):] for block in blocks]


def stream(served: Served, path: str, body: dict) -> tuple[httpx.Response, list[str]]:
    with httpx.stream("POST", served.url + path, json={**body, "stream": True}, timeout=TIMEOUT) as response:
        raw = response.read()
    return response, sse_blocks(raw)


@contextmanager
def engine_held(engine: Engine):
    """Hold the engine's turn like a long local reply: a generation suspended between tokens."""
    blocker = engine.complete("Once upon a time", Sampling(temperature=0, max_tokens=MAX_N_PREDICT))
    tokens = iter(blocker)
    next(tokens)
    try:
        yield
    finally:
        blocker.cancel()
        for _ in tokens:
            pass


# -- llama-server endpoints ------------------------------------------------------------------


def test_health_and_props(served):
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    props = httpx.get(served.url + "/props").json()
    assert props["total_slots"] == 1
    assert props["n_ctx"] == N_CTX == props["default_generation_settings"]["n_ctx"]
    assert props["default_generation_settings"]["params"]["n_predict"] == MAX_N_PREDICT  # 512 capped to 200
    assert props["model_path"] == str(default_model_path())
    assert props["queue"] == {"processing": 0, "deferred": 0}
    assert "im_start" in props["chat_template"]


def test_completion_non_streamed(served):
    response = post(served, "/completion", {"prompt": FRANCE, "n_predict": 8, "temperature": 0})
    assert response.status_code == 200
    assert response.headers["X-Queue-Position"] == "0"
    body = response.json()
    assert body["content"].startswith(" Paris")
    assert body["stop"] is True
    assert body["stop_type"] == "limit"
    assert body["tokens_predicted"] == 8
    assert body["tokens_evaluated"] == len(served.engine.tokenize(FRANCE))
    t = body["timings"]
    assert t["prompt_n"] == body["tokens_evaluated"] and t["predicted_n"] == 8
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0
    assert t["predicted_per_second"] == pytest.approx(8 / (t["predicted_ms"] / 1000))


def test_completion_streamed_matches_non_streamed(served):
    body = {"prompt": FRANCE, "n_predict": 10, "temperature": 0}
    whole = post(served, "/completion", body).json()
    response, blocks = stream(served, "/completion", body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(b) for b in blocks]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == whole["content"]
    last = events[-1]
    assert last["content"] == "" and last["tokens_predicted"] == 10 and last["stop_type"] == "limit"
    for key in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"):
        assert key in last["timings"]
    assert all("timings" not in e for e in events[:-1])


def test_completion_token_prompt_equals_text_prompt(served):
    ids = served.engine.tokenize(FRANCE)
    by_text = post(served, "/completion", {"prompt": FRANCE, "n_predict": 6, "temperature": 0}).json()
    by_ids = post(served, "/completion", {"prompt": ids, "n_predict": 6, "temperature": 0}).json()
    assert by_ids["content"] == by_text["content"]
    assert by_ids["prompt"] == FRANCE


def test_stop_word_eos_and_unbounded_n_predict(served):
    word = post(served, "/completion", {"prompt": FRANCE, "n_predict": -1, "temperature": 0, "stop": ["."]}).json()
    assert word["content"] == " Paris"
    assert (word["stop_type"], word["stopping_word"]) == ("word", ".")
    assert word["generation_settings"]["n_predict"] == MAX_N_PREDICT  # -1: up to the configured cap
    eos = post(served, "/completion", {"prompt": CHAT_EOS, "n_predict": 100, "temperature": 0}).json()
    assert eos["stop_type"] == "eos" and eos["tokens_predicted"] < 100
    assert "<|im_end|>" not in eos["content"]


def test_seed_makes_sampling_repeatable(served):
    body = {"prompt": "Once upon a time", "n_predict": 12, "temperature": 1.0, "seed": 1234}
    first = post(served, "/completion", body).json()["content"]
    assert post(served, "/completion", body).json()["content"] == first


def test_tokenize_detokenize(served):
    text = "Hello world 日本"
    tokens = post(served, "/tokenize", {"content": text}).json()["tokens"]
    assert tokens == served.engine.tokenize(text, add_special=False)
    pieces = post(served, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined.decode() == text
    assert any(isinstance(p["piece"], list) for p in pieces)  # a split multi-byte character comes as bytes
    assert post(served, "/detokenize", {"tokens": tokens}).json() == {"content": text}


def test_metrics_prometheus_text(served):
    before = prom.parse(httpx.get(served.url + "/metrics").text)
    post(served, "/completion", {"prompt": FRANCE, "n_predict": 5, "temperature": 0})
    response = httpx.get(served.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = prom.parse(response.text)
    assert after["llamacpp:tokens_predicted_total"] == before["llamacpp:tokens_predicted_total"] + 5
    assert after["llamacpp:prompt_tokens_total"] > before["llamacpp:prompt_tokens_total"]
    assert after["llamacpp:requests_processing"] == 0 and after["llamacpp:requests_deferred"] == 0
    assert after["kimitui_rss_bytes"] > 50e6 and after["kimitui_rss_peak_bytes"] >= after["kimitui_rss_bytes"]
    assert after["kimitui_token_latency_p95_seconds"] >= after["kimitui_token_latency_p50_seconds"] > 0
    assert "# TYPE llamacpp:tokens_predicted_total counter" in response.text
    # No streaming engine attached: its metrics are absent, not zero.
    assert not any(name.startswith(("kimitui_cache", "kimitui_prefetch", "kimitui_stall")) for name in after)


def test_metrics_streaming_counters_only_when_reported():
    snap = Snapshot(
        time=0.0, rss_bytes=1, rss_peak_bytes=2, cpu_percent=None, process_read_bytes=None, process_read_rate=None,
        disk_name=None, disk_read_rate=None, budget_bytes=None, latencies=[], p50_s=None, p95_s=None, ttft_s=None,
        decode_tok_s=None, tokens_total=0, requests_total=0, prompt_tokens_total=0,
        streaming=StreamingCounters(
            cache_hits=7, cache_misses=3, prefetch_queue_depth=2, prefetch_inflight_bytes=4096, stall_s=1.5,
            page_cache_fallback_bytes=8192,
        ),
    )
    values = prom.parse(prom.render(snap, processing=1, deferred=4))
    assert values["kimitui_cache_hits_total"] == 7 and values["kimitui_cache_misses_total"] == 3
    assert values["kimitui_prefetch_queue_depth"] == 2 and values["kimitui_prefetch_inflight_bytes"] == 4096
    assert values["kimitui_stall_seconds_total"] == 1.5
    assert values["kimitui_page_cache_fallback_bytes_total"] == 8192
    assert values["llamacpp:requests_deferred"] == 4
    # Unmeasured values are left out, never written as 0.
    for absent in ("kimitui_read_bytes_total", "kimitui_ttft_seconds", "kimitui_budget_bytes", "llamacpp:predicted_tokens_seconds"):
        assert absent not in values


def test_on_request_reports_each_request(served):
    post(served, "/completion", {"prompt": FRANCE, "n_predict": 3, "temperature": 0})
    httpx.get(served.url + "/no/such/route")

    def find(path):
        return [r for r in served.records if r["path"] == path]

    wait_for(lambda: find("/no/such/route"), "the 404 record")
    done = [r for r in find("/completion") if r["tokens"] == 3][-1]
    assert done["method"] == "POST" and done["status"] == 200 and done["queue_position"] == 0
    assert done["client"].startswith("127.0.0.1:") and done["duration_s"] > 0 and done["prompt_tokens"] > 0
    assert find("/no/such/route")[-1]["status"] == 404


def test_tutorial_requests_client(served):
    """A llama-server tutorial's client, unchanged: plain requests, naive SSE line parsing."""
    url = served.url
    response = requests.post(f"{url}/completion", json={"prompt": FRANCE, "n_predict": 8, "temperature": 0}, timeout=TIMEOUT)
    content = response.json()["content"]
    text, timings = "", None
    with requests.post(f"{url}/completion", json={"prompt": FRANCE, "n_predict": 8, "temperature": 0, "stream": True},
                       stream=True, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line:
                chunk = json.loads(line.decode("utf-8").removeprefix("data: "))
                text += chunk["content"]
                if chunk["stop"]:
                    timings = chunk["timings"]
    assert text == content and content.startswith(" Paris")
    assert timings["predicted_n"] == 8


# -- OpenAI endpoints ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


MESSAGES = [{"role": "user", "content": "Say hi"}]


def test_openai_models(oai, served):
    models = oai.models.list().data
    assert [m.id for m in models] == [default_model_path().name]
    assert httpx.get(served.url + "/models").json()["data"][0]["id"] == models[0].id


def test_openai_chat(oai):
    reply = oai.chat.completions.create(model="any", messages=MESSAGES, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    chunks = list(oai.chat.completions.create(model="any", messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == reply.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_openai_chat_stops_at_end_of_turn(oai):
    reply = oai.chat.completions.create(model="any", messages=MESSAGES, max_tokens=150, temperature=0, stop=["zzz"])
    assert reply.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in reply.choices[0].message.content


def test_openai_completions(oai):
    reply = oai.completions.create(model="any", prompt=FRANCE, max_tokens=8, temperature=0)
    assert reply.choices[0].text.startswith(" Paris") and reply.usage.completion_tokens == 8
    streamed = list(oai.completions.create(model="any", prompt=FRANCE, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_openai_sse_framing(served):
    response, blocks = stream(served, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0})
    assert blocks[-1] == "[DONE]"
    chunks = [json.loads(b) for b in blocks[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


def test_openai_errors_reach_the_sdk(oai):
    with pytest.raises(openai.BadRequestError, match="temperature: expected a number between 0 and 5"):
        oai.chat.completions.create(model="any", messages=MESSAGES, temperature=9)
    with pytest.raises(openai.BadRequestError, match="n: expected an integer between 1 and 8"):
        oai.chat.completions.create(model="any", messages=MESSAGES, n=9)
    with pytest.raises(openai.BadRequestError, match="tools: the chat template of .* has no Kimi K2 or K3 tool-call section"):
        oai.chat.completions.create(model="any", messages=MESSAGES, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])


# -- errors ----------------------------------------------------------------------------------

LONG = "hello " * 600  # 600 tokens, more than N_CTX


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/completion", b"{not json", "request body: not valid JSON"),
        ("/completion", b"[" * 5_000, "request body: JSON nested too deeply"),
        ("/completion", b"[1, 2]", "request body: expected a JSON object"),
        ("/completion", b"", "request body: expected a JSON object, got an empty body"),
        ("/completion", {"n_predict": 4}, "prompt: required"),
        ("/completion", {"prompt": 5}, "prompt: expected a string or a list of token ids"),
        ("/completion", {"prompt": [1, -3]}, "prompt[1]: expected a token id between 0 and 49151"),
        ("/completion", {"prompt": [{"text": "a"}]}, 'prompt[0]: expected {"prompt_string": text}'),
        ("/completion", {"prompt": ["a"] * 17}, "prompt: at most 16 prompts per request"),
        ("/completion", {"prompt": "x", "temperature": "hot"}, 'temperature: expected a number between 0 and 5, got "hot"'),
        ("/completion", {"prompt": "x", "temperature": 9}, "temperature: expected a number between 0 and 5, got 9"),
        ("/completion", {"prompt": "x", "top_p": 1.5}, "top_p: expected a number between 0 and 1"),
        ("/completion", {"prompt": "x", "top_k": -1}, "top_k: expected an integer between 0 and"),
        ("/completion", {"prompt": "x", "n_predict": 2.5}, "n_predict: expected an integer between -1 and 200"),
        ("/completion", {"prompt": "x", "n_predict": -2}, "n_predict: expected an integer between -1 and 200, got -2"),
        ("/completion", {"prompt": "x", "seed": "abc"}, "seed: expected an integer"),
        ("/completion", {"prompt": "x", "stream": "yes"}, "stream: expected true or false"),
        ("/completion", {"prompt": "x", "stop": [1]}, "stop: expected a string or a list of strings"),
        ("/completion", {"prompt": "x", "grammar": "root ::= x"}, "grammar: llama.cpp refused the grammar: Undefined rule identifier 'x'"),
        ("/completion", {"prompt": "x", "json_schema": {"type": "object"}, "grammar": "root ::= \"a\""}, "json_schema: give one of"),
        ("/completion", {"prompt": "x", "logit_bias": [[1, "up"]]}, "logit_bias[0]: expected a bias between -100 and 100 or false"),
        ("/completion", {"prompt": "x", "logit_bias": [[99999999, 1]]}, "logit_bias[0]: token id 99999999 is outside the vocabulary"),
        ("/completion", {"prompt": "x", "n_probs": 1000}, "n_probs: expected an integer between 0 and 100"),
        ("/completion", {"prompt": "x", "presence_penalty": 3}, "presence_penalty: expected a number between -2 and 2"),
        ("/completion", {"prompt": "x", "lora": [{"id": 0, "scale": 1.0}]}, "lora: not supported by kimitui"),
        ("/completion", {"prompt": "x", "id_slot": 1}, "id_slot: expected an integer between -1 and 0, got 1"),
        ("/completion", {"prompt": "x", "return_progress": True}, "return_progress: prompt progress is sent on a streamed reply only"),
        ("/completion", {"prompt": ""}, "prompt: the prompt is empty"),
        ("/completion", {"prompt": LONG}, f"prompt: the prompt is 601 tokens; the context holds {N_CTX}"),
        ("/completion", {"prompt": LONG, "stream": True}, "prompt: the prompt is 601 tokens"),
        ("/tokenize", {"content": 3}, "content: expected a string"),
        ("/tokenize", {}, "content: required"),
        ("/detokenize", {"tokens": [1, 99999999]}, "tokens[1]: expected a token id between 0 and 49151"),
        ("/detokenize", {"tokens": "abc"}, "tokens: expected a list of token ids"),
        ("/v1/chat/completions", {}, "messages: required"),
        ("/v1/chat/completions", {"messages": []}, "messages: expected a non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role: expected one of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 4}]}, "messages[0].content: expected a string"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0]: only text parts"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens: expected an integer between 1 and 200"),
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "yaml"}}, "response_format.type: expected text, json_object or json_schema"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs: needs logprobs: true"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"x": "up"}}, "logit_bias.x: expected a bias between -100 and 100"),
        ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0]: expected"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
         "tools: the chat template of SmolLM2-135M-Instruct"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages: the prompt is"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens: expected an integer between 1 and 200"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo: not supported"),
    ],
)
def test_bad_requests_get_400_naming_the_field(served, path, body, message):
    if isinstance(body, bytes):
        response = httpx.post(served.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=TIMEOUT)
    else:
        response = post(served, path, body)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    too_long = "the prompt is" in message and "empty" not in message  # llama-server's own type, with the counts clients read
    assert error["code"] == 400 and error["type"] == ("exceed_context_size_error" if too_long else "invalid_request_error")
    assert error["message"].startswith(message), error["message"]
    if too_long:
        assert error["n_prompt_tokens"] > error["n_ctx"] - 16 and error["n_ctx"] == N_CTX


def test_unknown_route_wrong_method_and_large_body(served):
    missing = httpx.get(served.url + "/v2/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"] == {"code": 404, "type": "not_found_error", "message": "no route /v2/nothing"}
    wrong = httpx.get(served.url + "/completion")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["message"] == "GET is not allowed on /completion"
    huge = post(served, "/completion", {"prompt": "x" * 20_000})
    assert huge.status_code == 413
    assert huge.json()["error"]["message"] == "request body too large"
    # Chunked upload without Content-Length: counted as it arrives.
    chunked = httpx.post(
        served.url + "/completion", content=iter([b'{"prompt": "', b"x" * 20_000, b'"}']),
        headers={"Content-Type": "application/json"}, timeout=TIMEOUT,
    )
    assert chunked.status_code == 413


def test_not_ready_engine_answers_503(served):
    idle = Engine(default_model_path())  # never loaded
    server = ServerThread(create_app(idle, served.settings), bind_socket("127.0.0.1", 0)).start()
    try:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "loading model"
        completion = httpx.post(server.url + "/completion", json={"prompt": "x"})
        assert completion.status_code == 503
        assert completion.json()["error"]["message"] == "the model is still loading"
        assert httpx.get(server.url + "/v1/models").status_code == 503
    finally:
        server.stop()


# -- auth ------------------------------------------------------------------------------------


def test_api_key(served):
    url = served.keyed_url
    body = {"prompt": FRANCE, "n_predict": 2, "temperature": 0}
    missing = httpx.post(url + "/completion", json=body)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert missing.headers["www-authenticate"] == "Bearer"
    assert httpx.post(url + "/completion", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(url + "/completion", json=body, headers={"Authorization": KEY}).status_code == 401
    assert httpx.get(url + "/nowhere").status_code == 401  # routes are not revealed without the key
    assert httpx.post(url + "/completion", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT).status_code == 200
    assert httpx.get(url + "/metrics", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(url + "/health").json() == {"status": "ok"}  # open, as in llama-server
    client = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    assert [m.id for m in client.models.list()]  # public, as in llama-server
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="m", prompt=FRANCE, max_tokens=2)
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
    assert client.completions.create(model="m", prompt=FRANCE, max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_non_loopback_needs_a_key():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.5"):
        check_bind(host, None)
    check_bind("0.0.0.0", "key")
    for host in ("0.0.0.0", "::", "192.168.1.10", "myhost.example"):
        with pytest.raises(UserError, match=f"refusing to listen on {host} without an API key"):
            check_bind(host, "")


# -- one engine, many clients ----------------------------------------------------------------

PROMPTS = [f"{word} is a word that" for word in ("Apple", "Banana", "Cherry", "Dog", "Eagle", "Forest", "Guitar", "House")]


def test_concurrent_clients_queue_and_get_their_own_answers(served):
    expected = [post(served, "/completion", {"prompt": p, "n_predict": 12, "temperature": 0}).json()["content"] for p in PROMPTS]
    results: list[str | None] = [None] * len(PROMPTS)
    positions: list[int | None] = [None] * len(PROMPTS)
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            body = {"prompt": PROMPTS[i], "n_predict": 12, "temperature": 0}
            if i % 2:  # half stream, half do not
                response, blocks = stream(served, "/completion", body)
                results[i] = "".join(json.loads(b)["content"] for b in blocks)
            else:
                response = post(served, "/completion", body)
                results[i] = response.json()["content"]
            positions[i] = int(response.headers["X-Queue-Position"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    with engine_held(served.engine):
        for t in threads:
            t.start()
        wait_for(lambda: served.engine.turns.waiting == 1 + len(PROMPTS), "all clients queued behind the held engine")
        props = httpx.get(served.url + "/props").json()
        assert props["queue"] == {"processing": 1, "deferred": len(PROMPTS)}
        metrics = prom.parse(httpx.get(served.url + "/metrics").text)
        assert metrics["llamacpp:requests_deferred"] == len(PROMPTS)
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    assert results == expected  # complete, and nobody got another's tokens
    assert all(p is not None and p >= 1 for p in positions)  # all arrived while the engine was busy


def test_a_burst_on_an_idle_engine_gets_distinct_queue_positions(served):
    """Requests arriving together, before any has taken its turn (that happens on its reply's
    thread), are told 0, 1, 2; a request given up before it started counts for nobody."""
    from types import SimpleNamespace

    from kimitui.server.decoding import Decoder

    decoder = Decoder(served.engine)
    tokens = served.engine.tokenize(FRANCE)

    def arrive():
        request = SimpleNamespace(state=SimpleNamespace())
        generation, headers = decoder.start(request, tokens, Sampling(temperature=0, max_tokens=2))
        return generation, int(headers["X-Queue-Position"])

    burst = [arrive() for _ in range(3)]
    assert [position for _, position in burst] == [0, 1, 2]
    for generation, _ in burst[1:]:
        generation.cancel()  # their clients left before the stream began
    assert arrive()[1] == 1  # behind the first one only
    first = burst[0][0]
    assert "".join(e.text for e in first)  # it takes its turn and runs
    del burst, first
    import gc

    gc.collect()
    assert arrive()[1] == 0


def test_stream_disconnect_frees_the_engine(served):
    """Closing a stream mid-reply cancels it: far fewer tokens than asked, engine free again."""
    before = served.engine.metrics.view()["tokens_total"]
    with httpx.stream("POST", served.url + "/completion", timeout=TIMEOUT,
                      json={"prompt": FRANCE, "n_predict": MAX_N_PREDICT, "temperature": 0, "stream": True}) as response:
        lines = response.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
    wait_for(lambda: served.engine.turns.waiting == 0, "the engine to be free")
    generated = served.engine.metrics.view()["tokens_total"] - before
    # At temperature 0 this prompt runs the full 200 tokens when nobody leaves (see FRANCE).
    assert 3 <= generated < MAX_N_PREDICT


def test_queued_clients_that_leave_give_up_their_turn(served):
    with engine_held(served.engine):
        # A streamed request waiting in line, then gone.
        with httpx.stream("POST", served.url + "/completion", timeout=TIMEOUT,
                          json={"prompt": FRANCE, "n_predict": 5, "stream": True}) as response:
            assert response.headers["X-Queue-Position"] == "1"
            wait_for(lambda: served.engine.turns.waiting == 2, "the streamed request to queue")
        wait_for(lambda: served.engine.turns.waiting == 1, "the streamed request to leave the line")
        # A non-streamed one whose client times out.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/completion", json={"prompt": FRANCE, "n_predict": 5}, timeout=httpx.Timeout(10, read=1.0))
        wait_for(lambda: served.engine.turns.waiting == 1, "the non-streamed request to leave the line")
    assert served.engine.turns.waiting == 0
    assert post(served, "/completion", {"prompt": FRANCE, "n_predict": 2, "temperature": 0}).json()["tokens_predicted"] == 2


# -- kimitui serve ---------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    """No API key from the environment (conftest already isolates the config file)."""
    monkeypatch.delenv("KIMITUI_API_KEY", raising=False)


def test_serve_refuses_public_host_without_key(clean_env, capsys):
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("kimitui: refusing to listen on 0.0.0.0 without an API key")


def test_serve_one_line_errors(clean_env, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kimitui: cannot listen on 127.0.0.1:{port}: ") and err.count("\n") == 1
    assert main(["serve", "--port", "http"]) == 2
    assert capsys.readouterr().err == "kimitui: --port: expected an integer, got 'http'\n"
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port: 70000 is above the maximum 65535" in capsys.readouterr().err


def test_serve_headless_process(clean_env, tmp_path):
    """`kimitui serve` as a user runs it: prints its URL, answers, traces, stops cleanly on Ctrl-C."""
    log, trace = tmp_path / "serve.log", tmp_path / "serve-trace.jsonl"
    env = {**os.environ, "KIMITUI_API_KEY": KEY}
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "kimitui", "serve", "--port", "0", "--host", "0.0.0.0", "--n-ctx", "512", "--threads", "1",
             "--trace", str(trace)],
            stdout=sink, stderr=sink, env=env,
        )
    try:
        wait_for(lambda: "serving" in log.read_text() or process.poll() is not None, "the serving line", 60)
        line = next(l for l in log.read_text().splitlines() if "serving" in l)
        assert "API key required" in line
        port = int(line.split("http://0.0.0.0:")[1].split()[0])
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200, "the model to load")
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(url + "/completion", json={"prompt": "x"}).status_code == 401
        reply = httpx.post(url + "/completion", json={"prompt": FRANCE, "n_predict": 3, "temperature": 0}, headers=headers, timeout=TIMEOUT)
        assert reply.json()["tokens_predicted"] == 3
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(60)
    # uvicorn re-raises the Ctrl-C it caught once it has shut down; main() turns that into 130.
    assert code in (0, 130), log.read_text()
    assert "Traceback" not in log.read_text()
    (request,) = read_trace([trace]).requests
    assert len(request.tokens) == 3 and request.end["type"] == "end"


def test_requests_refused_at_the_door_are_reported_too(served):
    refused = httpx.get(served.url + "/props", headers={"Host": "rebound.example"}, timeout=TIMEOUT)
    assert refused.status_code == 403
    wait_for(lambda: any(r["path"] == "/props" and r["status"] == 403 for r in served.records), "the 403 in on_request")


def test_serve_listens_on_several_addresses(clean_env, tmp_path):
    """`--host 127.0.0.1,::1`: one port on both loopbacks, each answering under its own name."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "kimitui", "serve", "--port", "0", "--host", "127.0.0.1,::1", "--n-ctx", "512", "--threads", "1"],
            stdout=sink, stderr=sink, env=dict(os.environ),
        )
    try:
        wait_for(lambda: "serving" in log.read_text() or process.poll() is not None, "the serving line", 60)
        line = next(l for l in log.read_text().splitlines() if "serving" in l)
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        assert f"and http://[::1]:{port}" in line
        for url in (f"http://127.0.0.1:{port}", f"http://[::1]:{port}"):
            wait_for(lambda: httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200, "the model to load")
            reply = httpx.post(url + "/completion", json={"prompt": FRANCE, "n_predict": 2, "temperature": 0}, timeout=TIMEOUT)
            assert reply.json()["tokens_predicted"] == 2
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(60)
    assert code in (0, 130), log.read_text()


def test_bind_all_is_all_or_none_and_pairs_wildcards():
    from kimitui.server.runner import bind_all

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(UserError, match="cannot listen on no-such-host.invalid"):
        bind_all(["127.0.0.1", "no-such-host.invalid"], port)
    again = bind_all(["127.0.0.1"], port)  # the first socket was given back
    again[0].close()
    try:
        pair = bind_all(["0.0.0.0", "::"], 0)  # IPv6-only beside IPv4 on one port, not a clash
    except UserError as exc:
        if "::" not in str(exc):
            raise
        pytest.skip("no IPv6 here")
    assert len({s.getsockname()[1] for s in pair}) == 1
    for s in pair:
        s.close()
