/* The pthread-pool backend of aio.h. One mutex per engine guards the queue and every request's
 * counters; the I/O syscalls themselves run unlocked. */
#define _GNU_SOURCE /* O_DIRECT, fallocate, mkstemp, fdatasync */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "aio.h"

#define MAX_WORKERS 256

struct fnz_aio_file {
    int fd;        /* buffered descriptor: always open */
    int fd_direct; /* O_DIRECT descriptor, or -1 */
};

struct fnz_aio_req {
    fnz_aio_file *file;
    int write;
    char *buf;
    int64_t nbytes, offset;
    int64_t nchunks, next_chunk, done_chunks; /* chunks handed out / finished */
    int64_t bytes;                            /* bytes transferred so far */
    int error;                                /* first -errno, or 0 */
    struct fnz_aio_req *qnext;                /* queue of requests with chunks left */
    struct fnz_aio_req *lnext, *lprev;        /* all live requests, freed by wait/destroy */
};

struct fnz_aio {
    pthread_mutex_t mu;
    pthread_cond_t work; /* a chunk was queued, or stop */
    pthread_cond_t done; /* a request finished */
    fnz_aio_req *qhead, *qtail;
    fnz_aio_req *live;
    int64_t block;
    int stop, nworkers;
    pthread_t workers[MAX_WORKERS];
};

static int aligned(const void *p, int64_t off, int64_t len) {
    return ((uintptr_t)p % FNZ_AIO_ALIGN) == 0 && off % FNZ_AIO_ALIGN == 0 && len % FNZ_AIO_ALIGN == 0;
}

/* One chunk, all of it: loop over short transfers and EINTR. Returns bytes done or -errno;
 * a read stops early at end of file. */
static int64_t do_chunk(const fnz_aio_file *f, int write, char *buf, int64_t len, int64_t off) {
    int fd = (f->fd_direct >= 0 && aligned(buf, off, len)) ? f->fd_direct : f->fd;
    int64_t done = 0;
    while (done < len) {
        ssize_t r = write ? pwrite(fd, buf + done, (size_t)(len - done), (off_t)(off + done))
                          : pread(fd, buf + done, (size_t)(len - done), (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) break; /* end of file */
        done += r;
        /* A short O_DIRECT transfer leaves the rest unaligned: finish it buffered. */
        if (done < len && fd == f->fd_direct) fd = f->fd;
    }
    return done;
}

static void *worker_main(void *arg) {
    fnz_aio *a = arg;
    pthread_mutex_lock(&a->mu);
    for (;;) {
        while (!a->qhead && !a->stop) pthread_cond_wait(&a->work, &a->mu);
        if (!a->qhead) break; /* stop, and nothing left */
        fnz_aio_req *r = a->qhead;
        int64_t k = r->next_chunk++;
        if (r->next_chunk == r->nchunks) { /* last chunk handed out: dequeue */
            a->qhead = r->qnext;
            if (!a->qhead) a->qtail = NULL;
        }
        pthread_mutex_unlock(&a->mu);
        int64_t off = k * a->block;
        int64_t len = r->nbytes - off < a->block ? r->nbytes - off : a->block;
        int64_t got = do_chunk(r->file, r->write, r->buf + off, len, r->offset + off);
        pthread_mutex_lock(&a->mu);
        if (got < 0 && !r->error) r->error = (int)got;
        if (got > 0) r->bytes += got;
        if (++r->done_chunks == r->nchunks) pthread_cond_broadcast(&a->done);
    }
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

fnz_aio *fnz_aio_create(int64_t block_size, int queue_depth, int thread_count, int *err) {
    *err = 0;
    if (block_size < 1 || queue_depth < 1 || thread_count < 1) {
        *err = -EINVAL;
        return NULL;
    }
    fnz_aio *a = calloc(1, sizeof *a);
    if (!a) {
        *err = -ENOMEM;
        return NULL;
    }
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->work, NULL);
    pthread_cond_init(&a->done, NULL);
    a->block = (block_size + FNZ_AIO_ALIGN - 1) / FNZ_AIO_ALIGN * FNZ_AIO_ALIGN;
    int64_t want = (int64_t)queue_depth * thread_count;
    if (want > MAX_WORKERS) want = MAX_WORKERS;
    for (int64_t i = 0; i < want; i++) {
        if (pthread_create(&a->workers[a->nworkers], NULL, worker_main, a) != 0) break;
        a->nworkers++;
    }
    if (a->nworkers == 0) {
        *err = -EAGAIN;
        fnz_aio_destroy(a);
        return NULL;
    }
    return a;
}

int fnz_aio_workers(const fnz_aio *a) { return a->nworkers; }

void fnz_aio_destroy(fnz_aio *a) {
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    a->stop = 1; /* workers drain the queue before they see it */
    pthread_cond_broadcast(&a->work);
    pthread_mutex_unlock(&a->mu);
    for (int i = 0; i < a->nworkers; i++) pthread_join(a->workers[i], NULL);
    while (a->live) {
        fnz_aio_req *r = a->live;
        a->live = r->lnext;
        free(r);
    }
    pthread_cond_destroy(&a->done);
    pthread_cond_destroy(&a->work);
    pthread_mutex_destroy(&a->mu);
    free(a);
}

fnz_aio_file *fnz_aio_open(const char *path, int flags, int *err) {
    int rw = flags & (FNZ_AIO_READ | FNZ_AIO_WRITE);
    int mode = rw == (FNZ_AIO_READ | FNZ_AIO_WRITE) ? O_RDWR : (rw == FNZ_AIO_WRITE ? O_WRONLY : O_RDONLY);
    *err = 0;
    if (!rw) {
        *err = -EINVAL;
        return NULL;
    }
    int extra = (flags & FNZ_AIO_CREATE ? O_CREAT : 0) | (flags & FNZ_AIO_TRUNC ? O_TRUNC : 0);
    fnz_aio_file *f = malloc(sizeof *f);
    if (!f) {
        *err = -ENOMEM;
        return NULL;
    }
    f->fd = open(path, mode | extra | O_CLOEXEC, 0644);
    if (f->fd < 0) {
        *err = -errno;
        free(f);
        return NULL;
    }
    f->fd_direct = -1;
#ifdef O_DIRECT
    if (flags & FNZ_AIO_DIRECT) f->fd_direct = open(path, mode | O_DIRECT | O_CLOEXEC); /* -1: refused */
#endif
    return f;
}

int fnz_aio_is_direct(const fnz_aio_file *f) { return f->fd_direct >= 0; }

int64_t fnz_aio_size(const fnz_aio_file *f) {
    struct stat st;
    return fstat(f->fd, &st) == 0 ? (int64_t)st.st_size : -errno;
}

int fnz_aio_preallocate(fnz_aio_file *f, int64_t size) {
    if (size < 0) return -EINVAL;
    int64_t cur = fnz_aio_size(f);
    if (cur < 0) return (int)cur;
    if (size <= cur) return 0;
#ifdef __linux__
    if (fallocate(f->fd, 0, 0, (off_t)size) == 0) return 0;
    if (errno != EOPNOTSUPP && errno != ENOSYS && errno != EINVAL) return -errno;
#endif
    return ftruncate(f->fd, (off_t)size) == 0 ? 1 : -errno;
}

int fnz_aio_sync(fnz_aio_file *f) { return fdatasync(f->fd) == 0 ? 0 : -errno; }

int fnz_aio_close(fnz_aio_file *f) {
    if (!f) return 0;
    int rc = 0;
    if (f->fd_direct >= 0 && close(f->fd_direct) != 0) rc = -errno;
    if (close(f->fd) != 0 && !rc) rc = -errno;
    free(f);
    return rc;
}

fnz_aio_req *fnz_aio_submit(fnz_aio *a, fnz_aio_file *f, int write, void *buf, int64_t nbytes,
                            int64_t offset, int *err) {
    *err = 0;
    if (!a || !f || nbytes < 0 || offset < 0 || (nbytes > 0 && !buf)) {
        *err = -EINVAL;
        return NULL;
    }
    fnz_aio_req *r = calloc(1, sizeof *r);
    if (!r) {
        *err = -ENOMEM;
        return NULL;
    }
    r->file = f;
    r->write = write != 0;
    r->buf = buf;
    r->nbytes = nbytes;
    r->offset = offset;
    r->nchunks = (nbytes + a->block - 1) / a->block;
    pthread_mutex_lock(&a->mu);
    r->lnext = a->live;
    if (a->live) a->live->lprev = r;
    a->live = r;
    if (r->nchunks > 0) { /* an empty request is complete at once */
        if (a->qtail) a->qtail->qnext = r;
        else a->qhead = r;
        a->qtail = r;
        pthread_cond_broadcast(&a->work);
    }
    pthread_mutex_unlock(&a->mu);
    return r;
}

int fnz_aio_done(fnz_aio *a, const fnz_aio_req *r) {
    pthread_mutex_lock(&a->mu);
    int d = r->done_chunks == r->nchunks;
    pthread_mutex_unlock(&a->mu);
    return d;
}

int64_t fnz_aio_wait(fnz_aio *a, fnz_aio_req *r) {
    pthread_mutex_lock(&a->mu);
    while (r->done_chunks < r->nchunks) pthread_cond_wait(&a->done, &a->mu);
    if (r->lprev) r->lprev->lnext = r->lnext;
    else a->live = r->lnext;
    if (r->lnext) r->lnext->lprev = r->lprev;
    pthread_mutex_unlock(&a->mu);
    int64_t result = r->error ? r->error : r->bytes;
    free(r);
    return result;
}

int fnz_aio_direct_supported(const char *dir) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/.fnzero-odirect-XXXXXX", dir) >= (int)sizeof path) return -ENAMETOOLONG;
    int fd = mkstemp(path);
    if (fd < 0) return -errno;
    int ok = 0;
#ifdef O_DIRECT
    int dfd = open(path, O_RDWR | O_DIRECT | O_CLOEXEC);
    if (dfd >= 0) { /* some file systems accept the flag and refuse the I/O: try one block */
        void *buf = NULL;
        if (posix_memalign(&buf, FNZ_AIO_ALIGN, FNZ_AIO_ALIGN) == 0) {
            memset(buf, 0, FNZ_AIO_ALIGN);
            ok = pwrite(dfd, buf, FNZ_AIO_ALIGN, 0) == FNZ_AIO_ALIGN;
            free(buf);
        }
        close(dfd);
    }
#endif
    close(fd);
    unlink(path);
    return ok;
}
