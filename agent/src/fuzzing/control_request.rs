//! The `control_request` target: Control and Balance requests as tonic
//! decodes them, and the checks the agent makes of them without root.

use std::time::Duration;

use ferry_proto::v1 as pb;

use super::{Input, decode};

/// `control_request`: the first byte picks one of the Control (and
/// Balance) requests, the rest is its protobuf encoding, decoded as tonic
/// would; then the agent's checks that run without root or a cluster:
/// SetBalancer's settings all the way to the balancer they configure and
/// a decision of it, Migrate's option checks.
pub fn control_request(data: &[u8]) {
    let mut input = Input(data);
    let which = input.byte();
    let msg = input.rest();
    match which % 18 {
        0 => drop(decode::<pb::ListNodesRequest>(msg)),
        1 => drop(decode::<pb::ListProcessesRequest>(msg)),
        2 => drop(decode::<pb::RunProcessRequest>(msg)),
        3 => {
            if let Some(req) = decode::<pb::MigrateRequest>(msg) {
                migrate_options(&req);
            }
        }
        4 => drop(decode::<pb::GetMigrationRequest>(msg)),
        5 => drop(decode::<pb::GetDataPlaneRequest>(msg)),
        6 => drop(decode::<pb::GetBalancerRequest>(msg)),
        7 => {
            if let Some(req) = decode::<pb::SetBalancerRequest>(msg) {
                set_balancer(&req);
            }
        }
        8 => drop(decode::<pb::OfferRequest>(msg)),
        9 => drop(decode::<pb::FinishRequest>(msg)),
        10 => drop(decode::<pb::CancelMigrationRequest>(msg)),
        11 => {
            if let Some(req) = decode::<pb::DrainNodeRequest>(msg)
                && let Err(s) = crate::api::drain_options(&req)
            {
                assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
            }
        }
        12 => drop(decode::<pb::SetCordonRequest>(msg)),
        13 => drop(decode::<pb::WatchEventsRequest>(msg)),
        14 => drop(decode::<pb::AdoptProcessRequest>(msg)),
        15 => drop(decode::<pb::WaitProcessRequest>(msg)),
        16 => drop(decode::<pb::CancelDrainRequest>(msg)),
        _ => {
            if let Some(req) = decode::<pb::SignalProcessRequest>(msg) {
                match crate::managed::signal_to_send(req.signal) {
                    Ok(s) => assert!(
                        (1..=31).contains(&(s as i32)) && s != nix::sys::signal::Signal::SIGSTOP,
                        "{s:?} accepted"
                    ),
                    Err(e) => assert!(e.starts_with("signal: "), "{e}"),
                }
            }
        }
    }
}

/// `ControlService::migrate`'s checks of a request: an accepted one is
/// within the documented bounds, a refused one is INVALID_ARGUMENT.
fn migrate_options(req: &pb::MigrateRequest) {
    match crate::api::migrate_options(req) {
        Ok((pid, destination, options)) => {
            assert!(pid > 0 && !destination.is_empty(), "{req:?}");
            assert!(
                options.downtime_budget.is_none_or(
                    |d| d.as_millis() <= u128::from(crate::config::MAX_DOWNTIME_BUDGET_MS)
                ),
                "{req:?}"
            );
            assert!(
                options
                    .max_rounds
                    .is_none_or(|r| r <= crate::config::MAX_PRECOPY_ROUNDS),
                "{req:?}"
            );
        }
        Err(s) => assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}"),
    }
}

/// What `ControlService::set_balancer` does with a request, minus the
/// conductor's lock: apply the settings, check them as the conductor does,
/// build the balancer and its information policy, and let it decide.
fn set_balancer(req: &pb::SetBalancerRequest) {
    use rand::SeedableRng;

    let Ok(policy) = crate::api::apply_settings(&ferry_policy::Config::default(), &req.settings)
    else {
        return;
    };
    if policy.validate().is_err() {
        return;
    }
    // What GetBalancer shows of an accepted policy reads back as itself.
    let shown = toml::to_string(&policy).expect("an accepted policy is TOML");
    let back: ferry_policy::Config = toml::from_str(&shown).expect("GetBalancer's TOML reads back");
    assert_eq!(back, policy, "{shown}");
    let node = crate::conductor::node_id;
    let local = node("node1");
    let members = [local, node("node2"), node("node3")];
    let _info = policy.information.policy(local, &members);
    let mut balancer = ferry_policy::Balancer::new(&policy);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let processes: Vec<_> = (1..=4)
        .map(|i| ferry_policy::selection::ProcessLoad {
            pid: ferry_policy::ProcessId(i),
            load: i as f64 * 0.3,
            resident_for: Duration::from_secs(i * 30),
            migratable: i != 2,
            since_arrival: (i == 3).then(|| Duration::from_secs(5)),
        })
        .collect();
    // Underloaded, balanced and overloaded views of the cluster, over time.
    for (step, local_load) in [0.0, 1.0, 4.0, 0.5, 9.0].into_iter().enumerate() {
        let peers: Vec<_> = members[1..]
            .iter()
            .zip([0.2, 2.5])
            .map(|(&n, load)| ferry_policy::PeerLoad {
                node: n,
                load,
                age: Duration::from_millis(500),
            })
            .collect();
        let now = ferry_policy::Instant::from_millis(1_000_000 + step as u64 * 60_000);
        let _ = balancer.plan(now, local_load, &peers, &processes, &mut rng);
    }
}
