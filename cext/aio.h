/* fnzero asynchronous file I/O for ZeRO-Offload/Infinity: the ABI (see specs/cext.md).
 *
 * Backend: a pthread pool doing pread/pwrite. A request is cut into block_size chunks; the
 * pool has thread_count * queue_depth workers, so that many chunks are in flight at once,
 * which is what queue depth means to the device (each worker blocks in one syscall). Chosen
 * over io_uring / Linux AIO for needing nothing from the kernel beyond pread/pwrite (io_uring is
 * often disabled by seccomp or sysctl) and because it reaches fio's bandwidth here (see the
 * benchmark in specs/cext.md).
 *
 * No global state: an engine (fnz_aio) owns its threads and requests, a file (fnz_aio_file)
 * owns its descriptors, and the caller creates and destroys both.
 *
 * O_DIRECT: a file is opened twice when O_DIRECT is asked for and allowed: once with O_DIRECT,
 * once buffered. Each chunk whose buffer address, file offset and length are all multiples of
 * FNZ_AIO_ALIGN goes through the O_DIRECT descriptor, any other through the buffered one, so
 * unaligned requests work (slower) and aligned ones skip the page cache. Linux keeps the two
 * coherent (direct I/O writes back and invalidates cached pages in its range first).
 *
 * Errors are negative errno values.
 */
#ifndef FNZERO_AIO_H
#define FNZERO_AIO_H

#include <stdint.h>

#define FNZ_AIO_ALIGN 4096 /* alignment O_DIRECT chunks need (covers 512 and 4K sectors) */

/* fnz_aio_open flags (combine with |). */
#define FNZ_AIO_READ 1    /* open for reading */
#define FNZ_AIO_WRITE 2   /* open for writing */
#define FNZ_AIO_CREATE 4  /* create if missing (mode 0644) */
#define FNZ_AIO_TRUNC 8   /* truncate to 0 on open */
#define FNZ_AIO_DIRECT 16 /* also try O_DIRECT; silently buffered-only where not allowed */

typedef struct fnz_aio fnz_aio;           /* an engine: worker threads + request queue */
typedef struct fnz_aio_file fnz_aio_file; /* an open file: buffered fd + O_DIRECT fd or none */
typedef struct fnz_aio_req fnz_aio_req;   /* one submitted read or write */

/* Start an engine.
 * block_size: bytes per chunk (>= 1; rounded up to FNZ_AIO_ALIGN so aligned requests stay
 *   aligned chunk by chunk). queue_depth, thread_count: >= 1; workers = their product, capped
 *   at 256 (DeepSpeed aio config: queue_depth, thread_count / intra_op_parallelism).
 * err: receives 0 or -errno. Returns NULL on failure. */
fnz_aio *fnz_aio_create(int64_t block_size, int queue_depth, int thread_count, int *err);

/* Wait for every submitted request, stop and join the workers, free the engine and any
 * request not yet waited for. NULL is a no-op. */
void fnz_aio_destroy(fnz_aio *aio);

/* Number of worker threads actually running (some may have failed to start; >= 1). */
int fnz_aio_workers(const fnz_aio *aio);

/* Open `path` (NUL-terminated) with FNZ_AIO_* flags. err: 0 or -errno (e.g. -ENOENT).
 * Returns NULL on failure. */
fnz_aio_file *fnz_aio_open(const char *path, int flags, int *err);

/* 1 if the file has an O_DIRECT descriptor, else 0. */
int fnz_aio_is_direct(const fnz_aio_file *f);

/* Current size in bytes, or -errno. */
int64_t fnz_aio_size(const fnz_aio_file *f);

/* Make the file at least `size` bytes with blocks allocated: fallocate(2) (returns 0), or
 * ftruncate when the file system cannot (returns 1: a sparse file; writes will allocate).
 * Never shrinks. Preallocating matters: extending O_DIRECT writes cost ~8x overwrites on ext4. */
int fnz_aio_preallocate(fnz_aio_file *f, int64_t size);

/* fdatasync the file; 0 or -errno. */
int fnz_aio_sync(fnz_aio_file *f);

/* Close and free. The caller must first wait for every request on this file. 0 or -errno. */
int fnz_aio_close(fnz_aio_file *f);

/* Queue a read (write = 0) or write (write = 1) of nbytes between buf and the file at
 * `offset`. buf must stay valid and untouched until fnz_aio_wait returns for the request.
 * err: 0 or -errno. Returns the request, or NULL on failure (nothing queued). */
fnz_aio_req *fnz_aio_submit(fnz_aio *aio, fnz_aio_file *f, int write, void *buf,
                            int64_t nbytes, int64_t offset, int *err);

/* 1 if the request has completed (wait will not block), else 0. */
int fnz_aio_done(fnz_aio *aio, const fnz_aio_req *req);

/* Block until the request completes, free it, and return the bytes transferred: nbytes, or
 * fewer for a read past the end of the file, or -errno (the first error of any chunk).
 * The request pointer is invalid afterwards. */
int64_t fnz_aio_wait(fnz_aio *aio, fnz_aio_req *req);

/* Probe whether O_DIRECT works in directory `dir`: 1 yes, 0 no (file system refuses it),
 * -errno if the probe file could not be created. Leaves nothing behind. */
int fnz_aio_direct_supported(const char *dir);

#endif
