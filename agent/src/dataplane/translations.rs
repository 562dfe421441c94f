//! The peer node's side of a migration's in-cluster connections
//! (`Peer.AddTranslations` / `RemoveTranslations`): see [`super::translation`]
//! for the whole picture. Blocking (BPF maps).
//!
//! A process may move again: its peer's socket still talks to the address
//! of the node the connection was opened from, and a rule already sends
//! that flow to the node the process is leaving. The new rule then replaces
//! that one (same original address, new node), or, when the process comes
//! back to the original node, the rule simply goes. What each call changed
//! is logged by migration so that `RemoveTranslations` (an abort) restores
//! exactly what was there.

use std::collections::VecDeque;
use std::sync::Mutex;

use ferry_ebpf::{RuleAction, TranslationRule};
use ferry_proto::v1::TranslationsRequest;

use super::DataPlane;
use super::translation::{FlowError, FlowRules, InClusterFlow};

/// One change to the rules: `removed` was there before, `added` after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Change {
    removed: Option<TranslationRule>,
    added: Option<TranslationRule>,
}

/// What the last migrations changed here, for their aborts. Bounded: an
/// abort follows its add within a peer timeout.
#[derive(Debug, Default)]
pub struct TranslationLog(Mutex<VecDeque<(String, Vec<Change>)>>);

const LOG_MIGRATIONS: usize = 64;

impl TranslationLog {
    fn push(&self, id: &str, changes: Vec<Change>) {
        let mut log = crate::sync::lock(&self.0);
        log.retain(|(m, _)| m != id);
        if log.len() == LOG_MIGRATIONS {
            log.pop_front();
        }
        log.push_back((id.to_owned(), changes));
    }

    fn take(&self, id: &str) -> Option<Vec<Change>> {
        let mut log = crate::sync::lock(&self.0);
        let i = log.iter().position(|(m, _)| m == id)?;
        log.remove(i).map(|(_, c)| c)
    }
}

/// This node, as the requests' flows must name it.
#[derive(Debug, Clone, Copy)]
pub struct Here<'a> {
    pub node: &'a str,
    pub cluster_address: std::net::IpAddr,
}

/// Parses and checks the request's flows: each must be to a socket of this
/// node (`remote` on this node's cluster address).
fn flows(here: Here<'_>, req: &TranslationsRequest) -> Result<Vec<InClusterFlow>, FlowError> {
    if req.migration_id.is_empty() {
        return Err(FlowError::InvalidField {
            field: "migration_id",
            reason: "empty".into(),
        });
    }
    req.flows
        .iter()
        .map(|pb| {
            let f = InClusterFlow::from_pb(pb)?;
            if f.remote.ip() != here.cluster_address {
                return Err(FlowError::InvalidField {
                    field: "flows.remote",
                    reason: format!(
                        "{} is not on {} ({})",
                        f.remote, here.node, here.cluster_address
                    ),
                });
            }
            Ok(f)
        })
        .collect()
}

/// The change that moves `flow`: a new rule, or a rule of an earlier
/// migration of the same process replaced or removed.
fn change_for(rules: &dyn FlowRules, flow: &InClusterFlow) -> Result<Change, FlowError> {
    let earlier = rules.rules()?.into_iter().find(|r| {
        r.protocol == flow.protocol
            && r.local == flow.remote
            && r.remote.port() == flow.old_local.port()
            && r.action
                == RuleAction::Translate {
                    remote_new: flow.old_local.ip(),
                }
    });
    Ok(match earlier {
        None => Change {
            removed: None,
            added: Some(flow.translation()),
        },
        // Back where the connection was opened: nothing to rewrite.
        Some(r) if r.remote.ip() == flow.new_local.ip() => Change {
            removed: Some(r),
            added: None,
        },
        Some(r) => Change {
            removed: Some(r),
            added: Some(TranslationRule::translate(
                flow.protocol,
                flow.remote,
                r.remote,
                flow.new_local.ip(),
            )),
        },
    })
}

fn apply(rules: &mut dyn FlowRules, c: &Change) -> Result<(), FlowError> {
    if let Some(r) = &c.removed {
        rules.remove(r)?;
    }
    if let Some(a) = c.added
        && let Err(e) = rules.add(a)
    {
        if let Some(r) = c.removed {
            let _ = rules.add(r);
        }
        return Err(e.into());
    }
    Ok(())
}

fn undo(rules: &mut dyn FlowRules, c: &Change) {
    let inverse = Change {
        removed: c.added,
        added: c.removed,
    };
    if let Err(e) = apply(rules, &inverse) {
        tracing::error!(?c, error = %e, "undoing a translation change");
    }
}

impl DataPlane {
    /// Installs the translations; all or none. Returns how many flows.
    pub fn add_translations(
        &self,
        here: Here<'_>,
        req: &TranslationsRequest,
    ) -> Result<u32, FlowError> {
        let flows = flows(here, req)?;
        let mut rules = self.flows();
        let mut done: Vec<Change> = Vec::new();
        for f in &flows {
            let result = change_for(rules.as_ref(), f).and_then(|c| {
                apply(rules.as_mut(), &c)?;
                Ok(c)
            });
            match result {
                Ok(c) => {
                    tracing::info!(migration = %req.migration_id, removed = ?c.removed, added = ?c.added, "in-cluster connection translated");
                    done.push(c);
                }
                Err(e) => {
                    for c in done.iter().rev() {
                        undo(rules.as_mut(), c);
                    }
                    return Err(e);
                }
            }
        }
        self.translation_log.push(&req.migration_id, done);
        Ok(flows.len() as u32)
    }

    /// Undoes what `add` did for the migration (an abort); an unknown
    /// migration has nothing to undo. Returns how many changes were undone.
    pub fn remove_translations(
        &self,
        here: Here<'_>,
        req: &TranslationsRequest,
    ) -> Result<u32, FlowError> {
        flows(here, req)?;
        let Some(changes) = self.translation_log.take(&req.migration_id) else {
            return Ok(0);
        };
        let mut rules = self.flows();
        for c in changes.iter().rev() {
            undo(rules.as_mut(), c);
            tracing::info!(migration = %req.migration_id, ?c, "translation change undone");
        }
        Ok(changes.len() as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::translation::fake::FakeFlowRules;
    use ferry_ebpf::Protocol;

    fn flow(old: &str, new: &str) -> InClusterFlow {
        InClusterFlow {
            protocol: Protocol::Tcp,
            old_local: old.parse().unwrap(),
            new_local: new.parse().unwrap(),
            remote: "198.19.0.3:5432".parse().unwrap(),
        }
    }

    #[test]
    fn a_second_move_replaces_the_rule_and_coming_home_removes_it() {
        let mut rules = FakeFlowRules::default();
        // node1 -> node2: the peer's socket talks to node1.
        let c1 = change_for(&rules, &flow("198.19.0.1:40000", "198.19.0.2:40000")).unwrap();
        apply(&mut rules, &c1).unwrap();
        assert_eq!(rules.rules().unwrap(), vec![c1.added.unwrap()]);
        // node2 -> node4: still node1's address, now at node4.
        let c2 = change_for(&rules, &flow("198.19.0.2:40000", "198.19.0.4:40000")).unwrap();
        apply(&mut rules, &c2).unwrap();
        let r = rules.rules().unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].remote, "198.19.0.1:40000".parse().unwrap());
        assert_eq!(
            r[0].action,
            RuleAction::Translate {
                remote_new: "198.19.0.4".parse().unwrap()
            }
        );
        // An abort of that move puts the first rule back.
        undo(&mut rules, &c2);
        assert_eq!(rules.rules().unwrap(), vec![c1.added.unwrap()]);
        // node2 -> node1: home, no rule.
        let c3 = change_for(&rules, &flow("198.19.0.2:40000", "198.19.0.1:40000")).unwrap();
        assert_eq!(c3.added, None);
        apply(&mut rules, &c3).unwrap();
        assert!(rules.rules().unwrap().is_empty());
        undo(&mut rules, &c3);
        assert_eq!(rules.rules().unwrap(), vec![c1.added.unwrap()]);
    }
}
