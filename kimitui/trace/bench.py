"""`kimitui trace bench`: what tracing costs, on a streamed model.

One engine, the same greedy request over and over, rounds alternating tracing off and on
(off-on, then on-off, so drift in machine load falls on both sides alike). Two figures:

- end to end: the median over rounds of (decode time per token traced / untraced) - 1;
- in the run: the time spent inside the writer's calls, on every thread (the engine's and
  the I/O pool's), per traced token, as a share of the decode time per token. It bounds what
  tracing can take from decode (the writer's work plus the GIL it holds), and, unlike the end
  to end figure, stays readable on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kimitui.errors import UserError
from kimitui.trace.writer import TraceWriter
from kimitui.units import format_bytes, size_option

PROMPT = "Once upon a time"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="GGUF to stream (default: a synthetic model of --size)")
    parser.add_argument("--size", default="512MiB", help="size of the synthetic model (default 512MiB)")
    parser.add_argument(
        "--arch", choices=("dense", "kimi"), default="dense",
        help="the synthetic model: dense llama, or Kimi-shaped MoE (61 layers, 384 experts; a read record per expert)",
    )
    parser.add_argument("--budget", help="memory budget, below the model's size so it streams (default: 90%% of its tensors)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of one untraced and one traced request (default 8)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


class TimedWriter(TraceWriter):
    """A TraceWriter that adds up the seconds spent in its Tracer calls, whatever the thread."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.spent: list[float] = []  # list.append is atomic: no lock of our own to time

    def _timed(self, call, *args) -> None:
        started = time.perf_counter()
        call(*args)
        self.spent.append(time.perf_counter() - started)

    def request_started(self, *args) -> None:
        self._timed(super().request_started, *args)

    def token(self, *args) -> None:
        self._timed(super().token, *args)

    def read(self, *args) -> None:
        self._timed(super().read, *args)

    def request_finished(self, *args) -> None:
        self._timed(super().request_finished, *args)


def decode_per_token(engine, tokens: int) -> float:
    from kimitui.engine.generation import Sampling

    gen = engine.complete(PROMPT, Sampling(temperature=0.0, max_tokens=tokens))
    list(gen)
    n = gen.result.completion_tokens
    if n < 2:
        raise UserError(f"the model stopped after {n} token(s): nothing to time")
    return gen.result.decode_s / (n - 1)


def measure(engine, rounds: int, tokens: int, trace_dir: Path) -> dict:
    """Alternate untraced and traced requests on a loaded, streaming ``engine``."""
    decode_per_token(engine, tokens)  # warm-up: page cache, llama.cpp's buffers
    off: list[float] = []
    on: list[float] = []
    spent = 0.0
    reads = written = traced_tokens = 0
    for n in range(rounds):
        for traced in ((False, True) if n % 2 == 0 else (True, False)):
            if not traced:
                off.append(decode_per_token(engine, tokens))
                continue
            path = trace_dir / f"round-{n}.jsonl"
            writer = TimedWriter(path)
            counted: list[dict] = []
            writer.subscribe(counted.append)
            writer.attach(engine)
            try:
                on.append(decode_per_token(engine, tokens))
            finally:
                writer.close()
            spent += sum(writer.spent)
            written += path.stat().st_size
            reads += sum(1 for r in counted if r["type"] == "read")
            traced_tokens += sum(1 for r in counted if r["type"] == "token")
    median_on = statistics.median(on)
    return {
        "rounds": rounds,
        "tokens_per_request": tokens,
        "off_ms_per_token": [round(x * 1000, 3) for x in off],
        "on_ms_per_token": [round(x * 1000, 3) for x in on],
        "median_off_ms": round(statistics.median(off) * 1000, 3),
        "median_on_ms": round(median_on * 1000, 3),
        "overhead_pct": round(statistics.median(b / a - 1 for a, b in zip(off, on)) * 100, 2),
        "writer_us_per_token": round(spent / traced_tokens * 1e6, 1),
        "writer_share_pct": round(spent / traced_tokens / median_on * 100, 3),
        "reads_per_token": round(reads / traced_tokens, 1),
        "trace_bytes_per_token": round(written / traced_tokens),
    }


def run(args: argparse.Namespace) -> int:
    from kimitui.engine.session import Engine
    from kimitui.engine.state import EngineError
    from kimitui.model import synth
    from kimitui.model.gguf_map import load_model_map

    if args.tokens < 2 or args.rounds < 1:
        raise UserError("--tokens must be at least 2 and --rounds at least 1")
    with tempfile.TemporaryDirectory(prefix="kimitui-trace-bench-") as tmp:
        tmp_dir = Path(tmp)
        model = args.model
        if model is None:
            size, tokenizer = size_option(args.size, "--size"), synth.default_tokenizer()
            if args.arch == "kimi":
                spec = synth.plan_like("kimi-k2", size, None, "q4_1", tokenizer)
            else:
                spec = synth.plan_dense(size, "q4_1", tokenizer)
            model = synth.write_model(spec, tmp_dir / "bench.gguf", progress=False).paths[0]
        tensor_bytes = load_model_map(model).tensor_bytes
        budget = size_option(args.budget, "--budget") if args.budget else int(tensor_bytes * 0.9)
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
                "streams_experts": engine.streamer.experts is not None,
                **measure(engine, args.rounds, args.tokens, tmp_dir),
            }
        finally:
            engine.close()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    streamed = f"{format_bytes(result['streamed_bytes_per_token'])} of layers streamed per token"
    if result["streams_experts"]:
        streamed += ", routed experts read as the router picks them"
    print(f"{result['model']}: {format_bytes(result['model_bytes'])} of tensors, budget {format_bytes(budget)}, {streamed}")
    print(f"decode per token, median of {args.rounds} rounds of {args.tokens} tokens:")
    print(f"  tracing off {result['median_off_ms']:.2f} ms · on {result['median_on_ms']:.2f} ms")
    print(f"  end to end: {result['overhead_pct']:+.2f}% (median of per-round ratios; machine noise included)")
    print(
        f"  in the run: {result['writer_us_per_token']:.0f} µs per token inside the writer = "
        f"{result['writer_share_pct']:.3f}% of a token ({result['reads_per_token']:.1f} read records, "
        f"{format_bytes(result['trace_bytes_per_token'])} of trace per token)"
    )
    return 0
