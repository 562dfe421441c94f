//! The receiver's side of the conductors' two-phase commit (Gerofi et al.
//! (DVE) §IV-A): an offer reserves this node's one incoming slot or is
//! refused; its end frees the slot, and a commit starts the calm-down,
//! raises the load by the process (with `load.follow_migrations`) and notes
//! the arrival (the export load's recent arrivals, the selection's rehop
//! residency).

use ferry_policy::ProcessId;
use ferry_policy::transfer::{Answer, MigrationId, Offer, Outcome, ReceiverView};
use ferry_proto::v1 as pb;

use super::{Conductor, State, node_id, refusal_name};

impl Conductor {
    /// Receiver, phase 1.
    pub fn on_offer(&self, req: &pb::OfferRequest) -> pb::OfferResponse {
        let mut s = self.state();
        let refuse = |s: &mut State, why: &str| {
            s.stats.incoming_refused += 1;
            pb::OfferResponse {
                accepted: false,
                refusal: why.to_owned(),
            }
        };
        if !s.settings.enabled {
            return refuse(&mut s, "disabled");
        }
        if !req.sender_load.is_finite() || !req.process_load.is_finite() {
            return refuse(&mut s, "invalid");
        }
        let now = self.clock.now();
        let offer = Offer {
            id: MigrationId(req.offer_id),
            from: node_id(&req.from_node),
            sender_load: req.sender_load,
            process_load: req.process_load,
        };
        // With `transfer.receiver_up_to_average` the receiver checks the
        // offer against what its peers see of it (its export load) and the
        // average it knows; otherwise against its own load, as Gerofi et al.
        let view = if s.settings.policy.transfer.receiver_up_to_average {
            let peers = self.candidates(&s, now);
            ReceiverView {
                load: s.export,
                average: Some(ferry_policy::node::approximate_average(s.export, &peers)),
            }
        } else {
            ReceiverView {
                load: s.load.internal(),
                average: None,
            }
        };
        match s.balancer.gate.on_offer_with(&offer, &view, now) {
            Answer::Accept => {
                s.stats.incoming_accepted += 1;
                s.incoming = Some((req.offer_id, req.process_load));
                tracing::info!(from = %req.from_node, pid = req.pid, "offer accepted");
                pb::OfferResponse {
                    accepted: true,
                    refusal: String::new(),
                }
            }
            Answer::Refuse(r) => refuse(&mut s, refusal_name(r)),
        }
    }

    /// Receiver, phase 2.
    pub fn on_finish(&self, req: &pb::FinishRequest) {
        let mut s = self.state();
        let now = self.clock.now();
        let outcome = if req.committed {
            Outcome::Committed
        } else {
            Outcome::Aborted
        };
        match s
            .balancer
            .gate
            .finish_incoming(MigrationId(req.offer_id), outcome, now)
        {
            Ok(()) => {
                let load = s
                    .incoming
                    .take()
                    .filter(|&(id, _)| id == req.offer_id)
                    .map_or(0.0, |(_, load)| load);
                if req.committed {
                    s.calm_from = Some(now);
                    let load_cfg = s.settings.policy.load.clone();
                    s.load.arrived(now, load, &load_cfg);
                    if req.destination_pid > 0 {
                        s.arrivals.note(now, ProcessId(req.destination_pid as u64));
                        s.arrived_at.insert(req.destination_pid, now);
                    }
                }
            }
            Err(e) => {
                tracing::debug!(from = %req.from_node, error = %e, "finish of an unknown offer")
            }
        }
    }
}
