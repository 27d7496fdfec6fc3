"""The measured side of `kimitui bench` and `kimitui bench-load`, one phase per process.

``python -m kimitui.benchmarks.child PHASE SPEC_JSON``. Results go to stdout as messages
(``kimitui.benchmarks.messages``); the parent timestamps each as it arrives.
Imports stay inside the phases: for bench-load, interpreter start and imports are part of
what is measured, and they must be the app's, not ours.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from kimitui.benchmarks.messages import emit
from kimitui.benchmarks.scale import phase_scale
CONVERSATION_KEY = "bench"  # bench-resume's conversation, as the engine keeps its state
DISK_CHUNK_BYTES = 4 * 2**20
# An ordinary English paragraph, repeated to the requested prompt length: both runs of a
# comparison tokenize it with the same vocabulary, so they see the same prompt tokens.
PROMPT_TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening, counting the steps as his "
    "father had taught him, and wound the great clockwork that turned the lens. Ships passed "
    "far out on the dark water, and he wrote their names in a book that nobody would read. "
)


def _read_bytes() -> int | None:
    from kimitui.benchmarks.common import storage_read_bytes

    return storage_read_bytes()


def _peak_rss() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _peak_address_space() -> int | None:
    """The most address space the process has held (VmPeak, Linux); None elsewhere."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmPeak:"))
    except (OSError, StopIteration):
        return None


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def prompt_tokens(llm, n: int, later: int = 0) -> list[int]:
    """``n`` tokens of the bench's text, the model's first (BOS) included; ``later``: the text
    taken from that many tokens on, after the first (a later reply's prompt of its own)."""
    copies = 1
    while True:
        tokens = llm.tokenize((PROMPT_TEXT * copies).encode(), add_bos=True, special=False)
        if len(tokens) >= n + later:
            return tokens[: min(n, 1)] + tokens[1 + later : n + later]
        copies *= 2


def _delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def measure_decode(token_ids, n_prompt: int, streaming=None) -> dict:
    """Time a token stream the same way for every engine.

    ``token_ids`` is a lazy iterator: nothing runs before the first ``next``. The first
    token's time is the TTFT (prefill and the first sample); decode is the rest. Storage
    reads are split the same way. ``streaming`` returns the streaming engine's cumulative
    counters (``Streamer.counters()``, or None while there is none).
    """
    from kimitui.engine.metrics import percentile

    started = time.perf_counter()
    io_start = _read_bytes()
    stamps: list[float] = []
    ids: list[int] = []
    io_first = stream_first = None
    for token in token_ids:
        stamps.append(time.perf_counter())
        ids.append(token)
        if len(stamps) == 1:
            io_first = _read_bytes()
            stream_first = streaming() if streaming else None
    io_end = _read_bytes()
    stream_end = streaming() if streaming else None
    if not stamps:
        raise RuntimeError("the model produced no token (end of generation at once)")
    ttft = stamps[0] - started
    intervals = [b - a for a, b in zip(stamps, stamps[1:])]
    decode_s = stamps[-1] - stamps[0]
    n_decode = len(intervals)
    decode_read = _delta(io_first, io_end)
    streamed: dict = {}
    if stream_first is not None and stream_end is not None and n_decode:
        def delta(key):
            a, b = stream_first.get(key), stream_end.get(key)
            return None if a is None or b is None else b - a

        hits, misses = delta("hits"), delta("misses")
        streamed["hit_rate"] = hits / (hits + misses) if hits + misses else None
        streamed["stall_s_per_token"] = delta("stall_s") / n_decode
        streamed["needed_bytes_per_token"] = delta("bytes_needed") / n_decode
        expert_needed = delta("expert_bytes_needed")
        streamed["expert_needed_bytes_per_token"] = None if expert_needed is None else expert_needed / n_decode
        expert_hits, expert_misses = delta("expert_hits"), delta("expert_misses")
        if expert_hits is not None:
            seen = expert_hits + expert_misses
            streamed["expert_hit_rate"] = expert_hits / seen if seen else None
            streamed["expert_prefetch_wasted_bytes_per_token"] = delta("expert_prefetch_wasted_bytes") / n_decode
        routes = delta("expert_routes")
        if routes:  # expert trimming on: the share of decode's routes it skipped
            streamed["expert_routes_skipped"] = delta("expert_routes_skipped") / routes
        streamed["shard_prefetch_wasted_per_token"] = delta("prefetch_wasted") / n_decode
        fallback = delta("page_cache_fallback_bytes")
        streamed["placement"] = stream_end.get("placement")
        streamed["page_cache_fallback_bytes_per_token"] = None if fallback is None else fallback / n_decode
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": len(ids),
        "tokens": ids,
        "ttft_s": ttft,
        "prefill_tok_s": n_prompt / ttft,
        "decode_s": decode_s,
        "decode_tok_s": n_decode / decode_s if n_decode and decode_s > 0 else None,
        "token_p50_s": percentile(intervals, 50),
        "token_p95_s": percentile(intervals, 95),
        "prefill_read_bytes": _delta(io_start, io_first),
        "decode_read_bytes": decode_read,
        "read_bytes_per_token": decode_read / n_decode if decode_read is not None and n_decode else None,
        "hit_rate": None,
        "stall_s_per_token": None,
        **streamed,
    }


# --- bench phases ---------------------------------------------------------------------------


def phase_disk(spec: dict) -> None:
    """Cold parallel read bandwidth: positional reads of a few MiB from several threads,
    the way the engine reads its pinned set."""
    from kimitui.engine.pinning import ParallelReader
    from pathlib import Path

    from kimitui.model.gguf_map import ByteRange, split_set

    path = str(max(split_set(Path(spec["model"])), key=os.path.getsize))  # of a split set: its largest file
    length = min(spec["sample_bytes"], os.path.getsize(path))
    before = _read_bytes()
    done = ParallelReader(threads=spec["threads"], chunk_bytes=DISK_CHUNK_BYTES).read([path], [ByteRange(0, 0, length)])
    from kimitui.benchmarks.common import drop_from_page_cache

    figures = {}
    if spec.get("slice_bytes"):
        drop_from_page_cache(path)
        figures = _random_reads(path, spec["slice_bytes"], spec["threads"], spec["sample_bytes"])
    drop_from_page_cache(path)
    figures |= _direct_reads(path, spec["threads"], length)
    emit(
        "result",
        bytes=done.done_bytes,
        seconds=done.elapsed_s,
        storage_bytes=_delta(before, _read_bytes()),
        threads=spec["threads"],
        chunk_bytes=DISK_CHUNK_BYTES,
        **figures,
    )


def _direct_reads(path: str, threads: int, length: int) -> dict:
    """The same cold parallel reads with O_DIRECT into memory faulted in beforehand, as the
    engine streams shards on Linux: no page cache on the way. The same bytes as the buffered
    sample, so that a host caching this VM's disk favours neither. Empty where the file system
    refuses O_DIRECT."""
    import ctypes
    import queue
    import threading
    from concurrent.futures import ThreadPoolExecutor

    if not hasattr(os, "O_DIRECT"):
        return {}
    start, end = 0, length // DISK_CHUNK_BYTES * DISK_CHUNK_BYTES or length
    from kimitui.engine.direct import Libc, huge_buffer

    # One buffer per thread, as the engine's: huge pages, faulted in before the clock starts.
    libc = Libc()
    buffers = queue.SimpleQueue()
    for _ in range(threads):
        view = memoryview((ctypes.c_char * DISK_CHUNK_BYTES).from_address(huge_buffer(libc, DISK_CHUNK_BYTES))).cast("B")
        view[:] = bytes(DISK_CHUNK_BYTES)
        buffers.put(view)
    local = threading.local()

    def read(offset: int) -> int:
        view = getattr(local, "view", None)
        if view is None:
            view = local.view = buffers.get()
        return os.preadv(fd, [view[: min(DISK_CHUNK_BYTES, end - offset)]], offset)

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return {}
    try:
        before = _read_bytes()
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            got = sum(pool.map(read, range(start, end, DISK_CHUNK_BYTES)))
        seconds = time.perf_counter() - started
    except OSError:  # O_DIRECT taken at open, refused for reads
        return {}
    finally:
        os.close(fd)
    return {"direct_bytes": got, "direct_seconds": seconds, "direct_storage_bytes": _delta(before, _read_bytes())}


def _random_reads(path: str, slice_bytes: int, threads: int, sample_bytes: int) -> dict:
    """Cold reads of one expert slice each at scattered page-aligned offsets, read-ahead off:
    how fast this disk delivers routed experts, which come in pieces of tens of KiB."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from kimitui.engine.platform import PlatformIO

    size = os.path.getsize(path)
    # A quarter of the file at most, so that few reads land on pages another one brought in.
    count = max(1, min(4000, min(sample_bytes, size) // 4 // slice_bytes))
    rng = random.Random(0)
    page = os.sysconf("SC_PAGE_SIZE")
    offsets = [rng.randrange(0, max(1, size - slice_bytes)) // page * page for _ in range(count)]
    fd = os.open(path, os.O_RDONLY)
    try:
        PlatformIO().exact_reads(fd)
        before = _read_bytes()
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            got = sum(pool.map(lambda offset: len(os.pread(fd, slice_bytes, offset)), offsets))
        seconds = time.perf_counter() - started
    finally:
        os.close(fd)
    return {
        "random_bytes": got,
        "random_seconds": seconds,
        "random_storage_bytes": _delta(before, _read_bytes()),
        "slice_bytes": slice_bytes,
    }


def _engine_generation(engine, spec: dict, reply: int = 0) -> dict:
    """One reply, timed: ``reply`` counts the replies this engine gave before (each later one
    answers a prompt of its own, from further on in the bench's text)."""
    from kimitui.engine.generation import Sampling

    tokens = prompt_tokens(engine.llm, spec["prompt_tokens"], later=reply * spec["prompt_tokens"])
    generation = engine.complete(tokens, Sampling(temperature=0.0, max_tokens=spec["tokens"]))
    ids = (event.token_id for event in generation if event.token_id >= 0)  # -1: a final text flush
    return measure_decode(ids, len(tokens), streaming=lambda: engine.streamer.counters() if engine.streamer else None)


def _engine(spec: dict):
    from kimitui.engine.memory import default_budget
    from kimitui.engine.session import Engine
    from kimitui.engine.streaming import StreamSettings

    # "auto" is sized here, inside the run's cgroup, exactly as the app sizes it.
    budget = spec["budget"] if spec["budget"] is not None else default_budget()
    stream = StreamSettings(**{
        k: spec[k]
        for k in ("policy", "prefetch_depth", "io_threads", "expert_lookahead", "expert_trim_below", "expert_trim_cumulative")
        if spec.get(k) is not None
    })
    return Engine(
        spec["model"], n_ctx=spec["n_ctx"], n_threads=spec["threads"], budget=budget, stream_settings=stream,
        address_space=spec.get("address_space", "auto"), **({"n_batch": spec["n_batch"]} if spec.get("n_batch") else {}),
    )


def phase_engine(spec: dict) -> None:
    """The kimitui engine: fast-start load, the pinned set (setup), then the measured reply."""
    import llama_cpp  # noqa: F401 - imported before the clock starts, as the baseline does

    engine = _engine(spec)
    stream, budget = engine.stream_settings, engine.budget
    started = time.perf_counter()
    engine.load()
    load_s = time.perf_counter() - started
    rss_after_load = _rss()
    started = time.perf_counter()
    shown = [0.0]

    def pinning(progress) -> None:
        now = time.perf_counter()
        if progress.finished or now - shown[0] >= 0.25:
            shown[0] = now
            emit("pinning", line=progress.describe(), finished=progress.finished)

    engine.pin(pinning)
    pin_s = time.perf_counter() - started
    writer = None
    if spec.get("trace"):
        from kimitui.trace.writer import TraceWriter

        writer = TraceWriter(spec["trace"])
        writer.attach(engine)
    with _ModelResidentPeak(engine) as resident:
        figures = _engine_generation(engine, spec)
        # A conversation's next replies: the same engine, its caches as the replies before left them.
        later = [_later_reply(_engine_generation(engine, spec, reply)) for reply in range(1, spec.get("replies", 1))]
    if writer is not None:
        writer.close()
    prefill = {}
    experts = engine.streamer.experts if engine.streamer is not None else None
    if experts is not None:
        # The bytes of the distinct experts the prompt routed to: the least a prefill can read.
        prefill["prefill_distinct_expert_bytes"] = len(experts.prefill_seen) * engine.model_map().bytes_per_expert
        prefill["prefill_expert_read_bytes"] = experts.prefill_read_bytes  # gaps read through included
        prefill["prefill_gap_bytes"] = experts.prefill_gap_bytes
        # The least the prompt must read, as it was evaluated: the streamed trunk once per chunk
        # (llama.cpp's micro-batch) and each chunk's distinct unpinned experts once.
        from kimitui.engine.budget import prompt_chunks

        chunks = prompt_chunks(figures["prompt_tokens"], engine.n_batch, engine.n_ubatch)
        prefill["prefill_chunks"] = chunks
        prefill["prefill_bound_bytes"] = len(chunks) * engine.streamer.streamed_bytes_per_token + experts.prefill_bound_bytes
        prefill["prefill_staged_layers"] = experts.staged_layers
        prefill["prefill_paged_in_bytes"] = engine.streamer.paged_in_bytes  # only a prompt pages in
    emit(
        "result",
        load_s=load_s,
        rss_after_load_bytes=rss_after_load,
        pin_s=pin_s,
        budget_bytes=budget,
        streaming=engine.streamer is not None,
        policy=stream.policy,
        prefetch_depth=stream.prefetch_depth,
        io_threads=stream.io_threads,
        expert_lookahead=stream.expert_lookahead,
        expert_trim=stream.trim_rule.label() or None,
        pinned_bytes=engine.pinned.bytes,
        hot_expert_bytes=engine.pinned.hot_expert_bytes,
        pin_note=engine.pinned.note,
        fast_load_note=engine.fast_load_note,
        peak_rss_bytes=_peak_rss(),
        peak_address_space_bytes=_peak_address_space(),
        peak_model_resident_bytes=resident.peak,
        n_ubatch=engine.n_ubatch,
        plan_note=engine.plan_note,
        windows_bytes=engine.space.plan.total_bytes if engine.space is not None and engine.space.bounded else None,
        slots=engine.space.n_slots if engine.space is not None and engine.space.bounded else None,
        slot_claims=engine.space.claims if engine.space is not None and engine.space.bounded else None,
        slot_wait_s=engine.streamer.slot_wait_s if engine.streamer is not None and engine.space is not None and engine.space.bounded else None,
        **prefill,
        **figures,
        later_replies=later,
    )


def _later_reply(figures: dict) -> dict:
    """What the bench shows of a later reply: its times, hits and stalls, and what it read."""
    keys = (
        "ttft_s", "decode_tok_s", "token_p50_s", "completion_tokens", "expert_hit_rate", "hit_rate", "stall_s_per_token",
        "read_bytes_per_token", "needed_bytes_per_token", "expert_needed_bytes_per_token", "tokens",
    )
    return {key: figures.get(key) for key in keys}


class _ModelResidentPeak:
    """The most of the model's mappings resident at once during a reply (smaps, every 50 ms:
    a tenth of a millisecond each at this size, out of the way of the two cores)."""

    def __init__(self, engine) -> None:
        self.source = engine.metrics.model_resident_source
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._sample()

    def _sample(self) -> None:
        value = self.source() if self.source else None
        if value is not None:
            self.peak = max(self.peak or 0, value)

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def phase_compute(spec: dict) -> None:
    """Compute speed with the weights in RAM: the engine's compute path (repacking off),
    loaded the stock way, which reads the whole file into memory before the first token."""
    import llama_cpp  # noqa: F401 - imported before the clock starts
    from kimitui.engine.session import Engine

    engine = Engine(spec["model"], n_ctx=spec["n_ctx"], n_threads=spec["threads"], fast_load=False)
    started = time.perf_counter()
    engine.load()
    load_s = time.perf_counter() - started
    emit("result", load_s=load_s, peak_rss_bytes=_peak_rss(), **_engine_generation(engine, spec))


def _plain_llama(spec: dict):
    """Stock llama-cpp-python, but with llama.cpp's weight repacking off as the engine has it:
    repacked weights (MXFP4 experts on AVX2, Q4_0) are read and copied into anonymous memory
    at load, so a model larger than memory could not even start, and compute would differ."""
    import llama_cpp

    from kimitui.engine.llama_glue import llama_params

    with llama_params(None, repack=False):
        return llama_cpp.Llama(
            model_path=spec["model"],
            n_ctx=spec["n_ctx"],
            n_threads=spec["threads"],
            n_threads_batch=spec["threads"],  # the engine prefills with the same threads
            verbose=False,
        )


def _plain_greedy(llm, tokens: list[int], n_tokens: int):
    import llama_cpp

    vocab = llm._model.vocab
    # The same sampler settings as the engine's Sampling(temperature=0.0): greedy.
    for n, token in enumerate(llm.generate(tokens, temp=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, reset=True)):
        if llama_cpp.llama_vocab_is_eog(vocab, token) or n >= n_tokens:
            return
        yield token


def phase_interleaved(spec: dict) -> None:
    """A model that fits: the engine and plain llama-cpp-python loaded in one process, their
    replies alternating. Separate processes meet this host's CPU in different moods (whole
    minutes at 105 or at 132 tok/s on the default model), larger than the 3% being judged;
    alternating replies in one process meet the same ones."""
    from kimitui.engine.generation import Sampling

    engine = _engine(spec)
    engine.load()
    engine.pin()
    if engine.streamer is not None:
        emit("result", skipped="the model does not fit the budget: it streams")
        return
    from kimitui.engine.loadhooks import stock_loads

    with stock_loads():  # the engine's load hooks are process-wide: the baseline loads as stock
        llm = _plain_llama(spec)
    tokens = prompt_tokens(llm, spec["prompt_tokens"])
    kimitui, plain = [], []
    for _ in range(spec["rounds"]):
        reply = engine.complete(tokens, Sampling(temperature=0.0, max_tokens=spec["tokens"]))
        kimitui.append(measure_decode((e.token_id for e in reply if e.token_id >= 0), len(tokens))["decode_tok_s"])
        plain.append(measure_decode(_plain_greedy(llm, tokens, spec["tokens"]), len(tokens))["decode_tok_s"])
    emit("result", kimitui=kimitui, plain=plain)


def phase_llama(spec: dict) -> None:
    """Plain llama-cpp-python, stock mmap load, greedy: the baseline."""
    import llama_cpp  # noqa: F401 - imported before the clock starts

    started = time.perf_counter()
    llm = _plain_llama(spec)
    load_s = time.perf_counter() - started
    rss_after_load = _rss()
    tokens = prompt_tokens(llm, spec["prompt_tokens"])
    figures = measure_decode(_plain_greedy(llm, tokens, spec["tokens"]), len(tokens))
    emit("result", load_s=load_s, rss_after_load_bytes=rss_after_load, peak_rss_bytes=_peak_rss(), **figures)


# --- bench-load phases ----------------------------------------------------------------------


def phase_app_load(spec: dict) -> None:
    """The real app, headless, from its own command line until the model is loaded.

    "ready" is sent from Textual's message hook when the app dispatches LoadFinished: the
    handler that runs next sets the main screen's ``ready`` and starts reading the pinned set, so storage
    reads sampled here are the load's alone. The pinned set is not part of start-to-ready.
    """
    import asyncio

    from kimitui.cli import build_app, build_parser

    app = build_app(build_parser().parse_args(spec["argv"]))  # exactly what `kimitui ARGV` builds
    model_path = app.engine.model_path
    from kimitui.benchmarks.common import cached_bytes
    from textual.worker import Worker, WorkerState

    from kimitui.tui.messages import LoadFinished

    failed = []

    def hook(message) -> None:
        if isinstance(message, LoadFinished):
            read = _read_bytes()
            emit("ready", read_bytes=read, load_s=app.engine.load_s, fast_load_note=app.engine.fast_load_note)
            emit("resident", model_cached_bytes=cached_bytes(model_path), peak_rss_bytes=_peak_rss())
        elif isinstance(message, Worker.StateChanged) and message.state is WorkerState.ERROR and message.worker.group == "load":
            failed.append(str(message.worker.error))
            emit("error", message=failed[-1])

    async def main() -> None:
        async with app.run_test(size=(120, 40), message_hook=hook) as pilot:
            while not app.main.ready and not failed:
                await pilot.pause(0.01)
            if app.main.ready:
                emit("result", ready=True)

    asyncio.run(main())


def phase_llama_load(spec: dict) -> None:
    """Plain llama-cpp-python's load with stock settings, from interpreter start."""
    from kimitui.benchmarks.common import cached_bytes

    started = time.perf_counter()
    _plain_llama(spec)
    load_s = time.perf_counter() - started
    emit("ready", read_bytes=_read_bytes(), load_s=load_s)
    emit("resident", model_cached_bytes=cached_bytes(spec["model"]), peak_rss_bytes=_peak_rss())
    emit("result", ready=True)


def phase_conversation(spec: dict) -> None:
    """bench-resume: a conversation on the engine, started afresh in this process. With
    ``build``, a first message of about ``conversation_tokens`` tokens and a short reply, its
    state saved; otherwise the conversation's next message, from its saved state
    (``use_state``) or evaluated again, timed to its first token."""
    from pathlib import Path

    from kimitui.engine.generation import Sampling

    engine = _engine(spec)
    engine.states_dir, engine.state_quota = Path(spec["states_dir"]), (1 << 40 if spec["use_state"] else 0)
    engine.load()
    engine.pin()
    emit("ready")
    key = CONVERSATION_KEY
    if spec["build"]:
        text, tokens = "", 0
        while tokens < spec["conversation_tokens"]:
            text += PROMPT_TEXT
            tokens = len(engine.chat_prompt([{"role": "user", "content": text + "Summarise it."}])[0])
        messages = [{"role": "user", "content": text + "Summarise it."}]
        generation = engine.chat(messages, Sampling(temperature=0.0, max_tokens=spec["reply_tokens"]), keep=key)
        list(generation)
        state = engine.saved_states().path(key)
        messages.append({"role": "assistant", "content": generation.result.text})
        emit("result", messages=messages, prompt_tokens=generation.result.prompt_tokens, notices=generation.result.notices,
             state_bytes=state.stat().st_size if state.exists() else None)
        return
    from kimitui.benchmarks.common import drop_from_page_cache

    messages = spec["messages"] + [{"role": "user", "content": "And in one word?"}]
    states = engine.saved_states()
    if states is not None and states.path(key).exists():
        drop_from_page_cache(states.path(key))  # read from storage, as after a reboot
    read_before, engine_before = _read_bytes(), engine.model_bytes_read()
    started = time.perf_counter()
    generation = engine.chat(messages, Sampling(temperature=0.0, max_tokens=1), keep=key if spec["use_state"] else None)
    events = iter(generation)  # one reply: each iteration of a Generation is a reply of its own
    first = next((event.token_id for event in events if event.token_id >= 0), None)
    ttft = time.perf_counter() - started
    for _ in events:
        pass
    result = generation.result
    emit("result", ttft_s=ttft, first_token=first, prompt_tokens=result.prompt_tokens,
         evaluated_tokens=result.prompt_tokens - result.cached_tokens,
         engine_read_bytes=engine.model_bytes_read() - engine_before, storage_read_bytes=_delta(read_before, _read_bytes()),
         notices=result.notices)


PHASES = {
    "disk": phase_disk,
    "engine": phase_engine,
    "compute": phase_compute,
    "llama": phase_llama,
    "interleaved": phase_interleaved,
    "app-load": phase_app_load,
    "llama-load": phase_llama_load,
    "scale": phase_scale,
    "conversation": phase_conversation,
}


def main(argv: list[str]) -> int:
    phase, spec = argv[0], json.loads(argv[1])
    try:
        PHASES[phase](spec)
    except Exception as exc:  # reported to the parent as one line; it decides what to show
        from kimitui.engine.state import EngineError
        from kimitui.errors import UserError

        if isinstance(exc, (EngineError, UserError)):
            emit("error", message=str(exc))
        else:  # our bug: the traceback goes to stderr, which the parent keeps
            import traceback

            traceback.print_exc()
            emit("error", message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
