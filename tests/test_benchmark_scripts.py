"""The benchmarks' own parts: one engine run in its own process, missing peers, the summary row, the mask
walk, and short runs of the scripts."""

import json

import pytest

from benchmarks import peers, run_all


def test_an_engine_run_reports_every_requested_token_and_batch_one_figures(tiny_model_dir, tmp_path):
    work = {"requests": [[[5, 6, 7, 8, 9], 6], [[10, 11, 12], 3], [[13] * 40, 9]], "single_prompt": list(range(20, 60))}
    workload = tmp_path / "work.json"
    workload.write_text(json.dumps(work))
    result = peers.run_offline("tessera", str(tiny_model_dir), "float32", str(workload))
    assert result["tokens"] == 6 + 3 + 9  # ignore_eos: every request runs to its own length
    assert result["tok_s"] > 0 and result["ttft_ms"] > 0 and result["tpot_ms"] > 0
    assert 0 < result["kv_fill_at_peak"] <= 1 and 0 < result["kv_blocks_used_at_peak"] <= 1


def test_a_missing_peer_is_skipped_with_how_to_get_it(monkeypatch, capsys):
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    monkeypatch.setenv("LLAMA_SERVER", "/nonexistent/llama-server")
    assert peers.available_engines(["tessera", "vllm", "llama.cpp"]) == ["tessera"]
    out = capsys.readouterr().out
    assert "vllm-cpu.sh" in out and "llama-cpp.sh" in out


def test_make_bench_gives_each_section_the_options_after_its_name():
    argv = ["fairness", "--engine", "--rounds", "3", "spec", "gguf", "--weights", "packed"]
    assert run_all.parse_sections(argv) == {
        "fairness": ["--engine", "--rounds", "3"],
        "spec": [],
        "gguf": ["--weights", "packed"],
    }
    assert list(run_all.parse_sections([])) == run_all.SECTIONS
    with pytest.raises(ValueError, match="unknown section '--engine'"):
        run_all.parse_sections(["--engine", "fairness"])
    assert run_all.main(["nonsense"]) == 2


def test_the_summary_row_pairs_runs_of_one_repeat():
    runs = {
        "tessera": [
            {"tok_s": 120.0, "ttft_ms": 10.0, "tpot_ms": 5.0, "kv_fill_at_peak": 0.98, "kv_blocks_used_at_peak": 0.5},
            {"tok_s": 150.0, "ttft_ms": 12.0, "tpot_ms": 4.0, "kv_fill_at_peak": 0.99, "kv_blocks_used_at_peak": 0.5},
        ],
        "vllm": [
            {"tok_s": 100.0, "ttft_ms": 20.0, "tpot_ms": 9.0, "vllm_kv_blocks_used_at_peak": 0.4},
            {"tok_s": 100.0, "ttft_ms": 20.0, "tpot_ms": 9.0, "vllm_kv_blocks_used_at_peak": 0.4},
        ],
    }
    row = peers.summary_row("m", "float32", runs)
    assert row[2] == 135.0 and row[3] == 100.0  # medians
    assert row[5] == 1.35 and row[6] == "1.20-1.50"  # ratio per repeat, then median and spread
    assert row[11] == 9.0 / 4.5  # batch-1: vLLM's TPOT over ours
    assert row[-3:] == ["98.5%", "50.0%", "40.0%"]


def test_the_grammar_bench_walks_constrained_rows_and_reports_each_batch():
    from benchmarks import grammar

    table = grammar.main(["--batches", "1,3", "--steps", "5"])
    lines = [line for line in table.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(lines) == 2


def test_the_gguf_bench_loads_the_default_file_packed_and_reports_its_row():
    from benchmarks import gguf

    table = gguf.main(
        ["--models", "smollm2", "--weights", "packed", "--prompt", "16", "--decode", "4", "--repeats", "1"]
    )
    [row] = [line for line in table.splitlines() if line.startswith("| SmolLM2")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:3] == ["packed", "packed"]
    load_s, rss_mib, prompt_tok_s, decode_tok_s = (float(cell.replace(",", "")) for cell in cells[3:])
    assert load_s > 0 and rss_mib > 0 and prompt_tok_s > 0 and decode_tok_s > 0


def test_the_spec_bench_runs_every_workload_and_speculation_keeps_greedy_outputs_on_the_default_model():
    from benchmarks import spec

    speed, costs = [
        [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines() if "n-gram" in line]
        for table in spec.main(
            ["--pairs", "smollm2-ngram", "--batches", "1", "--prompts", "1", "--max-tokens", "24", "--repeats", "2"]
        ).split("### ")[1:]
    ]
    assert [row[1] for row in speed] == ["input-grounded", "code editing", "open chat"]
    for row in speed:
        assert float(row[3].replace(",", "")) > 0 and float(row[4].replace(",", "")) > 0
        assert row[-1] == "2/2"  # greedy tokens equal with and without speculation, at batch 1, in both repeats
    assert any(row[8] != "-" for row in speed)  # something was proposed and verified
    # the verification steps' cost beside a plain one, and a proposal's: what the speed-up a mean accepted
    # length buys rests on
    steps = [row for row in costs if row[1] != "1 proposed"]
    assert steps[0][1] == "1" and steps[0][3] == "1.00x"
    assert len(steps) > 1 and all(1 < int(row[1]) <= 6 for row in steps[1:])
    assert [row[1] for row in costs[len(steps) :]] == ["1 proposed"]  # the n-gram lookup's price, timed too
    assert all(float(row[2].replace(",", "")) > 0 for row in steps)


def test_the_llama3_8b_shape_file_is_written_once_and_served_packed_at_a_tiny_size(tmp_path):
    from benchmarks import gguf, llama8b_shape
    from benchmarks.llama8b_shape import LLAMA3_8B, Shape, tensor_bytes, tensor_shapes
    from inference import gguf_loader

    # the full shape's tensors: Llama-3-8B's 8.03B parameters, all at Q4_K's 4.5 bits
    assert sum(tensor_bytes(dims) for _, dims in tensor_shapes(LLAMA3_8B)) == 4_517_937_152
    shape = Shape(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=49152 + 128)
    path = llama8b_shape.ensure(tmp_path / "tiny.gguf", shape)
    assert llama8b_shape.ensure(path, shape).stat().st_mtime_ns == path.stat().st_mtime_ns  # reused, not rewritten
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("tiny")] == ["tiny.gguf"]  # no partial file left

    header = gguf_loader.open_gguf(str(path))
    assert {t.tensor_type.name for t in header.tensors if len(t.shape) == 2} == {"Q4_K"}
    assert {t.tensor_type.name for t in header.tensors if len(t.shape) == 1} == {"F32"}
    config = gguf_loader.config_dict(str(path))
    assert (config["vocab_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (49280, 2, 2)
    assert (config["head_dim"], config["rope_theta"], config["tie_word_embeddings"]) == (64, 500000.0, False)
    from gguf import GGUFReader

    tokens = GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 49280 and tokens[-1] == "<|reserved_special_token_127|>"

    result = gguf.measure(str(path), "packed", 8, 4)
    assert result["weights_dtype"] == "packed" and result["rss_mib"] > 0 and result["decode_tok_s"] > 0


def test_the_peak_rss_sampler_sums_the_whole_process_tree_of_an_engine():
    import subprocess
    import sys

    # a parent holding 100 MiB that starts a child holding 200 MiB (its own interpreter, no shared pages)
    child = "b = bytearray(200 << 20); import time; time.sleep(1.5)"
    parent = f"import subprocess, sys; b = bytearray(100 << 20); subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    with peers.PeakRss(proc.pid, interval=0.05) as rss:
        proc.wait()
    assert 300 <= rss.peak_mib < 400  # both processes, and nothing outside the session (this one holds torch)


@pytest.mark.parametrize("dtype,computes_in", [("packed", "float32"), ("packed-bfloat16", "bfloat16")])
def test_a_packed_run_loads_the_gguf_file_itself_and_reports_its_kv_pool(tmp_path, dtype, computes_in):
    from benchmarks.common import real_model_path

    models = peers.engine_models(dtype, ["tessera", "llama.cpp"], lambda: pytest.fail("no folder"), real_model_path)
    assert models == {"tessera": (real_model_path(), dtype)}  # vLLM alone needs the dequantized folder
    work = {"requests": [[[500, 501, 502, 503], 5], [[600] * 30, 3]], "single_prompt": list(range(700, 720))}
    workload = tmp_path / "work.json"
    workload.write_text(json.dumps(work))
    result = peers.run_offline("tessera", *models["tessera"], str(workload))
    assert result["tokens"] == 5 + 3 and result["tpot_ms"] > 0
    assert result["kv_pool_bytes"] > 0 and result["peak_rss_mib"] > 0 and result["dtype"] == computes_in
    row = peers.memory_row("smollm2", peers.dtype_label(dtype), {"tessera": [result]})
    assert row[1].endswith("(vLLM bfloat16)") and row[6] == result["peak_rss_mib"]
    assert row[9] == result["kv_pool_bytes"] / 2**20 and row[2] == row[-1] == "-"  # no llama.cpp run
