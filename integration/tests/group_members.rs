//! A running distributed server's members change (the XtreemOS distributed
//! servers: serving nodes register with the contact node, a node taken as
//! failed joins again): a node joins a running group and serves connections
//! handed to it, then leaves once it serves none; a backup and a contact
//! node whose agents stalled long enough to be taken as failed join again
//! by themselves, and no connection they served is lost. Root only; run by
//! `cargo xtask test` (or `cargo xtask integration`).

use std::net::{SocketAddrV4, TcpStream};
use std::time::{Duration, Instant};

use ferry_integration::cluster::Cluster;
use ferry_integration::group::{
    TEST_PORT as PORT, echo, echo_group, group_server, group_view, pattern, start_cluster as start,
    wait_server,
};
use ferry_integration::managed::{migrate, process_state, runtime};
use ferry_integration::netns;
use ferry_proto::v1 as pb;
use ferry_proto::v1::control_client::ControlClient;
use tonic::transport::Channel;

/// A client connection to the group's port, served by whoever the filter
/// says, after a first exchange.
fn connect(cluster: &Cluster, hello: &'static [u8]) -> TcpStream {
    let addr = SocketAddrV4::new(cluster.public_addr(), PORT);
    netns::run_in(&cluster.netns_path("client1"), move || {
        let mut s = TcpStream::connect_timeout(&addr.into(), Duration::from_secs(5)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        echo(&mut s, hello).unwrap();
        s
    })
    .expect("the client")
}

/// 200 kB both ways at once on `s`, checked byte by byte.
fn stream_both_ways(s: &mut TcpStream) {
    use std::io::{Read, Write};
    let more = pattern(0, 200_000);
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || w.write_all(&more).unwrap());
    let mut back = vec![0; 200_000];
    s.read_exact(&mut back).unwrap();
    writer.join().unwrap();
    assert!(back == pattern(0, 200_000), "the echo of 200 kB differs");
}

/// The operator's handoff of the client's connection `s` on `from`.
async fn hand_off(c: &mut ControlClient<Channel>, s: &TcpStream, to: &str) {
    let r = c
        .handoff_connection(pb::HandoffConnectionRequest {
            node: String::new(),
            connection: Some(pb::GroupConnection {
                remote: s.local_addr().unwrap().to_string(),
                port: u32::from(PORT),
            }),
            to: to.into(),
            drain_ms: 0,
        })
        .await
        .expect("HandoffConnection")
        .into_inner();
    assert_eq!(r.acceptor, to);
}

/// Waits until `c`'s node holds a view of the group for which `ok` holds;
/// returns it.
async fn view_until(
    c: &mut ControlClient<Channel>,
    what: &str,
    ok: impl Fn(&pb::GroupView) -> bool,
) -> pb::GroupView {
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let views = c
            .list_groups(pb::ListGroupsRequest {})
            .await
            .expect("ListGroups")
            .into_inner()
            .groups;
        if let Some(v) = views.into_iter().find(|v| ok(v)) {
            return v;
        }
        assert!(Instant::now() < until, "no view where {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether `node`'s stack holds the client's connection `s` (established).
fn holds(cluster: &Cluster, node: &str, s: &TcpStream) -> bool {
    let mut ss = std::process::Command::new("ss");
    ss.args(["-Htn", "state", "established", "dst"])
        .arg(s.local_addr().unwrap().to_string());
    let out = netns::output_in(&cluster.netns_path(node), ss).expect("ss");
    assert!(
        out.status.success(),
        "ss: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    !out.stdout.is_empty()
}

fn epoch(v: &pb::GroupView) -> u64 {
    v.group.as_ref().map_or(0, |g| g.epoch)
}

#[test]
fn a_node_joins_a_running_group_serves_and_leaves_once_it_serves_nothing() {
    let Some(cluster) = start(
        "a_node_joins_a_running_group_serves_and_leaves_once_it_serves_nothing",
        3,
    ) else {
        return;
    };
    runtime().block_on(async {
        let server2 = echo_group(&cluster, "node1", &[], &["node2"], &["node1", "node2"]).await[1];
        let (mut c1, mut c2) = (
            cluster.control("node1").await.unwrap(),
            cluster.control("node2").await.unwrap(),
        );

        // A group's server does not migrate: its connections move one by
        // one. Refused before anything stops; it runs on.
        let refused = match migrate(&mut c2, server2, "node3").await {
            Err(s) | Ok((_, Some(s))) => s,
            Ok((r, None)) => panic!("a group server migrated: {r:?}"),
        };
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused}");
        assert!(
            refused
                .message()
                .contains("distributed server on port 8080"),
            "{refused}"
        );
        assert!(matches!(process_state(server2), Some('S' | 'R')));

        // Bad input: refused with the reason, nothing changes.
        let add = |port: u32, node: &str| pb::AddGroupMemberRequest {
            port,
            node: node.into(),
            backup: false,
        };
        let remove = |node: &str| pb::RemoveGroupMemberRequest {
            port: u32::from(PORT),
            node: node.into(),
        };
        let e = c2
            .add_group_member(add(u32::from(PORT), "node9"))
            .await
            .expect_err("node9 is not a node");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
        assert!(e.message().contains("node9"), "{e}");
        let e = c2
            .add_group_member(add(0, "node3"))
            .await
            .expect_err("port 0");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
        assert!(e.message().starts_with("port"), "{e}");
        let e = c2
            .add_group_member(add(9999, "node3"))
            .await
            .expect_err("no group on that port");
        assert_eq!(e.code(), tonic::Code::NotFound, "{e}");
        let e = c1
            .remove_group_member(remove("node3"))
            .await
            .expect_err("node3 is not a member");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
        assert!(e.message().contains("node3 is not a member"), "{e}");
        let e = c2
            .remove_group_member(remove("node1"))
            .await
            .expect_err("the contact node without a backup");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
        assert!(e.message().contains("no backup"), "{e}");
        assert_eq!(epoch(&group_view(&mut c1).await), 1, "nothing changed");

        // node3 joins through node2's CLI; node2 is not the contact node:
        // the call reaches node1, which commits the view.
        let out = std::process::Command::new(ferry_integration::bin_path("ferry"))
            .arg("--socket")
            .arg(cluster.control_socket("node2"))
            .args([
                "--json", "group", "add", "--port", "8080", "--member", "node3",
            ])
            .output()
            .expect("ferry group add");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let g: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(
            (g["epoch"].as_u64(), g["contact"].as_str()),
            (Some(2), Some("node1")),
            "{g}"
        );
        assert_eq!(
            g["members"],
            serde_json::json!(["node1", "node2", "node3"]),
            "{g}"
        );
        let mut c3 = cluster.control("node3").await.unwrap();
        let v3 = group_view(&mut c3).await;
        assert_eq!((v3.role.as_str(), epoch(&v3)), ("member", 2), "{v3:?}");
        assert_eq!(epoch(&group_view(&mut c2).await), 2);
        group_server(&mut c3, &["--mode", "echo"]).await;
        wait_server(&mut c3, "node3").await;
    });

    // A connection handed to the new member: every byte once, in order.
    let mut s = connect(&cluster, b"served by node1");
    runtime().block_on(async {
        let mut c1 = cluster.control("node1").await.unwrap();
        hand_off(&mut c1, &s, "node3").await;
    });
    echo(&mut s, b"served by node3 now").expect("after the handoff to the new member");
    stream_both_ways(&mut s);
    // (node1's server still holds its descriptor, inert in repair mode:
    // an operator's handoff does not tell the server.)
    assert!(holds(&cluster, "node3", &s));

    runtime().block_on(async {
        let mut c1 = cluster.control("node1").await.unwrap();
        let remove = pb::RemoveGroupMemberRequest {
            port: u32::from(PORT),
            node: "node3".into(),
        };
        let e = c1
            .remove_group_member(remove.clone())
            .await
            .expect_err("node3 serves a connection");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
        assert!(e.message().contains("node3 serves 1 of its"), "{e}");
        drop(s);
        // node3 finds the connection ended at its next sweep and tells the
        // contact node; then it may leave.
        let until = Instant::now() + Duration::from_secs(15);
        let g = loop {
            match c1.remove_group_member(remove.clone()).await {
                Ok(g) => break g.into_inner(),
                Err(e) if e.code() == tonic::Code::FailedPrecondition => {
                    assert!(Instant::now() < until, "node3 still serving: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("RemoveGroupMember: {e}"),
            }
        };
        assert_eq!(g.epoch, 3, "{g:?}");
        assert_eq!(g.members, ["node1", "node2"], "{g:?}");
        let mut c3 = cluster.control("node3").await.unwrap();
        let left = c3
            .list_groups(pb::ListGroupsRequest {})
            .await
            .unwrap()
            .into_inner()
            .groups;
        assert!(left.is_empty(), "node3 left the group: {left:?}");
    });
    // The group goes on without it.
    let mut s = connect(&cluster, b"a new client");
    echo(&mut s, b"still served").expect("a new connection after node3 left");
}

#[test]
fn a_backup_taken_as_failed_while_its_agent_stalled_joins_again_with_its_connections() {
    let Some(cluster) = start(
        "a_backup_taken_as_failed_while_its_agent_stalled_joins_again_with_its_connections",
        3,
    ) else {
        return;
    };
    runtime().block_on(echo_group(
        &cluster,
        "node1",
        &["node2", "node3"],
        &[],
        &["node1", "node2", "node3"],
    ));
    let mut s = connect(&cluster, b"served by node1");
    runtime().block_on(async {
        let mut c1 = cluster.control("node1").await.unwrap();
        hand_off(&mut c1, &s, "node2").await;
    });
    echo(&mut s, b"served by node2").unwrap();

    // node2's agent stops; node3, which watches it, takes it as failed.
    let stalled = cluster
        .stall_agent("node2")
        .expect("stalling node2's agent");
    runtime().block_on(async {
        let mut c1 = cluster.control("node1").await.unwrap();
        let v = view_until(&mut c1, "node2 is left out", |v| {
            v.group
                .as_ref()
                .is_some_and(|g| !g.members.contains(&"node2".to_owned()))
        })
        .await;
        assert_eq!(v.group.unwrap().backups, ["node3"]);
    });
    // Its node's kernel and server go on: the connection is still served.
    echo(&mut s, b"while node2's agent is stopped").expect("during the stall");
    stalled.resume();

    // node2 hears of the view that left it out and joins again, at the end
    // of the chain, with the connection it serves.
    let flow = s.local_addr().unwrap().to_string();
    runtime().block_on(async {
        let mut c1 = cluster.control("node1").await.unwrap();
        let v = view_until(&mut c1, "node2 is back", |v| {
            v.group
                .as_ref()
                .is_some_and(|g| g.members.contains(&"node2".to_owned()))
        })
        .await;
        let g = v.group.clone().unwrap();
        assert_eq!(g.backups, ["node3", "node2"], "{g:?}");
        assert!(g.epoch >= 3, "{g:?}");
        assert!(
            v.connections
                .iter()
                .any(|c| c.node == "node2"
                    && c.connection.as_ref().is_some_and(|c| c.remote == flow)),
            "the contact node knows node2 serves {flow}: {v:?}"
        );
        let mut c2 = cluster.control("node2").await.unwrap();
        let v2 = view_until(&mut c2, "node2 holds the view", |v| epoch(v) == g.epoch).await;
        assert_eq!(v2.role, "backup");
    });
    echo(&mut s, b"after joining again").expect("after node2 joined again");
    stream_both_ways(&mut s);

    // The chain is whole again: the contact node fails, node3 takes over,
    // and node2's connection goes on.
    cluster.fail_node("node1").expect("node1 failing");
    runtime().block_on(async {
        let mut c3 = cluster.control("node3").await.unwrap();
        view_until(&mut c3, "node3 is the contact node", |v| {
            v.role == "contact"
        })
        .await;
        let mut c2 = cluster.control("node2").await.unwrap();
        let v2 = view_until(&mut c2, "node2 follows node3", |v| {
            v.group.as_ref().is_some_and(|g| g.contact == "node3")
        })
        .await;
        assert_eq!(v2.role, "backup", "{v2:?}");
    });
    echo(&mut s, b"after the contact node failed").expect("after the failover");
}

#[test]
fn a_contact_node_taken_as_failed_while_its_agent_stalled_steps_down_and_keeps_its_connections() {
    let Some(cluster) = start(
        "a_contact_node_taken_as_failed_while_its_agent_stalled_steps_down_and_keeps_its_connections",
        2,
    ) else {
        return;
    };
    runtime().block_on(echo_group(
        &cluster,
        "node1",
        &["node2"],
        &[],
        &["node1", "node2"],
    ));
    // Served by node1 itself: no handoff, no entry of its own in any
    // table until node1 steps down.
    let mut s = connect(&cluster, b"served by node1");
    let stalled = cluster
        .stall_agent("node1")
        .expect("stalling node1's agent");
    runtime().block_on(async {
        let mut c2 = cluster.control("node2").await.unwrap();
        view_until(&mut c2, "node2 took over", |v| v.role == "contact").await;
    });
    stalled.resume();
    runtime().block_on(async {
        let mut c1 = cluster.control("node1").await.unwrap();
        let v1 = view_until(&mut c1, "node1 is a backup", |v| v.role == "backup").await;
        let g = v1.group.clone().unwrap();
        assert_eq!(
            (g.contact.as_str(), g.backups.as_slice()),
            ("node2", &["node1".to_owned()][..])
        );
        let mut c2 = cluster.control("node2").await.unwrap();
        let v2 = view_until(&mut c2, "node2 holds the same view", |v| {
            epoch(v) == g.epoch
        })
        .await;
        let flow = s.local_addr().unwrap().to_string();
        assert!(
            v2.connections
                .iter()
                .any(|c| c.node == "node1"
                    && c.connection.as_ref().is_some_and(|c| c.remote == flow)),
            "the new contact node leaves {flow} to node1: {v2:?}"
        );
    });
    // node1's own connection: still node1's, every byte once and in order.
    echo(&mut s, b"still served by node1").expect("after node1 stepped down");
    stream_both_ways(&mut s);
    assert!(holds(&cluster, "node1", &s) && !holds(&cluster, "node2", &s));
    // New connections: node2's now, and only node2's.
    let mut n = connect(&cluster, b"a new client");
    echo(&mut n, b"served by node2").unwrap();
    assert!(holds(&cluster, "node2", &n) && !holds(&cluster, "node1", &n));
    runtime().block_on(async {
        let mut c2 = cluster.control("node2").await.unwrap();
        assert_eq!(group_view(&mut c2).await.role, "contact");
    });
}

#[test]
fn restarted_agents_serve_their_groups_again_and_lose_no_connection() {
    let Some(mut cluster) = start(
        "restarted_agents_serve_their_groups_again_and_lose_no_connection",
        3,
    ) else {
        return;
    };
    runtime().block_on(echo_group(
        &cluster,
        "node1",
        &["node2"],
        &["node3"],
        &["node1", "node2", "node3"],
    ));
    // One connection handed to node3, one node1 serves itself.
    let mut handed = connect(&cluster, b"to be handed");
    runtime().block_on(async {
        let mut c1 = cluster.control("node1").await.unwrap();
        hand_off(&mut c1, &handed, "node3").await;
    });
    echo(&mut handed, b"served by node3").unwrap();
    let mut own = connect(&cluster, b"served by node1");

    // node3's agent restarts: its connection goes on meanwhile (its
    // kernel serves it), and after it the group is node3's again, its
    // server registered again by the library, and it takes handoffs.
    cluster.stop_agent("node3").expect("stopping node3's agent");
    echo(&mut handed, b"while node3's agent is away").expect("without node3's agent");
    cluster
        .start_agent("node3")
        .expect("starting node3's agent");
    let handed_remote = handed.local_addr().unwrap().to_string();
    runtime().block_on(async {
        let mut c3 = cluster.control("node3").await.unwrap();
        wait_server(&mut c3, "node3").await;
        let v3 = group_view(&mut c3).await;
        assert_eq!((v3.role.as_str(), epoch(&v3)), ("member", 1), "{v3:?}");
        assert!(
            v3.connections.iter().any(|c| c.node == "node3"
                && c.connection
                    .as_ref()
                    .is_some_and(|c| c.remote == handed_remote)),
            "node3 knows it serves {handed_remote}: {v3:?}"
        );
    });
    echo(&mut handed, b"after node3's agent restarted").expect("after the restart");
    let mut later = connect(&cluster, b"handed after the restart");
    runtime().block_on(async {
        let mut c1 = cluster.control("node1").await.unwrap();
        hand_off(&mut c1, &later, "node3").await;
    });
    echo(&mut later, b"served by node3").expect("a handoff to the restarted node");
    stream_both_ways(&mut later);

    // The contact node's agent restarts: node2 takes over while it is
    // away; back, node1 finds it was left out and joins again as a backup,
    // keeping the connection it served itself.
    cluster.stop_agent("node1").expect("stopping node1's agent");
    runtime().block_on(async {
        let mut c2 = cluster.control("node2").await.unwrap();
        view_until(&mut c2, "node2 took over", |v| v.role == "contact").await;
    });
    cluster
        .start_agent("node1")
        .expect("starting node1's agent");
    runtime().block_on(async {
        let mut c1 = cluster.control("node1").await.unwrap();
        let v1 = view_until(&mut c1, "node1 is back as a backup", |v| v.role == "backup").await;
        // Only the connection node1 served itself is its: its server's
        // descriptors of those an operator handed off stay inert.
        let mine: Vec<_> = v1
            .connections
            .iter()
            .filter(|c| c.node == "node1")
            .filter_map(|c| c.connection.as_ref().map(|c| c.remote.clone()))
            .collect();
        assert_eq!(mine, [own.local_addr().unwrap().to_string()], "{v1:?}");
        let g = v1.group.unwrap();
        assert_eq!(g.contact, "node2", "{g:?}");
        wait_server(&mut c1, "node1").await;
    });
    echo(&mut own, b"node1's own, after its agent restarted").expect("node1's own connection");
    stream_both_ways(&mut own);
    echo(&mut handed, b"node3's, after both restarts").expect("node3's connection");
    let mut n = connect(&cluster, b"a new client");
    echo(&mut n, b"served by node2").unwrap();
    assert!(holds(&cluster, "node2", &n));
}
