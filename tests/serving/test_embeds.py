"""Every embeds tensor passes one validation function: shape, hidden size, dtype, finite, length, dense,
weights-only loading."""

import base64
import io
import os

import pytest
import torch

from palimpsest.serving.models.embeds import EmbedsError, decode_embeds, encode_embeds, validate_embeds


def test_accepts_a_dense_finite_float_matrix_and_squeezes_a_batch_of_one():
    t = torch.randn(1, 5, 8)
    out = validate_embeds(t, hidden_size=8, max_len=16)
    assert out.shape == (5, 8)
    assert validate_embeds(torch.randn(3, 8, dtype=torch.bfloat16), 8, 16, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("bad, match", [
    (torch.randn(2, 3, 8), "2-D"),
    (torch.randn(8), "2-D"),
    (torch.randn(4, 7), "hidden size is 8"),
    (torch.ones(4, 8, dtype=torch.int64), "float32"),
    (torch.full((4, 8), float("nan")), "NaN"),
    (torch.tensor([[float("inf")] * 8]), "NaN or infinite"),
    (torch.randn(17, 8), "1..16"),
    (torch.zeros(0, 8), "1..16"),
    (torch.randn(4, 8).to_sparse(), "dense"),
    ([[0.0] * 8], "tensor"),
])
def test_refuses(bad, match):
    with pytest.raises(EmbedsError, match=match):
        validate_embeds(bad, hidden_size=8, max_len=16)


def test_round_trip_over_the_wire():
    t = torch.randn(6, 8)
    assert torch.equal(decode_embeds(encode_embeds(t), 8, 16), t)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_pickle_of_anything_but_tensors_is_refused_before_it_runs():
    buf = io.BytesIO()
    torch.save({"x": _Evil()}, buf)
    with pytest.raises(EmbedsError, match="could not be loaded"):
        decode_embeds(base64.b64encode(buf.getvalue()), 8, 16)


def test_garbage_and_non_base64_are_clear_errors():
    with pytest.raises(EmbedsError, match="base64"):
        decode_embeds("not base64 at all!", 8, 16)
    with pytest.raises(EmbedsError, match="could not be loaded"):
        decode_embeds(base64.b64encode(b"garbage bytes"), 8, 16)


def test_a_sparse_tensor_on_the_wire_is_refused():
    buf = io.BytesIO()
    torch.save(torch.randn(4, 8).to_sparse(), buf)
    with pytest.raises(EmbedsError):
        decode_embeds(base64.b64encode(buf.getvalue()), 8, 16)
