"""The format's pure parts: byte planes, chunking, and where each row of a K is stored."""

import numpy as np
import pytest

from vd.dtypes import DTYPES
from vd.layout import RowLayout
from vd.store import format as F


@pytest.mark.parametrize("name", list(DTYPES))
def test_byte_planes_split_and_join_bit_for_bit(name):
    storage = DTYPES[name].storage
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (3, 4, 37 * storage.itemsize), dtype=np.uint8).view(storage)  # every bit pattern kind
    hi, lo = F.split_planes(a)
    assert hi.shape == a.shape and hi.dtype == np.uint8 and lo.shape == (*a.shape, storage.itemsize - 1)
    # The high plane is each value's most significant byte: sign and exponent.
    assert np.array_equal(hi, (a.view(f"<u{storage.itemsize}") >> (8 * storage.itemsize - 8)).astype(np.uint8))
    back = F.join_planes(hi, lo, storage)
    assert back.dtype == storage and np.array_equal(back.view(np.uint8), a.view(np.uint8))


def test_prefill_rows_are_chunked_about_eight_megabytes_and_evenly():
    assert F.prefill_chunks(41, 151936, 2) == 21 and F.prefill_chunks(41, 128256, 2) == 21
    assert F.prefill_chunks(66, 49152, 2) == 66 and F.prefill_chunks(3, 1 << 22, 4) == 1
    # At most 85 rows of a 49152-wide bf16 vocabulary fit: 100 rows go 50 to a chunk, not 85 and 15.
    assert F.prefill_chunks(100, 49152, 2) == 50 and F.prefill_chunks(86, 49152, 2) == 43


@pytest.mark.parametrize("drafted", [False, True])
def test_every_row_has_one_address_inside_its_array(drafted):
    layout = RowLayout(prompt=5, steps=4, k=3, drafted=drafted)
    shapes = F.row_shapes(layout, 10)
    seen = set()
    for kind, n in layout.counts.items():
        for i in range(n):
            name, a0, within = F.row_address(layout, kind, i)
            assert name in F.ROW_ARRAYS[kind] and 0 <= a0 < shapes[name][0]
            assert (within is None) == (len(shapes[name]) == 2) and (within is None or within < shapes[name][1])
            seen.add((name, a0, within))
    assert len(seen) == layout.total  # no two rows share a place
    assert F.row_address(layout, "verify", 7) == ("logits", 2, 1)
    if drafted:
        assert F.row_address(layout, "draft", 0) == ("bootstrap_logits", 0, None)
        assert F.row_address(layout, "draft", 4) == ("draft_logits", 1, 1)


def test_digest_scheme_needs_a_width_and_a_known_dtype():
    assert F.digest_meta(512, "bfloat16")["words"] == 512 and F.digest_meta(512, "float32")["words"] == 1024
    assert F.digest_meta(None, "bfloat16") is None and F.digest_meta(512, "int8") is None
    assert F.digest_meta(True, "bfloat16") is None and F.digest_meta(0, "bfloat16") is None
