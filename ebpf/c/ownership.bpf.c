// SPDX-License-Identifier: GPL-2.0
/*
 * Port ownership on a node's public interface in ferry's single-IP cluster.
 *
 * Every node carries the same public address and the router floods every
 * frame for it to all nodes, so each node must keep exactly the packets of
 * the ports it owns and drop the rest before its stack sees them: a node
 * that does not own a port must not answer with an RST or an ICMP port
 * unreachable. The frames arrive with the broadcast destination MAC, so
 * the skb is PACKET_BROADCAST: TCP silently discards those (tcp_v4_rcv), so
 * owned packets are turned into PACKET_HOST; UDP does not look, which is
 * why non-owned UDP must be dropped here too.
 *
 * Why tc and not XDP (checked on Linux 6.18, veth as in the tests):
 *  - XDP cannot set pkt_type, it can only rewrite h_dest to the device's
 *    MAC. In driver mode on veth that does not help: veth_forward_skb()
 *    already ran eth_type_trans() (pkt_type = PACKET_BROADCAST) before the
 *    program, and the eth_type_trans() after it never sets PACKET_HOST, it
 *    only leaves pkt_type alone for our own MAC. A tc program behind a
 *    driver-mode XDP program that rewrote h_dest saw our MAC with
 *    PACKET_BROADCAST, and the TCP connect timed out. Generic (skb) XDP
 *    with the same rewrite did connect: that path resets pkt_type when the
 *    program changed the destination's class. On a physical NIC the skb is
 *    built after the program, so driver-mode XDP plus a rewrite would work
 *    there, but it needs the MAC passed in and a second program anyway:
 *  - XDP has no egress hook, and the egress guard below must be tc.
 * bpf_skb_change_type() at tc ingress is simple, runs before ip_rcv(), and
 * works the same on veth and real NICs.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/in.h>
#include <linux/in6.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "ferry_dataplane.h"

#define IP_MF 0x2000     /* more fragments flag of iphdr.frag_off */
#define IP_OFFSET 0x1FFF /* fragment offset field of iphdr.frag_off */
#define TCP_BYTE_SYN 0x02 /* SYN in byte 13 of the TCP header */
#define TCP_BYTE_ACK 0x10 /* ACK in byte 13 of the TCP header */
#define IP6_OFFSET 0xFFF8 /* fragment offset of the IPv6 fragment header */
#define IP6_MF 0x0001     /* more fragments flag of the IPv6 fragment header */
/* IPv6 extension headers followed before the transport header. More is
 * not a packet any sender makes (RFC 8200 recommends each at most once);
 * such a packet is dropped rather than let past the ownership check. */
#define IP6_MAX_EXT_HDRS 6

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536); /* far more ports than a node serves */
	__type(key, struct ferry_port_key);
	__type(value, __u32);
} FERRY_PORTS SEC(".maps");

/* The TCP connections of shared ports that are decided one by one: those
 * handed off to or from this node (a per-connection handoff of a
 * distributed server), and on the contact node those served elsewhere.
 * 65536 entries: a contact node hands off tens of thousands of clients. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct ferry_flow_key);
	__type(value, __u32);
} FERRY_FLOWS SEC(".maps");

/* The same for connections over IPv6. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct ferry_flow6_key);
	__type(value, __u32);
} FERRY_FLOWS6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FERRY_CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} FERRY_COUNTERS SEC(".maps");

/* Packets kept while a migration moves a process: captured ones (dropped
 * here, replayed into the stack later) and, on the source, a log of the
 * ones it delivered while the destination already captured. One ring for
 * all CPUs, so records come out in the order the programs reserved them,
 * which is the order the packets arrived in. 32 MiB holds a freeze's worth
 * of traffic: TCP senders stop after a window without acknowledgements. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 32 << 20);
} FERRY_CAPTURE SEC(".maps");

/* Later fragments carry no ports. When fragment zero of a datagram is
 * captured, its identity goes here, so that the rest of the datagram is
 * captured with it and the replay can reassemble it. */
struct ferry_frag_key {
	__be32 saddr;
	__be32 daddr;
	__be16 id;
	__u8 proto;
	__u8 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct ferry_frag_key);
	__type(value, __u16); /* the datagram's destination port */
} FERRY_FRAGS SEC(".maps");

/* The same for IPv6, whose fragments carry a 32-bit identification in a
 * fragment header. */
struct ferry_frag6_key {
	__u8 saddr[16];
	__u8 daddr[16];
	__be32 id;
	__u8 proto; /* the fragment header's next header */
	__u8 pad[3];
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct ferry_frag6_key);
	__type(value, __u16);
} FERRY_FRAGS6 SEC(".maps");

static __always_inline void count(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&FERRY_COUNTERS, &idx);

	/* Per-CPU slot: no other CPU writes it, a plain add is enough. */
	if (v)
		*v += 1;
}

enum l4_kind {
	L4_OTHER,     /* not TCP or UDP over IPv4 or IPv6 */
	L4_FRAGMENT,  /* TCP or UDP, but a later fragment: no ports in it */
	L4_TRUNCATED, /* TCP or UDP whose ports cannot be read */
	L4_PORTS,
};

struct l4 {
	__u8 ipv6;           /* the addresses are frag6's, not frag's */
	__u8 proto;
	__u8 first_fragment; /* offset 0 with more fragments to come */
	__u8 tcp_flags;      /* TCP: the header's flags byte (FIN..CWR) */
	__u16 sport;         /* host byte order */
	__u16 dport;         /* host byte order */
	struct ferry_frag_key frag;   /* IPv4: also the addresses, for FERRY_FLOWS */
	struct ferry_frag6_key frag6; /* IPv6: also the addresses, for FERRY_FLOWS6 */
};

/* Reads the ports (and TCP's flags) of the transport header at `off`. */
static __always_inline enum l4_kind parse_ports(struct __sk_buff *skb, struct l4 *l4, __u32 off)
{
	__be16 ports[2];

	/* TCP and UDP both start with the source and destination port. */
	if (bpf_skb_load_bytes(skb, off, ports, sizeof(ports)) < 0)
		return L4_TRUNCATED;
	l4->sport = bpf_ntohs(ports[0]);
	l4->dport = bpf_ntohs(ports[1]);
	/* TCP's flags: byte 13 of its header. */
	if (l4->proto == IPPROTO_TCP && bpf_skb_load_bytes(skb, off + 13, &l4->tcp_flags, 1) < 0)
		return L4_TRUNCATED;
	return L4_PORTS;
}

/* The first 8 bytes of an IPv6 extension header: all of a fragment
 * header; next header and length of the others. */
struct ip6_ext8 {
	__u8 nexthdr;
	__u8 hdrlen;
	__be16 frag_off; /* fragment header: offset << 3 | M */
	__be32 id;       /* fragment header: identification */
};

/* Finds protocol and ports of an IPv6 TCP or UDP packet, following the
 * extension headers a sender may put before the transport header. */
static __always_inline enum l4_kind parse6(struct __sk_buff *skb, struct l4 *l4)
{
	struct ipv6hdr ip6;
	struct ip6_ext8 ext;
	__u32 off = ETH_HLEN + sizeof(ip6);
	__u8 next;
	int i;

	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6)) < 0 || ip6.version != 6)
		return L4_OTHER;
	l4->ipv6 = 1;
	__builtin_memcpy(l4->frag6.saddr, &ip6.saddr, 16);
	__builtin_memcpy(l4->frag6.daddr, &ip6.daddr, 16);
	next = ip6.nexthdr;
#pragma unroll
	for (i = 0; i < IP6_MAX_EXT_HDRS; i++) {
		if (next == IPPROTO_TCP || next == IPPROTO_UDP) {
			l4->proto = next;
			return parse_ports(skb, l4, off);
		}
		/* ICMPv6 (neighbour discovery, errors about our own
		 * connections), no next header, ESP, ...: not ours to judge. */
		if (next != IPPROTO_HOPOPTS && next != IPPROTO_ROUTING && next != IPPROTO_DSTOPTS &&
		    next != IPPROTO_FRAGMENT)
			return L4_OTHER;
		/* A chain that cannot be followed hides its ports: dropped,
		 * as the stack would. */
		if (bpf_skb_load_bytes(skb, off, &ext, sizeof(ext)) < 0)
			return L4_TRUNCATED;
		if (next == IPPROTO_FRAGMENT) {
			l4->frag6.id = ext.id;
			l4->frag6.proto = ext.nexthdr;
			if (ext.frag_off & bpf_htons(IP6_OFFSET)) {
				/* The ports are in fragment zero only; the
				 * protocol is what fragment zero starts with. */
				l4->proto = ext.nexthdr;
				return L4_FRAGMENT;
			}
			l4->first_fragment = !!(ext.frag_off & bpf_htons(IP6_MF));
			off += 8;
		} else {
			off += ((__u32)ext.hdrlen + 1) * 8;
		}
		next = ext.nexthdr;
	}
	return L4_TRUNCATED;
}

/* Finds protocol and ports of an IPv4 or IPv6 TCP or UDP packet. */
static __always_inline enum l4_kind parse(struct __sk_buff *skb, struct l4 *l4)
{
	struct iphdr ip;
	__u32 ihl;

	/* At tc ingress and egress of an Ethernet device the packet starts
	 * at the MAC header and skb->protocol holds the EtherType. */
	if (skb->protocol == bpf_htons(ETH_P_IPV6))
		return parse6(skb, l4);
	if (skb->protocol != bpf_htons(ETH_P_IP))
		return L4_OTHER;
	/* bpf_skb_load_bytes() also reads paged data: a header beyond the
	 * linear part must not let a packet past the ownership check. A
	 * header that cannot be read at all is dropped by ip_rcv(). */
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) < 0)
		return L4_OTHER;
	if (ip.version != 4 || (ip.protocol != IPPROTO_TCP && ip.protocol != IPPROTO_UDP))
		return L4_OTHER;
	l4->proto = ip.protocol;
	l4->frag.saddr = ip.saddr;
	l4->frag.daddr = ip.daddr;
	l4->frag.id = ip.id;
	l4->frag.proto = ip.protocol;
	if (ip.frag_off & bpf_htons(IP_OFFSET))
		return L4_FRAGMENT;
	l4->first_fragment = !!(ip.frag_off & bpf_htons(IP_MF));
	/* The transport header follows the options: IHL, not sizeof(ip). */
	ihl = ip.ihl * 4;
	if (ihl < sizeof(ip))
		return L4_TRUNCATED;
	return parse_ports(skb, l4, ETH_HLEN + ihl);
}

static __always_inline __u32 port_flags(__u8 proto, __u16 port)
{
	struct ferry_port_key key = {.proto = proto, .pad = 0, .port = port};
	__u32 *flags = bpf_map_lookup_elem(&FERRY_PORTS, &key);

	return flags ? *flags : 0;
}

/* A shared port's TCP connection is decided by its own entry when it has
 * one (handed off to or away from this node), else by the port's flags.
 * The client's end is the packet's source on ingress (`from_client`), its
 * destination on egress; the other end is the shared port. */
static __always_inline __u32 flow_flags(__u32 port, const struct l4 *l4, int from_client)
{
	__u16 rport = from_client ? l4->sport : l4->dport;
	__u16 lport = from_client ? l4->dport : l4->sport;
	__u32 *flags;

	if (!(port & FERRY_PORT_SHARED) || l4->proto != IPPROTO_TCP)
		return port;
	if (l4->ipv6) {
		struct ferry_flow6_key key = {.remote_port = rport, .local_port = lport};

		__builtin_memcpy(key.remote_addr, from_client ? l4->frag6.saddr : l4->frag6.daddr,
				 16);
		flags = bpf_map_lookup_elem(&FERRY_FLOWS6, &key);
	} else {
		struct ferry_flow_key key = {
			.remote_addr = from_client ? l4->frag.saddr : l4->frag.daddr,
			.remote_port = rport,
			.local_port = lport,
		};

		flags = bpf_map_lookup_elem(&FERRY_FLOWS, &key);
	}
	return flags ? *flags : port;
}

/* The port of a datagram whose fragment zero was captured, if this is a
 * later fragment of one. */
static __always_inline __u16 *captured_fragment_port(struct l4 *l4)
{
	if (l4->ipv6)
		return bpf_map_lookup_elem(&FERRY_FRAGS6, &l4->frag6);
	return bpf_map_lookup_elem(&FERRY_FRAGS, &l4->frag);
}

/* Remembers the datagram of a captured fragment zero: its later fragments
 * are captured with it. */
static __always_inline void capture_fragments(struct l4 *l4)
{
	if (l4->ipv6)
		bpf_map_update_elem(&FERRY_FRAGS6, &l4->frag6, &l4->dport, BPF_ANY);
	else
		bpf_map_update_elem(&FERRY_FRAGS, &l4->frag, &l4->dport, BPF_ANY);
}

/* One ring record: the header and room for `N` bytes of packet. The ring
 * only reserves constant sizes, so packets go into the smallest of a few
 * size classes instead of always taking 64 KiB. */
#define CAPTURE_CLASS(N)                                                             \
	struct capture_##N {                                                         \
		struct ferry_capture_hdr hdr;                                        \
		__u8 data[N];                                                        \
	};                                                                           \
	static __always_inline int capture_##N(struct __sk_buff *skb, __u64 len,     \
					       __u16 port, __u8 proto, __u8 kind)    \
	{                                                                            \
		struct capture_##N *r = bpf_ringbuf_reserve(&FERRY_CAPTURE, sizeof(*r), 0); \
		if (!r)                                                              \
			return -1;                                                   \
		r->hdr.ktime_ns = bpf_ktime_get_ns();                                \
		r->hdr.pkt_len = (__u32)len;                                         \
		r->hdr.cap_len = (__u32)len;                                         \
		r->hdr.port = port;                                                  \
		r->hdr.proto = proto;                                                \
		r->hdr.kind = kind;                                                  \
		r->hdr.pad = 0;                                                      \
		/* Hide len's range from clang, which knows the caller checked \
		 * it and would drop the test the verifier needs to see on the \
		 * very register passed to bpf_skb_load_bytes(); 64 bits, so it \
		 * tests no zero-extended copy instead. */                           \
		asm volatile("" : "+r"(len));                                        \
		if (len == 0 || len > N ||                                           \
		    bpf_skb_load_bytes(skb, ETH_HLEN, r->data, len) < 0) {          \
			bpf_ringbuf_discard(r, 0);                                   \
			return -1;                                                   \
		}                                                                    \
		bpf_ringbuf_submit(r, 0);                                            \
		return 0;                                                            \
	}

CAPTURE_CLASS(256)   /* ACKs, small datagrams: most of what a freeze catches */
CAPTURE_CLASS(2048)  /* up to a full 1500-byte frame */
CAPTURE_CLASS(16384) /* jumbo frames, small GRO batches */
CAPTURE_CLASS(65576) /* the largest IPv6 packet without jumbograms, 40 + 65,535
		      * bytes, and so any IPv4 one (GRO batches on real NICs) */

/* Copies the packet, from its IP header on, into the capture ring. */
static __always_inline int capture(struct __sk_buff *skb, __u16 port, __u8 proto, __u8 kind)
{
	__u32 len = skb->len;

	if (len <= ETH_HLEN)
		return -1;
	len -= ETH_HLEN;
	if (len <= 256)
		return capture_256(skb, len, port, proto, kind);
	if (len <= 2048)
		return capture_2048(skb, len, port, proto, kind);
	if (len <= 16384)
		return capture_16384(skb, len, port, proto, kind);
	if (len <= 65576)
		return capture_65576(skb, len, port, proto, kind);
	return -1;
}

/* Keeps a packet the node must not deliver yet. A packet that does not fit
 * in the ring is dropped all the same (TCP will retransmit it). */
static __always_inline int keep(struct __sk_buff *skb, struct l4 *l4, __u16 port)
{
	if (capture(skb, port, l4->proto, FERRY_CAPTURED) < 0) {
		count(FERRY_CNT_CAPTURE_LOST);
		return TC_ACT_SHOT;
	}
	count(FERRY_CNT_CAPTURED);
	return TC_ACT_SHOT;
}

SEC("classifier")
int ferry_ingress(struct __sk_buff *skb)
{
	struct l4 l4 = {};
	__u32 flags;

	switch (parse(skb, &l4)) {
	case L4_OTHER:
		/* ARP, ICMP, ICMPv6: untouched. ICMP errors about our own
		 * connections (fragmentation needed, packet too big, ...) and
		 * IPv6's neighbour discovery must get through. */
		count(FERRY_CNT_PASSED_OTHER);
		return TC_ACT_OK;
	case L4_FRAGMENT: {
		__u16 *port = captured_fragment_port(&l4);

		/* The rest of a datagram whose fragment zero was captured. */
		if (port)
			return keep(skb, &l4, *port);
		/* No port to decide on, so let the stack have it. Only the
		 * owner also accepted fragment zero and can reassemble; on
		 * every other node the queue expires silently, because
		 * ip_expire() sends "time exceeded" only when fragment zero
		 * arrived (IPv6's ip6_frag_expire() alike). The reassembled
		 * packet takes fragment zero's
		 * PACKET_HOST; setting it here too keeps every piece alike. */
		bpf_skb_change_type(skb, PACKET_HOST);
		count(FERRY_CNT_PASSED_OTHER);
		return TC_ACT_OK;
	}
	case L4_TRUNCATED:
		/* No port, so not one we own; the stack would drop it too. */
		count(FERRY_CNT_DROPPED_NOT_OWNED);
		return TC_ACT_SHOT;
	case L4_PORTS:
		break;
	}
	flags = flow_flags(port_flags(l4.proto, l4.dport), &l4, 1);
	if (flags & FERRY_PORT_CAPTURE) {
		/* A migration moves the port's process: nobody may handle
		 * the packet now, and nothing of it may be lost. */
		if (l4.first_fragment)
			capture_fragments(&l4);
		return keep(skb, &l4, l4.dport);
	}
	if (flags & FERRY_PORT_FROZEN) {
		/* The process is being dumped: its stack must not see, ack
		 * or reset anything. The peer retransmits after the thaw or
		 * to the destination node once it owns the port. */
		count(FERRY_CNT_DROPPED_FROZEN);
		return TC_ACT_SHOT;
	}
	if (!(flags & FERRY_PORT_OWNED)) {
		/* Another node's port: it answers, we stay silent. */
		count(FERRY_CNT_DROPPED_NOT_OWNED);
		return TC_ACT_SHOT;
	}
	if ((flags & FERRY_PORT_HOLD_NEW) && l4.proto == IPPROTO_TCP &&
	    (l4.tcp_flags & (TCP_BYTE_SYN | TCP_BYTE_ACK)) == TCP_BYTE_SYN) {
		/* A new connection starts no handshake here: the destination,
		 * capturing already, replays the SYN to the restored
		 * listener. So every connection the dump finds was accepted
		 * by the process (CRIU cannot move one waiting in a
		 * listener's accept queue, nor a handshake half done).
		 * Unlogged, it is not skipped there. */
		count(FERRY_CNT_DROPPED_FROZEN);
		return TC_ACT_SHOT;
	}
	if (flags & FERRY_PORT_RECORD) {
		/* Best effort: a missing log entry can only make the
		 * destination replay a packet twice, never lose one. */
		if (capture(skb, l4.dport, l4.proto, FERRY_DELIVERED) == 0)
			count(FERRY_CNT_RECORDED);
	}
	if (skb->pkt_type != PACKET_HOST)
		bpf_skb_change_type(skb, PACKET_HOST);
	count(FERRY_CNT_PASSED);
	return TC_ACT_OK;
}

/* A frozen process's TCP sockets must send nothing, above all no RST
 * (CRIU closing them, a timer firing): this is the guard if anything
 * slips. TCP resends whatever this drops. UDP passes: a UDP socket sends
 * only what its process sends, and the process still runs for a few
 * milliseconds after its ports freeze (until CRIU stops it); an answer it
 * sends then, to a datagram it read, is not sent again by anyone, so
 * dropping it here lost it. TCP does not fragment (DF and MSS). */
SEC("classifier")
int ferry_egress(struct __sk_buff *skb)
{
	struct l4 l4 = {};

	if (parse(skb, &l4) != L4_PORTS)
		return TC_ACT_OK;
	if (l4.proto == IPPROTO_TCP &&
	    (flow_flags(port_flags(l4.proto, l4.sport), &l4, 0) & FERRY_PORT_FROZEN)) {
		count(FERRY_CNT_EGRESS_BLOCKED);
		return TC_ACT_SHOT;
	}
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "GPL";
