"""Theme files shipped with kimitui; installed as the package kimitui.themes."""
