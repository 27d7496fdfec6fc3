"""What llama-server and OpenAI clients expect beyond the basics, over loopback HTTP on the
real engine and the default model: constrained output (grammar, JSON schema, response_format),
logit bias, penalties, log-probabilities, several choices and prompts, reproducible prompts
(cache_prompt), and the reply shapes clients read (system_fingerprint, usage, timings).
Where the engine samples, its tokens are compared with stock llama-cpp-python's."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import requests

from helpers import stock_llama
from kimitui.model import default_model_path
from test_server import FRANCE, MAX_N_PREDICT, MESSAGES, TIMEOUT, post, served, stream  # noqa: F401 - served is a fixture

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "year": {"type": "integer"}}, "required": ["city", "year"]}


@pytest.fixture(scope="module")
def stock():
    """Plain llama-cpp-python on the same model and context, for the same greedy requests."""
    llm = stock_llama(default_model_path(), n_ctx=512, n_threads=1)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def stock_text(llm, prompt: str, **kwargs) -> str:
    llm.reset()  # the same fresh evaluation as a request with cache_prompt false
    return llm.create_completion(prompt, temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, **kwargs)["choices"][0]["text"]


def test_a_grammar_constrains_the_reply_as_stock_llama_cpp_does(served, stock):
    from llama_cpp import LlamaGrammar

    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    body = post(served, "/completion", {"prompt": FRANCE, "grammar": gbnf, "n_predict": 16, "temperature": 0, "cache_prompt": False}).json()
    assert body["content"] in ("The answer is yes.", "The answer is no.")
    assert body["content"] == stock_text(stock, FRANCE, grammar=LlamaGrammar.from_string(gbnf, verbose=False), max_tokens=16)


def test_json_schema_and_response_format_give_json_of_that_shape(served, oai):
    native = post(served, "/completion", {"prompt": "A city and a year as JSON:", "json_schema": SCHEMA, "n_predict": 60, "temperature": 0}).json()
    reply = json.loads(native["content"])
    assert isinstance(reply["city"], str) and isinstance(reply["year"], int)
    chat = oai.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}},
    )
    reply = json.loads(chat.choices[0].message.content)
    assert set(reply) >= {"city", "year"} and isinstance(reply["year"], int)
    loose = requests.post(served.url + "/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"},
    }, timeout=TIMEOUT).json()
    json.loads(loose["choices"][0]["message"]["content"])  # any JSON, but JSON (it may be cut at max_tokens: 40 is plenty here)


def test_logit_bias_and_penalties_change_tokens_as_in_stock_llama_cpp(served, stock):
    plain = post(served, "/completion", {"prompt": FRANCE, "n_predict": 6, "temperature": 0, "return_tokens": True}).json()
    first = plain["tokens"][0]
    banned = post(served, "/completion", {"prompt": FRANCE, "n_predict": 6, "temperature": 0, "return_tokens": True,
                                          "logit_bias": [[first, False]], "cache_prompt": False}).json()
    assert banned["tokens"][0] != first
    assert banned["content"] == stock_text(stock, FRANCE, max_tokens=6, logit_bias={first: float("-inf")})
    by_openai = requests.post(served.url + "/v1/completions", json={
        "prompt": FRANCE, "max_tokens": 6, "temperature": 0, "logit_bias": {str(first): -100},
    }, timeout=TIMEOUT).json()
    assert by_openai["choices"][0]["text"] == banned["content"]
    penalized = post(served, "/completion", {"prompt": FRANCE, "n_predict": 40, "temperature": 0,
                                             "frequency_penalty": 1.5, "presence_penalty": 0.5, "cache_prompt": False}).json()
    unpenalized = post(served, "/completion", {"prompt": FRANCE, "n_predict": 40, "temperature": 0, "cache_prompt": False}).json()
    assert penalized["content"] != unpenalized["content"]
    assert penalized["content"] == stock_text(stock, FRANCE, max_tokens=40, frequency_penalty=1.5, presence_penalty=0.5)


def test_log_probabilities_native_and_openai(served, oai):
    body = post(served, "/completion", {"prompt": FRANCE, "n_predict": 5, "temperature": 0, "n_probs": 4}).json()
    probs = body["completion_probabilities"]
    assert len(probs) == 5
    for entry in probs:
        top = entry["top_logprobs"]
        assert len(top) == 4 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert entry["logprob"] <= 0 and top[0]["id"] == entry["id"]  # greedy: the sampled token is the likeliest
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    assert "".join(e["token"] for e in probs) == body["content"]
    _, blocks = stream(served, "/completion", {"prompt": FRANCE, "n_predict": 3, "temperature": 0, "n_probs": 2})
    chunks = [json.loads(b) for b in blocks]
    assert [len(c["completion_probabilities"]) for c in chunks[:-1] if c["tokens"]] == [1, 1, 1]

    chat = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 3 and t.bytes for t in content)
    text = oai.completions.create(model="m", prompt=FRANCE, max_tokens=4, temperature=0, logprobs=2).choices[0].logprobs
    assert len(text.tokens) == len(text.token_logprobs) == len(text.top_logprobs) == 4
    assert text.text_offset[0] == 0 and all(len(t) <= 2 for t in text.top_logprobs)


def test_several_choices_and_several_prompts(served, oai):
    chat = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) > 1  # each choice its own seed (7, 8, 9)
    # The prompt counted once, as OpenAI counts it, however many choices it was given.
    assert chat.usage.prompt_tokens == oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    both = post(served, "/completion", {"prompt": [FRANCE, "Once upon a time"], "n_predict": 4, "temperature": 0}).json()
    assert isinstance(both, list) and [b["index"] for b in both] == [0, 1]
    alone = post(served, "/completion", {"prompt": "Once upon a time", "n_predict": 4, "temperature": 0}).json()
    assert both[1]["content"] == alone["content"]
    listed = oai.completions.create(model="m", prompt=[FRANCE, "Once upon a time"], max_tokens=4, temperature=0)
    assert [c.index for c in listed.choices] == [0, 1] and listed.choices[1].text == alone["content"]
    string = post(served, "/completion", {"prompt": {"prompt_string": "Once upon a time"}, "n_predict": 4, "temperature": 0}).json()
    assert string["content"] == alone["content"]


def test_cache_prompt_false_gives_the_same_text_every_time(served):
    prefix = "The history of the city of Paris begins"
    ask = {"n_predict": 24, "temperature": 0, "cache_prompt": False}
    post(served, "/completion", {**ask, "prompt": prefix})
    again = [post(served, "/completion", {**ask, "prompt": prefix + " in"}).json() for _ in range(2)]
    assert again[0]["content"] == again[1]["content"]
    # prompt_n is what llama_decode was given, counted at the decode: all of the prompt afresh,
    # part of it when the prefix is reused.
    assert again[0]["timings"]["cache_n"] == 0 and again[0]["timings"]["prompt_n"] == again[0]["tokens_evaluated"]
    cached = post(served, "/completion", {"n_predict": 2, "temperature": 0, "prompt": prefix + " in the"}).json()
    assert 0 < cached["timings"]["prompt_n"] < cached["tokens_evaluated"] and cached["tokens_cached"] > 0


def test_reply_shapes_clients_read(served):
    body = post(served, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}).json()
    assert body["system_fingerprint"].startswith("b") and "cached_tokens" in body["usage"]["prompt_tokens_details"]
    _, blocks = stream(served, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "timings_per_token": True,
                                                         "stream_options": {"include_usage": True}})
    chunks = [json.loads(b) for b in blocks[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None} and "timings" not in chunks[0]
    assert all("timings" in c for c in chunks[1:])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3 and "predicted_n" in chunks[-1]["timings"]
    native = post(served, "/completion", {"prompt": FRANCE, "n_predict": 2, "response_fields": ["content", "timings/predicted_n"]}).json()
    assert set(native) == {"content", "timings/predicted_n"} and native["timings/predicted_n"] == 2
    clamped = post(served, "/completion", {"prompt": FRANCE, "n_predict": 100_000, "temperature": 0}).json()
    assert clamped["tokens_predicted"] <= MAX_N_PREDICT and clamped["generation_settings"]["n_predict"] == MAX_N_PREDICT
    no_v1 = httpx.post(served.url + "/completions", json={"prompt": FRANCE, "n_predict": 2}, timeout=TIMEOUT).json()
    assert "content" in no_v1 and "choices" not in no_v1  # llama-server's own handler, as there


def test_apply_template_and_the_localhost_origin_entry(served):
    from kimitui.server.guard import origin_allowed

    prompt = post(served, "/apply-template", {"messages": MESSAGES}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and MESSAGES[-1]["content"] in prompt
    local = frozenset({"localhost"})
    for origin in ("http://localhost", "http://localhost:8080", "http://127.0.0.1:3000", "http://[::1]", "https://[::1]:3000"):
        assert origin_allowed(origin, local), origin
    for origin in ("http://localhost.evil.com", "http://notlocalhost", "http://evil.com", "http://127.0.0.2"):
        assert not origin_allowed(origin, local), origin


def test_slots_and_a_configured_seed(served, tmp_path):
    from kimitui.config import load_settings
    from kimitui.server.app import create_app
    from kimitui.server.runner import ServerThread, bind_socket

    slots = httpx.get(served.url + "/slots", timeout=TIMEOUT).json()
    assert len(slots) == 1 and slots[0]["id"] == 0 and slots[0]["n_ctx"] == served.engine.n_ctx and not slots[0]["is_processing"]
    config = tmp_path / "seeded.toml"
    config.write_text("[sampling]\nseed = 1234\ntemperature = 1.0\n[server]\nmax_n_predict = 200\n")
    seeded = ServerThread(create_app(served.engine, load_settings(config, explicit=True)), bind_socket("127.0.0.1", 0)).start()
    try:
        ask = {"prompt": "Once upon a time", "n_predict": 12}
        replies = [httpx.post(seeded.url + "/completion", json=ask, timeout=TIMEOUT).json() for _ in range(2)]
        assert replies[0]["content"] == replies[1]["content"] and replies[0]["generation_settings"]["seed"] == 1234
        other = httpx.post(seeded.url + "/completion", json={**ask, "seed": 99}, timeout=TIMEOUT).json()
        assert other["generation_settings"]["seed"] == 99
    finally:
        seeded.stop()


PREFILL = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "The capital of France is"}]


def test_a_final_assistant_message_is_continued_not_answered(served):
    """llama-server's assistant prefill: the reply goes on from the assistant's text; its
    prompt is the messages before it up to the reply's turn, then that text."""
    shown = post(served, "/apply-template", {"messages": PREFILL}).json()["prompt"]
    before = post(served, "/apply-template", {"messages": PREFILL[:1]}).json()["prompt"]
    assert shown == before + "The capital of France is"
    chat = post(served, "/v1/chat/completions", {"messages": PREFILL, "max_tokens": 8, "temperature": 0, "cache_prompt": False}).json()
    same = post(served, "/completion", {"prompt": shown, "n_predict": 8, "temperature": 0, "cache_prompt": False}).json()
    assert chat["choices"][0]["message"]["content"] == same["content"] and same["content"]
    # vLLM's spelling of the same thing gives the same prompt.
    explicit = {"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True}
    assert post(served, "/apply-template", explicit).json()["prompt"] == shown


@pytest.mark.parametrize("body,why", [
    ({"messages": PREFILL, "add_generation_prompt": True, "continue_final_message": True}, "at most one may be true"),
    ({"messages": PREFILL[:1], "continue_final_message": True, "add_generation_prompt": False}, "the last message must be the assistant's"),
    ({"messages": PREFILL[:1], "add_generation_prompt": False}, "taken only with continue_final_message"),
])
def test_turn_flags_that_cannot_be_honoured_are_a_400_naming_them(served, body, why):
    for path in ("/v1/chat/completions", "/apply-template"):
        reply = post(served, path, dict(body, max_tokens=4))
        assert reply.status_code == 400 and why in reply.json()["error"]["message"], reply.text


ONCE = "Once upon a time, in a village by the sea, there lived"


@pytest.fixture(scope="module")
def two_slots(tmp_path_factory):
    """The same engine, its 512-token context split into two slots (llama-server's --parallel 2)."""
    from kimitui.config import load_settings
    from kimitui.engine.metrics import EngineMetrics
    from kimitui.engine.session import Engine
    from kimitui.server.app import create_app
    from kimitui.server.runner import ServerThread, bind_socket

    config = tmp_path_factory.mktemp("slots") / "config.toml"
    config.write_text("[server]\nslots = 2\nmax_n_predict = 200\n[model]\nn_ctx = 512\nn_threads = 1\n")
    settings = load_settings(config, explicit=True)
    engine = Engine(default_model_path(), n_ctx=512, n_threads=1, metrics=EngineMetrics(), n_slots=2)
    engine.load()
    server = ServerThread(create_app(engine, settings), bind_socket("127.0.0.1", 0)).start()
    yield server.url
    server.stop()
    engine.close()


def test_two_slots_keep_their_prompts_apart_and_give_stock_tokens(two_slots, stock):
    """Two clients taking turns: each one's second request reuses its own cached prompt, though
    the other ran in between (its state was parked and put back), with stock greedy tokens."""
    ask = lambda prompt: httpx.post(two_slots + "/completion", json={"prompt": prompt, "n_predict": 12, "temperature": 0}, timeout=TIMEOUT).json()
    first_a, first_b = ask(FRANCE), ask(ONCE)
    assert first_a["id_slot"] != first_b["id_slot"]
    again_a, again_b = ask(FRANCE), ask(ONCE)
    assert again_a["id_slot"] == first_a["id_slot"] and again_b["id_slot"] == first_b["id_slot"]
    assert again_a["tokens_cached"] >= again_a["tokens_evaluated"] - 1 > 0
    assert again_b["tokens_cached"] >= again_b["tokens_evaluated"] - 1 > 0
    for first, again, prompt in ((first_a, again_a, FRANCE), (first_b, again_b, ONCE)):
        assert first["content"] == stock_text(stock, prompt, max_tokens=12)
        # Stock llama-cpp-python asked the same twice in a row: its prefix reused, as in the slot.
        reused = stock.create_completion(prompt, temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, max_tokens=12)
        assert again["content"] == reused["choices"][0]["text"]
    slots = httpx.get(two_slots + "/slots", timeout=TIMEOUT).json()
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == 256 and s["n_cached"] > 0 for s in slots)
    props = httpx.get(two_slots + "/props", timeout=TIMEOUT).json()
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 256


def test_a_slot_holds_its_share_of_the_context(two_slots):
    long = httpx.post(two_slots + "/completion", json={"prompt": FRANCE * 60, "n_predict": 4}, timeout=TIMEOUT)
    assert long.status_code == 400
    error = long.json()["error"]
    assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 256 and "a slot holds 256" in error["message"]
    asked = httpx.post(two_slots + "/completion", json={"prompt": FRANCE, "n_predict": 4, "id_slot": 1}, timeout=TIMEOUT).json()
    assert asked["id_slot"] == 1
    wrong = httpx.post(two_slots + "/completion", json={"prompt": FRANCE, "n_predict": 4, "id_slot": 2}, timeout=TIMEOUT)
    assert wrong.status_code == 400 and "id_slot" in wrong.json()["error"]["message"]


def test_verbose_gives_the_prompt_as_the_model_saw_it(served, oai):
    body = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    plain = oai.chat.completions.create(model="m", **body)
    assert "__verbose" not in (plain.model_extra or {})
    shown = requests.post(served.url + "/apply-template", json={"messages": MESSAGES}, timeout=TIMEOUT).json()["prompt"]
    verbose = oai.chat.completions.create(model="m", **body, extra_body={"verbose": True})
    assert verbose.model_extra["__verbose"]["prompt"] == shown
    assert verbose.model_extra["__verbose"]["tokens_predicted"] == verbose.usage.completion_tokens
    _, blocks = stream(served, "/v1/chat/completions", {**body, "verbose": True})
    last = json.loads(blocks[-2])
    assert last["choices"][0]["finish_reason"] and last["__verbose"]["prompt"] == shown


def test_input_tokens_counts_a_chat_prompt(served, oai):
    count = requests.post(served.url + "/v1/chat/completions/input_tokens", json={"messages": MESSAGES}, timeout=TIMEOUT).json()["input_tokens"]
    reply = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    assert count == reply.usage.prompt_tokens > 0
    assert post(served, "/chat/completions/input_tokens", {"messages": "hi"}).status_code == 400


def test_two_assistant_messages_at_the_end_are_refused(served):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "assistant", "content": "there"}]
    refused = post(served, "/v1/chat/completions", {"messages": messages})
    assert refused.status_code == 400 and "two assistant messages" in refused.json()["error"]["message"]


def test_a_built_in_template_by_name_is_rendered_by_llama_cpp(tmp_path):
    from kimitui.engine.metrics import EngineMetrics
    from kimitui.engine.session import Engine
    from kimitui.engine.state import ChatTemplateError

    engine = Engine(default_model_path(), n_ctx=256, n_threads=1, metrics=EngineMetrics(), chat_template="command-r")
    engine.load()
    try:
        messages = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
        assert engine.render_chat(messages).prompt == (
            "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
            "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
        )
        prefilled = engine.render_chat([*messages, {"role": "assistant", "content": "Sure"}]).prompt
        assert prefilled == engine.render_chat(messages).prompt + "Sure"
        with pytest.raises(ChatTemplateError, match="command-r renders no tools"):
            engine.render_chat(messages, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    finally:
        engine.close()


def test_models_lists_aliases_and_tags_and_x_api_key_is_a_key(served, tmp_path):
    from kimitui.config import load_settings
    from kimitui.server.app import create_app
    from kimitui.server.runner import ServerThread, bind_socket

    config = tmp_path / "named.toml"
    config.write_text('[server]\nalias = "kimi,k3,chat"\ntags = ["moe", "big"]\napi_key = "sesame"\n')
    named = ServerThread(create_app(served.engine, load_settings(config, explicit=True)), bind_socket("127.0.0.1", 0)).start()
    try:
        model = httpx.get(named.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]
        assert model["id"] == "chat" and set(model["aliases"]) == {"kimi", "k3", "chat"} and model["tags"] == ["moe", "big"]
        ask = {"prompt": FRANCE, "n_predict": 2}
        assert httpx.post(named.url + "/completion", json=ask, headers={"X-Api-Key": "sesame"}, timeout=TIMEOUT).status_code == 200
        assert httpx.post(named.url + "/completion", json=ask, headers={"X-Api-Key": "wrong"}, timeout=TIMEOUT).status_code == 401
    finally:
        named.stop()


def test_post_sampling_probs_are_what_the_token_was_drawn_from(served):
    """llama-server's post_sampling_probs: the candidates the sampler chain left (here top_k 3),
    their probabilities summing to one; the tokens are those of the same seed without them."""
    ask = {"prompt": FRANCE, "n_predict": 6, "temperature": 1.0, "top_k": 3, "seed": 7, "n_probs": 5, "cache_prompt": False}
    plain = post(served, "/completion", ask).json()
    post_sampled = post(served, "/completion", {**ask, "post_sampling_probs": True}).json()
    assert post_sampled["content"] == plain["content"]
    entries = post_sampled["completion_probabilities"]
    assert [e["id"] for e in entries] == [e["id"] for e in plain["completion_probabilities"]]
    for entry in entries:
        top = entry["top_probs"]
        assert 1 <= len(top) <= 3 and all(0.0 < t["prob"] <= 1.0 for t in top)
        assert sum(t["prob"] for t in top) == pytest.approx(1.0, abs=1e-4)
        assert entry["prob"] == pytest.approx(next(t["prob"] for t in top if t["id"] == entry["id"]))
    # Greedy: the pick is certain, and it is the token of highest probability before sampling.
    greedy = {**ask, "temperature": 0}
    certain = post(served, "/completion", {**greedy, "post_sampling_probs": True}).json()["completion_probabilities"]
    raw = post(served, "/completion", greedy).json()["completion_probabilities"]
    assert [e["id"] for e in certain] == [e["top_logprobs"][0]["id"] for e in raw]


def test_prompt_progress_comes_batch_by_batch_and_changes_no_token(tmp_path):
    """return_progress: a PromptProgress before the first micro-batch and after each; the reply's
    tokens are those of the same request without it (the same batches are evaluated)."""
    from kimitui.engine.generation import PromptProgress, Sampling
    from kimitui.engine.metrics import EngineMetrics
    from kimitui.engine.session import Engine

    engine = Engine(default_model_path(), n_ctx=512, n_batch=8, n_threads=1, metrics=EngineMetrics())
    engine.load()
    try:
        prompt = engine.tokenize(ONCE * 2)
        greedy = Sampling(temperature=0.0, max_tokens=8, cache_prompt=False)
        decoded: list[int] = []
        real_decode = engine.llm._ctx.decode
        engine.llm._ctx.decode = lambda batch: (decoded.append(batch.batch.n_tokens), real_decode(batch))[1]
        plain = [e.token_id for e in engine.complete(prompt, greedy) if e.token_id >= 0]
        plain_batches, decoded[:] = list(decoded), []
        events = list(engine.complete(prompt, greedy, progress=True))
        assert decoded == plain_batches  # the same micro-batches, the prompt evaluated once
        progress = [e for e in events if isinstance(e, PromptProgress)]
        assert [e.token_id for e in events if not isinstance(e, PromptProgress) and e.token_id >= 0] == plain
        assert len(progress) == -(-len(prompt) // 8) + 1 and progress[0].processed == progress[0].cache == 0
        assert [p.processed for p in progress] == sorted({p.processed for p in progress}) and progress[-1].processed == len(prompt)
        # Asked again, the prompt is kept but for its last token, which is evaluated afresh.
        again = [e for e in engine.complete(prompt, Sampling(temperature=0.0, max_tokens=8), progress=True) if isinstance(e, PromptProgress)]
        assert [(p.cache, p.processed) for p in again] == [(len(prompt) - 1,) * 2, (len(prompt) - 1, len(prompt))]
    finally:
        engine.close()


def test_return_progress_over_http(served):
    ask = {"prompt": ONCE, "n_predict": 4, "temperature": 0, "cache_prompt": False}
    _, blocks = stream(served, "/completion", {**ask, "return_progress": True})
    chunks = [json.loads(b) for b in blocks]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert progress[0]["processed"] == progress[0]["cache"] and progress[-1]["processed"] == progress[-1]["total"] > 0
    assert "".join(c["content"] for c in chunks if "prompt_progress" not in c) == post(served, "/completion", ask).json()["content"]
    chat = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "cache_prompt": False}
    _, blocks = stream(served, "/v1/chat/completions", {**chat, "return_progress": True})
    chunks = [json.loads(b) for b in blocks if b != "[DONE]"]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert progress and progress[-1]["processed"] == progress[-1]["total"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == post(served, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    refused = post(served, "/completion", {**ask, "return_progress": True})
    assert refused.status_code == 400 and "return_progress" in refused.json()["error"]["message"]


def test_truncated_says_the_context_filled(served):
    """llama-server's truncated: the reply stopped because the context was full, not at its
    n_predict (end-of-text banned, so only a limit can stop it)."""
    eos = served.engine.llm.token_eos()
    prompt = "hello " * 400  # 400 tokens of the 512: room for 112, fewer than the 200 asked
    full = post(served, "/completion", {"prompt": prompt, "n_predict": 200, "logit_bias": [[eos, False]], "temperature": 0}).json()
    assert full["truncated"] is True and full["tokens_predicted"] == 512 - full["tokens_evaluated"] and full["stop_type"] == "limit"
    short = post(served, "/completion", {"prompt": prompt, "n_predict": 8, "logit_bias": [[eos, False]], "temperature": 0}).json()
    assert short["truncated"] is False and short["tokens_predicted"] == 8
    room = 512 - full["tokens_evaluated"]  # asked for exactly what is left: the context is full all the same
    exact = post(served, "/completion", {"prompt": prompt, "n_predict": room, "logit_bias": [[eos, False]], "temperature": 0}).json()
    assert exact["truncated"] is True and exact["tokens_predicted"] == room
