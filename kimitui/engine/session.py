"""The llama-cpp-python session: load with progress, stream tokens with timings, cancel.

Callers run ``load`` and iterate generations on worker threads; nothing here blocks an event
loop or imports a UI. One llama.cpp context serves everyone, in turn (see turns.py).

The Engine is the face: it loads, pins and retunes, and hands each reply to a Generation
(generation.py), which sees it only as a ReplyHost. What the budget allows is budget.py's to
decide, reading the pinned set pinning.py's, llama.cpp's per-node callbacks graph_watch.py's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import psutil

from kimitui.config import key_spec
from kimitui.engine.interface import PinOutcome, TuningValues
from kimitui.engine.addressing import StoreTooLarge
from kimitui.engine.budget import PIECE_BYTES
from kimitui.engine.pinning import PinnedSet
from kimitui.engine.tuning import PendingTuning, schedule
from kimitui.engine.memory import cap_malloc_arenas, settle_collector
from kimitui.engine.metrics import DutyLimited, EngineMetrics
from kimitui.engine.settings import StreamSettings, check_changes
from kimitui.engine.turns import TurnQueue
from kimitui.errors import UserError
from kimitui.model.gguf_file import ModelInfo, read_model_info
from kimitui.units import format_bytes
from kimitui.engine.generation import Generation, Sampling, Tracer
from kimitui.engine.graph_watch import GraphWatch
from kimitui.engine.llama_glue import (
    FALLBACK_TEMPLATE, BuiltinChatFormatter, CancelFlag, builtin_chat_templates, DecodeClock, chat_formatter, chat_template_file, default_threads,
    ggml_base, llama_log, llama_params, silence_llama_log, stderr_caught, templates_checked_later,
    is_recurrent, restore_sequence, sequence_state,
)
from kimitui.engine.saved_states import SavedStates, StateRefused, model_identity
from kimitui.engine.slots import Slots, common_prefix
from kimitui.engine.state import ChatTemplateError, EngineError, EngineState, Lifecycle


if TYPE_CHECKING:  # the streamer is imported when a model streams, not on the way to ready
    from kimitui.engine.streaming import Streamer


@dataclass(frozen=True)
class LoadPlan:
    """How the model is held, decided before llama.cpp loads it."""

    files: tuple[Path, ...]
    files_bytes: int
    tensor_bytes: int
    bounded: bool  # larger than the address space allows: the weights live in windows (addressing.py)
    streams: bool  # its context has the streaming callbacks
    own_buffers: bool  # the stock load reads it into llama.cpp's own buffers (no mapping to fault on)


class Engine:
    def __init__(
        self,
        model_path: Path,
        *,
        n_ctx: int = key_spec("model.n_ctx").default,
        n_threads: int = 0,
        n_batch: int = key_spec("model.n_batch").default,
        metrics: EngineMetrics | None = None,
        repack: bool = False,
        fast_load: bool = True,
        budget: int | None = None,
        stream_settings: StreamSettings | None = None,
        shard_size: int = key_spec("engine.shard_size").default,
        n_ctx_fixed: bool = False,
        chat_template: str | None = None,
        n_slots: int = 1,
        address_space: int | str = "auto",
        states_dir: Path | None = None,
        state_quota: int = 0,
        context_shift: bool = False,
        speculate: str = key_spec("engine.speculate").default,
        draft_max: int = key_spec("engine.draft_max").default,
        draft_model: str = key_spec("engine.draft_model").default,
    ) -> None:
        """``states_dir``: where conversations' llama.cpp states are kept (saved_states.py), within
        ``state_quota`` bytes; None or 0: none kept. ``context_shift``: a reply that fills the
        context goes on, its older half dropped (where the model's memory can shift).

        One function: every attribute the engine holds, one a line with what it is, in one
        place; the load and the pinned set fill them in."""
        self.model_path = Path(model_path)
        self.context_shift_asked = context_shift
        self.speculate = speculate  # engine.speculate: "lookup" drafts from the conversation, or "off"
        self.draft_max = draft_max  # the most drafts one pass verifies
        self.draft_model_path = draft_model  # engine.draft_model: a small model whose drafts replace the lookup's
        self._draft_model = None  # speculation.DraftModel, loaded with the model
        self._draft_bytes: int | None = None  # its weights and context, beside the budget, once worked out
        self._made_cache = None  # the context's kv_cache.KVCache, once made
        self._rollback_guard = None  # speculation.RollbackGuard, on a recurrent model's context with snapshots
        # Replaces the model's own: Jinja text, or the name of one of llama.cpp's built-in templates.
        self.chat_template = chat_template
        self.n_ctx = n_ctx
        self.lifecycle = Lifecycle()  # the engine's state; every change goes through it
        self.slots = Slots(n_slots, self.lifecycle)  # the context split between clients' prompt caches (slots.py)
        self.states_dir = states_dir
        self.state_quota = state_quota if states_dir is not None else 0
        self._states: SavedStates | None = None  # for the model and context loaded now
        self.n_threads = n_threads or default_threads()
        self.n_batch = n_batch
        self.repack = repack
        self.fast_load = fast_load
        self.fast_load_note: str | None = None  # why the stock load was used, when it was
        self.mappings: dict = {}  # file index -> loadhooks.Mapping, once loaded with fast start
        self.address_space = address_space  # engine.address_space: "auto" or bytes
        self.space = None  # where the weights live (addressing.py), once loaded with fast start
        self.pointers = None  # addressing.WeightPointers, while weights still point into phantoms
        self.budget = budget
        self.stream_settings = stream_settings or StreamSettings()
        self.shard_size = shard_size
        self.streamer: Streamer | None = None
        self._callbacks: tuple | None = None  # ctypes eval/abort callbacks, alive as long as the context
        self.tracer: Tracer | None = None
        self.decode_clock = DecodeClock()
        self.cancel_flag: CancelFlag | None = None  # llama.cpp's abort flag, once a context exists
        self._replying = None  # the Generation holding the turn, whose cancel sets the flag
        self._replying_lock = threading.Lock()
        self._sizes_at_load: dict[Path, int] = {}
        self.working_bytes = 0
        self.pending = PendingTuning()  # what live tuning left for the next token or reply
        self._pin_listener: Callable | None = None
        self.pinned = PinnedSet()
        self.streamed_before = 0  # bytes the streamers that re-pins replaced had read
        self.plan = None  # budget.MemoryPlan, once a streamed model is planned
        self.plan_note: str | None = None  # what the plan changed of the settings, when it did
        self.n_ctx_fixed = n_ctx_fixed  # the user chose n_ctx: refuse rather than shrink it
        self.fit_note: str | None = None  # why n_ctx is smaller than configured, when it is
        self.draft_cap: int | None = None  # the most drafts a pass carries whose copies of the recurrent state fit
        self.draft_note: str | None = None  # why that is fewer than draft_max, when it is
        self.n_ubatch = n_batch
        self.ubatch_cap: int | None = None  # the most n_ubatch whose compute buffers fit beside the context
        self.metrics = metrics or EngineMetrics()
        self.metrics.engine_read_source = self.model_bytes_read
        self.metrics.budget_source = lambda: self.budget
        self.load_progress = 0.0
        self.load_s: float | None = None
        self.info: ModelInfo | None = None
        self._map = None  # the GGUF map at the current shard size, once pinning needs it
        self._plan_made = None  # (model map, the settings it was made for, the memory plan)
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
        self._rss_before_load = 0  # the process's RSS before llama.cpp loaded: what the engine holds is above it

    @property
    def state(self) -> EngineState:
        return self.lifecycle.state

    # -- loading -------------------------------------------------------------------------

    def model_bytes_read(self) -> int:
        """Model bytes the engine itself has read: its pinned sets and what it streamed."""
        streamer = self.streamer
        return self.pinned.read_bytes + self.streamed_before + (streamer.bytes_read if streamer is not None else 0)

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
            self.lifecycle.move(EngineState.LOADING)
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
        if self.state is not EngineState.LOADING:  # start_loading moved it already
            self.lifecycle.move(EngineState.LOADING)
        try:
            self._load_steps()
        except (EngineError, UserError) as exc:  # UserError: the file's header, shown as a user mistake
            self.load_error = str(exc)
            self.lifecycle.fail(self.load_error)
            raise
        except Exception as exc:  # a broken install (no ggml library), a bug: said, not hung
            self.load_error = f"loading {self.model_path.name} failed: {type(exc).__name__}: {exc}"
            self.lifecycle.fail(self.load_error)
            raise EngineError(self.load_error) from None

    def _load_steps(self) -> None:
        """The load in its order: fast start's hooks, how the model is held (LoadPlan), the
        llama.cpp model and context, the mappings fast start saw, what the load took."""
        self.inspect()
        self._draft_model_path()  # a draft model that is not there is said before the model loads
        started = time.perf_counter()

        def progress(value: float) -> bool:
            self.load_progress = value
            listener = self._on_load_progress
            if listener is not None:
                listener(value)
            return not self._abort_load.is_set()

        import llama_cpp
        # llama.cpp's log lines would tear a full-screen terminal UI; errors surface as exceptions.
        silence_llama_log(llama_cpp)
        hooks = self._fast_start_hooks()
        way = self._load_plan(hooks)
        process = psutil.Process()
        rss_before, vms_before = process.memory_info()[:2]
        self._rss_before_load = rss_before
        mark = self._make_llama(llama_cpp, hooks, way, progress)
        self._guard_rollbacks()
        llama_log().install()  # from here on llama.cpp's warnings and errors are kept: a failed reply says them
        self.decode_clock.attach(self._llm._ctx)
        self.cancel_flag = CancelFlag()
        if not way.streams:  # a streaming context's abort callback asks the flag itself
            self.cancel_flag.attach(self._llm._ctx)
        if hooks is not None:
            self._claim_mappings(hooks, mark, way.files)
        # Read into llama.cpp's own buffers, the model no longer needs its files: nothing to check.
        self._sizes_at_load = {} if way.own_buffers else {Path(f): os.stat(f).st_size for f in way.files}
        if self.mappings:
            self._watch_model_resident(way.bounded)
        elif way.bounded:
            raise EngineError(f"cannot load {self.model_path.name}: llama.cpp mapped none of its files where kimitui can see them")
        # llama.cpp's own working memory (KV cache, recurrent state, compute buffers, vocabulary):
        # committed at load, touched as the context fills, so the address space it added tells
        # what RSS will tell later. The model's mappings are not part of it.
        rss_after, vms_after = process.memory_info()[:2]
        mapped = self.space.size if way.bounded else way.files_bytes  # the windows' region, reserved whole
        held = way.tensor_bytes if way.own_buffers else 0  # read into llama.cpp's buffers: resident, yet the model's
        self.working_bytes = max(rss_after - rss_before - held, vms_after - vms_before - mapped)
        self._formatter, self.template_error = self._make_formatter()
        self._draft_model = self._load_draft_model(llama_cpp)
        self.load_s = time.perf_counter() - started
        if self.load_progress < 1.0:
            progress(1.0)  # fast start: the one step there was
        self.lifecycle.move(EngineState.READY)

    @property
    def kv_cache(self):
        """How the context caches keys and values (kv_cache.py): where drafts may be checked,
        a cache that computes a batched token as a lone one; once loaded, the one it was made with."""
        from kimitui.engine import kv_cache

        if self._made_cache is not None:
            return self._made_cache
        if not self._drafts_possible:
            return kv_cache.PLAIN
        model = self.model_map()
        return kv_cache.for_drafts(model.hparams, model.architecture)

    def _draft_model_path(self) -> Path | None:
        """engine.draft_model where drafts may be checked (loaded for nothing elsewhere: its file
        and context would take memory beside the budget); EngineError where speculation is on
        and it is not a file."""
        if not self.draft_model_path or self.speculate == "off":
            return None
        path = Path(self.draft_model_path).expanduser()
        if not path.is_file():
            raise EngineError(f"draft model {path}: no such file")
        return path if self._drafts_possible else None

    def _draft_model_bytes(self) -> int:
        """What the draft model takes beside the model: its weights, read whole, and its context
        (the budget holds neither)."""
        if self._draft_bytes is None:  # worked out once: a retune must not find the file gone
            path = self._draft_model_path()
            if path is None:
                return 0
            from kimitui.engine.budget import working_estimate
            from kimitui.model.gguf_map import load_model_map

            self._draft_bytes = path.stat().st_size + working_estimate(load_model_map(path), self.slot_ctx, self.n_batch)
        return self._draft_bytes

    def _guard_rollbacks(self) -> None:
        """A recurrent model's context with draft snapshots takes back only a drafted pass's
        own tokens (speculation.RollbackGuard)."""
        import llama_cpp

        from kimitui.engine.speculation import RollbackGuard

        llm = self._llm
        snapshots = llama_cpp.llama_n_rs_seq(llm._ctx.ctx)
        self._rollback_guard = RollbackGuard(llm._ctx) if snapshots and is_recurrent(llm) else None

    def _load_draft_model(self, llama_cpp):
        """engine.draft_model, read whole beside the model (it is small, and never streams);
        refused in one line where its vocabulary is not the model's."""
        path = self._draft_model_path()
        if path is None:
            return None
        from kimitui.engine import loadhooks
        from kimitui.engine.speculation import DraftModel, vocabulary_difference

        llama_log().lines.clear()  # its reason, if it fails, is this load's
        try:
            with loadhooks.stock_loads(), llama_params(None, repack=False), templates_checked_later():
                # Its drafts need not match to the bit: flash attention's F16 cache, as counted.
                llm = llama_cpp.Llama(
                    model_path=str(path), n_ctx=self.slot_ctx, n_batch=self.n_batch, n_threads=self.n_threads,
                    n_threads_batch=self.n_threads, flash_attn=True, verbose=False,
                )
        except Exception as exc:  # noqa: BLE001 - llama-cpp-python says only that it failed
            reason = llama_log().reason()
            raise EngineError(f"draft model {path.name}: llama.cpp could not load it ({reason or exc})") from None
        difference = vocabulary_difference(self._llm, llm)
        if difference is not None:
            llm.close()
            raise EngineError(
                f"draft model {path.name}: its vocabulary is not {self.model_path.name}'s ({difference}): "
                "its drafts could not be checked against the model's tokens"
            )
        return DraftModel(llm)

    def _fast_start_hooks(self):
        """loadhooks' hooks, installed, for fast start; None (and the note why) for the stock load."""
        from kimitui.engine import loadhooks

        if not self.fast_load:
            return None
        try:
            return loadhooks.install()
        except loadhooks.HookUnavailable as exc:
            self.fast_load_note = f"fast start unavailable ({exc}); llama.cpp reads the whole model at load"
            return None

    def _load_plan(self, hooks) -> LoadPlan:
        """How the model is held, decided before llama.cpp is called: streamed or whole, in
        windows or mapped whole, in llama.cpp's own buffers; the context and micro-batch fitted
        to it. EngineError when the files pass the process's limits."""
        files = tuple(self.info.files or (self.model_path,))
        files_bytes = sum(os.path.getsize(f) for f in files)
        bound = self._address_bound() if hooks is not None else None
        # Larger than the address space allows: llama.cpp's mappings are phantoms, and the
        # weights live in windows (addressing.py), which only a streamed model has.
        bounded = bound is not None and files_bytes > bound
        streams = self._may_stream() or bounded
        if streams:
            # A prefill micro-batch needs the union of its tokens' experts at once: as many
            # tokens as the planned expert cache surely holds.
            self.n_ubatch = min(self.n_batch, self._memory_plan(self.model_map()).ubatch)
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

        refused = model_fits_limits(list(files), 0 if own_buffers or bounded else files_bytes)
        if refused:
            raise EngineError(f"cannot load {self.model_path.name}: {refused}")
        return LoadPlan(files, files_bytes, tensor_bytes, bounded, streams, own_buffers)

    def _make_llama(self, llama_cpp, hooks, way: LoadPlan, progress: Callable[[float], bool]) -> int:
        """llama.cpp's model and context (``_llm``), made the way ``way`` says; once more with
        its log kept where the first try fails, so the error says why. Returns the hooks' mark
        the mappings are claimed since. EngineError when it fails or is cancelled."""
        from kimitui.engine import loadhooks

        mark = hooks.mark() if hooks is not None else 0
        if way.bounded:
            from kimitui.engine.addressing import PHANTOM_BASE

            hooks.phantom_next = PHANTOM_BASE
        self._in_c.set()
        try:
            # llama.cpp calls the progress callback once per tensor, each call a wait for the
            # GIL while the UI starts beside it; with fast start the load reads nothing and takes
            # a fraction of a second, so only the stock load, which reads the whole file, has one.
            # The hooks are process-wide once installed: a stock load must not go through them.
            # A factory, not one context manager: the retry below enters it a second time.
            stock = loadhooks.stock_loads if hooks is None else contextlib.nullcontext
            callbacks = self._stream_callbacks() if way.streams else (None, None)
            self._made_cache = None  # a context made again is made for what holds now
            cache = self.kv_cache

            def make():
                with stock(), llama_params(progress if hooks is None else None, self.repack and not way.bounded, *callbacks,
                                           rs_snapshots=self.rollback_snapshots), templates_checked_later():
                    return llama_cpp.Llama(
                        model_path=str(self.model_path),
                        n_ctx=self.slot_ctx,  # one slot's share: the others are parked (slots.py)
                        n_batch=self.n_batch,
                        n_ubatch=self.n_ubatch,
                        n_threads=self.n_threads,
                        n_threads_batch=self.n_threads,
                        use_mmap=not way.own_buffers,
                        # Speculation checks drafts in a batch: its cache makes a batched token's
                        # logits equal a lone one's (docs/design.md, "Speculative decoding").
                        **cache.llama_params(),
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
                hooks.phantom_next = None
            if self._abort_load.is_set():
                raise EngineError("loading cancelled") from None
            raise EngineError(f"llama.cpp could not load {self.model_path.name}: {exc}") from None
        self._made_cache = cache
        return mark

    def _claim_mappings(self, hooks, mark: int, files: Sequence[Path]) -> None:
        """The mappings llama.cpp made of ``files`` since ``mark``, kept as ``mappings``: all of
        them, or none (every file of a split set must be mapped where we can see it)."""
        hooks.phantom_next = None
        found = {i: hooks.claim(path, since=mark) for i, path in enumerate(files)}
        hooks.close_unclaimed(mark)
        self.mappings = found if all(m is not None for m in found.values()) else {}
        if not self.mappings:
            for m in found.values():
                if m is not None and m.fd >= 0:
                    os.close(m.fd)

    def _watch_model_resident(self, bounded: bool) -> None:
        """Where the weights live (``space``), and the metrics' source of how much of the
        model is resident: from pagemap where the mapped tensor data is small enough to read
        it, else from smaps; with what the streamer parked."""
        from kimitui.engine.addressing import PinnedStore
        from kimitui.engine.memory import PAGEMAP_MOST, mapped_resident_bytes, pagemap_resident_bytes, tensor_data_spans

        space = self.space = self._make_space(self._address_bound(loaded=True) if bounded else None)
        shared = PinnedStore.NAME if space.bounded else None
        mapped_data: list = []  # the whole files' spans of tensor data, once first asked for

        def parked() -> int:
            streamer = self.streamer
            return streamer.parked_bytes if streamer is not None else 0

        def spare() -> int:  # faulted in ahead of the placer's reads, outside the mapping
            streamer = self.streamer
            return streamer.spare_bytes if streamer is not None else 0

        def model_resident() -> int | None:
            if not space.bounded:
                if not mapped_data:
                    mapped_data.extend(tensor_data_spans(self.model_map(), space))
                if sum(end - start for start, end in mapped_data) <= PAGEMAP_MOST:
                    found = pagemap_resident_bytes(mapped_data)
                    if found is not None:
                        return found + spare()
            # Experts parked while smaps is read were counted in their slot and would be again
            # as parked (on K3, 0.5 GiB over the budget that was never there): read again then.
            for _ in range(4):
                before = parked()
                found = mapped_resident_bytes(space.spans(), shared_name=shared)
                if found is None or parked() == before:
                    break
            return None if found is None else found + parked() + spare()

        self.metrics.model_resident_source = DutyLimited(model_resident)

    def _address_bound(self, loaded: bool = False) -> int | None:
        """The address space the weights may take (engine.address_space), None: unbounded.
        Before the load it counts llama.cpp's KV cache and buffers by estimate; once loaded they
        are in the process's address space already (K3's took 3.7 GiB here, against an estimate
        of its resident 0.4 GiB), and the windows are sized from what is really left."""
        from kimitui.engine.addressing import address_bound
        from kimitui.engine.budget import working_estimate

        model = self.model_map()
        beside = self._memory_plan(model).pool_buffers * PIECE_BYTES  # the direct-read pool's buffers
        if not loaded:
            beside += working_estimate(model, self.n_ctx, self.n_ubatch, self.slots.count, self.rollback_snapshots,
                                       self.kv_cache.value_bytes)
        return address_bound(self.address_space, beside)

    def _make_space(self, bound: int | None):
        """Where the weights live: each file's whole mapping, or (``bound``) the windows."""
        from kimitui.engine.addressing import WeightPointers, Windows, WholeFiles, plan_windows

        if bound is None:
            return WholeFiles({i: m.address for i, m in self.mappings.items()}, {i: m.length for i, m in self.mappings.items()})
        model = self.model_map()
        fds = {}
        for i, m in self.mappings.items():
            fds[i] = m.fd if m.fd >= 0 else os.open(model.files[i], os.O_RDONLY)
        self.mappings = {i: replace(m, fd=fds[i]) for i, m in self.mappings.items()}  # closed with the engine
        import llama_cpp.llama_cpp as C

        WeightPointers.check_layout(ggml_base(C._lib._name))
        budget = self.budget if self.budget is not None else self._memory_plan(model).budget
        try:
            space = Windows(plan_windows(model, bound, budget), fds, {i: m.address for i, m in self.mappings.items()})
        except (OSError, EngineError) as exc:
            from kimitui.engine.platform import address_space_fix

            raise EngineError(
                f"cannot load {self.model_path.name}: out of address space, not a damaged file: {exc}; "
                f"{address_space_fix(total_bytes=bound)}"
            ) from None
        # The windows' bytes are read past the page cache. What another reader left cached would
        # be mapped a whole folio at a time wherever llama.cpp touches a window's file page (a
        # slice's shared end page), resident and counted against the budget: give it back.
        from kimitui.engine.platform import PlatformIO

        io = PlatformIO()
        for fd in fds.values():
            io.uncache(fd, 0, 0)
        self.pointers = WeightPointers(space)
        return space

    def _fit_context(self) -> None:
        """n_ctx (and where that lets the whole context fit, fewer drafts a pass or a smaller
        micro-batch) so that the budget and llama.cpp's context fit the memory this process may
        use (budget.drafts_that_fit, budget.fit_context)."""
        if self.budget is None:
            return
        from kimitui.engine.budget import drafts_that_fit, fit_context
        from kimitui.engine.memory import available_memory

        model = self.model_map()
        room = available_memory() - self._draft_model_bytes()
        weights, value_bytes = min(self.budget, model.tensor_bytes), self.kv_cache.value_bytes
        # Each draft a pass may carry keeps a copy of the recurrent state (0.46 GB at K3's full
        # size): fewer drafts before a smaller context.
        asked = self.rollback_snapshots
        fewer = drafts_that_fit(model, weights, room, self.n_ctx, self.n_ubatch, self.slots.count, asked, value_bytes)
        if fewer < asked:
            self.draft_cap = fewer
            self.draft_note = (
                f"speculation drafts at most {fewer} a pass, not {asked}: more copies of "
                f"{self.model_path.name}'s recurrent state would not fit beside the budget"
            )
        n_ctx, ubatch_cap, note = fit_context(
            model, weights, room, self.n_ctx, self.n_ubatch, self.slots.count,
            fixed=self.n_ctx_fixed, snapshots=self.rollback_snapshots, value_bytes=value_bytes,
        )
        if ubatch_cap is not None:
            self.n_ubatch = self.ubatch_cap = ubatch_cap
        if note is not None:
            self.fit_note, self.n_ctx = note, n_ctx

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

    @property
    def streams(self) -> bool:
        """Its context has the streaming callbacks: a streamer feeds it."""
        return self._callbacks is not None

    def _stream_callbacks(self) -> tuple:
        """A new context's per-node callbacks (graph_watch.py), kept alive as long as it."""
        import llama_cpp.llama_cpp as C

        self._callbacks = GraphWatch(self, ggml_base(C._lib._name)).c_callbacks()
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
        return PinOutcome(self.pinned.bytes, self.pinned.note, self.pinned.bytes >= self.inspect().tensor_bytes)

    # -- what a user interface asks (interface.ChatEngine) ---------------------------------

    def label(self) -> tuple[str, int | None]:
        info = self.inspect()
        return info.name, info.file_bytes

    def notices(self) -> list[str]:
        return [note for note in (self.fast_load_note, self.fit_note, self.draft_note, self.speculation_note, self.template_error, self.shift_note) if note]

    @property
    def shift_note(self) -> str | None:
        if self.context_shift_asked and self._llm is not None and not self.can_shift:
            return (
                f"context shift is off for {self.model_path.name}: its recurrent state (Kimi K3's KDA) cannot shift, so a reply "
                "stops when the context is full; the next message drops the oldest turns instead"
            )
        return None

    @property
    def rollback_snapshots(self) -> int:
        """Copies of the recurrent state llama.cpp keeps so that rejected drafts can be taken back
        (K3's KDA; none for a model without one, where llama.cpp ignores the setting): one per
        draft a pass may carry. llama.cpp keeps a batch's last that many + 1 tokens in one
        micro-batch, which must hold one more (it aborts otherwise). 0 where nothing streams:
        nothing is drafted there."""
        return self._draft_limit if self._drafts_possible else 0

    @property
    def _drafts_possible(self) -> bool:
        """Speculation is on, the model streams (or will) and no context shift takes its replies:
        where nothing streams a draft would cost compute and save no read, and a reply that may
        shift is decoded a token at a time (its cache need not be the drafts')."""
        if self._made_cache is not None and not self._made_cache.batch_exact:
            return False  # the context was made for none: what was decided then holds
        return self._drafts_wanted and not self._shifts

    @property
    def _drafts_wanted(self) -> bool:
        """Speculation is on and the model streams (or will), a context shift aside."""
        return self.speculate != "off" and (self.streams or self._may_stream())

    @property
    def _shifts(self) -> bool:
        """A context shift takes the replies (``context_shift``); before the load, where it is
        asked and the model keeps no recurrent state (which cannot shift)."""
        if self._llm is not None:
            return self.context_shift
        from kimitui.engine.llama_glue import keeps_recurrent_state

        return self.context_shift_asked and not keeps_recurrent_state(self.model_map())

    @property
    def speculation_note(self) -> str | None:
        if self._drafts_wanted and self._shifts:
            return "speculation drafts nothing while context shift is on: a reply that may shift is decoded a token at a time"
        return None

    @property
    def _draft_limit(self) -> int:
        """The most drafts a pass may carry: draft_max, fewer where their copies of the recurrent
        state would not fit (draft_cap), and a pass is one micro-batch (the one llama.cpp really
        uses: llama-cpp-python cuts n_batch to the context), two tokens short."""
        return max(0, min(self.draft_max, self.draft_max if self.draft_cap is None else self.draft_cap, self.n_ubatch - 2, self.n_batch - 2, self.slot_ctx - 2))

    def speculation(self):
        """This reply's drafts: where speculation is on and the model's memory can take rejected
        drafts back; the most drafts a pass carries fit one micro-batch."""
        if self.speculate == "off" or self._llm is None or self.streamer is None or not self.kv_cache.batch_exact:
            return None  # nothing streams, or the context was made for no drafts
        import llama_cpp

        from kimitui.engine.speculation import DraftPlanner, Speculation

        llm = self._llm
        most = self._draft_limit
        if is_recurrent(llm):
            most = min(most, llama_cpp.llama_n_rs_seq(llm._ctx.ctx))
        if most < 1:
            return None

        def pass_bytes() -> tuple[int, int] | None:
            streamer = self.streamer
            if streamer is None:
                return None
            counters = streamer.counters()
            experts = counters["expert_bytes_needed"] or 0
            return counters["bytes_needed"] - experts, experts

        return Speculation(
            # Acceptance is learnt afresh each reply: whether it copies text is the reply's own.
            DraftPlanner(most), pass_bytes, draft_model=self._draft_model, on_pass=self.metrics.draft_pass,
            guard=self._rollback_guard, n_ctx=llm.n_ctx(),
        )

    def lossy_setting(self) -> str | None:
        return self.stream_settings.trim_rule.label() or None

    def tuning(self) -> TuningValues:
        s = self.stream_settings
        return TuningValues(
            self.budget or 0, s.prefetch_depth, self.shard_size, s.policy, s.expert_policy, s.io_threads, s.expert_lookahead,
            s.expert_trim_below, s.expert_trim_cumulative,
        )

    def _pin(self) -> None:
        """Read the pinned set (the whole model where it fits, else the memory plan's shards and
        hot experts, cut to the bounded layout's store) and stream the rest."""
        if not self.mappings:
            return
        model = self.model_map()
        streaming = self.streams
        pinned, hot, counts, settings = self._planned_pins(model, streaming)
        unpinned = 0  # planned for pinning, left out by the bounded layout's store: the window may take it
        if self.space.bounded:
            from kimitui.engine.pinning import fit_store

            pinned, hot, unpinned = fit_store(pinned, hot, self.space.plan.store_bytes, os.sysconf("SC_PAGE_SIZE"))
            if unpinned:
                self.plan_note = (
                    f"pins {format_bytes(unpinned)} less than the budget allows: the address space leaves the pinned set "
                    f"{format_bytes(self.space.plan.store_bytes)} (raise engine.address_space)"
                )
        self._read_pinned(model, pinned, hot, streaming)
        if streaming and not self._abort_load.is_set():
            self._start_streamer(model, settings, {s.index for s in pinned}, hot, counts, unpinned)

    def _planned_pins(self, model, streaming: bool) -> tuple[list, list, list | None, StreamSettings]:
        """What to pin: (shards, hot expert units, the routing heatmap they came from, the stream
        settings the plan leaves). Streaming, it follows the memory plan (kept as ``plan``),
        whose read-ahead may be shallower than asked (``plan_note`` says why)."""
        from kimitui.engine.pinning import plan_pinned

        settings = self.stream_settings
        if not streaming:  # the whole model fits: pin it all, streaming nothing
            return plan_pinned(model, sum(shard.length for shard in model.shards)), [], None, settings
        plan = self.plan = self._memory_plan(model)
        if plan.prefetch_depth < settings.prefetch_depth:
            settings = replace(settings, prefetch_depth=plan.prefetch_depth)
            self.plan_note = (
                f"prefetch depth {plan.prefetch_depth} instead of {self.stream_settings.prefetch_depth}: "
                "deeper read-ahead would pass the budget"
            )
        if self.space.bounded and settings.prefetch_depth >= self.space.n_slots:
            settings = replace(settings, prefetch_depth=self.space.n_slots - 1)
            self.plan_note = (
                f"prefetch depth {settings.prefetch_depth} instead of {self.stream_settings.prefetch_depth}: "
                f"the address space holds {self.space.n_slots} layers at once"
            )
        if not model.is_moe:
            return list(plan.pinned), [], None, settings
        from kimitui.engine.experts import hot_experts, load_heatmap

        counts = load_heatmap(self.heatmap_path(model), model.n_layers, model.n_expert)
        return list(plan.pinned), hot_experts(model, counts, plan.hot_expert_bytes), counts, settings

    def _read_pinned(self, model, pinned: list, hot: list, streaming: bool) -> None:
        """Read and lock ``pinned`` and ``hot`` (into the bounded layout's store, or in place in
        the mappings); EngineError where they cannot be read, and a re-pin left for later."""
        from kimitui.engine.pinning import shard_ranges

        on_progress = self._pin_listener
        ranges = shard_ranges(model, pinned) + [r for unit in hot for r in unit.ranges]
        try:
            if self.space.bounded:
                try:
                    self.pinned.read_store(model.files, self.space, ranges, hot, on_progress, self._abort_load)
                except StoreTooLarge as exc:
                    self.pending.repin = True  # a lower budget or a re-pin later may fit
                    raise EngineError(str(exc)) from None
            else:
                self.pinned.read(model.files, self.mappings, ranges, hot, on_progress, self._abort_load, drop_the_rest=streaming)
        except OSError as exc:
            self.pending.repin = True  # the next reply tries again: the drive may be back by then
            raise EngineError(f"cannot read the pinned set of {self.model_path.name}: {exc}") from None

    def _start_streamer(self, model, settings: StreamSettings, pinned: set[int], hot: list, counts, unpinned: int) -> None:
        """The streamer for what is not pinned, with the expert cache beside the hot experts,
        published to the metrics; ``streamer`` only once complete (the eval callback reads it)."""
        from kimitui.engine.streaming import Streamer

        plan = self.plan
        streamer = Streamer(
            model, self.space, pinned, settings,
            mapping_fds={i: m.fd for i, m in self.mappings.items() if m.fd >= 0},
            window_limit=plan.window_bytes + unpinned, pool_limit=plan.pool_buffers + unpinned // PIECE_BYTES,
        )
        if model.is_moe:
            streamer.attach_experts(plan.expert_bytes - self.pinned.hot_expert_bytes, hot, counts)
            experts = streamer.experts
            self.metrics.experts_source = lambda: ([row[:] for row in experts.counts], experts.layer_hit_rates())

            def resident_per_layer(sizes=[layer.n_expert for layer in model.layers]) -> list[tuple[int, int]]:
                per_layer = [0] * len(sizes)
                for layer, _expert in experts.resident_keys():
                    per_layer[layer] += 1
                return list(zip(per_layer, sizes))

            self.metrics.expert_residency_source = resident_per_layer
        self.metrics.residency_source = streamer.residency_by_layer
        self.metrics.attach_streamer(streamer.panel_counters)
        self.streamer = streamer  # complete, experts attached, before the eval callback sees it
        settle_collector()
        self.set_tracer(self.tracer)

    def _memory_plan(self, model):
        """The memory plan for these settings, made once: a load asks for it up to four times
        (the address bound before and after llama.cpp's load, the micro-batch, the pin), and
        it takes 64 ms on the full-size K3."""
        from kimitui.engine.budget import plan_memory
        from kimitui.engine.memory import default_budget

        budget = self.budget if self.budget is not None else default_budget()
        key = (budget, self.stream_settings.prefetch_depth, self.n_batch)
        cached = self._plan_made
        if cached is None or cached[0] is not model or cached[1] != key:
            cached = self._plan_made = (model, key, plan_memory(model, budget, *key[1:]))
        return cached[2]

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

    def model_map(self):
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
            "expert_trim_below": self.stream_settings.expert_trim_below,
            "expert_trim_cumulative": self.stream_settings.expert_trim_cumulative,
            "pinned_bytes": self.pinned.bytes,
            "streaming": self.streamer is not None,
            # Routed experts that may be resident at once (pinned hot ones and the cache): the
            # capacity an offline optimum of the same routing is computed for.
            "expert_slots": self._expert_slots(),
        }

    def _expert_slots(self) -> int | None:
        from kimitui.engine.budget import expert_footprint

        experts = self.streamer.experts if self.streamer is not None else None
        if experts is None or not self.model_map().bytes_per_expert:
            return None
        return len(experts.pinned) + experts.capacity // expert_footprint(self.model_map())

    def retune(self, *, budget: int | None = None, shard_size: int | None = None, **stream) -> str:
        """Live tuning, applied from the next token. Budget and shard size change the pinned
        set: it is re-read before that token (mid-reply, or when the next reply starts), and
        the token waits for it, which the latency panel shows. Returns a line saying when the
        change applies."""
        if budget is not None:
            from kimitui.engine.budget import budget_shortfall

            try:
                shortfall = budget_shortfall(self.model_map(), budget)
            except UserError as exc:  # the file changed under us since load
                raise EngineError(str(exc)) from None
            if shortfall:  # refused before anything changes
                raise EngineError(shortfall)
            too_much = self._budget_overflow(budget)
            if too_much:
                raise EngineError(too_much)
        changes = {k: v for k, v in stream.items() if v is not None}
        try:
            check_changes(changes)  # refused before anything changes, streaming yet or not
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if changes:
            if self.streamer is not None:
                self.streamer.reconfigure(**changes)
            self.stream_settings = replace(self.stream_settings, **changes)
        repin = (budget is not None and budget != self.budget) or (shard_size is not None and shard_size != self.shard_size)
        if budget is not None:
            self.budget = budget
        if shard_size is not None:
            self.shard_size = shard_size
        return schedule(
            self.pending,
            repin=repin,
            streams=self.streams,
            fits=lambda: self.inspect().tensor_bytes <= (self.budget or 0) * 0.8,
            mapped=bool(self.mappings),
            ubatch_changes=lambda: self.model_map().is_moe and min(self.n_batch, self._memory_plan(self.model_map()).ubatch) != self.n_ubatch,
        )

    # -- the reply holding the turn (its cancel reaches llama.cpp between graph nodes) ---------

    def open_reply(self, generation: Generation) -> None:
        """The turn is ``generation``'s: the engine mended first where it failed (EngineError:
        the reply is refused), then its cancel reaches llama.cpp's abort flag."""
        self.lifecycle.begin_reply()
        with self._replying_lock:
            self._replying = generation
            flag = self.cancel_flag
            if flag is not None and generation.cancelled:
                flag.set()
            elif flag is not None:
                flag.clear()

    def close_reply(self, generation: Generation) -> None:
        with self._replying_lock:
            if self._replying is generation:
                self._replying = None
                if self.cancel_flag is not None:
                    self.cancel_flag.clear()
        self.lifecycle.end_reply()

    def cancel_reply(self, generation) -> None:
        """Stop ``generation``'s evaluation within the graph node it is in, if it holds the turn."""
        with self._replying_lock:
            if self._replying is generation and self.cancel_flag is not None:
                self.cancel_flag.set()

    def _budget_overflow(self, budget: int) -> str | None:
        """Why ``budget`` would not fit beside llama.cpp's context (budget.budget_overflow), or
        None. What the engine holds now (its pages and llama.cpp's memory, RSS above where the
        load began) is its to reuse."""
        if budget <= (self.budget or 0):
            return None  # lowering never needs more memory
        from kimitui.engine.budget import budget_overflow
        from kimitui.engine.memory import available_memory

        held = max(0, psutil.Process().memory_info().rss - self._rss_before_load)
        return budget_overflow(
            self.model_map(), budget, available_memory() + held - self._draft_model_bytes(), self.n_ctx, self.n_ubatch,
            self.slots.count, self.rollback_snapshots, self.kv_cache.value_bytes,
        )

    def between_tokens(self, *, mid_reply: bool) -> bool:
        """Carry out what ``retune`` left for a token to do: re-read the pinned set, and between
        replies only, give the model a fresh context first. The caller holds the turn. Whether
        anything was done."""
        if not self.pending.due(mid_reply):
            return False
        self._repin()
        return True

    def _rebuild_context(self) -> None:
        """Give the loaded model a fresh llama.cpp context with the streaming callbacks.

        The old context goes first (its KV cache could be gigabytes); the next reply prefills
        its prompt again."""
        import llama_cpp._internals as internals

        llm = self._llm
        params = llm.context_params
        params.cb_eval, params.abort_callback = self._stream_callbacks()
        # The prefill micro-batch the new budget's expert cache holds (see budget.py).
        self.n_ubatch = min(self.n_batch, self._memory_plan(self.model_map()).ubatch, self.ubatch_cap or self.n_batch)
        params.n_ubatch = self.n_ubatch
        params.n_rs_seq = self.rollback_snapshots
        self._rollback_guard = None  # it wraps the context closed here
        llm._ctx.close()
        try:
            llm._ctx = internals.LlamaContext(model=llm._model, params=params, verbose=False)
        except Exception as exc:
            # The old context is gone: nothing may compute until a new one is made. The next
            # reply tries again (memory may have been freed, the budget lowered meanwhile).
            self.pending.rebuild = self.pending.repin = True
            reason = (
                f"llama.cpp could not make a new context for streaming ({exc}): lower the budget or --n-ctx, "
                "or free memory; the next reply tries again"
            )
            self.lifecycle.fail(reason, recover=self._repin)
            raise EngineError(reason) from None
        self._guard_rollbacks()
        self.pending.rebuild = False  # only now: until a context is made, nothing computes
        llm._stack.callback(llm._ctx.close)
        self.decode_clock.attach(llm._ctx)  # its abort callback is the streaming one, which asks the flag
        llm.reset()

    def _repin(self) -> None:
        if self.pending.rebuild:
            self._rebuild_context()
        self.pending.repin = False
        if self.streamer is not None:
            self.save_heatmap()  # what routing taught so far seeds the new pinned set
            streamer, self.streamer = self.streamer, None
            streamer.close()  # reads finishing now still count
            self.streamed_before += streamer.bytes_read
        self.pinned.release(self.mappings)
        self._pin()  # the reply calling this holds the turn already

    def close(self) -> None:
        self.abort_load()
        with self.turns.turn():
            if self.streamer is not None:
                self.streamer.close()
                self.streamer = None
            self.pinned.release(self.mappings)
            if self.space is not None and self.space.bounded:
                self.space.pointers = None  # the weights it points go with the model, just below
            if self._llm is not None:
                self._llm.close()
                self._llm = None
            if self._draft_model is not None:
                self._draft_model.close()
                self._draft_model = None
            self._rollback_guard = None
            self.slots.forget()
            if self.space is not None and self.space.bounded:
                self.space.close()
            self.space = self.pointers = None
            for m in self.mappings.values():
                if m.fd >= 0:
                    os.close(m.fd)
            self.mappings = {}
            self.lifecycle.close()  # inside the turn: no reply can start on what was closed

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
        if self.chat_template in builtin_chat_templates():
            return BuiltinChatFormatter(self.chat_template), None
        template = self.chat_template or llm.metadata.get("tokenizer.chat_template") or FALLBACK_TEMPLATE
        eos, bos = llm.token_eos(), llm.token_bos()
        try:
            return chat_formatter()(
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

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        return self.llm.detokenize(list(tokens), special=special).decode("utf-8", errors="replace")

    @property
    def context_shift(self) -> bool:
        """Whether a reply that fills the context goes on (asked for, and the model's memory can
        shift: a recurrent or hybrid one, Kimi K3's KDA, cannot)."""
        return self.context_shift_asked and self.can_shift

    @property
    def can_shift(self) -> bool:
        """llama.cpp says a recurrent state shifts "trivially" (it has no positions), but a shift
        drops tokens from the middle of the context, which a recurrent state (Kimi K3's KDA)
        cannot give back: only an attention cache that can move its cells shifts here."""
        import llama_cpp

        if self._llm is None or self.recurrent:
            return False
        return bool(llama_cpp.llama_memory_can_shift(llama_cpp.llama_get_memory(self._llm._ctx.ctx)))

    @property
    def recurrent(self) -> bool:
        return is_recurrent(self.llm)

    def continuing(self, prompt: list[int]) -> list[int]:
        """A chat prompt that goes on from the context. The prompt re-renders the last reply as
        text, and text may tokenize otherwise than the tokens the reply was made of (" magic" +
        "alter" against " magical" + "ter"). An attention cache takes the few tokens back; a
        recurrent state cannot, and the whole conversation would be evaluated again (terabytes
        for K3 on the phone). There the context's own tokens are kept and only the text after
        them is tokenized: the same text, the state reused."""
        llm = self.llm
        if not self.recurrent or not llm.n_tokens:
            return prompt
        held = llm.input_ids[: llm.n_tokens].tolist()
        shared = common_prefix(held, prompt)
        if shared in (0, len(held)):
            return prompt
        said = llm.detokenize(held[shared:], special=True)
        asked = llm.detokenize(prompt[shared:], special=True)
        if len(asked) <= len(said) or not asked.startswith(said):
            return prompt
        spliced = held + llm.tokenize(asked[len(said):], add_bos=False, special=True)
        return spliced if len(spliced) < self.slot_ctx else prompt

    @functools.cached_property
    def end_of_generation(self) -> tuple[int, ...]:
        """The vocabulary's end-of-generation tokens (end of text, end of turn, ...): what
        ``ignore_eos`` bans. The model's path is the engine's for good, so once is enough."""
        import llama_cpp

        vocab = self.llm._model.vocab
        return tuple(t for t in range(self.llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t))

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

        with stderr_caught() as caught:
            sampler = llama_cpp.llama_sampler_init_grammar(self.llm._model.vocab, grammar.encode("utf-8"), b"root")
        if sampler:
            llama_cpp.llama_sampler_free(sampler)
            return None
        said = [line.strip() for line in caught.text.splitlines() if line.strip()]
        first = next((line for line in said if "error" in line), said[0] if said else "")
        return first.split("error parsing grammar: ", 1)[-1] or "it does not parse"

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None):
        """``messages`` (and the tools a reply may call) through the model's chat template
        (llama-cpp-python's formatter response: prompt, stop, added_special).

        A final assistant message with text (and no tool calls) is continued, not answered:
        the messages before it are rendered up to the reply's turn and its text follows, so the
        reply goes on from it (llama-server's assistant prefill, vLLM's continue_final_message)."""
        if self._formatter is None:
            raise ChatTemplateError(self.template_error or "the model is not loaded yet")
        import copy

        final = messages[-1] if messages else {}
        prefill = final.get("role") == "assistant" and bool(final.get("content")) and not final.get("tool_calls")
        try:
            # Copies: the template's sandbox lets lists grow (see chat_formatter), and the
            # caller's messages (the app's history) must come back as they went in.
            rendered = self._formatter(messages=copy.deepcopy(messages[:-1] if prefill else messages), tools=copy.deepcopy(tools))
        except Exception as exc:  # jinja2's errors, and the template's raise_exception (ValueError)
            raise ChatTemplateError(f"the chat template of {self.model_path.name} refused the messages: {exc}") from None
        if prefill:
            rendered.prompt += final["content"]
        return rendered

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

    def fit_chat(self, messages: list[dict], max_tokens: int) -> tuple[list[int], tuple[str, ...], int]:
        """Drop the oldest turns (never the system prompt or the last message) until it fits.
        Returns the prompt's tokens, its stop strings and how many messages were dropped."""
        msgs = list(messages)
        while True:
            tokens, stops = self.chat_prompt(msgs)
            room = self.slot_ctx - len(tokens)
            if room >= min(max_tokens, 16):
                return tokens, stops, len(messages) - len(msgs)
            first = 1 if msgs and msgs[0].get("role") == "system" else 0
            if len(msgs) - first <= 1:
                raise EngineError(f"the prompt is {len(tokens)} tokens; {self.context_words}")
            del msgs[first]

    # -- generation ----------------------------------------------------------------------

    @property
    def slot_ctx(self) -> int:
        """The tokens one reply may fill, prompt included: the context, or a slot's share of it."""
        return self.n_ctx // self.slots.count

    @property
    def context_words(self) -> str:
        if self.slots.count == 1:
            return f"the context holds {self.n_ctx}"
        return f"a slot holds {self.slot_ctx} (the context of {self.n_ctx} is split into {self.slots.count} slots)"

    def chat(self, messages: list[dict], sampling: Sampling, keep: str | None = None) -> "Generation":
        """A reply to ``messages``; with ``keep``, the conversation's state is restored from disk
        where that saves evaluating its tokens, and saved at the reply's end (saved_states.py)."""
        generation = Generation(self, lambda: ([], ()), sampling, keep=keep, chat=True)

        def build() -> tuple[list[int], tuple[str, ...]]:
            tokens, stops, dropped = self.fit_chat(messages, sampling.max_tokens)
            if dropped:
                generation.result.notices.append(
                    f"{dropped} earlier message{'s' if dropped != 1 else ''} left the model's context ({self.context_words} tokens); "
                    "the history keeps them",
                )
            return tokens, stops

        generation.build = build
        return generation

    # -- conversation states on disk (saved_states.py) ------------------------------------

    def saved_states(self) -> SavedStates | None:
        """The store of states this model and context can take, once loaded; None where none are kept."""
        if not self.state_quota or self._llm is None:
            return None
        if self._states is None or self._states.n_ctx != self.slot_ctx:
            self._states = SavedStates(self.states_dir, self.state_quota, self.state_identity, self.slot_ctx, self.model_path.name,
                                       self.kv_cache.name)
        return self._states

    @functools.cached_property
    def state_identity(self) -> str:
        """What a saved state belongs to (saved_states.model_identity): read once, as the files
        cannot change under a loaded model without the engine noticing (check_files)."""
        return model_identity(list(self.info.files or (self.model_path,)))

    def resumes(self, key: str) -> bool:
        """Whether the conversation ``key`` has a saved state this model can restore."""
        states = self.saved_states()
        return states is not None and states.resumes(key)

    def forget_state(self, key: str) -> None:
        """The conversation ``key`` is gone: its saved state goes too."""
        if self.states_dir is not None:
            SavedStates(self.states_dir, 0, "", 0, "").discard(key)

    def resume(self, key: str, prompt: list[int]) -> str | None:
        """In the reply's turn, before its prompt is evaluated: put ``key``'s saved state in the
        context when it shares more of ``prompt`` than the context holds now. Returns the line
        to show when the saved state was refused (it is removed; the tokens are evaluated)."""
        try:
            states = self.saved_states()
        except OSError as exc:  # a model file gone since the load: its identity cannot be read
            return f"saved states unavailable: {exc.strerror or exc}"
        if states is None:
            return None
        llm = self._llm
        here = common_prefix(llm.input_ids[: llm.n_tokens].tolist(), prompt)
        try:
            tokens = states.tokens(key)
            if tokens is None or common_prefix(tokens, prompt) <= here:
                return None
            saved = states.load(key)
        except StateRefused as exc:
            if exc.damaged:
                states.discard(key)
            return f"saved state refused: {exc}; the conversation is evaluated again"
        except (OSError, MemoryError) as exc:
            return f"saved state unreadable: {states.path(key)}: {exc}; the conversation is evaluated again"
        if saved is None:
            return None
        if not restore_sequence(llm, saved.tokens, saved.state):
            states.discard(key)
            return f"saved state refused: {states.path(key)}: llama.cpp could not restore it; the conversation is evaluated again"
        return None

    def keep_state(self, key: str) -> str | None:
        """In the reply's turn, at its end: save the context's state as ``key``'s. Returns the
        line to show when it could not be written (a full disk: the older file stays)."""
        try:
            states = self.saved_states()
            llm = self._llm
            if states is None or not llm.n_tokens:
                return None
            state = sequence_state(llm)
            if not state:
                return None
            states.save(key, llm.input_ids[: llm.n_tokens].tolist(), state)
        except (OSError, MemoryError) as exc:  # a full disk, no memory for the copy: the older file stays
            where = self.states_dir if self.states_dir is not None else "the states directory"
            return f"could not save the conversation's state in {where}: {getattr(exc, 'strerror', None) or exc}"
        return None

    def slot_file(self, action: str, slot_id: int, directory: Path, name: str = "") -> tuple[int, int]:
        """llama-server's slot actions, in the engine's turn: "save" ``slot_id``'s cached prompt
        as ``directory``/``name``, "restore" it from there (checked as a saved conversation is:
        model, context and its cache, checksum), or "erase" it. Returns (tokens, bytes written
        or read; 0 for erase). EngineError or StateRefused say why not, in one line."""
        with self.turns.turn() as served:
            if not served:
                raise EngineError("the engine is closing")
            self.lifecycle.begin_reply()
            try:
                if action == "erase":
                    return self.slots.erase(self.llm, slot_id), 0
                store = SavedStates(directory, None, self.state_identity, self.slot_ctx, self.model_path.name, self.kv_cache.name)
                if action == "save":
                    return self.slots.save(self.llm, slot_id, store, name)
                return self.slots.restore(self.llm, slot_id, store, name)
            finally:
                self.lifecycle.end_reply()

    def complete(self, prompt: str | list[int], sampling: Sampling, slot: int | None = None, progress: bool = False) -> "Generation":
        """A reply to ``prompt``, in ``slot`` (None: the slot whose cached prompt fits it best);
        with ``progress``, PromptProgress events come before its tokens."""
        def build():
            tokens = list(prompt) if isinstance(prompt, list) else self.tokenize(prompt)
            if not tokens:
                raise EngineError("the prompt is empty")
            if len(tokens) >= self.slot_ctx:
                raise EngineError(f"the prompt is {len(tokens)} tokens; {self.context_words}")
            return tokens, ()

        return Generation(self, build, sampling, slot=slot, progress=progress)


def engine_from_settings(settings, model_path: Path, budget: int | None = None) -> Engine:
    """The engine as configured (model, budget, streaming keys): one recipe for app and server.
    ``budget``: engine.budget already worked out (``cli.check_budget``), else worked out here."""
    from kimitui.config import data_dir
    from kimitui.engine.memory import resolve_budget

    return Engine(
        model_path,
        n_ctx=settings["model.n_ctx"],
        n_ctx_fixed=settings.origin("model.n_ctx") != "default",
        n_threads=settings["model.n_threads"],
        n_batch=settings["model.n_batch"],
        metrics=EngineMetrics(latency_window=settings["metrics.latency_window"]),
        budget=resolve_budget(settings["engine.budget"]) if budget is None else budget,
        shard_size=settings["engine.shard_size"],
        chat_template=chat_template_file(settings["model.chat_template_file"]) or settings["model.chat_template"] or None,
        n_slots=settings["server.slots"],
        context_shift=settings["model.context_shift"],
        stream_settings=StreamSettings(
            prefetch_depth=settings["engine.prefetch_depth"],
            policy=settings["engine.policy"],
            io_threads=settings["engine.io_threads"],
            expert_policy=settings["engine.expert_policy"],
            expert_lookahead=settings["engine.expert_lookahead"],
            expert_trim_below=settings["engine.expert_trim_below"],
            expert_trim_cumulative=settings["engine.expert_trim_cumulative"],
        ),
        address_space=settings["engine.address_space"],
        speculate=settings["engine.speculate"],
        draft_max=settings["engine.draft_max"],
        draft_model=settings["engine.draft_model"],
        states_dir=data_dir() / "states",
        state_quota=state_quota(settings["history.state_quota"], data_dir()),
    )


def state_quota(setting: int | str, directory: Path) -> int:
    """history.state_quota: bytes, or "auto": a tenth of the disk that holds ``directory``."""
    if setting != "auto":
        return int(setting)
    import shutil

    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).total // 10
    except OSError:
        return 0
