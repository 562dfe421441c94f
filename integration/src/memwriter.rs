//! `ferry-memwriter` in a test cluster, for the memory strategies' tests:
//! started under management on a node, asked through client1 wherever it
//! runs now, and its own check of its memory.

use std::net::SocketAddrV4;
use std::time::Duration;

use ferry_proto::v1::control_client::ControlClient;
use tonic::transport::Channel;

use crate::cluster::Cluster;
use crate::managed::{
    PROCESS_WAIT, list, process_state, run, wait_for_process, wait_for_process_within,
};
use crate::workload::request_line;

/// A memory writer listening on `port` of the cluster's public address.
#[derive(Debug, Clone, Copy)]
pub struct MemWriter {
    pub port: u16,
}

impl MemWriter {
    /// The binary (built with the integration crate).
    pub fn binary() -> String {
        crate::bin_path("ferry-memwriter")
            .to_string_lossy()
            .into_owned()
    }

    /// Starts it under management with `mib` MiB rewritten at
    /// `writes_per_ms` page writes per millisecond, and waits until its
    /// port is owned; returns its PID.
    pub async fn start(
        &self,
        control: &mut ControlClient<Channel>,
        mib: u32,
        writes_per_ms: u32,
    ) -> i32 {
        self.start_with(
            control,
            &[
                "--mib",
                &mib.to_string(),
                "--writes-per-ms",
                &writes_per_ms.to_string(),
            ],
        )
        .await
    }

    /// Starts it under management with these arguments besides its port
    /// (see `ferry-memwriter --help`); returns its PID once its port is
    /// owned.
    pub async fn start_with(&self, control: &mut ControlClient<Channel>, args: &[&str]) -> i32 {
        let mut argv = vec![Self::binary(), "--port".into(), self.port.to_string()];
        argv.extend(args.iter().map(|a| a.to_string()));
        let pid = run(control, argv).await;
        // It fills its memory before it listens: 4 GiB took more than
        // 10 s right after a large migration had freed as much.
        let mib: u64 = args
            .windows(2)
            .find(|w| w[0] == "--mib")
            .and_then(|w| w[1].parse().ok())
            .unwrap_or(0);
        let within = PROCESS_WAIT + Duration::from_secs(5 * mib / 1024);
        wait_for_process_within(control, pid, within, |p| p.tcp_listening == 1).await;
        pid
    }

    /// After a committed migration from `source` to `destination` (the
    /// writer was `pid` and is `new_pid`): it runs on the destination,
    /// migrated in; the source manages nothing and `pid` is gone; its check
    /// of all its memory passes with no fewer writes than `writes_before`;
    /// and it goes on writing. Returns its writes after that.
    pub async fn moved_intact(
        &self,
        cluster: &Cluster,
        source: &mut ControlClient<Channel>,
        destination: &mut ControlClient<Channel>,
        pid: i32,
        new_pid: i32,
        writes_before: u64,
    ) -> u64 {
        let moved = wait_for_process(destination, new_pid, |p| p.state == "running").await;
        assert_eq!(moved.origin, "migrated-in");
        assert!(list(source).await.is_empty(), "the source still manages it");
        assert_eq!(process_state(pid), None, "source copy still exists");
        let now = self.check(cluster);
        assert!(
            now >= writes_before,
            "writes went back from {writes_before} to {now}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let later = self.check(cluster);
        assert!(later > now, "the process does not run after the migration");
        later
    }

    /// One command, from client1; panics if it gets no answer.
    pub fn ask(&self, cluster: &Cluster, command: &str) -> String {
        let target = SocketAddrV4::new(cluster.public_addr(), self.port);
        request_line(
            &cluster.netns_path("client1"),
            target,
            command,
            Duration::from_secs(20),
        )
        .unwrap_or_else(|e| panic!("asking the writer {command:?}: {e}"))
    }

    /// Its check of all its memory must answer "ok <writes> <pages>";
    /// returns the writes so far.
    pub fn check(&self, cluster: &Cluster) -> u64 {
        self.check_pages(cluster).0
    }

    /// [`MemWriter::check`], with the pages it checked.
    pub fn check_pages(&self, cluster: &Cluster) -> (u64, usize) {
        let answer = self.ask(cluster, "check");
        let words: Vec<&str> = answer.split_whitespace().collect();
        assert_eq!(words.first(), Some(&"ok"), "memory check: {answer}");
        (
            words[1].parse().expect("a write count"),
            words[2].parse().expect("a page count"),
        )
    }
}

/// The agents of a two-node test as (source, destination), the process
/// being on `on` (0 or 1).
pub fn source_and_destination<T>(controls: &mut [T; 2], on: usize) -> (&mut T, &mut T) {
    let [a, b] = controls;
    if on == 0 { (a, b) } else { (b, a) }
}

/// Whether any mapping of `pid` is still registered for userfaultfd write
/// protection ("uw" in smaps' VmFlags).
pub fn write_protected(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/smaps"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("VmFlags:"))
        .any(|f| f.split_whitespace().any(|w| w == "uw"))
}
