"""benchmarks/serving_peers.py's own parts: servers alternate in every repeat, and the table's figures."""

import contextlib

import pytest

from benchmarks import serving_peers


def _measured(tok_s: float, ttft: float, itl: float, failed: int = 0) -> dict:
    stats = lambda p50: {"mean": p50, "p50": p50, "p99": p50}  # noqa: E731
    return {"output_tok_s": tok_s, "ttft_ms": stats(ttft), "itl_ms": stats(itl), "failed": failed}


def test_servers_start_afresh_and_alternate_in_every_repeat(monkeypatch):
    order = []

    def server(name):
        @contextlib.contextmanager
        def running():
            order.append(f"start {name}")
            yield f"http://{name}", "key", "model", {}
            order.append(f"stop {name}")

        return running

    def measure_rates(base_url, api_key, model, work, rates, seed, pids):
        order.append(f"measure {base_url}")
        return {str(rate): _measured(1.0, 1.0, 1.0) for rate in rates}

    monkeypatch.setattr(serving_peers, "measure_rates", measure_rates)
    runs = serving_peers.measure({"tessera": server("tessera"), "vllm": server("vllm")}, "float32", [], [1.0], 2)
    assert (
        order
        == ["start tessera", "measure http://tessera", "stop tessera", "start vllm", "measure http://vllm", "stop vllm"]
        * 2
    )
    assert len(runs["tessera"]) == len(runs["vllm"]) == 2


def test_the_row_takes_medians_and_pairs_the_ratio_by_repeat():
    runs = {
        "tessera": [{"inf": _measured(100.0, 30.0, 5.0)}, {"inf": _measured(120.0, 50.0, 7.0, failed=1)}],
        "vllm": [{"inf": _measured(50.0, 20.0, 6.0)}, {"inf": _measured(120.0, 40.0, 8.0)}],
    }
    [row] = serving_peers.rows_for("bfloat16", [float("inf")], runs)
    assert row[:4] == ["bfloat16", "inf", pytest.approx(110.0), pytest.approx(85.0)]
    assert row[4] == pytest.approx(1.5) and row[5] == "1.00-2.00"  # median of 2.0 and 1.0, not 110 / 85
    assert row[6:] == [pytest.approx(40.0), pytest.approx(30.0), pytest.approx(6.0), pytest.approx(7.0), 1]


def test_without_vllm_the_row_has_tessera_alone():
    [row] = serving_peers.rows_for("float32", [4.0], {"tessera": [{"4.0": _measured(10.0, 3.0, 1.0)}]})
    assert row == [
        "float32",
        "4",
        pytest.approx(10.0),
        "-",
        "-",
        "-",
        pytest.approx(3.0),
        "-",
        pytest.approx(1.0),
        "-",
        0,
    ]


def test_tessera_serves_with_its_engine_defaults_not_the_test_stacks():
    args = serving_peers.tessera_engine_args("bfloat16")
    assert args["dtype"] == "bfloat16" and args["max_model_len"] == 1024 and args["enable_prefix_caching"] is False
    assert args["max_num_seqs"] == 256 and args["num_kv_blocks"] is None and "model" not in args
