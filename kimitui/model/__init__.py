"""Model files: where the default model lives, and what a GGUF holds before llama.cpp sees it."""

from kimitui.model.default import DEFAULT_MODEL_DIST, default_model_path
from kimitui.model.gguf_file import ModelInfo, read_model_info

__all__ = ["DEFAULT_MODEL_DIST", "ModelInfo", "default_model_path", "read_model_info"]
