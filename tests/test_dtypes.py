"""The dtype table and its bit-exact conversions."""

import numpy as np
import pytest
import torch

from vd.dtypes import DTYPES, int_bits, of_storage, of_torch, parse_dtype, to_float, to_storage, to_tensor
from vd.errors import UsageError


def test_bf16_storage_is_bit_exact():
    t = torch.tensor([[1.5, -0.0, float("inf"), 3.140625, float("nan")]], dtype=torch.bfloat16)
    bits = to_storage(t)
    assert bits.dtype == np.uint16 and np.array_equal(bits, t.view(torch.int16).numpy().view(np.uint16))
    assert torch.equal(to_tensor(bits).view(torch.int16), t.view(torch.int16))
    np.testing.assert_array_equal(to_float(bits, "bfloat16"), t.float().numpy())


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_dtype_round_trips_and_compares_by_bits(name):
    d = DTYPES[name]
    t = torch.randn(3, 5).to(d.torch)
    a = to_storage(t)
    assert a.dtype == d.storage and of_storage(a) is d is of_torch(d.torch) and parse_dtype(name) is d
    assert torch.equal(to_tensor(a), t) and int_bits(a).dtype.itemsize == d.storage.itemsize


def test_dtype_names_and_aliases():
    assert parse_dtype("bf16").name == "bfloat16" and parse_dtype("fp32").torch is torch.float32
    with pytest.raises(UsageError, match="unknown dtype 'int8'"):
        parse_dtype("int8")
