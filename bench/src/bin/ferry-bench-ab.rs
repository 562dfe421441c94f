//! `ferry-bench-ab --a NAME=DIR[:CRIU] --b NAME=DIR[:CRIU] [--rounds N]
//! [-- FREEZE-BENCH-ARGS]`: the freeze of two builds, measured in
//! interleaved rounds, and compared.
//!
//! Each variant is a directory of ferry's binaries (`ferryd`,
//! `ferry-bench-freeze` and the workload servers it starts, as in
//! `target/debug`, where the bench crate's and the integration crate's
//! binaries land side by side) and optionally a CRIU binary. Each round
//! runs `ferry-bench-freeze` once per variant, with that variant's
//! `FERRY_BIN_DIR` and `FERRY_CRIU`; the order alternates (A B, B A, A B,
//! ...). On these machines the first variant of a back-to-back pair came
//! out ~2.5 ms faster, whichever it was, and the machine's speed drifts by
//! tens of percent within an hour: only interleaved rounds compare two
//! builds. Prints, and writes to `<out>/ab.md`, each variant's freeze
//! (median, mean, p95), its main parts and the parts of the freeze side by
//! side, with the RTO and UDP-loss totals that must stay 0.
//!
//! Two CRIU binaries compared must be built with one `SOURCE_DATE_EPOCH`:
//! CRIU keys its cache of the kernel's features by its build time, and
//! each would discard the other's cache at every switch.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Parser;
use ferry_bench::stats::{mean, median_unsorted as med, percentile};

#[derive(Debug, Parser)]
#[command(
    name = "ferry-bench-ab",
    about = "interleaved A/B of two builds' freeze (rounds of ferry-bench-freeze)"
)]
struct Args {
    /// The first variant: NAME=DIR or NAME=DIR:CRIU.
    #[arg(long)]
    a: Variant,
    /// The second variant.
    #[arg(long)]
    b: Variant,
    /// Rounds; each runs both variants once.
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Where each run's tables and the comparison go.
    #[arg(long, default_value = "target/bench/ab")]
    out: PathBuf,
    /// Arguments for each ferry-bench-freeze run (default: 3 migrations at
    /// 1024 connections, incremental).
    #[arg(last = true)]
    bench_args: Vec<String>,
}

#[derive(Debug, Clone)]
struct Variant {
    name: String,
    dir: PathBuf,
    criu: Option<PathBuf>,
}

impl std::str::FromStr for Variant {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (name, rest) = s
            .split_once('=')
            .ok_or_else(|| format!("`{s}`: expected NAME=DIR or NAME=DIR:CRIU"))?;
        if name.is_empty() || name.contains(['/', ' ']) {
            return Err(format!("`{name}`: a variant's name is a plain word"));
        }
        let (dir, criu) = match rest.split_once(':') {
            Some((d, c)) => (d, Some(PathBuf::from(c))),
            None => (rest, None),
        };
        Ok(Variant {
            name: name.to_owned(),
            dir: PathBuf::from(dir),
            criu,
        })
    }
}

/// What `ferry-bench-freeze` starts from its `FERRY_BIN_DIR`: the agent and
/// the integration crate's workloads (the session client with `--db`, the
/// echo server with `--bystanders`). Checked before the first round: a
/// directory with one crate's build only (`cargo build -p ferry-bench`)
/// lacks the others, and the freeze bench would fail only once its cluster
/// is up.
const VARIANT_BINARIES: [&str; 5] = [
    "ferryd",
    "ferry-bench-freeze",
    "ferry-dve-server",
    "ferry-echo-server",
    "ferry-pg-session",
];

const DEFAULT_BENCH_ARGS: [&str; 7] = [
    "--runs",
    "3",
    "--tcp",
    "1024",
    "--udp-only=",
    "--modes",
    "incremental",
];

fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.a.name == args.b.name {
        bail!("the two variants need different names");
    }
    for v in [&mut args.a, &mut args.b] {
        // Absolute: the cluster runs the binaries from other directories.
        v.dir = v
            .dir
            .canonicalize()
            .with_context(|| format!("variant {}: {}", v.name, v.dir.display()))?;
        if let Some(c) = &v.criu {
            v.criu = Some(
                c.canonicalize()
                    .with_context(|| format!("variant {}: {}", v.name, c.display()))?,
            );
        }
        let missing: Vec<&str> = VARIANT_BINARIES
            .into_iter()
            .filter(|bin| !v.dir.join(bin).is_file())
            .collect();
        if !missing.is_empty() {
            bail!(
                "variant {}: {} lacks {} (each DIR holds a build's binaries, as target/debug does)",
                v.name,
                v.dir.display(),
                missing.join(", ")
            );
        }
    }
    let bench_args: Vec<String> = if args.bench_args.is_empty() {
        DEFAULT_BENCH_ARGS.iter().map(|s| (*s).to_owned()).collect()
    } else {
        args.bench_args.clone()
    };
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    for round in 1..=args.rounds {
        let order = if round % 2 == 1 {
            [&args.a, &args.b]
        } else {
            [&args.b, &args.a]
        };
        for v in order {
            let out = args.out.join(format!("{}-{round}", v.name));
            run_once(v, &bench_args, &out)
                .with_context(|| format!("round {round}, variant {}", v.name))?;
            eprintln!("round {round}/{}: {} done", args.rounds, v.name);
        }
    }
    let summaries = [&args.a, &args.b]
        .map(|v| summarize(&args.out, &v.name, args.rounds))
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    let table = compare(&summaries, &bench_args, &args);
    print!("{table}");
    let path = args.out.join("ab.md");
    std::fs::write(&path, &table).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("written: {}", path.display());
    Ok(())
}

fn run_once(v: &Variant, bench_args: &[String], out: &Path) -> Result<()> {
    let mut c = Command::new(v.dir.join("ferry-bench-freeze"));
    c.args(bench_args)
        .arg("--out")
        .arg(out)
        .env("FERRY_BIN_DIR", &v.dir)
        .stdout(std::process::Stdio::null());
    if let Some(criu) = &v.criu {
        c.env("FERRY_CRIU", criu);
    }
    let status = c.status().context("starting ferry-bench-freeze")?;
    if !status.success() {
        bail!("ferry-bench-freeze exited with {status}");
    }
    Ok(())
}

/// One variant's migrations, over every round.
#[derive(Debug, Default)]
struct Summary {
    name: String,
    /// By column of freeze.csv: freeze_ms, dump_ms, transfer_ms, ...
    columns: BTreeMap<String, Vec<f64>>,
    /// By part of freeze_parts.csv, in their first order.
    parts: Vec<(String, Vec<f64>)>,
}

impl Summary {
    fn column(&self, name: &str) -> &[f64] {
        self.columns.get(name).map_or(&[], Vec::as_slice)
    }
}

fn summarize(out: &Path, name: &str, rounds: usize) -> Result<Summary> {
    let mut s = Summary {
        name: name.to_owned(),
        ..Summary::default()
    };
    // The comparison pools every migration: of one configuration only.
    let mut configuration: Option<Vec<String>> = None;
    for round in 1..=rounds {
        let dir = out.join(format!("{name}-{round}"));
        let freeze = read_csv(&dir.join("freeze.csv"))?;
        let keys: Vec<usize> = ["tcp", "udp", "mode"]
            .iter()
            .filter_map(|k| freeze.index(k))
            .collect();
        for row in &freeze.rows {
            let this: Vec<String> = keys.iter().filter_map(|&i| row.get(i).cloned()).collect();
            match &configuration {
                None => configuration = Some(this),
                Some(c) if *c != this => bail!(
                    "{}: more than one configuration ({} and {}); give ferry-bench-freeze one connection count and one mode",
                    dir.display(),
                    c.join("/"),
                    this.join("/")
                ),
                Some(_) => {}
            }
            for (h, v) in freeze.header.iter().zip(row) {
                if let Ok(x) = v.parse::<f64>() {
                    s.columns.entry(h.clone()).or_default().push(x);
                }
            }
        }
        let parts = read_csv(&dir.join("freeze_parts.csv"))?;
        let (Some(pi), Some(mi)) = (parts.index("part"), parts.index("ms")) else {
            bail!("{}: no part and ms columns", dir.display());
        };
        for row in &parts.rows {
            let (Some(part), Some(ms)) = (row.get(pi), row.get(mi)) else {
                continue;
            };
            let Ok(ms) = ms.parse::<f64>() else {
                continue;
            };
            match s.parts.iter_mut().find(|(p, _)| p == part) {
                Some((_, v)) => v.push(ms),
                None => s.parts.push((part.clone(), vec![ms])),
            }
        }
    }
    if s.column("freeze_ms").is_empty() {
        bail!("variant {name}: no migration in {}", out.display());
    }
    Ok(s)
}

fn compare(s: &[Summary], bench_args: &[String], args: &Args) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{} rounds, alternating which variant runs first; each run: ferry-bench-freeze {}\n",
        args.rounds,
        bench_args.join(" ")
    );
    let _ = writeln!(
        t,
        "| variant | migrations | freeze median (ms) | mean | p95 | dump | transfer | restore | TCP RTOs | UDP lost |"
    );
    let _ = writeln!(t, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for v in s {
        let f = v.column("freeze_ms");
        let _ = writeln!(
            t,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |",
            v.name,
            f.len(),
            med(f),
            mean(f),
            percentile(f, 95.0),
            med(v.column("dump_ms")),
            med(v.column("transfer_ms")),
            med(v.column("restore_ms")),
            v.column("tcp_rtos").iter().sum::<f64>(),
            v.column("udp_lost").iter().sum::<f64>(),
        );
    }
    let _ = writeln!(t, "\nParts of the freeze, medians (ms):\n");
    let _ = write!(t, "| part |");
    for v in s {
        let _ = write!(t, " {} |", v.name);
    }
    let _ = write!(t, "\n|---|");
    for _ in s {
        let _ = write!(t, "---:|");
    }
    t.push('\n');
    let mut names: Vec<&String> = Vec::new();
    for v in s {
        for (p, _) in &v.parts {
            if !names.contains(&p) {
                names.push(p);
            }
        }
    }
    for p in names {
        let _ = write!(t, "| {p} |");
        for v in s {
            match v.parts.iter().find(|(q, _)| q == p) {
                Some((_, x)) => {
                    let _ = write!(t, " {:.2} |", med(x));
                }
                None => t.push_str(" |"),
            }
        }
        t.push('\n');
    }
    t
}

/// A CSV file as the freeze bench writes it: a header, then rows; a field
/// may be quoted (a part's name holds commas).
struct Csv {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Csv {
    fn index(&self, column: &str) -> Option<usize> {
        self.header.iter().position(|h| h == column)
    }
}

fn read_csv(path: &Path) -> Result<Csv> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header = split_csv_line(lines.next().unwrap_or_default());
    Ok(Csv {
        header,
        rows: lines.map(split_csv_line).collect(),
    })
}

fn split_csv_line(line: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut field = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(std::mem::take(&mut field)),
            c => field.push(c),
        }
    }
    fields.push(field);
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quoted_field_keeps_its_commas() {
        assert_eq!(
            split_csv_line(r#"1024,24,incremental,0,"dump (CRIU, process stopped)",17.88"#),
            vec![
                "1024",
                "24",
                "incremental",
                "0",
                "dump (CRIU, process stopped)",
                "17.88"
            ]
        );
        assert_eq!(
            split_csv_line(r#"a,"say ""hi""",b"#),
            vec!["a", r#"say "hi""#, "b"]
        );
        assert_eq!(split_csv_line(""), vec![""]);
    }

    #[test]
    fn variants_are_named_with_a_directory_and_maybe_a_criu() {
        let v: Variant = "start=/tmp/a".parse().unwrap();
        assert_eq!(
            (v.name.as_str(), v.dir.as_path()),
            ("start", Path::new("/tmp/a"))
        );
        assert!(v.criu.is_none());
        let v: Variant = "end=/tmp/b:/opt/criu".parse().unwrap();
        assert_eq!(v.criu.as_deref(), Some(Path::new("/opt/criu")));
        assert!("nodir".parse::<Variant>().is_err());
        assert!("a/b=/tmp".parse::<Variant>().is_err());
    }

    #[test]
    fn rounds_are_summed_up_per_variant_and_part() {
        let out = tempfile::tempdir().unwrap();
        for (round, freeze, dump) in [(1, "30.0", "17.0"), (2, "34.0", "19.0")] {
            let dir = out.path().join(format!("x-{round}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(
                dir.join("freeze.csv"),
                format!("tcp,mode,freeze_ms,tcp_rtos\n1024,incremental,{freeze},0\n1024,incremental,40.0,0\n"),
            )
            .unwrap();
            std::fs::write(
                dir.join("freeze_parts.csv"),
                format!("tcp,part,ms\n1024,\"dump (CRIU, process stopped)\",{dump}\n"),
            )
            .unwrap();
        }
        let s = summarize(out.path(), "x", 2).unwrap();
        assert_eq!(s.column("freeze_ms"), [30.0, 40.0, 34.0, 40.0]);
        assert_eq!(
            s.parts,
            vec![("dump (CRIU, process stopped)".to_owned(), vec![17.0, 19.0])]
        );
        assert!(summarize(out.path(), "y", 1).is_err());
        // Two configurations are not pooled.
        std::fs::write(
            out.path().join("x-2/freeze.csv"),
            "tcp,mode,freeze_ms\n64,incremental,20.0\n",
        )
        .unwrap();
        let err = summarize(out.path(), "x", 2).unwrap_err().to_string();
        assert!(err.contains("1024/incremental and 64/incremental"), "{err}");
    }
}
