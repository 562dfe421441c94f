/* SPDX-License-Identifier: GPL-2.0 */
/* The layout shared by c/vmaflags.bpf.c, src/vmaflags.rs and ferry's
 * CRIU patch xtask/criu/vma-flags-without-smaps.patch. */
#ifndef FERRY_VMAFLAGS_H
#define FERRY_VMAFLAGS_H

#include <linux/types.h>

/* One mapping of a process, as the kernel keeps it: its range and its
 * vm_flags word, whose bits smaps prints as "VmFlags:" mnemonics. */
struct ferry_vma_flags {
	__u64 start;
	__u64 end;
	__u64 flags;
};

#endif
