// SPDX-License-Identifier: GPL-2.0
/*
 * Port ownership on a node's public interface in ferry's single-IP cluster.
 *
 * The router floods every frame for the shared address to all nodes, so
 * each node must keep exactly the packets of the ports it owns and drop the
 * rest before its stack sees them: a node that does not own a port must
 * not answer with an RST or an ICMP unreachable. The frames arrive with a
 * broadcast destination MAC, and TCP drops any skb whose pkt_type is not
 * PACKET_HOST (UDP does not check, which is why non-owned UDP must be
 * dropped here too), so owned packets are turned into PACKET_HOST.
 *
 * Why tc and not XDP: bpf_skb_change_type() exists only for skb programs;
 * driver-mode XDP on veth builds the skb after the program and sets
 * pkt_type from the (broadcast) MAC, so XDP would have to rewrite h_dest to
 * the interface's MAC instead, which needs the MAC in a map. tc ingress runs
 * before ip_rcv() and is enough for the foundation.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "ferry_dataplane.h"

#define IP_MF 0x2000
#define IP_OFFSET 0x1FFF

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct ferry_port_key);
	__type(value, __u32);
} FERRY_PORTS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FERRY_CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} FERRY_COUNTERS SEC(".maps");

static __always_inline void count(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&FERRY_COUNTERS, &idx);
	if (v)
		*v += 1;
}

enum l4_parse {
	L4_NONE,     /* not TCP/UDP over IPv4 */
	L4_FRAGMENT, /* a non-first fragment: no transport header */
	L4_PORTS,
};

/* Finds the transport ports of an IPv4 TCP or UDP packet. */
static __always_inline enum l4_parse parse_ports(struct __sk_buff *skb, __u8 *proto, __u16 *sport,
						 __u16 *dport)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip;
	__u32 ihl;

	if ((void *)(eth + 1) > data_end)
		return L4_NONE;
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return L4_NONE;
	ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end)
		return L4_NONE;
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP)
		return L4_NONE;
	*proto = ip->protocol;
	if (ip->frag_off & bpf_htons(IP_OFFSET))
		return L4_FRAGMENT;
	ihl = ip->ihl * 4;
	if (ihl < sizeof(*ip))
		return L4_NONE;
	/* TCP and UDP both start with source and destination port. */
	__u16 *ports = (void *)ip + ihl;
	if ((void *)(ports + 2) > data_end)
		return L4_NONE;
	*sport = bpf_ntohs(ports[0]);
	*dport = bpf_ntohs(ports[1]);
	return L4_PORTS;
}

static __always_inline __u32 port_flags(__u8 proto, __u16 port)
{
	struct ferry_port_key key = {.proto = proto, .pad = 0, .port = port};
	__u32 *flags = bpf_map_lookup_elem(&FERRY_PORTS, &key);
	return flags ? *flags : 0;
}

SEC("classifier")
int ferry_ingress(struct __sk_buff *skb)
{
	__u8 proto = 0;
	__u16 sport = 0, dport = 0;

	switch (parse_ports(skb, &proto, &sport, &dport)) {
	case L4_NONE:
		count(FERRY_CNT_PASSED_OTHER);
		return TC_ACT_OK;
	case L4_FRAGMENT:
		/* No port to decide on. Hand it to the stack: only the owner
		 * also got the first fragment, elsewhere reassembly times out
		 * silently (no ICMP without fragment zero). */
		bpf_skb_change_type(skb, PACKET_HOST);
		count(FERRY_CNT_PASSED_OTHER);
		return TC_ACT_OK;
	case L4_PORTS:
		break;
	}
	__u32 flags = port_flags(proto, dport);
	if (flags & FERRY_PORT_FROZEN) {
		count(FERRY_CNT_DROPPED_FROZEN);
		return TC_ACT_SHOT;
	}
	if (!(flags & FERRY_PORT_OWNED)) {
		count(FERRY_CNT_DROPPED_NOT_OWNED);
		return TC_ACT_SHOT;
	}
	if (skb->pkt_type != PACKET_HOST)
		bpf_skb_change_type(skb, PACKET_HOST);
	count(FERRY_CNT_PASSED);
	return TC_ACT_OK;
}

/* A frozen process's sockets must send nothing, above all no RST: CRIU
 * leaves them in repair mode, and this is the guard if anything slips. */
SEC("classifier")
int ferry_egress(struct __sk_buff *skb)
{
	__u8 proto = 0;
	__u16 sport = 0, dport = 0;

	if (parse_ports(skb, &proto, &sport, &dport) != L4_PORTS)
		return TC_ACT_OK;
	if (port_flags(proto, sport) & FERRY_PORT_FROZEN) {
		count(FERRY_CNT_EGRESS_BLOCKED);
		return TC_ACT_SHOT;
	}
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "GPL";
