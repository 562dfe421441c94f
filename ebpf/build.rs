//! Compiles every `c/*.bpf.c` with clang into OUT_DIR; src/ embeds the
//! objects with `include_bytes_aligned!`. C because stable Rust cannot
//! build eBPF (no bpf-linker here).

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // The directory itself, so that a new program is picked up.
    println!("cargo:rerun-if-changed=c");
    println!("cargo:rerun-if-changed=include");
    let mut sources: Vec<PathBuf> = std::fs::read_dir("c")
        .expect("reading ebpf/c")
        .map(|e| e.expect("reading ebpf/c").path())
        .filter(|p| p.to_string_lossy().ends_with(".bpf.c"))
        .collect();
    sources.sort();
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
        compile(src, &out);
    }
}

fn compile(src: &Path, out: &Path) {
    let name = src.file_name().unwrap().to_string_lossy();
    let obj = out.join(name.replace(".bpf.c", ".bpf.o"));
    let status = Command::new("clang")
        .args(["-O2", "-g", "-target", "bpf", "-D__TARGET_ARCH_x86"])
        .args(["-Wall", "-Werror"])
        // include/ for the shared layouts; the multiarch directory for
        // <asm/...>, which the kernel UAPI headers include.
        .args(["-I", "include", "-I", "/usr/include/x86_64-linux-gnu"])
        .arg("-c")
        .arg(src)
        .arg("-o")
        .arg(&obj)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("clang failed ({s}) on {}", src.display()),
        Err(e) if e.kind() == ErrorKind::NotFound => panic!(
            "clang not found: it builds ferry's eBPF programs ({}); run `cargo xtask setup`",
            src.display()
        ),
        Err(e) => panic!(
            "cannot run clang on {} ({e}): run `cargo xtask setup`",
            src.display()
        ),
    }
}
