/* Layouts shared by ferry's eBPF programs and the agent (ferry-ebpf's
 * src/maps.rs mirrors them; keep the two in step). */
#ifndef FERRY_DATAPLANE_H
#define FERRY_DATAPLANE_H

#include <linux/types.h>

/* Key of FERRY_PORTS: a transport port on the node's public address. */
struct ferry_port_key {
	__u8 proto; /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 pad;   /* always 0, so equal ports hash equally */
	__u16 port; /* host byte order */
};

/* Value of FERRY_PORTS: flags. A port absent from the map is another
 * node's. */
#define FERRY_PORT_OWNED 1u  /* deliver to this node's stack */
#define FERRY_PORT_FROZEN 2u /* a migration is freezing the process: drop both ways */

/* Indices of FERRY_COUNTERS (per-CPU u64). */
enum ferry_counter {
	FERRY_CNT_PASSED = 0,            /* owned port, delivered */
	FERRY_CNT_DROPPED_NOT_OWNED = 1, /* another node's port */
	FERRY_CNT_DROPPED_FROZEN = 2,    /* ingress to a frozen port */
	FERRY_CNT_PASSED_OTHER = 3,      /* not TCP/UDP over IPv4: ARP, ICMP, ... */
	FERRY_CNT_EGRESS_BLOCKED = 4,    /* egress from a frozen port */
	FERRY_CNT_MAX = 5,
};

_Static_assert(sizeof(struct ferry_port_key) == 4, "ferry_port_key must be 4 bytes");

#endif
