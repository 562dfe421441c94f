//! What the distributed servers' tests share with their server
//! (`ferry-group-server`): the bytes a download carries, so that a client
//! can check every byte of it whichever node sent it; and the tests' calls
//! to the agents (a group on [`TEST_PORT`], its servers, its views).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use ferry_proto::v1 as pb;
use ferry_proto::v1::control_client::ControlClient;
use tonic::transport::Channel;

use crate::cluster::{Cluster, ClusterSpec};
use crate::managed::run;

/// The port of the cluster's address the tests' groups serve.
pub const TEST_PORT: u16 = 8080;

/// A cluster of `nodes` and one client, unless the test cannot run here.
pub fn start_cluster(test: &str, nodes: usize) -> Option<Cluster> {
    if !crate::can_run(test) {
        return None;
    }
    Some(Cluster::start(ClusterSpec::new(nodes, 1)).expect("cluster"))
}

/// The bytes at `offset..offset + len` of a download: each 8-byte block
/// is a hash of its index, so a byte lost, repeated or moved anywhere
/// shows.
pub fn pattern(offset: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut i = offset;
    while out.len() < len {
        let block = splitmix(i / 8).to_le_bytes();
        out.push(block[(i % 8) as usize]);
        i += 1;
    }
    out
}

/// Raises this process's soft limit of open descriptors to its hard one:
/// thousands of connections in one process.
pub fn raise_nofile() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `l`; setrlimit reads it.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

/// Creates the group on [`TEST_PORT`] through `c`'s node.
pub async fn create_group(c: &mut ControlClient<Channel>, contact: &str, members: &[&str]) {
    create_group_with_backups(c, contact, &[], members).await;
}

pub async fn create_group_with_backups(
    c: &mut ControlClient<Channel>,
    contact: &str,
    backups: &[&str],
    members: &[&str],
) {
    c.create_group(pb::CreateGroupRequest {
        group: Some(pb::Group {
            port: u32::from(TEST_PORT),
            contact: contact.into(),
            backups: backups.iter().map(|m| m.to_string()).collect(),
            members: members.iter().map(|m| m.to_string()).collect(),
            epoch: 0,
            placement: String::new(),
        }),
    })
    .await
    .expect("CreateGroup");
}

/// The group on [`TEST_PORT`] as `c`'s node sees it.
pub async fn group_view(c: &mut ControlClient<Channel>) -> pb::GroupView {
    c.list_groups(pb::ListGroupsRequest {})
        .await
        .expect("ListGroups")
        .into_inner()
        .groups
        .into_iter()
        .find(|g| {
            g.group
                .as_ref()
                .is_some_and(|g| g.port == u32::from(TEST_PORT))
        })
        .expect("the group on this node")
}

/// Starts `ferry-group-server` under the node's agent with `args`.
pub async fn group_server(c: &mut ControlClient<Channel>, args: &[&str]) -> i32 {
    let mut argv = vec![
        crate::bin_path("ferry-group-server")
            .to_string_lossy()
            .into_owned(),
        "--port".into(),
        TEST_PORT.to_string(),
    ];
    argv.extend(args.iter().map(|a| a.to_string()));
    run(c, argv).await
}

/// Waits until a server process registered with the node's agent.
pub async fn wait_server(c: &mut ControlClient<Channel>, node: &str) {
    let until = Instant::now() + Duration::from_secs(20);
    while group_view(c).await.server_pids.is_empty() {
        assert!(
            Instant::now() < until,
            "no group server registered on {node}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Creates the group on [`TEST_PORT`] (`contact`, `backups`, `members`)
/// and starts an echo server of it under each of `servers`' agents, each
/// registered once this returns; their PIDs.
pub async fn echo_group(
    cluster: &Cluster,
    contact: &str,
    backups: &[&str],
    members: &[&str],
    servers: &[&str],
) -> Vec<i32> {
    let mut c = cluster
        .control(contact)
        .await
        .expect("the contact node's agent");
    create_group_with_backups(&mut c, contact, backups, members).await;
    let mut pids = Vec::new();
    for node in servers {
        let mut c = cluster.control(node).await.expect("a member's agent");
        pids.push(group_server(&mut c, &["--mode", "echo"]).await);
        wait_server(&mut c, node).await;
    }
    pids
}

/// Sends `msg` and reads it back (an echo server's answer): every byte
/// once and in order.
pub fn echo(s: &mut TcpStream, msg: &[u8]) -> std::io::Result<()> {
    s.write_all(msg)?;
    let mut back = vec![0; msg.len()];
    s.read_exact(&mut back)?;
    assert_eq!(back, msg, "the echo");
    Ok(())
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_slice_of_the_pattern_is_the_same_bytes() {
        let whole = pattern(0, 1000);
        assert_eq!(pattern(333, 100), whole[333..433]);
        assert_ne!(pattern(1, 100), whole[0..100]);
    }
}
