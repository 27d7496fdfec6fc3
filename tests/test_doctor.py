"""`kimitui doctor`: one line per prerequisite, failures with their fix, exit 0 only when all pass."""

from __future__ import annotations

import resource
import subprocess
import sys

CHECKS = ["platform", "fast start", "address space", "descriptors", "direct reads", "memory", "drive"]


def doctor(*args: str, limit_files: int | None = None) -> subprocess.CompletedProcess:
    def limited():
        if limit_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit_files, limit_files))

    return subprocess.run(
        [sys.executable, "-m", "kimitui", "doctor", "--seconds", "0.5", *args],
        capture_output=True, text=True, timeout=120, preexec_fn=limited,
    )


def test_every_prerequisite_passes_here_on_the_default_model():
    proc = doctor()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line[:14].strip() for line in lines] == CHECKS
    assert all(line[15:19] == "ok  " for line in lines)
    assert "O_DIRECT" in lines[4] and "checked against a cached read" in lines[4]
    assert "B/s over" in lines[6]


def test_a_k3_cut_under_a_budget_gets_its_tok_s_floor(tmp_path):
    from kimitui.model import synth

    spec = synth.plan_like("kimi-k3", None, 0.02, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
    path = synth.write_model(spec, tmp_path / "k3.gguf", seed=3, progress=False).paths[0]
    proc = doctor("--model", str(path), "--budget", "25MiB")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    memory, drive = proc.stdout.strip().splitlines()[-2:]
    assert "is above the working set" in memory
    assert "at 25.0 MiB a token reads" in drive and "tok/s" in drive


def test_a_failing_check_says_its_fix_and_the_exit_is_one():
    proc = doctor(limit_files=100)
    assert proc.returncode == 1
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("descriptors")]
    assert "FAIL" in line and "about 131 needed: run `ulimit -n 131` first" in line
    proc = doctor("--budget", "100TiB")
    assert proc.returncode == 1
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("memory")]
    assert "FAIL" in line and "lower --budget to" in line
    (drive,) = [line for line in proc.stdout.splitlines() if line.startswith("drive")]
    assert "no tok/s floor: the budget is refused above" in drive


def test_a_model_that_is_not_there_is_one_line_and_exit_two(tmp_path):
    proc = doctor("--model", str(tmp_path / "missing.gguf"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"kimitui: model file not found: {tmp_path / 'missing.gguf'} (from --model)"]


def test_on_the_phone_the_platform_line_says_ios_arm64_beside_the_machine_name(monkeypatch):
    from kimitui import doctor

    monkeypatch.setattr(doctor, "is_ios", lambda: True)
    monkeypatch.setattr(doctor.host, "machine", lambda: "iPhone17,1")
    check = doctor.check_platform()
    assert check.text.startswith("ios arm64 (iPhone17,1), CPython ")


def test_on_the_phone_the_address_space_line_weighs_the_windows_against_the_jumbo_ceiling(tmp_path, model_path):
    """A K3 cut larger than iOS's 63 GiB (sparse): doctor names the ceiling, the entitlement that
    reaches it and the iOS 18 one no user can sign for, and the windows that fit under it."""
    from kimitui import doctor
    from kimitui.engine.platform import EXTENDED_VA_ENTITLEMENT, IOS_ADDRESS_CEILING, IOS_LARGE_FILE_ENTITLEMENT
    from kimitui.model import synth
    from kimitui.model.gguf_map import load_model_map

    spec = synth.plan_like("kimi-k3", None, 1.0, None, synth.default_tokenizer(), synth.Cut(layers=6))
    path = synth.write_model(spec, tmp_path / "k3.gguf", seed=1, progress=False, sparse=True).paths[0]
    assert path.stat().st_size > IOS_ADDRESS_CEILING
    fits = lambda n: n <= IOS_ADDRESS_CEILING  # noqa: E731 - the phone's reservation, injected
    check = doctor.check_address_space([path], load_model_map(path), budget=6 * 2**30, platform="ios", reserve=fits)
    assert check.ok and "streams through windows of" in check.text, check.text
    assert f"iOS's ceiling {IOS_ADDRESS_CEILING / 2**30:.1f} GiB" in check.text
    assert EXTENDED_VA_ENTITLEMENT in check.text and IOS_LARGE_FILE_ENTITLEMENT in check.text
    small = doctor.check_address_space([model_path], platform="ios", reserve=fits)
    assert small.ok and "can be mapped at once (iOS's ceiling" in small.text
    refused = doctor.check_address_space([path], platform="ios", reserve=lambda n: False)
    assert not refused.ok and "63 GiB at most" in refused.text and "ldid -S" in refused.text
