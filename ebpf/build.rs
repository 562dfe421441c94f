//! Compiles the C eBPF programs in c/ with clang into OUT_DIR.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rerun-if-changed=include/ferry_dataplane.h");
    let mut sources: Vec<PathBuf> = std::fs::read_dir("c")
        .expect("reading ebpf/c")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".bpf.c"))
        .collect();
    sources.sort();
    for src in sources {
        println!("cargo:rerun-if-changed={}", src.display());
        let name = src
            .file_name()
            .unwrap()
            .to_string_lossy()
            .replace(".bpf.c", ".bpf.o");
        let obj = out.join(name);
        let status = Command::new("clang")
            .args([
                "-O2",
                "-g",
                "-target",
                "bpf",
                "-D__TARGET_ARCH_x86",
                "-Wall",
                "-Werror",
            ])
            .args(["-I", "include", "-I", "/usr/include/x86_64-linux-gnu"])
            .arg("-c")
            .arg(&src)
            .arg("-o")
            .arg(&obj)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run clang to build {} ({e}): run `cargo xtask setup`",
                    src.display()
                )
            });
        assert!(status.success(), "clang failed on {}", src.display());
    }
}
