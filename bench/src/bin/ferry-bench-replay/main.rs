//! `cargo xtask bench replay`: the cost and the side effects of the ways a
//! destination node can hand captured packets back to its own stack
//! (ebpf/src/replay.rs explains why ferry uses a raw `IPPROTO_RAW` socket).
//!
//! Everything happens in one network namespace, `fy<pid>-br` (deleted
//! on exit, failures included):
//!
//! - `brpub` (198.18.240.1/24), one end of a veth pair, plays the public
//!   interface; its peer `brpeer` plays the wire. Clients live behind it at
//!   198.18.243.7 (a route on `brpub` and a static neighbour entry with a
//!   MAC nobody owns, so the stack's answers leave `brpub` and die at
//!   `brpeer` as PACKET_OTHERHOST);
//! - `brtun`, a TUN device (IFF_TUN | IFF_NO_PI) without an address;
//! - the receivers, both on 198.18.240.1: a UDP socket on port 7003, and
//!   `--conns` established TCP connections on port 7004 created the way
//!   CRIU restores them (TCP_REPAIR: chosen sequence numbers, peer
//!   198.18.243.7, window scale 7), so that in-window data segments can be
//!   forged exactly.
//!
//! The packets are what the capture would hold: IPv4/UDP datagrams with a
//! 256-byte payload (the zone traffic of Gerofi et al. (DVE)) from
//! 198.18.243.7 to the UDP socket, and 256-byte TCP data segments spread
//! round-robin over the connections, all with correct checksums. Each
//! mechanism delivers `--packets` of them per run:
//!
//! - `raw socket (ferry Replayer)`: `ferry_ebpf::Replayer::replay`, i.e.
//!   what ferry does, per-packet copy and checksum recomputation included;
//! - `raw socket, sendto`: the same socket call on prebuilt packets;
//! - `raw socket, sendmmsg xB`: batches of `--batch`;
//! - `TUN write`: `write()` of each packet to the TUN device;
//! - `veth peer (AF_PACKET)`: the packet in an Ethernet frame, sent on
//!   `brpeer` so that it arrives on `brpub` like live traffic: the
//!   reference, and the path a replay must NOT take (it passes the capture
//!   hook again);
//! - the raw socket and TUN once more with `rp_filter=1` (strict) on
//!   `all`, the other rows running with `rp_filter=0` everywhere.
//!
//! Per run the time is the wall time of the send loop; the receivers'
//! counters (`IpInDelivers`, bytes queued on the TCP sockets) are read
//! right after it, and if not everything has arrived yet the clock keeps
//! running until it has (column "late at return"). Then the receivers are
//! drained and every datagram and byte checked (sequence numbers, payload,
//! order): a packet counts as delivered only when it was read back intact.
//! A mechanism that drops is shown with what it delivered and the counters
//! that explain the drops, never as fast.
//!
//! Last, a hook check: trivial eBPF programs that only count (tcx ingress
//! on `brpub`, `lo` and `brtun`; netfilter IPv4 PRE_ROUTING, LOCAL_IN,
//! LOCAL_OUT, POST_ROUTING through BPF netfilter links; run counts from
//! `BPF_ENABLE_STATS`) while each path replays UDP datagrams: which hooks a
//! replayed packet passes, in particular whether it re-enters tc ingress of
//! the public interface, where ferry's capture program sits; and whether a
//! UDP socket bound to the public interface (SO_BINDTODEVICE) receives a
//! replayed datagram.
//!
//! Writes the per-run samples as CSV and the tables as Markdown to `--out`
//! (default `target/bench/replay`).

mod bpf;
mod lab;
mod packets;
mod report;
mod sockets;

use lab::*;
use packets::*;
use report::*;
use sockets::*;

use std::fmt::Write as _;
use std::io::IoSliceMut;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use ferry_ebpf::Replayer;
use ferry_integration::NetNs;
use ferry_integration::cmd;
use ferry_integration::netns::{run_in, set_sysctl};
use ferry_integration::nstat::Nstat;
use nix::sys::socket::{
    self, AddressFamily, ControlMessageOwned, MsgFlags, SockFlag, SockType, SockaddrIn, sockopt,
};

const PUB: &str = "brpub";
const PEER: &str = "brpeer";
const TUN: &str = "brtun";
const TARGET: Ipv4Addr = Ipv4Addr::new(198, 18, 240, 1);
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 243, 7);
const PUB_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x01, 0x01];
const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x01, 0x02];
/// The clients' MAC as `brpub` knows it: owned by no device, so answers
/// to the clients are dropped at `brpeer` before IP.
const CLIENT_MAC: &str = "02:00:00:00:01:07";
const UDP_PORT: u16 = 7003;
const TCP_PORT: u16 = 7004;
/// A UDP socket bound to the public interface (SO_BINDTODEVICE).
const BOUND_PORT: u16 = 7005;
const PAYLOAD: usize = 256;
/// The receive window the repaired TCP connections are given.
const TCP_WINDOW: u32 = 4 << 20;
/// How long a run may wait for packets still in flight after the loop.
const SETTLE: Duration = Duration::from_millis(200);

#[derive(Debug, Parser)]
#[command(
    name = "ferry-bench-replay",
    about = "replaying captured packets: raw IPPROTO_RAW socket vs TUN vs the wire"
)]
struct Args {
    /// Packets per run, per mechanism and protocol.
    #[arg(long, default_value_t = 10_000)]
    packets: usize,
    /// Measured runs (after one warm-up run that is not counted).
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// TCP connections the segments are spread over.
    #[arg(long, default_value_t = 16)]
    conns: usize,
    /// Packets per sendmmsg() call.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Datagrams per path in the hook check.
    #[arg(long, default_value_t = 1000)]
    hook_packets: usize,
    /// Where the CSV and Markdown tables go.
    #[arg(long, default_value = "target/bench/replay")]
    out: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Replayer,
    RawSendto,
    RawSendmmsg,
    Tun,
    Veth,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mech {
    kind: Kind,
    /// `net.ipv4.conf.all.rp_filter=1` during the run (else 0).
    strict: bool,
}

const MECHS: [Mech; 7] = [
    Mech {
        kind: Kind::Replayer,
        strict: false,
    },
    Mech {
        kind: Kind::RawSendto,
        strict: false,
    },
    Mech {
        kind: Kind::RawSendmmsg,
        strict: false,
    },
    Mech {
        kind: Kind::Tun,
        strict: false,
    },
    Mech {
        kind: Kind::Veth,
        strict: false,
    },
    Mech {
        kind: Kind::Replayer,
        strict: true,
    },
    Mech {
        kind: Kind::Tun,
        strict: true,
    },
];

impl Mech {
    fn name(self, batch: usize) -> String {
        let base = match self.kind {
            Kind::Replayer => "raw socket (ferry Replayer)".to_owned(),
            Kind::RawSendto => "raw socket, sendto".to_owned(),
            Kind::RawSendmmsg => format!("raw socket, sendmmsg x{batch}"),
            Kind::Tun => "TUN write".to_owned(),
            Kind::Veth => "veth peer (AF_PACKET; wire reference)".to_owned(),
        };
        if self.strict {
            base + " [rp_filter=1]"
        } else {
            base
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proto {
    Udp,
    Tcp,
}

impl Proto {
    fn name(self) -> &'static str {
        match self {
            Proto::Udp => "UDP",
            Proto::Tcp => "TCP",
        }
    }
}

/// One run of one mechanism with one protocol.
#[derive(Debug, Clone)]
struct Sample {
    mech: Mech,
    proto: Proto,
    run: usize,
    packets: usize,
    /// Read back intact by the receiver.
    delivered: usize,
    /// Microseconds per packet until everything delivered had arrived.
    us_per_packet: f64,
    /// Not yet at the receiver when the send loop returned.
    late_at_return: usize,
    /// UDP datagrams read after one with a higher sequence number.
    reordered: usize,
    /// The ingress interface `IP_PKTINFO` reported (UDP).
    iif: String,
    /// Error and drop counters that grew during the run.
    drops: String,
}

const CSV_HEADER: &str = "mechanism,proto,run,packets,delivered,us_per_packet,late_at_return,reordered,iif,drop_counters";

impl Sample {
    fn csv(&self, batch: usize) -> String {
        format!(
            "\"{}\",{},{},{},{},{:.3},{},{},{},\"{}\"",
            self.mech.name(batch),
            self.proto.name(),
            self.run,
            self.packets,
            self.delivered,
            self.us_per_packet,
            self.late_at_return,
            self.reordered,
            self.iif,
            self.drops
        )
    }
}

/// The hook counts of one path in the hook check.
#[derive(Debug, Clone)]
struct HookRow {
    path: String,
    packets: usize,
    delivered: usize,
    iif: String,
    /// tcx ingress runs on `brpub`, `lo`, `brtun`.
    tc: [u64; 3],
    /// Netfilter IPv4 PRE_ROUTING, LOCAL_IN, LOCAL_OUT, POST_ROUTING runs.
    nf: [u64; 4],
    /// A socket bound to `brpub` with SO_BINDTODEVICE received the probe.
    bound_sees: bool,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if let Some(reason) = ferry_integration::skip_reason() {
        eprintln!("bench replay needs {reason}");
        return std::process::ExitCode::FAILURE;
    }
    match bench(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench replay failed: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn bench(args: &Args) -> Result<()> {
    if args.packets == 0 || args.runs == 0 || args.conns == 0 || args.batch == 0 {
        bail!("--packets, --runs, --conns and --batch must be at least 1");
    }
    let per_conn = args.packets.div_ceil(args.conns) * PAYLOAD;
    if per_conn > TCP_WINDOW as usize / 2 {
        bail!(
            "{} packets over {} connections is {per_conn} bytes per connection, more than \
             the receive window allows: raise --conns",
            args.packets,
            args.conns
        );
    }
    let mut ns = NetNs::create(&format!(
        "{}{}-br",
        ferry_integration::reap::NETNS_PREFIX,
        std::process::id()
    ))?;
    setup(&ns).context("setting up the namespace")?;
    let path = ns.path();
    let (samples, hooks) = run_in(&path, || -> Result<(Vec<Sample>, Vec<HookRow>)> {
        let mut lab = Lab::open(&path, args)?;
        let samples = lab.measure_all(args)?;
        let hooks = lab.hook_check(args.hook_packets)?;
        Ok((samples, hooks))
    })??;
    ns.delete()?;

    let report = tables(&samples, &hooks, args);
    println!("\n{report}");
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut csv = CSV_HEADER.to_owned() + "\n";
    for s in &samples {
        csv += &(s.csv(args.batch) + "\n");
    }
    std::fs::write(args.out.join("replay.csv"), csv)?;
    std::fs::write(args.out.join("replay.md"), &report)?;
    println!("written: {0}/replay.csv, {0}/replay.md", args.out.display());
    Ok(())
}
