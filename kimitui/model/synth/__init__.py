"""Synthetic GGUF models of any size that llama.cpp loads and runs (`kimitui synth`).

Benchmarks need models larger than memory, in real shapes, without downloading them:
random but valid quantized weights (finite logits), the default model's tokenizer (so
chat works), a dense `llama`, an MoE `deepseek2` (Kimi K2's architecture) or `kimi-k3`,
sized to a target or scaled from Kimi's. spec.py says what a model is made of, archs.py
builds each architecture, sizing.py shapes one to a size, blocks.py makes its bytes,
writer.py writes the files, cli.py is the command.
"""

# The face the test suite and `kimitui trace bench` make models through: plan one, then write it.
from kimitui.model.synth.sizing import Cut, plan_dense, plan_like, plan_moe
from kimitui.model.synth.spec import Tokenizer, default_tokenizer
from kimitui.model.synth.writer import write_model

__all__ = ["Cut", "Tokenizer", "default_tokenizer", "plan_dense", "plan_like", "plan_moe", "write_model"]
