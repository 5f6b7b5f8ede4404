/* The launch engine's spares (engine.h): on cgroup v1 a process moved into a cgroup waits for
 * an RCU grace period (the write to cgroup.procs takes cgroup_threadgroup_rwsem, cgroups(7)),
 * about 10 ms; a child cloned by a process already there is born in it. So the engine keeps
 * cgroups made ahead, each holding a spawner (spawner.c, a fork of this small program) that
 * moved itself in while the engine was idle, as the Python helper does (nsbox/helper/
 * spawner.py). A run takes a spare: the limits are written to its files, the spawner clones
 * the sandbox with CLONE_PARENT (clone(2)) and exits, its peak memory is reset. */
#define _GNU_SOURCE
#include "engine.h"

#include "child.h"
#include "spawner.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SPARES 2
#define NAMESPACES (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC \
                    | CLONE_NEWUTS | CLONE_NEWCGROUP)

struct spare {
    int used;
    pid_t pid;
    int sock;
    int ready;
    char name[ENGINE_VALUE_MAX + 24];
};

static struct spare spares[SPARES];
static char bases[ENGINE_MAX_DIRS][ENGINE_PATH_MAX];
static int nbases;
static unsigned long counter;

/* The directory ``dir`` lies in, into ``out``: 0, or -1 (not a path of at least two parts). */
static int parent_of(const char *dir, char *out)
{
    const char *slash = strrchr(dir, '/');
    if (slash == NULL || slash == dir || (size_t)(slash - dir) >= ENGINE_PATH_MAX)
        return -1;
    memcpy(out, dir, (size_t)(slash - dir));
    out[slash - dir] = '\0';
    return 0;
}

static int same_bases(const struct engine_request *req)
{
    char parent[ENGINE_PATH_MAX];
    if (req->ndirs != nbases)
        return 0;
    for (int i = 0; i < nbases; i++) {
        if (parent_of(req->dirs[i], parent) != 0 || strcmp(parent, bases[i]) != 0)
            return 0;
    }
    return 1;
}

static void spare_dir(int i, const char *name, char *out, size_t size)
{
    snprintf(out, size, "%s/%s", bases[i], name);
}

static void remove_dirs(const char *name, int n)
{
    char dir[ENGINE_PATH_MAX + ENGINE_VALUE_MAX + 32];
    for (int i = n - 1; i >= 0; i--) {
        spare_dir(i, name, dir, sizeof(dir));
        for (int round = 0; round < 100 && rmdir(dir) != 0 && errno == EBUSY; round++) {
            struct timespec pause = {0, 1000000};
            nanosleep(&pause, NULL);  /* a task that has just been reaped is leaving */
        }
    }
}

static void drop(struct spare *sp)
{
    if (!sp->used)
        return;
    kill(sp->pid, SIGKILL);
    waitpid(sp->pid, NULL, 0);
    close(sp->sock);
    remove_dirs(sp->name, nbases);
    sp->used = 0;
}

void spare_abandon(struct taken_spare *sp)
{
    kill(sp->pid, SIGKILL);
    waitpid(sp->pid, NULL, 0);
    close(sp->sock);
    remove_dirs(sp->name, nbases);
}

void spares_drop_all(void)
{
    for (int i = 0; i < SPARES; i++)
        drop(&spares[i]);
}

/* In the fork: every descriptor but ``keep`` (n of them) closed, at once, so that no other
 * launch's socket or pipe is held here while the spawner waits for its grace period. */
static void keep_only_fds(int *keep, int n)
{
    for (int i = 1; i < n; i++) {  /* insertion sort: a handful */
        for (int j = i; j > 0 && keep[j - 1] > keep[j]; j--) {
            int t = keep[j];
            keep[j] = keep[j - 1];
            keep[j - 1] = t;
        }
    }
    unsigned from = 3;
    for (int i = 0; i < n; i++) {
        if ((unsigned)keep[i] > from)
            sys_close_range(from, (unsigned)keep[i] - 1, 0);
        if ((unsigned)keep[i] + 1 > from)
            from = (unsigned)keep[i] + 1;
    }
    sys_close_range(from, ~0U, 0);
}

static int make_spare(struct spare *sp, const char *prefix, const char *spawner_name)
{
    char dir[ENGINE_PATH_MAX + ENGINE_VALUE_MAX + 32];
    int procs[ENGINE_MAX_DIRS + 1], made = 0, nprocs = 0, sv[2] = {-1, -1};
    snprintf(sp->name, sizeof(sp->name), "%s%lu", prefix, ++counter);
    for (; made < nbases; made++) {
        spare_dir(made, sp->name, dir, sizeof(dir));
        if (mkdir(dir, 0755) != 0)
            goto fail;
    }
    for (; nprocs < nbases; nprocs++) {
        char file[sizeof(dir) + 16];
        spare_dir(nprocs, sp->name, dir, sizeof(dir));
        snprintf(file, sizeof(file), "%s/cgroup.procs", dir);
        procs[nprocs] = open(file, O_WRONLY | O_CLOEXEC);
        if (procs[nprocs] < 0)
            goto fail;
    }
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
        goto fail;
    pid_t pid = fork();
    if (pid == 0) {
        procs[nprocs] = sv[1];
        keep_only_fds(procs, nprocs + 1);
        /* Moves itself into the spare, says "ready", clones one sandbox, exits. */
        spawner_main(sv[1], procs, nprocs, NAMESPACES | CLONE_PARENT | SIGCHLD, spawner_name,
                     "nsbox-engine");
        _exit(0);
    }
    if (pid < 0)
        goto fail;
    close(sv[1]);
    for (int i = 0; i < nprocs; i++)
        close(procs[i]);
    sp->pid = pid;
    sp->sock = sv[0];
    sp->ready = 0;
    sp->used = 1;
    return 0;
fail:
    for (int i = 0; i < nprocs; i++)
        close(procs[i]);
    if (sv[0] >= 0) {
        close(sv[0]);
        close(sv[1]);
    }
    remove_dirs(sp->name, made);
    return -1;
}

void spares_refill(const struct engine_request *req)
{
    if (req->spare_prefix[0] == '\0' || req->nprocs == 0 || req->clone_dir[0] != '\0'
        || req->ndirs == 0)
        return;
    if (!same_bases(req)) {
        spares_drop_all();
        nbases = 0;
        for (int i = 0; i < req->ndirs; i++) {
            if (parent_of(req->dirs[i], bases[i]) != 0) {
                nbases = 0;
                return;
            }
        }
        nbases = req->ndirs;
    }
    for (int i = 0; i < SPARES; i++) {
        if (!spares[i].used && make_spare(&spares[i], req->spare_prefix, req->spawner_name) != 0)
            return;  /* tried again after the next launch */
    }
}

int spare_take(const struct engine_request *req, struct taken_spare *out)
{
    if (req->spare_prefix[0] == '\0' || req->nprocs == 0 || req->clone_dir[0] != '\0'
        || !same_bases(req) || req->plan_len > MESSAGE_MAX)
        return -1;
    for (int i = 0; i < SPARES; i++) {
        struct spare *sp = &spares[i];
        if (sp->used && !sp->ready) {
            char word[64];
            ssize_t n = recv(sp->sock, word, sizeof(word), MSG_DONTWAIT);
            if (n == 5 && memcmp(word, "ready", 5) == 0)
                sp->ready = 1;
            else if (!(n < 0 && (errno == EAGAIN || errno == EINTR)))
                drop(sp);  /* it failed to move in, or died: made again later */
        }
        for (int d = 0; sp->used && sp->ready && d < nbases; d++) {
            char dir[ENGINE_PATH_MAX + ENGINE_VALUE_MAX + 32];
            struct stat st;
            spare_dir(d, sp->name, dir, sizeof(dir));
            if (stat(dir, &st) != 0)
                drop(sp);  /* removed from outside: it must not cost a run its cgroup */
        }
        if (sp->used && sp->ready) {
            out->pid = sp->pid;
            out->sock = sp->sock;
            snprintf(out->name, sizeof(out->name), "%s", sp->name);
            sp->used = 0;
            return 0;
        }
    }
    return -1;
}

/* --- the request over a spare's directories ------------------------------------------------ */

static char arena[128 * 1024];
static size_t arena_used;

static const char *moved(const struct engine_request *req, const char *name, const char *path,
                         int *bad)
{
    for (int i = 0; i < req->ndirs && path[0] != '\0'; i++) {
        size_t len = strlen(req->dirs[i]);
        if (strncmp(path, req->dirs[i], len) != 0 || (path[len] != '/' && path[len] != '\0'))
            continue;
        size_t room = sizeof(arena) - arena_used;
        int n = snprintf(arena + arena_used, room, "%s/%s%s", bases[i], name, path + len);
        if (n < 0 || (size_t)n >= room) {
            *bad = 1;
            return path;
        }
        const char *out = arena + arena_used;
        arena_used += (size_t)n + 1;
        return out;
    }
    return path;
}

int spare_paths(const struct engine_request *req, const char *name, struct engine_request *out)
{
    int bad = 0;
    arena_used = 0;
    *out = *req;
    out->cpu_path = moved(req, name, req->cpu_path, &bad);
    for (int i = 0; i < req->nwrites; i++)
        out->writes[i].path = moved(req, name, req->writes[i].path, &bad);
    for (int i = 0; i < req->nprocs; i++)
        out->procs[i] = moved(req, name, req->procs[i], &bad);
    out->kill_file = moved(req, name, req->kill_file, &bad);
    out->freezer = moved(req, name, req->freezer, &bad);
    out->events = moved(req, name, req->events, &bad);
    for (int i = 0; i < req->nusage; i++)
        out->usage[i].path = moved(req, name, req->usage[i].path, &bad);
    for (int i = 0; i < req->nresets; i++)
        out->resets[i].path = moved(req, name, req->resets[i].path, &bad);
    for (int i = 0; i < req->ndirs; i++)  /* last: the others match the old ones */
        out->dirs[i] = moved(req, name, req->dirs[i], &bad);
    return bad ? -1 : 0;
}
