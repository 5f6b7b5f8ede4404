/* The launch engine: a small standalone program that runs one-shot launches for a host process
 * (nsbox/host/engine.py starts it once with posix_spawn and keeps a control socket to it).
 *
 * Every decision is the host's: the flat plan (nsbox/sandbox/native.py, flatten), the run's
 * cgroup as a list of directories, file writes and files to read, the id maps as their text.
 * The engine executes them in order, clones the sandbox with the native core's child
 * (child.c), supervises it and reports. Its messages, host -> engine (control socket, one
 * datagram, or {"memfd": SIZE} and a memfd last, as nsbox/_sys/wire.py sends large ones), in the
 * flat plan's item format ('i' + int64 little-endian, 's' + uint32 length + bytes + NUL):
 *
 *   i ENGINE_FORMAT
 *   i wall time limit in microseconds, or -1
 *   i CPU time limit in nanoseconds, or -1; s the file polled for it, s its key ("": the
 *     whole file is the number), i nanoseconds per unit of that number
 *   i 1: write "deny" to /proc/PID/setgroups first; s uid_map; s gid_map
 *   i N, N x s: the run's cgroup directories, made in this order (removed in the reverse)
 *   i N, N x (s path, s value): the limits, written after the directories exist (a value
 *     "?V": V, where the file exists)
 *   i N, N x s: cgroup.procs files the child's pid is written to before its release (v1)
 *   s a cgroup v2 directory to clone the child into (clone3, CLONE_INTO_CGROUP), or ""
 *   s a cgroup.kill file, or ""; s a v1 freezer directory, or ""
 *   s a cgroup.events file ("populated"), or "": then the directories' cgroup.procs say
 *   i N, N x (s name, s path, s key): the usage to read after the run, each an integer
 *   s the name prefix of spare cgroups (v1: each waits with a spawner, so that a child is
 *     born in its cgroup), or "": none; s the spawners' process name; i N, N x (s path,
 *     s value): written once a spawner has left the run's cgroup (its peak memory reset)
 *   i the number of bind sources among the descriptors
 *   s the flat plan; its descriptors by index: 0-2 the standard streams, 3 and 4 the sync and
 *     error pipes (made here), 5... the bind sources
 *
 * with SCM_RIGHTS [launch socket, stdin, stdout, stderr, bind sources...]. The replies go on
 * the launch socket, in the events of the Python helper (nsbox/helper/loop.py): {"event":
 * "pid", "pid": N} with the pidfd, then {"event": "exit", "engine": 1, ...} with the raw
 * figures, which the host turns into the helper's report (nsbox/host/engine.py, report).
 */
#ifndef NSBOX_NATIVE_ENGINE_H
#define NSBOX_NATIVE_ENGINE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define ENGINE_FORMAT 2

#define ENGINE_MAX_DIRS 16     /* a run's directories: one per v1 hierarchy and the unified one */
#define ENGINE_MAX_WRITES 32
#define ENGINE_MAX_USAGE 16
#define ENGINE_MAX_SOURCES 200 /* with the 4 streams and a memfd: under SCM_MAX_FD (253) */
#define ENGINE_PATH_MAX 4096
#define ENGINE_VALUE_MAX 64
#define ENGINE_MAP_MAX 1024

struct engine_usage {
    const char *name, *path, *key;
};

struct engine_write {
    const char *path, *value;
};

/* One launch request, parsed; every string points into the message (NUL-terminated). */
struct engine_request {
    long long wall_us, cpu_ns;
    const char *cpu_path, *cpu_key;
    long long cpu_scale;
    int deny_setgroups;
    const char *uid_map, *gid_map;
    int ndirs;
    const char *dirs[ENGINE_MAX_DIRS];
    int nwrites;
    struct engine_write writes[ENGINE_MAX_WRITES];
    int nprocs;
    const char *procs[ENGINE_MAX_DIRS];
    const char *clone_dir, *kill_file, *freezer, *events;
    int nusage;
    struct engine_usage usage[ENGINE_MAX_USAGE];
    const char *spare_prefix, *spawner_name;
    int nresets;
    struct engine_write resets[ENGINE_MAX_DIRS];
    int nsources;
    const char *plan;
    size_t plan_len;
};

/* Parse ``len`` bytes at ``msg``: 0, or -1 with *why (a constant string) set. Checks every
 * length, count and range; a path longer than ENGINE_PATH_MAX, a value longer than
 * ENGINE_VALUE_MAX or a map longer than ENGINE_MAP_MAX is malformed. */
int engine_parse(struct engine_request *req, const char *msg, size_t len, const char **why);

#endif

/* --- the run's cgroup as the engine keeps it from its start to its removal (engine_cgroup.c) */

struct engine_cgroup {
    int ndirs;
    char *dirs[ENGINE_MAX_DIRS];
    char *kill_file, *freezer, *events;
    int nusage;
    struct engine_usage usage[ENGINE_MAX_USAGE];
    char *cpu_path, *cpu_key;
    long long cpu_scale;
    char *arena;  /* every string above, one allocation */
};

/* Copy what outlives the request (the directories, the kill and usage files): 0, or -1 with
 * errno ENOMEM. */
int cgroup_keep(struct engine_cgroup *cg, const struct engine_request *req);
void cgroup_free(struct engine_cgroup *cg);
/* Make the request's directories and write its limits (cgroups(7)): 0, or -1 with errno and
 * ``what`` ("mkdir PATH", "write V to PATH") set; what was made is removed again then. */
int cgroup_create(const struct engine_request *req, char *what, size_t what_size);
/* SIGKILL every process of the run: cgroup.kill (cgroups(7), Linux 5.14), or the v1 freezer
 * (freeze, kill each pid, thaw), then each directory's cgroup.procs until they are empty. */
void cgroup_kill_all(const struct engine_cgroup *cg);
/* Remove the directories (last made first): 0 when all are gone, 1 when one is still busy
 * (its processes are exiting: try again), -1 with errno otherwise. */
int cgroup_remove(struct engine_cgroup *cg);
/* The integer in ``path`` (``key`` "") or on its line "KEY N": 0, or -1 (missing, "max", not a
 * number). */
int read_number(const char *path, const char *key, long long *out);

/* --- spares: cgroups made ahead, each with a spawner waiting in it (engine_spare.c) ------- */

/* A spare taken for a launch: its spawner (a fork of the engine running spawner.c) clones the
 * sandbox in the spare's cgroups with CLONE_PARENT, so that the engine is its parent. */
struct taken_spare {
    pid_t pid;
    int sock;
    char name[ENGINE_VALUE_MAX + 24];
};

/* Make spares for the hierarchies of ``req`` (up to two, v1 only: cgroup.procs files and no
 * clone3 directory, and a spare prefix); spares of other hierarchies are dropped. */
void spares_refill(const struct engine_request *req);
/* A ready spare for ``req``'s hierarchies, taken out of the pool: 0, or -1 (none ready). */
int spare_take(const struct engine_request *req, struct taken_spare *out);
/* ``req`` with every path below one of its directories moved to the spare ``name``'s (the
 * strings in a static arena, valid until the next call): 0, or -1 when they do not fit. */
int spare_paths(const struct engine_request *req, const char *name, struct engine_request *out);
/* A spare taken and then not used: its spawner killed and reaped, its directories removed. */
void spare_abandon(struct taken_spare *sp);
/* Kill and reap every spawner, remove the spares (the engine ends). */
void spares_drop_all(void);
