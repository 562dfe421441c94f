/* Layouts of ferry's in-cluster address translation (c/translate.bpf.c),
 * shared with the agent. ferry-ebpf's src/translate_maps.rs mirrors them
 * with the same size and offset assertions: keep the two in step.
 *
 * The translation runs on the node of a migrated process's PEER. The
 * process was at remote_addr (its old node's cluster address) and is now
 * at new_addr; the peer's socket must keep seeing remote_addr:
 *   egress  (peer -> process): destination remote_addr -> new_addr
 *   ingress (process -> peer): source      new_addr    -> remote_addr
 * Addresses and ports are kept in network byte order, as in the packet, so
 * the programs compare header fields without converting them. */
#ifndef FERRY_TRANSLATE_H
#define FERRY_TRANSLATE_H

#include <linux/types.h>

/* Key of FERRY_XL_RULES: the flow as the peer's socket sees it, and of
 * FERRY_XL_REV, where remote_addr is the NEW address instead (the source
 * of an incoming packet). The hash covers every byte: pad is always 0. */
struct ferry_xlate_key {
	__be32 local_addr;  /* the peer socket's own address */
	__be32 remote_addr; /* RULES: the old address; REV: the new one */
	__be16 local_port;
	__be16 remote_port;
	__u8 proto; /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 pad[3];
};

/* Value of FERRY_XL_RULES: where the remote end is now, and what the
 * programs saw of the flow. The agent writes new_addr (and zeroes the
 * rest) when it adds a rule; the programs only add to the counters and
 * store last_seen_ns. The flag counts tell the agent when a TCP
 * connection is over, so that it can remove the rule: a FIN each way, or
 * an RST either way. */
struct ferry_xlate_rule {
	__be32 new_addr;
	__u32 pad;
	__u64 packets_egress;  /* translated peer -> process */
	__u64 packets_ingress; /* translated process -> peer */
	__u64 last_seen_ns;    /* bpf_ktime_get_ns() (CLOCK_MONOTONIC) of the last one */
	__u32 fin_egress;      /* TCP segments with FIN sent by the peer */
	__u32 fin_ingress;     /* ... received from the process */
	__u32 rst_egress;      /* TCP segments with RST sent by the peer */
	__u32 rst_ingress;     /* ... received from the process */
};

/* Key of FERRY_XL_FRAGS: an IPv4 datagram whose first fragment was
 * translated, as its later fragments (which carry no ports) arrive, i.e.
 * with the addresses before translation. The value (__be32) is the address
 * that replaces daddr (egress) or saddr (ingress). Internal to the
 * programs; the agent never reads it. */
struct ferry_xlate_frag_key {
	__be32 saddr;
	__be32 daddr;
	__be16 id;
	__u8 proto;
	__u8 dir; /* enum ferry_xlate_dir */
};

enum ferry_xlate_dir {
	FERRY_XL_EGRESS = 0,
	FERRY_XL_INGRESS = 1,
};

/* Indices of FERRY_XL_COUNT (per-CPU __u64). */
enum ferry_xlate_counter {
	/* Packets translated peer -> process, later fragments included. */
	FERRY_XL_CNT_EGRESS = 0,
	/* Packets translated process -> peer, later fragments included. */
	FERRY_XL_CNT_INGRESS = 1,
	/* Left alone: no rule, not TCP/UDP, not IPv4. */
	FERRY_XL_CNT_PASSED = 2,
	/* IPv4 whose headers cannot be read or do not add up: left alone. */
	FERRY_XL_CNT_MALFORMED = 3,
	/* Translated egress sent with bpf_redirect_neigh() (no usable FIB
	 * answer: forwarding off, or no neighbour yet). Each passes tc egress
	 * once more and counts as PASSED then. */
	FERRY_XL_CNT_REDIRECT_NEIGH = 4,
	/* Matched, but no route to the new address or a rewrite helper
	 * failed: dropped (TCP retransmits). */
	FERRY_XL_CNT_DROPPED = 5,
	FERRY_XL_CNT_MAX = 6,
};

_Static_assert(sizeof(struct ferry_xlate_key) == 16, "ferry_xlate_key is 16 bytes");
_Static_assert(__builtin_offsetof(struct ferry_xlate_key, local_addr) == 0, "local_addr at 0");
_Static_assert(__builtin_offsetof(struct ferry_xlate_key, remote_addr) == 4, "remote_addr at 4");
_Static_assert(__builtin_offsetof(struct ferry_xlate_key, local_port) == 8, "local_port at 8");
_Static_assert(__builtin_offsetof(struct ferry_xlate_key, remote_port) == 10, "remote_port at 10");
_Static_assert(__builtin_offsetof(struct ferry_xlate_key, proto) == 12, "proto at 12");
_Static_assert(__builtin_offsetof(struct ferry_xlate_key, pad) == 13, "pad at 13");
_Static_assert(sizeof(struct ferry_xlate_rule) == 48, "ferry_xlate_rule is 48 bytes");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, new_addr) == 0, "new_addr at 0");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, packets_egress) == 8, "packets_egress at 8");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, packets_ingress) == 16, "packets_ingress at 16");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, last_seen_ns) == 24, "last_seen_ns at 24");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, fin_egress) == 32, "fin_egress at 32");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, fin_ingress) == 36, "fin_ingress at 36");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, rst_egress) == 40, "rst_egress at 40");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, rst_ingress) == 44, "rst_ingress at 44");
_Static_assert(sizeof(struct ferry_xlate_frag_key) == 12, "ferry_xlate_frag_key is 12 bytes");
_Static_assert(__builtin_offsetof(struct ferry_xlate_frag_key, id) == 8, "id at 8");
_Static_assert(__builtin_offsetof(struct ferry_xlate_frag_key, proto) == 10, "proto at 10");
_Static_assert(__builtin_offsetof(struct ferry_xlate_frag_key, dir) == 11, "dir at 11");
_Static_assert(FERRY_XL_CNT_MAX == 6, "src/translate_maps.rs knows six counters");

#endif
