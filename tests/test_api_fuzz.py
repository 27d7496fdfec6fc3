"""The fault suite that keeps finding them: random and malformed bodies (types, sizes, unicode,
huge numbers, broken JSON) sent over loopback HTTP to the real server on the real default model.
Whatever arrives, the answer is never a 5xx, no read of it waits past a bound, and the server
still answers a plain request afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kimitui.config import load_settings
from kimitui.engine.session import Engine
from kimitui.server.app import create_app
from kimitui.server.runner import ServerThread, bind_socket

BOUND_S = 60.0  # no read of a reply waits longer (max_n_predict is small here)

ROUTES = {
    "/completion": ["prompt", "n_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stream", "n_probs",
                    "logit_bias", "grammar", "json_schema", "cache_prompt", "id_slot", "return_progress", "post_sampling_probs",
                    "response_fields", "return_tokens", "repeat_penalty", "timings_per_token", "lora", "mirostat"],
    "/v1/completions": ["prompt", "max_tokens", "n", "logprobs", "echo", "suffix", "best_of", "stream", "stream_options",
                        "temperature", "seed", "stop", "logit_bias", "response_format"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs", "stream",
                             "tools", "tool_choice", "parallel_tool_calls", "response_format", "temperature", "seed", "stop",
                             "add_generation_prompt", "continue_final_message", "presence_penalty", "frequency_penalty"],
    "/tokenize": ["content", "add_special", "parse_special", "with_pieces"],
    "/detokenize": ["tokens"],
    "/apply-template": ["messages"],
    "/v1/chat/completions/input_tokens": ["messages", "tools"],
    "/v1/messages": ["messages", "system", "max_tokens", "stop_sequences", "stream", "tools", "tool_choice", "temperature", "top_k",
                     "thinking", "metadata"],
    "/v1/messages/count_tokens": ["messages", "system", "tools"],
    "/v1/responses": ["input", "instructions", "max_output_tokens", "previous_response_id", "store", "text", "tools", "tool_choice",
                      "stream", "temperature", "background", "n"],
    "/slots/0?action=save": ["filename"],
    "/slots/0?action=restore": ["filename"],
}

scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40) | st.sampled_from(["", "Hello", "\u0000", "\ud7ff\U0001f600", "user", "assistant", "system", "tool",
                                             "json_object", "text", "json_schema", "root ::= \"a\"", "root ::= [", "auto"])
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "robot"]) | json_values},
    optional={"content": st.text(max_size=60) | json_values, "tool_calls": json_values, "tool_call_id": json_values, "name": json_values},
)


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(ROUTES)))
    kind = draw(st.sampled_from(["fields", "fields", "fields", "raw", "huge"]))
    if kind == "raw":
        return path, draw(st.binary(max_size=200) | st.sampled_from([b"", b"{", b"[1,2]", b"null", b'{"prompt": "a"', b"\xff\xfe"]))
    if kind == "huge":
        return path, b'{"prompt": "hi", "messages": [], "n_predict": ' + b"7" * draw(st.integers(4000, 6000)) + b"}"
    fields = ROUTES[path]
    # A valid request for the route, then a few of its fields replaced by anything: most bodies
    # reach deep into parsing and many reach the engine, instead of failing at the first field.
    body = dict(VALID[path])
    body.update(draw(st.dictionaries(st.sampled_from(fields), json_values | plausible, max_size=4)))
    if "messages" in fields and draw(st.booleans()):
        body["messages"] = draw(st.lists(message, min_size=1, max_size=3))
    if "input" in fields and draw(st.booleans()):
        body["input"] = draw(st.text(max_size=60) | st.lists(message | json_values, min_size=1, max_size=3))
    if "prompt" in fields and draw(st.booleans()):
        body["prompt"] = draw(st.text(max_size=80) | st.lists(st.integers(-5, 60000), max_size=8))
    return path, json.dumps(body, allow_nan=True).encode()


HELLO = [{"role": "user", "content": "Hello"}]
VALID = {
    "/completion": {"prompt": "Hello", "n_predict": 4},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 4},
    "/v1/chat/completions": {"messages": HELLO, "max_tokens": 4},
    "/tokenize": {"content": "Hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/apply-template": {"messages": HELLO},
    "/v1/chat/completions/input_tokens": {"messages": HELLO},
    "/v1/messages": {"messages": HELLO, "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": HELLO},
    "/v1/responses": {"input": "Hello", "max_output_tokens": 4},
    "/slots/0?action=save": {"filename": "fuzz.bin"},
    "/slots/0?action=restore": {"filename": "fuzz.bin"},
}
plausible = st.integers(-2, 40) | st.floats(0, 2) | st.booleans() | st.sampled_from([[], {}, ["a"], {"type": "json_object"}])


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("fuzz")
    config = home / "config.toml"
    config.write_text(f'[model]\nn_ctx = 512\n[server]\nmax_n_predict = 8\nslot_save_path = "{home}"\n')
    engine = Engine(model_path, n_ctx=512)
    engine.load()
    running = ServerThread(create_app(engine, load_settings(config, explicit=True)), bind_socket("127.0.0.1", 0)).start()
    with httpx.Client(base_url=running.url, timeout=BOUND_S) as client:
        yield client
    running.stop()
    engine.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(bodies())
def test_no_body_gets_a_5xx_or_hangs(server, request_body):
    path, raw = request_body
    with server.stream("POST", path, content=raw, headers={"Content-Type": "application/json"}) as response:
        text = response.read().decode("utf-8", errors="replace")  # a timeout past BOUND_S fails the test
    event(f"{path} {response.status_code}")  # pytest --hypothesis-show-statistics: how deep the bodies reach
    assert response.status_code < 500, f"{path} {raw[:200]!r}: {response.status_code} {text[:300]}"
    if response.status_code >= 400:
        error = json.loads(text)["error"]  # llama-server's shape, and Anthropic's on its routes
        assert error["message"] and "\n" not in error["message"]
    else:
        assert "server_error" not in text, f"{path} {raw[:200]!r}: {text[:300]}"
    assert server.get("/health").status_code == 200  # and it still answers
