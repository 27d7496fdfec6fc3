"""A reply: sampling settings, its token events and result, and the Generation that runs it
in the engine's turn (prefill, the token loop, stops, logprobs, timings, the trace).

A Generation sees the engine only as a ReplyHost: what a reply needs of it, nothing more.
Live tuning reaches the loop through one call between tokens (``ReplyHost.between_tokens``)."""

from __future__ import annotations

import codecs
import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence

from kimitui.config import key_spec
from kimitui.engine.llama_glue import clear_context, keep_counted, llama_log
from kimitui.engine.slots import common_prefix
from kimitui.engine.state import EngineError

if TYPE_CHECKING:
    from kimitui.engine.llama_glue import DecodeClock
    from kimitui.engine.metrics import DraftCounts
    from kimitui.engine.speculation import Speculation
    from kimitui.engine.metrics import EngineMetrics
    from kimitui.engine.slots import Slots
    from kimitui.engine.streaming import Streamer
    from kimitui.engine.turns import TurnQueue


# The bias of a banned token. Finite: with a grammar that allows only banned tokens, -inf
# everywhere would leave llama.cpp's grammar sampler nothing to accept (it aborts the process).
BANNED = -1e30


@dataclass
class Sampling:
    temperature: float = key_spec("sampling.temperature").default
    top_p: float = key_spec("sampling.top_p").default
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    max_tokens: int = key_spec("sampling.max_tokens").default
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-inf bans it)
    grammar: str | None = None  # GBNF the reply must match (llama-cpp-python's LlamaGrammar)
    n_probs: int = 0  # with each token, the most likely n tokens and their log-probabilities
    post_sampling: bool = False  # n_probs from what the sampler chain left, not the raw logits
    cache_prompt: bool = True  # False: evaluate the whole prompt afresh (same numerics every time)
    special: bool = False  # special tokens in the reply's text (a tool-call section's markers)
    typical_p: float = 1.0  # locally typical sampling (1: off)
    mirostat: int = 0  # 0 off, 1 or 2: Mirostat v1 / v2 in place of top-k, top-p, min-p and temperature
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    ignore_eos: bool = False  # the end-of-generation tokens are banned (llama-server's logit bias on each)
    n_keep: int = 0  # a context shift keeps the context's first n_keep tokens (-1: the whole prompt)
    n_discard: int = 0  # and drops this many after them (0: half of the rest)

    def bias(self, end_of_generation: Sequence[int]) -> dict[int, float]:
        """The logit bias the reply is sampled with: the request's, and with ``ignore_eos`` each
        end-of-generation token banned."""
        return {**self.logit_bias, **dict.fromkeys(end_of_generation, BANNED)} if self.ignore_eos else self.logit_bias


@dataclass(frozen=True)
class TokenEvent:
    text: str  # may be "" while a stop string or a multi-byte character is held back
    token_id: int  # -1 for the final flush of held-back text
    index: int
    wall_s: float  # since the previous token (the first: since the request began, prefill included)
    # With Sampling.n_probs: the token's own log-probability and the top n (id, log-probability),
    # from the logits it was sampled from (logit bias applied, before temperature and the rest);
    # with Sampling.post_sampling, from the candidates the whole sampler chain left.
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptProgress:
    """How far the prompt's evaluation is (llama-server's prompt_progress), for a Generation
    made with ``progress``: before the first micro-batch, then after each."""

    total: int  # the prompt's tokens
    cache: int  # of them, kept from the context's last contents
    processed: int  # evaluated so far, the kept ones included
    time_ms: float  # since the reply began computing


class LogitsHook:
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


class SampledFrom:
    """What each token was drawn from after the whole sampler chain (llama-server's
    post_sampling_probs): the candidates top-k, top-p, min-p and the rest left, with the
    probabilities the chain's last sampler normalised. It is appended to the chain
    llama-cpp-python builds in generate(), after that sampler, so it reads and changes nothing."""

    def __init__(self, n_probs: int, greedy: bool) -> None:
        self.n_probs = n_probs
        self.greedy = greedy  # the greedy sampler computes no probabilities: the pick is certain
        self.selected: tuple[int, float] | None = None
        self.top: tuple[tuple[int, float], ...] = ()

    def __call__(self, cur_p) -> None:
        import ctypes

        import llama_cpp
        import numpy as np

        array = cur_p.contents
        size = int(array.size)
        if size == 0 or array.selected < 0:
            self.selected, self.top = None, ()
            return
        if self.greedy:
            self.selected = (int(array.data[array.selected].id), 1.0)
            self.top = (self.selected,)
            return
        raw = (ctypes.c_char * (size * ctypes.sizeof(llama_cpp.llama_token_data))).from_address(ctypes.addressof(array.data.contents))
        data = np.frombuffer(raw, dtype=np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True))
        self.selected = (int(data["id"][array.selected]), float(data["p"][array.selected]))
        best = np.argsort(-data["p"], kind="stable")[: self.n_probs]
        self.top = tuple((int(data["id"][i]), float(data["p"][i])) for i in best if data["p"][i] > 0.0)

    def install(self, llm) -> None:
        build = type(llm)._init_sampler

        def with_recorder(*args, **kwargs):
            sampler = build(llm, *args, **kwargs)
            sampler.add_custom(self)
            return sampler

        llm._init_sampler = with_recorder

    @staticmethod
    def uninstall(llm) -> None:
        llm.__dict__.pop("_init_sampler", None)

    def of(self, token: int) -> tuple[float | None, tuple[tuple[int, float], ...]]:
        """The token's log-probability and the top n (id, log-probability), as LogitsHook.of."""
        import math

        if self.selected is None or self.selected[0] != token:
            return None, ()
        return math.log(self.selected[1]), tuple((i, math.log(p)) for i, p in self.top)


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
    slot: int = 0  # the slot it ran in (Engine.slots)
    context_full: bool = False  # the context (the slot) filled: it ended at "length", or shifted (llama-server's truncated)
    shifted: int = 0  # tokens the context shifts dropped from the context while it ran
    error: str | None = None
    timings: list[float] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)  # what the user should know of it (a saved state refused, ...)
    speculation: DraftCounts | None = None  # decode passes, drafts and acceptances, where it speculated


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


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that could start a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold


def stop_at(text: str, emitted: int, stops: Sequence[str]) -> int:
    """Where the first stop string in ``text`` begins (-1: none); only what could end past
    ``emitted`` is searched, as the text before was searched already."""
    cut = -1
    for stop in stops:
        at = text.find(stop, max(0, emitted - len(stop)))
        if at != -1 and (cut == -1 or at < cut):
            cut = at
    return cut


class ReplyHost(Protocol):
    """What a reply asks of the engine that runs it (session.Engine is one): its turn, the
    context it evaluates in, the conversation's saved state, and live tuning between tokens."""

    turns: TurnQueue
    slots: Slots
    metrics: EngineMetrics
    decode_clock: DecodeClock
    tracer: Tracer | None
    streamer: Streamer | None  # replaced when live tuning re-reads the pinned set
    model_path: Path

    @property
    def llm(self): ...
    @property
    def slot_ctx(self) -> int: ...
    @property
    def context_shift(self) -> bool: ...
    @property
    def can_shift(self) -> bool: ...
    @property
    def end_of_generation(self) -> tuple[int, ...]: ...

    def open_reply(self, generation: Generation) -> None:
        """The turn is the reply's: a failed engine mended first (EngineError: refused), and
        ``generation``'s cancel reaches llama.cpp from here on."""
    def close_reply(self, generation: Generation) -> None: ...
    def cancel_reply(self, generation: Generation) -> None: ...
    def between_tokens(self, *, mid_reply: bool) -> bool:
        """Carry out what live tuning left for a token boundary; whether anything was done."""
    def check_files(self) -> None: ...
    def grammar_error(self, grammar: str) -> str | None: ...
    def resume(self, key: str, prompt: list[int]) -> str | None: ...
    def keep_state(self, key: str) -> str | None: ...
    def continuing(self, prompt: list[int]) -> list[int]: ...
    def trace_settings(self) -> dict: ...
    def save_heatmap(self) -> None: ...
    def speculation(self) -> Speculation | None:
        """This reply's drafts (speculation.py), or None: off, or of no use here."""


@dataclass
class _Decoded:
    """What a reply's token loop has made so far: what its end (stop, failure, cancel) settles."""

    started: float  # when the reply began computing
    last: float  # when the last token came
    before: dict | None  # the streamer's counters at the last token, for the trace
    text: str = ""
    emitted: int = 0  # of ``text``, already yielded
    cut: int = -1  # where a stop string began in ``text``
    finish: str = "length"


class Generation:
    """One request's token stream. Iterate for TokenEvents; read ``result`` afterwards.

    ``cancel()`` is safe from any thread and takes effect before the next token (or, while
    queued, gives the turn up at once).
    """

    def __init__(
        self, host: ReplyHost, build: Callable[[], tuple[list[int], tuple[str, ...]]], sampling: Sampling, slot: int | None = None,
        progress: bool = False, keep: str | None = None, chat: bool = False,
    ):
        self.host = host
        self.chat = chat  # a chat turn: its prompt re-renders the context's last reply (ReplyHost.continuing)
        self.keep = keep  # the conversation whose state is restored and saved (ReplyHost.resume, keep_state)
        self._holds_keep = False  # the context holds ``keep``'s tokens (its prompt was chosen for it)
        self.sampling = sampling
        self.slot_asked = slot
        self.progress = progress  # also yield PromptProgress while the prompt is evaluated
        self.result = GenerationResult()
        self.id = f"req-{next(_request_ids)}"
        self.build = build  # () -> (prompt tokens, stop strings), in the reply's turn
        self._cancel = threading.Event()
        self.ticket: int | None = None

    def cancel(self) -> None:
        self._cancel.set()
        self.host.cancel_reply(self)  # within a graph node, when it is computing

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def queue_position(self) -> int | None:
        return None if self.ticket is None else self.host.turns.position(self.ticket)

    def __iter__(self) -> Iterator[TokenEvent | PromptProgress]:
        host = self.host
        queued_at = time.perf_counter()
        self.ticket = host.turns.take()
        if not host.turns.wait(self.ticket, self._cancel):
            self.result.finish_reason = "cancelled"
            return
        try:
            self.result.queued_s = time.perf_counter() - queued_at
            try:
                host.open_reply(self)
            except EngineError as exc:
                self.result.finish_reason, self.result.error = "error", str(exc)
                raise
            try:
                if self._cancel.is_set():  # cancelled while it waited for its turn: nothing to evaluate
                    self.result.finish_reason = "cancelled"
                    return
                try:
                    host.between_tokens(mid_reply=False)
                except EngineError as exc:
                    self.result.finish_reason, self.result.error = "error", str(exc)
                    raise
                yield from self._run()
            finally:
                try:
                    if self._holds_keep and self.result.finish_reason != "error":
                        notice = host.keep_state(self.keep)
                        if notice:
                            self.result.notices.append(notice)
                finally:
                    host.close_reply(self)
        finally:
            host.turns.release(self.ticket)

    @staticmethod
    def _prefill_in_batches(llm, prompt: list[int], started: float, cancel: threading.Event) -> Iterator[PromptProgress]:
        """The prompt evaluated n_batch tokens at a time, as llama-cpp-python's generate() would
        (the same prefix kept, the same batches), with a PromptProgress before the first batch and
        after each; generate() then finds the whole prompt evaluated and samples from its logits,
        so the tokens are those of a reply without progress. Returns False when cancelled."""
        total = len(prompt)
        kept = common_prefix(llm.input_ids[: llm.n_tokens].tolist(), prompt)
        if not (kept == total == llm.n_tokens and not llm._requires_eval):
            kept = kept - 1 if kept == total else kept  # generate() re-evaluates at least one token
            if kept > 0 and llm._ctx.kv_cache_seq_rm(-1, kept, -1):
                llm.n_tokens = kept
            else:
                llm.reset()
                kept = 0

        def progress() -> PromptProgress:
            return PromptProgress(total, kept, llm.n_tokens, (time.perf_counter() - started) * 1000.0)

        yield progress()
        for start in range(kept, total, llm.n_batch):
            if cancel.is_set():
                return False
            llm.eval(prompt[start : start + llm.n_batch])
            yield progress()
        return True

    def _sampled(self, llm, prompt: list[int], shift: bool, **sampler) -> Iterator[int]:
        """llama-cpp-python's generate(), and with ``shift`` a context shift whenever the context
        is full, as llama-server does it: the sequence's cells after the first n_keep lose
        n_discard of them (half of the rest unless asked) and the later ones move back. The
        reply then goes on in a fresh generate() over the shifted context with the very same
        sampler chain (its grammar state, penalties and random state kept)."""
        import llama_cpp

        speculation = None if shift else self.host.speculation()
        if speculation is not None:
            self.result.speculation = speculation.stats
            yield from self._speculated(llm, prompt, speculation, sampler)
            return
        tokens = llm.generate(prompt, **sampler)
        token = next(tokens, None)
        while token is not None:
            yield token
            if not shift or llm.n_tokens + 1 < self.host.slot_ctx:
                token = next(tokens, None)
                continue
            tokens.close()
            s, n_past = self.sampling, llm.n_tokens
            n_keep = (len(prompt) if s.n_keep < 0 else s.n_keep) + int(llama_cpp.llama_vocab_get_add_bos(llm._model.vocab))
            n_keep = min(n_keep, self.host.slot_ctx - 4)
            n_discard = min(s.n_discard or (n_past - n_keep) // 2, n_past - n_keep - 1)
            llm._ctx.kv_cache_seq_rm(0, n_keep, n_keep + n_discard)
            llm._ctx.kv_cache_seq_shift(0, n_keep + n_discard, n_past, -n_discard)
            llm.input_ids[n_keep : n_past - n_discard] = llm.input_ids[n_keep + n_discard : n_past]
            llm.n_tokens = n_past - n_discard
            self.result.shifted += n_discard
            chain, own = llm._sampler, llm.__dict__.get("_init_sampler")
            llm._init_sampler = lambda *_, **__: chain  # generate() builds a new chain first thing
            tokens = llm.generate(llm.input_ids[: llm.n_tokens].tolist() + [token], **sampler)
            try:
                token = next(tokens, None)
            finally:
                if own is None:
                    del llm._init_sampler
                else:
                    llm._init_sampler = own

    @staticmethod
    def _speculated(llm, prompt: list[int], speculation: Speculation, sampler: dict) -> Iterator[int]:
        """generate() with drafts: each pass evaluates the token sampled last and the drafts
        after it in one batch, every position with its logits (llama-cpp-python asks for them
        only with logits_all, which would also copy every prompt position's); the prompt's
        evaluation stays as it is. When the reply stops in the middle of a pass, the context
        keeps only what was verified, as plain decoding would have left it."""
        original_eval = llm.eval
        most = speculation.planner.max_drafts + 1
        guard = speculation.guard

        def eval_with_drafts(tokens):
            drafted = 1 < len(tokens) <= most
            if guard is not None:  # only a drafted pass's own tokens may be taken back
                guard.allow_after(llm.n_tokens if drafted else None)
            if not drafted:  # a plain pass, a prompt, or nothing at all (a prompt cached whole)
                return original_eval(tokens)
            n_past = llm.n_tokens
            llm._ctx.kv_cache_seq_rm(-1, n_past, -1)
            llm._batch.set_batch(batch=tokens, n_past=n_past, logits_all=True)
            llm._ctx.decode(llm._batch)
            llm.input_ids[n_past : n_past + len(tokens)] = tokens
            llm.n_tokens += len(tokens)
            llm._requires_eval = False

        yielded = 0
        llm.eval, llm.draft_model = eval_with_drafts, speculation
        try:
            for token in llm.generate(prompt, **sampler):
                yielded += 1
                speculation.token_yielded()
                yield token
        finally:
            del llm.eval
            llm.draft_model = None
            try:
                # Plain decoding leaves the prompt and every token but the last sampled one evaluated.
                verified = len(prompt) + yielded - 1
                if yielded and llm.n_tokens > verified:
                    llm.n_tokens = verified
                    llm._requires_eval = True  # the last logits are a later position's
                    if not llm._ctx.kv_cache_seq_rm(-1, verified, -1):
                        clear_context(llm)  # the drafts could not be taken back: the next reply starts afresh
            finally:
                if guard is not None:
                    guard.allow_after(None)
            speculation.finish()

    def _run(self) -> Iterator[TokenEvent | PromptProgress]:
        """The reply in its turn: its prompt placed, its sampler chain built, then its tokens."""
        host, s = self.host, self.sampling
        llm = host.llm
        started = time.perf_counter()
        host.metrics.request_started()
        prompt, stops = self._prepare(llm)
        shift = host.context_shift
        budget = max(0, s.max_tokens if shift else min(s.max_tokens, host.slot_ctx - len(prompt)))
        llm.set_seed(s.seed if s.seed is not None else 0xFFFFFFFF)
        tracer = host.tracer
        done = _Decoded(started=started, last=started, before=self._counters())
        log = llama_log()
        log.lines.clear()
        if tracer is not None:
            tracer.request_started(self.id, host.model_path.name, host.trace_settings())
        sampled_from: SampledFrom | None = None
        try:
            if budget == 0:
                return
            sampler, probs, sampled_from = self._sampler(llm)
            if not s.cache_prompt:
                llm.reset()  # the whole prompt in one evaluation, as on a fresh context
            tokens = self._sampled(llm, prompt, shift, **sampler)
            try:
                yield from self._decode(llm, tokens, prompt, stops, budget, probs, tracer, done)
            finally:
                tokens.close()  # its clean-up (speculation's) now, before the context is judged, not when collected
        except GeneratorExit:
            done.finish = "cancelled"
            raise
        except Exception as exc:  # llama_decode failures and the like: stop this reply only
            self._failed(llm, exc, log, done)
        finally:
            if sampled_from is not None:
                sampled_from.uninstall(llm)
            self._finished(prompt, tracer, done)

    def _counters(self) -> dict | None:
        streamer = self.host.streamer  # replaced when live tuning re-pins: asked each time
        return streamer.counters() if streamer is not None else None

    def _prepare(self, llm) -> tuple[list[int], tuple[str, ...]]:
        """The prompt's tokens, in the slot that fits them, the conversation's saved state put
        back where it saves evaluating them; and the stop strings."""
        host, result = self.host, self.result
        if host.streamer is not None and host.streamer.error is not None:
            host.streamer.reset_error()  # a failure after the last reply's last token: that reply is over
        try:
            if host.streamer is None:
                host.check_files()
            prompt, template_stops = self.build()
            stops = tuple(dict.fromkeys(tuple(self.sampling.stop) + template_stops))
            result.prompt_tokens = len(prompt)
            result.slot = host.slots.choose(llm, prompt, self.slot_asked)
            host.slots.activate(llm, result.slot)
            if self.keep is not None:
                notice = host.resume(self.keep, prompt)
                if notice:
                    result.notices.append(notice)
                self._holds_keep = True
            if self.chat:
                prompt = host.continuing(prompt)
                result.prompt_tokens = len(prompt)
        except EngineError as exc:
            result.finish_reason, result.error = "error", str(exc)
            host.metrics.request_finished()
            raise
        return prompt, stops

    def _sampler(self, llm) -> tuple[dict, LogitsHook | SampledFrom | None, SampledFrom | None]:
        """generate()'s sampler arguments; what the tokens' log-probabilities come from (None:
        none asked for); and the SampledFrom installed in ``llm``, which the caller uninstalls."""
        from llama_cpp import LlamaGrammar, LogitsProcessorList

        s = self.sampling
        grammar = None
        if s.grammar is not None:
            error = self.host.grammar_error(s.grammar)  # a refused grammar in the sampler chain would crash the process
            if error is not None:
                raise EngineError(f"grammar: llama.cpp refused it: {error}")
            grammar = LlamaGrammar.from_string(s.grammar, verbose=False)
        post = s.post_sampling and s.n_probs > 0
        raw_probs = 0 if post else s.n_probs  # log-probabilities of the logits, before the sampler chain
        bias = s.bias(self.host.end_of_generation) if s.ignore_eos else s.logit_bias
        logits = LogitsHook(bias, raw_probs) if bias or raw_probs else None
        sampled_from = None
        if post:
            sampled_from = SampledFrom(s.n_probs, greedy=s.temperature <= 0)
            sampled_from.install(llm)
        sampler = dict(
            top_k=s.top_k,
            top_p=s.top_p,
            min_p=s.min_p,
            typical_p=s.typical_p,
            temp=s.temperature,
            mirostat_mode=s.mirostat,
            mirostat_tau=s.mirostat_tau,
            mirostat_eta=s.mirostat_eta,
            repeat_penalty=s.repeat_penalty,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            logits_processor=LogitsProcessorList([logits]) if logits is not None else None,
            grammar=grammar,
        )
        return sampler, sampled_from if sampled_from is not None else logits, sampled_from

    def _decode(self, llm, tokens: Iterator[int], prompt: list[int], stops: tuple[str, ...], budget: int,
                probs: LogitsHook | SampledFrom | None, tracer: Tracer | None, done: _Decoded) -> Iterator[TokenEvent | PromptProgress]:
        """The token loop: each token timed, counted and traced, its text held back while it may
        begin a stop string; live tuning and cancellation between tokens."""
        import llama_cpp

        host, result, metrics, clock = self.host, self.result, self.host.metrics, self.host.decode_clock
        vocab = llm._model.vocab
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoded, decoded_tokens = clock.seconds, clock.tokens
        experts = host.streamer.experts if host.streamer is not None else None
        if experts is not None:
            experts.begin_prefill()
        if self.progress and not (yield from self._prefill_in_batches(llm, prompt, done.started, self._cancel)):
            done.finish = "cancelled"  # between two batches: the context holds what was evaluated
            return
        for index, token in enumerate(tokens):
            now = time.perf_counter()
            wall, done.last = now - done.last, now
            decode_s, decoded = clock.seconds - decoded, clock.seconds
            if index == 0:
                result.prompt_s = wall
                result.cached_tokens = max(0, len(prompt) - (clock.tokens - decoded_tokens))
                metrics.prompt_evaluated(len(prompt))
                if experts is not None:
                    experts.prefilling = False
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                done.finish = "stop"
                break
            result.completion_tokens += 1
            result.timings.append(wall)
            metrics.token(wall)
            if tracer is not None:
                after = self._counters()
                tracer.token(self.id, index, wall, done.before, after, decode_s)
                done.before = after
            done.text += decoder.decode(llm.detokenize([token], special=self.sampling.special))
            done.cut = stop_at(done.text, done.emitted, stops)
            logprob, top = probs.of(token) if probs is not None else (None, ())
            if done.cut != -1:
                done.text = done.text[: done.cut]
                yield TokenEvent(done.text[done.emitted :], token, index, wall, logprob, top)
                done.emitted = len(done.text)
                done.finish = "stop"
                break
            safe = len(done.text) - held_back(done.text, stops)
            yield TokenEvent(done.text[done.emitted : safe], token, index, wall, logprob, top)
            done.emitted = max(done.emitted, safe)
            # Budget or shard size changed mid-reply: from the next token on. Its wait for
            # the re-read pinned set is part of its time, where the panels show it.
            if host.between_tokens(mid_reply=True):
                done.before = self._counters()
            if self._cancel.is_set():
                done.finish = "cancelled"
                break
            if result.completion_tokens >= budget:
                done.finish = "length"
                break
        else:
            done.finish = "stop"
        if done.finish != "stop" or done.cut == -1:
            # What was held back as a possible stop string, or a dangling byte sequence, is real text.
            done.text += decoder.decode(b"", final=True)
            if len(done.text) > done.emitted:
                yield TokenEvent(done.text[done.emitted :], -1, result.completion_tokens, 0.0)
                done.emitted = len(done.text)

    def _failed(self, llm, exc: Exception, log, done: _Decoded) -> None:
        """A reply that raised: cancelled within a graph node (it ends, its prefix kept), or
        failed (EngineError with what failed: the read, or what llama.cpp said)."""
        # llama.cpp takes back only the micro-batch that failed; earlier ones of the same
        # evaluation stay in the cache (and in a recurrent state, for good) beyond what
        # llama-cpp-python counts.
        result, streamer = self.result, self.host.streamer
        if self._cancel.is_set() and (streamer is None or streamer.error is None):
            keep_counted(llm)  # the conversation's prefix stays cached for the next reply
            done.finish = "cancelled"  # llama.cpp stopped between two graph nodes when asked
            return
        clear_context(llm)  # after a failure the next reply starts afresh
        done.finish = "error"
        if streamer is not None and streamer.error is not None:
            result.error = streamer.error  # the read that failed, not llama.cpp's "aborted"
            streamer.reset_error()
        else:
            reason = log.reason()  # what llama.cpp said while this reply ran, if anything
            result.error = f"generation failed: {exc}" + (f" (llama.cpp: {reason})" if reason else "")
        raise EngineError(result.error) from None

    def _finished(self, prompt: list[int], tracer: Tracer | None, done: _Decoded) -> None:
        """The result settled, however the reply ended; the metrics and the trace told."""
        host, result = self.host, self.result
        result.text = done.text
        result.finish_reason = done.finish
        result.context_full = result.shifted > 0 or (done.finish == "length" and result.completion_tokens >= host.slot_ctx - len(prompt))
        if result.context_full and not result.shifted:
            result.notices.append(
                f"the context is full ({host.slot_ctx} tokens): the reply stops here"
                + ("" if host.can_shift else f"; {host.model_path.name}'s recurrent state cannot shift")
                + "; the next message drops the oldest turns to make room",
            )
        result.decode_s = max(0.0, done.last - done.started - result.prompt_s)
        host.metrics.request_finished()
        host.save_heatmap()
        if tracer is not None:
            tracer.request_finished(self.id, result)
