"""The flash reader and the fetcher over it: the bytes of each span, whichever way it reads (a C call per batch
or os.preadv from Python, direct I/O or not), in batches that never outgrow the planned buffer, and a clean
error for a file cut short."""

import numpy as np
import pytest

from lsparse.image.bundles import coalesce
from lsparse.kernels.native import compiler, read_shared
from lsparse.runtime.reader import ALIGN, FlashReader

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
    reader = FlashReader(path, workers=4, direct=direct, native=native, buffer_bytes=4 << 20)
    try:
        for _ in range(3):
            offsets = np.append(rng.integers(0, len(data) - 70000, 37), len(data) - 10)  # and the last, partial block
            lengths = np.append(rng.integers(1, 70000, 37), 10)
            buffer, at, transferred, _ = reader.read_into(offsets, lengths)
            for o, n, a in zip(offsets, lengths, at, strict=True):
                np.testing.assert_array_equal(buffer[a:a + n], data[o:o + n])
            assert transferred % ALIGN == 0 and transferred >= lengths.sum()
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
            reader.read_into(np.array([0, len(data) - 50]), np.array([100, 100]))
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
        _, at, transferred, _ = reader.read_into(np.array([], np.int64), np.array([], np.int64))
        assert len(at) == 0 and transferred == 0
    finally:
        reader.close()


def test_a_long_run_is_cut_to_fit_a_buffer():
    offsets, lengths, run = coalesce(np.arange(10), stride=1000, base=0, gap_bytes=0, max_bytes=3000)
    assert offsets.tolist() == [0, 3000, 6000, 9000] and lengths.tolist() == [3000, 3000, 3000, 1000]
    assert run.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]


def test_batches_fit_the_buffer_and_cut_only_where_allowed(data_file):
    reader = FlashReader(data_file[0], workers=2, buffer_bytes=3 * ALIGN)
    sizes = np.full(7, ALIGN)
    assert reader.batches(sizes) == [(0, 3), (3, 6), (6, 7)]
    cuts = np.array([True, False, True, False, True, False, True])
    assert reader.batches(sizes, cuts) == [(0, 2), (2, 4), (4, 7)]
    with pytest.raises(ValueError):
        reader.batches(np.array([4 * ALIGN]))
    offsets = np.arange(7) * 100_000
    transferred, _ = reader.read_all(offsets, np.full(7, 5000))
    blocks = sum(-(-(o + 5000) // ALIGN) - o // ALIGN for o in offsets.tolist())
    assert transferred == blocks * ALIGN and len(reader.buffer) == 3 * ALIGN
    reader.close()


@pytest.mark.parametrize("bundled", [True, False])
def test_fetched_bundles_are_the_files_bytes_through_a_small_buffer(data_file, bundled):
    """Bundles of 3 rows of 1000 bytes, 3072 apart; a buffer of 5 blocks forces many batches, cut at runs (or,
    rows read apart, at neurons)."""
    from lsparse.runtime.fetch import Fetcher
    path, data = data_file
    fetcher = Fetcher(path, stride=3072, row_bytes=1000, gap_bytes=8192, bundled=bundled, readers=4, direct=True,
                      buffer_bytes=5 * ALIGN, lookahead=False)
    positions = np.sort(np.random.default_rng(3).choice(900, 120, replace=False))
    region = 4096
    got = fetcher.read(region, positions, 2000)
    want = np.stack([data[region + p * 3072:region + p * 3072 + 2000] for p in positions])
    np.testing.assert_array_equal(got.rows, want)
    assert got.transferred >= 120 * 2000 and len(fetcher.reader.buffer) == 5 * ALIGN
    fetcher.close()



def resident_pages(path) -> int:
    """Pages of a file in the page cache, by mincore(2) over a mapping of it (Linux)."""
    import ctypes
    import mmap
    import os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        assert libc.mincore(address, size, vec) == 0
        libc.munmap(address, size)
        return sum(v & 1 for v in vec)
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(__import__("os"), "posix_fadvise"), reason="Linux: posix_fadvise and mincore")
def test_a_file_just_written_is_read_from_the_device_after_its_pages_are_dropped(tmp_path):
    """The device is measured on files just written (an image after compile): their pages are in RAM until
    dropped. On macOS the same call drops them with msync(MS_INVALIDATE), whose call is exercised here."""
    import os

    from lsparse.runtime.device import _msync_invalidate, drop_cached_pages
    path = tmp_path / "file"
    path.write_bytes(os.urandom(8 << 20))
    assert resident_pages(path) > 1000
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _msync_invalidate(fd, 8 << 20) == "msync(MS_INVALIDATE)"
        assert drop_cached_pages(fd, 8 << 20) == "posix_fadvise(DONTNEED)"
    finally:
        os.close(fd)
    assert resident_pages(path) == 0
