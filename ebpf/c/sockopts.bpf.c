// SPDX-License-Identifier: GPL-2.0
/*
 * The setsockopt watch of an incremental collective migration (issue 6,
 * Gerofi et al. (DVE) section III-C: socket state tracked during
 * pre-copy, so that the freeze carries only what changed).
 *
 * ferryd reads the socket options of a process's TCP connections before
 * the freeze, while the process runs. Options change only by setsockopt
 * (the kernel's own tuning of unlocked buffer sizes aside, which ferryd
 * reads in the freeze anyway). This program, attached to the process's
 * cgroup for the time of the migration, runs before the kernel handles
 * every setsockopt call made there, and records the connection it was
 * made on. Inside the freeze ferryd reads again the options of the
 * connections recorded here and of none other.
 *
 * It never changes a call: optlen 0 tells the kernel to use the caller's
 * own buffer (also above a page, where the program would only see the
 * first page), and it always returns 1 (allow).
 */
#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "ferry_sockopts.h"

#define AF_INET 2 /* not in the UAPI headers clang -target bpf sees */
#define AF_INET6 10

/* The connections a setsockopt call touched, since the attach. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FERRY_SO_TOUCHED_MAX);
	__type(key, struct ferry_sockopt_key);
	__type(value, __u32);
} FERRY_SO_TOUCHED SEC(".maps");

/* Calls on connections that did not fit in FERRY_SO_TOUCHED. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} FERRY_SO_LOST SEC(".maps");

/* The network namespace (cookie) whose connections are recorded; 0: any.
 * The agent sets it once it knows the process's namespace. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} FERRY_SO_NETNS SEC(".maps");

SEC("cgroup/setsockopt")
int ferry_sockopt_watch(struct bpf_sockopt *ctx)
{
	struct ferry_sockopt_key key = {};
	struct bpf_sock *sk = ctx->sk;
	__u32 one = 1, zero = 0;
	__u64 *lost, *netns;

	/* The kernel takes the value from the caller's buffer. */
	ctx->optlen = 0;
	if (!sk || sk->protocol != IPPROTO_TCP)
		return 1;
	/* Not connected: not a connection ferryd reads before a freeze. */
	if (sk->dst_port == 0)
		return 1;
	key.family = sk->family;
	if (key.family == AF_INET) {
		key.local_addr[0] = sk->src_ip4;
		key.remote_addr[0] = sk->dst_ip4;
	} else if (key.family == AF_INET6) {
		key.local_addr[0] = sk->src_ip6[0];
		key.local_addr[1] = sk->src_ip6[1];
		key.local_addr[2] = sk->src_ip6[2];
		key.local_addr[3] = sk->src_ip6[3];
		key.remote_addr[0] = sk->dst_ip6[0];
		key.remote_addr[1] = sk->dst_ip6[1];
		key.remote_addr[2] = sk->dst_ip6[2];
		key.remote_addr[3] = sk->dst_ip6[3];
	} else {
		return 1;
	}
	key.local_port = sk->src_port;
	key.remote_port = bpf_ntohs(sk->dst_port);
	key.netns = bpf_get_netns_cookie(ctx);
	netns = bpf_map_lookup_elem(&FERRY_SO_NETNS, &zero);
	if (netns && *netns && *netns != key.netns)
		return 1;
	if (bpf_map_update_elem(&FERRY_SO_TOUCHED, &key, &one, BPF_ANY) != 0) {
		lost = bpf_map_lookup_elem(&FERRY_SO_LOST, &zero);
		if (lost)
			__sync_fetch_and_add(lost, 1);
	}
	return 1;
}

char _license[] SEC("license") = "GPL";
