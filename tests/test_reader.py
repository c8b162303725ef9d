"""The flash reader: the bytes of each span, whichever way it reads (a C call per batch or os.preadv from
Python, direct I/O or not), and a clean error for a file cut short."""

import numpy as np
import pytest

from lsparse.kernels.native import compiler, read_shared
from lsparse.runtime.reader import ALIGN, FlashReader, coalesce

WAYS = [(True, True), (True, False), (False, True), (False, False)]  # (native, direct)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader") / "neurons.bin"
    data = np.random.default_rng(0).integers(0, 256, 3 * (1 << 20) + 1234, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return path, data


def test_the_native_batch_is_built_where_a_compiler_is():
    assert read_shared() is not None or compiler() is None


@pytest.mark.parametrize("native,direct", WAYS)
def test_reads_return_the_bytes_of_each_span(data_file, native, direct):
    path, data = data_file
    if native and read_shared() is None:
        pytest.skip("no C compiler here: the reader's native batch cannot be built")
    rng = np.random.default_rng(1)
    reader = FlashReader(path, workers=4, direct=direct, native=native)
    try:
        for _ in range(3):
            offsets = rng.integers(0, len(data) - 70000, 37)
            lengths = rng.integers(1, 70000, 37)
            spans = [(int(o), int(n)) for o, n in zip(offsets, lengths, strict=True)]
            spans.append((len(data) - 10, 10))  # the file's last, partial block
            views, transferred, _ = reader.read(spans)
            for (o, n), view in zip(spans, views, strict=True):
                np.testing.assert_array_equal(view, data[o:o + n])
            assert transferred % ALIGN == 0 and transferred >= sum(n for _, n in spans)
    finally:
        reader.close()


@pytest.mark.parametrize("native,direct", WAYS)
def test_a_span_past_the_end_is_a_short_read(data_file, native, direct):
    path, data = data_file
    if native and read_shared() is None:
        pytest.skip("no C compiler here: the reader's native batch cannot be built")
    reader = FlashReader(path, workers=2, direct=direct, native=native)
    try:
        with pytest.raises(OSError, match="short read at byte .*truncated"):
            reader.read([(0, 100), (len(data) - 50, 100)])
    finally:
        reader.close()


def test_coalesce_reads_through_small_gaps_only():
    offsets, lengths, run = coalesce(np.array([0, 1, 3, 9, 40]), stride=1000, base=64, gap_bytes=2000)
    assert offsets.tolist() == [64, 9064, 40064] and lengths.tolist() == [4000, 1000, 1000]
    assert run.tolist() == [0, 0, 0, 1, 2]
    assert [len(a) for a in coalesce(np.array([], dtype=np.int64), 1000, 64, 2000)] == [0, 0, 0]


@pytest.mark.parametrize("native,direct", WAYS[::3])
def test_no_spans_reads_nothing(data_file, native, direct):
    reader = FlashReader(data_file[0], workers=4, direct=direct, native=native and read_shared() is not None)
    try:
        views, transferred, _ = reader.read([])
        assert views == [] and transferred == 0
    finally:
        reader.close()
