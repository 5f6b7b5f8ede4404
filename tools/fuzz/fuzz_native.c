/* A mutation fuzzer for the native core's parsers and writers, built from the real sources
 * (nsbox/native/plan.c, report.c) with AddressSanitizer and UndefinedBehaviorSanitizer; run by
 * tools/fuzz_native.py, which makes the seed corpus from real flattened plans.
 *
 *   fuzz_native SEED CASES FILE...
 *
 * Each case mutates one seed (a whole plan, 'P' files, or a pooled command, 'C' files) and
 * feeds it to plan_parse or plan_parse_command, then feeds bytes of it, as text, to the report
 * writer (format_report, format_trace, text_put, and fail / fail_about / fail_call in a forked
 * child). The oracles: no sanitizer report; a parsed plan holds only what the parser promises
 * (strings inside the blob and NUL-terminated, descriptors from the list, counts in range);
 * every report is one JSON object of valid UTF-8 whose strings decode to the text given, cut to
 * REPORT_TEXT_MAX bytes on a character boundary with "..." after a cut. It also checks, outside
 * the mutation loop, map_memfd_message against short and oversized memfds, receive_with_fds
 * against too many descriptors, several SCM_RIGHTS messages and cut datagrams, take_streams
 * with streams that are already 0, 1 or 2 (close-on-exec), and keep_only. Exit status 0: no
 * finding.
 */
#define _GNU_SOURCE
#include "child.h"
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_SEEDS 64
#define INPUT_MAX (1 << 20)

struct seed {
    char kind;  /* 'P' a whole plan, 'C' a pooled command */
    unsigned char *data;
    size_t len;
};

static struct seed seeds[MAX_SEEDS];
static int nseeds;
static uint64_t rng_state;
static struct plan base_plan;  /* a parsed whole plan: the base of plan_parse_command */
static const char *base_blob;

static void finding(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void finding(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("fuzz_native: FINDING: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

static uint64_t next_random(void)
{
    /* xorshift64*: deterministic for a given seed. */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ULL;
}

static size_t below(size_t n)
{
    return n == 0 ? 0 : (size_t)(next_random() % n);
}

/* --- mutations ---------------------------------------------------------------------------- */

/* The offsets of the items of a flat plan ('i' + 8 bytes, 's' + 4 + len + 1), as far as they
 * parse; a mutation aimed at an item reaches the range checks more often than a random byte. */
static size_t item_offsets(const unsigned char *p, size_t len, size_t *out, size_t max)
{
    size_t n = 0, at = 0;
    while (at < len && n < max) {
        out[n++] = at;
        if (p[at] == 'i' && len - at >= 9) {
            at += 9;
        } else if (p[at] == 's' && len - at >= 5) {
            uint32_t l = (uint32_t)p[at + 1] | (uint32_t)p[at + 2] << 8 | (uint32_t)p[at + 3] << 16
                         | (uint32_t)p[at + 4] << 24;
            if (len - at - 5 < (size_t)l + 1)
                break;
            at += 5 + l + 1;
        } else {
            break;
        }
    }
    return n;
}

static const int64_t interesting[] = {
    0, 1, -1, 2, -2, 7, 8, 63, 64, 255, 256, 4095, 4096, 4097, 65535, 65536, 07777, 010000,
    INT32_MAX, (int64_t)INT32_MAX + 1, INT32_MIN, (int64_t)INT32_MIN - 1, UINT32_MAX,
    (int64_t)UINT32_MAX + 1, (int64_t)UINT32_MAX + 2, 100000, 100001, 1 << 24, (1 << 24) + 1,
    INT64_MAX, INT64_MIN, INT64_MIN + 1,
};

static void put_le(unsigned char *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static size_t mutate(unsigned char *buf, size_t len, size_t cap)
{
    static size_t offsets[8192];
    size_t nitems = item_offsets(buf, len, offsets, sizeof(offsets) / sizeof(offsets[0]));
    int rounds = 1 + (int)below(4);
    for (int r = 0; r < rounds; r++) {
        size_t at = nitems ? offsets[below(nitems)] : 0;
        switch (below(10)) {
        case 0: /* an int item gets an interesting value */
        case 1:
            if (at + 9 <= len && buf[at] == 'i')
                put_le(buf + at + 1, (uint64_t)interesting[below(sizeof(interesting) / 8)], 8);
            break;
        case 2: /* a string's length is off */
            if (at + 5 <= len && buf[at] == 's') {
                uint32_t l = (uint32_t)buf[at + 1] | (uint32_t)buf[at + 2] << 8;
                uint32_t lens[] = {0, 1, l + 1, l - 1, l + 9, UINT32_MAX, UINT32_MAX - 4, 1u << 31};
                put_le(buf + at + 1, lens[below(8)], 4);
            }
            break;
        case 3: /* a tag changes */
            if (at < len)
                buf[at] = "isx\0"[below(4)];
            break;
        case 4: /* a random bit */
            if (len)
                buf[below(len)] ^= (unsigned char)(1u << below(8));
            break;
        case 5: /* a random byte */
            if (len)
                buf[below(len)] = (unsigned char)next_random();
            break;
        case 6: /* cut short */
            if (len)
                len = below(len + 1);
            break;
        case 7: { /* an item repeated or removed */
            size_t end = nitems ? at + 9 : 0;
            if (end <= len && end > at) {
                if (below(2) && len + (end - at) <= cap) {
                    memmove(buf + end + (end - at), buf + end, len - end);
                    len += end - at;
                } else {
                    memmove(buf + at, buf + end, len - end);
                    len -= end - at;
                }
            }
            break;
        }
        case 8: { /* bytes of another seed spliced in */
            const struct seed *other = &seeds[below((size_t)nseeds)];
            size_t from = below(other->len), n = below(other->len - from + 1);
            size_t to = below(len + 1);
            if (to + n <= cap) {
                memcpy(buf + to, other->data + from, n);
                if (to + n > len)
                    len = to + n;
            }
            break;
        }
        default: /* the end changes */
            if (len < cap)
                buf[len++] = (unsigned char)next_random();
        }
    }
    return len;
}

/* --- the parser's promises ---------------------------------------------------------------- */

static void check_string(const char *s, const char *blob, size_t len, const char *what)
{
    if (s == NULL)
        finding("%s is NULL", what);
    if (s[0] == '\0' && (s < blob || s >= blob + len))
        return;  /* the reader's "" for a missing item, in a plan that is then refused */
    if (s < blob || s >= blob + len)
        finding("%s points outside the blob", what);
    if (memchr(s, '\0', (size_t)(blob + len - s)) == NULL)
        finding("%s is not NUL-terminated inside the blob", what);
}

static int fd_listed(int fd, const int *fds, size_t nfds)
{
    for (size_t i = 0; i < nfds; i++) {
        if (fds[i] == fd)
            return 1;
    }
    return 0;
}

static void check_command(const struct plan *p, const char *blob, size_t len)
{
    if (p->nrlimits < 0 || p->nrlimits > 64)
        finding("nrlimits %d", p->nrlimits);
    for (int i = 0; i < p->nrlimits; i++) {
        if (p->rlimits[i].resource < 0 || p->rlimits[i].resource > RESOURCE_MAX
            || p->rlimits[i].soft < -1 || p->rlimits[i].hard < -1)
            finding("rlimit %d out of range", i);
    }
    check_string(p->cwd, blob, len, "cwd");
    if (p->argv == NULL || p->argv[0] == NULL)
        finding("a plan without argv[0]");
    for (int i = 0; p->argv[i] != NULL; i++)
        check_string(p->argv[i], blob, len, "argv");
    for (int i = 0; p->envp[i] != NULL; i++)
        check_string(p->envp[i], blob, len, "envp");
    for (int i = 0; i < p->ncandidates; i++)
        check_string(p->candidates[i], blob, len, "candidate");
    if ((unsigned)p->exec_direct > 1 || (unsigned)p->seccomp_notify > 1)
        finding("a flag out of range");
}

static void check_plan(const struct plan *p, const char *blob, size_t len, const int *fds,
                       size_t nfds)
{
    for (int i = 0; i < 3; i++) {
        if (!fd_listed(p->stdio[i], fds, nfds))
            finding("stdio[%d] = %d is not a listed descriptor", i, p->stdio[i]);
    }
    if (!fd_listed(p->sync_fd, fds, nfds) || !fd_listed(p->err_fd, fds, nfds))
        finding("sync or error pipe not listed");
    if ((p->notify_fd != -1 && !fd_listed(p->notify_fd, fds, nfds))
        || (p->net_fd != -1 && !fd_listed(p->net_fd, fds, nfds)))
        finding("notify or net descriptor not listed");
    if (p->uid < 0 || p->gid < 0 || p->cap_last < 0 || p->cap_last > CAP_LAST_MAX
        || (unsigned)p->trace > 1 || (unsigned)p->pooled > 1 || p->net_mode < NET_NONE
        || p->net_mode > NET_ALLOW || p->proxy_port < 0 || p->proxy_port > 65535)
        finding("a number of the plan out of range");
    check_string(p->comm, blob, len, "comm");
    check_string(p->hostname, blob, len, "hostname");
    for (int i = 0; i < p->nmounts; i++) {
        const struct mount_op *op = &p->mounts[i];
        if (op->kind < M_BIND || op->kind > M_PROC)
            finding("mount %d has kind %d", i, op->kind);
        check_string(op->target, blob, len, "target");
        check_string(op->step, blob, len, "step");
        if (op->mode < 0 || op->mode > MODE_MAX || op->size < 0)
            finding("mount %d: mode or size out of range", i);
        if (op->kind == M_BIND && op->source_fd != -1 && !fd_listed(op->source_fd, fds, nfds))
            finding("mount %d: source descriptor not listed", i);
        for (int j = 0; op->kind == M_DEV && j < op->ndevices; j++)
            check_string(op->devices[j], blob, len, "device");
    }
    check_command(p, blob, len);
}

/* --- a JSON reader for the oracle ----------------------------------------------------------- */

struct json_in {
    const unsigned char *p, *end;
};

static void expect(struct json_in *in, const char *text)
{
    size_t n = strlen(text);
    if ((size_t)(in->end - in->p) < n || memcmp(in->p, text, n) != 0)
        finding("expected '%s' at '%.40s'", text, (const char *)in->p);
    in->p += n;
}

static int hex_digit(int ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

static size_t put_utf8(unsigned char *out, unsigned v)
{
    if (v < 0x80) {
        out[0] = (unsigned char)v;
        return 1;
    }
    if (v < 0x800) {
        out[0] = (unsigned char)(0xC0 | (v >> 6));
        out[1] = (unsigned char)(0x80 | (v & 0x3F));
        return 2;
    }
    out[0] = (unsigned char)(0xE0 | (v >> 12));
    out[1] = (unsigned char)(0x80 | ((v >> 6) & 0x3F));
    out[2] = (unsigned char)(0x80 | (v & 0x3F));
    return 3;
}

/* A JSON string (RFC 8259 section 7, UTF-8 checked) decoded into ``out``: its length. */
static size_t read_string(struct json_in *in, unsigned char *out)
{
    size_t n = 0;
    expect(in, "\"");
    for (;;) {
        if (in->p >= in->end)
            finding("a string without its closing quote");
        unsigned ch = *in->p;
        if (ch == '"') {
            in->p++;
            return n;
        }
        if (ch < 0x20)
            finding("a raw control character 0x%02x in a string", ch);
        if (ch == '\\') {
            if (in->end - in->p < 2)
                finding("a cut escape");
            unsigned esc = in->p[1];
            in->p += 2;
            if (esc == 'u') {
                unsigned v = 0;
                for (int i = 0; i < 4; i++) {
                    int d = in->p < in->end ? hex_digit(*in->p) : -1;
                    if (d < 0)
                        finding("a cut or bad \\u escape");
                    v = v * 16 + (unsigned)d;
                    in->p++;
                }
                if (v >= 0xD800 && v <= 0xDFFF)
                    finding("a surrogate escape");
                n += put_utf8(out + n, v);
            } else if (esc == '"' || esc == '\\' || esc == '/') {
                out[n++] = (unsigned char)esc;
            } else if (strchr("bfnrt", (int)esc) != NULL && esc != 0) {
                out[n++] = (unsigned char)"\b\f\n\r\t"[strchr("bfnrt", (int)esc) - "bfnrt"];
            } else {
                finding("a bad escape \\%c", esc);
            }
            continue;
        }
        /* One UTF-8 character, validated as strictly as Python's decoder does. */
        size_t len = ch < 0x80 ? 1 : ch >= 0xC2 && ch <= 0xDF ? 2 : ch >= 0xE0 && ch <= 0xEF ? 3
                     : ch >= 0xF0 && ch <= 0xF4 ? 4 : 0;
        if (len == 0 || (size_t)(in->end - in->p) < len)
            finding("invalid UTF-8 in the output");
        unsigned v = len == 1 ? ch : ch & (0x7Fu >> len);
        for (size_t i = 1; i < len; i++) {
            if ((in->p[i] & 0xC0) != 0x80)
                finding("invalid UTF-8 in the output");
            v = (v << 6) | (in->p[i] & 0x3Fu);
        }
        static const unsigned min[] = {0, 0, 0x80, 0x800, 0x10000};
        if (v < min[len] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
            finding("an overlong or surrogate UTF-8 form in the output");
        memcpy(out + n, in->p, len);
        n += len;
        in->p += len;
    }
}

static long long read_int(struct json_in *in)
{
    char digits[32];
    size_t n = 0;
    while (in->p < in->end && n < sizeof(digits) - 1 && (*in->p == '-' || (*in->p >= '0' && *in->p <= '9')))
        digits[n++] = (char)*in->p++;
    digits[n] = '\0';
    if (n == 0)
        finding("expected a number");
    return strtoll(digits, NULL, 10);
}

/* Whether ``s`` is valid UTF-8 (then the writer must give it back exactly, cut or not). */
static int valid_utf8(const unsigned char *s, size_t len)
{
    for (size_t i = 0; i < len;) {
        unsigned ch = s[i];
        size_t n = ch < 0x80 ? 1 : ch >= 0xC2 && ch <= 0xDF ? 2 : ch >= 0xE0 && ch <= 0xEF ? 3
                   : ch >= 0xF0 && ch <= 0xF4 ? 4 : 0;
        if (n == 0 || len - i < n)
            return 0;
        unsigned v = n == 1 ? ch : ch & (0x7Fu >> n);
        for (size_t j = 1; j < n; j++) {
            if ((s[i + j] & 0xC0) != 0x80)
                return 0;
            v = (v << 6) | (s[i + j] & 0x3Fu);
        }
        static const unsigned min[] = {0, 0, 0x80, 0x800, 0x10000};
        if (v < min[n] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
            return 0;
        i += n;
    }
    return 1;
}

/* The text a report must carry for ``s``: cut to REPORT_TEXT_MAX bytes on a character
 * boundary, "..." after a cut (nsbox/sandbox/child.py, cut_text). */
static size_t expected_text(const char *s, unsigned char *out)
{
    size_t len = strlen(s), cut = len;
    if (len > REPORT_TEXT_MAX) {
        cut = REPORT_TEXT_MAX;
        for (int back = 0; back < 3 && ((unsigned char)s[cut] & 0xC0) == 0x80; back++)
            cut--;
    }
    memcpy(out, s, cut);
    if (cut < len) {
        memcpy(out + cut, "...", 3);
        cut += 3;
    }
    return cut;
}

static void check_string_value(struct json_in *in, const char *given)
{
    static unsigned char got[REPORT_MAX], want[REPORT_TEXT_MAX + 8];
    size_t n = read_string(in, got);
    if (n > 3 * REPORT_TEXT_MAX + 3)  /* a byte that is not UTF-8 comes back as U+FFFD */
        finding("a string of %zu bytes, over the budget", n);
    if (valid_utf8((const unsigned char *)given, strlen(given))) {
        size_t m = expected_text(given, want);
        if (m != n || memcmp(got, want, n) != 0)
            finding("a string does not decode to the text given (%zu vs %zu bytes)", n, m);
    }
}

static void check_report(const char *out, size_t n, const char *step, int err,
                         const char *message)
{
    struct json_in in = {(const unsigned char *)out, (const unsigned char *)out + n};
    if (n > REPORT_MAX)
        finding("a report of %zu bytes", n);
    expect(&in, "{\"step\": ");
    check_string_value(&in, step);
    expect(&in, ", \"errno\": ");
    if (read_int(&in) != err)
        finding("the errno is not the one given");
    expect(&in, ", \"message\": ");
    check_string_value(&in, message);
    expect(&in, "}");
    if (in.p != in.end)
        finding("bytes after the report");
}

static void check_trace(const char *out, size_t n, const char *const *names, int count)
{
    struct json_in in = {(const unsigned char *)out, (const unsigned char *)out + n};
    expect(&in, "{\"trace\": [");
    for (int i = 0; i < count; i++) {
        expect(&in, i ? ", [" : "[");
        check_string_value(&in, names[i]);
        expect(&in, ", ");
        read_int(&in);
        expect(&in, "]");
    }
    expect(&in, "]}\n");
    if (in.p != in.end)
        finding("bytes after the trace");
}

/* --- the report writer --------------------------------------------------------------------- */

/* A NUL-terminated text from the case's bytes: any bytes, often long, often escapes. */
static void make_text(char *out, size_t cap, const unsigned char *data, size_t len)
{
    size_t n = below(cap);
    if (below(3) == 0)
        n = REPORT_TEXT_MAX - 4 + below(9);  /* around the budget */
    if (n >= cap)
        n = cap - 1;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = len ? data[(i + below(4)) % len] : (unsigned char)next_random();
        switch (below(8)) {
        case 0:
            ch = (unsigned char)below(0x20);  /* a control character: six bytes escaped */
            break;
        case 1:
            ch = "\"\\"[below(2)];
            break;
        case 2:
            if (i + 3 < n) {  /* a character of 2 to 4 bytes */
                static const char *multi[] = {"\xc3\xa9", "\xe2\x80\xae", "\xf0\x9f\x98\x80",
                                              "\xef\xbf\xbd"};
                const char *m = multi[below(4)];
                size_t ml = strlen(m);
                memcpy(out + i, m, ml);
                i += ml - 1;
                continue;
            }
            break;
        default:
            break;
        }
        out[i] = ch == 0 ? 'x' : (char)ch;
    }
    out[n] = '\0';
}

static int memfd_of(const char *name)
{
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0)
        finding("memfd_create: %s", strerror(errno));
    return fd;
}

static size_t read_back(int fd, char *out, size_t cap)
{
    off_t size = lseek(fd, 0, SEEK_END);
    if (size < 0 || (size_t)size > cap)
        finding("a trace of %lld bytes", (long long)size);
    if (pread(fd, out, (size_t)size, 0) != size)
        finding("pread: %s", strerror(errno));
    return (size_t)size;
}

/* fail(), fail_about() and fail_call() write the report and _exit: in a child, read back. */
static void check_fail_paths(const char *step, const char *message, int err)
{
    static char out[REPORT_MAX + 1];
    static struct text expected;
    int pipefd[2];
    int how = (int)below(3);
    if (pipe2(pipefd, O_CLOEXEC) != 0)
        finding("pipe2: %s", strerror(errno));
    pid_t pid = fork();
    if (pid == 0) {
        struct plan plan;
        struct child c;
        memset(&plan, 0, sizeof(plan));
        memset(&c, 0, sizeof(c));
        plan.err_fd = pipefd[1];
        c.plan = &plan;
        c.step = step;
        close(pipefd[0]);
        errno = err;
        if (how == 0)
            fail(&c, err, message);
        if (how == 1)
            fail_about(&c, err, "before ", message, " after");
        fail_call(&c, "call", message);
    }
    close(pipefd[1]);
    size_t n = 0;
    for (;;) {
        ssize_t got = read(pipefd[0], out + n, sizeof(out) - n);
        if (got <= 0)
            break;
        n += (size_t)got;
    }
    close(pipefd[0]);
    int status;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 127)
        finding("the failing child did not exit 127 (status %d)", status);
    text_init(&expected);
    if (how == 0) {
        text_put(&expected, message);
    } else if (how == 1) {
        text_put(&expected, "before ");
        text_put(&expected, message);
        text_put(&expected, " after");
    } else {
        text_put(&expected, "call('");
        text_put(&expected, message);
        text_put(&expected, "'): ");
        text_put(&expected, strerror(err));
    }
    check_report(out, n, step, err, expected.s);
}

static void check_writer(const unsigned char *data, size_t len, int with_fork)
{
    static char step[3 * REPORT_TEXT_MAX], message[3 * REPORT_TEXT_MAX];
    static struct json_out out;
    static struct text t;
    make_text(step, sizeof(step), data, len);
    make_text(message, sizeof(message), data, len);
    int err = (int)below(200);

    json_init(&out, -1);
    format_report(&out, step, err, message);
    check_report(out.s, out.n, step, err, message);

    /* A composed text is cut when full, never inside a character. */
    text_init(&t);
    for (int i = 0; i < 3; i++)
        text_put(&t, message);
    if (t.n >= TEXT_MAX || t.s[t.n] != '\0')
        finding("a text overflows its buffer");
    if (valid_utf8((const unsigned char *)message, strlen(message))
        && !valid_utf8((const unsigned char *)t.s, t.n))
        finding("a text was cut inside a character");

    /* A trace longer than the buffer is written out in parts. */
    const char *names[16];
    long long ns[16];
    int count = (int)below(6);
    for (int i = 0; i < count; i++) {
        names[i] = i % 2 ? step : message;
        ns[i] = (long long)next_random();
    }
    int fd = memfd_of("trace");
    static char trace[16 * REPORT_MAX];
    json_init(&out, fd);
    format_trace(&out, names, ns, count);
    json_flush(&out);
    check_trace(trace, read_back(fd, trace, sizeof(trace)), names, count);
    close(fd);

    if (with_fork)
        check_fail_paths(step, message, err);
}

/* --- the plan parser ------------------------------------------------------------------------ */

/* The launch engine's request (nsbox/native/engine_msg.c): parsed, every string lies inside
 * the message and ends at its NUL, every count within its array, every path absolute or "";
 * the plan it carries parses as any plan does. */
static void check_engine_request(const char *blob, size_t len, const int *fds, size_t nfds)
{
    struct engine_request req;
    const char *why = NULL;
    if (engine_parse(&req, blob, len, &why) != 0) {
        if (why == NULL)
            finding("an engine request refused without its reason");
        return;
    }
    if (req.ndirs > ENGINE_MAX_DIRS || req.nwrites > ENGINE_MAX_WRITES
        || req.nprocs > ENGINE_MAX_DIRS || req.nusage > ENGINE_MAX_USAGE
        || req.nsources > ENGINE_MAX_SOURCES || req.cpu_scale < 1 || req.wall_us < -1)
        finding("an engine request's count out of range");
    const char *paths[] = {req.cpu_path, req.clone_dir, req.kill_file, req.freezer, req.events};
    for (size_t i = 0; i < sizeof(paths) / sizeof(paths[0]); i++) {
        check_string(paths[i], blob, len, "engine path");
        if (paths[i][0] != '\0' && paths[i][0] != '/')
            finding("an engine path is not absolute");
    }
    check_string(req.uid_map, blob, len, "uid_map");
    check_string(req.gid_map, blob, len, "gid_map");
    for (int i = 0; i < req.ndirs; i++)
        check_string(req.dirs[i], blob, len, "dir");
    for (int i = 0; i < req.nwrites; i++) {
        check_string(req.writes[i].path, blob, len, "write path");
        check_string(req.writes[i].value, blob, len, "write value");
    }
    for (int i = 0; i < req.nusage; i++) {
        check_string(req.usage[i].name, blob, len, "usage name");
        check_string(req.usage[i].path, blob, len, "usage path");
        check_string(req.usage[i].key, blob, len, "usage key");
    }
    if (req.plan < blob || req.plan + req.plan_len >= blob + len || req.plan[req.plan_len])
        finding("the engine request's plan lies outside it");
    struct plan plan;
    if (plan_parse(&plan, req.plan, req.plan_len, fds, nfds, &why) == 0) {
        check_plan(&plan, blob, len, fds, nfds);
        plan_free(&plan);
    }
}

static void run_case(unsigned char *buf, size_t cap, int with_writer, int with_fork)
{
    static const int fds[] = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
    const struct seed *s = &seeds[below((size_t)nseeds)];
    memcpy(buf, s->data, s->len);
    size_t len = mutate(buf, s->len, cap);
    /* A private copy of exactly ``len`` bytes: a read past the end is a sanitizer report. */
    char *blob = malloc(len ? len : 1);
    if (blob == NULL)
        finding("out of memory");
    memcpy(blob, buf, len);
    size_t nfds = below(sizeof(fds) / sizeof(fds[0]) + 1);
    if (s->kind == 'E') {
        check_engine_request(blob, len, fds, nfds);
    } else if (s->kind == 'P') {
        struct plan plan;
        const char *why = NULL;
        if (plan_parse(&plan, blob, len, fds, nfds, &why) == 0) {
            check_plan(&plan, blob, len, fds, nfds);
            plan_free(&plan);
        } else if (why == NULL || (strcmp(why, "the native plan is malformed") != 0
                                   && strcmp(why, "the native plan has an unknown version") != 0
                                   && strcmp(why, "out of memory") != 0)) {
            finding("a refusal without its reason");
        }
    } else {
        /* As a pooled sandbox: the command over the plan it was built with. */
        struct plan command = base_plan;
        int before = command.nallocations;
        if (plan_parse_command(&command, blob, len) == 0)
            check_command(&command, blob, len);
        for (int i = before; i < command.nallocations; i++)
            free(command.allocations[i]);
    }
    if (with_writer)
        check_writer((const unsigned char *)blob, len, with_fork);
    free(blob);
}

/* --- the message receivers (not mutated: their cases are few and exact) -------------------- */

static int open_descriptors(void)
{
    int n = 0;
    for (int fd = 0; fd < 1024; fd++) {
        if (fcntl(fd, F_GETFD) >= 0)
            n++;
    }
    return n;
}

static void check_memfd_messages(void)
{
    static const struct {
        const char *tag_tail;
        size_t fill;
        int ok;
    } cases[] = {
        {"100}", 100, 1}, {"100}", 4096, 1}, {"100}", 99, 0}, {"100}", 0, 0}, {"0}", 10, 0},
        {"}", 10, 0}, {"100", 100, 0}, {"100}x", 100, 0}, {"268435457}", 10, 0},
        {"99999999999999999999999}", 10, 0}, {"4096}", 4095, 0}, {"8193}", 8192, 0},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char tag[128];
        size_t len = 0;
        snprintf(tag, sizeof(tag), "%s%s", MEMFD_TAG, cases[i].tag_tail);
        int fd = memfd_of("message");
        if (ftruncate(fd, (off_t)cases[i].fill) != 0)
            finding("ftruncate: %s", strerror(errno));
        const char *map = map_memfd_message(tag, fd, &len);
        if ((map != NULL) != cases[i].ok)
            finding("map_memfd_message(%s) over %zu bytes: %s", tag, cases[i].fill,
                    map ? "mapped" : strerror(errno));
        if (map != NULL) {
            unsigned sum = 0;
            for (size_t j = 0; j < len; j++)
                sum += (unsigned char)map[j];  /* every byte readable: no SIGBUS */
            if (sum != 0)
                finding("the mapping is not the memfd");
            munmap((void *)map, len);
        } else {
            close(fd);
        }
    }
}

static void send_with_fds(int sock, const char *data, size_t len, int nfds, int split)
{
    union {
        char buf[CMSG_SPACE(64 * sizeof(int)) * 2];
        struct cmsghdr align;
    } control;
    int fds[64];
    struct iovec iov = {(void *)data, len};
    struct msghdr msg = {0};
    memset(&control, 0, sizeof(control));
    for (int i = 0; i < nfds; i++)
        fds[i] = open("/dev/null", O_RDONLY | O_CLOEXEC);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (nfds > 0) {
        int first = split ? nfds / 2 : nfds;
        msg.msg_control = control.buf;
        struct cmsghdr *cmsg = (struct cmsghdr *)control.buf;
        cmsg->cmsg_level = SOL_SOCKET;
        cmsg->cmsg_type = SCM_RIGHTS;
        cmsg->cmsg_len = CMSG_LEN((size_t)first * sizeof(int));
        memcpy(CMSG_DATA(cmsg), fds, (size_t)first * sizeof(int));
        msg.msg_controllen = CMSG_SPACE((size_t)first * sizeof(int));
        if (split && nfds - first > 0) {
            struct cmsghdr *second = (struct cmsghdr *)(control.buf + msg.msg_controllen);
            second->cmsg_level = SOL_SOCKET;
            second->cmsg_type = SCM_RIGHTS;
            second->cmsg_len = CMSG_LEN((size_t)(nfds - first) * sizeof(int));
            memcpy(CMSG_DATA(second), fds + first, (size_t)(nfds - first) * sizeof(int));
            msg.msg_controllen += CMSG_SPACE((size_t)(nfds - first) * sizeof(int));
        }
    }
    if (sendmsg(sock, &msg, 0) < 0)
        finding("sendmsg: %s", strerror(errno));
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
}

static void check_receiver(void)
{
    static const struct {
        int sent, max, split;
        size_t len, room;
        int ok;
    } cases[] = {
        {3, 3, 0, 5, 64, 1}, {3, 4, 0, 5, 64, 1}, {4, 3, 0, 5, 64, 0}, {4, 4, 1, 5, 64, 1},
        {5, 4, 1, 5, 64, 0}, {0, 4, 0, 5, 64, 1}, {3, 3, 0, 100, 64, 0}, {2, 1, 1, 5, 64, 0},
        {8, 8, 1, 5, 64, 1}, {9, 8, 0, 5, 64, 0}, {1, 0, 0, 5, 64, 0},
    };
    char data[128], buf[128];
    memset(data, 'x', sizeof(data));
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int pair[2], fds[RECEIVE_MAX_FDS], nfds = -1;
        if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0)
            finding("socketpair: %s", strerror(errno));
        int before = open_descriptors();
        send_with_fds(pair[0], data, cases[i].len, cases[i].sent, cases[i].split);
        ssize_t n = receive_with_fds(pair[1], buf, cases[i].room, fds, cases[i].max, &nfds);
        if ((n >= 0) != cases[i].ok)
            finding("receive_with_fds case %zu: %zd (%s)", i, n, strerror(errno));
        if (nfds < 0 || nfds > cases[i].max || (n >= 0 && nfds != cases[i].sent))
            finding("receive_with_fds case %zu: %d descriptors", i, nfds);
        for (int j = 0; j < nfds; j++) {
            if (!(fcntl(fds[j], F_GETFD) & FD_CLOEXEC))
                finding("a received descriptor is not close-on-exec");
            close(fds[j]);
        }
        if (open_descriptors() != before)
            finding("receive_with_fds case %zu leaves descriptors open", i);
        close(pair[0]);
        close(pair[1]);
    }
}

/* take_streams and keep_only change this process's descriptors: each case in a child. */
static void in_child(void (*check)(int), int arg, const char *what)
{
    pid_t pid = fork();
    if (pid == 0) {
        check(arg);
        _exit(0);
    }
    int status;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        finding("%s case %d failed (status %d)", what, arg, status);
}

static int open_cloexec(int at)
{
    /* /dev/null close-on-exec at exactly ``at``, as a received descriptor arrives. */
    int fd = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (fd != at) {
        if (dup3(fd, at, O_CLOEXEC) < 0)
            _exit(10);
        close(fd);
    }
    return at;
}

static void child_take_streams(int which)
{
    int fds[3];
    int high = open_cloexec(20), other = open_cloexec(21);
    switch (which) {
    case 0: /* each already its own stream, close-on-exec: the bug dup2 would leave */
        fds[0] = open_cloexec(0), fds[1] = open_cloexec(1), fds[2] = open_cloexec(2);
        break;
    case 1: /* one descriptor for two streams, as a pool's /dev/null for 1 and 2 */
        fds[0] = high, fds[1] = other, fds[2] = other;
        break;
    case 2: /* a source that is another stream's target */
        fds[0] = high, fds[1] = open_cloexec(0), fds[2] = other;
        break;
    default: /* a mix */
        fds[0] = open_cloexec(0), fds[1] = high, fds[2] = open_cloexec(1);
    }
    if (take_streams(fds) != 0)
        _exit(11);
    for (int i = 0; i < 3; i++) {
        int flags = fcntl(i, F_GETFD);
        if (flags < 0 || (flags & FD_CLOEXEC))
            _exit(12 + i);  /* a stream missing or closed at exec */
    }
    for (int i = 0; i < 3; i++) {
        if (fds[i] > 2 && fcntl(fds[i], F_GETFD) >= 0)
            _exit(15);  /* a source left open */
    }
}

static void child_keep_only(int nmounts)
{
    struct mount_op ops[8];
    struct plan plan;
    memset(&plan, 0, sizeof(plan));
    memset(ops, 0, sizeof(ops));
    for (int fd = 3; fd < 40; fd++)
        open_cloexec(fd);
    plan.sync_fd = 30, plan.err_fd = 5, plan.notify_fd = -1, plan.net_fd = 30;
    plan.mounts = ops;
    plan.nmounts = nmounts;
    for (int i = 0; i < nmounts; i++)
        ops[i].source_fd = i % 3 == 0 ? -1 : 7 + 3 * i;
    keep_only(&plan);
    for (int fd = 0; fd < 64; fd++) {
        int kept = fd <= 2 || fd == 5 || fd == 30;
        for (int i = 0; i < nmounts; i++)
            kept |= fd == ops[i].source_fd;
        if ((fcntl(fd, F_GETFD) >= 0) != kept && fd >= 3)
            _exit(20);
    }
}

/* --- main ---------------------------------------------------------------------------------- */

static void load_seed(const char *path)
{
    const char *name = strrchr(path, '/');
    name = name ? name + 1 : path;
    FILE *f = fopen(path, "rb");
    if (f == NULL || nseeds == MAX_SEEDS)
        finding("cannot load the seed %s", path);
    struct seed *s = &seeds[nseeds++];
    s->kind = name[0];
    s->data = malloc(INPUT_MAX);
    s->len = fread(s->data, 1, INPUT_MAX, f);
    fclose(f);
    if (s->kind != 'P' && s->kind != 'C' && s->kind != 'E')
        finding("a seed's name starts with P (a plan), C (a command) or E (an engine "
                "request): %s", name);
    if (s->kind == 'P' && base_blob == NULL) {
        const char *why;
        static const int fds[] = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
        if (plan_parse(&base_plan, (const char *)s->data, s->len, fds, 10, &why) != 0)
            finding("the seed %s does not parse: %s", name, why);
        base_blob = (const char *)s->data;
    }
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: fuzz_native SEED CASES FILE...\n");
        return 2;
    }
    rng_state = strtoull(argv[1], NULL, 10) * 0x9E3779B97F4A7C15ULL + 1;
    long cases = strtol(argv[2], NULL, 10);
    for (int i = 3; i < argc; i++)
        load_seed(argv[i]);
    if (base_blob == NULL)
        finding("no whole plan among the seeds");
    check_memfd_messages();
    check_receiver();
    for (int i = 0; i < 4; i++)
        in_child(child_take_streams, i, "take_streams");
    for (int n = 0; n <= 8; n++)
        in_child(child_keep_only, n, "keep_only");
    unsigned char *buf = malloc(INPUT_MAX * 2);
    for (long i = 0; i < cases; i++)
        run_case(buf, INPUT_MAX * 2, i % 4 == 0, i % 196 == 0);  /* the writer is the dearer */
    free(buf);
    plan_free(&base_plan);
    for (int i = 0; i < nseeds; i++)
        free(seeds[i].data);
    printf("fuzz_native: %ld cases over %d seeds, no finding\n", cases, nseeds);
    return 0;
}
