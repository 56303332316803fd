"""lm-evaluation-harness works unchanged against Tessera: its `local-completions` model (echo + prompt
logprobs on /v1/completions, the remote tokenizer found through /tokenizer_info and /tokenize) gives the
same loglikelihoods as its `hf` backend on the same model, on a small local multiple-choice task: the
tiny random model of the shared live stack, and the real default model (SmolLM2-135M-Instruct GGUF)."""

from __future__ import annotations

import json

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

DOCS = [
    {"question": "the cat sat on the", "choices": [" mat", " dog", " park and the sun"], "answer": 0},
    {"question": "the dog ran in the", "choices": [" park", " cat sat", " house"], "answer": 0},
    {"question": "a small bird sang", "choices": [" in the tree", " on the mat", " loudly"], "answer": 2},
    {"question": "she opened the door and", "choices": [" the cat", " walked in", " ran"], "answer": 1},
]
TASK = "tessera_tiny_mc"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A local task (nothing can be downloaded): a JSON lines file and its lm-eval task YAML."""
    folder = tmp_path_factory.mktemp("lm-eval-task")
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    return folder


def loglikelihoods(model: str, model_args: str, task_dir) -> list[float]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        log_samples=True,
        task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=1,
    )
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return [float(resp[0][0]) for sample in samples for resp in sample["resps"]]


def served_loglikelihoods(stack, model_name: str, task_dir, monkeypatch) -> list[float]:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("OPENAI_API_KEY", stack.api_key)  # what local-completions sends as its bearer key
    return loglikelihoods(
        "local-completions",
        f"model={model_name},base_url={stack.base_url}/v1/completions,"
        f"auth_token={stack.api_key},num_concurrent=1,max_retries=1,tokenized_requests=True",
        task_dir,
    )


def test_local_completions_loglikelihoods_equal_the_hf_backend(live_stack, tiny_model_dir, task_dir, monkeypatch):
    served = served_loglikelihoods(live_stack, live_stack.model_name, task_dir, monkeypatch)
    # lm-eval's remote tokenizer (as against vLLM) encodes with add_special_tokens=False; its hf backend
    # would let this tokenizer prepend <|bos|>, so it is told not to: both then score the same tokens.
    reference = loglikelihoods(
        "hf", f"pretrained={tiny_model_dir},dtype=float32,device=cpu,add_bos_token=False", task_dir
    )
    assert len(served) == len(reference) == sum(len(doc["choices"]) for doc in DOCS)
    assert served == pytest.approx(reference, abs=1e-3)
    assert len(set(round(x, 3) for x in served)) > 1  # real, distinct loglikelihoods, not a constant


def test_on_the_real_default_model_too(tmp_path_factory, task_dir, monkeypatch):
    """SmolLM2's tokenizer adds no BOS, so the hf backend runs with its defaults here."""
    from inference.gguf_files import bundled_model
    from tests.platform.live_stack import real_model_stack

    with real_model_stack(tmp_path_factory, "real-stack", {"max_model_len": 512, "num_kv_blocks": 64}) as stack:
        served = served_loglikelihoods(stack, "SmolLM2-135M-Instruct", task_dir, monkeypatch)
    file = bundled_model()
    reference = loglikelihoods(
        "hf", f"pretrained={file.parent},gguf_file={file.name},dtype=float32,device=cpu", task_dir
    )
    assert len(served) == len(reference) == sum(len(doc["choices"]) for doc in DOCS)
    assert served == pytest.approx(reference, abs=1e-3)
