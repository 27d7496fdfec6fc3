"""Record the metrics the snapshot and widget tests replay (tests/data/k3_metrics.json): the real
engine streaming a Kimi K3 cut (4 layers, 896 experts, three fiftieths of the widths) under a
budget a little above its minimum working set, sampled every quarter second through one
greedy reply. Run from the repository root: `.venv/bin/python tests/data/record_metrics.py`."""

from __future__ import annotations

import dataclasses
import json
import tempfile
import threading
import time
from pathlib import Path

from kimitui.engine.budget import minimum_budget
from kimitui.engine.generation import Sampling
from kimitui.engine.metrics import Sampler
from kimitui.engine.session import Engine
from kimitui.model import synth
from kimitui.model.gguf_map import load_model_map

OUT = Path(__file__).with_name("k3_metrics.json")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spec = synth.plan_like("kimi-k3", None, 0.06, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
        path = synth.write_model(spec, Path(tmp) / "k3-cut.gguf", seed=5, progress=False).paths[0]
        budget = minimum_budget(load_model_map(path)) + 8 * 2**20
        engine = Engine(path, n_ctx=256, budget=budget)
        engine.load()
        engine.pin()
        sampler = Sampler(engine.metrics, interval=0.25, model_path=path)
        samples, done = [sampler.sample()], threading.Event()

        def sample() -> None:
            while not done.wait(0.25):
                samples.append(sampler.sample())

        thread = threading.Thread(target=sample)
        thread.start()
        try:
            for _ in engine.complete("The quick brown fox jumps over the lazy dog", Sampling(temperature=0.0, max_tokens=48)):
                pass
            time.sleep(0.3)
        finally:
            done.set()
            thread.join()
            engine.close()
    start = samples[0].time
    OUT.write_text(json.dumps([dict(dataclasses.asdict(s), time=round(s.time - start, 3)) for s in samples[-8:]], indent=0) + "\n")
    print(f"{len(samples[-8:])} snapshots -> {OUT}")


if __name__ == "__main__":
    main()
