/* SPDX-License-Identifier: GPL-2.0 */
/* The layout shared by c/tcpstate.bpf.c and src/tcpstate.rs. */
#ifndef FERRY_TCPSTATE_H
#define FERRY_TCPSTATE_H

#include <linux/types.h>

/* Connections ferryd asks about, by socket cookie (SO_COOKIE). */
#define FERRY_TCPSTATE_WANTED_MAX 65536

/* One connection's state as TCP repair reads it, from the kernel's own
 * fields (the getsockopt/ioctl each reads named beside it). */
struct ferry_tcp_state {
	__u64 cookie;
	__u32 state;      /* TCP_INFO tcpi_state */
	__u32 write_seq;  /* TCP_QUEUE_SEQ, send queue */
	__u32 snd_una;    /* SIOCOUTQ = write_seq - snd_una */
	__u32 snd_nxt;    /* SIOCOUTQNSD = write_seq - snd_nxt */
	__u32 rcv_nxt;    /* TCP_QUEUE_SEQ, receive queue */
	__u32 copied_seq; /* SIOCINQ = rcv_nxt - copied_seq */
	__u32 snd_wl1;    /* TCP_REPAIR_WINDOW, in its order */
	__u32 snd_wnd;
	__u32 max_window;
	__u32 rcv_wnd;
	__u32 rcv_wup;
	__s32 sndbuf;     /* SO_SNDBUF */
	__s32 rcvbuf;     /* SO_RCVBUF */
	__u32 urg_data;   /* non-zero: urgent data pending, SIOCINQ differs */
	__u32 mss_clamp;  /* TCP_MAXSEG in repair mode */
	__u32 tsoffset;   /* TCP_TIMESTAMP = the TCP clock (ms, or us) + this */
};

/* One socket descriptor of a process (ferry_task_sockets): what ferryd
 * otherwise learns by listing /proc/PID/fd and asking each descriptor
 * (fstat, SO_DOMAIN, SO_PROTOCOL, TCP_INFO) before taking it. */
struct ferry_task_socket {
	__u64 inode;    /* fstat's st_ino */
	__u32 fd;
	__u16 family;   /* SO_DOMAIN */
	__u16 type;     /* SO_TYPE */
	__u16 protocol; /* SO_PROTOCOL */
	__u8 state;     /* TCP_INFO tcpi_state (any socket's sk_state) */
	__u8 pad[5];
};

#endif
