/* ferry's per-connection handoff for distributed servers (libferry_handoff).
 *
 * A group of server processes on several nodes of a ferry cluster serves
 * one port of the cluster's address. A process hands one established TCP
 * connection to the group's process on another node, which goes on with
 * it as if it had accepted it; the client notices nothing. The calls talk
 * to the node's ferryd over $FERRY_HANDOFF_SOCKET (default
 * /run/ferry/handoff.sock). Each returns -1 on failure, with errno set and
 * the reason in ferry_handoff_error(). */
#ifndef FERRY_HANDOFF_H
#define FERRY_HANDOFF_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Registers the calling process as a server of the group on `port`.
 * Returns a channel descriptor, readable when a connection is handed to
 * the process (keep it open to stay a server), or -1 (EPERM: the process
 * is not one ferryd manages; ENOENT: no group on the port takes this
 * node). */
int ferry_serve(uint16_t port);

/* Takes the next connection handed to this process on `channel`. Copies
 * the donor's state into `state` (at most *state_len bytes) and sets
 * *state_len to its whole length. Returns the connection's descriptor, or
 * -1. If ferryd restarted (the channel closed), registers again first, on
 * the same descriptor number, for up to 30 s. */
int ferry_accept(int channel, void *state, size_t *state_len);

/* Hands `conn` to the group's server on `node`, with `state_len` bytes of
 * `state` (at most 65536) for it. `drain_ms` > 0: first wait up to that
 * long for the client to acknowledge what was sent. Returns 0: the
 * connection is the acceptor's, close `conn` (nothing is sent); or -1: it
 * is still the caller's, untouched (ENOTCONN: not an established
 * connection of a group's port; ENOENT: `node` is not in the group; EBUSY:
 * a handoff of it is under way; ECONNREFUSED: the acceptor has no server;
 * EHOSTUNREACH: the acceptor failed before taking it; EPERM: the caller
 * does not serve the group). */
int ferry_handoff(int conn, const char *node, const void *state, size_t state_len,
		  uint32_t drain_ms);

/* Which member of the group on `port` should serve a new connection, by
 * the group's placement policy: its name is copied into `node` (with its
 * NUL, at most `node_len` bytes). Returns 1 if it is this node (serve it
 * here), 0 if another (hand the connection to it), or -1. */
int ferry_place(uint16_t port, char *node, size_t node_len);

/* The reason of this thread's last failed call. */
const char *ferry_handoff_error(void);

#ifdef __cplusplus
}
#endif

#endif
