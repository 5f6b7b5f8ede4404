/* The launch engine's request parser (engine.h has the layout). No allocation: every string
 * is checked to lie inside the message and to end in its NUL, every count against its array. */
#include "engine.h"

#include <string.h>

struct cursor {
    const char *p, *end;
    int bad;
};

static long long take_int(struct cursor *c)
{
    uint64_t bits = 0;
    int64_t value;
    if (c->bad || c->end - c->p < 9 || c->p[0] != 'i') {
        c->bad = 1;
        return 0;
    }
    for (int i = 8; i >= 1; i--)
        bits = (bits << 8) | (unsigned char)c->p[i];
    memcpy(&value, &bits, sizeof(value));
    c->p += 9;
    return value;
}

static long long take_in(struct cursor *c, long long low, long long high)
{
    long long value = take_int(c);
    if (value < low || value > high) {
        c->bad = 1;
        return low;
    }
    return value;
}

/* A string item of at most ``max`` bytes with no NUL inside; "" when malformed. */
static const char *take_bytes(struct cursor *c, size_t max, size_t *out_len)
{
    uint32_t len = 0;
    if (c->bad || c->end - c->p < 5 || c->p[0] != 's') {
        c->bad = 1;
        return "";
    }
    for (int i = 4; i >= 1; i--)
        len = (len << 8) | (unsigned char)c->p[i];
    if (len > max || (size_t)(c->end - c->p - 5) < (size_t)len + 1 || c->p[5 + len] != '\0') {
        c->bad = 1;
        return "";
    }
    const char *s = c->p + 5;
    c->p += 5 + (size_t)len + 1;
    if (out_len != NULL)
        *out_len = len;
    return s;
}

static const char *take_str(struct cursor *c, size_t max)
{
    size_t len = 0;
    const char *s = take_bytes(c, max, &len);
    if (!c->bad && memchr(s, '\0', len) != NULL)
        c->bad = 1;
    return c->bad ? "" : s;
}

/* A path: absolute, or "" for none. */
static const char *take_path(struct cursor *c)
{
    const char *s = take_str(c, ENGINE_PATH_MAX);
    if (s[0] != '\0' && s[0] != '/')
        c->bad = 1;
    return s;
}

static void take_paths(struct cursor *c, int *n, const char **out, int max)
{
    *n = (int)take_in(c, 0, max);
    for (int i = 0; i < *n && !c->bad; i++) {
        out[i] = take_path(c);
        if (out[i][0] == '\0')
            c->bad = 1;
    }
}

int engine_parse(struct engine_request *req, const char *msg, size_t len, const char **why)
{
    struct cursor c = {msg, msg + len, 0};
    memset(req, 0, sizeof(*req));
    *why = "the launch request is malformed";
    if (take_int(&c) != ENGINE_FORMAT) {
        *why = "the launch request is of another format: reinstall nsbox";
        return -1;
    }
    req->wall_us = take_in(&c, -1, INT64_MAX);
    req->cpu_ns = take_in(&c, -1, INT64_MAX);
    req->cpu_path = take_path(&c);
    req->cpu_key = take_str(&c, ENGINE_VALUE_MAX);
    req->cpu_scale = take_in(&c, 1, 1000000000);
    req->deny_setgroups = (int)take_in(&c, 0, 1);
    req->uid_map = take_str(&c, ENGINE_MAP_MAX);
    req->gid_map = take_str(&c, ENGINE_MAP_MAX);
    take_paths(&c, &req->ndirs, req->dirs, ENGINE_MAX_DIRS);
    req->nwrites = (int)take_in(&c, 0, ENGINE_MAX_WRITES);
    for (int i = 0; i < req->nwrites && !c.bad; i++) {
        req->writes[i].path = take_path(&c);
        req->writes[i].value = take_str(&c, ENGINE_VALUE_MAX);
    }
    take_paths(&c, &req->nprocs, req->procs, ENGINE_MAX_DIRS);
    req->clone_dir = take_path(&c);
    req->kill_file = take_path(&c);
    req->freezer = take_path(&c);
    req->events = take_path(&c);
    req->nusage = (int)take_in(&c, 0, ENGINE_MAX_USAGE);
    for (int i = 0; i < req->nusage && !c.bad; i++) {
        req->usage[i].name = take_str(&c, ENGINE_VALUE_MAX);
        req->usage[i].path = take_path(&c);
        req->usage[i].key = take_str(&c, ENGINE_VALUE_MAX);
        for (const char *p = req->usage[i].name; *p; p++) {
            if (!((*p >= 'a' && *p <= 'z') || *p == '_'))
                c.bad = 1;  /* written into the report's JSON as it is */
        }
    }
    req->spare_prefix = take_str(&c, ENGINE_VALUE_MAX);
    req->spawner_name = take_str(&c, 15);  /* a process name: TASK_COMM_LEN - 1 */
    req->nresets = (int)take_in(&c, 0, ENGINE_MAX_DIRS);
    for (int i = 0; i < req->nresets && !c.bad; i++) {
        req->resets[i].path = take_path(&c);
        req->resets[i].value = take_str(&c, ENGINE_VALUE_MAX);
    }
    for (const char *p = req->spare_prefix; *p; p++) {
        if (*p == '/')
            c.bad = 1;  /* a name in each hierarchy, never a path */
    }
    req->nsources = (int)take_in(&c, 0, ENGINE_MAX_SOURCES);
    req->plan = take_bytes(&c, len, &req->plan_len);
    if (c.bad || c.p != c.end)
        return -1;
    return 0;
}
