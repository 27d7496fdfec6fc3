"""kimitui: chat with GGUF models larger than memory, and watch them stream."""

__version__ = "0.1.0"
