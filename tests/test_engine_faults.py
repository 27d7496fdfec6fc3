"""Faults inside the real engine and its API, injected: a llama.cpp context that cannot be made
again, a cancel in the middle of a long prompt, a budget raised past the memory there is, the
direct-read pool's spare memory, oversized and malformed requests, a name given to --serve."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kimitui.engine.addressing import WholeFiles
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.engine.state import EngineError, EngineState, IllegalMove, Lifecycle

MIB = 2**20


def greedy(engine: Engine, prompt="Once upon a time", n: int = 8, **kw) -> str:
    gen = engine.complete(prompt, Sampling(temperature=0.0, max_tokens=n, **kw))
    list(gen)
    return gen.result.text


# -- the lifecycle ---------------------------------------------------------------------------------


def test_the_lifecycle_allows_no_reply_on_a_failed_engine_without_a_successful_mend():
    life = Lifecycle()
    with pytest.raises(IllegalMove):
        life.move(EngineState.GENERATING)  # never loaded
    life.move(EngineState.LOADING)
    life.move(EngineState.READY)
    life.fail("the context is gone")
    with pytest.raises(IllegalMove):
        life.move(EngineState.GENERATING)
    with pytest.raises(EngineError, match="the context is gone"):
        life.begin_reply()  # nothing can mend it: refused, still FAILED
    assert life.state is EngineState.FAILED and life.refusal() == "the context is gone"

    attempts = []

    def mend():
        attempts.append(1)
        if len(attempts) == 1:
            raise EngineError("still no memory")

    life.fail("the context is gone", recover=mend)
    assert life.refusal() is None  # a reply may come: it tries the mend first
    with pytest.raises(EngineError, match="still no memory"):
        life.begin_reply()
    assert life.state is EngineState.FAILED and life.recoverable
    life.begin_reply()  # mended this time
    assert life.state is EngineState.GENERATING and len(attempts) == 2
    life.end_reply()
    assert life.state is EngineState.READY and life.reason is None


def test_a_context_that_cannot_be_made_again_fails_the_reply_and_a_later_reply_mends_it(dense, monkeypatch):
    import llama_cpp._internals as internals

    engine = Engine(dense, n_ctx=256, budget=1024 * MIB)
    engine.load()
    engine.pin()
    reference = greedy(engine)  # fits whole: stock llama.cpp's tokens (test_streaming compares them)
    assert "fresh llama.cpp context" in engine.retune(budget=100 * MIB)
    real = internals.LlamaContext

    class NoMemory:
        def __init__(self, *args, **kwargs):
            raise ValueError("Failed to create context with model")

    monkeypatch.setattr(internals, "LlamaContext", NoMemory)
    for _ in range(2):  # the second reply once crashed the process computing on the closed context
        with pytest.raises(EngineError, match="could not make a new context.*the next reply tries again"):
            greedy(engine)
        assert engine.state is EngineState.FAILED and engine.lifecycle.recoverable
    monkeypatch.setattr(internals, "LlamaContext", real)
    assert greedy(engine) == reference
    assert engine.state is EngineState.READY and engine.streamer is not None
    engine.close()


# -- cancel reaches llama.cpp between graph nodes ----------------------------------------------------


def test_a_cancel_stops_a_long_prompt_within_its_evaluation_and_the_next_reply_is_unchanged(model_path):
    engine = Engine(model_path, n_ctx=4096)
    engine.load()
    engine.pin()
    prompt = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 200)[:2000]
    started = time.perf_counter()
    reference = greedy(engine, prompt, n=4, cache_prompt=False)
    whole = time.perf_counter() - started  # the whole prompt's evaluation, this run, this machine
    gen = engine.complete(prompt, Sampling(temperature=0.0, max_tokens=4, cache_prompt=False))
    consumer = threading.Thread(target=lambda: list(gen))
    consumer.start()
    while engine._replying is not gen:
        time.sleep(0.005)
    time.sleep(whole / 2)  # past the first of its 512-token micro-batches
    asked = time.perf_counter()
    gen.cancel()
    consumer.join(whole * 2)
    stopped = time.perf_counter() - asked
    assert not consumer.is_alive()
    assert gen.result.finish_reason == "cancelled" and gen.result.completion_tokens == 0
    # Within the evaluation, not after it: a small part of what the whole prompt takes.
    assert stopped < whole / 4, (stopped, whole)
    assert engine.state is EngineState.READY
    # What was evaluated before the cancel stays cached (an attention model's cells are trimmed
    # to what llama-cpp-python counts), and the next reply's tokens are an uninterrupted run's.
    kept = engine.llm.n_tokens
    assert 0 < kept < len(prompt)
    again = engine.complete(prompt, Sampling(temperature=0.0, max_tokens=4))
    list(again)
    assert again.result.text == reference and again.result.cached_tokens == kept
    engine.close()


# -- a budget raised past the memory there is -----------------------------------------------------------


def test_raising_the_budget_past_the_memory_there_is_is_refused_with_the_numbers(dense, monkeypatch):
    from kimitui.engine import memory

    engine = Engine(dense, n_ctx=256, budget=120 * MIB)
    engine.load()
    engine.pin()
    assert engine.streamer is not None
    monkeypatch.setattr(memory, "available_memory", lambda: 0)  # nothing free: only what the engine holds
    with pytest.raises(EngineError, match=r"budget 2\.0 GiB does not fit: .* may use .*: at most") as refused:
        engine.retune(budget=2048 * MIB)
    assert "\n" not in str(refused.value)
    assert engine.budget == 120 * MIB and not engine.pending.repin  # nothing changed
    assert "applies" in engine.retune(budget=110 * MIB)  # lowering needs no memory
    engine.close()


# -- the direct-read pool --------------------------------------------------------------------------------


def resident_bytes(spans: list[tuple[int, int]]) -> int:
    """Resident pages inside ``spans``, by mincore(2): what the kernel says, whatever the VMAs."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for lo, hi in spans:
        vec = (ctypes.c_ubyte * ((hi - lo) // page))()
        assert libc.mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
        total += sum(b & 1 for b in vec) * page
    return total


def test_the_pools_memory_beside_the_mapping_is_its_free_buffers_only(tmp_path):
    import random

    from helpers import takes_direct_reads

    from kimitui.engine.direct import PIECE_BYTES, DirectPlacer, Libc, split_pieces
    from kimitui.engine.platform import MAP_SHARED, PROT_READ

    path = tmp_path / "weights.bin"
    data = random.Random(2).randbytes(40 * MIB + 4096 * 3 + 17)
    path.write_bytes(data)
    if not takes_direct_reads(path):
        pytest.skip(f"{tmp_path} takes no O_DIRECT")
    fd = os.open(path, os.O_RDONLY)
    libc = Libc()
    address = libc.check(libc.mmap(None, len(data), PROT_READ, MAP_SHARED, fd, 0), "mmap")
    page = os.sysconf("SC_PAGE_SIZE")
    placer = DirectPlacer.create([str(path)], WholeFiles({0: address}, {0: os.fstat(fd).st_size}), {0: fd}, capacity=16)
    if placer is None:
        libc.munmap(address, len(data))
        os.close(fd)
        pytest.skip("no direct placement on this kernel (MREMAP_DONTUNMAP)")
    try:
        # Shards whose ends fall inside 4 MiB blocks: partial pieces beside whole ones.
        shards = [(1 * MIB + 4096, 9 * MIB + 123), (9 * MIB + 123, 18 * MIB), (18 * MIB + 777, 40 * MIB)]
        for _ in range(3):
            for lo, hi in shards:
                for start, length, whole_pages in split_pieces(lo, hi, page):
                    if whole_pages:
                        assert placer.place(0, start, length) == length
            # A lent buffer holds nothing: its piece's pages are in the mapping (counted there),
            # the rest of a partial piece's buffer was given back. Only free buffers hold memory.
            free = sum(map(len, placer._free.values()))
            assert resident_bytes(placer.buffer_spans()) <= free * PIECE_BYTES
            assert resident_bytes(placer.buffer_spans()) + placer.placed_bytes <= placer.capacity * PIECE_BYTES
            for lo, hi in shards:
                placer.release(0, lo, hi - lo)
            assert resident_bytes(placer.buffer_spans()) <= placer.capacity * PIECE_BYTES
        assert ctypes.string_at(address, len(data)) == data
    finally:
        placer.close()
        libc.munmap(address, len(data))
        os.close(fd)


@pytest.mark.parametrize("budget_mib", [100, 120, 150])  # 100: just above the minimum, where the pool is capped
def test_the_plan_counts_the_direct_read_pool_the_streamer_may_fill(dense, budget_mib):
    from kimitui.engine.budget import PIECE_BYTES, SLACK_BYTES

    engine = Engine(dense, n_ctx=256, budget=budget_mib * MIB)
    engine.load()
    engine.pin()
    plan, streamer = engine.plan, engine.streamer
    assert streamer is not None
    # Pinned set, what streams at its fullest (the window, or the pool holding it) and the slack:
    # within the budget.
    streams = max(plan.window_bytes, plan.pool_buffers * PIECE_BYTES)
    assert plan.pinned_bytes + streams + SLACK_BYTES <= budget_mib * MIB
    if streamer.placer is not None:  # the pool the streamer made is the one the plan counted
        assert streamer.placer.capacity <= plan.pool_buffers
    engine.close()


# -- the API: caps, bad numbers, nothing CPU-bound on the event loop -------------------------------------


@pytest.fixture(scope="module")
def api(model_path, tmp_path_factory):
    from kimitui.config import load_settings
    from kimitui.server.app import create_app

    config = tmp_path_factory.mktemp("api-faults") / "config.toml"
    config.write_text("[model]\nn_ctx = 2048\n[server]\nmax_body = \"4MiB\"\n")
    settings = load_settings(config, explicit=True)
    engine = Engine(model_path, n_ctx=2048)
    engine.load()
    yield create_app(engine, settings), settings
    engine.close()


async def request(app, path: str, body, **kw) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return await client.post(path, content=content, headers={"Content-Type": "application/json"}, timeout=120, **kw)


@pytest.mark.parametrize("path, body", [
    ("/completion", {"prompt": ["a", "b"], "n_predict": 2048, "n_probs": 100}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 8, "max_tokens": 2048, "logprobs": True, "top_logprobs": 20}),
    ("/v1/completions", {"prompt": ["a"] * 16, "n": 8, "max_tokens": 2048, "logprobs": 1}),
])
async def test_a_request_asking_for_too_much_is_a_400_naming_the_limit_before_any_token(api, path, body):
    app, settings = api
    response = await request(app, path, body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "server.max_request_entries" in message and f"{settings['server.max_request_entries']:,}" in message


async def test_a_number_past_pythons_digit_limit_is_a_400(api):
    app, _ = api
    response = await request(app, "/completion", '{"prompt": "hi", "n_predict": ' + "9" * 5000 + "}")
    assert response.status_code == 400 and "number is too long" in response.json()["error"]["message"]
    ok = await request(app, "/completion", {"prompt": "hi", "n_predict": 2})
    assert ok.status_code == 200


async def test_tokenizing_a_large_body_with_pieces_leaves_the_event_loop_free(api):
    app, _ = api
    gaps = []

    async def ticker(stop: asyncio.Event):
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    stop = asyncio.Event()
    tick = asyncio.ensure_future(ticker(stop))
    response = await request(app, "/tokenize", {"content": "word " * 180_000, "with_pieces": True})
    stop.set()
    await tick
    assert response.status_code == 200 and len(response.json()["tokens"]) > 100_000
    assert max(gaps) < 0.25, f"the event loop stalled {max(gaps):.2f} s"


def test_a_size_too_large_for_any_machine_is_one_line_not_a_traceback(model_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kimitui", "--model", str(model_path), "--budget", "9" * 400],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "too large for a size" in proc.stderr


# -- a name given to --serve in the app ---------------------------------------------------------------------


async def test_the_apps_api_answers_requests_that_name_the_host_given_to_serve():
    import socket

    from kimitui.cli import build_app, build_parser

    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        pytest.skip(f"this machine's name {name!r} does not resolve")
    flags = ["--serve", f"{name}:0", "--api-key", "k"]  # a name, not an address: a key is asked for
    app = build_app(build_parser().parse_args(flags))
    async with app.run_test(size=(120, 40)) as pilot:
        while app.main.api_url is None:
            await pilot.pause(0.05)
        port = app.main.api_url.rsplit(":", 1)[1].rstrip("/")
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://{address}:{port}/v1/models", headers={"Host": f"{name}:{port}", "Authorization": "Bearer k"})
    assert response.status_code == 200, response.text


def test_a_stock_load_that_fails_twice_says_llama_cpps_reason(model_path, monkeypatch):
    """The stock load (no fast start) is tried once more with llama.cpp's log kept; the retry
    goes through the stock-load guard again, and the error is the load's, not the guard's."""
    import llama_cpp

    tries = []

    def failing(*args, **kwargs):
        tries.append(kwargs["model_path"])
        raise ValueError("Failed to load model from file")

    monkeypatch.setattr(llama_cpp, "Llama", failing)
    engine = Engine(model_path, fast_load=False)
    with pytest.raises(EngineError, match=r"could not load .*Failed to load model from file"):
        engine.load()
    assert len(tries) == 2
