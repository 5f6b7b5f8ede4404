/* The launch engine's cgroup steps: what the host wrote into the request, carried out
 * (cgroups(7); Documentation/admin-guide/cgroup-v1 and cgroup-v2.rst for the files). */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char *keep(char **at, const char *s)
{
    size_t n = strlen(s) + 1;
    char *out = *at;
    memcpy(out, s, n);
    *at += n;
    return out;
}

int cgroup_keep(struct engine_cgroup *cg, const struct engine_request *req)
{
    /* Bounded by the parser: at most (16 + 3 + 1 + 3 x 16) strings of at most 4096 bytes. */
    size_t size = strlen(req->kill_file) + strlen(req->freezer) + strlen(req->events)
        + strlen(req->cpu_path) + strlen(req->cpu_key) + 5;
    for (int i = 0; i < req->ndirs; i++)
        size += strlen(req->dirs[i]) + 1;
    for (int i = 0; i < req->nusage; i++)
        size += strlen(req->usage[i].name) + strlen(req->usage[i].path)
            + strlen(req->usage[i].key) + 3;
    memset(cg, 0, sizeof(*cg));
    cg->arena = malloc(size);
    if (cg->arena == NULL)
        return -1;
    char *at = cg->arena;
    cg->ndirs = req->ndirs;
    for (int i = 0; i < req->ndirs; i++)
        cg->dirs[i] = keep(&at, req->dirs[i]);
    cg->kill_file = keep(&at, req->kill_file);
    cg->freezer = keep(&at, req->freezer);
    cg->events = keep(&at, req->events);
    cg->cpu_path = keep(&at, req->cpu_path);
    cg->cpu_key = keep(&at, req->cpu_key);
    cg->cpu_scale = req->cpu_scale;
    cg->nusage = req->nusage;
    for (int i = 0; i < req->nusage; i++) {
        cg->usage[i].name = keep(&at, req->usage[i].name);
        cg->usage[i].path = keep(&at, req->usage[i].path);
        cg->usage[i].key = keep(&at, req->usage[i].key);
    }
    return 0;
}

void cgroup_free(struct engine_cgroup *cg)
{
    free(cg->arena);
    memset(cg, 0, sizeof(*cg));
}

static int write_file(const char *path, const char *value)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t len = strlen(value);
    ssize_t n = write(fd, value, len);
    int err = errno;
    close(fd);
    if (n < 0 || (size_t)n != len) {
        errno = n < 0 ? err : EIO;
        return -1;
    }
    return 0;
}

int cgroup_create(const struct engine_request *req, char *what, size_t what_size)
{
    int made = 0;
    for (; made < req->ndirs; made++) {
        if (mkdir(req->dirs[made], 0755) != 0) {
            snprintf(what, what_size, "mkdir %s", req->dirs[made]);
            goto undo;
        }
    }
    for (int i = 0; i < req->nwrites; i++) {
        /* "?VALUE": written where the file exists (cgroup v2's memory.swap.max exists only
         * with swap accounting, cgroup-v2.rst), else left out; every other write must land. */
        const char *value = req->writes[i].value;
        int optional = value[0] == '?';
        if (write_file(req->writes[i].path, value + optional) != 0) {
            if (optional && errno == ENOENT)
                continue;
            snprintf(what, what_size, "write %s to %s", req->writes[i].value,
                     req->writes[i].path);
            goto undo;
        }
    }
    return 0;
undo:;
    int err = errno;
    while (made-- > 0)
        rmdir(req->dirs[made]);
    errno = err;
    return -1;
}

/* The pids in ``dir``/cgroup.procs, SIGKILLed: how many there were, -1 when unreadable. */
static int kill_procs(const char *dir)
{
    char path[ENGINE_PATH_MAX + 32];
    char buf[8192];
    int found = 0;
    snprintf(path, sizeof(path), "%s/cgroup.procs", dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t have = 0;
    for (;;) {
        ssize_t n = read(fd, buf + have, sizeof(buf) - 1 - have);
        if (n <= 0)
            break;
        have += (size_t)n;
        buf[have] = '\0';
        /* Every whole line; a cut one stays for the next read. */
        char *line = buf, *nl;
        while ((nl = strchr(line, '\n')) != NULL) {
            *nl = '\0';
            long pid = strtol(line, NULL, 10);
            if (pid > 1) {
                kill((pid_t)pid, SIGKILL);
                found++;
            }
            line = nl + 1;
        }
        have = (size_t)(buf + have - line);
        memmove(buf, line, have);
        if (have == sizeof(buf) - 1)
            have = 0;  /* no line is this long */
    }
    close(fd);
    return found;
}

void cgroup_kill_all(const struct engine_cgroup *cg)
{
    if (cg->kill_file[0] != '\0' && write_file(cg->kill_file, "1") == 0)
        return;
    if (cg->freezer[0] != '\0') {
        /* Frozen tasks cannot fork, so one pass finds them all; the SIGKILL is delivered once
         * they are thawed (cgroup-v1/freezer-subsystem.rst). */
        char state[ENGINE_PATH_MAX + 32];
        snprintf(state, sizeof(state), "%s/freezer.state", cg->freezer);
        if (write_file(state, "FROZEN") == 0) {
            kill_procs(cg->freezer);
            write_file(state, "THAWED");
        }
    }
    for (int round = 0; round < 100; round++) {
        int found = 0;
        for (int i = 0; i < cg->ndirs; i++) {
            int n = kill_procs(cg->dirs[i]);
            found += n > 0 ? n : 0;
        }
        if (found == 0)
            break;
    }
}

int cgroup_remove(struct engine_cgroup *cg)
{
    while (cg->ndirs > 0) {
        const char *dir = cg->dirs[cg->ndirs - 1];
        if (rmdir(dir) != 0 && errno != ENOENT)
            return errno == EBUSY ? 1 : -1;
        cg->ndirs--;
    }
    return 0;
}

int read_number(const char *path, const char *key, long long *out)
{
    char buf[4096];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t have = 0;
    ssize_t n;
    while (have < sizeof(buf) - 1 && (n = read(fd, buf + have, sizeof(buf) - 1 - have)) > 0)
        have += (size_t)n;
    close(fd);
    buf[have] = '\0';
    const char *p = buf;
    size_t klen = strlen(key);
    if (klen > 0) {
        for (;;) {
            if (strncmp(p, key, klen) == 0 && p[klen] == ' ') {
                p += klen + 1;
                break;
            }
            p = strchr(p, '\n');
            if (p == NULL)
                return -1;
            p++;
        }
    }
    char *end;
    errno = 0;
    long long value = strtoll(p, &end, 10);
    if (end == p || errno != 0 || (*end != '\0' && *end != '\n'))
        return -1;
    *out = value;
    return 0;
}
