"""Settings: TOML file (``$KIMITUI_CONFIG`` or the platform config dir), then flags on top.

Every key lives in ``SCHEMA`` with its type, default and bounds; config.example.toml
documents the same keys (a test keeps the two in step). Errors name the file, line and key.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from kimitui.errors import UserError
from kimitui.units import parse_size

APP_NAME = "kimitui"


@dataclass(frozen=True)
class Key:
    kind: str  # "int" | "float" | "str" | "size" | "size_or_auto" | "bool" | "str_list"
    default: Any
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] | None = None

    @property
    def bounds(self) -> tuple:
        return self.low, self.high


SCHEMA: dict[str, dict[str, Key]] = {
    "model": {
        "path": Key("str", ""),
        "paths": Key("str_list", []),
        "n_ctx": Key("int", 4096, 256, 1 << 20),
        "n_threads": Key("int", 0, 0, 1024),
        "n_batch": Key("int", 512, 1, 1 << 16),
        "chat_template_file": Key("str", ""),
        # One of llama.cpp's built-in template names (llama3, chatml, command-r, ...) or a
        # Jinja template's text; chat_template_file wins where both are set.
        "chat_template": Key("str", ""),
        # A reply that fills the context goes on: the older half after n_keep tokens leaves it
        # (llama-server's --context-shift); models whose memory cannot shift (Kimi K3) stop instead.
        "context_shift": Key("bool", False),
    },
    "sampling": {
        "temperature": Key("float", 0.7, 0.0, 5.0),
        "top_p": Key("float", 0.95, 0.0, 1.0),
        "max_tokens": Key("int", 512, 1, 1 << 20),
        "seed": Key("int", -1, -1, 0xFFFFFFFF),
        "system_prompt": Key("str", "You are a helpful assistant."),
    },
    "engine": {
        "budget": Key("size_or_auto", "auto"),
        "prefetch_depth": Key("int", 2, 0, 16),
        "shard_size": Key("size", 64 * 2**20, 4 * 2**20, 2**30),
        "policy": Key("str", "pin-stream", choices=("pin-stream", "lru")),
        "io_threads": Key("int", 4, 1, 64),
        "expert_policy": Key("str", "lfu", choices=("lfu", "lru")),
        "expert_lookahead": Key("bool", False),
        # Lossy, off by default (engine/trimming.py): skip a routed expert that is not in memory
        # when its share of the token's routing weight is below expert_trim_below, or past the
        # token's experts whose shares reach expert_trim_cumulative.
        "expert_trim_below": Key("float", 0.0, 0.0, 0.5),
        "expert_trim_cumulative": Key("float", 1.0, 0.05, 1.0),
        # Speculative decoding (engine/speculation.py): "lookup" drafts from the conversation
        # itself, verified in one pass where the weights stream (a Q8_0 cache, flash attention);
        # "off" (the default: that cache rounds otherwise than llama-cpp-python's).
        "speculate": Key("str", "off", choices=("lookup", "off")),
        "draft_max": Key("int", 8, 1, 32),
        "draft_model": Key("str", ""),  # a small GGUF with the model's vocabulary whose drafts replace the lookup's
        # The address space the model's weights may take: "auto" (under iOS's 63 GiB ceiling
        # or `ulimit -v`, what the process leaves) or a size; a model larger streams through windows.
        "address_space": Key("size_or_auto", "auto"),
    },
    "metrics": {
        "interval": Key("float", 0.25, 0.05, 10.0),
        "latency_window": Key("int", 64, 4, 4096),
    },
    "ui": {
        "theme": Key("str", ""),
    },
    "history": {
        # Disk for conversations' saved llama.cpp states (a reopened chat is not evaluated
        # again): "auto" = a tenth of the disk holding the history, a size, or 0 for none.
        "state_quota": Key("size_or_auto", "auto"),
    },
    "trace": {
        "enabled": Key("bool", False),
        "path": Key("str", ""),
        "max_size": Key("size", 64 * 2**20, 2**20, 2**40),
        "keep": Key("int", 4, 0, 1000),
    },
    "server": {
        "host": Key("str", "127.0.0.1"),
        "port": Key("int", 8080, 0, 65535),
        "api_key": Key("str", ""),
        "max_body": Key("size", 1 << 20),
        "max_n_predict": Key("int", 2048, 1, 1 << 20),
        "max_request_entries": Key("int", 262_144, 1, 1 << 30),  # replies x tokens x (1 + alternatives) per request
        "allowed_hosts": Key("str_list", []),
        "cors_origins": Key("str_list", []),
        "alias": Key("str", ""),  # one name, or several comma-separated (any of them names the model)
        "tags": Key("str_list", []),
        "verbose": Key("bool", False),  # every reply carries llama-server's __verbose object
        "slots": Key("int", 1, 1, 64),  # the context split into this many prompt caches (engine/slots.py)
        "slots_endpoint": Key("bool", True),  # GET /slots answers (else 501, as llama-server --no-slots)
        # Where POST /slots/{id}?action=save|restore keeps slots' files ("": the actions answer 501).
        "slot_save_path": Key("str", ""),
    },
}


def key_spec(dotted: str) -> Key:
    """The schema's entry for ``section.key``: its type, default and bounds, for whoever checks
    the same value elsewhere (live tuning, request bodies)."""
    section, key = dotted.split(".")
    return SCHEMA[section][key]


@dataclass
class Settings:
    """Resolved settings. ``origins`` says where each value came from, for error lines."""

    values: dict[str, Any]
    config_path: Path | None
    origins: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, dotted: str) -> Any:
        return self.values[dotted]

    def __setitem__(self, dotted: str, value: Any) -> None:
        self.values[dotted] = value

    def origin(self, dotted: str) -> str:
        return self.origins.get(dotted, "default")


def default_config_path() -> Path:
    env = os.environ.get("KIMITUI_CONFIG")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_config_dir(APP_NAME)) / "config.toml"


def data_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP_NAME))


def cache_dir() -> Path:
    """What kimitui can rebuild: routing heatmaps, start-up caches, split-set links."""
    return Path(platformdirs.user_cache_dir(APP_NAME))


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary name, so a reader never sees half a file.
    OSError is the caller's to handle."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _key_line(text: str, section: str, key: str | None) -> int | None:
    """1-based line of ``key`` inside ``[section]`` (or of the section header)."""
    current = ""
    header = re.compile(r"^\s*\[\s*([^\]]+?)\s*\]")
    for number, line in enumerate(text.splitlines(), start=1):
        m = header.match(line)
        if m:
            current = m.group(1)
            if key is None and current == section:
                return number
            continue
        if key is not None and current == section and re.match(rf"^\s*{re.escape(key)}\s*=", line):
            return number
    return None


def coerce(dotted: str, raw: Any, spec: Key) -> Any:
    """Check and convert one value; ValueError carries the reason."""
    kind = spec.kind
    if kind == "bool":
        if not isinstance(raw, bool):
            raise ValueError(f"expected true or false, got {raw!r}")
        return raw
    if kind == "int":
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"expected an integer, got {raw!r}")
        value: Any = raw
    elif kind == "float":
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ValueError(f"expected a number, got {raw!r}")
        value = float(raw)
        if not math.isfinite(value):  # nan passes every range comparison
            raise ValueError(f"expected a finite number, got {raw!r}")
    elif kind == "str":
        if not isinstance(raw, str):
            raise ValueError(f"expected a string, got {raw!r}")
        value = raw
    elif kind == "str_list":
        if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
            raise ValueError(f"expected a list of strings such as [\"/mnt/ssd/models\"], got {raw!r}")
        return list(raw)
    elif kind in ("size", "size_or_auto"):
        if kind == "size_or_auto" and raw == "auto":
            return "auto"
        if isinstance(raw, float) or not isinstance(raw, (str, int)):
            raise ValueError(f"expected a size such as \"512MiB\", \"8GiB\" or \"1.5GB\", got {raw!r}")
        value = parse_size(raw)
    else:  # pragma: no cover - schema typo
        raise AssertionError(kind)
    if spec.low is not None and value < spec.low:
        raise ValueError(f"{value!r} is below the minimum {spec.low:g}")
    if spec.high is not None and value > spec.high:
        raise ValueError(f"{value!r} is above the maximum {spec.high:g}")
    if spec.choices is not None and value not in spec.choices:
        raise ValueError(f"{value!r} is not one of {', '.join(spec.choices)}")
    return value


def load_settings(path: Path | None = None, *, explicit: bool = False) -> Settings:
    """Defaults, then the TOML file if present. A missing file is fine unless named explicitly."""
    values = {f"{s}.{k}": spec.default for s, keys in SCHEMA.items() for k, spec in keys.items()}
    path = path or default_config_path()
    explicit = explicit or bool(os.environ.get("KIMITUI_CONFIG"))
    settings = Settings(values, None)
    if not path.exists():
        if explicit:
            raise UserError(f"config file not found: {path}")
        return settings
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read config file {path}: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    settings.config_path = path

    def where(section: str, key: str | None) -> str:
        line = _key_line(text, section, key)
        return f"{path}" + (f" line {line}" if line else "")

    for section, table in data.items():
        if section not in SCHEMA:
            raise UserError(f"{where(section, None)}: unknown section [{section}] (known: {', '.join(SCHEMA)})")
        if not isinstance(table, dict):
            raise UserError(f"{path}: {section} must be a [{section}] table")
        for key, raw in table.items():
            dotted = f"{section}.{key}"
            spec = SCHEMA[section].get(key)
            if spec is None:
                known = ", ".join(SCHEMA[section])
                raise UserError(f"{where(section, key)}: unknown key {dotted} (known in [{section}]: {known})")
            try:
                settings[dotted] = coerce(dotted, raw, spec)
            except ValueError as exc:
                raise UserError(f"{where(section, key)}: {dotted}: {exc}") from None
            line = _key_line(text, section, key)
            settings.origins[dotted] = f"{path}" + (f" line {line}" if line else "")
    return settings


def apply_override(settings: Settings, dotted: str, raw: Any, flag: str) -> None:
    """A command-line flag wins over the file; errors name the flag."""
    spec = key_spec(dotted)
    if spec.kind in ("int", "float") and isinstance(raw, str):
        try:
            raw = int(raw) if spec.kind == "int" else float(raw)
        except ValueError:
            raise UserError(f"{flag}: expected {'an integer' if spec.kind == 'int' else 'a number'}, got {raw!r}") from None
    try:
        settings[dotted] = coerce(dotted, raw, spec)
    except ValueError as exc:
        raise UserError(f"{flag}: {exc}") from None
    settings.origins[dotted] = flag

