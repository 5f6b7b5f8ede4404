/* The child's failure report and trace, written as the Python child writes them
 * (nsbox/sandbox/child.py: fail, send_trace), and the raw system calls the steps share. */
#define _GNU_SOURCE
#include "child.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

void text_init(struct text *t)
{
    t->n = 0;
    t->s[0] = '\0';
}

static void text_putn(struct text *t, const char *s, size_t len)
{
    if (len > TEXT_MAX - 1 - t->n)
        len = TEXT_MAX - 1 - t->n;
    memcpy(t->s + t->n, s, len);
    t->n += len;
    t->s[t->n] = '\0';
}

void text_put(struct text *t, const char *s)
{
    text_putn(t, s, strlen(s));
}

static void text_put_base(struct text *t, long long value, int base)
{
    char digits[32];
    int i = (int)sizeof(digits);
    unsigned long long v = value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value;
    do {
        digits[--i] = (char)('0' + v % (unsigned)base);
        v /= (unsigned)base;
    } while (v != 0);
    if (value < 0)
        digits[--i] = '-';
    text_putn(t, digits + i, sizeof(digits) - (size_t)i);
}

void text_put_int(struct text *t, long long value)
{
    text_put_base(t, value, 10);
}

void text_put_octal(struct text *t, long long value)
{
    text_put_base(t, value, 8);
}

/* A JSON string body: the plan's strings are valid UTF-8 (flatten checks), so only the quote,
 * the backslash and control characters need an escape (RFC 8259, section 7). */
static void text_put_json(struct text *t, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') {
            char esc[2] = {'\\', (char)ch};
            text_putn(t, esc, 2);
        } else if (ch < 0x20) {
            char esc[6] = {'\\', 'u', '0', '0', hex[ch >> 4], hex[ch & 15]};
            text_putn(t, esc, 6);
        } else {
            text_putn(t, s, 1);
        }
    }
}

static void write_all(int fd, const char *data, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return;
        data += n;
        len -= (size_t)n;
    }
}

static long long monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void set_step(struct child *c, const char *name)
{
    c->step = name;
    if (c->plan->trace && c->trace_n < TRACE_MAX) {
        c->trace_names[c->trace_n] = name;
        c->trace_ns[c->trace_n++] = monotonic_ns();
    }
}

/* {"trace": [[step, ns], ...]} and a newline: one line before any error report. */
void send_trace(struct child *c)
{
    struct text t;
    text_init(&t);
    text_put(&t, "{\"trace\": [");
    for (int i = 0; i < c->trace_n; i++) {
        text_put(&t, i ? ", [\"" : "[\"");
        text_put_json(&t, c->trace_names[i]);
        text_put(&t, "\", ");
        text_put_int(&t, c->trace_ns[i]);
        text_put(&t, "]");
    }
    text_put(&t, "]}\n");
    write_all(c->plan->err_fd, t.s, t.n);
}

void fail(struct child *c, int err, const char *message)
{
    struct text t;
    text_init(&t);
    text_put(&t, "{\"step\": \"");
    text_put_json(&t, c->step);
    text_put(&t, "\", \"errno\": ");
    text_put_int(&t, err);
    text_put(&t, ", \"message\": \"");
    text_put_json(&t, message);
    text_put(&t, "\"}");
    write_all(c->plan->err_fd, t.s, t.n);
    _exit(127);
}

void fail_errno(struct child *c)
{
    int err = errno;
    fail(c, err, strerror(err));
}

void fail_about(struct child *c, int err, const char *before, const char *what, const char *after)
{
    struct text t;
    text_init(&t);
    text_put(&t, before);
    text_put(&t, what);
    text_put(&t, after);
    fail(c, err, t.s);
}

void fail_call(struct child *c, const char *call, const char *arg)
{
    struct text t;
    int err = errno;
    text_init(&t);
    text_put(&t, call);
    text_put(&t, "('");
    text_put(&t, arg);
    text_put(&t, "'): ");
    text_put(&t, strerror(err));
    fail(c, err, t.s);
}

/* struct mount_attr (mount_setattr(2)): attr_set, attr_clr, propagation, userns_fd. */
int sys_mount_setattr(int dirfd, const char *path, unsigned flags, unsigned long long attr_set)
{
    unsigned long long attr[4] = {attr_set, 0, 0, 0};
    return (int)syscall(SYS_mount_setattr, dirfd, path, flags, attr, sizeof(attr));
}

int sys_move_mount(int from_dirfd, const char *from_path, int to_dirfd, const char *to_path,
                   unsigned flags)
{
    return (int)syscall(SYS_move_mount, from_dirfd, from_path, to_dirfd, to_path, flags);
}

int sys_open_tree(int dirfd, const char *path, unsigned flags)
{
    return (int)syscall(SYS_open_tree, dirfd, path, flags);
}

/* struct open_how (openat2(2)): flags, mode, resolve. */
int sys_openat2(int dirfd, const char *path, unsigned long long flags, unsigned long long resolve)
{
    unsigned long long how[3] = {flags, 0, resolve};
    return (int)syscall(SYS_openat2, dirfd, path, how, sizeof(how));
}

int sys_close_range(unsigned first, unsigned last, unsigned flags)
{
    return (int)syscall(SYS_close_range, first, last, flags);
}

/* --- messages from the helper (child.h) --------------------------------------------------- */

/* One datagram on ``sock`` and the descriptors that came with it, close-on-exec (unix(7),
 * SCM_RIGHTS): its length, or -1 with errno. The control buffer takes at most ``max_fds``
 * (<= RECEIVE_MAX_FDS) descriptors; the kernel closes any more (MSG_CTRUNC). */
ssize_t receive_with_fds(int sock, char *buf, size_t size, int *fds, int max_fds, int *nfds)
{
    union {
        char buf[CMSG_SPACE(RECEIVE_MAX_FDS * sizeof(int))];
        struct cmsghdr align;
    } control;
    struct iovec iov = {buf, size};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.buf;
    msg.msg_controllen = CMSG_SPACE((size_t)max_fds * sizeof(int));
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    *nfds = 0;
    for (struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg); n >= 0 && cmsg != NULL;
         cmsg = CMSG_NXTHDR(&msg, cmsg)) {
        if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS)
            continue;
        *nfds = (int)((cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        memcpy(fds, CMSG_DATA(cmsg), (size_t)*nfds * sizeof(int));
    }
    return n;
}

/* The message announced by ``tag`` ({"memfd": SIZE}) in the memfd ``fd``: mapped read-only,
 * not copied, and the descriptor closed (the mapping stays). NULL with errno when it cannot
 * be mapped. */
const char *map_memfd_message(const char *tag, int fd, size_t *len)
{
    long long size = 0;
    for (const char *p = tag + strlen(MEMFD_TAG); *p >= '0' && *p <= '9'; p++)
        size = size * 10 + (*p - '0');
    errno = EINVAL;  /* for a size of 0, which mmap does not check for us */
    void *map = size > 0 ? mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
    if (map == MAP_FAILED)
        return NULL;
    close(fd);
    *len = (size_t)size;
    return map;
}
