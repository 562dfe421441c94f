//! `cargo xtask sim <openmosix|dve|all> [--runs N] [--seed S] [--out DIR]`:
//! runs the policy simulator (ferry-policy's `sim` module, the same policy
//! code ferryd runs) and writes tables, CSV and SVG plots to a report
//! directory, by default `target/sim/<name>/`. Needs no root and no setup.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::ValueEnum;
use ferry_policy::sim::report::{csv, text_table};
use ferry_policy::sim::svg::{Chart, Series};
use ferry_policy::sim::{dve, openmosix};

use crate::cmd;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SimName {
    /// Meehan & Wynne (openMosix): 20 nodes, 6 spikes of 70 CPU-bound processes, own load vs
    /// hearsay vectors.
    Openmosix,
    /// Gerofi et al. (DVE): 5 nodes, 100 zone servers, 10,000 drifting clients, balancing off
    /// vs on.
    Dve,
    /// Both.
    All,
}

#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    pub name: SimName,
    /// Runs per variant (openmosix; default 5, as in Meehan & Wynne (openMosix)).
    #[arg(long)]
    pub runs: Option<u32>,
    /// Base seed; run r uses seed + r.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Report directory (default target/sim/<name>/).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

pub fn run(args: &SimArgs) -> Result<()> {
    match args.name {
        SimName::Openmosix => run_openmosix(args),
        SimName::Dve => run_dve(args),
        SimName::All => {
            run_openmosix(args)?;
            run_dve(args)
        }
    }
}

fn out_dir(args: &SimArgs, name: &str) -> Result<PathBuf> {
    let dir = match &args.out {
        // With `all`, each simulation gets its own subdirectory.
        Some(out) if args.name == SimName::All => out.join(name),
        Some(out) => out.clone(),
        None => cmd::workspace_root().join("target").join("sim").join(name),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

fn write(dir: &Path, file: &str, contents: &str) -> Result<()> {
    let path = dir.join(file);
    std::fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))
}

fn f1(v: f64) -> String {
    format!("{v:.1}")
}

fn pm(v: (f64, f64)) -> String {
    format!("{:.1} ± {:.1}", v.0, v.1)
}

fn run_openmosix(args: &SimArgs) -> Result<()> {
    let mut params = openmosix::Params::default();
    if let Some(runs) = args.runs {
        params.runs = runs;
    }
    if let Some(seed) = args.seed {
        params.seed = seed;
    }
    let dir = out_dir(args, "openmosix")?;
    let started = std::time::Instant::now();
    let variants: Vec<openmosix::Variant> = openmosix::Variant::SEED_TABLE
        .into_iter()
        .chain(openmosix::Variant::FERRY_TABLE)
        .chain(openmosix::Variant::LOCATION_ALTERNATIVES)
        .chain(openmosix::Variant::ablations())
        .collect();
    let results = openmosix::run_all(&params, &variants)?;
    let header = [
        "variant",
        "recovery s (sim)",
        "recovery s (openMosix)",
        "choose/node (sim)",
        "choose/node (openMosix)",
        "migr/node (sim)",
        "migr/node (openMosix)",
        "choose/migr (sim)",
        "choose/migr (openMosix)",
        "msg B (sim)",
        "msg B (openMosix)",
        "load B/node/s (sim)",
        "belief age s (sim)",
        "target error (sim)",
        "re-migrated (sim)",
        "refused (sim)",
        "timed out",
    ];
    let mut rows = Vec::new();
    for v in &results {
        let reference = openmosix::seed_reference(v.variant);
        let seed = |f: fn(&openmosix::SeedReference) -> f64| {
            reference.as_ref().map_or("-".to_string(), |r| f1(f(r)))
        };
        let choose = v.mean(|r| r.choose_per_node);
        let migr = v.mean(|r| r.migrations_per_node);
        rows.push(vec![
            v.label.clone(),
            pm(v.mean(|r| r.recovery_secs)),
            seed(|r| r.recovery_secs),
            pm(choose),
            seed(|r| r.choose_per_node),
            pm(migr),
            seed(|r| r.migrations_per_node),
            f1(choose.0 / migr.0),
            seed(|r| r.choose_per_node / r.migrations_per_node),
            v.runs.first().map_or(0, |r| r.message_bytes).to_string(),
            reference.map_or("-".into(), |r| r.message_bytes.to_string()),
            f1(v.mean(|r| r.load_bytes_per_node_per_sec).0),
            format!("{:.2}", v.mean(|r| r.mean_belief_age_secs).0),
            format!("{:.2}", v.mean(|r| r.mean_target_error).0),
            f1(v.mean(|r| f64::from(r.remigrated_processes)).0),
            f1(v.mean(|r| r.refused_offers as f64).0),
            v.runs.iter().filter(|r| r.timed_out).count().to_string(),
        ]);
    }
    let table = text_table(&header, &rows);
    println!(
        "openmosix: {} nodes, {} spikes of {} processes {} s apart, {} runs per variant (seed {}), {:.1} s\n",
        params.nodes,
        params.spikes,
        params.processes_per_spike,
        params.spike_interval.as_secs(),
        params.runs,
        params.seed,
        started.elapsed().as_secs_f64()
    );
    println!("{table}");
    println!(
        "(openMosix) columns: the figures Meehan & Wynne (openMosix) measured, for reference; \
         (sim) columns: this simulation, mean ± sd over runs."
    );
    write(&dir, "summary.txt", &table)?;
    write(&dir, "summary.csv", &csv(&header, &rows))?;
    let run_header = [
        "variant",
        "run",
        "recovery_secs",
        "timed_out",
        "choose_per_node",
        "migrations_per_node",
        "remigrated_processes",
        "message_bytes",
        "load_bytes_per_node_per_sec",
        "mean_belief_age_secs",
        "mean_target_error",
        "refused_offers",
        "final_spread",
    ];
    let mut run_rows = Vec::new();
    for v in &results {
        for (i, r) in v.runs.iter().enumerate() {
            run_rows.push(vec![
                v.label.clone(),
                i.to_string(),
                format!("{:.3}", r.recovery_secs),
                r.timed_out.to_string(),
                format!("{:.2}", r.choose_per_node),
                format!("{:.2}", r.migrations_per_node),
                r.remigrated_processes.to_string(),
                r.message_bytes.to_string(),
                format!("{:.1}", r.load_bytes_per_node_per_sec),
                format!("{:.3}", r.mean_belief_age_secs),
                format!("{:.3}", r.mean_target_error),
                r.refused_offers.to_string(),
                r.final_spread.to_string(),
            ]);
        }
    }
    write(&dir, "runs.csv", &csv(&run_header, &run_rows))?;
    let mut timeline_rows = Vec::new();
    for v in &results {
        for p in &v.runs[0].timeline {
            timeline_rows.push(vec![
                v.label.clone(),
                format!("{:.0}", p.secs),
                p.max_processes.to_string(),
                p.min_processes.to_string(),
                p.migrations_so_far.to_string(),
            ]);
        }
    }
    write(
        &dir,
        "timeline_run0.csv",
        &csv(
            &[
                "variant",
                "secs",
                "max_processes",
                "min_processes",
                "migrations_so_far",
            ],
            &timeline_rows,
        ),
    )?;
    // Run 0 of each variant over time.
    let busiest = timeline_chart(
        &results,
        "openMosix spikes: processes on the busiest node (run 0)",
        "processes on the busiest node",
        |p| p.max_processes as f64,
    );
    write(&dir, "busiest_node.svg", &busiest.render())?;
    let migrations = timeline_chart(
        &results,
        "openMosix spikes: migrations so far (run 0)",
        "migrations",
        |p| p.migrations_so_far as f64,
    );
    write(&dir, "migrations.svg", &migrations.render())?;
    let mut params_text = String::new();
    let _ = writeln!(params_text, "{params:#?}");
    write(&dir, "params.txt", &params_text)?;
    println!("\nreport: {}", dir.display());
    Ok(())
}

/// One series per variant: `value` of run 0's timeline over time.
fn timeline_chart(
    results: &[openmosix::VariantResult],
    title: &str,
    y_label: &str,
    value: impl Fn(&openmosix::TimelinePoint) -> f64,
) -> Chart {
    Chart {
        title: title.into(),
        x_label: "seconds since the first spike".into(),
        y_label: y_label.into(),
        y_range: None,
        x_log2: false,
        series: results
            .iter()
            .map(|v| Series {
                name: v.label.clone(),
                points: v.runs[0]
                    .timeline
                    .iter()
                    .map(|p| (p.secs, value(p)))
                    .collect(),
            })
            .collect(),
    }
}

/// The two mechanisms' costs, fitted to ferry's committed results
/// (`docs/freeze.csv`, `docs/memory.csv`), and a line that says so.
fn measured_mechanisms() -> Result<([dve::MechanismVariant; 4], String)> {
    use ferry_policy::measured_cost::fit;
    let docs = crate::cmd::workspace_root().join("docs");
    let read = |f: &str| {
        std::fs::read_to_string(docs.join(f)).with_context(|| format!("reading docs/{f}"))
    };
    let (freeze, memory) = (read("freeze.csv")?, read("memory.csv")?);
    let precopy = fit(&freeze, "incremental", Some((&memory, "pre-copy")))?;
    let stop_and_copy = fit(&freeze, "iterative", None)?;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
    let provenance = format!(
        "migration cost fitted to ferry's release measurements: pre-copy {:.1} ms + {:.1} µs per connection + {:.2} µs per MiB \
         (docs/freeze.csv incremental mode, {} migrations; docs/memory.csv pre-copy at 1,000 pages/s over 1 Gb/s, {}); \
         stop-and-copy {:.1} ms + {:.1} µs per connection (docs/freeze.csv iterative mode, {}) plus the memory at 1 Gb/s",
        ms(precopy.fixed),
        ms(precopy.per_connection) * 1000.0,
        ms(precopy.per_mib) * 1000.0,
        precopy.connection_rows,
        precopy.memory_rows,
        ms(stop_and_copy.fixed),
        ms(stop_and_copy.per_connection) * 1000.0,
        stop_and_copy.connection_rows,
    );
    Ok((
        [
            dve::precopy_mechanism(&precopy),
            dve::stop_and_copy_mechanism(&stop_and_copy),
            dve::precopy_mechanism(&precopy).with_policies(dve::Policies::Ferry),
            dve::precopy_mechanism(&precopy).with_policies(dve::Policies::FerrySymmetric),
        ],
        provenance,
    ))
}

fn run_dve(args: &SimArgs) -> Result<()> {
    let mut params = dve::Params::default();
    if let Some(seed) = args.seed {
        params.seed = seed;
    }
    let dir = out_dir(args, "dve")?;
    let started = std::time::Instant::now();
    let (mechanisms, provenance) = measured_mechanisms()?;
    println!("{provenance}");
    let results = dve::run_all(&params, &mechanisms)?;
    let tail_from = params.duration.as_secs_f64() * 2.0 / 3.0;
    let nodes = params.nodes;
    let mut header: Vec<String> = vec!["variant".into()];
    header.extend((1..=nodes).map(|n| format!("node{n} CPU last 5 min")));
    header.extend(
        [
            "max-min",
            "s with a node > 95%",
            "migrations",
            "pulls (given)",
            "refused",
            "frozen s",
            "max freeze ms",
            "client·s frozen",
        ]
        .map(String::from),
    );
    let mut rows = Vec::new();
    for r in &results {
        let tail = r.mean_utilisation_from(tail_from);
        let max = tail.iter().cloned().fold(0.0, f64::max);
        let min = tail.iter().cloned().fold(1.0, f64::min);
        let mut row = vec![r.label.clone()];
        row.extend(tail.iter().map(|u| format!("{:.0}%", u * 100.0)));
        row.push(format!("{:.0} pts", (max - min) * 100.0));
        row.push(format!(
            "{:.0}",
            r.secs_any_node_above(0.95, params.report_every)
        ));
        row.push(r.migrations.to_string());
        row.push(format!("{} ({})", r.pulls, r.pulls_given));
        row.push(r.refused_offers.to_string());
        row.push(format!("{:.2}", r.frozen_secs));
        row.push(format!("{:.0}", r.max_freeze_ms));
        row.push(format!("{:.0}", r.client_frozen_secs));
        rows.push(row);
    }
    let header_refs: Vec<&str> = header.iter().map(|s| s.as_str()).collect();
    let table = text_table(&header_refs, &rows);
    println!(
        "dve: {} nodes x {} cores, 100 zones, {} clients, {} s (seed {}), {:.1} s\n",
        params.nodes,
        params.cores_per_node,
        params.clients,
        params.duration.as_secs(),
        params.seed,
        started.elapsed().as_secs_f64()
    );
    println!("{table}");
    write(&dir, "summary.txt", &table)?;
    write(&dir, "summary.csv", &csv(&header_refs, &rows))?;
    // Time series: one CSV per variant, one CPU and one zones plot each.
    for (i, r) in results.iter().enumerate() {
        let slug = [
            "off",
            "on_precopy",
            "on_stop_and_copy",
            "on_precopy_ferry",
            "on_precopy_ferry_symmetric",
        ]
        .get(i)
        .copied()
        .unwrap_or("variant");
        let mut series_header = vec!["secs".to_string()];
        series_header.extend((1..=nodes).map(|n| format!("node{n}_cpu")));
        series_header.extend((1..=nodes).map(|n| format!("node{n}_zones")));
        let rows: Vec<Vec<String>> = r
            .samples
            .iter()
            .map(|s| {
                let mut row = vec![format!("{:.0}", s.secs)];
                row.extend(s.utilisation.iter().map(|u| format!("{u:.4}")));
                row.extend(s.zones.iter().map(|z| z.to_string()));
                row
            })
            .collect();
        let refs: Vec<&str> = series_header.iter().map(|s| s.as_str()).collect();
        write(&dir, &format!("timeseries_{slug}.csv"), &csv(&refs, &rows))?;
        let cpu = Chart {
            title: format!("CPU per node, {}", r.label),
            x_label: "seconds".into(),
            y_label: "CPU utilisation (%)".into(),
            y_range: Some((0.0, 100.0)),
            x_log2: false,
            series: (0..nodes)
                .map(|n| Series {
                    name: format!("node{}", n + 1),
                    points: r
                        .samples
                        .iter()
                        .map(|s| (s.secs, s.utilisation[n] * 100.0))
                        .collect(),
                })
                .collect(),
        };
        write(&dir, &format!("cpu_{slug}.svg"), &cpu.render())?;
        if r.balancing {
            let zones = Chart {
                title: format!("Zone servers per node, {}", r.label),
                x_label: "seconds".into(),
                y_label: "zone servers".into(),
                y_range: None,
                x_log2: false,
                series: (0..nodes)
                    .map(|n| Series {
                        name: format!("node{}", n + 1),
                        points: r
                            .samples
                            .iter()
                            .map(|s| (s.secs, s.zones[n] as f64))
                            .collect(),
                    })
                    .collect(),
            };
            write(&dir, &format!("zones_{slug}.svg"), &zones.render())?;
        }
    }
    let mut params_text = String::new();
    let _ = writeln!(params_text, "{params:#?}\n{mechanisms:#?}");
    write(&dir, "params.txt", &params_text)?;
    println!("\nreport: {}", dir.display());
    Ok(())
}
