"""The real key embedder and the actor's tokenizer, from the packages that ship them (integration tier)."""

import numpy as np
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def minilm():
    from palimpsest.models.embedder import MiniLMEmbedder

    return MiniLMEmbedder(max_tokens=128, batch_size=4)


def test_minilm_gives_normalised_384d_vectors_that_rank_by_meaning(minilm):
    v = minilm.embed(["parse_config raises KeyError for database_url",
                      "the config parser fails with a missing key error", "sunny weather with light wind", ""])
    assert v.shape == (4, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v[:3], axis=1), 1.0, atol=1e-5) and not v[3].any()
    assert v[0] @ v[1] > v[0] @ v[2] + 0.2
    assert minilm.name == "all-MiniLM-L6-v2@128"


def test_minilm_batches_give_the_same_vectors_as_single_calls(minilm):
    texts = [f"step {i}: grep -n parse_config_{i} settings/mod_{i}.py " * (i + 1) for i in range(7)]
    batched = minilm.embed(texts)
    single = np.stack([minilm.embed([t])[0] for t in texts])
    assert np.allclose(batched, single, atol=1e-4)


def test_smollm2_tokenizer_is_extracted_offline_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PALIMPSEST_CACHE", str(tmp_path))
    from palimpsest.models.assets import smollm2_tokenizer_dir
    from palimpsest.platform.prompt.tokens import HFTokenizer

    path = smollm2_tokenizer_dir()
    assert (path / "tokenizer.json").is_file() and smollm2_tokenizer_dir() == path
    tok = HFTokenizer(path)
    assert tok.count("def parse_config(env):") > 3 and tok.count_batch(["a b", ""]) == [2, 0]
