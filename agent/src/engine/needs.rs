//! What a migration needs of each node's kernel and privileges
//! (`crate::host_features`), and the refusal when one lacks it: checked
//! before anything stops, by the source for itself and for the destination
//! (from its Hello), and by the destination for itself at Prepare (a source
//! of another version may not know).
//!
//! A strategy the request did not name (the node's configured one) gives
//! way to total copy where a node lacks what it needs ([`settle`]). Other
//! fallbacks are taken where their work is done; all are said in the
//! report (`MigrationReport.fallbacks`).

use ferry_proto::v1::{Fallback, HostFeature};

use super::EngineError;
use crate::config::MemoryStrategy;
use crate::host_features::HostFeatures;

/// A feature a migration cannot do without, and what needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    pub key: &'static str,
    pub what: &'static str,
}

/// Which end of the migration a node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Source,
    Destination,
}

/// What `role` needs for a migration with `strategy`.
pub fn of(role: Role, strategy: MemoryStrategy) -> Vec<Need> {
    let mut needs = Vec::new();
    match role {
        Role::Source => {
            needs.push(Need {
                key: "cap_checkpoint_restore",
                what: "CRIU's dump",
            });
            needs.push(Need {
                key: "cap_sys_ptrace",
                what: "taking the process's connections",
            });
            if strategy.is_precopy() {
                for key in ["uffd_wp_async", "pagemap_scan"] {
                    needs.push(Need {
                        key,
                        what: "pre-copy's tracking of written pages",
                    });
                }
            }
        }
        Role::Destination => {
            needs.push(Need {
                key: "cap_checkpoint_restore",
                what: "CRIU's restore",
            });
            // The pages that follow the process arrive on a userfaultfd
            // that must see the process fork, remap and unmap (CRIU's
            // lazy pages asks the same of the kernel as ferryd's filler).
            if strategy.is_postcopy() {
                needs.push(Need {
                    key: "uffd_events",
                    what: "post-copy's page faults after the resume",
                });
            }
        }
    }
    needs
}

/// The first of `needs` that `features` (a node's, as the peer API carries
/// them) says is missing. A feature `features` does not list (a node of an
/// older version) is unknown, not missing.
pub fn first_missing<'f>(
    needs: &[Need],
    features: &'f [HostFeature],
) -> Option<(Need, &'f HostFeature)> {
    needs.iter().find_map(|need| {
        features
            .iter()
            .find(|f| f.key == need.key && !f.present)
            .map(|f| (*need, f))
    })
}

/// Refuses, naming the feature, `node` and its kernel, the first of
/// `needs` that `features` says is missing ([`first_missing`]).
pub fn check(
    needs: &[Need],
    features: &[HostFeature],
    node: &str,
    kernel: &str,
    strategy: MemoryStrategy,
) -> Result<(), EngineError> {
    match first_missing(needs, features) {
        None => Ok(()),
        Some((need, f)) => Err(missing(need, f, node, kernel, strategy)),
    }
}

fn missing(
    need: Need,
    f: &HostFeature,
    node: &str,
    kernel: &str,
    strategy: MemoryStrategy,
) -> EngineError {
    EngineError::FeatureMissing {
        what: format!("{} ({})", need.what, strategy.name()),
        feature: format!("{} [{}]", f.name, f.key),
        node: node.to_owned(),
        kernel: kernel.to_owned(),
    }
}

/// The strategy a migration takes given what `node` (as `role`) has: the
/// one asked for, refused ([`check`]) if the node lacks what it needs; or,
/// when the request named none (`defaulted`: the node's configured
/// strategy, the balancer's migrations), total copy instead, which needs
/// nothing more than any migration, with the fallback noted. A need of
/// every migration (CRIU's privileges) is refused either way.
pub fn settle(
    role: Role,
    strategy: MemoryStrategy,
    defaulted: bool,
    features: &[HostFeature],
    node: &str,
    kernel: &str,
    fallbacks: &mut Vec<Fallback>,
) -> Result<MemoryStrategy, EngineError> {
    let Some((need, f)) = first_missing(&of(role, strategy), features) else {
        return Ok(strategy);
    };
    let total = MemoryStrategy::TotalCopy;
    if !defaulted || first_missing(&of(role, total), features).is_some() {
        return Err(missing(need, f, node, kernel, strategy));
    }
    fallbacks.push(Fallback {
        feature: f.key.clone(),
        node: node.to_owned(),
        instead: format!(
            "total copy, not the configured {} ({} needs {})",
            strategy.name(),
            need.what,
            f.name
        ),
    });
    Ok(total)
}

/// This node's kernel features and privileges, `features_off` applied
/// (probed once per ferryd, off the runtime the first time).
pub async fn this_host(engine: &super::Engine) -> Result<HostFeatures, EngineError> {
    crate::host_features::host_off_runtime(&engine.config.features_off)
        .await
        .map_err(|source| EngineError::Task {
            what: "probing this host's features",
            source,
        })
}

/// [`check`] against this node's own features.
pub fn check_here(
    role: Role,
    strategy: MemoryStrategy,
    host: &HostFeatures,
    node: &str,
) -> Result<(), EngineError> {
    check(
        &of(role, strategy),
        &host.to_pb(),
        node,
        &host.kernel,
        strategy,
    )
}

/// Whether the node whose `features` these are lacks `key` (false when it
/// does not say: a node of an older version).
pub fn lacks(features: &[HostFeature], key: &str) -> bool {
    features.iter().any(|f| f.key == key && !f.present)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn features(missing: &[&str]) -> Vec<HostFeature> {
        crate::host_features::KEYS
            .iter()
            .map(|k| HostFeature {
                key: (*k).to_owned(),
                name: format!("the {k} feature"),
                present: !missing.contains(k),
            })
            .collect()
    }

    #[test]
    fn pre_copy_needs_write_tracking_on_the_source_only() {
        let lacking = features(&["pagemap_scan"]);
        let err = check(
            &of(Role::Source, MemoryStrategy::PreCopy),
            &lacking,
            "node1",
            "5.15.0",
            MemoryStrategy::PreCopy,
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("pagemap_scan") && text.contains("node1") && text.contains("5.15.0"),
            "{text}"
        );
        assert!(matches!(err, EngineError::FeatureMissing { .. }));
        for strategy in [MemoryStrategy::PreCopy, MemoryStrategy::QueuedPreCopy] {
            check(
                &of(Role::Destination, strategy),
                &lacking,
                "node2",
                "5.15.0",
                strategy,
            )
            .unwrap();
        }
        check(
            &of(Role::Source, MemoryStrategy::TotalCopy),
            &lacking,
            "node1",
            "5.15.0",
            MemoryStrategy::TotalCopy,
        )
        .unwrap();
    }

    #[test]
    fn post_copy_needs_userfaultfd_events_on_the_destination() {
        let lacking = features(&["uffd_events"]);
        for strategy in [MemoryStrategy::PostCopy, MemoryStrategy::AssistedPostCopy] {
            let err = check(
                &of(Role::Destination, strategy),
                &lacking,
                "node2",
                "6.1",
                strategy,
            )
            .unwrap_err();
            assert!(err.to_string().contains("uffd_events"), "{err}");
            check(
                &of(Role::Source, strategy),
                &lacking,
                "node1",
                "6.1",
                strategy,
            )
            .unwrap();
        }
        check(
            &of(Role::Destination, MemoryStrategy::PreCopy),
            &lacking,
            "node2",
            "6.1",
            MemoryStrategy::PreCopy,
        )
        .unwrap();
    }

    #[test]
    fn a_node_that_does_not_say_is_not_refused() {
        for role in [Role::Source, Role::Destination] {
            check(
                &of(role, MemoryStrategy::AssistedPostCopy),
                &[],
                "old",
                "",
                MemoryStrategy::AssistedPostCopy,
            )
            .unwrap();
        }
        assert!(!lacks(&[], "uffd_events"));
        assert!(lacks(&features(&["uffd_events"]), "uffd_events"));
    }

    #[test]
    fn a_configured_strategy_gives_way_to_total_copy_an_asked_one_is_refused() {
        let lacking = features(&["uffd_wp_async"]);
        let mut fallbacks = Vec::new();
        let asked = settle(
            Role::Source,
            MemoryStrategy::PreCopy,
            false,
            &lacking,
            "node1",
            "5.15.0",
            &mut fallbacks,
        );
        assert!(
            matches!(asked, Err(EngineError::FeatureMissing { .. })),
            "{asked:?}"
        );
        assert!(fallbacks.is_empty());
        let configured = settle(
            Role::Source,
            MemoryStrategy::PreCopy,
            true,
            &lacking,
            "node1",
            "5.15.0",
            &mut fallbacks,
        )
        .unwrap();
        assert_eq!(configured, MemoryStrategy::TotalCopy);
        assert_eq!(fallbacks.len(), 1);
        assert_eq!(fallbacks[0].feature, "uffd_wp_async");
        assert_eq!(fallbacks[0].node, "node1");
        assert!(fallbacks[0].instead.contains("total copy"), "{fallbacks:?}");
        // What every migration needs has no fallback.
        let no_criu = features(&["cap_checkpoint_restore"]);
        let err = settle(
            Role::Destination,
            MemoryStrategy::PostCopy,
            true,
            &no_criu,
            "node2",
            "5.15.0",
            &mut fallbacks,
        );
        assert!(err.is_err(), "{err:?}");
        // Nothing missing: the strategy as it was, no fallback.
        let all = features(&[]);
        let kept = settle(
            Role::Source,
            MemoryStrategy::QueuedPreCopy,
            true,
            &all,
            "node1",
            "6.18",
            &mut fallbacks,
        )
        .unwrap();
        assert_eq!(kept, MemoryStrategy::QueuedPreCopy);
        assert_eq!(fallbacks.len(), 1);
    }

    #[test]
    fn every_need_is_a_probed_feature() {
        for role in [Role::Source, Role::Destination] {
            for strategy in [
                MemoryStrategy::TotalCopy,
                MemoryStrategy::PreCopy,
                MemoryStrategy::QueuedPreCopy,
                MemoryStrategy::PostCopy,
                MemoryStrategy::AssistedPostCopy,
            ] {
                for need in of(role, strategy) {
                    assert!(crate::host_features::KEYS.contains(&need.key), "{need:?}");
                }
            }
        }
    }
}
