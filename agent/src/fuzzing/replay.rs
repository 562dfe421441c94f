//! The kept inputs replayed through the targets' bodies on every
//! `cargo test`, and the seeds written into `fuzz/corpus/`.

use std::collections::HashMap;
use std::path::Path;

use super::{TARGETS, regressions, seeds};

/// Where the fuzz targets' kept inputs are: the minimised corpus and
/// the crashes found and fixed.
fn kept(target: &str) -> Vec<std::path::PathBuf> {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut files = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(fuzz.join(dir).join(target)) else {
            continue;
        };
        files.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_file()));
    }
    files.sort();
    files
}

/// Every kept input of every target, once, as the fuzzer ran them:
/// what `cargo xtask fuzz` found and was fixed stays fixed.
#[test]
fn fuzz_corpus_replays_without_a_finding() {
    for (target, run) in TARGETS {
        let files = kept(target);
        for path in &files {
            let data = std::fs::read(path).unwrap();
            let outcome = std::panic::catch_unwind(|| run(&data));
            assert!(outcome.is_ok(), "{target}: {} fails", path.display());
        }
        eprintln!("{target}: {} inputs replayed", files.len());
    }
}

#[test]
fn regressions_run_clean() {
    for (target, _, data) in regressions() {
        let run = TARGETS.iter().find(|(t, _)| *t == target).unwrap().1;
        run(&data);
    }
}

#[test]
fn seeds_run_clean() {
    for (target, data) in seeds() {
        let run = TARGETS.iter().find(|(t, _)| *t == target).unwrap().1;
        run(&data);
    }
}

#[test]
fn short_and_empty_inputs_mean_something() {
    for (_, run) in TARGETS {
        run(&[]);
        run(&[0]);
        run(&[0xff; 3]);
    }
}

/// Writes [`seeds`] into `fuzz/corpus/<target>/seed-<n>`.
#[test]
#[ignore = "writes the fuzz seeds: cargo test -p ferry-agent write_fuzz_seeds -- --ignored"]
fn write_fuzz_seeds() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    let mut n: HashMap<&str, usize> = HashMap::new();
    for (target, data) in seeds() {
        let i = n.entry(target).or_default();
        *i += 1;
        let dir = corpus.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("seed-{i}")), data).unwrap();
    }
    let kept = corpus.join("../regressions");
    for (target, name, data) in regressions() {
        let dir = kept.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), data).unwrap();
    }
}
