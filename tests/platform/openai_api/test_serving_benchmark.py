"""The serving benchmark's measuring code works (a 4-request smoke run; the real runs are `make bench`)."""

import subprocess
import sys
import time

import pytest

from benchmarks import serving

pytestmark = pytest.mark.slow


def test_summary_statistics():
    results = [
        serving.RequestResult(ok=True, prompt_len=4, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        serving.RequestResult(ok=False, prompt_len=4, error="HTTP 500"),
    ]
    summary = serving.summarize(results, duration=2.0)
    assert summary["completed"] == 1 and summary["failed"] == 1 and summary["errors"] == ["HTTP 500"]
    assert summary["output_tok_s"] == pytest.approx(2.5)
    assert summary["tpot_ms"]["p50"] == pytest.approx(100.0) and summary["itl_ms"]["p99"] == pytest.approx(100.0)


def test_a_stream_with_tokens_but_no_text_counts_without_a_ttft():
    """A random-weight model can emit only tokens that decode to nothing: the request completed."""
    results = [
        serving.RequestResult(ok=True, prompt_len=4, output_tokens=5, ttft=0.2, latency=0.6),
        serving.RequestResult(ok=True, prompt_len=4, output_tokens=3, ttft=None, latency=0.4),
    ]
    summary = serving.summarize(results, duration=1.0)
    assert summary["completed"] == 2 and summary["failed"] == 0 and summary["output_tok_s"] == pytest.approx(8.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0) and summary["tpot_ms"]["mean"] == pytest.approx(100.0)


def test_each_ratio_divides_by_the_bare_runs_that_alternated_with_it():
    def measured(served, bare, interval):
        stats = {"mean": 1.0, "p50": 1.0, "p99": 1.0}
        return {
            "completed": 3,
            "failed": 0,
            "request_throughput": 1.0,
            "output_tok_s": served,
            "ttft_ms": stats,
            "tpot_ms": stats,
            "itl_ms": stats,
            "runs_tok_s": [served] * 3,
            "bare_runs_tok_s": bare,
            "stream_interval": interval,
        }

    report = {
        "machine": "m",
        "workload": {"stream_interval": 1},
        "rates": {"inf": measured(80.0, [90, 100, 130], 1)},
        "grouped": measured(90.0, [120, 100, 95], 8),
        "offline": {"idle_ttft_p50_ms": 10.0},
        "idle_ttft_ms": {"p50": 22.0},
    }
    serving.print_report(report)
    assert report["comparison"]["by_stream_interval"] == {1: pytest.approx(0.8), 8: pytest.approx(0.9)}
    assert report["comparison"]["added_p50_ttft_ms_idle"] == pytest.approx(12.0)


def test_process_cpu_time_is_read_for_another_process_and_this_one():
    busy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)",
        ]
    )
    try:
        before = {"busy": serving.process_cpu_s(busy.pid), "client": serving.process_cpu_s(serving.os.getpid())}
        deadline = time.monotonic() + 20
        while serving.process_cpu_s(busy.pid) - before["busy"] < 0.3 and time.monotonic() < deadline:
            sum(i * i for i in range(200_000))  # some CPU time of our own meanwhile
        after = {"busy": serving.process_cpu_s(busy.pid), "client": serving.process_cpu_s(serving.os.getpid())}
    finally:
        busy.kill()
        busy.wait()
    per_token = serving.cpu_us_per_token(before, after, tokens=1000)
    assert 0.3e3 <= per_token["busy"] < 1.5e3, per_token  # 0.3-0.45 s over 1000 tokens, in us per token
    assert per_token["client"] > 0
    assert serving.process_cpu_s(busy.pid) is None, "a reaped process has no CPU time to read"


def test_cpu_table_sums_the_served_processes_and_subtracts_the_bare_engine():
    stats = {"mean": 1.0, "p50": 1.0, "p99": 1.0}
    cpu = {"bare engine": 1000.0, "engine0": 1100.0, "web": 120.0, "redis": 20.0, "benchmark client": 40.0}
    report = {
        "machine": "m",
        "workload": {"stream_interval": 1},
        "rates": {
            "inf": {
                "completed": 3,
                "failed": 0,
                "request_throughput": 1.0,
                "output_tok_s": 80.0,
                "ttft_ms": stats,
                "tpot_ms": stats,
                "itl_ms": stats,
                "cpu_us_per_token": cpu,
            }
        },
    }
    table = serving.print_report(report)
    assert "| 1 | 1,000 | 1,100 | 120 | 20.00 | 40.00 | 1,280 | 280 |" in table


def test_benchmark_runs_against_a_live_stack(live_stack, tiny_model_dir, tmp_path):
    report = serving.main(
        [
            "--base-url",
            live_stack.base_url,
            "--api-key",
            live_stack.api_key,
            "--model-name",
            live_stack.model_name,
            "--model",
            tiny_model_dir,
            "--skip-offline",
            "--num-requests",
            "4",
            "--prompt-len",
            "4",
            "8",
            "--output-len",
            "4",
            "8",
            "--rates",
            "20,inf",
            "--out",
            str(tmp_path / "serving.json"),
        ]
    )
    for rate in ("20.0", "inf"):
        summary = report["rates"][rate]
        assert summary["completed"] == 4 and summary["failed"] == 0
        assert summary["output_tok_s"] > 0 and summary["ttft_ms"]["p50"] > 0
    assert (tmp_path / "serving.json").exists()
