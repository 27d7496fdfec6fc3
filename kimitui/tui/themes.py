"""Load the theme files in themes/ into Textual's theme system."""

from __future__ import annotations

from importlib import resources

from textual.theme import BUILTIN_THEMES, Theme

from kimitui.config import tomllib
from kimitui.errors import UserError

DEFAULT_THEME = "kimitui-dusk"
_FIELDS = set(Theme.__dataclass_fields__)


def bundled_themes() -> list[Theme]:
    themes = []
    for entry in sorted(resources.files("kimitui.themes").iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".toml"):
            continue
        data = tomllib.loads(entry.read_text(encoding="utf-8"))
        unknown = set(data) - _FIELDS
        if unknown:
            raise UserError(f"theme file {entry.name}: unknown keys {', '.join(sorted(unknown))}")
        themes.append(Theme(**data))
    return themes


def theme_names() -> list[str]:
    return sorted({*BUILTIN_THEMES, *(t.name for t in bundled_themes())})


def check_theme(name: str, origin: str) -> None:
    if name and name not in theme_names():
        raise UserError(f"{origin}: unknown theme {name!r} (available: {', '.join(theme_names())})")
