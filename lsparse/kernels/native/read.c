// The flash reader's direct reads, a whole call's worth from each reader thread in one C call. From Python
// each preadv costs a few microseconds of interpreter time under the GIL, which sixteen threads share on two
// cores: at 4 KiB that capped the reader at about 77% of fio. ctypes drops the GIL for the whole call, and
// the threads take the next read from a shared counter rather than a fixed share, so that none sits idle
// while another still has a queue: the call ends one read's time after the last read is issued.
// Built with the gathered products by lsparse/kernels/native.py.
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <sys/uio.h>
#include <unistd.h>

// Read sizes[i] bytes at file offset starts[i] into buffer + at[i], for the i each thread takes from *next,
// until all n are taken or one failed. *failed is left as -1 when every read brought at least needed[i]
// bytes; else the first failure seen: the index of a read that came back short (a truncated file), or
// -2 - errno for a read that failed.
void lsparse_read_shared(int fd, uint8_t* buffer, const int64_t* starts, const int64_t* sizes,
                         const int64_t* at, const int64_t* needed, int64_t n, int64_t* next, int64_t* failed) {
    for (;;) {
        int64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (i >= n || __atomic_load_n(failed, __ATOMIC_RELAXED) != -1) return;
        struct iovec span = {buffer + at[i], (size_t)sizes[i]};
        ssize_t got;
        do {
            got = preadv(fd, &span, 1, (off_t)starts[i]);
        } while (got < 0 && errno == EINTR);
        int64_t code = got < 0 ? -2 - errno : got < needed[i] ? i : -1;
        int64_t none = -1;
        if (code != -1) __atomic_compare_exchange_n(failed, &none, code, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
}
