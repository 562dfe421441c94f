/* Layouts shared by ferry's eBPF programs and the agent. ferry-ebpf's
 * src/maps.rs mirrors them with the same size and offset assertions: keep
 * the two in step. */
#ifndef FERRY_DATAPLANE_H
#define FERRY_DATAPLANE_H

#include <linux/types.h>

/* Key of FERRY_PORTS: a transport port on the node's public address. */
struct ferry_port_key {
	__u8 proto; /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 pad;   /* always 0: the hash covers every key byte */
	__u16 port; /* host byte order */
};

/* Value of FERRY_PORTS (__u32): flags. A port absent from the map is
 * another node's. */
#define FERRY_PORT_OWNED 1u  /* deliver to this node's stack */
#define FERRY_PORT_FROZEN 2u /* a migration is dumping the process: drop both ways */

/* Indices of FERRY_COUNTERS (per-CPU __u64). */
enum ferry_counter {
	FERRY_CNT_PASSED = 0,            /* ingress to an owned port, delivered */
	FERRY_CNT_DROPPED_NOT_OWNED = 1, /* ingress to another node's port */
	FERRY_CNT_DROPPED_FROZEN = 2,    /* ingress to a frozen port */
	FERRY_CNT_PASSED_OTHER = 3,      /* ingress without ports: ARP, ICMP, IPv6, later fragments */
	FERRY_CNT_EGRESS_BLOCKED = 4,    /* egress from a frozen port (RST or data) */
	FERRY_CNT_MAX = 5,
};

_Static_assert(sizeof(struct ferry_port_key) == 4, "ferry_port_key is 4 bytes");
_Static_assert(__builtin_offsetof(struct ferry_port_key, proto) == 0, "proto at 0");
_Static_assert(__builtin_offsetof(struct ferry_port_key, pad) == 1, "pad at 1");
_Static_assert(__builtin_offsetof(struct ferry_port_key, port) == 2, "port at 2");
_Static_assert(FERRY_CNT_MAX == 5, "src/maps.rs knows five counters");

#endif
