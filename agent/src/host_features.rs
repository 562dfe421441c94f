//! What this host's kernel and this agent's privileges offer ferry, probed
//! (not guessed from the kernel's version: distributions backport and
//! configure features away, e.g. soft-dirty bits here): `ferryd --check`
//! prints it, and ferryd logs what is missing when it starts.
//!
//! Each probe is cheap and touches only ferryd's own process: a
//! userfaultfd handshake, a `PAGEMAP_SCAN` of nothing, a soft-dirty round
//! trip on one page of its own, the kernel's BTF for the iterators' types,
//! its own capability set.

use std::fmt::Write as _;

/// One thing ferry uses, whether this host has it, and what depends on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Feature {
    /// Its name in `features_off` (config) and logs.
    pub key: &'static str,
    pub name: &'static str,
    pub present: bool,
    /// What in ferry uses it.
    pub used_for: &'static str,
    /// What happens on a host without it.
    pub without: &'static str,
    /// ferryd cannot run without it.
    pub required: bool,
}

/// Everything probed, with the kernel's release.
#[derive(Debug, Clone)]
pub struct HostFeatures {
    pub kernel: String,
    pub features: Vec<Feature>,
}

impl HostFeatures {
    /// The features this host lacks.
    pub fn missing(&self) -> impl Iterator<Item = &Feature> {
        self.features.iter().filter(|f| !f.present)
    }

    /// Whether the feature `key` is present (false for an unknown key).
    pub fn has(&self, key: &str) -> bool {
        self.features.iter().any(|f| f.key == key && f.present)
    }

    /// The features as the peer and control APIs carry them.
    pub fn to_pb(&self) -> Vec<ferry_proto::v1::HostFeature> {
        self.features
            .iter()
            .map(|f| ferry_proto::v1::HostFeature {
                key: f.key.to_owned(),
                name: f.name.to_owned(),
                present: f.present,
            })
            .collect()
    }

    /// Whether ferryd can run here at all.
    pub fn runnable(&self) -> bool {
        self.missing().all(|f| !f.required)
    }

    /// A table for people (`ferryd --check`): each feature with its key
    /// for `features_off`.
    pub fn table(&self) -> String {
        let mut t = format!("kernel  {}\n\n", self.kernel);
        let label = |f: &Feature| format!("{} [{}]", f.name, f.key);
        let width = self
            .features
            .iter()
            .map(|f| label(f).len())
            .max()
            .unwrap_or(0);
        for f in &self.features {
            let mark = if f.present { "yes" } else { "NO " };
            let _ = writeln!(t, "{mark}  {:width$}  {}", label(f), f.used_for);
            if !f.present {
                let _ = writeln!(t, "     {:width$}  without it: {}", "", f.without);
            }
        }
        t
    }
}

/// Every feature's key, as `features_off` takes them.
pub const KEYS: &[&str] = &[
    "uffd_wp_async",
    "pagemap_scan",
    "uffd_events",
    "soft_dirty",
    "btf",
    "bpf_iter_tcp",
    "bpf_iter_task_vma",
    "cgroup_sockopt",
    "cap_sys_resource",
    "cap_checkpoint_restore",
    "cap_bpf",
    "cap_sys_ptrace",
];

/// This host's features, probed once per ferryd, with the ones the
/// configuration turns off (`features_off`) marked missing: how a test
/// or an operator tries a fallback on a kernel that has the feature.
pub fn host(features_off: &[String]) -> HostFeatures {
    static PROBED: std::sync::OnceLock<HostFeatures> = std::sync::OnceLock::new();
    let mut host = PROBED.get_or_init(probe).clone();
    for f in &mut host.features {
        if features_off.iter().any(|k| k == f.key) {
            f.present = false;
        }
    }
    host
}

/// [`host`] from async code: the probes (the first time only) run off
/// the runtime.
pub async fn host_off_runtime(
    features_off: &[String],
) -> Result<HostFeatures, tokio::task::JoinError> {
    let off = features_off.to_vec();
    tokio::task::spawn_blocking(move || host(&off)).await
}

/// The feature `key` of this host, `features_off` applied (blocking the
/// first time: the probes).
pub fn feature(features_off: &[String], key: &str) -> Feature {
    host(features_off)
        .features
        .into_iter()
        .find(|f| f.key == key)
        .unwrap_or_else(|| panic!("{key} is not one of host_features::KEYS"))
}

/// Probes this host (blocking, a few milliseconds).
pub fn probe() -> HostFeatures {
    let btf = std::fs::read("/sys/kernel/btf/vmlinux").ok();
    let has_btf_type = |name: &str| {
        btf.as_deref().is_some_and(|b| {
            // Type names are NUL-terminated in BTF's string section.
            let needle = [name.as_bytes(), b"\0"].concat();
            b.windows(needle.len()).any(|w| w == needle.as_slice())
        })
    };
    let caps = own_effective_caps();
    let cap = |bit: u32| caps.is_some_and(|c| c & (1 << bit) != 0);
    let features = vec![
        Feature {
            key: "uffd_wp_async",
            name: "userfaultfd asynchronous write-protect",
            present: crate::uffd::has_features(crate::uffd::UFFD_FEATURE_WP_ASYNC).unwrap_or(false),
            used_for: "pre-copy's tracking of written pages (Linux 6.7+)",
            without: "pre-copy, queued pre-copy and assisted post-copy asked for are refused before the freeze, naming it; a configured one gives way to total copy (said in the report)",
            required: false,
        },
        Feature {
            key: "pagemap_scan",
            name: "PAGEMAP_SCAN",
            present: pagemap_scan_exists(),
            used_for: "pre-copy's scan of written pages, held pages left out of the dump (Linux 6.7+)",
            without: "as without asynchronous write-protect",
            required: false,
        },
        Feature {
            key: "uffd_events",
            name: "userfaultfd events (fork, remap, remove, unmap)",
            present: crate::uffd::has_features(crate::uffd::FILL_FEATURES).unwrap_or(false),
            used_for: "post-copy and the fill of held pages after the resume",
            without: "post-copy to this node is refused before the freeze if asked for, total copy if configured; pre-copy carries the pages this node holds in the freeze (said in the report)",
            required: false,
        },
        Feature {
            key: "soft_dirty",
            name: "soft-dirty bits",
            present: soft_dirty_works(),
            used_for: "nothing yet (CRIU's own pre-dump tracking, the older kernels' way)",
            without: "nothing: ferry tracks written pages by write-protect",
            required: false,
        },
        Feature {
            key: "btf",
            name: "BTF (/sys/kernel/btf/vmlinux)",
            present: btf.is_some(),
            used_for: "every eBPF program (CO-RE)",
            without: "no fallback: the data plane's programs do not load; a kernel built with CONFIG_DEBUG_INFO_BTF=y would do (Debian's, Ubuntu's and Fedora's from 5.15 are)",
            required: true,
        },
        Feature {
            key: "bpf_iter_tcp",
            name: "BPF iterator over TCP sockets",
            present: has_btf_type("bpf_iter__tcp"),
            used_for: "reading every connection's state in one pass in the freeze",
            without: "the freeze reads each connection by its own calls (said in the report)",
            required: false,
        },
        Feature {
            key: "bpf_iter_task_vma",
            name: "BPF iterator over mappings",
            present: has_btf_type("bpf_iter__task_vma"),
            used_for: "mappings' flags without smaps in the dump",
            without: "CRIU reads smaps, which walks every resident page (a longer dump)",
            required: false,
        },
        Feature {
            key: "cgroup_sockopt",
            name: "cgroup setsockopt hook",
            present: has_btf_type("bpf_sockopt_kern"),
            used_for: "incremental socket migration's watch for option changes after the pre-read",
            without: "incremental socket migration falls back to collective (said in the report)",
            required: false,
        },
        Feature {
            key: "cap_sys_resource",
            name: "CAP_SYS_RESOURCE",
            present: cap(crate::process::privileges::CAP_SYS_RESOURCE),
            used_for: "CRIU's prlimit() on tasks of another user; pipes above fs.pipe-max-size",
            without: "ferry's CRIU reads other users' limits from procfs; another CRIU cannot move servers that drop root (refused before the freeze)",
            required: false,
        },
        Feature {
            key: "cap_checkpoint_restore",
            name: "CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN",
            present: cap(40) || cap(21),
            used_for: "CRIU's dump and restore",
            without: "every migration from or to this node is refused before the freeze",
            required: false,
        },
        Feature {
            key: "cap_bpf",
            name: "CAP_BPF and CAP_NET_ADMIN",
            present: (cap(39) || cap(21)) && cap(12),
            used_for: "the data plane's eBPF programs",
            without: "no fallback: the data plane's programs do not load; run ferryd as root with these capabilities (packaging/ferryd.service keeps them)",
            required: true,
        },
        Feature {
            key: "cap_sys_ptrace",
            name: "CAP_SYS_PTRACE",
            present: cap(19),
            used_for: "taking a process's connections and memory tracker (pidfd_getfd, ptrace)",
            without: "every migration from this node is refused before the freeze",
            required: false,
        },
    ];
    HostFeatures {
        kernel: kernel_release(),
        features,
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

/// The effective capability set of ferryd.
fn own_effective_caps() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    crate::process::privileges::effective_caps(&status)
}

/// Whether the kernel knows the `PAGEMAP_SCAN` ioctl: a scan of an empty
/// range answers with nothing on a kernel that has it, ENOTTY on one that
/// does not.
fn pagemap_scan_exists() -> bool {
    let Ok(pagemap) = std::fs::File::open("/proc/self/pagemap") else {
        return false;
    };
    let mut out = Vec::new();
    let query = crate::uffd::ScanQuery {
        return_mask: crate::uffd::PAGE_IS_PRESENT,
        ..Default::default()
    };
    match crate::uffd::pagemap_scan(std::os::fd::AsFd::as_fd(&pagemap), 0, 0, query, &mut out) {
        Ok(_) => true,
        Err(e) => e.raw_os_error() != Some(libc::ENOTTY),
    }
}

/// Whether soft-dirty bits work: a page of ferryd's own, cleared
/// (`clear_refs` 4) and written, reads as soft-dirty (pagemap bit 55).
/// A kernel without CONFIG_MEM_SOFT_DIRTY accepts the clear and never
/// sets the bit.
fn soft_dirty_works() -> bool {
    use std::io::{Read, Seek, SeekFrom, Write};
    const SOFT_DIRTY: u64 = 1 << 55;
    // SAFETY: an anonymous private mapping of one page, unmapped below.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if page == libc::MAP_FAILED {
        return false;
    }
    let result = (|| -> std::io::Result<bool> {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/proc/self/clear_refs")?
            .write_all(b"4")?;
        // SAFETY: the page is mapped writable above and only this
        // function uses it.
        unsafe { std::ptr::write_volatile(page.cast::<u8>(), 1) };
        let mut pagemap = std::fs::File::open("/proc/self/pagemap")?;
        pagemap.seek(SeekFrom::Start(page as u64 / 4096 * 8))?;
        let mut entry = [0u8; 8];
        pagemap.read_exact(&mut entry)?;
        Ok(u64::from_ne_bytes(entry) & SOFT_DIRTY != 0)
    })();
    // SAFETY: unmaps the page mapped above.
    unsafe { libc::munmap(page, 4096) };
    result.unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This machine (DESIGN.md's facts): Linux 6.18 with write-protect,
    /// PAGEMAP_SCAN, the iterators and BTF, without soft-dirty bits and
    /// without CAP_SYS_RESOURCE. The probes must find exactly that.
    #[test]
    fn finds_what_this_machine_has_and_lacks() {
        let host = probe();
        let has = |name: &str| {
            host.features
                .iter()
                .find(|f| f.name == name)
                .unwrap_or_else(|| panic!("no probe {name}"))
                .present
        };
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        assert!(
            has("userfaultfd asynchronous write-protect"),
            "{}",
            host.table()
        );
        assert!(has("PAGEMAP_SCAN"), "{}", host.table());
        assert!(has("BPF iterator over TCP sockets"), "{}", host.table());
        assert!(has("BPF iterator over mappings"), "{}", host.table());
        assert!(has("cgroup setsockopt hook"), "{}", host.table());
        assert!(has("BTF (/sys/kernel/btf/vmlinux)"), "{}", host.table());
        // The kernel's build configuration, where it is published.
        let config = std::fs::read_to_string(format!("/boot/config-{}", host.kernel))
            .ok()
            .or_else(|| {
                let out = std::process::Command::new("zcat")
                    .arg("/proc/config.gz")
                    .output()
                    .ok()?;
                out.status
                    .success()
                    .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
            });
        if let Some(config) = config {
            assert_eq!(
                has("soft-dirty bits"),
                config.contains("CONFIG_MEM_SOFT_DIRTY=y"),
                "{}",
                host.table()
            );
        }
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let own = crate::process::privileges::has_cap_sys_resource(&status);
        assert_eq!(Some(has("CAP_SYS_RESOURCE")), own, "{}", host.table());
    }

    #[test]
    fn every_probe_has_a_known_key_and_features_off_turns_it_off() {
        let probed: Vec<&str> = probe().features.iter().map(|f| f.key).collect();
        assert_eq!(probed, KEYS);
        let off = vec!["pagemap_scan".to_owned()];
        assert!(!feature(&off, "pagemap_scan").present);
        assert_eq!(
            feature(&[], "btf").present,
            std::path::Path::new("/sys/kernel/btf/vmlinux").exists()
        );
    }

    #[test]
    fn the_table_says_what_is_missing_and_what_that_means() {
        let host = HostFeatures {
            kernel: "5.15.0".into(),
            features: vec![
                Feature {
                    key: "pagemap_scan",
                    name: "PAGEMAP_SCAN",
                    present: false,
                    used_for: "pre-copy",
                    without: "total copy only",
                    required: false,
                },
                Feature {
                    key: "btf",
                    name: "BTF",
                    present: true,
                    used_for: "eBPF",
                    without: "no start",
                    required: true,
                },
            ],
        };
        assert_eq!(
            host.table(),
            "kernel  5.15.0\n\nNO   PAGEMAP_SCAN [pagemap_scan]  pre-copy\n                                  without it: total copy only\nyes  BTF [btf]                    eBPF\n"
        );
        assert_eq!(host.missing().count(), 1);
        assert!(host.runnable());
    }
}
