/* Layout of ferry's setsockopt watch (c/sockopts.bpf.c), shared with the
 * agent. ferry-ebpf's src/sockopt_watch.rs mirrors it with the same size
 * and offset assertions: keep the two in step.
 *
 * The watch runs while a process is prepared for an incremental
 * collective migration: ferryd reads the options of the process's TCP
 * connections before the freeze, and inside the freeze reads again only
 * those of connections some setsockopt call touched since. */
#ifndef FERRY_SOCKOPTS_H
#define FERRY_SOCKOPTS_H

#include <linux/types.h>

/* Key of FERRY_SO_TOUCHED: one connection, as its own socket sees it.
 * Every byte is written (unused address words are 0), as the hash covers
 * them all. */
struct ferry_sockopt_key {
	__u64 netns;	     /* the socket's network namespace cookie */
	__u32 family;	     /* AF_INET or AF_INET6 */
	__u16 local_port;    /* host byte order */
	__u16 remote_port;   /* host byte order */
	__u32 local_addr[4]; /* network byte order; IPv4 in word 0 */
	__u32 remote_addr[4];
};

/* Entries of FERRY_SO_TOUCHED: far more than the connections a migrating
 * process holds; a full map is counted (FERRY_SO_LOST) and the agent then
 * reads every connection again. */
#define FERRY_SO_TOUCHED_MAX 16384

#endif
