//! Receiver-initiated transfer: a node below the average asks a loaded node
//! for work (`transfer.mode = "receiver_initiated"` or `"symmetric"`).
//!
//! The asking node sends `Pull` to its candidates in order (the location
//! policy ranks the most loaded first) until one will give. The giving node
//! answers at once: `Balancer::give` picks the process closest to half the
//! gap between the two loads (the move that evens the pair) if moving it
//! lowers the larger one; then the giver marks its outgoing slot and pushes
//! the process to the asker through the ordinary two-phase commit (`Offer`,
//! the migration, `Finish`). The asker's gate decides as for any offer, so
//! a pull never lets in more than a push would.

use std::sync::Arc;

use ferry_policy::NodeId;
use ferry_policy::transfer::MigrationId;
use ferry_proto::v1 as pb;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

use super::{Conductor, node_id, process_loads};

impl Conductor {
    /// Asks the candidates, in order, for work; stops at the first that
    /// will give.
    pub(super) async fn pull(&self, deficit: f64, candidates: Vec<NodeId>) {
        let (timeout, requester_load) = {
            let s = self.state();
            (s.settings.offer_timeout, s.load.internal())
        };
        for node in candidates {
            let Some(name) = self.state().names.get(&node).cloned() else {
                continue;
            };
            self.state().stats.pulls_sent += 1;
            let req = pb::PullRequest {
                from_node: self.node.clone(),
                requester_load,
                deficit,
            };
            match tokio::time::timeout(timeout, self.negotiator.pull(&name, req)).await {
                Ok(Ok(r)) if r.will_push => {
                    tracing::info!(from = %name, pid = r.pid, "pull answered: an offer follows");
                    let mut s = self.state();
                    s.stats.pulls_answered += 1;
                    s.last_decision = format!("pulled {} from {name}", r.pid);
                    return;
                }
                Ok(Ok(r)) => tracing::info!(from = %name, refusal = %r.refusal, "pull refused"),
                Ok(Err(e)) => tracing::info!(from = %name, error = %e, "pull failed"),
                Err(_) => tracing::warn!(from = %name, ?timeout, "no answer to the pull in time"),
            }
        }
        self.state().last_decision = "pull: no candidate had work to give".into();
    }

    /// The loaded node's side of a pull: gives a process to the asker when
    /// moving one helps, through an ordinary push.
    pub fn on_pull(self: &Arc<Self>, req: &pb::PullRequest) -> pb::PullResponse {
        let refuse = |why: &str| pb::PullResponse {
            refusal: why.to_owned(),
            ..Default::default()
        };
        if !req.requester_load.is_finite()
            || req.requester_load < 0.0
            || !crate::config::valid_node_name(&req.from_node)
            || req.from_node == self.node
        {
            return refuse("invalid");
        }
        let mut s = self.state();
        if !s.settings.enabled {
            return refuse("disabled");
        }
        if !self.starter.can_reach(&req.from_node) {
            return refuse("unreachable");
        }
        let now = self.clock.now();
        if s.balancer.gate.calming_down(now) {
            return refuse("calming_down");
        }
        if !s.balancer.gate.can_send(now) {
            return refuse("busy");
        }
        let own = s.load.internal();
        let procs = process_loads(&s, now);
        let mut rng = StdRng::seed_from_u64(s.rng.next_u64());
        // The process closest to half the gap, if moving it lowers the
        // larger load (the same call answers pulls in the simulator).
        let Some((pid, process_load)) = s.balancer.give(&procs, own, req.requester_load, &mut rng)
        else {
            return refuse("would_not_help");
        };
        let id = MigrationId(s.rng.next_u64());
        if let Err(e) = s.balancer.gate.mark(id, now) {
            return refuse(&format!("busy: {e}"));
        }
        let requester = node_id(&req.from_node);
        s.names.insert(requester, req.from_node.clone());
        s.stats.pulls_given += 1;
        s.last_decision = format!("give {} to {} (pulled)", pid.0, req.from_node);
        // What the migration's record shows as the reason: the asker's load
        // as it said it, this node's, and the process.
        s.beliefs = pb::BalancerDecision {
            load: own,
            approximate_average: (own + req.requester_load) / 2.0,
            candidates: vec![pb::BalancerPeer {
                node: req.from_node.clone(),
                load: req.requester_load,
                age_ms: 0,
            }],
            pid: pid.0 as i32,
            process_load,
            destinations: vec![req.from_node.clone()],
            at_unix_ms: super::unix_ms(),
            ..Default::default()
        };
        let why = pb::BalancerDecision {
            decision: s.last_decision.clone(),
            ..s.beliefs.clone()
        };
        drop(s);
        tracing::info!(to = %req.from_node, pid = pid.0, process_load, "pull: giving a process");
        let this = Arc::clone(self);
        tokio::spawn(async move {
            this.push(pid.0 as i32, process_load, vec![requester], Some(id), why)
                .await;
        });
        pb::PullResponse {
            will_push: true,
            pid: pid.0 as i32,
            process_load,
            refusal: String::new(),
        }
    }
}
