// SPDX-License-Identifier: GPL-2.0
/*
 * The state of a migrating process's TCP connections, read in one pass
 * inside the freeze (issue 6: socket state collected in one batch).
 *
 * The process is stopped and its packets held (nothing moves): ferryd
 * reads one iterator once, over the process's descriptors or over its
 * network namespace's TCP sockets. For every connection whose cookie it
 * asked for (FERRY_TCPSTATE_WANTED), one struct ferry_tcp_state with what
 * a dozen getsockopt and ioctl calls per connection read otherwise, taken
 * from the same kernel fields those calls read (TCP_TIMESTAMP's offset
 * too: ferryd adds the TCP clock). The kernel structures are declared here
 * with only the fields read, relocated against the running kernel's BTF
 * (CO-RE) when the program loads. No bitfield is read (the options
 * negotiated at the handshake, which never change, and whether the
 * timestamps count microseconds come from TCP_INFO before the freeze):
 * aya's loader misplaced them when tried.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#include "ferry_tcpstate.h"

struct seq_file;

struct bpf_iter_meta {
	struct seq_file *seq;
} __attribute__((preserve_access_index));

struct sock_common {
	unsigned short skc_family;
	unsigned char skc_state;
	struct {
		long long counter;
	} skc_cookie;
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
	int sk_sndbuf;
	int sk_rcvbuf;
	__u16 sk_type;
	__u16 sk_protocol;
} __attribute__((preserve_access_index));

struct tcp_options_received {
	__u16 mss_clamp;
} __attribute__((preserve_access_index));

struct tcp_sock {
	__u32 rcv_nxt;
	__u32 copied_seq;
	__u32 rcv_wup;
	__u32 snd_nxt;
	__u32 snd_una;
	__u32 snd_wl1;
	__u32 snd_wnd;
	__u32 max_window;
	__u32 write_seq;
	__u32 rcv_wnd;
	__u16 urg_data;
	struct tcp_options_received rx_opt;
	__u32 tsoffset;
} __attribute__((preserve_access_index));

struct bpf_iter__tcp {
	struct bpf_iter_meta *meta;
	struct sock_common *sk_common;
} __attribute__((preserve_access_index));

struct inode {
	unsigned long i_ino;
} __attribute__((preserve_access_index));

struct file {
	struct inode *f_inode;
} __attribute__((preserve_access_index));

struct task_struct;

struct socket {
	struct sock *sk;
} __attribute__((preserve_access_index));

struct bpf_iter__task_file {
	struct bpf_iter_meta *meta;
	struct task_struct *task;
	__u32 fd;
	struct file *file;
} __attribute__((preserve_access_index));

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FERRY_TCPSTATE_WANTED_MAX);
	__type(key, __u64);
	__type(value, __u8);
} FERRY_TCPSTATE_WANTED SEC(".maps");


/* Writes the record of @skc if ferryd asked for it and it is a TCP one. */
static __always_inline int emit(struct seq_file *seq, struct sock_common *skc)
{
	struct ferry_tcp_state out = {};
	struct tcp_sock *tp;
	struct sock *sk;

	out.cookie = BPF_CORE_READ(skc, skc_cookie.counter);
	if (!out.cookie || !bpf_map_lookup_elem(&FERRY_TCPSTATE_WANTED, &out.cookie))
		return 0;
	tp = bpf_skc_to_tcp_sock(skc);
	if (!tp)
		return 0;
	sk = (struct sock *)tp;
	out.state = BPF_CORE_READ(sk, __sk_common.skc_state);
	out.write_seq = BPF_CORE_READ(tp, write_seq);
	out.snd_una = BPF_CORE_READ(tp, snd_una);
	out.snd_nxt = BPF_CORE_READ(tp, snd_nxt);
	out.rcv_nxt = BPF_CORE_READ(tp, rcv_nxt);
	out.copied_seq = BPF_CORE_READ(tp, copied_seq);
	out.snd_wl1 = BPF_CORE_READ(tp, snd_wl1);
	out.snd_wnd = BPF_CORE_READ(tp, snd_wnd);
	out.max_window = BPF_CORE_READ(tp, max_window);
	out.rcv_wnd = BPF_CORE_READ(tp, rcv_wnd);
	out.rcv_wup = BPF_CORE_READ(tp, rcv_wup);
	out.sndbuf = BPF_CORE_READ(sk, sk_sndbuf);
	out.rcvbuf = BPF_CORE_READ(sk, sk_rcvbuf);
	out.urg_data = BPF_CORE_READ(tp, urg_data);
	out.mss_clamp = BPF_CORE_READ(tp, rx_opt.mss_clamp);
	out.tsoffset = BPF_CORE_READ(tp, tsoffset);

	bpf_seq_write(seq, &out, sizeof(out));
	return 0;
}

/* Every TCP socket of the namespace's hash table, empty buckets walked
 * too: the pass costs the table's size (262,144 buckets on this project's
 * machines), whatever the number of connections asked for. */
SEC("iter/tcp")
int ferry_tcp_state(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;

	if (!skc)
		return 0;
	return emit(ctx->meta->seq, skc);
}

/* The socket of a task_file iterator's descriptor @file (loaded from the
 * context once: the verifier wants the very pointer it saw checked), or
 * NULL if it is none. */
static __always_inline struct socket *socket_of(struct file *file)
{
	if (!file)
		return NULL;
	return bpf_sock_from_file(file);
}

/* The descriptors of one process (the link's task filter, Linux 6.1+):
 * the pass costs that process's descriptors only. */
SEC("iter/task_file")
int ferry_task_tcp_state(struct bpf_iter__task_file *ctx)
{
	struct socket *sock = socket_of(ctx->file);
	struct sock *sk;

	if (!sock)
		return 0;
	sk = sock->sk;
	if (!sk)
		return 0;
	return emit(ctx->meta->seq, &sk->__sk_common);
}

/* Every socket descriptor of one process (the link's task filter, as
 * above): ferryd takes the ones it migrates itself (pidfd_getfd) from this
 * list, inside the freeze, instead of listing /proc/PID/fd and asking
 * each descriptor what it is. */
SEC("iter/task_file")
int ferry_task_sockets(struct bpf_iter__task_file *ctx)
{
	struct ferry_task_socket out = {};
	struct file *file = ctx->file;
	struct socket *sock = socket_of(file);
	struct sock *sk;

	if (!sock)
		return 0;
	out.fd = ctx->fd;
	out.inode = BPF_CORE_READ(file, f_inode, i_ino);
	sk = sock->sk;
	/* A socket without its sock (being released) is listed as of no
	 * family: ferryd leaves it to CRIU. */
	if (sk) {
		out.family = BPF_CORE_READ(sk, __sk_common.skc_family);
		out.type = BPF_CORE_READ(sk, sk_type);
		out.protocol = BPF_CORE_READ(sk, sk_protocol);
		out.state = BPF_CORE_READ(sk, __sk_common.skc_state);
	}
	bpf_seq_write(ctx->meta->seq, &out, sizeof(out));
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
