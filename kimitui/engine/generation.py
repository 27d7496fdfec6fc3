"""A reply: sampling settings, its token events and result, and the Generation that runs it
in the engine's turn (prefill, the token loop, stops, logprobs, timings, the trace)."""

from __future__ import annotations

import codecs
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence


from kimitui.engine.llama_glue import clear_context, keep_counted, llama_log
from kimitui.engine.slots import common_prefix
from kimitui.engine.state import EngineError

if TYPE_CHECKING:
    from kimitui.engine.session import Engine


# The bias of a banned token. Finite: with a grammar that allows only banned tokens, -inf
# everywhere would leave llama.cpp's grammar sampler nothing to accept (it aborts the process).
BANNED = -1e30


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


class Generation:
    """One request's token stream. Iterate for TokenEvents; read ``result`` afterwards.

    ``cancel()`` is safe from any thread and takes effect before the next token (or, while
    queued, gives the turn up at once).
    """

    def __init__(
        self, engine: Engine, build: Callable[[], tuple[list[int], tuple[str, ...]]], sampling: Sampling, slot: int | None = None,
        progress: bool = False, keep: str | None = None, chat: bool = False,
    ):
        self.engine = engine
        self.chat = chat  # a chat turn: its prompt re-renders the context's last reply (Engine.continuing)
        self.keep = keep  # the conversation whose state is restored and saved (Engine.resume, keep_state)
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
        self.engine.cancel_reply(self)  # within a graph node, when it is computing

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def queue_position(self) -> int | None:
        return None if self.ticket is None else self.engine.turns.position(self.ticket)

    def __iter__(self) -> Iterator[TokenEvent | PromptProgress]:
        engine = self.engine
        queued_at = time.perf_counter()
        self.ticket = engine.turns.take()
        if not engine.turns.wait(self.ticket, self._cancel):
            self.result.finish_reason = "cancelled"
            return
        try:
            self.result.queued_s = time.perf_counter() - queued_at
            try:
                engine.lifecycle.begin_reply()  # a failed engine is mended first, or the reply refused
            except EngineError as exc:
                self.result.finish_reason, self.result.error = "error", str(exc)
                raise
            engine.reply_started(self)
            try:
                if self._cancel.is_set():  # cancelled while it waited for its turn: nothing to evaluate
                    self.result.finish_reason = "cancelled"
                    return
                try:
                    engine.apply_pending_tuning(mid_reply=False)
                except EngineError as exc:
                    self.result.finish_reason, self.result.error = "error", str(exc)
                    raise
                yield from self._run()
            finally:
                try:
                    if self._holds_keep and self.result.finish_reason != "error":
                        notice = engine.keep_state(self.keep)
                        if notice:
                            self.result.notices.append(notice)
                finally:
                    engine.reply_ended(self)
                    engine.lifecycle.end_reply()
        finally:
            engine.turns.release(self.ticket)

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

        tokens = llm.generate(prompt, **sampler)
        token = next(tokens, None)
        while token is not None:
            yield token
            if not shift or llm.n_tokens + 1 < self.engine.slot_ctx:
                token = next(tokens, None)
                continue
            tokens.close()
            s, n_past = self.sampling, llm.n_tokens
            n_keep = (len(prompt) if s.n_keep < 0 else s.n_keep) + int(llama_cpp.llama_vocab_get_add_bos(llm._model.vocab))
            n_keep = min(n_keep, self.engine.slot_ctx - 4)
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

    def _run(self) -> Iterator[TokenEvent | PromptProgress]:
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
            prompt_tokens, template_stops = self.build()
        except EngineError as exc:
            result.finish_reason, result.error = "error", str(exc)
            metrics.request_finished()
            raise
        stops = tuple(dict.fromkeys(tuple(s.stop) + template_stops))
        result.prompt_tokens = len(prompt_tokens)
        try:
            result.slot = engine.slots.choose(llm, prompt_tokens, self.slot_asked)
            engine.slots.activate(llm, result.slot)
            if self.keep is not None:
                notice = engine.resume(self.keep, prompt_tokens)
                if notice:
                    result.notices.append(notice)
                self._holds_keep = True
            if self.chat:
                prompt_tokens = engine.continuing(prompt_tokens)
                result.prompt_tokens = len(prompt_tokens)
        except EngineError as exc:
            result.finish_reason, result.error = "error", str(exc)
            metrics.request_finished()
            raise
        shift = engine.context_shift
        budget = max(0, s.max_tokens if shift else min(s.max_tokens, engine.slot_ctx - len(prompt_tokens)))
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
        sampled_from: SampledFrom | None = None
        finish = "length"
        try:
            if budget == 0:
                return
            from llama_cpp import LlamaGrammar, LogitsProcessorList

            post = s.post_sampling and s.n_probs > 0
            raw_probs = 0 if post else s.n_probs  # log-probabilities of the logits, before the sampler chain
            bias = s.bias(engine.end_of_generation) if s.ignore_eos else s.logit_bias
            logits = LogitsHook(bias, raw_probs) if bias or raw_probs else None
            if post:
                sampled_from = SampledFrom(s.n_probs, greedy=s.temperature <= 0)
                sampled_from.install(llm)
            grammar = None
            if s.grammar is not None:
                error = engine.grammar_error(s.grammar)  # a refused grammar in the sampler chain would crash the process
                if error is not None:
                    raise EngineError(f"grammar: llama.cpp refused it: {error}")
                grammar = LlamaGrammar.from_string(s.grammar, verbose=False)
            if not s.cache_prompt:
                llm.reset()  # the whole prompt in one evaluation, as on a fresh context
            tokens = self._sampled(
                llm, prompt_tokens, shift,
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
            clock = engine.decode_clock
            decoded, decoded_tokens = clock.seconds, clock.tokens
            experts = engine.streamer.experts if engine.streamer is not None else None
            if experts is not None:
                experts.begin_prefill()
            if self.progress and not (yield from self._prefill_in_batches(llm, prompt_tokens, started, self._cancel)):
                finish = "cancelled"  # between two batches: the context holds what was evaluated
                return
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
                if sampled_from is not None:
                    logprob, top = sampled_from.of(token)
                else:
                    logprob, top = logits.of(token) if logits is not None else (None, ())
                if cut != -1:
                    text = text[:cut]
                    yield TokenEvent(text[emitted:], token, index, wall, logprob, top)
                    emitted = len(text)
                    finish = "stop"
                    break
                safe = len(text) - held_back(text, stops)
                yield TokenEvent(text[emitted:safe], token, index, wall, logprob, top)
                emitted = max(emitted, safe)
                # Budget or shard size changed mid-reply: from the next token on. Its wait for
                # the re-read pinned set is part of its time, where the panels show it.
                if engine.apply_pending_tuning(mid_reply=True):
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
            # llama.cpp takes back only the micro-batch that failed; earlier ones of the same
            # evaluation stay in the cache (and in a recurrent state, for good) beyond what
            # llama-cpp-python counts.
            streamer = engine.streamer
            if self._cancel.is_set() and (streamer is None or streamer.error is None):
                keep_counted(llm)  # the conversation's prefix stays cached for the next reply
                finish = "cancelled"  # llama.cpp stopped between two graph nodes when asked
                return
            clear_context(llm)  # after a failure the next reply starts afresh
            finish = "error"
            if streamer is not None and streamer.error is not None:
                result.error = streamer.error  # the read that failed, not llama.cpp's "aborted"
                streamer.reset_error()
            else:
                reason = log.reason()  # what llama.cpp said while this reply ran, if anything
                result.error = f"generation failed: {exc}" + (f" (llama.cpp: {reason})" if reason else "")
            raise EngineError(result.error) from None
        finally:
            if sampled_from is not None:
                sampled_from.uninstall(llm)
            result.text = text
            result.finish_reason = finish
            result.context_full = result.shifted > 0 or (finish == "length" and result.completion_tokens >= engine.slot_ctx - len(prompt_tokens))
            if result.context_full and not result.shifted:
                result.notices.append(
                    f"the context is full ({engine.slot_ctx} tokens): the reply stops here"
                    + ("" if engine.can_shift else f"; {engine.model_path.name}'s recurrent state cannot shift")
                    + "; the next message drops the oldest turns to make room",
                )
            result.decode_s = max(0.0, last - started - result.prompt_s)
            metrics.request_finished()
            engine.save_heatmap()
            if tracer is not None:
                tracer.request_finished(self.id, result)
