//! Placement of a distributed server's new connections (the XtreemOS
//! distributed servers: the contact node takes each new connection and
//! chooses the member that serves it). Pure: the caller gives the members
//! and what each serves.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How the contact node chooses a member for a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Each member in turn, the contact node included.
    #[default]
    RoundRobin,
    /// The member serving the fewest connections now (a distributed
    /// server's load is its connections); ties go to the earlier member.
    LeastConnections,
}

impl Placement {
    /// The name the API and the config use.
    pub fn name(self) -> &'static str {
        match self {
            Placement::RoundRobin => "round-robin",
            Placement::LeastConnections => "least-connections",
        }
    }

    /// Parses [`Self::name`]; the empty string is the default.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "" | "round-robin" => Some(Placement::RoundRobin),
            "least-connections" => Some(Placement::LeastConnections),
            _ => None,
        }
    }
}

/// A contact node's placement state for one group.
#[derive(Debug, Clone, Default)]
pub struct Placer {
    policy: Placement,
    /// Round robin: how many placements were made.
    turns: usize,
}

impl Placer {
    pub fn new(policy: Placement) -> Self {
        Self { policy, turns: 0 }
    }

    pub fn policy(&self) -> Placement {
        self.policy
    }

    /// The member for the next new connection, given the connections each
    /// serves (a member missing from `serving` serves none). None without
    /// members.
    pub fn place(&mut self, members: &[String], serving: &BTreeMap<String, u64>) -> Option<String> {
        if members.is_empty() {
            return None;
        }
        let chosen = match self.policy {
            Placement::RoundRobin => members[self.turns % members.len()].clone(),
            Placement::LeastConnections => members
                .iter()
                .enumerate()
                .min_by_key(|(i, m)| (serving.get(*m).copied().unwrap_or(0), *i))
                .map(|(_, m)| m.clone())?,
        };
        self.turns = self.turns.wrapping_add(1);
        Some(chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members() -> Vec<String> {
        ["n1", "n2", "n3"].map(String::from).to_vec()
    }

    #[test]
    fn round_robin_takes_each_member_in_turn() {
        let mut p = Placer::new(Placement::RoundRobin);
        let got: Vec<String> = (0..5)
            .map(|_| p.place(&members(), &BTreeMap::new()).unwrap())
            .collect();
        assert_eq!(got, ["n1", "n2", "n3", "n1", "n2"]);
        assert_eq!(p.place(&[], &BTreeMap::new()), None);
    }

    #[test]
    fn least_connections_fills_the_emptiest_member_first() {
        let mut p = Placer::new(Placement::LeastConnections);
        let mut serving = BTreeMap::from([("n1".to_owned(), 3), ("n2".to_owned(), 1)]);
        assert_eq!(p.place(&members(), &serving).unwrap(), "n3");
        serving.insert("n3".into(), 1);
        assert_eq!(
            p.place(&members(), &serving).unwrap(),
            "n2",
            "ties: the earlier"
        );
    }

    #[test]
    fn names_round_trip_and_unknown_ones_are_refused() {
        for p in [Placement::RoundRobin, Placement::LeastConnections] {
            assert_eq!(Placement::parse(p.name()), Some(p));
        }
        assert_eq!(Placement::parse(""), Some(Placement::RoundRobin));
        assert_eq!(Placement::parse("random"), None);
    }
}
