"""Benchmarks behind `kimitui bench*` subcommands; figures go into docs/benchmarks.md, never into timed tests."""
