//! One family's pair of translation maps (`FERRY_XL_RULES` and
//! `FERRY_XL_REV`, or their IPv6 twins): the rules, kept as the programs
//! read them. The [`Translator`](crate::translate::Translator) holds one
//! table per family and hands each rule to the table of its addresses.

use std::net::{IpAddr, SocketAddr};

use aya::maps::{HashMap, MapData, MapError};

use crate::DataPlaneError;
use crate::error::map_err;
use crate::translate::{RuleAction, RuleState, TranslationRule, from_ip_proto, ip_proto};
use crate::translate_maps::{self as maps, Xlate6Key, Xlate6Rule, XlateKey, XlateRule};

/// What differs between the IPv4 and the IPv6 maps: their names, layouts
/// and how a rule's addresses go into them.
pub(crate) trait Family {
    type Key: aya::Pod + Copy;
    type Value: aya::Pod + Copy + Default + PartialEq;
    type Addr: aya::Pod + Copy + PartialEq;
    const RULES: &'static str;
    const REV: &'static str;
    /// `ip` in this family's bytes; None if it is of the other.
    fn addr(ip: IpAddr) -> Option<Self::Addr>;
    fn ip(a: Self::Addr) -> IpAddr;
    fn key(local: Self::Addr, remote: Self::Addr, rule: &TranslationRule) -> Self::Key;
    fn with_remote(k: Self::Key, remote: Self::Addr) -> Self::Key;
    /// Local and remote end, protocol number of a key.
    fn ends(k: &Self::Key) -> (SocketAddr, SocketAddr, u8);
    fn new_addr(v: &Self::Value) -> Self::Addr;
    fn action(v: &Self::Value) -> u32;
    /// `existing` (its counts) with `new_addr` and `action`.
    fn value(new_addr: Self::Addr, action: u32, existing: Option<Self::Value>) -> Self::Value;
    fn state(v: &Self::Value) -> RuleState;
}

pub(crate) struct V4;
pub(crate) struct V6;

/// `Family` for a marker type: its maps' names, its key and value types
/// (`translate_maps`, alike but for the address width) and the address's
/// `IpAddr` variant.
macro_rules! family {
    ($family:ident, $key:ty, $value:ty, $width:literal, $variant:ident, $rules:literal, $rev:literal) => {
        impl Family for $family {
            type Key = $key;
            type Value = $value;
            type Addr = [u8; $width];
            const RULES: &'static str = $rules;
            const REV: &'static str = $rev;

            fn addr(ip: IpAddr) -> Option<Self::Addr> {
                match ip {
                    IpAddr::$variant(a) => Some(a.octets()),
                    _ => None,
                }
            }
            fn ip(a: Self::Addr) -> IpAddr {
                a.into()
            }
            fn key(local: Self::Addr, remote: Self::Addr, rule: &TranslationRule) -> $key {
                <$key>::from_parts(local, remote, rule)
            }
            fn with_remote(k: $key, remote: Self::Addr) -> $key {
                <$key>::with_remote(k, remote)
            }
            fn ends(k: &$key) -> (SocketAddr, SocketAddr, u8) {
                (
                    (Self::ip(k.local_addr), u16::from_be_bytes(k.local_port)).into(),
                    (Self::ip(k.remote_addr), u16::from_be_bytes(k.remote_port)).into(),
                    k.proto,
                )
            }
            fn new_addr(v: &$value) -> Self::Addr {
                v.new_addr
            }
            fn action(v: &$value) -> u32 {
                v.action
            }
            fn value(new_addr: Self::Addr, action: u32, existing: Option<$value>) -> $value {
                <$value>::with(new_addr, action, existing)
            }
            fn state(v: &$value) -> RuleState {
                RuleState {
                    packets_egress: v.packets_egress,
                    packets_ingress: v.packets_ingress,
                    last_seen_ns: v.last_seen_ns,
                    fin_egress: v.fin_egress,
                    fin_ingress: v.fin_ingress,
                    rst_egress: v.rst_egress,
                    rst_ingress: v.rst_ingress,
                }
            }
        }

        impl $key {
            fn from_parts(
                local: [u8; $width],
                remote: [u8; $width],
                rule: &TranslationRule,
            ) -> Self {
                Self {
                    local_addr: local,
                    remote_addr: remote,
                    local_port: rule.local.port().to_be_bytes(),
                    remote_port: rule.remote.port().to_be_bytes(),
                    proto: ip_proto(rule.protocol),
                    pad: [0; 3],
                }
            }
            fn with_remote(self, remote: [u8; $width]) -> Self {
                Self {
                    remote_addr: remote,
                    ..self
                }
            }
        }

        impl $value {
            /// `existing` (its counts) with `new_addr` and `action`.
            fn with(new_addr: [u8; $width], action: u32, existing: Option<Self>) -> Self {
                Self {
                    new_addr,
                    action,
                    ..existing.unwrap_or_default()
                }
            }
        }
    };
}

family!(
    V4,
    XlateKey,
    XlateRule,
    4,
    V4,
    "FERRY_XL_RULES",
    "FERRY_XL_REV"
);
family!(
    V6,
    Xlate6Key,
    Xlate6Rule,
    16,
    V6,
    "FERRY_XL_RULES6",
    "FERRY_XL_REV6"
);

/// A rule's action code (`enum ferry_xlate_action`).
fn action_code(rule: &TranslationRule) -> u32 {
    match rule.action {
        RuleAction::Translate { .. } => maps::ACTION_TRANSLATE,
        RuleAction::Hold => maps::ACTION_HOLD,
    }
}

/// The rule a map entry holds; None for one this crate cannot have written.
fn rule_of<F: Family>(k: &F::Key, v: &F::Value) -> Option<TranslationRule> {
    let action = match F::action(v) {
        maps::ACTION_TRANSLATE => RuleAction::Translate {
            remote_new: F::ip(F::new_addr(v)),
        },
        maps::ACTION_HOLD => RuleAction::Hold,
        _ => return None,
    };
    let (local, remote, proto) = F::ends(k);
    Some(TranslationRule {
        protocol: from_ip_proto(proto)?,
        local,
        remote,
        action,
    })
}

/// One family's rule maps.
pub(crate) struct Table<F: Family> {
    rules: HashMap<MapData, F::Key, F::Value>,
    reverse: HashMap<MapData, F::Key, F::Addr>,
}

/// A rule's key and addresses in one family's bytes.
struct Placed<F: Family> {
    key: F::Key,
    remote: F::Addr,
    incoming: F::Addr,
}

impl<F: Family> Table<F> {
    pub(crate) fn new(
        rules: HashMap<MapData, F::Key, F::Value>,
        reverse: HashMap<MapData, F::Key, F::Addr>,
    ) -> Self {
        Self { rules, reverse }
    }

    /// `rule`'s key and addresses here; None if its addresses are not all
    /// of this family (its table is the other).
    fn place(rule: &TranslationRule) -> Option<Placed<F>> {
        let local = F::addr(rule.local.ip())?;
        let remote = F::addr(rule.remote.ip())?;
        let incoming = F::addr(match rule.action {
            RuleAction::Translate { remote_new } => remote_new,
            RuleAction::Hold => rule.remote.ip(),
        })?;
        Some(Placed {
            key: F::key(local, remote, rule),
            remote,
            incoming,
        })
    }

    /// Whether `rule` belongs here.
    pub(crate) fn holds(rule: &TranslationRule) -> bool {
        Self::place(rule).is_some()
    }

    fn get_rule(&self, k: &F::Key) -> Result<Option<F::Value>, DataPlaneError> {
        match self.rules.get(k, 0) {
            Ok(v) => Ok(Some(v)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err(F::RULES)(e)),
        }
    }

    fn remove_rev(&mut self, k: &F::Key) -> Result<(), DataPlaneError> {
        match self.reverse.remove(k) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(map_err(F::REV)(e)),
        }
    }

    /// The rule stored under `key`, for messages.
    fn describe(&self, key: &F::Key) -> Result<String, DataPlaneError> {
        Ok(self
            .get_rule(key)?
            .and_then(|v| rule_of::<F>(key, &v))
            .map_or_else(|| "a rule being changed".to_owned(), |r| r.to_string()))
    }

    /// [`Translator::add`](crate::translate::Translator::add) of a rule of
    /// this family (`rule.check()` passed).
    pub(crate) fn add(&mut self, rule: &TranslationRule) -> Result<(), DataPlaneError> {
        let Some(Placed {
            key,
            remote,
            incoming,
        }) = Self::place(rule)
        else {
            return Err(DataPlaneError::InvalidRule {
                rule: rule.to_string(),
                reason: "addresses must be of one family",
            });
        };
        let rev = F::with_remote(key, incoming);
        let conflict = |existing: String| DataPlaneError::RuleConflict {
            rule: rule.to_string(),
            existing,
        };
        match self.reverse.get(&rev, 0) {
            Ok(a) if a != remote => {
                let existing = self.describe(&F::with_remote(key, a))?;
                return Err(conflict(existing));
            }
            Ok(_) | Err(MapError::KeyNotFound) => {}
            Err(e) => return Err(map_err(F::REV)(e)),
        }
        let action = action_code(rule);
        let existing = self.get_rule(&key)?;
        if let Some(e) = existing.filter(|e| F::action(e) != action) {
            let existing = rule_of::<F>(&key, &e).map_or_else(
                || format!("a rule with action {}", F::action(&e)),
                |r| r.to_string(),
            );
            return Err(conflict(existing));
        }
        let value = F::value(incoming, action, existing);
        if existing != Some(value) {
            // A re-target rewrites the whole value: increments the
            // programs make during the update may be lost; the counts are
            // for the agent's bookkeeping, not exact accounting.
            self.rules
                .insert(key, value, 0)
                .map_err(map_err(F::RULES))?;
        }
        // Egress translates (holds) from the rule on; ingress from here on.
        self.reverse
            .insert(rev, remote, 0)
            .map_err(map_err(F::REV))?;
        if let Some(prev) = existing.filter(|e| F::new_addr(e) != F::new_addr(&value)) {
            self.remove_rev(&F::with_remote(key, F::new_addr(&prev)))?;
        }
        Ok(())
    }

    /// [`Translator::remove`](crate::translate::Translator::remove).
    pub(crate) fn remove(&mut self, rule: &TranslationRule) -> Result<bool, DataPlaneError> {
        let Some(Placed { key, .. }) = Self::place(rule) else {
            return Ok(false);
        };
        let Some(value) = self
            .get_rule(&key)?
            .filter(|v| F::action(v) == action_code(rule))
        else {
            return Ok(false);
        };
        // Ingress first, so that no answer is translated for a flow whose
        // requests no longer are.
        self.remove_rev(&F::with_remote(key, F::new_addr(&value)))?;
        match self.rules.remove(&key) {
            Ok(()) => Ok(true),
            Err(MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(map_err(F::RULES)(e)),
        }
    }

    /// [`Translator::state`](crate::translate::Translator::state).
    pub(crate) fn state(
        &self,
        rule: &TranslationRule,
    ) -> Result<Option<RuleState>, DataPlaneError> {
        let Some(Placed { key, .. }) = Self::place(rule) else {
            return Ok(None);
        };
        Ok(self
            .get_rule(&key)?
            .filter(|v| F::action(v) == action_code(rule))
            .map(|v| F::state(&v)))
    }

    /// Every rule of this family with its state.
    pub(crate) fn rules(
        &self,
        out: &mut Vec<(TranslationRule, RuleState)>,
    ) -> Result<(), DataPlaneError> {
        for item in self.rules.iter() {
            let (k, v) = item.map_err(map_err(F::RULES))?;
            // Only this crate writes the map, always with TCP or UDP.
            if let Some(rule) = rule_of::<F>(&k, &v) {
                out.push((rule, F::state(&v)));
            }
        }
        Ok(())
    }
}
