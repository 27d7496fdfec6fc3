"""The llama-cpp-python session: load with progress, stream tokens with timings, cancel.

Callers run ``load`` and iterate generations on worker threads; nothing here blocks an event
loop or imports a UI. One llama.cpp context serves everyone, in turn (see turns.py).
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import ctypes
import enum
import itertools
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence

import psutil

from kimitui.engine.interface import PinOutcome, TuningValues
from kimitui.engine.memory import cap_malloc_arenas
from kimitui.engine.metrics import EngineMetrics
from kimitui.engine.settings import StreamSettings
from kimitui.engine.turns import TurnQueue
from kimitui.errors import UserError
from kimitui.model.gguf_file import ModelInfo, read_model_info
from kimitui.units import format_bytes

# Used when a GGUF carries no chat template (base models): plain ChatML.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

if TYPE_CHECKING:  # the streamer is imported when a model streams, not on the way to ready
    from kimitui.engine.streaming import Streamer

_params_lock = threading.Lock()


class DecodeClock:
    """Seconds spent inside llama_decode: compute, plus what the eval callback waited for
    reads (stall). A token's wall time beyond it is sampling, detokenizing and Python."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0  # tokens decoded: a prompt's share tells how much of it came from the cache

    def attach(self, ctx) -> None:
        """Time every decode of ``ctx`` (llama-cpp-python's LlamaContext)."""
        decode = ctx.decode

        def timed(batch):
            started = time.perf_counter()
            try:
                return decode(batch)
            finally:
                self.seconds += time.perf_counter() - started
                self.tokens += batch.batch.n_tokens

        ctx.decode = timed


class EngineState(enum.Enum):
    EMPTY = "empty"
    LOADING = "loading"
    READY = "ready"
    GENERATING = "generating"
    FAILED = "failed"


class EngineError(Exception):
    """A failure while loading or generating; the message is shown to the user as is."""


class ChatTemplateError(EngineError):
    """The model's chat template refused the messages (its ``raise_exception``, or a template
    that does not render them): the request's fault, not the engine's."""


@dataclass
class Sampling:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    max_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-inf bans it)
    grammar: str | None = None  # GBNF the reply must match (llama-cpp-python's LlamaGrammar)
    n_probs: int = 0  # with each token, the most likely n tokens and their log-probabilities
    cache_prompt: bool = True  # False: evaluate the whole prompt afresh (same numerics every time)
    special: bool = False  # special tokens in the reply's text (a tool-call section's markers)


@dataclass(frozen=True)
class TokenEvent:
    text: str  # may be "" while a stop string or a multi-byte character is held back
    token_id: int  # -1 for the final flush of held-back text
    index: int
    wall_s: float  # since the previous token (the first: since the request began, prefill included)
    # With Sampling.n_probs: the token's own log-probability and the top n (id, log-probability),
    # from the logits it was sampled from (logit bias applied, before temperature and the rest).
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class _Logits:
    """llama-cpp-python's logits processor hook, used for two things the sampler lacks: the
    request's logit bias, and the log-probabilities a client asked for."""

    def __init__(self, bias: dict[int, float], n_probs: int) -> None:
        import numpy as np

        self._np = np
        self._ids = np.array(list(bias), dtype=np.intp)
        self._values = np.array(list(bias.values()), dtype=np.float32)
        self.n_probs = n_probs
        self.logprobs = None  # the last step's log-softmax, when asked for

    def __call__(self, _input_ids, scores):
        np = self._np
        if len(self._ids):
            scores[self._ids] += self._values
        if self.n_probs:
            finite = scores[np.isfinite(scores)]
            top = finite.max() if len(finite) else 0.0
            shifted = scores - top
            self.logprobs = shifted - np.log(np.exp(shifted).sum())
        return scores

    def of(self, token: int) -> tuple[float | None, tuple[tuple[int, float], ...]]:
        if self.logprobs is None:
            return None, ()
        np = self._np
        lp = self.logprobs
        best = np.argpartition(-lp, min(self.n_probs, len(lp) - 1))[: self.n_probs]
        best = best[np.argsort(-lp[best])]
        return float(lp[token]), tuple((int(i), float(lp[i])) for i in best)


@dataclass
class GenerationResult:
    text: str = ""
    finish_reason: str = "stop"  # stop | length | cancelled | error
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, reused from the last reply's context (not evaluated)
    completion_tokens: int = 0
    prompt_s: float = 0.0
    decode_s: float = 0.0
    queued_s: float = 0.0
    error: str | None = None
    timings: list[float] = field(default_factory=list)


def _ggml_base(llama_library: str):
    """libggml-base next to libllama: ggml_get_name() reads a graph node's name."""
    import glob
    import os

    candidates = sorted(glob.glob(os.path.join(os.path.dirname(llama_library), "libggml-base.*")))
    if not candidates:
        raise EngineError("cannot find libggml-base next to libllama (llama-cpp-python changed?)")
    lib = ctypes.CDLL(candidates[0])
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = (ctypes.c_void_p,)
    lib.ggml_get_data.restype = ctypes.c_void_p
    lib.ggml_get_data.argtypes = (ctypes.c_void_p,)
    return lib


# The node that holds the token embeddings, computed before layer 0: most graphs name it
# "embd" (build_inp_embd); kimi-k3 renames that same node "inp_embd".
LAYER_ZERO_NODES = (b"embd", b"inp_embd")
WATCHED_NODES = (b"l_out-", b"ffn_moe_topk-")  # each followed by its layer number (their one "-")


def _numbered(name: bytes, prefix: bytes) -> int | None:
    """N for a graph node named exactly ``prefix`` + N ("l_out-12"), else None."""
    if not name.startswith(prefix):
        return None
    tail = name[len(prefix):]
    return int(tail) if tail.isdigit() else None


def _topk_ids(ggml, tensor: int) -> set[int]:
    """Expert ids in a router's top-k node: int32, ne = [k, n_tokens], rows nb[1] apart.

    ne and nb sit right after ggml_tensor's type and buffer fields, a layout ggml has kept
    for years; the data pointer comes through ggml's own accessor.
    """
    k, n_tokens = (ctypes.c_int64 * 2).from_address(tensor + 16)
    row_stride = (ctypes.c_size_t * 2).from_address(tensor + 48)[1]
    data = ggml.ggml_get_data(tensor)
    ids: set[int] = set()
    for token in range(n_tokens):
        ids.update((ctypes.c_int32 * k).from_address(data + token * row_stride))
    return ids


def _last_row_f32(ggml, tensor: int):
    """The one token's row of a float32 activation [n_embd, 1] (decode); None otherwise.

    ggml_tensor starts with its type (0 = GGML_TYPE_F32), then ne at +16 as for the top-k."""
    import numpy as np

    if ctypes.c_int.from_address(tensor).value != 0:
        return None
    n_embd, n_tokens = (ctypes.c_int64 * 2).from_address(tensor + 16)
    if n_tokens != 1:  # prefill reads its experts per batch anyway
        return None
    return np.ctypeslib.as_array((ctypes.c_float * n_embd).from_address(ggml.ggml_get_data(tensor))).copy()


def default_threads() -> int:
    return max(1, psutil.cpu_count(logical=False) or psutil.cpu_count() or 1)


@contextmanager
def _llama_params(progress: Callable[[float], bool] | None, repack: bool, eval_cb=None, abort_cb=None):
    """Give Llama() a progress callback and the repack switch, which its constructor lacks.

    llama-cpp-python builds its llama_model_params from ``llama_model_default_params()``
    inside ``Llama.__init__`` and exposes neither field, so the default is wrapped for the
    duration of one constructor call. The ctypes callback object lives until the load ends.
    """
    import llama_cpp.llama_cpp as C

    original = C.llama_model_default_params
    original_ctx = C.llama_context_default_params
    c_progress = None
    if progress is not None:
        c_progress = C.llama_progress_callback(lambda value, _user: bool(progress(float(value))))

    def patched():
        params = original()
        if c_progress is not None:
            params.progress_callback = c_progress
        params.use_extra_bufts = repack
        return params

    def patched_ctx():
        params = original_ctx()
        if eval_cb is not None:
            params.cb_eval = eval_cb
        if abort_cb is not None:
            params.abort_callback = abort_cb
        return params

    with _params_lock:
        C.llama_model_default_params = patched
        C.llama_context_default_params = patched_ctx
        try:
            yield
        finally:
            C.llama_model_default_params = original
            C.llama_context_default_params = original_ctx


@contextlib.contextmanager
def _templates_checked_later():
    """llama-cpp-python compiles the model's chat templates inside ``Llama()``, for chat handlers
    kimitui never uses, and a template that does not compile fails the whole load. Meanwhile its
    formatter keeps a template that fails to compile as a handler that is never called; the
    engine compiles the template itself afterwards and says why chat cannot work (see
    ``Engine._make_formatter``), while plain completions go on."""
    import llama_cpp.llama_chat_format as chat_format

    original = chat_format.Jinja2ChatFormatter

    class Tolerant(original):
        def __init__(self, *args, **kwargs):
            try:
                super().__init__(*args, **kwargs)
            except Exception:  # noqa: BLE001 - reported by the engine's own compile
                self._env = None

    chat_format.Jinja2ChatFormatter = Tolerant
    try:
        yield
    finally:
        chat_format.Jinja2ChatFormatter = original


_log_sink = None


def _silence_llama_log(llama_cpp) -> None:
    """Send llama.cpp's log lines nowhere, without a Python call per line.

    llama-cpp-python installs a Python log callback; a load logs thousands of lines, each one a
    wait for the GIL while the UI starts beside it. libc's getpid stands in as the callback: it
    takes no arguments, so under the C calling conventions of x86-64 and arm64 (arguments in
    registers, cleaned up by the caller) it ignores the level, text and user pointer it is given.
    """
    global _log_sink
    if _log_sink is None:
        _log_sink = ctypes.cast(ctypes.CDLL(None).getpid, llama_cpp.llama_log_callback)
    llama_cpp.llama_log_set(_log_sink, None)


class LlamaLog:
    """llama.cpp's warnings and errors, the last few kept: a failure's reason is often only there.

    Installed after a load (llama.cpp logs nothing while it decodes, so this costs nothing),
    and for the second try of a load that failed (see ``Engine._load``); the load itself logs
    through ``_silence_llama_log``."""

    WARN, ERROR, CONT = 3, 4, 5  # ggml_log_level

    def __init__(self) -> None:
        import llama_cpp

        self.lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=32)  # (level, text)
        self._keeping = False
        self._callback = llama_cpp.llama_log_callback(self._line)

    def _line(self, level: int, text: bytes, _user) -> None:
        line = (text or b"").decode("utf-8", "replace")
        if level == self.CONT and self._keeping and self.lines:
            kept_level, kept = self.lines[-1]
            self.lines[-1] = (kept_level, kept + line.rstrip("\n"))
            return
        self._keeping = level in (self.WARN, self.ERROR)
        if self._keeping:
            self.lines.append((level, line.strip()))

    def install(self) -> None:
        import llama_cpp

        llama_cpp.llama_log_set(self._callback, None)

    def reason(self) -> str | None:
        """The first error line (the cause; later ones are what failed because of it), else the
        last warning, without llama.cpp's function-name prefix."""
        errors = [text for level, text in self.lines if level == self.ERROR and text]
        line = errors[0] if errors else (self.lines[-1][1] if self.lines else None)
        return line.split(": ", 1)[-1] if line and ": " in line else line


_llama_log: LlamaLog | None = None


def llama_log() -> LlamaLog:
    global _llama_log
    if _llama_log is None:
        _llama_log = LlamaLog()
    return _llama_log


class Tracer(Protocol):
    """Receives what a trace records (kimitui.trace implements it); called on the engine's threads."""

    def request_started(self, request_id: str, model: str, settings: dict) -> None: ...
    def token(
        self, request_id: str, index: int, wall_s: float, before: dict | None, after: dict | None, decode_s: float
    ) -> None: ...
    def read(self, shard, offset: int, length: int, start: float, seconds: float) -> None: ...
    def route(self, layer: int, experts: list[int], hits: int) -> None: ...
    def request_finished(self, request_id: str, result: "GenerationResult") -> None: ...


_request_ids = itertools.count(1)


class Engine:
    def __init__(
        self,
        model_path: Path,
        *,
        n_ctx: int = 4096,
        n_threads: int = 0,
        n_batch: int = 512,
        metrics: EngineMetrics | None = None,
        repack: bool = False,
        fast_load: bool = True,
        budget: int | None = None,
        stream_settings: StreamSettings | None = None,
        shard_size: int = 64 * 2**20,
        n_ctx_fixed: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.model_path = Path(model_path)
        self.chat_template = chat_template  # replaces the model's own (llama-server's --chat-template-file)
        self.n_ctx = n_ctx
        self.n_threads = n_threads or default_threads()
        self.n_batch = n_batch
        self.repack = repack
        self.fast_load = fast_load
        self.fast_load_note: str | None = None  # why the stock load was used, when it was
        self.mappings: dict = {}  # file index -> loadhooks.Mapping, once loaded with fast start
        self.budget = budget
        self.stream_settings = stream_settings or StreamSettings()
        self.shard_size = shard_size
        self.streamer: Streamer | None = None
        self._callbacks: tuple | None = None  # ctypes eval/abort callbacks, alive as long as the context
        self.tracer: Tracer | None = None
        self.decode_clock = DecodeClock()
        self._sizes_at_load: dict[Path, int] = {}
        self.pinned_ranges: list = []
        self.working_bytes = 0
        self._repin_pending = False
        self._rebuild_pending = False  # a fresh context with the streaming callbacks is due
        self._pin_listener: Callable | None = None
        self._pin_placer = None  # holds the pinned set's anonymous pages (see pin)
        self.pinned_bytes = 0
        self.pinned_read_bytes = 0  # model bytes the pinned sets read so far (every re-pin adds)
        self.hot_expert_bytes = 0  # of the pinned set: experts earlier runs' heatmap marked hot
        self.pin_note: str | None = None  # why the pinned set is not locked, when it is not
        self.plan = None  # budget.MemoryPlan, once a streamed model is planned
        self.plan_note: str | None = None  # what the plan changed of the settings, when it did
        self.n_ctx_fixed = n_ctx_fixed  # the user chose n_ctx: refuse rather than shrink it
        self.fit_note: str | None = None  # why n_ctx is smaller than configured, when it is
        self.n_ubatch = n_batch
        self.metrics = metrics or EngineMetrics()
        self.metrics.engine_read_source = self.model_bytes_read
        self.state = EngineState.EMPTY
        self.load_progress = 0.0
        self.load_s: float | None = None
        self.info: ModelInfo | None = None
        self._map = None  # the GGUF map at the current shard size, once pinning needs it
        self.turns = TurnQueue()
        cap_malloc_arenas()  # before the engine's threads start: see memory.py
        self._llm = None
        self._formatter = None
        self.template_error: str | None = None  # why chat cannot be formatted (see _make_formatter)
        self.load_error: str | None = None  # why the load failed: what /health and the app say
        self._abort_load = threading.Event()
        self._on_load_progress: Callable[[float], None] | None = None
        self._early_load: threading.Thread | None = None
        self._early_error: BaseException | None = None
        self._in_c = threading.Event()  # the load thread is past its Python imports (see start_loading)

    # -- loading -------------------------------------------------------------------------

    def model_bytes_read(self) -> int:
        """Model bytes the engine itself has read: its pinned sets and what it streamed."""
        streamer = self.streamer
        return self.pinned_read_bytes + (streamer.bytes_read if streamer is not None else 0)

    def inspect(self) -> ModelInfo:
        """Header checks only (no llama.cpp): raises UserError with one line on a bad file."""
        if self.info is None:
            self.info = read_model_info(self.model_path)
        return self.info

    def start_loading(self) -> None:
        """Begin the load now on a thread of its own; a later ``load()`` joins it.

        The app calls this before it imports and starts its UI: llama.cpp's load runs in C,
        outside the GIL, so the two overlap instead of adding up on the way to ready."""
        if self._early_load is None and self.state is EngineState.EMPTY:
            self.state = EngineState.LOADING
            self._early_load = threading.Thread(target=self._load_early, name="kimitui-load", daemon=True)
            self._early_load.start()

    def wait_until_loading_in_c(self, timeout: float = 2.0) -> None:
        """Wait (a tenth of a second here) until the load started by ``start_loading`` has
        imported llama-cpp-python and runs in C, outside the GIL. Importing the UI meanwhile
        would only take turns with that import on the GIL; after it, the two run side by side."""
        if self._early_load is not None:
            self._in_c.wait(timeout)

    def _load_early(self) -> None:
        try:
            self._load()
        except BaseException as exc:  # handed to whoever joins in load()
            self._early_error = exc
        finally:
            self._in_c.set()

    def load(self, on_progress: Callable[[float], None] | None = None) -> None:
        """Blocking load; call from a worker thread. Raises EngineError on failure."""
        self._on_load_progress = on_progress
        early = self._early_load
        if early is None:
            self._load()
            return
        if on_progress is not None:
            on_progress(self.load_progress)  # what happened before we joined
        early.join()
        if self._early_error is not None:
            raise self._early_error

    def _load(self) -> None:
        """The load; whatever fails leaves the engine FAILED with one line why (``load_error``),
        never LOADING for good."""
        self.state = EngineState.LOADING
        try:
            self._load_steps()
        except (EngineError, UserError) as exc:  # UserError: the file's header, shown as a user mistake
            self.state, self.load_error = EngineState.FAILED, str(exc)
            raise
        except Exception as exc:  # a broken install (no ggml library), a bug: said, not hung
            self.state = EngineState.FAILED
            self.load_error = f"loading {self.model_path.name} failed: {type(exc).__name__}: {exc}"
            raise EngineError(self.load_error) from None

    def _load_steps(self) -> None:
        self.inspect()
        started = time.perf_counter()

        def progress(value: float) -> bool:
            self.load_progress = value
            listener = self._on_load_progress
            if listener is not None:
                listener(value)
            return not self._abort_load.is_set()

        import llama_cpp
        # llama.cpp's log lines would tear a full-screen terminal UI; errors surface as exceptions.
        _silence_llama_log(llama_cpp)
        from kimitui.engine import loadhooks

        hooks = None
        if self.fast_load:
            try:
                hooks = loadhooks.install()
            except loadhooks.HookUnavailable as exc:
                self.fast_load_note = f"fast start unavailable ({exc}); llama.cpp reads the whole model at load"
        streams = self._may_stream()
        callbacks = self._stream_callbacks() if streams else (None, None)
        if streams:
            # A prefill micro-batch needs the union of its tokens' experts at once: as many
            # tokens as the planned expert cache surely holds.
            self.n_ubatch = min(self.n_batch, self._memory_plan(self._model_map()).ubatch)
        self._fit_context()
        # The stock load: llama.cpp would map the file and fault all of it in, so a file cut short
        # (a bumped cable) would SIGBUS compute. Where the model fits in memory it is read into
        # llama.cpp's own buffers instead, and a cut then touches nothing already loaded.
        from kimitui.engine.memory import available_memory

        tensor_bytes = self.inspect().tensor_bytes
        own_buffers = (
            hooks is None
            and tensor_bytes < available_memory() * 0.8  # cgroup limits included
            and (self.budget is None or tensor_bytes <= self.budget)
        )
        if hooks is None and not own_buffers and self.fast_load:
            self.fast_load_note += " (mapped, as it is larger than free memory: a file cut short while it runs crashes the app)"
        from kimitui.engine.platform import model_fits_limits

        files = self.info.files or (self.model_path,)
        refused = model_fits_limits(list(files), 0 if own_buffers else sum(os.path.getsize(f) for f in files))
        if refused:
            raise EngineError(f"cannot load {self.model_path.name}: {refused}")
        process = psutil.Process()
        rss_before, vms_before = process.memory_info()[:2]
        mark = hooks.mark() if hooks is not None else 0
        self._in_c.set()
        try:
            # llama.cpp calls the progress callback once per tensor, each call a wait for the
            # GIL while the UI starts beside it; with fast start the load reads nothing and takes
            # a fraction of a second, so only the stock load, which reads the whole file, has one.
            # The hooks are process-wide once installed: a stock load must not go through them.
            stock = loadhooks.stock_loads() if hooks is None else contextlib.nullcontext()

            def make():
                with stock, _llama_params(progress if hooks is None else None, self.repack, *callbacks), _templates_checked_later():
                    return llama_cpp.Llama(
                        model_path=str(self.model_path),
                        n_ctx=self.n_ctx,
                        n_batch=self.n_batch,
                        n_ubatch=self.n_ubatch,
                        n_threads=self.n_threads,
                        n_threads_batch=self.n_threads,
                        use_mmap=not own_buffers,
                        verbose=False,
                    )

            try:
                self._llm = make()
            except Exception:
                if self._abort_load.is_set():
                    raise
                # llama-cpp-python's exception says only that it failed; llama.cpp logged why,
                # to the sink. Once more with the log kept (a load that fails, fails early).
                if hooks is not None:
                    hooks.close_unclaimed(mark)
                    mark = hooks.mark()
                log = llama_log()
                log.lines.clear()
                log.install()
                try:
                    self._llm = make()
                except Exception as exc:
                    raise RuntimeError(log.reason() or str(exc)) from None
        except Exception as exc:
            if hooks is not None:
                hooks.close_unclaimed(mark)
            if self._abort_load.is_set():
                raise EngineError("loading cancelled") from None
            raise EngineError(f"llama.cpp could not load {self.model_path.name}: {exc}") from None
        llama_log().install()  # from here on llama.cpp's warnings and errors are kept: a failed reply says them
        self.decode_clock.attach(self._llm._ctx)
        if hooks is not None:
            found = {i: hooks.claim(path, since=mark) for i, path in enumerate(files)}
            hooks.close_unclaimed(mark)
            # Every file of a split set must be mapped where we can see it, or none is managed.
            self.mappings = found if all(m is not None for m in found.values()) else {}
            if not self.mappings:
                for m in found.values():
                    if m is not None and m.fd >= 0:
                        os.close(m.fd)
        # Read into llama.cpp's own buffers, the model no longer needs its files: nothing to check.
        self._sizes_at_load = {} if own_buffers else {Path(f): os.stat(f).st_size for f in files}
        if self.mappings:
            from kimitui.engine.memory import mapped_resident_bytes

            spans = [(m.address, m.address + m.length) for m in self.mappings.values()]
            self.metrics.model_resident_source = lambda: mapped_resident_bytes(spans)
        # llama.cpp's own working memory (KV cache, recurrent state, compute buffers, vocabulary):
        # committed at load, touched as the context fills, so the address space it added tells
        # what RSS will tell later. The model's mappings are not part of it.
        rss_after, vms_after = process.memory_info()[:2]
        mapped = sum(os.path.getsize(f) for f in files)
        held = tensor_bytes if own_buffers else 0  # read into llama.cpp's buffers: resident, yet the model's
        self.working_bytes = max(rss_after - rss_before - held, vms_after - vms_before - mapped)
        self._formatter, self.template_error = self._make_formatter()
        self.load_s = time.perf_counter() - started
        if self.load_progress < 1.0:
            progress(1.0)  # fast start: the one step there was
        self.state = EngineState.READY

    def _fit_context(self) -> None:
        """Pick n_ctx so that the budget and llama.cpp's context (KV cache, recurrent state,
        compute buffers) fit the memory this process may use (cgroup limits included): the
        largest up to the configured one, or, when the user chose it, a refusal that says what
        to lower. Without it a context too big is an OOM kill once the KV cache fills."""
        if self.budget is None:
            return
        from kimitui.engine.budget import context_fits, working_estimate
        from kimitui.engine.memory import available_memory

        model = self._model_map()
        weights = min(self.budget, model.tensor_bytes)
        room = available_memory()
        fitted = context_fits(model, weights, room, self.n_ctx, self.n_ubatch)
        if fitted == self.n_ctx:
            return
        if fitted is None or self.n_ctx_fixed:
            need = working_estimate(model, self.n_ctx, self.n_ubatch)
            lower = "--budget" if fitted is None else f"--n-ctx (to {fitted} at most) or --budget"
            raise EngineError(
                f"context of {self.n_ctx} tokens needs {format_bytes(need)} of KV cache and buffers beside the "
                f"{format_bytes(weights)} of weights, but {format_bytes(room)} is available (cgroup limits included): lower {lower}"
            )
        self.fit_note = f"context {fitted} tokens instead of {self.n_ctx}: the KV cache for more would not fit beside the budget"
        self.n_ctx = fitted

    def abort_load(self) -> None:
        self._abort_load.set()

    def cancel_loading(self) -> None:
        """Stop a load started with ``start_loading`` and wait for its thread."""
        self.abort_load()
        if self._early_load is not None:
            self._early_load.join()

    def _may_stream(self) -> bool:
        # The eval callback costs a Python call per graph node: only models that cannot be
        # wholly pinned get it, so runs that fit the budget pay nothing.
        return self.fast_load and self.budget is not None and self.inspect().tensor_bytes > self.budget * 0.8

    def _stream_callbacks(self):
        import llama_cpp.llama_cpp as C

        ggml = _ggml_base(C._lib._name)

        clock = time.perf_counter

        def on_eval(tensor, ask, _user):
            # ggml asks about every graph node, ~17,600 a token at Kimi K3's full size: what the
            # asking costs (pure overhead) and what the observed nodes cost (the streaming work,
            # stalls included) are counted apart (README: the eval callback's cost per token).
            started = clock()
            try:
                return observe(tensor, ask)
            finally:
                streamer = self.streamer
                if streamer is not None:
                    spent = clock() - started
                    if ask:
                        streamer.eval_asks += 1
                        streamer.eval_ask_s += spent
                    else:
                        streamer.eval_observed += 1
                        streamer.eval_observe_s += spent

        def observe(tensor, ask):
            name = ggml.ggml_get_name(tensor) or b""
            # Only the nodes themselves, never views of them: ggml names a view of l_out-5
            # "l_out-5 (reshaped)" (K3's residual attention makes one at each block boundary).
            if ask:  # observe the node before each layer (the embeddings, then l_out-<i>) and each router's top-k
                # Every node passes here: one builtin test first, the digits only for the few that match.
                if name in LAYER_ZERO_NODES or (name.startswith(WATCHED_NODES) and name.partition(b"-")[2].isdigit()):
                    return True
                # With router look-ahead, also each MoE layer's FFN input.
                streamer = self.streamer
                return streamer is not None and streamer.predictor is not None and _numbered(name, b"ffn_norm-") is not None
            streamer = self.streamer
            if streamer is None:
                return True
            # Returning False here would make ggml skip the rest of the graph split: silently
            # wrong logits. Any failure stops the token through the abort callback instead.
            try:
                if (layer := _numbered(name, b"ffn_moe_topk-")) is not None:
                    streamer.on_experts(layer, _topk_ids(ggml, tensor))
                elif (layer := _numbered(name, b"ffn_norm-")) is not None:
                    hidden = _last_row_f32(ggml, tensor)
                    if hidden is not None:
                        streamer.on_router_input(layer, hidden)
                else:
                    streamer.on_layer_start(0 if name in LAYER_ZERO_NODES else _numbered(name, b"l_out-") + 1)
            except Exception as exc:  # noqa: BLE001 - a C callback must not raise
                streamer.fail(f"streaming failed at graph node {name.decode(errors='replace')}: {type(exc).__name__}: {exc}")
            return True

        def on_abort(_user):
            streamer = self.streamer
            return streamer is not None and streamer.error is not None

        self._callbacks = (C.ggml_backend_sched_eval_callback(on_eval), C.ggml_abort_callback(on_abort))
        return self._callbacks

    def pin(self, on_progress: Callable | None = None) -> PinOutcome:
        """Read the pinned set with parallel reads and lock it; call from a worker after load.

        It holds the engine's turn: a reply asked for meanwhile waits in the queue until the
        pinned set and the streamer are complete, rather than computing on a half-read set.
        With the stock load (no fast start) llama.cpp has already read the whole file, so
        there is nothing left to pin. Raises EngineError if the model file cannot be read.
        """
        if on_progress is not None:
            self._pin_listener = on_progress  # a later re-pin (live tuning) reports to it too
        with self.turns.turn():
            self._pin()
        return PinOutcome(self.pinned_bytes, self.pin_note, self.pinned_bytes >= self.inspect().tensor_bytes)

    # -- what a user interface asks (interface.ChatEngine) ---------------------------------

    def label(self) -> tuple[str, int | None]:
        info = self.inspect()
        return info.name, info.file_bytes

    def notices(self) -> list[str]:
        return [note for note in (self.fast_load_note, self.fit_note, self.template_error) if note]

    def tuning(self) -> TuningValues:
        s = self.stream_settings
        return TuningValues(
            self.budget or 0, s.prefetch_depth, self.shard_size, s.policy, s.expert_policy, s.io_threads, s.expert_lookahead,
        )

    def _pin(self) -> None:
        on_progress = self._pin_listener
        if not self.mappings:
            return
        from kimitui.engine.pinning import (
            PLACED_CHUNK_BYTES, ParallelReader, drop_outside, lock_ranges, plan_pinned, shard_ranges, whole_pages,
        )
        from kimitui.engine.platform import PlatformIO

        model = self._model_map()
        streaming = self._callbacks is not None
        settings = self.stream_settings
        hot: list = []
        counts = None
        if streaming:
            plan = self.plan = self._memory_plan(model)
            pinned = list(plan.pinned)
            if plan.prefetch_depth < settings.prefetch_depth:
                settings = replace(settings, prefetch_depth=plan.prefetch_depth)
                self.plan_note = (
                    f"prefetch depth {plan.prefetch_depth} instead of {self.stream_settings.prefetch_depth}: "
                    "deeper read-ahead would pass the budget"
                )
            if model.is_moe:
                from kimitui.engine.experts import hot_experts, load_heatmap

                counts = load_heatmap(self.heatmap_path(model), model.n_layers, model.n_expert)
                hot = hot_experts(model, counts, plan.hot_expert_bytes)
        else:  # the whole model fits: pin it all, streaming nothing
            pinned = plan_pinned(model, sum(shard.length for shard in model.shards))
        ranges = shard_ranges(model, pinned) + [r for unit in hot for r in unit.ranges]
        addresses = {i: m.address for i, m in self.mappings.items()}
        mapping_fds = {i: m.fd for i, m in self.mappings.items() if m.fd >= 0}
        # The pinned set goes into anonymous memory at its place in the mapping, as streamed
        # shards do: a file cut short (a USB cable bumped) then cannot SIGBUS compute there,
        # and the set stays whole when the file comes back. Where that cannot be done (a
        # Linux before 5.7, a file that cannot be opened again) it stays in the page cache, locked.
        placer = PlatformIO().placer(model.files, addresses, mapping_fds, 1)
        pages = whole_pages(ranges, os.sysconf("SC_PAGE_SIZE"))
        try:
            reader = ParallelReader(chunk_bytes=PLACED_CHUNK_BYTES) if placer is not None else ParallelReader()
            reader.read(model.files, pages, on_progress, cancel=self._abort_load, placer=placer)
        except OSError as exc:
            if placer is not None:
                placer.close()
            self._repin_pending = True  # the next reply tries again: the drive may be back by then
            raise EngineError(f"cannot read the pinned set of {self.model_path.name}: {exc}") from None
        if placer is not None:
            placer.done_reading()
        self.pinned_read_bytes += sum(r.length for r in pages)
        self._pin_placer = placer
        if self._abort_load.is_set():
            return
        self.pin_note = lock_ranges(addresses, pages)
        if streaming:
            lengths = {i: m.length for i, m in self.mappings.items()}
            kept = drop_outside(addresses, lengths, {i: str(path) for i, path in enumerate(model.files)}, ranges)
            self.pin_note = "; ".join(note for note in (self.pin_note, kept) if note) or None
        self.pinned_ranges = pages
        self.pinned_bytes = sum(r.length for r in ranges)
        self.hot_expert_bytes = sum(unit.footprint for unit in hot)
        if streaming:
            from kimitui.engine.streaming import Streamer

            streamer = Streamer(
                model, addresses, {s.index for s in pinned}, settings, self.metrics,
                mapping_fds=mapping_fds, window_limit=plan.window_bytes,
            )
            if model.is_moe:
                streamer.attach_experts(plan.expert_bytes - self.hot_expert_bytes, hot, counts)
                experts = streamer.experts
                self.metrics.experts_source = lambda: ([row[:] for row in experts.counts], experts.layer_hit_rates())

                def resident_per_layer(sizes=[layer.n_expert for layer in model.layers]) -> list[tuple[int, int]]:
                    per_layer = [0] * len(sizes)
                    for layer, _expert in experts.resident_keys():
                        per_layer[layer] += 1
                    return list(zip(per_layer, sizes))

                self.metrics.expert_residency_source = resident_per_layer
            self.metrics.residency_source = streamer.residency_by_layer
            self.streamer = streamer  # complete, experts attached, before the eval callback sees it
            self.set_tracer(self.tracer)

    def _memory_plan(self, model):
        from kimitui.engine.budget import plan_memory
        from kimitui.engine.memory import default_budget

        budget = self.budget if self.budget is not None else default_budget()
        return plan_memory(model, budget, self.stream_settings.prefetch_depth, self.n_batch)

    def check_files(self) -> None:
        """A model held whole has no per-layer check (no eval callback): before each reply, make
        sure no file shrank or vanished since load, or compute would die of SIGBUS in the mapping."""
        for path, size in self._sizes_at_load.items():
            try:
                now = os.stat(path).st_size
            except OSError as exc:
                raise EngineError(f"cannot reach model file {path.name}: {exc.strerror or exc} (drive removed?)") from None
            if now < size:
                raise EngineError(
                    f"model file {path.name} is now {now} bytes, {size} at load (file truncated or drive removed?)"
                )

    def _model_map(self):
        """Parsed once; a live shard-size change regroups the same tensors, so a re-pin between
        two tokens does not parse the header again."""
        if self._map is None:
            from kimitui.model.gguf_map import load_model_map

            self._map = load_model_map(self.model_path, shard_size=self.shard_size)
        elif self._map.shard_size != self.shard_size:
            self._map = self._map.regroup(self.shard_size)
        return self._map

    def heatmap_path(self, model) -> Path:
        from kimitui.config import cache_dir
        from kimitui.engine.experts import heatmap_path

        return heatmap_path(model, cache_dir())

    def save_heatmap(self) -> None:
        """Keep what routing taught us for the next run's pinned hot experts."""
        streamer = self.streamer
        if streamer is not None and streamer.experts is not None:
            from kimitui.engine.experts import save_heatmap

            save_heatmap(self.heatmap_path(streamer.model), streamer.experts.counts)

    def set_tracer(self, tracer: "Tracer | None") -> None:
        self.tracer = tracer
        if self.streamer is not None:
            self.streamer.on_read = tracer.read if tracer is not None else None
            self.streamer.on_route = tracer.route if tracer is not None else None

    def trace_settings(self) -> dict:
        """The settings a trace records with each request."""
        return {
            "budget": self.budget,
            "shard_size": self.shard_size,
            "prefetch_depth": self.stream_settings.prefetch_depth,
            "policy": self.stream_settings.policy,
            "expert_policy": self.stream_settings.expert_policy,
            "expert_lookahead": self.stream_settings.expert_lookahead,
            "pinned_bytes": self.pinned_bytes,
            "streaming": self.streamer is not None,
            # Routed experts that may be resident at once (pinned hot ones and the cache): the
            # capacity an offline optimum of the same routing is computed for.
            "expert_slots": self._expert_slots(),
        }

    def _expert_slots(self) -> int | None:
        from kimitui.engine.budget import expert_footprint

        experts = self.streamer.experts if self.streamer is not None else None
        if experts is None or not self._model_map().bytes_per_expert:
            return None
        return len(experts.pinned) + experts.capacity // expert_footprint(self._model_map())

    def retune(self, *, budget: int | None = None, shard_size: int | None = None, **stream) -> str:
        """Live tuning, applied from the next token. Budget and shard size change the pinned
        set: it is re-read before that token (mid-reply, or when the next reply starts), and
        the token waits for it, which the latency panel shows. Returns a line saying when the
        change applies."""
        if budget is not None:
            from kimitui.engine.budget import budget_shortfall

            try:
                shortfall = budget_shortfall(self._model_map(), budget)
            except UserError as exc:  # the file changed under us since load
                raise EngineError(str(exc)) from None
            if shortfall:  # refused before anything changes
                raise EngineError(shortfall)
        changes = {k: v for k, v in stream.items() if v is not None}
        if changes:
            if self.streamer is not None:
                try:
                    self.streamer.reconfigure(**changes)
                except ValueError as exc:  # refused before anything changes
                    raise EngineError(str(exc)) from None
            self.stream_settings = replace(self.stream_settings, **changes)
        repin = (budget is not None and budget != self.budget) or (shard_size is not None and shard_size != self.shard_size)
        if budget is not None:
            self.budget = budget
            self.metrics.budget_bytes = budget
        if shard_size is not None:
            self.shard_size = shard_size
        if not repin:
            return "applies from the next token"
        if self._callbacks is None and self.inspect().tensor_bytes > (self.budget or 0) * 0.8:
            if not self.mappings:
                return "no streaming after the stock load (it read the whole model): the budget applies at the next start"
            # The model fitted, so it runs without the eval callback, which a llama.cpp context
            # only takes when it is created: the next reply starts on a fresh one.
            self._rebuild_pending = self._repin_pending = True
            return "applies from the next reply: streaming starts on a fresh llama.cpp context"
        if self._model_map().is_moe and min(self.n_batch, self._memory_plan(self._model_map()).ubatch) != self.n_ubatch:
            # The expert cache changes size: prefill micro-batches must follow, which llama.cpp
            # takes only with a fresh context (the conversation is prefilled again).
            self._rebuild_pending = self._repin_pending = True
            return "applies from the next reply, on a fresh llama.cpp context sized for the new expert cache"
        self._repin_pending = True
        return "applies from the next token, after the pinned set is re-read"

    def _rebuild_context(self) -> None:
        """Give the loaded model a fresh llama.cpp context with the streaming callbacks.

        The old context goes first (its KV cache could be gigabytes); the next reply prefills
        its prompt again."""
        import llama_cpp._internals as internals

        self._rebuild_pending = False
        llm = self._llm
        params = llm.context_params
        params.cb_eval, params.abort_callback = self._stream_callbacks()
        # The prefill micro-batch the new budget's expert cache holds (see budget.py).
        self.n_ubatch = min(self.n_batch, self._memory_plan(self._model_map()).ubatch)
        params.n_ubatch = self.n_ubatch
        llm._ctx.close()
        try:
            llm._ctx = internals.LlamaContext(model=llm._model, params=params, verbose=False)
        except Exception as exc:
            self.state = EngineState.FAILED
            raise EngineError(f"llama.cpp could not make a new context for streaming: {exc}") from None
        llm._stack.callback(llm._ctx.close)
        self.decode_clock.attach(llm._ctx)
        llm.reset()

    def _repin(self) -> None:
        from kimitui.engine.pinning import unlock_ranges

        if self._rebuild_pending:
            self._rebuild_context()
        self._repin_pending = False
        if self.streamer is not None:
            self.save_heatmap()  # what routing taught so far seeds the new pinned set
            self.streamer.close()
            self.streamer = None
        if self.mappings and self.pinned_ranges:
            unlock_ranges({i: m.address for i, m in self.mappings.items()}, self.pinned_ranges)
        self._release_pinned()
        self._pin()  # the reply calling this holds the turn already

    def _release_pinned(self) -> None:
        """The pinned set's anonymous pages go back to the file (the mapping reads the file there again)."""
        self.pinned_ranges, self.pinned_bytes = [], 0
        if self._pin_placer is not None:
            self._pin_placer.close()
            self._pin_placer = None

    def close(self) -> None:
        self.abort_load()
        with self.turns.turn():
            if self.streamer is not None:
                self.streamer.close()
                self.streamer = None
            self._release_pinned()
            if self._llm is not None:
                self._llm.close()
                self._llm = None
            for m in self.mappings.values():
                if m.fd >= 0:
                    os.close(m.fd)
            self.mappings = {}
        self.state = EngineState.EMPTY

    @property
    def mapping(self):
        """The first (or only) model file's mapping; None with the stock load."""
        return self.mappings.get(0)

    @property
    def llm(self):
        if self._llm is None:
            raise EngineError("the model is not loaded yet")
        return self._llm

    def _make_formatter(self):
        """The chat formatter, or None and why: a template that does not compile leaves the
        model usable for plain completions, and each chat request is told why it cannot be."""
        llm = self._llm
        template = self.chat_template or llm.metadata.get("tokenizer.chat_template") or FALLBACK_TEMPLATE
        eos, bos = llm.token_eos(), llm.token_bos()
        try:
            return _chat_formatter()(
                template=template,
                eos_token=self.token_text(eos) if eos >= 0 else "",
                bos_token=self.token_text(bos) if bos >= 0 else "",
                stop_token_ids=[eos] if eos >= 0 else None,
            ), None
        except Exception as exc:  # jinja2.TemplateSyntaxError, mostly
            where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
            return None, f"the chat template of {self.model_path.name} does not compile{where}: {exc}"

    # -- tokens --------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.llm.detokenize([token_id], special=True).decode("utf-8", errors="replace")

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.llm.detokenize(list(tokens)).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """One token's bytes (a piece of a multi-byte character is not text on its own)."""
        return self.llm.detokenize([token], special=True)

    def grammar_error(self, grammar: str) -> str | None:
        """Why llama.cpp would refuse this GBNF grammar (its parser's first error), or None.
        llama-cpp-python hands the text over unchecked, and a sampler chain with a refused
        grammar in it crashes the process. The parser writes its error, and the whole grammar,
        to stderr: that is caught in a file (a pipe could fill and block) and kept off the
        terminal, where it would paint over the app."""
        import llama_cpp

        with _stderr_caught() as caught:
            sampler = llama_cpp.llama_sampler_init_grammar(self.llm._model.vocab, grammar.encode("utf-8"), b"root")
        if sampler:
            llama_cpp.llama_sampler_free(sampler)
            return None
        said = [line.strip() for line in caught.text.splitlines() if line.strip()]
        first = next((line for line in said if "error" in line), said[0] if said else "")
        return first.split("error parsing grammar: ", 1)[-1] or "it does not parse"

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None):
        """``messages`` (and the tools a reply may call) through the model's chat template
        (llama-cpp-python's formatter response: prompt, stop, added_special)."""
        if self._formatter is None:
            raise ChatTemplateError(self.template_error or "the model is not loaded yet")
        import copy

        try:
            # Copies: the template's sandbox lets lists grow (see _chat_formatter), and the
            # caller's messages (the app's history) must come back as they went in.
            return self._formatter(messages=copy.deepcopy(messages), tools=copy.deepcopy(tools))
        except Exception as exc:  # jinja2's errors, and the template's raise_exception (ValueError)
            raise ChatTemplateError(f"the chat template of {self.model_path.name} refused the messages: {exc}") from None

    @property
    def template_text(self) -> str:
        """The chat template in use (for what it can render: tools, tool calls)."""
        return self.chat_template or (self._llm.metadata.get("tokenizer.chat_template", "") if self._llm is not None else "")

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], tuple[str, ...]]:
        """Token ids of ``messages`` rendered with the model's template, and its stop strings."""
        rendered = self.render_chat(messages, tools)
        tokens = self.tokenize(rendered.prompt, add_special=not rendered.added_special)
        stop = rendered.stop
        stops = tuple(s for s in ([stop] if isinstance(stop, str) else (stop or [])) if s)
        return tokens, stops

    def fit_chat(self, messages: list[dict], max_tokens: int) -> tuple[list[int], tuple[str, ...]]:
        """Drop the oldest turns (never the system prompt or the last message) until it fits."""
        msgs = list(messages)
        while True:
            tokens, stops = self.chat_prompt(msgs)
            room = self.n_ctx - len(tokens)
            if room >= min(max_tokens, 16):
                return tokens, stops
            first = 1 if msgs and msgs[0].get("role") == "system" else 0
            if len(msgs) - first <= 1:
                raise EngineError(f"the prompt is {len(tokens)} tokens; the context holds {self.n_ctx}")
            del msgs[first]

    # -- generation ----------------------------------------------------------------------

    def chat(self, messages: list[dict], sampling: Sampling) -> "Generation":
        return Generation(self, lambda: self.fit_chat(messages, sampling.max_tokens), sampling)

    def complete(self, prompt: str | list[int], sampling: Sampling) -> "Generation":
        def build():
            tokens = list(prompt) if isinstance(prompt, list) else self.tokenize(prompt)
            if not tokens:
                raise EngineError("the prompt is empty")
            if len(tokens) >= self.n_ctx:
                raise EngineError(f"the prompt is {len(tokens)} tokens; the context holds {self.n_ctx}")
            return tokens, ()

        return Generation(self, build, sampling)


def engine_from_settings(settings, model_path: Path) -> Engine:
    """The engine as configured (model, budget, streaming keys): one recipe for app and server."""
    from kimitui.engine.memory import default_budget

    budget = settings["engine.budget"]
    metrics = EngineMetrics(latency_window=settings["metrics.latency_window"])
    metrics.budget_bytes = default_budget() if budget == "auto" else budget
    return Engine(
        model_path,
        n_ctx=settings["model.n_ctx"],
        n_ctx_fixed=settings.origin("model.n_ctx") != "default",
        n_threads=settings["model.n_threads"],
        n_batch=settings["model.n_batch"],
        metrics=metrics,
        budget=metrics.budget_bytes,
        shard_size=settings["engine.shard_size"],
        chat_template=_chat_template_file(settings["model.chat_template_file"]),
        stream_settings=StreamSettings(
            prefetch_depth=settings["engine.prefetch_depth"],
            policy=settings["engine.policy"],
            io_threads=settings["engine.io_threads"],
            expert_policy=settings["engine.expert_policy"],
            expert_lookahead=settings["engine.expert_lookahead"],
        ),
    )


_stderr_lock = threading.Lock()


class _Caught:
    text = ""  # what was written, once the block is over


@contextlib.contextmanager
def _stderr_caught():
    """What C code writes to file descriptor 2 meanwhile, caught in a temporary file."""
    import tempfile

    caught = _Caught()
    with _stderr_lock, tempfile.TemporaryFile() as file:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(file.fileno(), 2)
        try:
            yield caught
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            caught.text = file.read().decode("utf-8", errors="replace")


def _chat_formatter():
    """llama-cpp-python's Jinja formatter with a sandbox whose lists may grow: Kimi K2's template
    builds its tool-call list with ``.append``, which the immutable sandbox refuses. Attribute
    access stays sandboxed."""
    import jinja2
    from jinja2.sandbox import SandboxedEnvironment
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    class ChatFormatter(Jinja2ChatFormatter):
        def __init__(self, template: str, **kwargs) -> None:
            super().__init__(template, **kwargs)
            environment = SandboxedEnvironment(
                loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                extensions=[Jinja2ChatFormatter.IgnoreGenerationTags, jinja2.ext.loopcontrols],
            )
            environment.filters["tojson"] = self.tojson
            self._environment = environment.from_string(template)

    return ChatFormatter


def _chat_template_file(path: str) -> str | None:
    if not path:
        return None
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"model.chat_template_file: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that could start a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold


class Generation:
    """One request's token stream. Iterate for TokenEvents; read ``result`` afterwards.

    ``cancel()`` is safe from any thread and takes effect before the next token (or, while
    queued, gives the turn up at once).
    """

    def __init__(self, engine: Engine, build: Callable[[], tuple[list[int], tuple[str, ...]]], sampling: Sampling):
        self.engine = engine
        self.sampling = sampling
        self.result = GenerationResult()
        self.id = f"req-{next(_request_ids)}"
        self._build = build
        self._cancel = threading.Event()
        self.ticket: int | None = None

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def queue_position(self) -> int | None:
        return None if self.ticket is None else self.engine.turns.position(self.ticket)

    def __iter__(self) -> Iterator[TokenEvent]:
        engine = self.engine
        queued_at = time.perf_counter()
        self.ticket = engine.turns.take()
        if not engine.turns.wait(self.ticket, self._cancel):
            self.result.finish_reason = "cancelled"
            return
        try:
            self.result.queued_s = time.perf_counter() - queued_at
            engine.state = EngineState.GENERATING
            try:
                if engine._repin_pending:
                    try:
                        engine._repin()
                    except EngineError as exc:
                        self.result.finish_reason, self.result.error = "error", str(exc)
                        raise
                yield from self._run()
            finally:
                if engine.state is EngineState.GENERATING:  # FAILED stays
                    engine.state = EngineState.READY
        finally:
            engine.turns.release(self.ticket)

    def _run(self) -> Iterator[TokenEvent]:
        engine, s, result = self.engine, self.sampling, self.result
        llm = engine.llm
        metrics = engine.metrics
        started = time.perf_counter()
        metrics.request_started()
        if engine.streamer is not None and engine.streamer.error is not None:
            engine.streamer.reset_error()  # a failure after the last reply's last token: that reply is over
        try:
            if engine.streamer is None:
                engine.check_files()
            prompt_tokens, template_stops = self._build()
        except EngineError as exc:
            result.finish_reason, result.error = "error", str(exc)
            metrics.request_finished()
            raise
        stops = tuple(dict.fromkeys(tuple(s.stop) + template_stops))
        result.prompt_tokens = len(prompt_tokens)
        budget = max(0, min(s.max_tokens, engine.n_ctx - len(prompt_tokens)))
        llm.set_seed(s.seed if s.seed is not None else 0xFFFFFFFF)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        import llama_cpp

        vocab = llm._model.vocab
        tracer = engine.tracer

        def counters() -> dict | None:  # the streamer is replaced when live tuning re-pins
            return engine.streamer.counters() if engine.streamer is not None else None

        before = counters()
        log = llama_log()
        log.lines.clear()
        if tracer is not None:
            tracer.request_started(self.id, engine.model_path.name, engine.trace_settings())
        text, emitted, cut = "", 0, -1
        last = started
        finish = "length"
        try:
            if budget == 0:
                return
            from llama_cpp import LlamaGrammar, LogitsProcessorList

            logits = _Logits(s.logit_bias, s.n_probs) if s.logit_bias or s.n_probs else None
            grammar = None
            if s.grammar is not None:
                error = engine.grammar_error(s.grammar)  # a refused grammar in the sampler chain would crash the process
                if error is not None:
                    raise EngineError(f"grammar: llama.cpp refused it: {error}")
                grammar = LlamaGrammar.from_string(s.grammar, verbose=False)
            if not s.cache_prompt:
                llm.reset()  # the whole prompt in one evaluation, as on a fresh context
            tokens = llm.generate(
                prompt_tokens,
                top_k=s.top_k,
                top_p=s.top_p,
                min_p=s.min_p,
                temp=s.temperature,
                repeat_penalty=s.repeat_penalty,
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                logits_processor=LogitsProcessorList([logits]) if logits is not None else None,
                grammar=grammar,
            )
            clock = engine.decode_clock
            decoded, decoded_tokens = clock.seconds, clock.tokens
            experts = engine.streamer.experts if engine.streamer is not None else None
            if experts is not None:
                experts.begin_prefill()
            for index, token in enumerate(tokens):
                now = time.perf_counter()
                wall = now - last
                last = now
                decode_s, decoded = clock.seconds - decoded, clock.seconds
                if index == 0:
                    result.prompt_s = wall
                    result.cached_tokens = max(0, len(prompt_tokens) - (clock.tokens - decoded_tokens))
                    metrics.prompt_evaluated(len(prompt_tokens))
                    if experts is not None:
                        experts.prefilling = False
                if llama_cpp.llama_vocab_is_eog(vocab, token):
                    finish = "stop"
                    break
                result.completion_tokens += 1
                result.timings.append(wall)
                metrics.token(wall)
                if tracer is not None:
                    after = counters()
                    tracer.token(self.id, index, wall, before, after, decode_s)
                    before = after
                text += decoder.decode(llm.detokenize([token], special=s.special))
                cut = -1
                for stop in stops:
                    at = text.find(stop, max(0, emitted - len(stop)))
                    if at != -1 and (cut == -1 or at < cut):
                        cut = at
                logprob, top = logits.of(token) if logits is not None else (None, ())
                if cut != -1:
                    text = text[:cut]
                    yield TokenEvent(text[emitted:], token, index, wall, logprob, top)
                    emitted = len(text)
                    finish = "stop"
                    break
                safe = len(text) - _held_back(text, stops)
                yield TokenEvent(text[emitted:safe], token, index, wall, logprob, top)
                emitted = max(emitted, safe)
                if engine._repin_pending and not engine._rebuild_pending:
                    # Budget or shard size changed mid-reply: from the next token on. Its wait
                    # for the re-read pinned set is part of its time, where the panels show it.
                    engine._repin()
                    before = counters()
                if self._cancel.is_set():
                    finish = "cancelled"
                    break
                if result.completion_tokens >= budget:
                    finish = "length"
                    break
            else:
                finish = "stop"
            if finish != "stop" or cut == -1:
                # What was held back as a possible stop string, or a dangling byte sequence, is real text.
                text += decoder.decode(b"", final=True)
                if len(text) > emitted:
                    yield TokenEvent(text[emitted:], -1, result.completion_tokens, 0.0)
                    emitted = len(text)
        except GeneratorExit:
            finish = "cancelled"
            raise
        except Exception as exc:  # llama_decode failures and the like: stop this reply only
            finish = "error"
            streamer = engine.streamer
            if streamer is not None and streamer.error is not None:
                result.error = streamer.error  # the read that failed, not llama.cpp's "aborted"
                streamer.reset_error()
            else:
                reason = log.reason()  # what llama.cpp said while this reply ran, if anything
                result.error = f"generation failed: {exc}" + (f" (llama.cpp: {reason})" if reason else "")
            raise EngineError(result.error) from None
        finally:
            result.text = text
            result.finish_reason = finish
            result.decode_s = max(0.0, last - started - result.prompt_s)
            metrics.request_finished()
            engine.save_heatmap()
            if tracer is not None:
                tracer.request_finished(self.id, result)
