"""Faults a phone user meets, injected into the real engine, API and app: each ends in one clear
line, keeps what the user had, and the next request works once the cause is gone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import places_reads, takes_direct_reads

from kimitui.model import synth

MIB = 2**20


@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    """A Kimi K3 cut (4 layers, all 896 experts) of 210 MiB: trunk shards and expert slices stream."""
    spec = synth.plan_like("kimi-k3", None, 0.06, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
    out = tmp_path_factory.mktemp("faults-k3") / "k3.gguf"
    return synth.write_model(spec, out, seed=5, progress=False).paths[0]


# The drive goes away at a moment that has nothing to do with the engine's layers (a thread cuts
# the file while tokens compute), and comes back: the same inode, whole again, as after the
# cable is plugged back in. Twice. A SIGBUS would kill this child: it runs on its own.
CUT_SCRIPT = r"""
import json, os, sys, threading, time
from pathlib import Path
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.engine.state import EngineError
from kimitui.engine.streaming import StreamSettings
path, budget, anywhere = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "anywhere"
if sys.argv[4] == "no-o-direct":  # a file system that refuses O_DIRECT (this kernel's tmpfs serves it)
    from kimitui.engine.direct import DirectPlacer
    real_open = DirectPlacer._open
    def refuse(p, fd, flags):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(p, fd, flags)
    DirectPlacer._open = staticmethod(refuse)
full = path.stat().st_size
with open(path, "rb") as f:
    f.seek(full // 2)
    tail = f.read()

def greedy(n=8):
    gen = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=n))
    list(gen)
    return gen.result.text

engine = Engine(path, n_ctx=256, budget=budget, stream_settings=StreamSettings(prefetch_depth=1))
engine.load(); engine.pin()
assert engine.streamer is not None
reference = greedy()
rounds = []
for round_ in range(2):
    started = threading.Event()
    def cut():
        started.wait()
        time.sleep(0.003 * (round_ + 1))  # somewhere inside a token, not at a layer boundary
        os.truncate(path, full // 2)
    cutter = threading.Thread(target=cut)
    if anywhere:
        cutter.start()
    else:  # nothing placed (no MREMAP_DONTUNMAP): a cut while a layer computes could SIGBUS (docs/design.md)
        real = engine.streamer.on_layer_start
        def cut_at_layer_start(layer, real=real):
            if started.is_set() and path.stat().st_size == full:
                os.truncate(path, full // 2)
            return real(layer)
        engine.streamer.on_layer_start = cut_at_layer_start
    gen = engine.chat([{"role": "user", "content": "Tell me a long story"}], Sampling(temperature=0.0, max_tokens=400))
    error, events = None, 0
    try:
        for event in gen:
            events += 1
            if events == 2:
                started.set()
    except EngineError as exc:
        error = str(exc)
    started.set()
    if anywhere:
        cutter.join()
    else:
        engine.streamer.on_layer_start = real
    try:
        greedy(2)
        while_cut = None
    except EngineError as exc:
        while_cut = str(exc)
    with open(path, "r+b") as f:  # the drive is back: same file, whole again
        f.seek(full // 2)
        f.write(tail)
    rounds.append({"events": events, "error": error, "finish": gen.result.finish_reason, "while_cut": while_cut,
                   "after": greedy()})
print(json.dumps({"reference": reference, "rounds": rounds, "placement": engine.streamer.counters()["placement"]}))
"""


@pytest.mark.parametrize(
    "which,budget,reads", [("dense", 150 * MIB, "o-direct"), ("k3", 120 * MIB, "o-direct"), ("dense", 150 * MIB, "no-o-direct")]
)
def test_a_drive_cut_and_restored_mid_reply_ends_that_reply_and_the_next_works(which, budget, reads, request, tmp_path):
    source = request.getfixturevalue(which)
    victim = tmp_path / "live.gguf"
    victim.write_bytes(source.read_bytes())
    # Placed in anonymous memory (O_DIRECT or not) the cut may land anywhere; left in the
    # file's pages (no MREMAP_DONTUNMAP) only at a layer start.
    where = "anywhere" if places_reads() else "layer-start"
    out = subprocess.run(
        [sys.executable, "-c", CUT_SCRIPT, str(victim), str(budget), where, reads], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]  # no SIGBUS (-7), no traceback
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if places_reads():
        assert result["placement"] == ("direct" if reads == "o-direct" and takes_direct_reads(victim) else "buffered")
    for r in result["rounds"]:
        assert r["finish"] == "error" and r["events"] >= 2
        assert "live.gguf" in r["error"] and ("truncated" in r["error"] or "ended at byte" in r["error"]), r["error"]
        assert r["while_cut"] and "live.gguf" in r["while_cut"]
        assert r["after"] == result["reference"]  # not poisoned: the same greedy tokens as before the cut


STOCK_CUT_SCRIPT = r"""
import json, os, sys
from pathlib import Path
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
path = Path(sys.argv[1])
engine = Engine(path, n_ctx=256, fast_load=False)
engine.load()
def greedy():
    gen = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=8))
    list(gen)
    return gen.result.text
before = greedy()
os.truncate(path, path.stat().st_size // 2)
print(json.dumps({"before": before, "cut": greedy(), "mappings": [l for l in open("/proc/self/maps") if str(path) in l]}))
"""


def test_the_stock_load_reads_the_model_into_memory_so_a_cut_file_cannot_crash_it(dense, tmp_path):
    """Without fast start (hooks unavailable) llama.cpp would map the file whole; a model that
    fits in memory is read into its own buffers instead, and a file cut short changes nothing."""
    victim = tmp_path / "live.gguf"
    victim.write_bytes(dense.read_bytes())
    out = subprocess.run([sys.executable, "-c", STOCK_CUT_SCRIPT, str(victim)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]  # no SIGBUS (-7)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cut"] == result["before"] and result["mappings"] == []


# -- chat templates that refuse ------------------------------------------------------------

REFUSES_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)
DOES_NOT_COMPILE = "{% for m in messages %}{{ m['content'] }}"  # no endfor


def with_template(template: str):
    """The default model's tokenizer with another chat template."""
    tok = synth.default_tokenizer()
    fields, old = [], None
    for key, value, vtype, sub in tok.fields:
        if key == "tokenizer.chat_template":
            old = value
            value = template
        fields.append((key, value, vtype, sub))
    assert old is not None
    delta = len(template.encode()) - len(old.encode())
    return synth.Tokenizer(tuple(fields), tok.n_vocab, tok.encoded_bytes + delta)


def small_model(out: Path, template: str) -> Path:
    return synth.write_model(synth.plan_dense(48 * MIB, "q8_0", with_template(template)), out, seed=2, progress=False).paths[0]


@pytest.fixture(scope="module")
def refusing(tmp_path_factory) -> Path:
    return small_model(tmp_path_factory.mktemp("tpl") / "refuse.gguf", REFUSES_SYSTEM)


@pytest.fixture(scope="module")
def uncompiled(tmp_path_factory) -> Path:
    return small_model(tmp_path_factory.mktemp("tpl") / "broken-template.gguf", DOES_NOT_COMPILE)


def serve(model: Path, tmp_path: Path, config: str = "", budget: int | None = None):
    from kimitui.config import load_settings
    from kimitui.engine.session import Engine
    from kimitui.server.app import create_app
    from kimitui.server.runner import ServerThread, bind_socket

    path = tmp_path / "config.toml"
    path.write_text("[model]\nn_ctx = 512\n" + config)
    settings = load_settings(path, explicit=True)
    engine = Engine(model, n_ctx=512, budget=budget)
    engine.load()
    engine.pin()
    return engine, settings, ServerThread(create_app(engine, settings), bind_socket("127.0.0.1", 0)).start()


def chat(url: str, messages: list[dict], **kw):
    import httpx

    body = {"messages": messages, "max_tokens": 4, "temperature": 0, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_a_template_that_refuses_the_messages_is_a_400_naming_it_and_the_next_request_works(refusing, tmp_path):
    engine, _, server = serve(refusing, tmp_path)
    try:
        system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        for stream in (False, True):
            refused = chat(server.url, system, stream=stream)
            assert refused.status_code == 400, refused.text
            message = refused.json()["error"]["message"]
            assert "chat template of refuse.gguf" in message and "System role not supported" in message
        fine = chat(server.url, system[1:])
        assert fine.status_code == 200 and fine.json()["choices"][0]["message"]["content"]
    finally:
        server.stop()
        engine.close()


def test_a_template_that_does_not_compile_leaves_completions_working(uncompiled, tmp_path):
    import httpx

    engine, _, server = serve(uncompiled, tmp_path)
    try:
        assert engine.template_error and "broken-template.gguf" in engine.template_error
        refused = chat(server.url, [{"role": "user", "content": "Hi"}])
        assert refused.status_code == 400 and "does not compile" in refused.json()["error"]["message"]
        plain = httpx.post(server.url + "/completion", json={"prompt": "Hello", "n_predict": 3}, timeout=120)
        assert plain.status_code == 200 and plain.json()["tokens_predicted"] == 3
    finally:
        server.stop()
        engine.close()


async def test_the_app_survives_a_refusing_template_and_chats_once_the_cause_is_gone(refusing, tmp_path, monkeypatch):
    from kimitui.cli import build_parser, make_app, resolve_model, resolve_settings
    from kimitui.config import data_dir
    from kimitui.history import HistoryStore
    from kimitui.tui.widgets.chat import MessageView, PromptInput

    config = tmp_path / "app.toml"
    config.write_text('[sampling]\ntemperature = 0.0\nmax_tokens = 6\nsystem_prompt = "Be brief."\n')
    monkeypatch.setenv("KIMITUI_CONFIG", str(config))
    settings = resolve_settings(build_parser().parse_args(["--model", str(refusing)]))
    app = make_app(settings, resolve_model(settings))

    async def send(pilot, text):
        waited = 0.0
        while not app.main.ready or app.main.reply is not None:
            await pilot.pause(0.05)
            waited += 0.05
            assert waited < 120
        app.query_one(PromptInput).focus()
        await pilot.press(*text)
        await pilot.press("enter")
        while app.main.reply is not None or not app.query(MessageView).last().border_subtitle:
            await pilot.pause(0.05)
            waited += 0.05
            assert waited < 240
        return app.query(MessageView).last()

    async with app.run_test(size=(120, 40)) as pilot:
        failed = await send(pilot, "Hi")
        assert str(failed.border_subtitle).startswith("error:") and "System role not supported" in str(failed.border_subtitle)
        app.main.system_prompt = ""  # the cause gone: the user clears the system prompt
        ok = await send(pilot, "Hello")  # the same chat goes on
        assert ok.text and not str(ok.border_subtitle).startswith("error:")
        conv = app.main.conversation_id
    msgs = HistoryStore(data_dir() / "history.sqlite3").messages(conv)
    assert [(m.role, m.content) for m in msgs] == [("user", "Hi"), ("assistant", ""), ("user", "Hello"), ("assistant", ok.text)]


# -- what a web page could do to a keyless loopback server ------------------------------------


@pytest.fixture(scope="module")
def web_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("web")
    from kimitui.model import default_model_path

    engine, settings, server = serve(
        default_model_path(), tmp, '[server]\nallowed_hosts = ["kimi.local"]\ncors_origins = ["http://localhost:3000"]\n'
    )
    yield engine, server
    server.stop()
    engine.close()


def test_a_foreign_host_header_is_refused_and_the_servers_own_names_are_not(web_server):
    import httpx

    engine, server = web_server
    port = server.url.rsplit(":", 1)[1]
    for host, status in [("evil.example", 403), (f"attacker.test:{port}", 403), (f"localhost:{port}", 200),
                         (f"127.0.0.1:{port}", 200), ("kimi.local", 200), ("127.0.0.2", 200)]:
        got = httpx.get(server.url + "/health", headers={"Host": host}, timeout=30)
        assert got.status_code == status, (host, got.text)
        if status == 403:
            assert "server.allowed_hosts" in got.json()["error"]["message"]


def test_only_json_bodies_reach_the_engine(web_server):
    import httpx

    engine, server = web_server
    before = engine.metrics.view()["requests_total"]
    body = '{"prompt": "Hello", "n_predict": 2}'
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": kind} if kind else {}
        got = httpx.post(server.url + "/completion", content=body, headers=headers, timeout=30)
        assert got.status_code == 415 and "application/json" in got.json()["error"]["message"], got.text
    assert engine.metrics.view()["requests_total"] == before  # none reached the engine
    ok = httpx.post(server.url + "/completion", content=body, headers={"Content-Type": "application/json; charset=utf-8"}, timeout=60)
    assert ok.status_code == 200


def test_cors_preflights_follow_the_configured_origins(web_server):
    import httpx

    engine, server = web_server
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    allowed = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": "http://localhost:3000", **ask}, timeout=30)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://localhost:3000"
    refused = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": "https://evil.example", **ask}, timeout=30)
    assert refused.status_code == 200 and "access-control-allow-origin" not in refused.headers  # no grant
    cross = httpx.post(server.url + "/completion", json={"prompt": "Hi", "n_predict": 1}, headers={"Origin": "https://evil.example"}, timeout=30)
    assert cross.status_code == 403 and "server.cors_origins" in cross.json()["error"]["message"]
    same = httpx.post(server.url + "/completion", json={"prompt": "Hi", "n_predict": 1}, headers={"Origin": "http://localhost:3000"}, timeout=60)
    assert same.status_code == 200 and same.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_without_configured_origins_no_preflight_is_granted(tmp_path):
    import httpx

    from kimitui.model import default_model_path

    engine, _, server = serve(default_model_path(), tmp_path, '[server]\napi_key = "k"\n')
    try:
        ask = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
        got = httpx.options(server.url + "/v1/chat/completions", headers=ask, timeout=30)
        assert got.status_code == 200 and "access-control-allow-origin" not in got.headers  # no grant
    finally:
        server.stop()
        engine.close()


# -- loads that fail, and a pinned set that is not there yet -----------------------------------


def test_a_model_llama_cpp_refuses_fails_the_load_with_llama_cpps_reason(tmp_path):
    from kimitui.engine.session import Engine
    from kimitui.engine.state import EngineError, EngineState

    model = synth.write_model(synth.plan_dense(48 * MIB, "q8_0", synth.default_tokenizer()), tmp_path / "bad.gguf", progress=False).paths[0]
    raw = model.read_bytes()
    assert raw.count(b"output_norm.weight") == 1
    model.write_bytes(raw.replace(b"output_norm.weight", b"output_xorm.weight"))  # same length: header still parses
    engine = Engine(model, n_ctx=256)
    with pytest.raises(EngineError) as failed:
        engine.load()
    message = str(failed.value)
    assert "bad.gguf" in message and "output_norm.weight" in message and "\n" not in message
    assert engine.state is EngineState.FAILED and engine.load_error == message


def test_a_broken_install_after_llama_cpp_ends_the_load_failed_and_health_says_why(tmp_path, monkeypatch):
    import httpx

    import kimitui.engine.session as session
    from kimitui.config import load_settings
    from kimitui.server.app import create_app
    from kimitui.server.runner import ServerThread, bind_socket

    def missing(_name):
        raise OSError("libggml-base.so: cannot open shared object file")

    monkeypatch.setattr(session, "ggml_base", missing)
    model = synth.write_model(synth.plan_dense(48 * MIB, "q8_0", synth.default_tokenizer()), tmp_path / "m.gguf", progress=False).paths[0]
    engine = session.Engine(model, n_ctx=256, budget=24 * MIB)  # streams: the eval callback needs ggml
    config = tmp_path / "c.toml"
    config.write_text("")
    server = ServerThread(create_app(engine, load_settings(config, explicit=True)), bind_socket("127.0.0.1", 0)).start()
    try:
        with pytest.raises(session.EngineError, match="libggml-base.so"):
            engine.load()
        assert engine.state is session.EngineState.FAILED
        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert "libggml-base.so" in health.json()["error"]["message"]
    finally:
        server.stop()


def test_a_reply_asked_for_while_the_pinned_set_is_read_waits_for_it(dense, monkeypatch):
    import threading

    from kimitui.engine import pinning
    from kimitui.engine.generation import Sampling
    from kimitui.engine.session import Engine
    from kimitui.engine.streaming import StreamSettings

    gate = threading.Event()
    real_read = pinning.ParallelReader.read

    def slow_read(self, *args, **kwargs):
        gate.wait(60)
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(pinning.ParallelReader, "read", slow_read)
    engine = Engine(dense, n_ctx=256, budget=150 * MIB, stream_settings=StreamSettings(prefetch_depth=1))
    engine.load()
    pinner = threading.Thread(target=engine.pin)
    pinner.start()
    while engine.turns.waiting == 0:
        pass
    gen = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=4))
    seen = []

    def consume():
        for _ in gen:
            seen.append((engine.streamer is not None, engine.pinned.bytes))

    reply = threading.Thread(target=consume)
    reply.start()
    reply.join(1.0)
    assert not seen and gen.queue_position == 1  # queued behind the pin, not computing on half a set
    gate.set()
    pinner.join()
    reply.join(120)
    assert seen and all(streaming and pinned > 0 for streaming, pinned in seen)
    engine.close()


def test_a_pin_that_fails_is_tried_again_by_the_next_reply(dense, tmp_path):
    import os

    from kimitui.engine.generation import Sampling
    from kimitui.engine.session import Engine
    from kimitui.engine.state import EngineError

    victim = tmp_path / "pin.gguf"
    victim.write_bytes(dense.read_bytes())
    full = victim.stat().st_size
    engine = Engine(victim, n_ctx=256, budget=150 * MIB)
    engine.load()
    with open(victim, "rb") as f:
        tail = (f.seek(full // 2), f.read())[1]
    os.truncate(victim, full // 2)
    with pytest.raises(EngineError, match="pin.gguf"):
        engine.pin()
    with open(victim, "r+b") as f:
        f.seek(full // 2)
        f.write(tail)
    gen = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=4))
    list(gen)
    assert gen.result.finish_reason == "length" and engine.streamer is not None and engine.pinned.bytes > 0
    engine.close()


def test_the_metrics_sampler_lives_through_a_failed_sample():
    import time

    from kimitui.engine.metrics import EngineMetrics, Sampler

    sampler = Sampler(EngineMetrics())
    sampler.set_interval(0.05)
    seen = []

    def flaky(snap):
        seen.append(snap)
        if len(seen) == 1:
            raise RuntimeError("a panel's bug")

    sampler.subscribe(flaky)
    sampler.start()
    deadline = time.monotonic() + 30
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    sampler.stop()
    assert len(seen) >= 3 and sampler.errors == 1 and "a panel's bug" in sampler.last_error


def test_a_release_that_fails_stops_the_token_without_hanging_the_dropper(dense):
    import threading

    from kimitui.engine.generation import Sampling
    from kimitui.engine.session import Engine
    from kimitui.engine.state import EngineError
    from kimitui.engine.streaming import StreamSettings

    engine = Engine(dense, n_ctx=256, budget=150 * MIB, stream_settings=StreamSettings(prefetch_depth=1))
    engine.load()
    engine.pin()
    streamer = engine.streamer
    real = streamer.io.drop
    failed = threading.Event()

    def refusing_drop(*args):
        if not failed.is_set():
            failed.set()
            raise OSError(22, "madvise(MADV_DONTNEED) of 4096 bytes: Invalid argument")
        return real(*args)

    streamer.io.drop = refusing_drop
    gen = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=40))
    with pytest.raises(EngineError, match="cannot give streamed bytes back"):
        list(gen)
    again = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=4))
    list(again)  # the dropper lives on: the next reply streams
    assert again.result.finish_reason == "length"
    engine.close()


def test_host_rules_for_wildcard_named_and_ipv6_binds():
    from kimitui.server.guard import host_allowed

    none = frozenset()
    assert host_allowed("192.168.1.20:8080", "0.0.0.0", none)  # an address of some interface: not rebindable
    assert host_allowed("localhost:8080", "0.0.0.0", none)
    assert not host_allowed("evil.example", "0.0.0.0", none)
    assert host_allowed("[::1]:8080", "::1", none) and host_allowed("127.0.0.1", "::1", none)
    assert not host_allowed("192.168.1.20", "127.0.0.1", none)
    assert host_allowed("phone.local:8080", "phone.local", none)
    assert not host_allowed("localhost", "192.168.1.20", none)
    assert host_allowed("anything.example", "127.0.0.1", frozenset({"*"}))
    assert host_allowed("[::1]:8080", "127.0.0.1,::1", none) and host_allowed("phone.local", "127.0.0.1, phone.local", none)
    assert not host_allowed("evil.example", "127.0.0.1,::1", none)


def test_malloc_arenas_are_capped_unless_the_user_chose(monkeypatch):
    import platform

    from kimitui.engine.memory import cap_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert cap_malloc_arenas() is False  # the user's choice stands
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert cap_malloc_arenas() is (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc")


def test_an_unexpected_error_inside_the_eval_callback_stops_the_token_not_the_logits(dense):
    from kimitui.engine.generation import Sampling
    from kimitui.engine.session import Engine
    from kimitui.engine.state import EngineError
    from kimitui.engine.streaming import StreamSettings

    engine = Engine(dense, n_ctx=256, budget=150 * MIB, stream_settings=StreamSettings(prefetch_depth=1))
    engine.load()
    engine.pin()
    reference = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=6))
    list(reference)
    streamer = engine.streamer
    real = streamer.on_layer_start

    def broken(layer):
        if layer == 3:
            raise RuntimeError("a bug in the streamer")
        return real(layer)

    streamer.on_layer_start = broken
    gen = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=6))
    with pytest.raises(EngineError, match=r"streaming failed at graph node l_out-2: RuntimeError: a bug in the streamer"):
        list(gen)
    streamer.on_layer_start = real
    again = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=6))
    list(again)
    assert again.result.text == reference.result.text  # no token was computed on skipped nodes
    engine.close()


def test_over_http_a_cut_file_is_a_500_naming_it_and_once_whole_the_same_reply_again(dense, tmp_path):
    import os

    import httpx

    victim = tmp_path / "served.gguf"
    victim.write_bytes(dense.read_bytes())
    full = victim.stat().st_size
    with open(victim, "rb") as f:
        f.seek(full // 2)
        tail = f.read()
    engine, _, server = serve(victim, tmp_path, budget=150 * MIB)
    assert engine.streamer is not None
    try:
        body = {"prompt": "Once upon a time", "n_predict": 6, "temperature": 0}
        before = httpx.post(server.url + "/completion", json=body, timeout=120)
        assert before.status_code == 200
        os.truncate(victim, full // 2)
        cut = httpx.post(server.url + "/completion", json=body, timeout=120)
        assert cut.status_code == 500 and "served.gguf" in cut.json()["error"]["message"], cut.text
        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 200  # the engine is fine; its drive is not
        with open(victim, "r+b") as f:
            f.seek(full // 2)
            f.write(tail)
        after = httpx.post(server.url + "/completion", json=body, timeout=120)
        assert after.status_code == 200 and after.json()["content"] == before.json()["content"]
    finally:
        server.stop()
        engine.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="drop_outside unmaps on Linux only")
def test_pages_the_kernel_would_not_drop_outside_the_pinned_set_are_said(tmp_path, monkeypatch):
    import ctypes
    import mmap

    from kimitui.engine import pinning
    from kimitui.model.gguf_map import ByteRange

    path = tmp_path / "m.bin"
    path.write_bytes(b"\1" * (64 * 4096))
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    real = pinning._libc()

    class Refusing:
        mlock, munlock = real.mlock, real.munlock

        @staticmethod
        def madvise(*_args):
            ctypes.set_errno(11)
            return -1

    monkeypatch.setattr(pinning, "_libc", lambda: Refusing)
    base = next(lo for lo, hi, p in pinning._file_areas({str(path.resolve())}))
    note = pinning.drop_outside({0: base}, {0: len(mapped)}, {0: str(path)}, [ByteRange(0, 4096, 4096)])
    assert note and "outside the pinned set" in note and "Resource temporarily unavailable" in note
    mapped.close()
