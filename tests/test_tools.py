"""Tool calls in the Kimi K2/K3 format over loopback HTTP, on the real engine: the tools reach
the chat template, a required or named call is made by grammar with arguments its schema
accepts, the reply is read back into OpenAI's tool_calls (streamed and not), the next turn with
the call and the tool's answer renders, and a template without the format is refused in one
line. The template is a Kimi-layout one written for the tests (tests/data/kimi_tools.jinja);
the default model and a streamed Kimi K3 cut speak it."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import requests

from kimitui.config import load_settings
from kimitui.engine.session import Engine
from kimitui.model import default_model_path, synth
from kimitui.server.app import create_app
from kimitui.server.runner import ServerThread, bind_socket
from kimitui.server.tools import read_calls, tool_format

TEMPLATE = (Path(__file__).parent / "data" / "kimi_tools.jinja").read_text()  # Kimi K2's format
K3_TEMPLATE = (Path(__file__).parent / "data" / "kimi_k3_tools.jinja").read_text()  # Kimi K3's tags
TIMEOUT = 180.0
MIB = 2**20
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def serve(path: Path, tmp_path: Path, budget: int | None = None, template: str = TEMPLATE):
    config = tmp_path / "config.toml"
    config.write_text("[model]\nn_ctx = 1024\nn_threads = 1\n[server]\nmax_n_predict = 160\n")
    settings = load_settings(config, explicit=True)
    engine = Engine(path, n_ctx=1024, n_threads=1, budget=budget, chat_template=template)
    engine.load()
    engine.pin()
    return engine, ServerThread(create_app(engine, settings), bind_socket("127.0.0.1", 0)).start()


@pytest.fixture(scope="module")
def kimi_server(tmp_path_factory):
    engine, server = serve(default_model_path(), tmp_path_factory.mktemp("tools"))
    yield server
    server.stop()
    engine.close()


def test_a_required_call_is_made_and_read_back(kimi_server):
    client = openai.OpenAI(base_url=kimi_server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    reply = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=160, temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    several = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=160, temperature=0)
    # Parallel calls (OpenAI's default): as many as the model makes; this one goes on to the token limit.
    assert several.choices[0].message.tool_calls and several.choices[0].finish_reason in ("tool_calls", "length")
    for call in choice.message.tool_calls + several.choices[0].message.tool_calls:
        assert call.function.name in ("get_weather", "get_time") and call.id.startswith(f"functions.{call.function.name}:")
        arguments = json.loads(call.function.arguments)
        assert isinstance(arguments["city"], str) if call.function.name == "get_weather" else isinstance(arguments["zone"], int)
    named = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=160, temperature=0,
    )
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time" and isinstance(json.loads(calls[0].function.arguments)["zone"], int)


def test_a_streamed_call_arrives_as_openai_chunks(kimi_server):
    with requests.post(kimi_server.url + "/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 160, "temperature": 0, "stream": True,
    }, stream=True, timeout=TIMEOUT) as response:
        lines = [line[len(b"data: "):] for line in response.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert calls and calls[0]["function"]["name"] == "get_weather" and "city" in json.loads(calls[0]["function"]["arguments"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_next_turn_renders_the_call_and_the_answer(kimi_server):
    call = {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny, 21 C"},
    ]
    prompt = requests.post(kimi_server.url + "/apply-template", json={"messages": history}, timeout=TIMEOUT).json()["prompt"]
    assert '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>' in prompt
    assert "## Return of functions.get_weather:0\nSunny, 21 C" in prompt
    reply = requests.post(kimi_server.url + "/v1/chat/completions", json={
        "messages": history, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 8, "temperature": 0,
    }, timeout=TIMEOUT).json()
    assert reply["choices"][0]["message"]["role"] == "assistant" and "tool_calls" not in reply["choices"][0]["message"]


def test_bad_tool_requests_name_the_field(kimi_server):
    cases = [
        ({"tools": [{"type": "function"}]}, "tools[0]: expected"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name: expected 1 to 64"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 'tool_choice.function.name: "nope" is not one'),
        ({"tool_choice": "required"}, "tool_choice: required needs tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "grammar": 'root ::= "x"'}, "tool_choice: required makes its own grammar"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id: required"),
    ]
    for extra, message in cases:
        got = requests.post(kimi_server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra}, timeout=TIMEOUT)
        assert got.status_code == 400 and got.json()["error"]["message"].startswith(message), (extra, got.text)


@pytest.mark.parametrize("template", [TEMPLATE, K3_TEMPLATE], ids=["k2-format", "k3-format"])
def test_a_streamed_kimi_k3_calls_a_tool(tmp_path, template):
    """Both formats on the kimi-k3 architecture, streamed under a budget far below its size."""
    spec = synth.plan_like("kimi-k3", None, 0.02, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
    path = synth.write_model(spec, tmp_path / "k3.gguf", seed=3, progress=False).paths[0]
    engine, server = serve(path, tmp_path, budget=12 * MIB, template=template)
    try:
        assert engine.streamer is not None
        reply = requests.post(server.url + "/v1/chat/completions", json={
            "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 160, "temperature": 0,
        }, timeout=TIMEOUT).json()
        calls = reply["choices"][0]["message"]["tool_calls"]
        assert reply["choices"][0]["finish_reason"] == "tool_calls" and calls[0]["function"]["name"] == "get_weather"
        assert isinstance(json.loads(calls[0]["function"]["arguments"])["city"], str)
        assert reply["choices"][0]["message"]["content"] is None  # no markup of the format left in it
        free = requests.post(server.url + "/v1/chat/completions", json={
            "messages": ASK, "tools": [WEATHER], "max_tokens": 12, "temperature": 0,
        }, timeout=TIMEOUT).json()["choices"][0]["message"]
        assert "<|open|>" not in (free["content"] or "") and "<|close|>" not in (free["content"] or "")
    finally:
        server.stop()
        engine.close()


def test_reading_a_reply_with_content_and_two_calls():
    text = ("Let me look. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"zone": 2}'
            "<|tool_call_end|><|tool_calls_section_end|>")
    content, calls = read_calls(text)
    assert content == "Let me look. "
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris"}), ("functions.get_time:1", "get_time", {"zone": 2}),
    ]
    assert read_calls("no calls here") == ("no calls here", [])


def test_reading_a_kimi_k3_reply():
    text = ("<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>"
            '<|open|>call tool="get_weather" index="1"<|sep|><|open|>json type="object"<|sep|>{"city": "Paris"}<|close|>json<|sep|><|close|>call<|sep|>'
            '<|open|>call tool="get_time" index="2"<|sep|><|open|>argument key="zone" type="number"<|sep|>2<|close|>argument<|sep|>'
            '<|open|>argument key="label" type="string"<|sep|>a "b"<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
    content, calls = read_calls(text, "k3")
    assert content == "Checking."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("functions.get_weather:1", "get_weather", {"city": "Paris"}), ("functions.get_time:2", "get_time", {"zone": 2, "label": 'a "b"'}),
    ]
    assert tool_format(K3_TEMPLATE) == "k3" and tool_format(TEMPLATE) == "k2" and tool_format("{{ messages }}") is None


def test_tools_sharing_definition_names_keep_their_own_and_a_bad_schema_is_a_400(kimi_server):
    item = lambda kind: {"type": "object", "properties": {"v": {"$ref": "#/$defs/Item"}}, "required": ["v"], "$defs": {"Item": {"type": kind}}}  # noqa: E731
    counts = {"type": "function", "function": {"name": "count", "parameters": item("integer")}}
    words = {"type": "function", "function": {"name": "say", "parameters": item("string")}}
    for name, kind in (("count", int), ("say", str)):
        reply = requests.post(kimi_server.url + "/v1/chat/completions", json={
            "messages": ASK, "tools": [counts, words], "tool_choice": {"type": "function", "function": {"name": name}},
            "max_tokens": 160, "temperature": 0,
        }, timeout=TIMEOUT).json()
        call = reply["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == name and isinstance(json.loads(call["function"]["arguments"])["v"], kind)
    loop = {"type": "function", "function": {"name": "loop", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": {"a": {"$ref": "#/$defs/a"}}}}}
    got = requests.post(kimi_server.url + "/v1/chat/completions", json={"messages": ASK, "tools": [loop], "tool_choice": "required"}, timeout=TIMEOUT)
    assert got.status_code == 400 and got.json()["error"]["message"].startswith("tools"), got.text
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "properties": {"x": {"type": "wibble"}}}}}
    got = requests.post(kimi_server.url + "/v1/chat/completions", json={"messages": ASK, "tools": [odd], "tool_choice": "required"}, timeout=TIMEOUT)
    assert got.status_code == 400 and got.json()["error"]["message"].startswith("tools[0].function.parameters"), got.text
    prompt = requests.post(kimi_server.url + "/apply-template", json={"messages": ASK}, timeout=TIMEOUT).json()["prompt"]
    assert "tool_declare" not in prompt  # no tools, nothing declared (the template's .append ran on an empty list)
