//! A migration's cost as ferry measured it, for the simulator: the fixed
//! part of the freeze and what each connection and each MiB of memory add
//! to it, fitted (least squares) to the committed results of `cargo xtask
//! bench freeze` (`docs/freeze.csv`: the freeze against the number of TCP
//! connections, per socket mode) and `cargo xtask bench memory`
//! (`docs/memory.csv`: the freeze against the process's memory, per
//! strategy), release builds only. The simulator then charges what ferry
//! does on these machines, not figures chosen to match a paper's.

use std::time::Duration;

/// Why the figures could not be fitted.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CostError {
    #[error("{file}: no column {column:?}")]
    NoColumn {
        file: &'static str,
        column: &'static str,
    },
    #[error("{file}: {rows} usable rows for {what}; a fit needs two different x values at least")]
    TooFewRows {
        file: &'static str,
        what: String,
        rows: usize,
    },
}

/// The fitted cost, with how many measured migrations each part rests on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasuredCost {
    /// The freeze with no connection and (almost) no memory.
    pub fixed: Duration,
    pub per_connection: Duration,
    pub per_mib: Duration,
    pub connection_rows: usize,
    pub memory_rows: usize,
}

/// Fits the freeze of `socket_mode` ("incremental", "iterative", ...)
/// against its connections from `freeze_csv` (rows with the bench's 24
/// UDP sockets), and the freeze of `strategy` ("pre-copy") against memory
/// from `memory_csv` (rows writing 1,000 pages/s over the 1 Gb/s link).
/// `None` for `memory_csv`: no per-MiB part (a stop-and-copy sends the
/// memory in the freeze at the link's speed, which the model charges
/// apart).
pub fn fit(
    freeze_csv: &str,
    socket_mode: &str,
    memory_csv: Option<(&str, &str)>,
) -> Result<MeasuredCost, CostError> {
    const FREEZE: &str = "docs/freeze.csv";
    let connections = points(
        freeze_csv,
        FREEZE,
        &[("mode", socket_mode), ("udp", "24"), ("profile", "release")],
        "tcp",
    )?;
    let (fixed_ms, per_connection_ms) =
        least_squares(&connections).ok_or_else(|| CostError::TooFewRows {
            file: FREEZE,
            what: format!("{socket_mode} mode"),
            rows: connections.len(),
        })?;
    let (per_mib_ms, memory_rows) = match memory_csv {
        None => (0.0, 0),
        Some((csv, strategy)) => {
            const MEMORY: &str = "docs/memory.csv";
            let sizes = points(
                csv,
                MEMORY,
                &[
                    ("strategy", strategy),
                    ("write_rate", "1000"),
                    ("link", "1gbit"),
                    ("profile", "release"),
                ],
                "size_mib",
            )?;
            let (_, slope) = least_squares(&sizes).ok_or_else(|| CostError::TooFewRows {
                file: MEMORY,
                what: strategy.to_owned(),
                rows: sizes.len(),
            })?;
            (slope, sizes.len())
        }
    };
    let ms = |v: f64| Duration::from_secs_f64(v.max(0.0) / 1000.0);
    Ok(MeasuredCost {
        fixed: ms(fixed_ms),
        per_connection: ms(per_connection_ms),
        per_mib: ms(per_mib_ms),
        connection_rows: connections.len(),
        memory_rows,
    })
}

/// (x, freeze_ms) of the rows of `csv` whose columns match `filter`. The
/// columns read come before any quoted one, so a plain split on commas
/// reads them right.
fn points(
    csv: &str,
    file: &'static str,
    filter: &[(&'static str, &str)],
    x: &'static str,
) -> Result<Vec<(f64, f64)>, CostError> {
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split(',').collect();
    let index = |column: &'static str| {
        header
            .iter()
            .position(|h| *h == column)
            .ok_or(CostError::NoColumn { file, column })
    };
    let filters = filter
        .iter()
        .map(|(c, v)| index(c).map(|i| (i, *v)))
        .collect::<Result<Vec<_>, _>>()?;
    let (xi, yi) = (index(x)?, index("freeze_ms")?);
    Ok(lines
        .map(|l| l.split(',').collect::<Vec<_>>())
        .filter(|cells| filters.iter().all(|(i, v)| cells.get(*i) == Some(v)))
        .filter_map(|cells| Some((cells.get(xi)?.parse().ok()?, cells.get(yi)?.parse().ok()?)))
        .collect())
}

/// The line y = a + b·x closest to `points` (least squares): (a, b);
/// `None` without two different x values.
pub fn least_squares(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    if points.len() < 2 || sxx == 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    let b = sxy / sxx;
    Some((mean_y - b * mean_x, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_through_its_points() {
        let (a, b) = least_squares(&[(0.0, 10.0), (100.0, 20.0), (200.0, 30.0)]).unwrap();
        assert!((a - 10.0).abs() < 1e-9 && (b - 0.1).abs() < 1e-9, "{a} {b}");
        assert_eq!(least_squares(&[(1.0, 2.0)]), None);
        assert_eq!(least_squares(&[(1.0, 2.0), (1.0, 3.0)]), None);
    }

    const FREEZE: &str = "tcp,udp,mode,run,freeze_ms,profile\n\
        16,24,incremental,0,20,release\n\
        1024,24,incremental,0,40,release\n\
        1024,1024,incremental,0,90,release\n\
        1024,24,incremental,0,400,debug\n\
        1024,24,iterative,0,250,release\n";
    const MEMORY: &str = "size_mib,write_rate,link,strategy,run,profile,freeze_ms,x\n\
        64,1000,1gbit,pre-copy,0,release,12,\"a, b\"\n\
        4096,1000,1gbit,pre-copy,0,release,16,\"c\"\n\
        4096,1000,unshaped,pre-copy,0,release,99,\n";

    #[test]
    fn fits_only_the_rows_asked_for() {
        let c = fit(FREEZE, "incremental", Some((MEMORY, "pre-copy"))).unwrap();
        assert_eq!((c.connection_rows, c.memory_rows), (2, 2));
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        // 20 ms at 16, 40 at 1024: 1008 connections add 20 ms.
        assert!((ms(c.per_connection) - 20.0 / 1008.0).abs() < 1e-6, "{c:?}");
        assert!(
            (ms(c.fixed) - (20.0 - 16.0 * 20.0 / 1008.0)).abs() < 1e-6,
            "{c:?}"
        );
        assert!((ms(c.per_mib) - 4.0 / 4032.0).abs() < 1e-6, "{c:?}");
        let e = fit(FREEZE, "collective", None).unwrap_err();
        assert!(matches!(e, CostError::TooFewRows { rows: 0, .. }), "{e}");
        let e = fit("a,b\n", "incremental", None).unwrap_err();
        assert_eq!(
            e,
            CostError::NoColumn {
                file: "docs/freeze.csv",
                column: "mode"
            }
        );
    }

    /// The committed results fit: a freeze that grows with connections
    /// and hardly with memory, from every release row there is.
    #[test]
    fn fits_the_committed_results() {
        let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
        let freeze = std::fs::read_to_string(docs.join("freeze.csv")).unwrap();
        let memory = std::fs::read_to_string(docs.join("memory.csv")).unwrap();
        let c = fit(&freeze, "incremental", Some((&memory, "pre-copy"))).unwrap();
        assert!(c.connection_rows >= 12 && c.memory_rows >= 12, "{c:?}");
        assert!(c.fixed > Duration::from_millis(1), "{c:?}");
        assert!(c.per_connection > Duration::ZERO, "{c:?}");
        assert!(c.per_mib < Duration::from_millis(1), "{c:?}");
        let iterative = fit(&freeze, "iterative", None).unwrap();
        assert!(
            iterative.per_connection > c.per_connection,
            "{iterative:?} {c:?}"
        );
    }
}
