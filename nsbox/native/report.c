/* The child's failure report and trace, written as the Python child writes them
 * (nsbox/sandbox/child.py: fail, send_trace), and the raw system calls the steps share. */
#define _GNU_SOURCE
#include "child.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
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

/* How many of the ``len`` bytes at ``s`` can be kept within ``room`` without cutting a UTF-8
 * character: a cut backs up over at most 3 continuation bytes (RFC 3629, section 3). */
static size_t cut_on_character(const char *s, size_t len, size_t room)
{
    size_t cut = room;
    if (len <= room)
        return len;
    for (int back = 0; back < 3 && cut > 0 && ((unsigned char)s[cut] & 0xC0) == 0x80; back++)
        cut--;
    return cut;
}

static void text_putn(struct text *t, const char *s, size_t len)
{
    len = cut_on_character(s, len, TEXT_MAX - 1 - t->n);
    memcpy(t->s + t->n, s, len);
    t->n += len;
    t->s[t->n] = '\0';
}

void text_put(struct text *t, const char *s)
{
    text_putn(t, s, strlen(s));
}

/* The digits of ``value`` in ``base`` into ``digits`` (32 bytes): where they start. */
static size_t format_number(char *digits, long long value, int base)
{
    size_t i = 32;
    unsigned long long v = value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value;
    do {
        digits[--i] = (char)('0' + v % (unsigned)base);
        v /= (unsigned)base;
    } while (v != 0);
    if (value < 0)
        digits[--i] = '-';
    return i;
}

void text_put_int(struct text *t, long long value)
{
    char digits[32];
    size_t i = format_number(digits, value, 10);
    text_putn(t, digits + i, sizeof(digits) - i);
}

void text_put_octal(struct text *t, long long value)
{
    char digits[32];
    size_t i = format_number(digits, value, 8);
    text_putn(t, digits + i, sizeof(digits) - i);
}

/* --- JSON: the failure report and the trace (nsbox/sandbox/child.py: fail, send_trace) ---- */

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

void json_init(struct json_out *o, int fd)
{
    o->fd = fd;
    o->n = 0;
}

void json_flush(struct json_out *o)
{
    if (o->fd >= 0)
        write_all(o->fd, o->s, o->n);
    o->n = 0;
}

/* ``len`` bytes (at most a few: one escape, one character, one number) as they are. Without a
 * descriptor to flush to, REPORT_MAX is sized so that this never runs out of room; if it did,
 * the piece would be left out whole, never cut. */
static void json_putn(struct json_out *o, const char *s, size_t len)
{
    if (o->n + len > sizeof(o->s))
        json_flush(o);
    if (o->n + len > sizeof(o->s))
        return;
    memcpy(o->s + o->n, s, len);
    o->n += len;
}

void json_put_raw(struct json_out *o, const char *s)
{
    for (; *s; s++)
        json_putn(o, s, 1);
}

void json_put_int(struct json_out *o, long long value)
{
    char digits[32];
    size_t i = format_number(digits, value, 10);
    json_putn(o, digits + i, sizeof(digits) - i);
}

/* The length of the UTF-8 character at ``s`` (at most ``len`` bytes), or 0 when the bytes are
 * not one: overlong forms, surrogates and values past U+10FFFF included (RFC 3629, section 4). */
static size_t utf8_length(const unsigned char *s, size_t len)
{
    size_t n;
    unsigned min;
    unsigned value;
    if (s[0] < 0x80)
        return 1;
    if (s[0] >= 0xC2 && s[0] <= 0xDF)
        n = 2, min = 0x80, value = s[0] & 0x1Fu;
    else if (s[0] >= 0xE0 && s[0] <= 0xEF)
        n = 3, min = 0x800, value = s[0] & 0x0Fu;
    else if (s[0] >= 0xF0 && s[0] <= 0xF4)
        n = 4, min = 0x10000, value = s[0] & 0x07u;
    else
        return 0;
    if (len < n)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        value = (value << 6) | (s[i] & 0x3Fu);
    }
    if (value < min || value > 0x10FFFF || (value >= 0xD800 && value <= 0xDFFF))
        return 0;
    return n;
}

/* A JSON string body: the quote, the backslash and control characters escaped (RFC 8259,
 * section 7). The plan's strings are valid UTF-8 (flatten checks), and so is strerror's text;
 * a byte that is not, from wherever it came, becomes U+FFFD, so that the report stays JSON. */
static void json_put_escaped(struct json_out *o, const char *s, size_t len)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)s;
    const unsigned char *end = p + len;
    while (p < end) {
        size_t n = utf8_length(p, (size_t)(end - p));
        if (n == 0) {
            json_putn(o, "\\ufffd", 6);
            p++;
        } else if (*p == '"' || *p == '\\') {
            char esc[2] = {'\\', (char)*p};
            json_putn(o, esc, 2);
            p++;
        } else if (*p < 0x20) {
            char esc[6] = {'\\', 'u', '0', '0', hex[*p >> 4], hex[*p & 15]};
            json_putn(o, esc, 6);
            p++;
        } else {
            json_putn(o, (const char *)p, n);
            p += n;
        }
    }
}

void json_put_string(struct json_out *o, const char *s)
{
    size_t len = strlen(s);
    size_t kept = cut_on_character(s, len, REPORT_TEXT_MAX);
    json_putn(o, "\"", 1);
    json_put_escaped(o, s, kept);
    if (kept < len)
        json_putn(o, "...", 3);
    json_putn(o, "\"", 1);
}

void format_report(struct json_out *o, const char *step, int err, const char *message)
{
    json_put_raw(o, "{\"step\": ");
    json_put_string(o, step);
    json_put_raw(o, ", \"errno\": ");
    json_put_int(o, err);
    json_put_raw(o, ", \"message\": ");
    json_put_string(o, message);
    json_put_raw(o, "}");
}

void format_trace(struct json_out *o, const char *const *names, const long long *ns, int n)
{
    json_put_raw(o, "{\"trace\": [");
    for (int i = 0; i < n; i++) {
        json_put_raw(o, i ? ", [" : "[");
        json_put_string(o, names[i]);
        json_put_raw(o, ", ");
        json_put_int(o, ns[i]);
        json_put_raw(o, "]");
    }
    json_put_raw(o, "]}\n");
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

/* One line before any error report; written in parts when long (only this process writes to
 * the pipe now: pid 1 sleeps until the exec, CLONE_VFORK). */
void send_trace(struct child *c)
{
    struct json_out o;
    json_init(&o, c->plan->err_fd);
    format_trace(&o, c->trace_names, c->trace_ns, c->trace_n);
    json_flush(&o);
}

void fail(struct child *c, int err, const char *message)
{
    struct json_out o;
    json_init(&o, -1);
    format_report(&o, c->step, err, message);
    write_all(c->plan->err_fd, o.s, o.n);
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
 * (<= RECEIVE_MAX_FDS) descriptors, rounded up by CMSG_SPACE; a datagram cut short (MSG_TRUNC),
 * descriptors the kernel could not pass (MSG_CTRUNC: more than the buffer holds, or none left
 * here: EMFILE) or more than ``max_fds`` in any number of SCM_RIGHTS messages fail with
 * EMSGSIZE, all that came closed: a message is taken whole or not at all (nsbox/_sys/wire.py,
 * receive_fds). */
ssize_t receive_with_fds(int sock, char *buf, size_t size, int *fds, int max_fds, int *nfds)
{
    union {
        char buf[CMSG_SPACE(RECEIVE_MAX_FDS * sizeof(int))];
        struct cmsghdr align;
    } control;
    struct iovec iov = {buf, size};
    struct msghdr msg = {0};
    int extra = 0;
    *nfds = 0;
    if (max_fds < 0 || max_fds > RECEIVE_MAX_FDS) {
        errno = EINVAL;
        return -1;
    }
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.buf;
    msg.msg_controllen = CMSG_SPACE((size_t)max_fds * sizeof(int));
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0)
        return -1;
    for (struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg); cmsg != NULL;
         cmsg = CMSG_NXTHDR(&msg, cmsg)) {
        if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS)
            continue;
        size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(cmsg) + i * sizeof(int), sizeof(int));
            if (*nfds < max_fds) {
                fds[(*nfds)++] = fd;
            } else {
                close(fd);
                extra = 1;
            }
        }
    }
    if (extra || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        /* MSG_CTRUNC with room left: the kernel could not install them here (EMFILE). */
        int lost = !extra && !(msg.msg_flags & MSG_TRUNC) && *nfds < max_fds;
        for (int i = 0; i < *nfds; i++)
            close(fds[i]);
        *nfds = 0;
        errno = lost ? EMFILE : EMSGSIZE;
        return -1;
    }
    return n;
}

/* The message announced by ``tag`` ({"memfd": SIZE}) in the memfd ``fd``: mapped read-only,
 * not copied, and the descriptor closed (the mapping stays until the exec). A memfd shorter
 * than SIZE is refused before the mapping: a page past its end would raise SIGBUS at the first
 * read, not an error (mmap(2)). */
const char *map_memfd_message(const char *tag, int fd, size_t *len)
{
    uint64_t size = 0;
    struct stat st;
    const char *p = tag + strlen(MEMFD_TAG);
    const char *digits = p;
    for (; *p >= '0' && *p <= '9'; p++) {
        size = size * 10 + (uint64_t)(*p - '0');
        if (size > MEMFD_MESSAGE_MAX) {
            errno = EMSGSIZE;
            return NULL;
        }
    }
    if (p == digits || strcmp(p, "}") != 0 || size == 0) {
        errno = EBADMSG;
        return NULL;
    }
    if (fstat(fd, &st) != 0)
        return NULL;
    if (st.st_size < 0 || (uint64_t)st.st_size < size) {
        errno = EBADMSG;
        return NULL;
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED)
        return NULL;
    close(fd);
    *len = (size_t)size;
    return map;
}
