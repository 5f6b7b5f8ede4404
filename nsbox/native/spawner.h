/* The spawner loop in C (spawner.c). */
#ifndef NSBOX_NATIVE_SPAWNER_H
#define NSBOX_NATIVE_SPAWNER_H

/* In a fresh clone of the helper: serve one launch as a spawner, then exit. Returns 0 only in
 * a sandbox child for the Python child ("clone"), which goes on in Python. */
long spawner_main(int sock, const int *procs, int nprocs, unsigned long flags,
                  const char *spawner_name, const char *sandbox_name);

#endif
