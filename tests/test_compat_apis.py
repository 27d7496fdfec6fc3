"""What today's clients speak, on the real engine over loopback HTTP: Anthropic's Messages API
through the anthropic SDK and raw HTTP, OpenAI's Responses API through the openai SDK and raw
HTTP (each greedy reply equal to the same request on /v1/chat/completions), ignore_eos and the
sampling fields kimitui honours or refuses by name, saved slots across a server restart, and
context shift (and its refusal where the model's memory cannot shift)."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from kimitui.config import load_settings
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.model import default_model_path, synth
from kimitui.server.app import create_app
from kimitui.server.runner import ServerThread, bind_socket

TEMPLATE = (Path(__file__).parent / "data" / "kimi_tools.jinja").read_text()  # Kimi K2's tool format, on the default model
TIMEOUT = 180.0
GREEDY = {"temperature": 0}
SYSTEM, ASK = "You are terse.", "Say hello"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}


def serve(tmp_path: Path, *, path: Path | None = None, config: str = "", template: str | None = TEMPLATE, **engine):
    file = tmp_path / "config.toml"
    file.write_text("[model]\nn_ctx = 1024\nn_threads = 1\n[server]\nmax_n_predict = 160\n" + config)
    settings = load_settings(file, explicit=True)
    engine = Engine(path or default_model_path(), n_ctx=engine.pop("n_ctx", 1024), n_threads=1, chat_template=template, **engine)
    engine.load()
    engine.pin()
    return engine, ServerThread(create_app(engine, settings), bind_socket("127.0.0.1", 0)).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine, thread = serve(tmp_path_factory.mktemp("compat"))
    yield thread
    thread.stop()
    engine.close()


def chat(server, messages: list[dict], **extra) -> dict:
    body = {"messages": messages, "max_tokens": 24, **GREEDY, "cache_prompt": False, **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT).json()


def sse(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    events, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:") and line[5:].strip() != "[DONE]":
            events.append((name, json.loads(line[5:])))
    return events


# -- Anthropic Messages ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=TIMEOUT)


def test_messages_equal_chat_completions_through_the_sdk(server, claude):
    expected = chat(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])["choices"][0]
    message = claude.messages.create(
        model="m", max_tokens=24, system=SYSTEM, messages=[{"role": "user", "content": ASK}], extra_body={**GREEDY, "cache_prompt": False},
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "text" and message.content[0].text == expected["message"]["content"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected["finish_reason"]]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 0 and message.usage.output_tokens > 0
    # Streamed through the SDK: the same text, the same end.
    with claude.messages.stream(
        model="m", max_tokens=24, system=[{"type": "text", "text": SYSTEM}], messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}],
        extra_body={**GREEDY, "cache_prompt": False},
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected["message"]["content"] == final.content[0].text
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens


def test_messages_stream_follows_anthropics_event_sequence(server):
    body = {"max_tokens": 12, "messages": [{"role": "user", "content": ASK}], "stream": True, **GREEDY}
    events = sse(httpx.post(server.url + "/v1/messages", json=body, timeout=TIMEOUT))
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert names[0] == "message_start" and names[1] == "content_block_start" and names[-2:] == ["message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"} and names[-3] == "content_block_stop"
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] > 0 and start["stop_reason"] is None
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] > 0
    assert "timings" not in events[-1][1]


def test_stop_sequences_and_count_tokens(server, claude):
    ask = {"model": "m", "max_tokens": 24, "system": SYSTEM, "messages": [{"role": "user", "content": ASK}], "extra_body": GREEDY}
    free = claude.messages.create(**ask)
    word = free.content[0].text.split()[2]  # a word the greedy reply reaches
    cut = claude.messages.create(**ask, stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word and word not in cut.content[0].text
    counted = claude.messages.count_tokens(model="m", system=SYSTEM, messages=[{"role": "user", "content": ASK}])
    same = httpx.post(server.url + "/v1/chat/completions/input_tokens", json={"messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]}, timeout=TIMEOUT).json()
    assert counted.input_tokens == same["input_tokens"] > 0


def test_tool_use_and_tool_results(server, claude):
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    one = {"type": "any", "disable_parallel_tool_use": True}
    called = claude.messages.create(model="m", max_tokens=160, tools=[tool], tool_choice=one, messages=ask, extra_body=GREEDY)
    uses = [block for block in called.content if block.type == "tool_use"]
    assert called.stop_reason == "tool_use" and uses and uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
    named = claude.messages.create(
        model="m", max_tokens=160, tools=[tool], tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=ask, extra_body=GREEDY,
    )
    assert [block.type for block in named.content] == ["tool_use"]
    # The same call made through chat completions: the same arguments.
    expected = chat(server, ask, max_tokens=160, tools=[{"type": "function", "function": {"name": "get_weather", "description": tool["description"],
                    "parameters": WEATHER_SCHEMA}}], tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    assert named.content[0].input == json.loads(expected["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    # Streamed: the call arrives as a tool_use block with its input as JSON.
    with claude.messages.stream(model="m", max_tokens=160, tools=[tool], tool_choice=one, messages=ask, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.input for b in final.content if b.type == "tool_use"] == [u.input for u in uses]
    # The next turn: the call and its result (an error said in words), with text after it.
    turn = ask + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": [{"type": "text", "text": "Sunny, 21 C"}]},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ]
    answered = claude.messages.create(model="m", max_tokens=8, tools=[tool], messages=turn, extra_body=GREEDY)
    assert answered.content[0].type == "text"
    rendered = httpx.post(server.url + "/apply-template", json={"messages": [
        *ask, {"role": "assistant", "content": "", "tool_calls": [{"id": uses[0].id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(uses[0].input)}}]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "Sunny, 21 C"}, {"role": "user", "content": "And tomorrow?"},
    ]}, timeout=TIMEOUT).json()["prompt"]
    assert "Sunny, 21 C" in rendered


@pytest.mark.parametrize("body, status, kind, says", [
    ({"max_tokens": 8}, 400, "invalid_request_error", "messages: required"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "messages[0].content[0]: image blocks are not supported"),
    ({"max_tokens": 8, "messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request_error", "messages[0].role: expected user or assistant"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "max_tokens: expected an integer"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "web"}]}, 400,
     "invalid_request_error", "tools[0].type: web_search_20250305 is one of Anthropic's server tools"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x" * 6000}]}, 400, "invalid_request_error", "messages: the prompt is"),
])
def test_messages_errors_in_anthropics_shape(server, claude, body, status, kind, says):
    response = httpx.post(server.url + "/v1/messages", json=body, timeout=TIMEOUT)
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"].startswith(says), error
    if "messages" in body:
        with pytest.raises(anthropic.BadRequestError) as raised:  # and the SDK raises its own class for it
            claude.messages.create(model="m", **body)
        assert says in str(raised.value)


# -- OpenAI Responses -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def test_responses_equal_chat_completions_through_the_sdk(server, client):
    expected = chat(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}], max_tokens=16)["choices"][0]
    response = client.responses.create(model="m", instructions=SYSTEM, input=ASK, max_output_tokens=16, temperature=0,
                                       extra_body={"cache_prompt": False})
    assert response.id.startswith("resp_") and response.output[0].id.startswith("msg_")
    assert response.output_text == expected["message"]["content"]
    assert response.status == ("incomplete" if expected["finish_reason"] == "length" else "completed")
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    # Items in, streamed out: deltas add up to what the final event holds.
    stream = client.responses.create(
        model="m", input=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
        max_output_tokens=16, temperature=0, stream=True, extra_body={"cache_prompt": False},
    )
    events = list(stream)
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == expected["message"]["content"] == events[-1].response.output_text
    assert events[-1].type == "response.completed" and events[-1].response.status == response.status
    message_id = next(e.item.id for e in events if e.type == "response.output_item.added")
    assert all(e.item_id == message_id for e in events if e.type.startswith(("response.output_text", "response.content_part")))


def test_previous_response_id_continues_the_conversation(server, client):
    first = client.responses.create(model="m", input="Name a colour.", max_output_tokens=8, temperature=0)
    second = client.responses.create(model="m", input="Another one?", previous_response_id=first.id, max_output_tokens=8, temperature=0,
                                     extra_body={"cache_prompt": False})
    expected = chat(server, [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text},
                             {"role": "user", "content": "Another one?"}], max_tokens=8)
    assert second.output_text == expected["choices"][0]["message"]["content"]
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model="m", input="x", previous_response_id="resp_unknown")
    unkept = client.responses.create(model="m", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="y", previous_response_id=unkept.id)


def test_responses_function_calls_and_formats(server, client):
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_SCHEMA}
    called = client.responses.create(model="m", input="What is the weather in Paris?", tools=[tool], tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=160, temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments)["city"], str)
    answered = client.responses.create(model="m", input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"},
    ], tools=[tool], max_output_tokens=8, temperature=0)
    assert answered.output[0].type == "message"
    shaped = client.responses.create(model="m", input="Write an example", max_output_tokens=10, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "t", "schema": {"const": "foooooo"}}})
    assert shaped.output_text == '"foooooo"'
    with pytest.raises(openai.BadRequestError, match="text.format.schema: required"):
        client.responses.create(model="m", input="x", text={"format": {"type": "json_schema", "name": "t"}})
    with pytest.raises(openai.BadRequestError, match=r"input\[0\].content\[0\]: input_image parts are not supported"):
        client.responses.create(model="m", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}])


def test_responses_raw_stream_carries_llama_servers_progress_and_timings(server):
    body = {"input": "This is a test " * 10, "max_output_tokens": 4, **GREEDY, "stream": True, "timings_per_token": True, "return_progress": True}
    events = sse(httpx.post(server.url + "/responses", json=body, timeout=TIMEOUT))
    progress = [data for name, data in events if "prompt_progress" in data]
    assert progress and all(name == "response.in_progress" for name, data in events if "prompt_progress" in data)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"] > 0
    assert any("timings" in data for name, data in events if name == "response.output_text.delta")
    assert events[-1][0] == "response.completed" and "timings" in events[-1][1]


# -- sampling fields --------------------------------------------------------------------------


def test_ignore_eos_bans_every_end_of_generation_token(server):
    prompt = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"  # the default model's own turn: it ends it soon

    def reply(**fields) -> dict:
        body = {"prompt": prompt, "n_predict": 120, **GREEDY, "cache_prompt": False, "return_tokens": True, **fields}
        return httpx.post(server.url + "/completion", json=body, timeout=TIMEOUT).json()

    base, forced = reply(), reply(ignore_eos=True)
    assert base["stop_type"] == "eos" and base["tokens_predicted"] < 120
    assert forced["stop_type"] == "limit" and forced["tokens_predicted"] == 120
    assert forced["tokens"][: len(base["tokens"])] == base["tokens"]  # the same reply up to where it ended
    settings = forced["generation_settings"]
    banned = {b["token"] for b in settings["logit_bias"] if b["bias"] is None}
    assert settings["ignore_eos"] is True and banned and not set(forced["tokens"]) & banned
    assert base["generation_settings"]["ignore_eos"] is False and base["generation_settings"]["logit_bias"] == []


@pytest.mark.parametrize("field, value", [("dry_multiplier", 0.8), ("xtc_probability", 0.5), ("dynatemp_range", 0.5),
                                          ("top_n_sigma", 1.0), ("samplers", ["top_k"]), ("repeat_last_n", 128)])
def test_sampling_fields_llama_cpp_python_cannot_honour_are_refused_by_name(server, field, value):
    response = httpx.post(server.url + "/completion", json={"prompt": "Hi", "n_predict": 2, field: value}, timeout=TIMEOUT)
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(f"{field}: not supported by kimitui (")
    off = httpx.post(server.url + "/completion", json={"prompt": "Hi", "n_predict": 2, field: {"dry_multiplier": 0, "xtc_probability": 0,
                     "dynatemp_range": 0, "top_n_sigma": -1, "samplers": None, "repeat_last_n": 64}[field]}, timeout=TIMEOUT)
    assert off.status_code == 200  # the value that means "off" is taken


def test_mirostat_and_typical_p_reach_the_sampler(server):
    def reply(**fields) -> str:
        return httpx.post(server.url + "/completion", json={"prompt": "Once upon a time", "n_predict": 24, "seed": 7, "temperature": 1.0,
                                                           "cache_prompt": False, **fields}, timeout=TIMEOUT).json()["content"]

    plain = reply()
    assert reply() == plain  # the seed repeats it
    assert reply(mirostat=2, mirostat_tau=1.0) != plain and reply(mirostat=2, mirostat_tau=1.0) == reply(mirostat=2, mirostat_tau=1.0)
    assert reply(typical_p=0.2) != plain


# -- saved slots ------------------------------------------------------------------------------


def test_a_slot_saved_restores_after_a_restart_and_goes_on_as_before(tmp_path, dense):
    slots = tmp_path / "slots"
    slots.mkdir()
    config = f'slot_save_path = "{slots}"\n'
    first = "The capital of France is"
    second = first + " Paris. The capital of Germany is"

    def ask(thread, prompt: str) -> dict:
        return httpx.post(thread.url + "/completion", json={"prompt": prompt, "n_predict": 12, **GREEDY, "id_slot": 0}, timeout=TIMEOUT).json()

    engine, thread = serve(tmp_path, config=config)
    try:
        ask(thread, first)
        saved = httpx.post(thread.url + "/slots/0?action=save", json={"filename": "france.bin"}, timeout=TIMEOUT).json()
        assert saved["id_slot"] == 0 and saved["filename"] == "france.bin" and saved["n_saved"] > 5 and saved["n_written"] > 0
        uninterrupted = ask(thread, second)
    finally:
        thread.stop()
        engine.close()
    engine, thread = serve(tmp_path, config=config)
    try:
        restored = httpx.post(thread.url + "/slots/0?action=restore", json={"filename": "france.bin"}, timeout=TIMEOUT).json()
        assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"] and "restore_ms" in restored["timings"]
        after = ask(thread, second)
        assert after["content"] == uninterrupted["content"] and after["tokens_cached"] == uninterrupted["tokens_cached"] > 5
        erased = httpx.post(thread.url + "/slots/0?action=erase", timeout=TIMEOUT).json()
        assert erased["id_slot"] == 0 and erased["n_erased"] >= after["tokens_evaluated"]
        assert ask(thread, second)["tokens_cached"] == 0
        # Bad requests, each a line naming what is wrong.
        (slots / "damaged.bin").write_bytes((slots / "france.bin").read_bytes()[:-9] + b"123456789")
        for action, body, status, says in [
            ("restore", {"filename": "missing.bin"}, 404, "filename: "),
            ("restore", {"filename": "damaged.bin"}, 400, "checksum mismatch"),
            ("save", {"filename": "../escape.bin"}, 400, "filename: \"../escape.bin\" is not a plain file name"),
            ("save", {}, 400, "filename: required"),
            ("rename", {"filename": "x"}, 400, "action: expected save, restore or erase"),
        ]:
            got = httpx.post(thread.url + f"/slots/0?action={action}", json=body, timeout=TIMEOUT)
            assert got.status_code == status and says in got.json()["error"]["message"], (action, got.text)
        assert httpx.post(thread.url + "/slots/7?action=erase", timeout=TIMEOUT).status_code == 400
    finally:
        thread.stop()
        engine.close()
    # Another model's file is refused for what it is.
    engine, thread = serve(tmp_path, path=dense, config=config, template=None)
    try:
        got = httpx.post(thread.url + "/slots/0?action=restore", json={"filename": "france.bin"}, timeout=TIMEOUT)
        assert got.status_code == 400 and "saved with another model" in got.json()["error"]["message"]
    finally:
        thread.stop()
        engine.close()


def test_slot_actions_are_off_without_a_save_path(server):
    got = httpx.post(server.url + "/slots/0?action=erase", timeout=TIMEOUT)
    assert got.status_code == 501 and "--slot-save-path" in got.json()["error"]["message"]


# -- context shift ----------------------------------------------------------------------------


def test_context_shift_goes_on_past_the_context_with_the_same_tokens_until_it(tmp_path):
    body = {"prompt": "Once upon a time", "n_predict": 150, **GREEDY, "ignore_eos": True, "return_tokens": True}
    engine, thread = serve(tmp_path, n_ctx=128)
    try:
        stopped = httpx.post(thread.url + "/completion", json=body, timeout=TIMEOUT).json()
    finally:
        thread.stop()
        engine.close()
    assert stopped["truncated"] is True and stopped["tokens_predicted"] < 128 and stopped["stop_type"] == "limit"
    engine, thread = serve(tmp_path, n_ctx=128, context_shift=True)
    try:
        shifted = httpx.post(thread.url + "/completion", json=body, timeout=TIMEOUT).json()
        assert shifted["tokens_predicted"] == 150 and shifted["truncated"] is True
        assert shifted["tokens"][: len(stopped["tokens"])] == stopped["tokens"]  # the same reply up to where it had to stop
        kept = httpx.post(thread.url + "/completion", json={**body, "n_keep": -1, "n_discard": 20}, timeout=TIMEOUT).json()
        assert kept["tokens_predicted"] == 150 and kept["tokens"][: len(stopped["tokens"])] == stopped["tokens"]
        assert engine.notices() == []
    finally:
        thread.stop()
        engine.close()


def test_kimi_k3_cannot_shift_and_says_so(tmp_path):
    spec = synth.plan_like("kimi-k3", None, 0.02, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
    path = synth.write_model(spec, tmp_path / "k3.gguf", seed=3, progress=False).paths[0]
    engine = Engine(path, n_ctx=256, n_threads=1, budget=12 * 2**20, context_shift=True)
    engine.load()
    engine.pin()
    try:
        assert not engine.context_shift
        (note,) = [n for n in engine.notices() if "context shift" in n]
        assert "cannot shift" in note and "\n" not in note
        generation = engine.complete("Once upon a time", Sampling(temperature=0, max_tokens=400, ignore_eos=True))
        list(generation)
        result = generation.result
        assert result.finish_reason == "length" and result.context_full and result.completion_tokens < 256 and not result.shifted
        assert any("cannot shift" in n for n in result.notices)
    finally:
        engine.close()


def test_errors_at_the_door_come_in_the_routes_shape(tmp_path):
    engine, thread = serve(tmp_path, config='api_key = "sesame"\n')
    try:
        url, key = thread.url, {"Authorization": "Bearer sesame"}
        cases = [
            (httpx.post(url + "/v1/messages", json={"max_tokens": 4, "messages": []}, timeout=TIMEOUT), 401, "authentication_error"),
            (httpx.get(url + "/v1/messages", headers=key, timeout=TIMEOUT), 405, "invalid_request_error"),
            (httpx.post(url + "/v1/messages", content=b"x", headers={**key, "Content-Type": "text/plain"}, timeout=TIMEOUT), 415,
             "invalid_request_error"),
            (httpx.post(url + "/v1/messages/nope", json={}, headers=key, timeout=TIMEOUT), 404, "not_found_error"),
        ]
        for response, status, kind in cases:
            body = response.json()
            assert response.status_code == status and body["type"] == "error" and body["error"]["type"] == kind, body
        other = httpx.post(url + "/v1/chat/completions", json={}, timeout=TIMEOUT).json()
        assert other["error"]["code"] == 401 and "type" not in other  # llama-server's shape elsewhere
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(model="m", max_tokens=4, messages=[])
    finally:
        thread.stop()
        engine.close()


def test_a_slot_restored_into_a_parked_slot_is_checked_and_goes_on(tmp_path):
    """Two slots: slot 0 saved, slot 1 then takes the context (slot 0 is parked), and the file
    is restored into slot 0: llama.cpp takes it at once, and slot 0's next reply is the same as
    without the save and restore."""
    prompt = [1] + list(range(400, 430))
    more = prompt + list(range(500, 510))
    greedy = Sampling(temperature=0, max_tokens=8)

    def reply(engine, tokens, slot) -> tuple[list[int], int]:
        generation = engine.complete(tokens, greedy, slot=slot)
        ids = [e.token_id for e in generation if e.token_id >= 0]
        return ids, generation.result.cached_tokens

    engine = Engine(default_model_path(), n_ctx=512, n_threads=1, n_slots=2)
    engine.load()
    try:
        reply(engine, prompt, 0)
        tokens, size = engine.slot_file("save", 0, tmp_path, "zero.bin")
        assert tokens > len(prompt) and size > 0
        expected = reply(engine, more, 0)
        reply(engine, [1, 7, 8, 9], 1)  # slot 1 active, slot 0 parked
        assert engine.slot_file("erase", 0, tmp_path) == (len(more) + 7, 0)  # what slot 0 held: its prompt and 7 of 8 tokens
        assert engine.slot_file("restore", 0, tmp_path, "zero.bin") == (tokens, size)
        assert engine.slots.active == 0
        assert reply(engine, more, 0) == expected
    finally:
        engine.close()


def test_context_shift_drops_what_the_request_asks(tmp_path):
    engine = Engine(default_model_path(), n_ctx=128, n_threads=1, context_shift=True)
    engine.load()
    try:
        shifted = []
        for n_keep, n_discard in ((0, 0), (-1, 20)):
            generation = engine.complete("Once upon a time", Sampling(temperature=0, max_tokens=300, ignore_eos=True, n_keep=n_keep,
                                                                      n_discard=n_discard, cache_prompt=False))
            list(generation)
            assert generation.result.completion_tokens == 300 and generation.result.context_full
            shifted.append(generation.result.shifted)
        half, twenty = shifted
        assert half > 0 and half % 63 == 0  # half of the 126 tokens after BOS, each time the 128 filled
        assert twenty > 0 and twenty % 20 == 0
    finally:
        engine.close()
