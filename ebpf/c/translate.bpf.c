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
 * header covers both addresses. Nothing else changes: ports, sequence
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
 * not a readable IPv4 TCP/UDP packet of a flow with a rule passes
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
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "ferry_translate.h"

#define AF_INET 2        /* not in the UAPI headers clang -target bpf sees */
#define IP_MF 0x2000     /* more fragments flag of iphdr.frag_off */
#define IP_OFFSET 0x1FFF /* fragment offset field of iphdr.frag_off */
#define TCP_FIN 0x01     /* flag bits in byte 13 of the TCP header */
#define TCP_RST 0x04
#define TCP_FLAGS_OFF 13

#define IP_CSUM_OFF (ETH_HLEN + __builtin_offsetof(struct iphdr, check))
#define IP_SADDR_OFF (ETH_HLEN + __builtin_offsetof(struct iphdr, saddr))
#define IP_DADDR_OFF (ETH_HLEN + __builtin_offsetof(struct iphdr, daddr))

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
static __always_inline void note(struct ferry_xlate_rule *r, const struct pkt *p, int egress)
{
	if (egress)
		__sync_fetch_and_add(&r->packets_egress, 1);
	else
		__sync_fetch_and_add(&r->packets_ingress, 1);
	r->last_seen_ns = bpf_ktime_get_ns();
	if (p->proto != IPPROTO_TCP)
		return;
	if (p->tcp_flags & TCP_FIN)
		__sync_fetch_and_add(egress ? &r->fin_egress : &r->fin_ingress, 1);
	if (p->tcp_flags & TCP_RST)
		__sync_fetch_and_add(egress ? &r->rst_egress : &r->rst_ingress, 1);
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
	__u8 macs[2 * ETH_ALEN];
	long rc;

	fib.family = AF_INET;
	fib.l4_protocol = p->proto;
	fib.sport = p->sport;
	fib.dport = p->dport;
	/* tot_len 0: the kernel checks the skb against the MTU itself, and
	 * lets GSO packets through (a tot_len would fail them). */
	fib.tot_len = 0;
	fib.ifindex = skb->ifindex;
	fib.tos = p->tos;
	fib.ipv4_src = p->saddr;
	fib.ipv4_dst = daddr;
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
