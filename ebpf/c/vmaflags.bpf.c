// SPDX-License-Identifier: GPL-2.0
/*
 * A process's mappings with their flags, read in the freeze without
 * walking its page tables.
 *
 * CRIU's dump reads /proc/<pid>/smaps for each mapping's "VmFlags:" line
 * (MAP_GROWSDOWN, mlock, madvise advice...), and the kernel computes
 * smaps' page counts by visiting every resident page: ~15 ms a GiB in the
 * freeze. This iterator, linked to one process (task filter, Linux 6.1+),
 * writes each mapping's range and its vm_flags word instead; ferryd opens
 * it before the freeze and hands it to CRIU, which reads it once the
 * process is stopped, with /proc/<pid>/maps (no page walk) for the rest.
 * vm_flags' bits are not ABI: ferryd learns which bit each mnemonic is on
 * this kernel by comparing this iterator and smaps for mappings it makes
 * (agent/src/criu/vmflags.rs). Relocated against the running kernel's
 * BTF (CO-RE): vm_start, vm_end and vm_flags sit in anonymous unions.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#include "ferry_vmaflags.h"

struct seq_file;

struct bpf_iter_meta {
	struct seq_file *seq;
} __attribute__((preserve_access_index));

struct task_struct {
	int pid;
	int tgid;
} __attribute__((preserve_access_index));

struct vm_area_struct {
	union {
		struct {
			unsigned long vm_start;
			unsigned long vm_end;
		};
	};
	union {
		const unsigned long vm_flags;
	};
} __attribute__((preserve_access_index));

struct bpf_iter__task_vma {
	struct bpf_iter_meta *meta;
	struct task_struct *task;
	struct vm_area_struct *vma;
} __attribute__((preserve_access_index));

SEC("iter/task_vma")
int ferry_vma_flags(struct bpf_iter__task_vma *ctx)
{
	struct task_struct *task = ctx->task;
	struct vm_area_struct *vma = ctx->vma;
	struct ferry_vma_flags out;

	if (!task || !vma)
		return 0;
	/* Threads share the leader's mappings: once per process. */
	if (task->pid != task->tgid)
		return 0;
	out.start = vma->vm_start;
	out.end = vma->vm_end;
	out.flags = vma->vm_flags;
	bpf_seq_write(ctx->meta->seq, &out, sizeof(out));
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
