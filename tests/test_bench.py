"""`kimitui bench` and `bench-load` on a small synthetic model: real runs, figures checked
for sense (never for speed), the cgroup path where this machine allows it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimitui.benchmarks.bench import DISK_THREADS
from kimitui.benchmarks.cgroup import Hierarchy, find_hierarchy
from kimitui.cli import main
from kimitui.model import synth
from kimitui.model.gguf_map import load_model_map

MIB = 2**20


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "dense100.gguf"
    synth.write_model(synth.plan_dense(100 * MIB, "q4_1", synth.default_tokenizer()), path, progress=False)
    return path


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimitui", *argv], capture_output=True, text=True, timeout=300)


def cgroup_or_skip() -> Hierarchy:
    if os.geteuid() != 0:
        pytest.skip("memory cgroups need root here")
    found = find_hierarchy()
    if isinstance(found, str):
        pytest.skip(found)
    return found


def test_bench_with_baseline_reports_measured_figures(small_model, tmp_path):
    out = tmp_path / "bench.json"
    done = run_cli("bench", "--model", str(small_model), "--tokens", "4", "--prompt-tokens", "8", "--baseline", "--json", str(out))
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads(out.read_text())
    assert "kimitui" in done.stdout and "plain mmap" in done.stdout

    disk = report["disk"]
    assert len(disk["samples"]) == 2 * len(DISK_THREADS)  # each thread count, before and after
    assert {s["threads"] for s in disk["samples"]} == set(DISK_THREADS)
    for sample in disk["samples"]:
        assert sample["storage_bytes"] >= 0.9 * sample["bytes"]  # it was cold
    assert disk["bandwidth_bytes_s"] == max(s["bandwidth_bytes_s"] for s in disk["samples"]) > 0
    assert report["compute"]["decode_tok_s"] > 0  # 100 MiB fits in RAM
    runs = report["runs"]
    for name in ("kimitui", "baseline"):
        r = runs[name]
        assert r["error"] is None
        assert r["prompt_tokens"] == 8 and r["completion_tokens"] == 4
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["ttft_s"] > 0
        assert 0 < r["token_p50_s"] <= r["token_p95_s"]
        assert r["peak_rss_bytes"] > 0 and r["load_s"] > 0
        for key in ("read_bytes_per_token", "prefill_read_bytes", "decode_read_bytes"):
            assert key in r
        assert r["read_bytes_per_token"] >= 0  # Linux has per-process I/O counters
        # Nothing reports cache hits yet: unmeasured stays None, never a made-up number.
        assert r["hit_rate"] is None and r["stall_s_per_token"] is None
    assert report["same_tokens"] is True  # greedy on the same prompt: the comparison is fair
    # The model fits: replies also alternated in one process, and the target is judged on them.
    inter = report["interleaved"]
    assert len(inter["kimitui"]) == len(inter["plain"]) >= 5 and all(v > 0 for v in inter["kimitui"] + inter["plain"])
    assert report["targets"]["decode_vs_plain_within_3%"]["value"] == pytest.approx(inter["ratio"])
    ratios = report["ratios"]
    assert ratios["decode_tok_s"] == pytest.approx(runs["kimitui"]["decode_tok_s"] / runs["baseline"]["decode_tok_s"])
    assert ratios["ttft_s"] == pytest.approx(runs["kimitui"]["ttft_s"] / runs["baseline"]["ttft_s"])

    limit = report["limit"]
    model_map = load_model_map(small_model)
    assert limit["pinned_bytes"] == runs["kimitui"]["pinned_bytes"] > 0
    assert limit["must_read_bytes_per_token"] == model_map.read_bytes_per_token(limit["pinned_bytes"])
    assert limit["tok_s"] > 0
    assert report["settings"]["cgroup_limit_bytes"] is None and runs["kimitui"]["cgroup_peak_bytes"] is None


def test_bench_rounds_alternate_and_report_the_median_run(small_model, tmp_path):
    out = tmp_path / "bench.json"
    done = run_cli("bench", "--model", str(small_model), "--tokens", "3", "--prompt-tokens", "4", "--baseline", "--rounds", "3", "--json", str(out))
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads(out.read_text())
    for name in ("kimitui", "baseline"):
        rates = report["rounds"][name]
        assert len(rates) == 3 and all(r > 0 for r in rates)
        assert report["runs"][name]["decode_tok_s"] == sorted(rates)[1]
    assert "decode tok/s of every round" in done.stdout


def test_bench_streaming_moe_reports_experts_and_needed_bytes(tmp_path):
    model = tmp_path / "moe.gguf"
    synth.write_model(synth.plan_moe(200 * MIB, "q4_1", synth.default_tokenizer()), model, progress=False)
    out = tmp_path / "bench.json"
    done = run_cli(
        "bench", "--model", str(model), "--budget", "100MiB", "--tokens", "6", "--prompt-tokens", "8", "--expert-lookahead",
        "--replies", "2", "--json", str(out),
    )
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads(out.read_text())
    run = report["runs"]["kimitui"]
    assert run["streaming"] and report["model"]["moe"]
    # Experts are timed at this disk's rate for expert-sized scattered reads, measured too.
    assert report["disk"]["random_bandwidth_bytes_s"] > 0
    assert report["disk"]["slice_bytes"] == load_model_map(model).expert_slice_bytes
    assert report["limit"]["must_read_expert_bytes_per_token"] > 0
    assert 0 <= run["expert_hit_rate"] <= 1
    assert run["needed_bytes_per_token"] > 0  # 100 MiB cannot hold 200 MiB: some experts come from storage
    assert run["read_vs_needed"] == pytest.approx(run["read_bytes_per_token"] / run["needed_bytes_per_token"])
    assert run["expert_lookahead"] is True and "expert look-ahead on" in done.stdout
    assert run["expert_prefetch_wasted_bytes_per_token"] >= 0
    assert set(report["targets"]) == {"decode_vs_plain_at_least_4x", "read_vs_needed_at_most_1.15x"}
    assert "targets (MoE streaming)" in done.stdout and "expert hit rate" in done.stdout
    # A second reply in the same engine, to a prompt of its own, its caches as the first left them.
    (second,) = run["later_replies"]
    assert second["ttft_s"] > 0 and second["decode_tok_s"] > 0 and second["completion_tokens"] == 6
    assert 0 <= second["expert_hit_rate"] <= 1 and second["share_of_io_limit"] > 0
    assert "kimitui reply 2, the same engine, a prompt of its own" in done.stdout
    # The pinned set's reading showed its progress (bytes, MB/s, ETA) while the bench ran.
    assert "pinning" in done.stderr and "MB/s" in done.stderr and "ETA" in done.stderr


def test_bench_in_a_memory_cgroup(small_model, tmp_path):
    hierarchy = cgroup_or_skip()
    out = tmp_path / "bench.json"
    limit = 512 * MIB
    proc = subprocess.Popen(
        [sys.executable, "-m", "kimitui", "bench", "--model", str(small_model), "--tokens", "4", "--prompt-tokens", "8",
         "--budget", "256MiB", "--cgroup-limit", "512MiB", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr + stdout
    report = json.loads(out.read_text())
    assert report["settings"]["cgroup_limit_bytes"] == limit
    run = report["runs"]["kimitui"]
    assert run["error"] is None and run["decode_tok_s"] > 0
    assert 0 < run["cgroup_peak_bytes"] <= limit
    # Every per-run cgroup is gone afterwards.
    assert not list(hierarchy.own.glob(f"kimitui-bench-{proc.pid}-*"))


def test_bench_load_times_the_app_and_the_stock_load(small_model, tmp_path):
    out = tmp_path / "load.json"
    done = run_cli("bench-load", "--model", str(small_model), "--n-ctx", "256", "--repeat", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads(out.read_text())
    app, base = report["runs"]["kimitui"][0], report["runs"]["baseline"][0]
    assert app["error"] is None and base["error"] is None
    assert app["ready_s"] > app["load_s"] > 0  # interpreter start and imports count
    assert base["ready_s"] > base["load_s"] > 0
    assert app["read_bytes"] is not None and base["read_bytes"] is not None
    # The stock load reads the whole model (MAP_POPULATE); fast start does not.
    assert base["read_bytes"] >= 0.9 * report["model"]["tensor_bytes"]
    assert app["read_bytes"] < base["read_bytes"]
    assert report["targets"]["share_of_baseline"] == pytest.approx(app["ready_s"] / base["ready_s"])


def test_bench_load_passes_the_address_space_on_and_can_leave_the_stock_load_out(small_model, tmp_path):
    out = tmp_path / "load.json"
    done = run_cli(
        "bench-load", "--model", str(small_model), "--n-ctx", "256", "--repeat", "1", "--address-space", "2GiB",
        "--no-baseline", "--json", str(out),
    )
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads(out.read_text())
    argv = report["settings"]["app_argv"]
    assert argv[argv.index("--address-space") + 1] == "2GiB"
    assert report["runs"]["kimitui"][0]["error"] is None and report["runs"]["baseline"] == []
    assert "start to ready" in done.stdout


def test_bench_resume_compares_a_saved_state_with_evaluating_again(model_path, tmp_path):
    """The real engine, three fresh processes: the saved state's side evaluates only the new
    message, the other side the whole conversation, and both give the same greedy token."""
    out = tmp_path / "resume.json"
    done = run_cli("bench-resume", "--model", str(model_path), "--conversation-tokens", "200", "--repeat", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads(out.read_text())
    saved, again = report["runs"]["saved state"][0], report["runs"]["evaluated again"][0]
    assert report["same_first_token"] and report["state_bytes"] > 0
    assert again["evaluated_tokens"] == again["prompt_tokens"] >= 200
    assert 0 < saved["evaluated_tokens"] < 32
    assert saved["storage_read_bytes"] is None or saved["storage_read_bytes"] >= report["state_bytes"] // 2
    assert "request to first token" in done.stdout


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["bench", "--tokens", "1"], "--tokens: at least 2"),
        (["bench", "--budget", "lots"], "--budget: cannot read 'lots' as a size"),
        (["bench", "--cgroup-limit", "2XB"], "--cgroup-limit: unknown size unit"),
        (["bench", "--model", "/nonexistent.gguf"], "model file not found"),
        (["bench-load", "--repeat", "0"], "--repeat: at least 1"),
        (["bench-resume", "--conversation-tokens", "4"], "--conversation-tokens: at least 16"),
        (["bench-resume", "--cgroup-limit", "2XB"], "--cgroup-limit: unknown size unit"),
        (["bench", "--rounds", "0"], "--rounds: at least 1"),
        (["bench", "--replies", "0"], "--replies: at least 1"),
        (["bench", "--budget", "4MiB"], "--budget: budget 4.0 MiB is below the minimum working set of SmolLM2"),
    ],
)
def test_bad_flags_end_in_one_line(argv, text, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1


def test_find_hierarchy_v1_and_v2(tmp_path):
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "mountinfo").write_text(
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    (proc / "cgroup").write_text("4:memory:/jobs/a\n0::/\n")
    assert find_hierarchy(tmp_path / "proc") == Hierarchy("v1", Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/memory/jobs/a"))

    mount = tmp_path / "cg2"
    mount.mkdir()
    (mount / "cgroup.controllers").write_text("cpu io memory pids\n")
    (proc / "mountinfo").write_text(f"30 1 0:26 / {mount} rw - cgroup2 cgroup2 rw\n")
    (proc / "cgroup").write_text("0::/user.slice/me\n")
    assert find_hierarchy(tmp_path / "proc") == Hierarchy("v2", mount, mount / "user.slice" / "me")

    (mount / "cgroup.controllers").write_text("cpu io pids\n")
    assert "no memory cgroup controller" in find_hierarchy(tmp_path / "proc")
