"""Benchmarks behind `kimitui bench*` subcommands; figures go into the README, never into timed tests."""
