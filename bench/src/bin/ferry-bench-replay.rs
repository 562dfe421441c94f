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

/// Devices, addresses, routes and sysctls of the namespace (the TUN device
/// is made by [`Lab::open`], inside it).
fn setup(ns: &NetNs) -> Result<()> {
    let path = ns.path();
    // No IPv6: nothing but the benchmark's packets crosses the hooks.
    set_sysctl(&path, "net.ipv6.conf.all.disable_ipv6", "1")?;
    set_sysctl(&path, "net.ipv6.conf.default.disable_ipv6", "1")?;
    // Explicit, whatever the host's defaults: no reverse-path filtering
    // except in the runs that ask for it.
    set_sysctl(&path, "net.ipv4.conf.all.rp_filter", "0")?;
    set_sysctl(&path, "net.ipv4.conf.default.rp_filter", "0")?;
    let mac = |m: [u8; 6]| {
        m.iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":")
    };
    cmd::ip_batch(
        Some(ns.name()),
        &[
            "link set lo up".into(),
            format!(
                "link add {PUB} address {} type veth peer name {PEER} address {}",
                mac(PUB_MAC),
                mac(PEER_MAC)
            ),
            format!("addr add {TARGET}/24 dev {PUB}"),
            format!("link set {PUB} up"),
            format!("link set {PEER} up"),
            format!("route add 198.18.243.0/24 dev {PUB}"),
            format!("neigh add {CLIENT} lladdr {CLIENT_MAC} dev {PUB} nud permanent"),
        ],
    )?;
    Ok(())
}

/// The senders and receivers, all created inside the namespace.
struct Lab {
    ns_path: PathBuf,
    replayer: Replayer,
    raw: OwnedFd,
    tun: OwnedFd,
    packet: OwnedFd,
    peer_ifindex: i32,
    udp: OwnedFd,
    ifaces: Vec<(u32, &'static str)>,
    batch: usize,
    conns: usize,
    next_seq: u64,
    next_port: u16,
}

impl Lab {
    /// Must run on a thread inside the namespace.
    fn open(ns_path: &Path, args: &Args) -> Result<Self> {
        let ns_name = ns_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let replayer = Replayer::new()?;
        let raw = raw_socket(libc::AF_INET, libc::IPPROTO_RAW).context("raw IP socket")?;
        let packet = raw_socket(libc::AF_PACKET, 0).context("packet socket")?;
        let tun = open_tun(TUN).context("creating the TUN device")?;
        cmd::ip(["-n", &ns_name, "link", "set", TUN, "up"])?;

        let udp = socket::socket(
            AddressFamily::Inet,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        // Room for every datagram of a run: the receiver only reads after.
        socket::setsockopt(&udp, sockopt::RcvBufForce, &(256 << 20))?;
        socket::setsockopt(&udp, sockopt::Ipv4PacketInfo, &true)?;
        socket::bind(
            udp.as_raw_fd(),
            &SockaddrIn::from(SocketAddrV4::new(TARGET, UDP_PORT)),
        )?;

        let index = |name: &str| {
            nix::net::if_::if_nametoindex(name).with_context(|| format!("ifindex of {name}"))
        };
        let ifaces = vec![(index(PUB)?, PUB), (index("lo")?, "lo"), (index(TUN)?, TUN)];
        let peer_ifindex = index(PEER)? as i32;
        Ok(Self {
            ns_path: ns_path.to_owned(),
            replayer,
            raw,
            tun,
            packet,
            peer_ifindex,
            udp,
            ifaces,
            batch: args.batch,
            conns: args.conns,
            next_seq: 0,
            next_port: 20_000,
        })
    }

    fn iface_name(&self, index: u32) -> String {
        self.ifaces
            .iter()
            .find(|(i, _)| *i == index)
            .map(|(_, n)| (*n).to_owned())
            .unwrap_or_else(|| format!("ifindex {index}"))
    }

    /// Run 0 is a warm-up; mechanisms and protocols are interleaved
    /// within each run so that drift spreads over all of them.
    fn measure_all(&mut self, args: &Args) -> Result<Vec<Sample>> {
        println!(
            "bench replay: {} packets per run, {} runs (+1 warm-up), TCP over {} connections, \
             sendmmsg batches of {}; kernel {}, {} CPUs\n",
            args.packets,
            args.runs,
            args.conns,
            args.batch,
            kernel_release(),
            std::thread::available_parallelism().map_or(0, |n| n.get()),
        );
        println!("run\tproto\tdelivered\tus/pkt\tlate\tmechanism");
        let mut samples = Vec::new();
        for run in 0..=args.runs {
            for mech in MECHS {
                for proto in [Proto::Udp, Proto::Tcp] {
                    let s = self
                        .measure(mech, proto, run, args.packets)
                        .with_context(|| {
                            format!("{} {} run {run}", mech.name(self.batch), proto.name())
                        })?;
                    println!(
                        "{}{run}\t{}\t{}/{}\t{:.3}\t{}\t{}{}",
                        if run == 0 { "w" } else { "" },
                        proto.name(),
                        s.delivered,
                        s.packets,
                        s.us_per_packet,
                        s.late_at_return,
                        mech.name(self.batch),
                        if s.drops.is_empty() {
                            String::new()
                        } else {
                            format!("  [{}]", s.drops)
                        }
                    );
                    if run > 0 {
                        samples.push(s);
                    }
                }
            }
        }
        Ok(samples)
    }

    fn measure(&mut self, mech: Mech, proto: Proto, run: usize, n: usize) -> Result<Sample> {
        self.drain_udp()?; // nothing left over from an earlier run
        let conns = match proto {
            Proto::Udp => Vec::new(),
            Proto::Tcp => (0..self.conns)
                .map(|i| {
                    let port = self.next_port;
                    self.next_port = if port == 60_000 { 20_000 } else { port + 1 };
                    repair_connection(
                        port,
                        0x1000_0000u32.wrapping_mul(i as u32 + 1),
                        0x0100_0000u32.wrapping_mul(i as u32),
                    )
                })
                .collect::<Result<_>>()?,
        };
        let base = self.next_seq;
        self.next_seq += n as u64;
        let packets: Vec<Vec<u8>> = (0..n)
            .map(|k| match proto {
                Proto::Udp => udp_packet(base + k as u64, k),
                Proto::Tcp => {
                    let c = &conns[k % conns.len()];
                    tcp_packet(c, k % conns.len(), k / conns.len(), k)
                }
            })
            .collect();
        let frames: Vec<Vec<u8>> = if mech.kind == Kind::Veth {
            packets.iter().map(|p| ether_frame(p)).collect()
        } else {
            Vec::new()
        };

        let before = Nstat::read(&self.ns_path)?;
        let udp_before = ip_in_delivers()?;
        let arrived = || -> Result<usize> {
            Ok(match proto {
                Proto::Udp => (ip_in_delivers()? - udp_before) as usize,
                Proto::Tcp => conns.iter().map(|c| queued(&c.fd)).sum::<Result<usize>>()? / PAYLOAD,
            })
        };
        let strict = RpFilter::set(mech.strict)?;
        let t0 = Instant::now();
        self.send(mech.kind, &packets, &frames)?;
        let sent = t0.elapsed();
        let at_return = arrived()?;
        let mut elapsed = sent;
        if at_return < n {
            // Still in flight (or dropped): keep the clock running until
            // everything is there or nothing more comes.
            loop {
                let now = arrived()?;
                if now >= n {
                    elapsed = t0.elapsed();
                    break;
                }
                if t0.elapsed() > sent + SETTLE {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        drop(strict);
        let after = Nstat::read(&self.ns_path)?;

        let (delivered, reordered, iif) = match proto {
            Proto::Udp => {
                let r = self.drain_udp()?;
                let delivered = r.check(base, n)?;
                (delivered, r.reordered, r.iif.map(|i| self.iface_name(i)))
            }
            Proto::Tcp => (verify_tcp(&conns, n)?, 0, None),
        };
        for c in conns {
            c.abort();
        }
        Ok(Sample {
            mech,
            proto,
            run,
            packets: n,
            delivered,
            us_per_packet: elapsed.as_secs_f64() * 1e6 / n as f64,
            late_at_return: n.saturating_sub(at_return),
            reordered,
            iif: iif.unwrap_or_else(|| "-".into()),
            drops: drop_counters(&after.since(&before)),
        })
    }

    /// Hands every packet to the stack through `kind`.
    fn send(&mut self, kind: Kind, packets: &[Vec<u8>], frames: &[Vec<u8>]) -> Result<()> {
        match kind {
            Kind::Replayer => {
                for p in packets {
                    self.replayer.replay(p)?;
                }
            }
            Kind::RawSendto => {
                for p in packets {
                    let dst = SockaddrIn::from(SocketAddrV4::new(dst_of(p), 0));
                    let n = socket::sendto(self.raw.as_raw_fd(), p, &dst, MsgFlags::empty())?;
                    ensure!(n == p.len(), "short sendto: {n} of {}", p.len());
                }
            }
            Kind::RawSendmmsg => send_mmsg(&self.raw, packets, self.batch)?,
            Kind::Tun => {
                for p in packets {
                    let n = nix::unistd::write(&self.tun, p)?;
                    ensure!(
                        n == p.len(),
                        "short write to the TUN device: {n} of {}",
                        p.len()
                    );
                }
            }
            Kind::Veth => {
                for f in frames {
                    send_frame(&self.packet, self.peer_ifindex, f)?;
                }
            }
        }
        Ok(())
    }

    /// Reads every queued datagram.
    fn drain_udp(&self) -> Result<UdpDrain> {
        let mut r = UdpDrain::default();
        let mut buf = [0u8; 2048];
        let mut cmsg = nix::cmsg_space!(libc::in_pktinfo);
        loop {
            let mut iov = [IoSliceMut::new(&mut buf)];
            let msg = match socket::recvmsg::<SockaddrIn>(
                self.udp.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_DONTWAIT,
            ) {
                Ok(m) => m,
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => return Err(e).context("reading the UDP socket"),
            };
            let len = msg.bytes;
            let mut iif = None;
            for c in msg.cmsgs()? {
                if let ControlMessageOwned::Ipv4PacketInfo(info) = c {
                    iif = Some(info.ipi_ifindex as u32);
                }
            }
            r.iif = r.iif.or(iif);
            r.datagrams.push(buf[..len].to_vec());
        }
        let mut last = None;
        for d in &r.datagrams {
            let seq = d
                .get(..8)
                .map(|s| u64::from_be_bytes(s.try_into().unwrap()));
            if let (Some(s), Some(l)) = (seq, last)
                && s < l
            {
                r.reordered += 1;
            }
            last = seq.or(last);
        }
        Ok(r)
    }

    /// Which hooks each path passes: tcx ingress of every interface and
    /// the IPv4 netfilter hooks, counted by do-nothing eBPF programs.
    fn hook_check(&mut self, n: usize) -> Result<Vec<HookRow>> {
        let _stats = bpf::enable_stats().context("BPF_ENABLE_STATS")?;
        let nf_progs = (0..4)
            .map(|_| bpf::load_counter(bpf::PROG_TYPE_NETFILTER, bpf::ATTACH_NETFILTER, 1))
            .collect::<Result<Vec<_>>>()
            .context("loading the netfilter counters")?;
        // One program per attach point, so each has its own run count.
        let tc_progs = self
            .ifaces
            .iter()
            .map(|_| bpf::load_counter(bpf::PROG_TYPE_SCHED_CLS, bpf::ATTACH_TCX_INGRESS, -1))
            .collect::<Result<Vec<_>>>()
            .context("loading the tcx counters")?;
        let mut links = Vec::new();
        for (p, (ifindex, name)) in tc_progs.iter().zip(&self.ifaces) {
            links.push(
                bpf::attach_tcx(p, *ifindex)
                    .with_context(|| format!("attaching tcx ingress on {name}"))?,
            );
        }
        for (p, hook) in nf_progs.iter().zip(bpf::NF_HOOKS) {
            links.push(
                bpf::attach_netfilter(p, hook)
                    .with_context(|| format!("attaching netfilter hook {hook}"))?,
            );
        }
        let counts = || -> Result<([u64; 3], [u64; 4])> {
            let mut tc = [0; 3];
            for (c, p) in tc.iter_mut().zip(&tc_progs) {
                *c = bpf::run_count(p)?;
            }
            let mut nf = [0; 4];
            for (c, p) in nf.iter_mut().zip(&nf_progs) {
                *c = bpf::run_count(p)?;
            }
            Ok((tc, nf))
        };
        // Does a socket bound to the public interface (SO_BINDTODEVICE)
        // see a replayed datagram? Probed after the counts are read: a
        // datagram nobody takes makes an ICMP error, which crosses hooks.
        let bound = socket::socket(
            AddressFamily::Inet,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        socket::setsockopt(
            &bound,
            sockopt::BindToDevice,
            &std::ffi::OsString::from(PUB),
        )?;
        socket::bind(
            bound.as_raw_fd(),
            &SockaddrIn::from(SocketAddrV4::new(TARGET, BOUND_PORT)),
        )?;
        let mut rows = Vec::new();
        for kind in [Kind::Replayer, Kind::Tun, Kind::Veth] {
            self.drain_udp()?;
            let base = self.next_seq;
            self.next_seq += n as u64;
            let packets: Vec<Vec<u8>> = (0..n).map(|k| udp_packet(base + k as u64, k)).collect();
            let frames: Vec<Vec<u8>> = packets.iter().map(|p| ether_frame(p)).collect();
            let (tc0, nf0) = counts()?;
            self.send(kind, &packets, &frames)?;
            std::thread::sleep(Duration::from_millis(50));
            let (tc1, nf1) = counts()?;
            let r = self.drain_udp()?;
            let delivered = r.check(base, n)?;

            let probe = [udp_packet_to(BOUND_PORT, u64::MAX, 0)];
            let probe_frame = [ether_frame(&probe[0])];
            self.send(kind, &probe, &probe_frame)?;
            std::thread::sleep(Duration::from_millis(20));
            let mut buf = [0u8; 2048];
            let bound_sees = match socket::recv(bound.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT)
            {
                Ok(_) => true,
                Err(nix::errno::Errno::EAGAIN) => false,
                Err(e) => return Err(e).context("reading the device-bound socket"),
            };
            rows.push(HookRow {
                bound_sees,
                path: Mech {
                    kind,
                    strict: false,
                }
                .name(self.batch),
                packets: n,
                delivered,
                iif: r.iif.map_or_else(|| "-".into(), |i| self.iface_name(i)),
                tc: std::array::from_fn(|i| tc1[i] - tc0[i]),
                nf: std::array::from_fn(|i| nf1[i] - nf0[i]),
            });
        }
        drop(links);
        Ok(rows)
    }
}

#[derive(Debug, Default)]
struct UdpDrain {
    datagrams: Vec<Vec<u8>>,
    reordered: usize,
    iif: Option<u32>,
}

impl UdpDrain {
    /// How many of the datagrams `base..base + n` arrived intact (each
    /// counted once); anything else in the queue is an error.
    fn check(&self, base: u64, n: usize) -> Result<usize> {
        let mut seen = vec![false; n];
        for d in &self.datagrams {
            ensure!(d.len() == PAYLOAD, "a {}-byte datagram", d.len());
            let seq = u64::from_be_bytes(d[..8].try_into().unwrap());
            ensure!(
                seq >= base && seq < base + n as u64,
                "datagram {seq} outside this run ({base}..{})",
                base + n as u64
            );
            ensure!(
                d[..] == payload(seq)[..],
                "datagram {seq}: payload corrupted"
            );
            seen[(seq - base) as usize] = true;
        }
        Ok(seen.iter().filter(|s| **s).count())
    }
}

/// Sets `net.ipv4.conf.all.rp_filter` (of the calling thread's namespace)
/// to 1 while alive, if asked; back to 0 on drop.
struct RpFilter(bool);

const RP_FILTER_ALL: &str = "/proc/sys/net/ipv4/conf/all/rp_filter";

impl RpFilter {
    fn set(strict: bool) -> Result<Self> {
        if strict {
            std::fs::write(RP_FILTER_ALL, "1").context("setting rp_filter")?;
        }
        Ok(Self(strict))
    }
}

impl Drop for RpFilter {
    fn drop(&mut self) {
        if self.0
            && let Err(e) = std::fs::write(RP_FILTER_ALL, "0")
        {
            eprintln!("bench replay: resetting rp_filter: {e}");
        }
    }
}

/// The error and drop counters among `delta`, as `Name=n` pairs.
fn drop_counters(delta: &Nstat) -> String {
    const MARKS: [&str; 8] = [
        "Err",
        "Drop",
        "Discard",
        "ReversePath",
        "Csum",
        "Prune",
        "PAWS",
        "NoPorts",
    ];
    delta
        .0
        .iter()
        .filter(|(k, _)| MARKS.iter().any(|m| k.contains(m)))
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `Ip: InDelivers` of the calling thread's namespace: packets handed to
/// a transport protocol, counted in the same softirq that queues a UDP
/// datagram on its socket (`UdpInDatagrams` would only count at recvmsg).
/// In a UDP run nothing else is delivered in the namespace.
fn ip_in_delivers() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/net/snmp")?;
    let mut lines = text.lines().filter(|l| l.starts_with("Ip:"));
    let (Some(names), Some(values)) = (lines.next(), lines.next()) else {
        bail!("no Ip lines in /proc/thread-self/net/snmp");
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "InDelivers")
        .and_then(|(_, v)| v.parse().ok())
        .context("no Ip InDelivers")
}

fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_else(|_| "?".into())
}

// ---------------------------------------------------------------- packets

/// The 256-byte payload tagged `tag`: the tag, then bytes that depend on it.
fn payload(tag: u64) -> [u8; PAYLOAD] {
    let mut p = [0u8; PAYLOAD];
    p[..8].copy_from_slice(&tag.to_be_bytes());
    for (i, b) in p[8..].iter_mut().enumerate() {
        *b = (tag as u8).wrapping_mul(31).wrapping_add(i as u8);
    }
    p
}

/// Sums big-endian 16-bit words (odd last byte padded with zero).
fn sum_words(mut sum: u32, bytes: &[u8]) -> u32 {
    let mut chunks = bytes.chunks_exact(2);
    for w in &mut chunks {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    sum
}

fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 packet CLIENT -> TARGET around `l4`, whose checksum (at
/// `csum_at` within it) is filled in, as is the header's.
fn ipv4(id: u16, proto: u8, mut l4: Vec<u8>, csum_at: usize) -> Vec<u8> {
    let total = 20 + l4.len();
    let mut p = Vec::with_capacity(total);
    p.extend_from_slice(&[0x45, 0]);
    p.extend_from_slice(&(total as u16).to_be_bytes());
    p.extend_from_slice(&id.to_be_bytes());
    p.extend_from_slice(&[0x40, 0, 64, proto, 0, 0]); // DF, TTL 64
    p.extend_from_slice(&CLIENT.octets());
    p.extend_from_slice(&TARGET.octets());
    let h = fold(sum_words(0, &p));
    p[10..12].copy_from_slice(&h.to_be_bytes());
    let mut sum = sum_words(0, &p[12..20]) + u32::from(proto) + l4.len() as u32;
    sum = sum_words(sum, &l4);
    let mut c = fold(sum);
    if c == 0 && proto == 17 {
        c = 0xffff;
    }
    l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
    p.extend_from_slice(&l4);
    p
}

/// Datagram `seq` of a UDP player at 198.18.243.7 (16 source ports).
fn udp_packet(seq: u64, k: usize) -> Vec<u8> {
    udp_packet_to(UDP_PORT, seq, k)
}

fn udp_packet_to(port: u16, seq: u64, k: usize) -> Vec<u8> {
    let mut l4 = Vec::with_capacity(8 + PAYLOAD);
    l4.extend_from_slice(&(40_000 + (k % 16) as u16).to_be_bytes());
    l4.extend_from_slice(&port.to_be_bytes());
    l4.extend_from_slice(&((8 + PAYLOAD) as u16).to_be_bytes());
    l4.extend_from_slice(&[0, 0]);
    l4.extend_from_slice(&payload(seq));
    ipv4(k as u16, 17, l4, 6)
}

/// Data segment `seg` (256 bytes) of connection `conn`: in window, in
/// order, acknowledging everything the server has sent (nothing).
fn tcp_packet(c: &RepairedConn, conn: usize, seg: usize, k: usize) -> Vec<u8> {
    let mut l4 = Vec::with_capacity(20 + PAYLOAD);
    l4.extend_from_slice(&c.peer_port.to_be_bytes());
    l4.extend_from_slice(&TCP_PORT.to_be_bytes());
    l4.extend_from_slice(&(c.rcv_nxt.wrapping_add((seg * PAYLOAD) as u32)).to_be_bytes());
    l4.extend_from_slice(&c.snd_nxt.to_be_bytes());
    l4.extend_from_slice(&[5 << 4, 0x18]); // no options; PSH | ACK
    l4.extend_from_slice(&0xffffu16.to_be_bytes());
    l4.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
    l4.extend_from_slice(&payload(tcp_tag(conn, seg)));
    ipv4(k as u16, 6, l4, 16)
}

fn tcp_tag(conn: usize, seg: usize) -> u64 {
    ((conn as u64) << 32) | seg as u64
}

fn dst_of(p: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(p[16], p[17], p[18], p[19])
}

/// `p` in an Ethernet frame from `brpeer` to `brpub`.
fn ether_frame(p: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + p.len());
    f.extend_from_slice(&PUB_MAC);
    f.extend_from_slice(&PEER_MAC);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    f.extend_from_slice(p);
    f
}

// ---------------------------------------------------------------- sockets

fn raw_socket(family: libc::c_int, protocol: libc::c_int) -> std::io::Result<OwnedFd> {
    // SAFETY: socket(2) takes plain integers and returns a new descriptor
    // or -1.
    let fd = unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Creates the TUN device `name` in the calling thread's namespace; it
/// disappears with the descriptor.
fn open_tun(name: &str) -> Result<OwnedFd> {
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .context("opening /dev/net/tun")?;
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes a struct ifreq, which IfReq lays
    // out (name, the flags union member, padding to 40 bytes); it lives
    // for the whole call.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("TUNSETIFF");
    }
    Ok(OwnedFd::from(file))
}

fn setsockopt_raw<T>(fd: RawFd, level: libc::c_int, name: libc::c_int, value: &T) -> Result<()> {
    // SAFETY: value points to a live T of the length given; the kernel
    // only reads it.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("setsockopt({level}, {name})"));
    }
    Ok(())
}

/// Bytes readable on a stream socket.
fn queued(fd: &OwnedFd) -> Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int, n, which outlives the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut n) };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("FIONREAD");
    }
    Ok(n as usize)
}

/// Sends the Ethernet frame `f` on the interface `ifindex`.
fn send_frame(fd: &OwnedFd, ifindex: i32, f: &[u8]) -> Result<()> {
    let mut to = libc::sockaddr_ll {
        sll_family: libc::AF_PACKET as u16,
        sll_protocol: (libc::ETH_P_IP as u16).to_be(),
        sll_ifindex: ifindex,
        sll_hatype: 0,
        sll_pkttype: 0,
        sll_halen: 6,
        sll_addr: [0; 8],
    };
    to.sll_addr[..6].copy_from_slice(&PUB_MAC);
    // SAFETY: f and to are valid for the lengths given during the call;
    // the kernel only reads them.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            f.as_ptr().cast(),
            f.len(),
            0,
            (&to as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error()).context("sending on the veth peer");
    }
    ensure!(
        n as usize == f.len(),
        "short send on {PEER}: {n} of {}",
        f.len()
    );
    Ok(())
}

/// Raw-socket sends in batches of `batch` through sendmmsg(2).
fn send_mmsg(fd: &OwnedFd, packets: &[Vec<u8>], batch: usize) -> Result<()> {
    let mut addrs: Vec<libc::sockaddr_in> = Vec::with_capacity(batch);
    let mut iovs: Vec<libc::iovec> = Vec::with_capacity(batch);
    let mut msgs: Vec<libc::mmsghdr> = Vec::with_capacity(batch);
    for chunk in packets.chunks(batch) {
        addrs.clear();
        iovs.clear();
        msgs.clear();
        for p in chunk {
            addrs.push(libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: 0,
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(dst_of(p).octets()),
                },
                sin_zero: [0; 8],
            });
            iovs.push(libc::iovec {
                iov_base: p.as_ptr() as *mut libc::c_void,
                iov_len: p.len(),
            });
        }
        for i in 0..chunk.len() {
            // SAFETY: mmsghdr is plain data for which all-zero is valid.
            let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
            m.msg_hdr.msg_name = (&mut addrs[i] as *mut libc::sockaddr_in).cast();
            m.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            m.msg_hdr.msg_iov = &mut iovs[i];
            m.msg_hdr.msg_iovlen = 1;
            msgs.push(m);
        }
        let mut done = 0;
        while done < msgs.len() {
            // SAFETY: every header points into addrs, iovs and packets,
            // which are neither moved nor freed until the loop ends; the
            // kernel only reads them (and writes msg_len).
            let r = unsafe {
                libc::sendmmsg(
                    fd.as_raw_fd(),
                    msgs[done..].as_mut_ptr(),
                    (msgs.len() - done) as libc::c_uint,
                    0,
                )
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error()).context("sendmmsg");
            }
            done += r as usize;
        }
    }
    Ok(())
}

/// A server-side connection 198.18.240.1:7004 <-> 198.18.243.7:port made
/// established with TCP_REPAIR, as CRIU restores one.
struct RepairedConn {
    fd: OwnedFd,
    peer_port: u16,
    /// The next sequence number the server expects.
    rcv_nxt: u32,
    /// The server's next sequence number (nothing sent yet).
    snd_nxt: u32,
}

#[repr(C)]
struct TcpRepairOpt {
    code: u32,
    val: u32,
}

#[repr(C)]
struct TcpRepairWindow {
    snd_wl1: u32,
    snd_wnd: u32,
    max_window: u32,
    rcv_wnd: u32,
    rcv_wup: u32,
}

fn repair_connection(peer_port: u16, snd_nxt: u32, rcv_nxt: u32) -> Result<RepairedConn> {
    const TCP_RECV_QUEUE: libc::c_int = 1;
    const TCP_SEND_QUEUE: libc::c_int = 2;
    const TCPOPT_MAXSEG: u32 = 2;
    const TCPOPT_WINDOW: u32 = 3;
    const TCP_REPAIR_OFF_NO_WP: libc::c_int = -1;
    let fd = socket::socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let raw = fd.as_raw_fd();
    // The whole run fits in the buffer: nobody reads until it is over.
    socket::setsockopt(&fd, sockopt::RcvBufForce, &(32 << 20))?;
    socket::setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_REPAIR, &1 as &libc::c_int)?;
    socket::bind(raw, &SockaddrIn::from(SocketAddrV4::new(TARGET, TCP_PORT)))?;
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_REPAIR_QUEUE, &TCP_SEND_QUEUE)?;
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_QUEUE_SEQ, &snd_nxt)?;
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_REPAIR_QUEUE, &TCP_RECV_QUEUE)?;
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_QUEUE_SEQ, &rcv_nxt)?;
    socket::connect(raw, &SockaddrIn::from(SocketAddrV4::new(CLIENT, peer_port)))
        .context("repair-mode connect")?;
    let opts = [
        TcpRepairOpt {
            code: TCPOPT_MAXSEG,
            val: 1460,
        },
        TcpRepairOpt {
            code: TCPOPT_WINDOW,
            val: 7 | (7 << 16),
        },
    ];
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_REPAIR_OPTIONS, &opts)?;
    let window = TcpRepairWindow {
        snd_wl1: rcv_nxt,
        snd_wnd: 0xffff << 7,
        max_window: 0xffff << 7,
        rcv_wnd: TCP_WINDOW,
        rcv_wup: rcv_nxt,
    };
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_REPAIR_WINDOW, &window)?;
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_REPAIR, &TCP_REPAIR_OFF_NO_WP)?;
    Ok(RepairedConn {
        fd,
        peer_port,
        rcv_nxt,
        snd_nxt,
    })
}

impl RepairedConn {
    /// Closes with a RST (SO_LINGER 0): nothing lingers between runs.
    fn abort(self) {
        let _ = socket::setsockopt(
            &self.fd,
            sockopt::Linger,
            &libc::linger {
                l_onoff: 1,
                l_linger: 0,
            },
        );
    }
}

/// Reads every connection and counts the segments that arrived intact
/// and in order (`n` were sent, round-robin over the connections).
fn verify_tcp(conns: &[RepairedConn], n: usize) -> Result<usize> {
    let mut delivered = 0;
    for (i, c) in conns.iter().enumerate() {
        let segs = n / conns.len() + usize::from(i < n % conns.len());
        let mut data = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match socket::recv(c.fd.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
                Ok(0) => break,
                Ok(r) => data.extend_from_slice(&buf[..r]),
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => return Err(e).with_context(|| format!("reading connection {i}")),
            }
        }
        ensure!(
            data.len() % PAYLOAD == 0 && data.len() / PAYLOAD <= segs,
            "connection {i}: {} bytes for {segs} segments",
            data.len()
        );
        for (seg, chunk) in data.chunks(PAYLOAD).enumerate() {
            ensure!(
                chunk == payload(tcp_tag(i, seg)),
                "connection {i}, segment {seg}: data corrupted"
            );
        }
        delivered += data.len() / PAYLOAD;
    }
    Ok(delivered)
}

// ---------------------------------------------------------------- eBPF

/// Just enough of bpf(2) for counting programs: each returns a constant,
/// and the kernel's run statistics (`BPF_ENABLE_STATS`) count the calls.
mod bpf {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use anyhow::{Context, Result};

    pub const PROG_TYPE_SCHED_CLS: u32 = 3;
    pub const PROG_TYPE_NETFILTER: u32 = 32;
    pub const ATTACH_NETFILTER: u32 = 45;
    pub const ATTACH_TCX_INGRESS: u32 = 46;
    const CMD_PROG_LOAD: i32 = 5;
    const CMD_OBJ_GET_INFO_BY_FD: i32 = 15;
    const CMD_LINK_CREATE: i32 = 28;
    const CMD_ENABLE_STATS: i32 = 32;
    const NFPROTO_IPV4: u32 = 2;
    /// PRE_ROUTING, LOCAL_IN, LOCAL_OUT, POST_ROUTING.
    pub const NF_HOOKS: [u32; 4] = [0, 1, 3, 4];
    /// `struct bpf_prog_info`: its size and the offset of `run_cnt`.
    const PROG_INFO_LEN: usize = 232;
    const RUN_CNT_AT: usize = 200;

    /// A zeroed `union bpf_attr` (the prefix this file uses).
    struct Attr([u8; 152]);

    impl Attr {
        fn new() -> Self {
            Self([0; 152])
        }
        fn u32(&mut self, at: usize, v: u32) -> &mut Self {
            self.0[at..at + 4].copy_from_slice(&v.to_ne_bytes());
            self
        }
        fn u64(&mut self, at: usize, v: u64) -> &mut Self {
            self.0[at..at + 8].copy_from_slice(&v.to_ne_bytes());
            self
        }
        fn call(&mut self, cmd: i32) -> std::io::Result<i32> {
            // SAFETY: the attr buffer is valid for its length and every
            // pointer stored in it refers to memory the caller keeps alive
            // for the call.
            let r = unsafe {
                libc::syscall(libc::SYS_bpf, cmd, self.0.as_mut_ptr(), self.0.len() as u32)
            };
            if r < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(r as i32)
            }
        }
        fn fd(&mut self, cmd: i32) -> std::io::Result<OwnedFd> {
            let fd = self.call(cmd)?;
            // SAFETY: the kernel just returned this new descriptor.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }
    }

    /// Run-time statistics on until the descriptor is closed.
    pub fn enable_stats() -> Result<OwnedFd> {
        Ok(Attr::new().u32(0, 0).fd(CMD_ENABLE_STATS)?) // BPF_STATS_RUN_TIME
    }

    /// `r0 = ret; exit`.
    pub fn load_counter(prog_type: u32, attach: u32, ret: i32) -> Result<OwnedFd> {
        let insns: [u64; 2] = [0xb7 | (u64::from(ret as u32) << 32), 0x95];
        let license = b"GPL\0";
        let mut log = vec![0u8; 4096];
        let mut name = [0u8; 16];
        name[..11].copy_from_slice(b"ferry_br_ct");
        let mut a = Attr::new();
        a.u32(0, prog_type)
            .u32(4, insns.len() as u32)
            .u64(8, insns.as_ptr() as u64)
            .u64(16, license.as_ptr() as u64)
            .u32(24, 1)
            .u32(28, log.len() as u32)
            .u64(32, log.as_mut_ptr() as u64)
            .u32(68, attach);
        a.0[48..64].copy_from_slice(&name);
        a.fd(CMD_PROG_LOAD).with_context(|| {
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            format!(
                "BPF_PROG_LOAD (type {prog_type}): {}",
                String::from_utf8_lossy(&log[..end])
            )
        })
    }

    pub fn attach_tcx(prog: &OwnedFd, ifindex: u32) -> Result<OwnedFd> {
        Ok(Attr::new()
            .u32(0, prog.as_raw_fd() as u32)
            .u32(4, ifindex)
            .u32(8, ATTACH_TCX_INGRESS)
            .fd(CMD_LINK_CREATE)?)
    }

    /// In the calling thread's network namespace.
    pub fn attach_netfilter(prog: &OwnedFd, hook: u32) -> Result<OwnedFd> {
        Ok(Attr::new()
            .u32(0, prog.as_raw_fd() as u32)
            .u32(8, ATTACH_NETFILTER)
            .u32(16, NFPROTO_IPV4)
            .u32(20, hook)
            .u32(24, (-100i32) as u32)
            .fd(CMD_LINK_CREATE)?)
    }

    pub fn run_count(prog: &OwnedFd) -> Result<u64> {
        let mut info = [0u8; PROG_INFO_LEN];
        Attr::new()
            .u32(0, prog.as_raw_fd() as u32)
            .u32(4, PROG_INFO_LEN as u32)
            .u64(8, info.as_mut_ptr() as u64)
            .call(CMD_OBJ_GET_INFO_BY_FD)
            .context("BPF_OBJ_GET_INFO_BY_FD")?;
        Ok(u64::from_ne_bytes(
            info[RUN_CNT_AT..RUN_CNT_AT + 8].try_into().unwrap(),
        ))
    }
}

// ---------------------------------------------------------------- report

fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

fn tables(samples: &[Sample], hooks: &[HookRow], args: &Args) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "Replay into the local stack: {} packets per run (256-byte payloads; TCP spread over {} \
         connections), {} runs after a warm-up; kernel {}, {} CPUs. µs/packet is the wall time \
         until the last packet had reached its socket, divided by the packets; \"delivered\" \
         counts what was read back intact (worst run).\n",
        args.packets,
        args.conns,
        args.runs,
        kernel_release(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    let _ = writeln!(
        t,
        "| mechanism | proto | packets | delivered | µs/packet median | min | max | late at return (max) | reordered | ingress (IP_PKTINFO) | drop counters (a run) |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|---|---|---|");
    for mech in MECHS {
        for proto in [Proto::Udp, Proto::Tcp] {
            let rs: Vec<&Sample> = samples
                .iter()
                .filter(|s| s.mech == mech && s.proto == proto)
                .collect();
            if rs.is_empty() {
                continue;
            }
            let mut us: Vec<f64> = rs.iter().map(|s| s.us_per_packet).collect();
            us.sort_by(f64::total_cmp);
            let worst = rs.iter().map(|s| s.delivered).min().unwrap_or(0);
            let drops = rs
                .iter()
                .map(|s| s.drops.as_str())
                .find(|d| !d.is_empty())
                .unwrap_or("");
            let timing = if worst < args.packets {
                format!(
                    "(dropped) {:.3} | {:.3} | {:.3}",
                    median(&us),
                    us[0],
                    us[us.len() - 1]
                )
            } else {
                format!(
                    "{:.3} | {:.3} | {:.3}",
                    median(&us),
                    us[0],
                    us[us.len() - 1]
                )
            };
            let _ = writeln!(
                t,
                "| {} | {} | {} | {} | {timing} | {} | {} | {} | {} |",
                mech.name(args.batch),
                proto.name(),
                args.packets,
                worst,
                rs.iter().map(|s| s.late_at_return).max().unwrap_or(0),
                rs.iter().map(|s| s.reordered).max().unwrap_or(0),
                rs[0].iif,
                drops,
            );
        }
    }
    let _ = writeln!(
        t,
        "\nHook check: {} UDP datagrams per path; runs of do-nothing eBPF programs at tcx \
         ingress of each interface and at the IPv4 netfilter hooks (BPF netfilter links, \
         priority -100).\n",
        args.hook_packets
    );
    let _ = writeln!(
        t,
        "| path | delivered | ingress (IP_PKTINFO) | tc ingress {PUB} (public) | tc ingress lo | tc ingress {TUN} | nf PREROUTING | nf INPUT | nf OUTPUT | nf POSTROUTING | socket bound to {PUB} gets it |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|---|---|---|");
    for h in hooks {
        let _ = writeln!(
            t,
            "| {} | {}/{} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            h.path,
            h.delivered,
            h.packets,
            h.iif,
            h.tc[0],
            h.tc[1],
            h.tc[2],
            h.nf[0],
            h.nf[1],
            h.nf[2],
            h.nf[3],
            if h.bound_sees { "yes" } else { "no" },
        );
    }
    let _ = writeln!(
        t,
        "\nSet-up: one namespace; the public interface {PUB} (198.18.240.1/24) is a veth whose \
         peer {PEER} plays the wire; the clients (198.18.243.7) are routed via {PUB}; {TUN} has \
         no address. rp_filter is 0 (all, default, every device) except in the [rp_filter=1] \
         rows (net.ipv4.conf.all.rp_filter=1, namespace only); accept_local is never needed \
         (the sources are not local). TCP receivers are server sockets made established with \
         TCP_REPAIR (window scale 7, 4 MiB window, no timestamps), so their ACKs are part of \
         the TCP cost."
    );
    let _ = writeln!(
        t,
        "\nReproduce: `cargo xtask bench replay -- --packets {} --runs {} --conns {} --batch {}` (root).",
        args.packets, args.runs, args.conns, args.batch
    );
    t
}
