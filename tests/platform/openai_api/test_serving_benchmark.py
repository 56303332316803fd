"""The serving benchmark's measuring code works (a 4-request smoke run; the real runs are `make bench`)."""
import pytest

from benchmarks import serving

pytestmark = pytest.mark.slow


def test_summary_statistics():
    results = [serving.RequestResult(ok=True, prompt_len=4, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
               serving.RequestResult(ok=False, prompt_len=4, error="HTTP 500")]
    summary = serving.summarize(results, duration=2.0)
    assert summary["completed"] == 1 and summary["failed"] == 1 and summary["errors"] == ["HTTP 500"]
    assert summary["output_tok_s"] == pytest.approx(2.5)
    assert summary["tpot_ms"]["p50"] == pytest.approx(100.0) and summary["itl_ms"]["p99"] == pytest.approx(100.0)


def test_a_stream_with_tokens_but_no_text_counts_without_a_ttft():
    """A random-weight model can emit only tokens that decode to nothing: the request completed."""
    results = [serving.RequestResult(ok=True, prompt_len=4, output_tokens=5, ttft=0.2, latency=0.6),
               serving.RequestResult(ok=True, prompt_len=4, output_tokens=3, ttft=None, latency=0.4)]
    summary = serving.summarize(results, duration=1.0)
    assert summary["completed"] == 2 and summary["failed"] == 0 and summary["output_tok_s"] == pytest.approx(8.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0) and summary["tpot_ms"]["mean"] == pytest.approx(100.0)


def test_each_ratio_divides_by_the_bare_runs_that_alternated_with_it():
    def measured(served, bare, interval):
        stats = {"mean": 1.0, "p50": 1.0, "p99": 1.0}
        return {"completed": 3, "failed": 0, "request_throughput": 1.0, "output_tok_s": served, "ttft_ms": stats,
                "tpot_ms": stats, "itl_ms": stats, "runs_tok_s": [served] * 3, "bare_runs_tok_s": bare,
                "stream_interval": interval}

    report = {"machine": "m", "workload": {"stream_interval": 1}, "rates": {"inf": measured(80.0, [90, 100, 130], 1)},
              "grouped": measured(90.0, [120, 100, 95], 8), "offline": {"idle_ttft_p50_ms": 10.0},
              "idle_ttft_ms": {"p50": 22.0}}
    serving.print_report(report)
    assert report["comparison"]["by_stream_interval"] == {1: pytest.approx(0.8), 8: pytest.approx(0.9)}
    assert report["comparison"]["added_p50_ttft_ms_idle"] == pytest.approx(12.0)


def test_benchmark_runs_against_a_live_stack(live_stack, tiny_model_dir, tmp_path):
    report = serving.main(["--base-url", live_stack.base_url, "--api-key", live_stack.api_key,
                           "--model-name", live_stack.model_name, "--model", tiny_model_dir, "--skip-offline",
                           "--num-requests", "4", "--prompt-len", "4", "8", "--output-len", "4", "8",
                           "--rates", "20,inf", "--out", str(tmp_path / "serving.json")])
    for rate in ("20.0", "inf"):
        summary = report["rates"][rate]
        assert summary["completed"] == 4 and summary["failed"] == 0
        assert summary["output_tok_s"] > 0 and summary["ttft_ms"]["p50"] > 0
    assert (tmp_path / "serving.json").exists()
