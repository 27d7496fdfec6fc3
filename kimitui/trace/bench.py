"""`kimitui trace bench`: what tracing costs, on a streamed model.

One engine, the same greedy request over and over, rounds alternating tracing off and on
(off-on, then on-off, so drift in machine load falls on both sides alike). The headline is
the median over rounds of (decode time per token traced / untraced) - 1. The writer's own cost
per record, timed in isolation, gives a second estimate that machine noise cannot hide.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kimitui.errors import UserError
from kimitui.units import format_bytes, parse_size

PROMPT = "Once upon a time"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="GGUF to stream (default: a synthetic dense model of --size)")
    parser.add_argument("--size", default="512MiB", help="size of the synthetic model (default 512MiB)")
    parser.add_argument("--budget", help="memory budget, below the model's size so it streams (default: 90%% of its tensors)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of one untraced and one traced request (default 8)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def decode_per_token(engine, tokens: int) -> float:
    from kimitui.engine.session import Sampling

    gen = engine.complete(PROMPT, Sampling(temperature=0.0, max_tokens=tokens))
    list(gen)
    n = gen.result.completion_tokens
    if n < 2:
        raise UserError(f"the model stopped after {n} token(s): nothing to time")
    return gen.result.decode_s / (n - 1)


def measure(engine, rounds: int, tokens: int, trace_dir: Path) -> dict:
    """Alternate untraced and traced requests on a loaded, streaming ``engine``."""
    from kimitui.trace.writer import TraceWriter

    decode_per_token(engine, tokens)  # warm-up: page cache, llama.cpp's buffers
    off: list[float] = []
    on: list[float] = []
    reads = written = traced_tokens = 0
    for n in range(rounds):
        for traced in ((False, True) if n % 2 == 0 else (True, False)):
            if not traced:
                off.append(decode_per_token(engine, tokens))
                continue
            path = trace_dir / f"round-{n}.jsonl"
            writer = TraceWriter(path)
            counted: list[dict] = []
            writer.subscribe(counted.append)
            writer.attach(engine)
            try:
                on.append(decode_per_token(engine, tokens))
            finally:
                writer.close()
            written += path.stat().st_size
            reads += sum(1 for r in counted if r["type"] == "read")
            traced_tokens += sum(1 for r in counted if r["type"] == "token")
    ratios = [b / a - 1 for a, b in zip(off, on)]
    return {
        "rounds": rounds,
        "tokens_per_request": tokens,
        "off_ms_per_token": [round(x * 1000, 3) for x in off],
        "on_ms_per_token": [round(x * 1000, 3) for x in on],
        "median_off_ms": round(statistics.median(off) * 1000, 3),
        "median_on_ms": round(statistics.median(on) * 1000, 3),
        "overhead_pct": round(statistics.median(ratios) * 100, 2),
        "reads_per_token": round(reads / traced_tokens, 1),
        "trace_bytes_per_token": round(written / traced_tokens),
    }


def writer_cost(trace_dir: Path, n: int = 20000) -> dict:
    """Microseconds the writer spends per token record and per read record (file writes
    included), measured alone: its share of a token is cost x records / token time."""
    from kimitui.engine.session import GenerationResult
    from kimitui.model.gguf_map import Shard
    from kimitui.trace.writer import COUNTERS, TraceWriter

    writer = TraceWriter(trace_dir / "cost.jsonl")
    shard = Shard(index=7, file=0, offset=0, length=4 << 20, tensor_bytes=4 << 20, layer=3, routed=False, tensors=())
    counters = {k: 0 for k in COUNTERS}
    writer.request_started("req-cost", "cost", {})
    started = time.perf_counter()
    for i in range(n):
        writer.read(shard, i << 22, 4 << 20, started, 0.001)
    per_read = (time.perf_counter() - started) / n
    started = time.perf_counter()
    for i in range(n):
        writer.token("req-cost", i, 0.05, counters, counters)
    per_token = (time.perf_counter() - started) / n
    writer.request_finished("req-cost", GenerationResult())
    writer.close()
    return {"read_record_us": round(per_read * 1e6, 2), "token_record_us": round(per_token * 1e6, 2)}


def run(args: argparse.Namespace) -> int:
    from kimitui.engine.session import Engine, EngineError
    from kimitui.model import synth
    from kimitui.model.gguf_map import load_model_map

    if args.tokens < 2 or args.rounds < 1:
        raise UserError("--tokens must be at least 2 and --rounds at least 1")
    with tempfile.TemporaryDirectory(prefix="kimitui-trace-bench-") as tmp:
        tmp_dir = Path(tmp)
        model = args.model
        if model is None:
            spec = synth.plan_dense(parse_size(args.size), "q4_1", synth.default_tokenizer())
            model = synth.write_model(spec, tmp_dir / "bench.gguf", progress=False).paths[0]
        tensor_bytes = load_model_map(model).tensor_bytes
        budget = parse_size(args.budget) if args.budget else int(tensor_bytes * 0.9)
        engine = Engine(model, n_ctx=512, budget=budget)
        try:
            engine.load()
            engine.pin()
        except EngineError as exc:
            raise UserError(str(exc)) from None
        try:
            if engine.streamer is None:
                raise UserError(f"with a budget of {format_bytes(budget)} nothing streams: lower --budget")
            result = {
                "model": model.name, "model_bytes": tensor_bytes, "budget": budget,
                "streamed_bytes_per_token": engine.streamer.streamed_bytes_per_token,
                **measure(engine, args.rounds, args.tokens, tmp_dir),
                **writer_cost(tmp_dir),
            }
        finally:
            engine.close()
    ms = result["median_off_ms"] / 1000
    result["writer_share_pct"] = round(
        (result["token_record_us"] + result["reads_per_token"] * result["read_record_us"]) / 1e6 / ms * 100, 3
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['model']}: {format_bytes(result['model_bytes'])} of tensors, budget {format_bytes(budget)}, "
        f"{format_bytes(result['streamed_bytes_per_token'])} streamed per token"
    )
    print(f"decode per token, median of {args.rounds} rounds of {args.tokens} tokens:")
    print(f"  tracing off {result['median_off_ms']:.2f} ms · on {result['median_on_ms']:.2f} ms")
    print(f"  overhead (median of per-round ratios): {result['overhead_pct']:+.2f}%")
    print(
        f"writer alone: {result['token_record_us']:.1f} µs per token record, {result['read_record_us']:.1f} µs per read "
        f"record; 1 token and {result['reads_per_token']:.1f} read records ({format_bytes(result['trace_bytes_per_token'])} of trace) per token "
        f"= {result['writer_share_pct']:.3f}% of a token"
    )
    return 0
