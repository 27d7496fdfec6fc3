"""`kimitui bench-ui`: how long a keypress takes to show in the prompt while a reply streams.

The real app runs headless (Textual's test driver) on the real engine. Each probe posts a key
event to the app the way the terminal driver does and times until the character is in the
prompt box, only while tokens are streaming.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from kimitui.engine.metrics import percentile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kimitui.cli import add_common

    add_common(parser)
    parser.add_argument("--presses", type=int, default=50, help="keypresses to time (default 50)")
    parser.add_argument("--size", default="120x40", help="terminal size WxH (default 120x40)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


async def _measure(app, presses: int, size: tuple[int, int]) -> dict:
    from textual import events

    from kimitui.tui.widgets.chat import PromptInput

    latencies: list[float] = []
    tokens_during = 0
    async with app.run_test(size=size) as pilot:
        while not app.main.ready:
            await pilot.pause(0.05)
        prompt = app.query_one(PromptInput)
        prompt.focus()
        prompt.insert("Write a very long story about the sea, chapter by chapter.")
        await pilot.press("enter")
        while app.main.reply is None or not app.main.reply.view.text:
            await pilot.pause(0.01)
        start_tokens = app.engine.metrics.view()["tokens_total"]
        for i in range(presses):
            if app.main.reply is None:  # the reply ended: start another so every probe runs under load
                prompt.clear()
                prompt.insert("Tell me another long story.")
                await pilot.press("enter")
                while app.main.reply is None:
                    await pilot.pause(0.01)
            before = prompt.text
            sent = time.perf_counter()
            app.post_message(events.Key("x", "x"))
            while prompt.text == before:
                await asyncio.sleep(0.0005)
            latencies.append(time.perf_counter() - sent)
            await pilot.pause(0.1 + (i % 3) * 0.05)  # spread the probes over the token cadence
        tokens_during = app.engine.metrics.view()["tokens_total"] - start_tokens
        if app.main.reply is not None and app.main.reply.generation is not None:
            app.main.reply.generation.cancel()
        while app.main.reply is not None:
            await pilot.pause(0.05)
    return {
        "presses": len(latencies),
        "tokens_streamed_meanwhile": tokens_during,
        "p50_ms": round(percentile(latencies, 50) * 1000, 2),
        "p95_ms": round(percentile(latencies, 95) * 1000, 2),
        "max_ms": round(max(latencies) * 1000, 2),
    }


def run(args: argparse.Namespace) -> int:
    from kimitui.cli import make_app, resolve_model, resolve_settings
    from kimitui.errors import UserError

    try:
        width, height = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        raise UserError(f"--size: expected WxH such as 120x40, got {args.size!r}") from None
    settings = resolve_settings(args)
    settings["sampling.max_tokens"] = 2048
    app = make_app(settings, resolve_model(settings))
    figures = asyncio.run(_measure(app, args.presses, (width, height)))
    if args.json:
        print(json.dumps(figures))
    else:
        print(
            f"keypress echo while streaming ({figures['presses']} presses, "
            f"{figures['tokens_streamed_meanwhile']} tokens streamed meanwhile): "
            f"p50 {figures['p50_ms']} ms, p95 {figures['p95_ms']} ms, max {figures['max_ms']} ms"
        )
    return 0
