/* Layouts of ferry's in-cluster address translation (c/translate.bpf.c),
 * shared with the agent. ferry-ebpf's src/translate_maps.rs mirrors them
 * with the same size and offset assertions: keep the two in step.
 *
 * The translation runs on the node of a migrated process's PEER. The
 * process was at remote_addr (its old node's cluster address) and is now
 * at new_addr; the peer's socket must keep seeing remote_addr:
 *   egress  (peer -> process): destination remote_addr -> new_addr
 *   ingress (process -> peer): source      new_addr    -> remote_addr
 * That is a TRANSLATE rule. A HOLD rule drops its flow in both directions
 * instead, on the node of the migrated process itself: while a process
 * moves from A1 to A2, A2 restores its sockets, whose local address is
 * A2's and whose peers are still talking to A1. Until the migration
 * commits, nothing of such a flow may leave A2 (the restored socket's
 * window probe would reach the peer untranslated and be answered with an
 * RST) and nothing of it may reach A2's stack (before the socket exists,
 * the stack itself would answer with an RST). The rule is removed when the
 * migration commits or aborts; TCP's retransmissions deliver what it held.
 * Addresses and ports are kept in network byte order, as in the packet, so
 * the programs compare header fields without converting them. */
#ifndef FERRY_TRANSLATE_H
#define FERRY_TRANSLATE_H

#include <linux/types.h>

/* Key of FERRY_XL_RULES: the flow as the local socket sees it (and sends
 * it), and of FERRY_XL_REV: the flow as incoming packets carry it, where
 * remote_addr is a translate rule's NEW address instead (the source of an
 * incoming packet); a hold rule's two keys are the same. The hash covers
 * every byte: pad is always 0. */
struct ferry_xlate_key {
	__be32 local_addr;  /* the local socket's own address */
	__be32 remote_addr; /* RULES: the old address (hold: the remote's);
			     * REV: the new one (hold: the same) */
	__be16 local_port;
	__be16 remote_port;
	__u8 proto; /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 pad[3];
};

/* What a rule does with its flow (ferry_xlate_rule.action). */
enum ferry_xlate_action {
	/* Rewrite: egress destination remote_addr -> new_addr, ingress
	 * source new_addr -> remote_addr. */
	FERRY_XL_TRANSLATE = 0,
	/* Drop every packet of the flow, both ways, and count it. */
	FERRY_XL_HOLD = 1,
};

/* Value of FERRY_XL_RULES: what to do with the flow (for a translate rule:
 * where the remote end is now), and what the programs saw of it. The
 * agent writes new_addr and action (and zeroes the rest) when it adds a
 * rule; the programs only add to the counters and store last_seen_ns.
 * The flag counts tell the agent when a TCP connection is over, so that
 * it can remove a translate rule: a FIN each way, or an RST either way. A
 * hold rule counts the packets it dropped, flags included. */
struct ferry_xlate_counts {
	__u64 packets_egress;  /* translated peer -> process (hold: dropped, sent here) */
	__u64 packets_ingress; /* translated process -> peer (hold: dropped, arrived) */
	__u64 last_seen_ns;    /* bpf_ktime_get_ns() (CLOCK_MONOTONIC) of the last one */
	__u32 fin_egress;      /* TCP segments with FIN sent by the peer */
	__u32 fin_ingress;     /* ... received from the process */
	__u32 rst_egress;      /* TCP segments with RST sent by the peer */
	__u32 rst_ingress;     /* ... received from the process */
};

struct ferry_xlate_rule {
	__be32 new_addr; /* hold: remote_addr itself, as FERRY_XL_REV gives it */
	__u32 action;    /* enum ferry_xlate_action */
	struct ferry_xlate_counts c;
};

/* The same over an IPv6 cluster network, in maps of their own
 * (FERRY_XL_RULES6, FERRY_XL_REV6, FERRY_XL_FRAGS6), so that the IPv4 maps
 * an earlier ferryd pinned keep their layout. Addresses in network byte
 * order, as in the packet. */
struct ferry_xlate6_key {
	__u8 local_addr[16];
	__u8 remote_addr[16]; /* as in ferry_xlate_key */
	__be16 local_port;
	__be16 remote_port;
	__u8 proto;
	__u8 pad[3];
};

struct ferry_xlate6_rule {
	__u8 new_addr[16];
	__u32 action;
	__u32 pad;
	struct ferry_xlate_counts c;
};

struct ferry_xlate6_frag_key {
	__u8 saddr[16];
	__u8 daddr[16];
	__be32 id;  /* the fragment header's identification */
	__u8 proto; /* the fragment header's next header */
	__u8 dir;
	__u8 pad[2];
};

struct ferry_xlate6_frag {
	__u8 addr[16];
	__u32 action;
	__u32 pad;
};

/* Key of FERRY_XL_FRAGS: an IPv4 datagram whose first fragment was
 * translated or held, as its later fragments (which carry no ports)
 * arrive, i.e. with the addresses before translation. The value is
 * ferry_xlate_frag. Internal to the programs; the agent never reads it. */
struct ferry_xlate_frag_key {
	__be32 saddr;
	__be32 daddr;
	__be16 id;
	__u8 proto;
	__u8 dir; /* enum ferry_xlate_dir */
};

/* Value of FERRY_XL_FRAGS: what was done to the first fragment. */
struct ferry_xlate_frag {
	__be32 addr;  /* translate: replaces daddr (egress) or saddr (ingress) */
	__u32 action; /* enum ferry_xlate_action: hold drops the fragment */
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
	/* Left alone: no rule, not TCP/UDP, neither IPv4 nor IPv6. */
	FERRY_XL_CNT_PASSED = 2,
	/* IPv4 or IPv6 whose headers cannot be read or do not add up: left
	 * alone. */
	FERRY_XL_CNT_MALFORMED = 3,
	/* Translated egress sent with bpf_redirect_neigh() (no usable FIB
	 * answer: forwarding off, or no neighbour yet). Each passes tc egress
	 * once more and counts as PASSED then. */
	FERRY_XL_CNT_REDIRECT_NEIGH = 4,
	/* Matched, but no route to the new address or a rewrite helper
	 * failed: dropped (TCP retransmits). */
	FERRY_XL_CNT_DROPPED = 5,
	/* Packets of a held flow, either way, later fragments included:
	 * dropped on purpose (not in DROPPED). */
	FERRY_XL_CNT_HELD = 6,
	FERRY_XL_CNT_MAX = 7,
};

/* The agent pins these maps and reopens them after a restart or upgrade.
 * There is no version number: a pinned map is reused only if its type, key
 * and value sizes and max_entries are this build's (src/pin.rs), so a
 * change in what the bytes of a map mean must change one of those, or a
 * new build would misread an old build's pins (and the reverse). Hold
 * rules did: the value of FERRY_XL_FRAGS grew from a bare address to
 * ferry_xlate_frag (4 -> 8 bytes) and FERRY_XL_COUNT from 6 to 7 entries.
 * (ferry_xlate_rule.action took the place of a pad that was always 0, and
 * 0 is FERRY_XL_TRANSLATE.) */

_Static_assert(sizeof(struct ferry_xlate_key) == 16, "ferry_xlate_key is 16 bytes");
_Static_assert(__builtin_offsetof(struct ferry_xlate_key, local_addr) == 0, "local_addr at 0");
_Static_assert(__builtin_offsetof(struct ferry_xlate_key, remote_addr) == 4, "remote_addr at 4");
_Static_assert(__builtin_offsetof(struct ferry_xlate_key, local_port) == 8, "local_port at 8");
_Static_assert(__builtin_offsetof(struct ferry_xlate_key, remote_port) == 10, "remote_port at 10");
_Static_assert(__builtin_offsetof(struct ferry_xlate_key, proto) == 12, "proto at 12");
_Static_assert(__builtin_offsetof(struct ferry_xlate_key, pad) == 13, "pad at 13");
_Static_assert(sizeof(struct ferry_xlate_rule) == 48, "ferry_xlate_rule is 48 bytes");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, new_addr) == 0, "new_addr at 0");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, action) == 4, "action at 4");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, c.packets_egress) == 8, "packets_egress at 8");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, c.packets_ingress) == 16, "packets_ingress at 16");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, c.last_seen_ns) == 24, "last_seen_ns at 24");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, c.fin_egress) == 32, "fin_egress at 32");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, c.fin_ingress) == 36, "fin_ingress at 36");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, c.rst_egress) == 40, "rst_egress at 40");
_Static_assert(__builtin_offsetof(struct ferry_xlate_rule, c.rst_ingress) == 44, "rst_ingress at 44");
_Static_assert(sizeof(struct ferry_xlate6_key) == 40, "ferry_xlate6_key is 40 bytes");
_Static_assert(__builtin_offsetof(struct ferry_xlate6_key, remote_addr) == 16, "remote_addr at 16");
_Static_assert(__builtin_offsetof(struct ferry_xlate6_key, local_port) == 32, "local_port at 32");
_Static_assert(__builtin_offsetof(struct ferry_xlate6_key, remote_port) == 34, "remote_port at 34");
_Static_assert(__builtin_offsetof(struct ferry_xlate6_key, proto) == 36, "proto at 36");
_Static_assert(sizeof(struct ferry_xlate6_rule) == 64, "ferry_xlate6_rule is 64 bytes");
_Static_assert(__builtin_offsetof(struct ferry_xlate6_rule, action) == 16, "action at 16");
_Static_assert(__builtin_offsetof(struct ferry_xlate6_rule, c) == 24, "counts at 24");
_Static_assert(sizeof(struct ferry_xlate6_frag_key) == 40, "ferry_xlate6_frag_key is 40 bytes");
_Static_assert(sizeof(struct ferry_xlate6_frag) == 24, "ferry_xlate6_frag is 24 bytes");
_Static_assert(sizeof(struct ferry_xlate_frag_key) == 12, "ferry_xlate_frag_key is 12 bytes");
_Static_assert(__builtin_offsetof(struct ferry_xlate_frag_key, id) == 8, "id at 8");
_Static_assert(__builtin_offsetof(struct ferry_xlate_frag_key, proto) == 10, "proto at 10");
_Static_assert(__builtin_offsetof(struct ferry_xlate_frag_key, dir) == 11, "dir at 11");
_Static_assert(sizeof(struct ferry_xlate_frag) == 8, "ferry_xlate_frag is 8 bytes");
_Static_assert(__builtin_offsetof(struct ferry_xlate_frag, action) == 4, "frag action at 4");
_Static_assert(FERRY_XL_CNT_MAX == 7, "src/translate_maps.rs knows seven counters");

#endif
