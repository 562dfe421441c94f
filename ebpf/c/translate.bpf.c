// SPDX-License-Identifier: GPL-2.0
/*
 * In-cluster address translation, on the node of a migrated process's peer.
 *
 * A process that migrates from node A1 to node A2 keeps its TCP and UDP
 * sockets, but their local address becomes A2's cluster address. A peer on
 * another node still has a socket connected to A1, and nothing in it may
 * change. So the peer's node rewrites that exact flow on its cluster
 * interface (Gerofi et al. (DVE), section III-C):
 *   ferry_xlate_out, tc egress:  destination A1 -> A2
 *   ferry_xlate_in,  tc ingress: source      A2 -> A1
 * fixing the IPv4 header checksum and the TCP/UDP checksum, whose pseudo
 * header covers both addresses (on an IPv6 cluster network the same with
 * 16-byte addresses, below). Nothing else changes: ports, sequence
 * numbers and options are the same on both sides.
 *
 * A hold rule, on the migrated process's NEW node A2 during the migration,
 * drops its exact flow (local A2:port <-> remote A3:port) both ways
 * instead: the restored socket's window probe must not reach A3
 * untranslated, and A3's packets must not reach A2's stack before the
 * socket exists; either would cost an RST (see ferry_translate.h). Other
 * flows, also between the same two hosts, pass.
 *
 * Headers are read with bpf_skb_load_bytes(), which also reads paged data
 * (GRO'd and TSO skbs are non-linear), and written with the store and
 * checksum helpers, which make the bytes writable first. Anything that is
 * not a readable IPv4 or IPv6 TCP/UDP packet of a flow with a rule passes
 * untouched: a malformed packet is the stack's to drop, never this
 * program's to misread.
 *
 * Every verdict that leaves the packet alone is TC_ACT_UNSPEC, which is
 * TCX_NEXT for tcx links (and "continue" for cls_bpf): another program on
 * the same interface, such as the ownership filter, still sees it.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/in6.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "ferry_translate.h"

#define AF_INET 2        /* not in the UAPI headers clang -target bpf sees */
#define AF_INET6 10
#define IP6_OFFSET 0xFFF8 /* fragment offset of the IPv6 fragment header */
#define IP6_MF 0x0001     /* more fragments flag of the IPv6 fragment header */
#define IP6_MAX_EXT_HDRS 6 /* extension headers followed, as the ownership filter */
#define IP_MF 0x2000     /* more fragments flag of iphdr.frag_off */
#define IP_OFFSET 0x1FFF /* fragment offset field of iphdr.frag_off */
#define TCP_FIN 0x01     /* flag bits in byte 13 of the TCP header */
#define TCP_RST 0x04
#define TCP_FLAGS_OFF 13

#define IP_CSUM_OFF (ETH_HLEN + __builtin_offsetof(struct iphdr, check))
#define IP_SADDR_OFF (ETH_HLEN + __builtin_offsetof(struct iphdr, saddr))
#define IP_DADDR_OFF (ETH_HLEN + __builtin_offsetof(struct iphdr, daddr))
#define IP6_SADDR_OFF (ETH_HLEN + __builtin_offsetof(struct ipv6hdr, saddr))
#define IP6_DADDR_OFF (ETH_HLEN + __builtin_offsetof(struct ipv6hdr, daddr))

/* One entry per migrated connection a local socket has; a node talks to
 * far fewer. The agent adds and removes entries. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct ferry_xlate_key);
	__type(value, struct ferry_xlate_rule);
} FERRY_XL_RULES SEC(".maps");

/* The same rules indexed as incoming packets carry them (remote_addr is
 * the new address; for a hold rule the remote's own), giving the
 * remote_addr of the rule's key. Written by the agent with FERRY_XL_RULES:
 * added after the rule, removed before it. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct ferry_xlate_key);
	__type(value, __be32);
} FERRY_XL_REV SEC(".maps");

/* Later fragments carry no ports: the datagrams whose first fragment was
 * translated or held, so that the rest follows it (see
 * ferry_xlate_frag_key). LRU: an entry whose last fragment never came ages
 * out. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct ferry_xlate_frag_key);
	__type(value, struct ferry_xlate_frag);
} FERRY_XL_FRAGS SEC(".maps");

/* The same three for an IPv6 cluster network. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct ferry_xlate6_key);
	__type(value, struct ferry_xlate6_rule);
} FERRY_XL_RULES6 SEC(".maps");

struct xlate6_addr {
	__u8 a[16];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct ferry_xlate6_key);
	__type(value, struct xlate6_addr);
} FERRY_XL_REV6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct ferry_xlate6_frag_key);
	__type(value, struct ferry_xlate6_frag);
} FERRY_XL_FRAGS6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FERRY_XL_CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} FERRY_XL_COUNT SEC(".maps");

static __always_inline void count(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&FERRY_XL_COUNT, &idx);

	/* Per-CPU slot: no other CPU writes it, a plain add is enough. */
	if (v)
		*v += 1;
}

enum kind {
	PKT_OTHER,     /* not IPv4, or not TCP/UDP: none of ours */
	PKT_MALFORMED, /* IPv4 whose headers cannot be read or do not add up */
	PKT_FRAGMENT,  /* TCP/UDP, a later fragment: no ports in it */
	PKT_L4,        /* TCP/UDP with ports (and flags) read */
};

struct pkt {
	__u32 l4_off; /* from the start of the frame */
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__be16 id;
	__u8 proto;
	__u8 tos;
	__u8 tcp_flags;
	__u8 more_fragments; /* first fragment of a fragmented datagram */
	__u8 last_fragment;  /* later fragment without MF */
};

/* Reads what the translation needs; PKT_L4 only if the whole TCP or UDP
 * header, checksum field included, lies inside this packet, so that the
 * checksum helpers below never touch bytes beyond it. */
static __always_inline enum kind parse(struct __sk_buff *skb, struct pkt *p)
{
	struct iphdr ip;
	__u32 ihl, tot_len;

	/* At tc ingress and egress of an Ethernet device the packet starts
	 * at the MAC header and skb->protocol holds the EtherType. */
	if (skb->protocol != bpf_htons(ETH_P_IP))
		return PKT_OTHER;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) < 0)
		return PKT_MALFORMED;
	if (ip.version != 4)
		return PKT_MALFORMED;
	/* The transport header follows the options: IHL, not sizeof(ip). */
	ihl = ip.ihl * 4;
	tot_len = bpf_ntohs(ip.tot_len);
	/* BIG TCP (GSO packets over 64 KiB) writes tot_len 0: the length is
	 * the skb's then. */
	if (tot_len == 0 && skb->gso_size)
		tot_len = skb->len - ETH_HLEN;
	if (ihl < sizeof(ip) || tot_len < ihl || skb->len < ETH_HLEN + tot_len)
		return PKT_MALFORMED;
	if (ip.protocol != IPPROTO_TCP && ip.protocol != IPPROTO_UDP)
		return PKT_OTHER;
	p->proto = ip.protocol;
	p->tos = ip.tos;
	p->saddr = ip.saddr;
	p->daddr = ip.daddr;
	p->id = ip.id;
	if (ip.frag_off & bpf_htons(IP_OFFSET)) {
		p->last_fragment = !(ip.frag_off & bpf_htons(IP_MF));
		return PKT_FRAGMENT;
	}
	p->more_fragments = !!(ip.frag_off & bpf_htons(IP_MF));
	p->l4_off = ETH_HLEN + ihl;
	if (ip.protocol == IPPROTO_TCP) {
		struct tcphdr th;

		if (tot_len < ihl + sizeof(th) ||
		    bpf_skb_load_bytes(skb, p->l4_off, &th, sizeof(th)) < 0)
			return PKT_MALFORMED;
		p->sport = th.source;
		p->dport = th.dest;
		p->tcp_flags = ((__u8 *)&th)[TCP_FLAGS_OFF];
	} else {
		struct udphdr uh;

		if (tot_len < ihl + sizeof(uh) ||
		    bpf_skb_load_bytes(skb, p->l4_off, &uh, sizeof(uh)) < 0)
			return PKT_MALFORMED;
		p->sport = uh.source;
		p->dport = uh.dest;
	}
	return PKT_L4;
}

/* Replaces the address at addr_off (saddr or daddr) `from` -> `to` and
 * fixes the checksums. Both checksum helpers handle every ip_summed:
 *  - CHECKSUM_PARTIAL (locally sent, checksum offloaded, as on veth): the
 *    L4 field holds only the pseudo header sum, which BPF_F_PSEUDO_HDR
 *    updates; the payload is summed later by the device or the stack;
 *  - CHECKSUM_COMPLETE (received): skb->csum is kept in step;
 *  - NONE / UNNECESSARY: the field is updated incrementally.
 * UDP's checksum 0 means "none" and must stay 0, and a computed 0 must be
 * sent as 0xffff: BPF_F_MARK_MANGLED_0 does both. (A PARTIAL UDP field is
 * never 0: it is a non-complemented sum of non-zero words.) Later
 * fragments (l4 = 0) have no L4 header; the first one's checksum covers
 * the whole datagram and was fixed with it. */
static __always_inline int rewrite(struct __sk_buff *skb, const struct pkt *p, __u32 addr_off,
				   __be32 from, __be32 to, int l4)
{
	if (l4) {
		__u32 csum_off = p->l4_off;
		__u64 flags = BPF_F_PSEUDO_HDR | sizeof(to);

		if (p->proto == IPPROTO_TCP) {
			csum_off += __builtin_offsetof(struct tcphdr, check);
		} else {
			csum_off += __builtin_offsetof(struct udphdr, check);
			flags |= BPF_F_MARK_MANGLED_0;
		}
		if (bpf_l4_csum_replace(skb, csum_off, from, to, flags) < 0)
			return -1;
	}
	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, from, to, sizeof(to)) < 0)
		return -1;
	/* No BPF_F_RECOMPUTE_CSUM: the checksum fields just changed by the
	 * opposite amount, and l4_csum_replace already adjusted a COMPLETE
	 * skb->csum for the net change, as netfilter's NAT does. */
	if (bpf_skb_store_bytes(skb, addr_off, &to, sizeof(to), 0) < 0)
		return -1;
	return 0;
}

/* Per-rule state for the agent. Atomic adds: the same flow can be on
 * several CPUs at once (egress on one, ingress on another). */
static __always_inline void note_counts(struct ferry_xlate_counts *c, __u8 proto, __u8 tcp_flags,
					int egress)
{
	if (egress)
		__sync_fetch_and_add(&c->packets_egress, 1);
	else
		__sync_fetch_and_add(&c->packets_ingress, 1);
	c->last_seen_ns = bpf_ktime_get_ns();
	if (proto != IPPROTO_TCP)
		return;
	if (tcp_flags & TCP_FIN)
		__sync_fetch_and_add(egress ? &c->fin_egress : &c->fin_ingress, 1);
	if (tcp_flags & TCP_RST)
		__sync_fetch_and_add(egress ? &c->rst_egress : &c->rst_ingress, 1);
}

static __always_inline void note(struct ferry_xlate_rule *r, const struct pkt *p, int egress)
{
	note_counts(&r->c, p->proto, p->tcp_flags, egress);
}

/* A fragmented datagram was translated or held: its later fragments
 * follow (f). Any other first fragment with the same identity (f NULL)
 * starts a new datagram that must not inherit a stale entry (IP ids wrap,
 * and are shared by all flows between two addresses). */
static __always_inline void frag_start(const struct pkt *p, __u8 dir,
				       const struct ferry_xlate_frag *f)
{
	struct ferry_xlate_frag_key fk = {
		.saddr = p->saddr, .daddr = p->daddr, .id = p->id, .proto = p->proto, .dir = dir,
	};

	if (f)
		bpf_map_update_elem(&FERRY_XL_FRAGS, &fk, f, BPF_ANY);
	else
		bpf_map_delete_elem(&FERRY_XL_FRAGS, &fk);
}

/* What was done to the first fragment of a later fragment's datagram, in
 * *f; 0 if nothing (no entry). The entry goes with the last fragment. */
static __always_inline int frag_lookup(const struct pkt *p, __u8 dir, struct ferry_xlate_frag *f)
{
	struct ferry_xlate_frag_key fk = {
		.saddr = p->saddr, .daddr = p->daddr, .id = p->id, .proto = p->proto, .dir = dir,
	};
	struct ferry_xlate_frag *v = bpf_map_lookup_elem(&FERRY_XL_FRAGS, &fk);

	if (!v)
		return 0;
	*f = *v;
	if (p->last_fragment)
		bpf_map_delete_elem(&FERRY_XL_FRAGS, &fk);
	return 1;
}

/* A packet of a held flow: counted on the rule and dropped, and so are
 * its later fragments. */
static __always_inline int hold(struct ferry_xlate_rule *r, const struct pkt *p, __u8 dir)
{
	if (p->more_fragments) {
		struct ferry_xlate_frag f = { .action = FERRY_XL_HOLD };

		frag_start(p, dir, &f);
	}
	note(r, p, dir == FERRY_XL_EGRESS);
	count(FERRY_XL_CNT_HELD);
	return TC_ACT_SHOT;
}

/* next_hop()'s lookup of `fib` (family, addresses, ports and protocol
 * filled in by the caller) and what follows from its answer. */
static __always_inline int route(struct __sk_buff *skb, struct bpf_fib_lookup *fib_in)
{
	struct bpf_fib_lookup fib = *fib_in;
	__u8 macs[2 * ETH_ALEN];
	long rc;

	/* tot_len 0: the kernel checks the skb against the MTU itself, and
	 * lets GSO packets through (a tot_len would fail them). */
	fib.tot_len = 0;
	fib.ifindex = skb->ifindex;
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_OUTPUT);
	switch (rc) {
	case BPF_FIB_LKUP_RET_SUCCESS:
		__builtin_memcpy(macs, fib.dmac, ETH_ALEN);
		__builtin_memcpy(macs + ETH_ALEN, fib.smac, ETH_ALEN);
		if (bpf_skb_store_bytes(skb, 0, macs, sizeof(macs), 0) < 0) {
			count(FERRY_XL_CNT_DROPPED);
			return TC_ACT_SHOT;
		}
		count(FERRY_XL_CNT_EGRESS);
		if (fib.ifindex == skb->ifindex)
			return TC_ACT_UNSPEC;
		return bpf_redirect(fib.ifindex, 0);
	case BPF_FIB_LKUP_RET_BLACKHOLE:
	case BPF_FIB_LKUP_RET_UNREACHABLE:
	case BPF_FIB_LKUP_RET_PROHIBIT:
		/* The new node is not reachable from here: sending the
		 * packet to the old node's MAC would only get it dropped or
		 * reset there. */
		count(FERRY_XL_CNT_DROPPED);
		return TC_ACT_SHOT;
	default:
		/* Forwarding off, no neighbour yet, or a result the kernel's
		 * own output path handles better (an MTU below the packet's):
		 * route and resolve in the kernel, out of this device. */
		count(FERRY_XL_CNT_REDIRECT_NEIGH);
		count(FERRY_XL_CNT_EGRESS);
		return bpf_redirect_neigh(skb->ifindex, NULL, 0, 0);
	}
}

/* The route and the neighbour (the destination MAC in the frame) were
 * chosen for the old address before tc egress runs; they must be redone
 * for the new one. Two ways, both checked on Linux 6.18 veth:
 *  - bpf_fib_lookup() gives the MACs, written here, and the packet goes on
 *    as it is. But it answers BPF_FIB_LKUP_RET_FWD_DISABLED on a device
 *    without IPv4 forwarding, even for an output lookup, which is most
 *    nodes; and NO_NEIGH while the new node's MAC is not resolved yet.
 *  - bpf_redirect_neigh() routes and resolves in the kernel (queueing the
 *    packet meanwhile) and transmits through the neighbour layer. It works
 *    at tc egress; the packet passes this device's tc egress a second time
 *    then, carrying the new address, which matches no rule.
 * So: the FIB where it answers, bpf_redirect_neigh() for everything else. */
static __always_inline int next_hop(struct __sk_buff *skb, const struct pkt *p, __be32 daddr)
{
	struct bpf_fib_lookup fib = {};

	fib.family = AF_INET;
	fib.l4_protocol = p->proto;
	fib.sport = p->sport;
	fib.dport = p->dport;
	fib.tos = p->tos;
	fib.ipv4_src = p->saddr;
	fib.ipv4_dst = daddr;
	return route(skb, &fib);
}

/* IPv6: an IPv6 cluster network. The same translation over 16-byte
 * addresses, in maps of their own. No IP header checksum; the TCP/UDP
 * checksum's pseudo header covers both addresses, so it is fixed by their
 * difference (bpf_csum_diff). Extension headers are followed as the
 * ownership filter does; later fragments carry a fragment header's 32-bit
 * identification. */
struct pkt6 {
	__u32 l4_off;
	__u8 saddr[16];
	__u8 daddr[16];
	__be16 sport;
	__be16 dport;
	__be32 id;
	__u8 proto;
	__u8 frag_proto; /* the fragment header's next header */
	__u8 tcp_flags;
	__u8 more_fragments;
	__u8 last_fragment;
};

/* The first 8 bytes of an IPv6 extension header: all of a fragment
 * header; next header and length of the others. */
struct ip6_ext8 {
	__u8 nexthdr;
	__u8 hdrlen;
	__be16 frag_off;
	__be32 id;
};

static __always_inline enum kind parse6(struct __sk_buff *skb, struct pkt6 *p)
{
	struct ipv6hdr ip6;
	struct ip6_ext8 ext;
	__u32 off = ETH_HLEN + sizeof(ip6), end;
	__u8 next;
	int i;

	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6)) < 0 || ip6.version != 6)
		return PKT_MALFORMED;
	end = ETH_HLEN + sizeof(ip6) + bpf_ntohs(ip6.payload_len);
	/* BIG TCP: a GSO packet over 64 KiB has payload_len 0 (a jumbo
	 * option); the length is the skb's then. */
	if (ip6.payload_len == 0 && skb->gso_size)
		end = skb->len;
	if (skb->len < end)
		return PKT_MALFORMED;
	__builtin_memcpy(p->saddr, &ip6.saddr, 16);
	__builtin_memcpy(p->daddr, &ip6.daddr, 16);
	next = ip6.nexthdr;
#pragma unroll
	for (i = 0; i < IP6_MAX_EXT_HDRS; i++) {
		if (next == IPPROTO_TCP || next == IPPROTO_UDP)
			break;
		if (next != IPPROTO_HOPOPTS && next != IPPROTO_ROUTING && next != IPPROTO_DSTOPTS &&
		    next != IPPROTO_FRAGMENT)
			return PKT_OTHER;
		if (bpf_skb_load_bytes(skb, off, &ext, sizeof(ext)) < 0)
			return PKT_MALFORMED;
		if (next == IPPROTO_FRAGMENT) {
			p->id = ext.id;
			p->frag_proto = ext.nexthdr;
			if (ext.frag_off & bpf_htons(IP6_OFFSET)) {
				p->proto = ext.nexthdr;
				p->last_fragment = !(ext.frag_off & bpf_htons(IP6_MF));
				return PKT_FRAGMENT;
			}
			p->more_fragments = !!(ext.frag_off & bpf_htons(IP6_MF));
			off += 8;
		} else {
			off += ((__u32)ext.hdrlen + 1) * 8;
		}
		next = ext.nexthdr;
	}
	if (next != IPPROTO_TCP && next != IPPROTO_UDP)
		return PKT_OTHER;
	p->proto = next;
	p->l4_off = off;
	if (next == IPPROTO_TCP) {
		struct tcphdr th;

		if (end < off + sizeof(th) || bpf_skb_load_bytes(skb, off, &th, sizeof(th)) < 0)
			return PKT_MALFORMED;
		p->sport = th.source;
		p->dport = th.dest;
		p->tcp_flags = ((__u8 *)&th)[TCP_FLAGS_OFF];
	} else {
		struct udphdr uh;

		if (end < off + sizeof(uh) || bpf_skb_load_bytes(skb, off, &uh, sizeof(uh)) < 0)
			return PKT_MALFORMED;
		p->sport = uh.source;
		p->dport = uh.dest;
	}
	return PKT_L4;
}

/* rewrite() for IPv6: the address at addr_off `from` -> `to`, and the
 * transport checksum by their difference (size 0: `to` is a checksum
 * difference), for every ip_summed as there. */
static __always_inline int rewrite6(struct __sk_buff *skb, const struct pkt6 *p, __u32 addr_off,
				    const __u8 *from, const __u8 *to, int l4)
{
	__be32 f[4], t[4];

	__builtin_memcpy(f, from, 16);
	__builtin_memcpy(t, to, 16);
	if (l4) {
		__u32 csum_off = p->l4_off;
		__u64 flags = BPF_F_PSEUDO_HDR;
		__s64 diff = bpf_csum_diff(f, sizeof(f), t, sizeof(t), 0);

		if (diff < 0)
			return -1;
		if (p->proto == IPPROTO_TCP) {
			csum_off += __builtin_offsetof(struct tcphdr, check);
		} else {
			csum_off += __builtin_offsetof(struct udphdr, check);
			flags |= BPF_F_MARK_MANGLED_0;
		}
		if (bpf_l4_csum_replace(skb, csum_off, 0, (__u32)diff, flags) < 0)
			return -1;
	}
	if (bpf_skb_store_bytes(skb, addr_off, t, sizeof(t), 0) < 0)
		return -1;
	return 0;
}

/* Whether two IPv6 addresses are equal (no memcmp in BPF). */
static __always_inline int same6(const __u8 *a, const __u8 *b)
{
	__u64 x[2], y[2];

	__builtin_memcpy(x, a, 16);
	__builtin_memcpy(y, b, 16);
	return x[0] == y[0] && x[1] == y[1];
}

static __always_inline void frag6_start(const struct pkt6 *p, __u8 dir,
					const struct ferry_xlate6_frag *f)
{
	struct ferry_xlate6_frag_key fk = {.id = p->id, .proto = p->frag_proto, .dir = dir};

	__builtin_memcpy(fk.saddr, p->saddr, 16);
	__builtin_memcpy(fk.daddr, p->daddr, 16);
	if (f)
		bpf_map_update_elem(&FERRY_XL_FRAGS6, &fk, f, BPF_ANY);
	else
		bpf_map_delete_elem(&FERRY_XL_FRAGS6, &fk);
}

static __always_inline int frag6_lookup(const struct pkt6 *p, __u8 dir, struct ferry_xlate6_frag *f)
{
	struct ferry_xlate6_frag_key fk = {.id = p->id, .proto = p->frag_proto, .dir = dir};
	struct ferry_xlate6_frag *v;

	__builtin_memcpy(fk.saddr, p->saddr, 16);
	__builtin_memcpy(fk.daddr, p->daddr, 16);
	v = bpf_map_lookup_elem(&FERRY_XL_FRAGS6, &fk);
	if (!v)
		return 0;
	*f = *v;
	if (p->last_fragment)
		bpf_map_delete_elem(&FERRY_XL_FRAGS6, &fk);
	return 1;
}

static __always_inline int hold6(struct ferry_xlate6_rule *r, const struct pkt6 *p, __u8 dir)
{
	if (p->more_fragments) {
		struct ferry_xlate6_frag f = {.action = FERRY_XL_HOLD};

		frag6_start(p, dir, &f);
	}
	note_counts(&r->c, p->proto, p->tcp_flags, dir == FERRY_XL_EGRESS);
	count(FERRY_XL_CNT_HELD);
	return TC_ACT_SHOT;
}

static __always_inline int next_hop6(struct __sk_buff *skb, const struct pkt6 *p, const __u8 *daddr)
{
	struct bpf_fib_lookup fib = {};

	fib.family = AF_INET6;
	fib.l4_protocol = p->proto;
	fib.sport = p->sport;
	fib.dport = p->dport;
	__builtin_memcpy(fib.ipv6_src, p->saddr, 16);
	__builtin_memcpy(fib.ipv6_dst, daddr, 16);
	return route(skb, &fib);
}

/* ferry_xlate_out for IPv6. */
static __always_inline int xlate6_out(struct __sk_buff *skb)
{
	struct ferry_xlate6_key key = {};
	struct ferry_xlate6_frag f = {};
	struct ferry_xlate6_rule *rule;
	struct pkt6 p = {};
	__u8 to[16];

	switch (parse6(skb, &p)) {
	case PKT_OTHER:
		count(FERRY_XL_CNT_PASSED);
		return TC_ACT_UNSPEC;
	case PKT_MALFORMED:
		count(FERRY_XL_CNT_MALFORMED);
		return TC_ACT_UNSPEC;
	case PKT_FRAGMENT:
		if (!frag6_lookup(&p, FERRY_XL_EGRESS, &f)) {
			count(FERRY_XL_CNT_PASSED);
			return TC_ACT_UNSPEC;
		}
		if (f.action == FERRY_XL_HOLD) {
			count(FERRY_XL_CNT_HELD);
			return TC_ACT_SHOT;
		}
		if (rewrite6(skb, &p, IP6_DADDR_OFF, p.daddr, f.addr, 0) < 0) {
			count(FERRY_XL_CNT_DROPPED);
			return TC_ACT_SHOT;
		}
		return next_hop6(skb, &p, f.addr);
	case PKT_L4:
		break;
	}
	__builtin_memcpy(key.local_addr, p.saddr, 16);
	__builtin_memcpy(key.remote_addr, p.daddr, 16);
	key.local_port = p.sport;
	key.remote_port = p.dport;
	key.proto = p.proto;
	rule = bpf_map_lookup_elem(&FERRY_XL_RULES6, &key);
	if (!rule) {
		if (p.more_fragments)
			frag6_start(&p, FERRY_XL_EGRESS, NULL);
		count(FERRY_XL_CNT_PASSED);
		return TC_ACT_UNSPEC;
	}
	if (rule->action == FERRY_XL_HOLD)
		return hold6(rule, &p, FERRY_XL_EGRESS);
	__builtin_memcpy(to, rule->new_addr, 16);
	if (rewrite6(skb, &p, IP6_DADDR_OFF, p.daddr, to, 1) < 0) {
		count(FERRY_XL_CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	note_counts(&rule->c, p.proto, p.tcp_flags, 1);
	if (p.more_fragments) {
		__builtin_memcpy(f.addr, to, 16);
		f.action = FERRY_XL_TRANSLATE;
		frag6_start(&p, FERRY_XL_EGRESS, &f);
	}
	return next_hop6(skb, &p, to);
}

/* ferry_xlate_in for IPv6. */
static __always_inline int xlate6_in(struct __sk_buff *skb)
{
	struct ferry_xlate6_key key = {};
	struct ferry_xlate6_frag f = {};
	struct ferry_xlate6_rule *rule;
	struct xlate6_addr *old;
	struct pkt6 p = {};
	__u8 to[16];

	switch (parse6(skb, &p)) {
	case PKT_OTHER:
		count(FERRY_XL_CNT_PASSED);
		return TC_ACT_UNSPEC;
	case PKT_MALFORMED:
		count(FERRY_XL_CNT_MALFORMED);
		return TC_ACT_UNSPEC;
	case PKT_FRAGMENT:
		if (!frag6_lookup(&p, FERRY_XL_INGRESS, &f)) {
			count(FERRY_XL_CNT_PASSED);
			return TC_ACT_UNSPEC;
		}
		if (f.action == FERRY_XL_HOLD) {
			count(FERRY_XL_CNT_HELD);
			return TC_ACT_SHOT;
		}
		if (rewrite6(skb, &p, IP6_SADDR_OFF, p.saddr, f.addr, 0) < 0) {
			count(FERRY_XL_CNT_DROPPED);
			return TC_ACT_SHOT;
		}
		count(FERRY_XL_CNT_INGRESS);
		return TC_ACT_UNSPEC;
	case PKT_L4:
		break;
	}
	__builtin_memcpy(key.local_addr, p.daddr, 16);
	__builtin_memcpy(key.remote_addr, p.saddr, 16);
	key.local_port = p.dport;
	key.remote_port = p.sport;
	key.proto = p.proto;
	old = bpf_map_lookup_elem(&FERRY_XL_REV6, &key);
	if (!old)
		goto pass;
	__builtin_memcpy(to, old->a, 16);
	__builtin_memcpy(key.remote_addr, to, 16);
	rule = bpf_map_lookup_elem(&FERRY_XL_RULES6, &key);
	if (!rule || !same6(rule->new_addr, p.saddr))
		goto pass;
	if (rule->action == FERRY_XL_HOLD)
		return hold6(rule, &p, FERRY_XL_INGRESS);
	if (rewrite6(skb, &p, IP6_SADDR_OFF, p.saddr, to, 1) < 0) {
		count(FERRY_XL_CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	note_counts(&rule->c, p.proto, p.tcp_flags, 0);
	if (p.more_fragments) {
		__builtin_memcpy(f.addr, to, 16);
		f.action = FERRY_XL_TRANSLATE;
		frag6_start(&p, FERRY_XL_INGRESS, &f);
	}
	count(FERRY_XL_CNT_INGRESS);
	return TC_ACT_UNSPEC;
pass:
	if (p.more_fragments)
		frag6_start(&p, FERRY_XL_INGRESS, NULL);
	count(FERRY_XL_CNT_PASSED);
	return TC_ACT_UNSPEC;
}

/* Peer -> process: the destination is the old address; send it to the new
 * one. A held flow's packets (this node sending) are dropped. */
SEC("classifier")
int ferry_xlate_out(struct __sk_buff *skb)
{
	struct ferry_xlate_key key = {};
	struct ferry_xlate_frag f = {};
	struct ferry_xlate_rule *rule;
	struct pkt p = {};
	__be32 to;

	if (skb->protocol == bpf_htons(ETH_P_IPV6))
		return xlate6_out(skb);
	switch (parse(skb, &p)) {
	case PKT_OTHER:
		count(FERRY_XL_CNT_PASSED);
		return TC_ACT_UNSPEC;
	case PKT_MALFORMED:
		count(FERRY_XL_CNT_MALFORMED);
		return TC_ACT_UNSPEC;
	case PKT_FRAGMENT:
		if (!frag_lookup(&p, FERRY_XL_EGRESS, &f)) {
			count(FERRY_XL_CNT_PASSED);
			return TC_ACT_UNSPEC;
		}
		if (f.action == FERRY_XL_HOLD) {
			count(FERRY_XL_CNT_HELD);
			return TC_ACT_SHOT;
		}
		if (rewrite(skb, &p, IP_DADDR_OFF, p.daddr, f.addr, 0) < 0) {
			count(FERRY_XL_CNT_DROPPED);
			return TC_ACT_SHOT;
		}
		return next_hop(skb, &p, f.addr);
	case PKT_L4:
		break;
	}
	key.local_addr = p.saddr;
	key.remote_addr = p.daddr;
	key.local_port = p.sport;
	key.remote_port = p.dport;
	key.proto = p.proto;
	rule = bpf_map_lookup_elem(&FERRY_XL_RULES, &key);
	if (!rule) {
		if (p.more_fragments)
			frag_start(&p, FERRY_XL_EGRESS, NULL);
		count(FERRY_XL_CNT_PASSED);
		return TC_ACT_UNSPEC;
	}
	if (rule->action == FERRY_XL_HOLD)
		return hold(rule, &p, FERRY_XL_EGRESS);
	to = rule->new_addr;
	if (rewrite(skb, &p, IP_DADDR_OFF, p.daddr, to, 1) < 0) {
		count(FERRY_XL_CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	note(rule, &p, 1);
	if (p.more_fragments) {
		f.addr = to;
		f.action = FERRY_XL_TRANSLATE;
		frag_start(&p, FERRY_XL_EGRESS, &f);
	}
	return next_hop(skb, &p, to);
}

/* Process -> peer: the source is the new address; the peer's socket must
 * see the old one. The packet is for this host, so no routing to redo. A
 * held flow's packets (the remote sending) are dropped. */
SEC("classifier")
int ferry_xlate_in(struct __sk_buff *skb)
{
	struct ferry_xlate_key key = {};
	struct ferry_xlate_frag f = {};
	struct ferry_xlate_rule *rule;
	struct pkt p = {};
	__be32 *old, to;

	if (skb->protocol == bpf_htons(ETH_P_IPV6))
		return xlate6_in(skb);
	switch (parse(skb, &p)) {
	case PKT_OTHER:
		count(FERRY_XL_CNT_PASSED);
		return TC_ACT_UNSPEC;
	case PKT_MALFORMED:
		count(FERRY_XL_CNT_MALFORMED);
		return TC_ACT_UNSPEC;
	case PKT_FRAGMENT:
		if (!frag_lookup(&p, FERRY_XL_INGRESS, &f)) {
			count(FERRY_XL_CNT_PASSED);
			return TC_ACT_UNSPEC;
		}
		if (f.action == FERRY_XL_HOLD) {
			count(FERRY_XL_CNT_HELD);
			return TC_ACT_SHOT;
		}
		if (rewrite(skb, &p, IP_SADDR_OFF, p.saddr, f.addr, 0) < 0) {
			count(FERRY_XL_CNT_DROPPED);
			return TC_ACT_SHOT;
		}
		count(FERRY_XL_CNT_INGRESS);
		return TC_ACT_UNSPEC;
	case PKT_L4:
		break;
	}
	key.local_addr = p.daddr;
	key.remote_addr = p.saddr;
	key.local_port = p.dport;
	key.remote_port = p.sport;
	key.proto = p.proto;
	old = bpf_map_lookup_elem(&FERRY_XL_REV, &key);
	if (!old)
		goto pass;
	to = *old;
	key.remote_addr = to;
	rule = bpf_map_lookup_elem(&FERRY_XL_RULES, &key);
	/* Both maps agree except while the agent changes a rule: then the
	 * rule decides. (A hold rule's new_addr is its remote address, the
	 * source of the flow's incoming packets.) */
	if (!rule || rule->new_addr != p.saddr)
		goto pass;
	if (rule->action == FERRY_XL_HOLD)
		return hold(rule, &p, FERRY_XL_INGRESS);
	if (rewrite(skb, &p, IP_SADDR_OFF, p.saddr, to, 1) < 0) {
		count(FERRY_XL_CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	note(rule, &p, 0);
	if (p.more_fragments) {
		f.addr = to;
		f.action = FERRY_XL_TRANSLATE;
		frag_start(&p, FERRY_XL_INGRESS, &f);
	}
	count(FERRY_XL_CNT_INGRESS);
	return TC_ACT_UNSPEC;
pass:
	if (p.more_fragments)
		frag_start(&p, FERRY_XL_INGRESS, NULL);
	count(FERRY_XL_CNT_PASSED);
	return TC_ACT_UNSPEC;
}

char LICENSE[] SEC("license") = "GPL";
