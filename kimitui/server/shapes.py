"""The pieces of a reply's body that several routes write: llama-server's timings and result
object, OpenAI's usage and finish reasons, log-probabilities in each API's shape,
response_fields, and the event stream every streamed reply is sent as."""

from __future__ import annotations

import json
import math
from typing import Any, AsyncIterator

from sse_starlette import EventSourceResponse

from kimitui import __version__
from kimitui.engine.generation import BANNED, Generation, GenerationResult, Sampling, TokenEvent
from kimitui.engine.interface import ServingEngine

FINGERPRINT = f"b{__version__}-kimitui"  # OpenAI's system_fingerprint; llama-server's start with "b"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def event_stream(events: AsyncIterator, headers: dict) -> EventSourceResponse:
    """A streamed reply: server-sent events with bare line feeds and no keep-alive pings."""
    return EventSourceResponse(events, headers=headers, sep="\n", ping=0)


def timings(r: GenerationResult) -> dict:
    """llama-server's timings block (prompt_n counts the prompt tokens evaluated, cache_n those
    reused from the last reply's context). A rate over zero time is null, not a made-up number."""

    def per_token(s: float, n: int) -> float | None:
        return s * 1000 / n if n else None

    def per_second(n: int, s: float) -> float | None:
        return n / s if s > 0 else None

    evaluated = r.prompt_tokens - r.cached_tokens
    return {
        "cache_n": r.cached_tokens,
        "prompt_n": evaluated,
        "prompt_ms": r.prompt_s * 1000,
        "prompt_per_token_ms": per_token(r.prompt_s, evaluated),
        "prompt_per_second": per_second(evaluated, r.prompt_s),
        "predicted_n": r.completion_tokens,
        "predicted_ms": r.decode_s * 1000,
        "predicted_per_token_ms": per_token(r.decode_s, r.completion_tokens),
        "predicted_per_second": per_second(r.completion_tokens, r.decode_s),
    }


def usage(results: list[GenerationResult], choices_per_prompt: int = 1) -> dict:
    """OpenAI's usage: each prompt counted once, however many choices it was given."""
    prompt = sum(r.prompt_tokens for r in results[::choices_per_prompt])
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)},
    }


def _piece(engine: ServingEngine, token: int) -> tuple[str, list[int]]:
    raw = engine.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def native_probs(engine: ServingEngine, events: list[TokenEvent], post_sampling: bool = False) -> list[dict]:
    """llama-server's completion_probabilities: each token, its log-probability and the top n;
    with post_sampling_probs, as llama-server gives them then: probabilities, under "prob"."""
    value, name, top_name = (math.exp, "prob", "top_probs") if post_sampling else (float, "logprob", "top_logprobs")
    out = []
    for e in events:
        if e.token_id < 0 or e.logprob is None:
            continue
        text, raw = _piece(engine, e.token_id)
        top = []
        for tid, lp in e.top:
            t_text, t_raw = _piece(engine, tid)
            top.append({"id": tid, "token": t_text, "bytes": t_raw, name: value(lp)})
        out.append({"id": e.token_id, "token": text, "bytes": raw, name: value(e.logprob), top_name: top})
    return out


def chat_logprobs(engine: ServingEngine, events: list[TokenEvent], n_top: int) -> dict:
    content = []
    for entry in native_probs(engine, events):
        top = [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]} for t in entry["top_logprobs"][:n_top]]
        content.append({"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"], "top_logprobs": top})
    return {"content": content, "refusal": None}


def text_logprobs(engine: ServingEngine, events: list[TokenEvent], n_top: int) -> dict:
    """OpenAI completions' logprobs: parallel lists, the alternatives as {token: logprob}."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for entry in native_probs(engine, events):
        offsets.append(offset)
        offset += len(entry["token"])
        tokens.append(entry["token"])
        lps.append(entry["logprob"])
        tops.append({t["token"]: t["logprob"] for t in entry["top_logprobs"][:n_top]})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def only_fields(body: dict, paths: list[str]) -> dict:
    """llama-server's response_fields: just these keys, a "/" path reaching into objects
    (named by the whole path, as llama-server names them)."""
    out = {}
    for path in paths:
        node: Any = body
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[path] = node
    return out


def openai_finish(r: GenerationResult) -> str:
    return "length" if r.finish_reason == "length" else "stop"


def stop_type(engine: ServingEngine, result: GenerationResult, stops: tuple[str, ...], ids: list[int]) -> tuple[str, str]:
    """llama-server's stop_type and stopping_word. The engine cuts a stop string out of the
    text, so the raw tokens tell a stop word from an end-of-generation token."""
    if result.finish_reason == "length":
        return "limit", ""
    if result.finish_reason != "stop":
        return "none", ""
    raw = engine.detokenize(ids) if stops else ""
    found = [(raw.find(s), s) for s in stops if s in raw]
    return ("word", min(found)[1]) if found else ("eos", "")


def native_result(
    engine: ServingEngine, model_id: str, index: int, prompt: list[int], generation: Generation, events: list[TokenEvent],
    content: str, *, return_tokens: bool = True,
) -> dict:
    """llama-server's own result object: /completion's reply, and the ``__verbose`` of an
    OpenAI reply. Its prompt is the prompt's tokens as text, special tokens included."""
    r, sampling = generation.result, generation.sampling
    ids = [e.token_id for e in events if e.token_id >= 0]
    stop, word = stop_type(engine, r, sampling.stop, ids)
    return {
        "index": index,
        "content": content,
        "tokens": ids if return_tokens else [],
        "id_slot": r.slot,
        "stop": True,
        "model": model_id,
        "tokens_predicted": r.completion_tokens,
        "tokens_evaluated": r.prompt_tokens,
        "tokens_cached": r.cached_tokens,
        "generation_settings": generation_settings(engine, sampling),
        "prompt": engine.detokenize(prompt, special=True),
        "has_new_line": "\n" in r.text,
        # llama-server's meaning: the reply was cut because the context filled (a prompt
        # that does not fit is refused, never cut).
        "truncated": r.context_full,
        "stop_type": stop,
        "stopping_word": word,
        "timings": timings(r),
    }


def generation_settings(engine: ServingEngine, s: Sampling) -> dict:
    """llama-server's generation_settings: a reply's sampling, or /props' defaults."""
    return {
        "n_predict": s.max_tokens,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "typical_p": s.typical_p,
        "repeat_last_n": 64,
        "repeat_penalty": s.repeat_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "mirostat": s.mirostat,
        "mirostat_tau": s.mirostat_tau,
        "mirostat_eta": s.mirostat_eta,
        "n_keep": s.n_keep,
        "n_discard": s.n_discard,
        "ignore_eos": s.ignore_eos,
        "seed": -1 if s.seed is None else s.seed,
        "stop": list(s.stop),
        # As llama-server shows it, ignore_eos's bans included; a ban is null (JSON has no -inf).
        "logit_bias": [
            {"token": t, "bias": None if b <= BANNED else b}
            for t, b in s.bias(engine.end_of_generation if s.ignore_eos else ()).items()
        ],
    }


def stream_error(exc: Exception) -> str:
    """The last event of a stream whose reply failed after its headers were sent."""
    return dumps({"error": {"code": 500, "type": "server_error", "message": str(exc)}})
