//! A network namespace's SNMP counters (what `nstat` shows): /proc/net/snmp,
//! /proc/net/netstat and /proc/net/snmp6 as seen from inside the namespace.
//! Tests compare
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
    /// A test or benchmark that reads a counter this kernel lacks cannot
    /// say what it claims: not a 0.
    #[error(
        "this kernel has no counter {name} (/proc/net/snmp, /proc/net/netstat, /proc/net/snmp6)"
    )]
    Missing { name: String },
}

/// Counters by `nstat` name: the table prefix and the field (`TcpOutRsts`,
/// `TcpExtTCPTimeouts`, `UdpInDatagrams`, `IcmpOutDestUnreachs`), and
/// IPv6's by their own (`Icmp6OutDestUnreachs`, `Udp6NoPorts`).
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
            // IPv6's: absent where the namespace or kernel has no IPv6.
            let file = "/proc/thread-self/net/snmp6";
            match std::fs::read_to_string(file) {
                Ok(text) => parse_snmp6(file, &text, &mut all)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(NstatError::Read { file, source }),
            }
            Ok(Self(all))
        })?
    }

    /// A counter; an error if this kernel lacks it.
    pub fn get(&self, name: &str) -> Result<u64, NstatError> {
        self.0
            .get(name)
            .copied()
            .ok_or_else(|| NstatError::Missing {
                name: name.to_owned(),
            })
    }

    /// `self - earlier` for every counter both have (0 for those that did
    /// not grow, so a counter read from the difference is still known).
    pub fn since(&self, earlier: &Nstat) -> Nstat {
        Nstat(
            self.0
                .iter()
                .filter_map(|(k, v)| {
                    let e = earlier.0.get(k)?;
                    Some((k.clone(), v.saturating_sub(*e)))
                })
                .collect(),
        )
    }
}

/// The counters that are not 0, one a line.
impl std::fmt::Display for Nstat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (k, v) in self.0.iter().filter(|(_, v)| **v > 0) {
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

/// /proc/net/snmp6: one `Name value` a line.
fn parse_snmp6(
    file: &'static str,
    text: &str,
    out: &mut BTreeMap<String, u64>,
) -> Result<(), NstatError> {
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split_whitespace();
        let (Some(name), Some(value), None) = (f.next(), f.next(), f.next()) else {
            return Err(NstatError::Malformed {
                file,
                line: line.to_owned(),
            });
        };
        if let Ok(v) = value.parse::<u64>() {
            out.insert(name.to_owned(), v);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_snmp6_name_value_lines() {
        let mut m = BTreeMap::new();
        parse_snmp6(
            "snmp6",
            "Ip6InReceives                   \t61\nIcmp6OutDestUnreachs            \t2\n",
            &mut m,
        )
        .unwrap();
        assert_eq!(m["Ip6InReceives"], 61);
        assert_eq!(m["Icmp6OutDestUnreachs"], 2);
        assert!(parse_snmp6("snmp6", "Udp6NoPorts\n", &mut m).is_err());
    }

    #[test]
    fn parses_name_and_value_lines() {
        let text =
            "Tcp: RtoAlgorithm MaxConn OutRsts\nTcp: 1 -1 7\nTcpExt: TCPTimeouts\nTcpExt: 3\n";
        let mut m = BTreeMap::new();
        parse("snmp", text, &mut m).unwrap();
        let n = Nstat(m);
        assert_eq!(n.get("TcpOutRsts").unwrap(), 7);
        assert_eq!(n.get("TcpExtTCPTimeouts").unwrap(), 3);
        // -1 is no counter; an absent counter is an error, not a 0.
        for absent in ["TcpMaxConn", "TcpExtTCPNoSuchCounter"] {
            assert!(
                matches!(n.get(absent), Err(NstatError::Missing { ref name }) if name == absent),
                "{absent}"
            );
        }
        let later = Nstat(BTreeMap::from([
            ("TcpOutRsts".to_owned(), 9),
            ("TcpExtTCPTimeouts".to_owned(), 3),
            ("TcpExtNew".to_owned(), 1),
        ]));
        // Both counters they share, grown or not; not one only the later has.
        let d = later.since(&n);
        assert_eq!(
            d.0,
            BTreeMap::from([
                ("TcpOutRsts".to_owned(), 2),
                ("TcpExtTCPTimeouts".to_owned(), 0),
            ])
        );
        assert_eq!(d.get("TcpExtTCPTimeouts").unwrap(), 0);
        assert!(d.get("TcpExtNew").is_err());
        // Shown: what grew.
        assert_eq!(d.to_string().lines().count(), 1);
        assert!(parse("snmp", "Tcp: A\n", &mut BTreeMap::new()).is_err());
    }
}
