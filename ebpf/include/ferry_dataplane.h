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
 * another node's. The combinations the agent uses, along a migration:
 *   OWNED             a process here serves the port
 *   OWNED|RECORD      source, just before the freeze: deliver, and log a
 *                     copy of what was delivered (the destination is
 *                     already capturing: the log tells which of its
 *                     captured packets the source has handled)
 *   OWNED|RECORD|HOLD_NEW  source from Arm (the destination captures) to
 *                     the freeze: as OWNED|RECORD, but a TCP SYN is not
 *                     delivered (the destination keeps it, and replays it
 *                     to the restored listener): no handshake starts here
 *                     that the dump would find half done or queued
 *   FROZEN            destination, reserved: nothing in, nothing out
 *   FROZEN|CAPTURE    source while frozen, destination while armed: keep
 *                     every incoming packet in the capture ring, send
 *                     nothing
 *   OWNED|CAPTURE     the node resuming the process: egress open, ingress
 *                     still captured while the captured packets are
 *                     replayed, so none is overtaken */
#define FERRY_PORT_OWNED 1u   /* deliver to this node's stack */
#define FERRY_PORT_FROZEN 2u  /* drop both ways (no RST can leave) */
#define FERRY_PORT_CAPTURE 4u /* ingress: copy into FERRY_CAPTURE, drop */
#define FERRY_PORT_RECORD 8u  /* ingress: copy into FERRY_CAPTURE, deliver */
#define FERRY_PORT_HOLD_NEW 16u /* ingress: a TCP SYN (no ACK) is dropped */
/* The port is a distributed server's: a group of nodes serves it (the
 * XtreemOS distributed servers). A TCP connection listed in FERRY_FLOWS is
 * decided by its entry there, whose value takes the same flags (OWNED,
 * FROZEN, CAPTURE; 0 is not used). Every other packet is decided by the
 * port's other flags: the contact node has OWNED (new connections and the
 * ones it keeps), the other members have none. */
#define FERRY_PORT_SHARED 32u

/* Key of FERRY_FLOWS: one TCP connection of a shared port, seen from this
 * node (the local address is the cluster's public one on every node). */
struct ferry_flow_key {
	__be32 remote_addr; /* network byte order, as in the IP header */
	__u16 remote_port;  /* host byte order */
	__u16 local_port;   /* host byte order */
};

/* Key of FERRY_FLOWS6: the same for a connection over IPv6. A map of its
 * own (not FERRY_FLOWS with wider keys) so that the maps an earlier ferryd
 * pinned keep their layout across an upgrade. */
struct ferry_flow6_key {
	__u8 remote_addr[16]; /* network byte order, as in the IPv6 header */
	__u16 remote_port;    /* host byte order */
	__u16 local_port;     /* host byte order */
};

/* Indices of FERRY_COUNTERS (per-CPU __u64). */
enum ferry_counter {
	FERRY_CNT_PASSED = 0,            /* ingress to an owned port, delivered */
	FERRY_CNT_DROPPED_NOT_OWNED = 1, /* ingress to another node's port */
	FERRY_CNT_DROPPED_FROZEN = 2,    /* ingress to a frozen port, not captured; a SYN held (HOLD_NEW) */
	FERRY_CNT_PASSED_OTHER = 3,      /* ingress without ports: ARP, ICMP, ICMPv6, later fragments */
	FERRY_CNT_EGRESS_BLOCKED = 4,    /* egress from a frozen port (RST or data) */
	FERRY_CNT_CAPTURED = 5,          /* ingress kept in the capture ring */
	FERRY_CNT_CAPTURE_LOST = 6,      /* to capture, but the ring was full: dropped */
	FERRY_CNT_RECORDED = 7,          /* delivered and logged (RECORD) */
	FERRY_CNT_MAX = 8,
};

/* A record of FERRY_CAPTURE: this header, then cap_len bytes of the packet
 * from its IP header on, IPv4 or IPv6 (the version field of its first byte
 * tells; the Ethernet header is not kept: the agent re-injects at the IP
 * layer). */
struct ferry_capture_hdr {
	__u64 ktime_ns; /* bpf_ktime_get_ns() at ingress */
	__u32 pkt_len;  /* length of the IP packet */
	__u32 cap_len;  /* bytes of it in this record (< pkt_len: truncated) */
	__u16 port;     /* the port the packet is for, host byte order */
	__u8 proto;     /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 kind;      /* enum ferry_capture_kind */
	__u32 pad;
};

enum ferry_capture_kind {
	FERRY_CAPTURED = 0,  /* dropped here, to be replayed */
	FERRY_DELIVERED = 1, /* delivered here (RECORD) */
};

_Static_assert(sizeof(struct ferry_port_key) == 4, "ferry_port_key is 4 bytes");
_Static_assert(__builtin_offsetof(struct ferry_port_key, proto) == 0, "proto at 0");
_Static_assert(__builtin_offsetof(struct ferry_port_key, pad) == 1, "pad at 1");
_Static_assert(__builtin_offsetof(struct ferry_port_key, port) == 2, "port at 2");
_Static_assert(sizeof(struct ferry_flow_key) == 8, "ferry_flow_key is 8 bytes");
_Static_assert(__builtin_offsetof(struct ferry_flow_key, remote_port) == 4, "remote_port at 4");
_Static_assert(__builtin_offsetof(struct ferry_flow_key, local_port) == 6, "local_port at 6");
_Static_assert(sizeof(struct ferry_flow6_key) == 20, "ferry_flow6_key is 20 bytes");
_Static_assert(__builtin_offsetof(struct ferry_flow6_key, remote_port) == 16, "remote_port at 16");
_Static_assert(__builtin_offsetof(struct ferry_flow6_key, local_port) == 18, "local_port at 18");
_Static_assert(sizeof(struct ferry_capture_hdr) == 24, "ferry_capture_hdr is 24 bytes");
_Static_assert(__builtin_offsetof(struct ferry_capture_hdr, pkt_len) == 8, "pkt_len at 8");
_Static_assert(__builtin_offsetof(struct ferry_capture_hdr, cap_len) == 12, "cap_len at 12");
_Static_assert(__builtin_offsetof(struct ferry_capture_hdr, port) == 16, "port at 16");
_Static_assert(__builtin_offsetof(struct ferry_capture_hdr, proto) == 18, "proto at 18");
_Static_assert(__builtin_offsetof(struct ferry_capture_hdr, kind) == 19, "kind at 19");
_Static_assert(FERRY_CNT_MAX == 8, "src/maps.rs knows eight counters");

#endif
