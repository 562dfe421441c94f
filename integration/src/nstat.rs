//! A network namespace's SNMP counters (what `nstat` shows): /proc/net/snmp
//! and /proc/net/netstat as seen from inside the namespace. Tests compare
//! them before and after a migration, e.g. the clients' `TcpExtTCPTimeouts`
//! (retransmission timeouts) and the nodes' `TcpOutRsts`.

use std::collections::BTreeMap;
use std::path::Path;

use crate::netns::{NetNsError, run_in};

#[derive(Debug, thiserror::Error)]
pub enum NstatError {
    #[error(transparent)]
    NetNs(#[from] NetNsError),
    #[error("reading {file}: {source}")]
    Read {
        file: &'static str,
        source: std::io::Error,
    },
    #[error("{file}: malformed: {line}")]
    Malformed { file: &'static str, line: String },
}

/// Counters by `nstat` name: the table prefix and the field (`TcpOutRsts`,
/// `TcpExtTCPTimeouts`, `UdpInDatagrams`, `IcmpOutDestUnreachs`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Nstat(pub BTreeMap<String, u64>);

impl Nstat {
    /// Reads the counters of the namespace at `netns`.
    pub fn read(netns: &Path) -> Result<Self, NstatError> {
        run_in(netns, || {
            let mut all = BTreeMap::new();
            // thread-self: /proc/self/net would follow the main thread's
            // namespace, not this thread's.
            for file in [
                "/proc/thread-self/net/snmp",
                "/proc/thread-self/net/netstat",
            ] {
                let text = std::fs::read_to_string(file)
                    .map_err(|source| NstatError::Read { file, source })?;
                parse(file, &text, &mut all)?;
            }
            Ok(Self(all))
        })?
    }

    /// A counter, 0 if this kernel lacks it.
    pub fn get(&self, name: &str) -> u64 {
        self.0.get(name).copied().unwrap_or(0)
    }

    /// `self - earlier` for every counter that grew.
    pub fn since(&self, earlier: &Nstat) -> Nstat {
        Nstat(
            self.0
                .iter()
                .filter_map(|(k, v)| {
                    let d = v.saturating_sub(earlier.get(k));
                    (d > 0).then(|| (k.clone(), d))
                })
                .collect(),
        )
    }
}

impl std::fmt::Display for Nstat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (k, v) in &self.0 {
            writeln!(f, "{k:<32} {v}")?;
        }
        Ok(())
    }
}

/// The files come in line pairs: `Tcp: Name1 Name2 ...` then
/// `Tcp: 1 2 ...`.
fn parse(
    file: &'static str,
    text: &str,
    out: &mut BTreeMap<String, u64>,
) -> Result<(), NstatError> {
    let mut lines = text.lines();
    while let Some(names) = lines.next() {
        let Some(values) = lines.next() else {
            return Err(NstatError::Malformed {
                file,
                line: names.to_owned(),
            });
        };
        let (Some((prefix, names)), Some((_, values))) =
            (names.split_once(':'), values.split_once(':'))
        else {
            return Err(NstatError::Malformed {
                file,
                line: names.to_owned(),
            });
        };
        for (n, v) in names.split_whitespace().zip(values.split_whitespace()) {
            // Some fields (Tcp MaxConn) are -1: not a counter.
            if let Ok(v) = v.parse::<u64>() {
                out.insert(format!("{prefix}{n}"), v);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_name_and_value_lines() {
        let text =
            "Tcp: RtoAlgorithm MaxConn OutRsts\nTcp: 1 -1 7\nTcpExt: TCPTimeouts\nTcpExt: 3\n";
        let mut m = BTreeMap::new();
        parse("snmp", text, &mut m).unwrap();
        let n = Nstat(m);
        assert_eq!(n.get("TcpOutRsts"), 7);
        assert_eq!(n.get("TcpExtTCPTimeouts"), 3);
        assert_eq!(n.get("TcpMaxConn"), 0);
        let later = Nstat(BTreeMap::from([
            ("TcpOutRsts".to_owned(), 9),
            ("TcpExtTCPTimeouts".to_owned(), 3),
        ]));
        assert_eq!(
            later.since(&n).0,
            BTreeMap::from([("TcpOutRsts".to_owned(), 2)])
        );
        assert!(parse("snmp", "Tcp: A\n", &mut BTreeMap::new()).is_err());
    }
}
