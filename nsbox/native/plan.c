/* The flat plan: parsed in the parent, before the clone (see plan.h).
 *
 * The blob is a sequence of items, each a tag byte then its value: 'i' and a little-endian
 * int64, or 's', a little-endian uint32 length, the bytes and a NUL. The order of the items is
 * fixed (nsbox/sandbox/native.py, flatten, writes them in the order read here).
 */
#include "plan.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

struct reader {
    const char *p, *end;
    const int *fds;
    size_t nfds;
    int bad;
};

static long long next_int(struct reader *r)
{
    /* Unsigned: a shift of a signed value (the -1 of "no descriptor") is undefined in C. The
     * bits are then taken as two's complement, as the writer made them. */
    uint64_t bits = 0;
    int64_t value;
    if (r->bad || r->end - r->p < 9 || r->p[0] != 'i') {
        r->bad = 1;
        return 0;
    }
    for (int i = 8; i >= 1; i--)
        bits = (bits << 8) | (unsigned char)r->p[i];
    memcpy(&value, &bits, sizeof(value));
    r->p += 9;
    return value;
}

/* An int item that must lie in [low, high]; any other value makes the plan malformed (and is
 * never narrowed into an int that would mean something else). */
static int next_in(struct reader *r, long long low, long long high)
{
    long long value = next_int(r);
    if (value < low || value > high) {
        r->bad = 1;
        return 0;
    }
    return (int)value;
}

/* 64 bits of a mask (the int item's bytes, unsigned). */
static uint64_t next_bits(struct reader *r)
{
    long long value = next_int(r);
    uint64_t bits;
    memcpy(&bits, &value, sizeof(bits));
    return bits;
}

static int next_flag(struct reader *r)
{
    return next_in(r, 0, 1);
}

/* A size or a limit: >= -1 (-1: none, as RLIM_INFINITY), or >= 0. */
static long long next_at_least(struct reader *r, long long low)
{
    long long value = next_int(r);
    if (value < low) {
        r->bad = 1;
        return 0;
    }
    return value;
}

static struct bytes_item next_bytes(struct reader *r)
{
    struct bytes_item item = {"", 0};
    uint32_t len = 0;
    if (r->bad || r->end - r->p < 5 || r->p[0] != 's') {
        r->bad = 1;
        return item;
    }
    for (int i = 4; i >= 1; i--)
        len = (len << 8) | (unsigned char)r->p[i];
    if ((size_t)(r->end - r->p - 5) < (size_t)len + 1 || r->p[5 + len] != '\0') {
        r->bad = 1;
        return item;
    }
    item.data = r->p + 5;
    item.len = len;
    r->p += 5 + len + 1;
    return item;
}

static const char *next_str(struct reader *r)
{
    return next_bytes(r).data;
}

/* A descriptor given by its index in the fds list, or -1 for none. */
static int next_fd(struct reader *r)
{
    long long index = next_int(r);
    if (index == -1 && !r->bad)
        return -1;
    if (index < 0 || (size_t)index >= r->nfds) {
        r->bad = 1;
        return -1;
    }
    return r->fds[index];
}

static void *track(struct plan *plan, void *memory)
{
    size_t room = sizeof(plan->allocations) / sizeof(plan->allocations[0]);
    if (memory != NULL && (size_t)plan->nallocations == room) {
        free(memory);  /* a plan with more /dev mounts than anyone writes */
        return NULL;
    }
    if (memory != NULL)
        plan->allocations[plan->nallocations++] = memory;
    return memory;
}

static int count(struct reader *r, long long limit)
{
    return next_in(r, 0, limit);
}

/* A NULL-terminated array of ``n`` strings; NULL when out of memory. */
static char **next_strings(struct plan *plan, struct reader *r, int n)
{
    char **list = track(plan, calloc((size_t)n + 1, sizeof(char *)));
    if (list == NULL)
        return NULL;
    for (int i = 0; i < n; i++)
        list[i] = (char *)next_str(r);
    return list;
}

static void parse_mount_kind(struct plan *plan, struct reader *r, struct mount_op *op)
{
    switch (op->kind) {
    case M_BIND:
        op->source_fd = next_fd(r);
        op->source = next_str(r);
        op->writable = next_flag(r);
        op->is_dir = next_flag(r);
        break;
    case M_TMPFS:
        op->size = next_at_least(r, 0);
        op->mode = next_in(r, 0, MODE_MAX);
        break;
    case M_FILE:
        op->data = next_bytes(r);
        op->mode = next_in(r, 0, MODE_MAX);
        break;
    case M_SYMLINK:
        op->data = next_bytes(r);
        break;
    case M_DIR:
        op->mode = next_in(r, 0, MODE_MAX);
        break;
    case M_DEV:
        op->ndevices = count(r, 4096);
        op->devices = (const char **)next_strings(plan, r, op->ndevices);
        if (op->devices == NULL)
            r->bad = 1;
        op->size = next_at_least(r, 0);
        break;
    case M_PROC:
        break;
    default:
        r->bad = 1;
    }
}

static int parse_mounts(struct plan *plan, struct reader *r)
{
    plan->nmounts = count(r, 100000);
    plan->mounts = track(plan, calloc((size_t)plan->nmounts + 1, sizeof(struct mount_op)));
    if (plan->mounts == NULL)
        return -1;
    for (int i = 0; i < plan->nmounts && !r->bad; i++) {
        struct mount_op *op = &plan->mounts[i];
        op->kind = next_in(r, M_BIND, M_PROC);
        op->target = next_str(r);
        op->step = next_str(r);
        op->source_fd = -1;
        parse_mount_kind(plan, r, op);
    }
    return 0;
}

static int parse_command(struct plan *plan, struct reader *r)
{
    plan->nrlimits = count(r, 64);
    plan->rlimits = track(plan, calloc((size_t)plan->nrlimits + 1, sizeof(struct rlimit_item)));
    if (plan->rlimits == NULL)
        return -1;
    for (int i = 0; i < plan->nrlimits; i++) {
        plan->rlimits[i].resource = next_in(r, 0, RESOURCE_MAX);
        plan->rlimits[i].soft = next_at_least(r, -1);
        plan->rlimits[i].hard = next_at_least(r, -1);
    }
    plan->cwd = next_str(r);
    plan->argv = next_strings(plan, r, count(r, 1 << 24));
    plan->envp = next_strings(plan, r, count(r, 1 << 24));
    plan->exec_direct = next_flag(r);
    plan->ncandidates = count(r, 1 << 16);
    plan->candidates = next_strings(plan, r, plan->ncandidates);
    plan->setid_bpf = next_bytes(r);
    plan->seccomp_bpf = next_bytes(r);
    plan->seccomp_notify = next_flag(r);
    plan->tty = next_flag(r);
    plan->tty_rows = next_in(r, 0, 65535);
    plan->tty_cols = next_in(r, 0, 65535);
    if (plan->argv == NULL || plan->envp == NULL || plan->candidates == NULL)
        return -1;
    return 0;
}

int plan_parse(struct plan *plan, const char *blob, size_t len, const int *fds, size_t nfds,
               const char **why)
{
    struct reader r = {blob, blob + len, fds, nfds, 0};
    memset(plan, 0, sizeof(*plan));
    long long format = next_int(&r);
    *why = "the native plan is malformed";
    if (r.bad)
        return -1;
    if (format != PLAN_FORMAT) {
        *why = "the native plan has an unknown version";
        return -1;
    }
    for (int i = 0; i < 3; i++)
        plan->stdio[i] = next_fd(&r);
    plan->sync_fd = next_fd(&r);
    plan->err_fd = next_fd(&r);
    plan->notify_fd = next_fd(&r);
    plan->net_fd = next_fd(&r);
    plan->uid = next_in(&r, 0, INT_MAX);
    plan->gid = next_in(&r, 0, INT_MAX);
    plan->cap_last = next_in(&r, 0, CAP_LAST_MAX);
    plan->trace = next_flag(&r);
    plan->pooled = next_flag(&r);
    plan->ignored_signals = next_bits(&r);
    plan->comm = next_str(&r);
    plan->hostname = next_str(&r);
    plan->net_mode = next_in(&r, NET_NONE, NET_ALLOW);
    plan->proxy_port = next_in(&r, 0, 65535);
    if (parse_mounts(plan, &r) < 0 || parse_command(plan, &r) < 0) {
        *why = "out of memory";
        plan_free(plan);
        return -1;
    }
    if (r.bad || r.p != r.end || plan->sync_fd < 0 || plan->err_fd < 0 || plan->stdio[0] < 0
        || plan->stdio[1] < 0 || plan->stdio[2] < 0 || plan->argv[0] == NULL) {
        plan_free(plan);
        return -1;
    }
    return 0;
}

void plan_free(struct plan *plan)
{
    for (int i = 0; i < plan->nallocations; i++)
        free(plan->allocations[i]);
    plan->nallocations = 0;
}

int plan_parse_command(struct plan *plan, const char *blob, size_t len)
{
    struct reader r = {blob, blob + len, NULL, 0, 0};
    if (parse_command(plan, &r) < 0 || r.bad || r.p != r.end || plan->argv[0] == NULL)
        return -1;
    return 0;
}
