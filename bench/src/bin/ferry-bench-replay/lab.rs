//! The bench's namespace: its interfaces, receivers and counters.

use super::*;

/// Devices, addresses, routes and sysctls of the namespace (the TUN device
/// is made by [`Lab::open`], inside it).
pub(crate) fn setup(ns: &NetNs) -> Result<()> {
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
pub(crate) struct Lab {
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
    pub(crate) fn open(ns_path: &Path, args: &Args) -> Result<Self> {
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

    pub(crate) fn iface_name(&self, index: u32) -> String {
        self.ifaces
            .iter()
            .find(|(i, _)| *i == index)
            .map(|(_, n)| (*n).to_owned())
            .unwrap_or_else(|| format!("ifindex {index}"))
    }

    /// Run 0 is a warm-up; mechanisms and protocols are interleaved
    /// within each run so that drift spreads over all of them.
    pub(crate) fn measure_all(&mut self, args: &Args) -> Result<Vec<Sample>> {
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

    pub(crate) fn measure(
        &mut self,
        mech: Mech,
        proto: Proto,
        run: usize,
        n: usize,
    ) -> Result<Sample> {
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
    pub(crate) fn send(
        &mut self,
        kind: Kind,
        packets: &[Vec<u8>],
        frames: &[Vec<u8>],
    ) -> Result<()> {
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
    pub(crate) fn drain_udp(&self) -> Result<UdpDrain> {
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
    pub(crate) fn hook_check(&mut self, n: usize) -> Result<Vec<HookRow>> {
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
pub(crate) struct UdpDrain {
    datagrams: Vec<Vec<u8>>,
    reordered: usize,
    iif: Option<u32>,
}

impl UdpDrain {
    /// How many of the datagrams `base..base + n` arrived intact (each
    /// counted once); anything else in the queue is an error.
    pub(crate) fn check(&self, base: u64, n: usize) -> Result<usize> {
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
pub(crate) struct RpFilter(bool);

pub(crate) const RP_FILTER_ALL: &str = "/proc/sys/net/ipv4/conf/all/rp_filter";

impl RpFilter {
    pub(crate) fn set(strict: bool) -> Result<Self> {
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
pub(crate) fn drop_counters(delta: &Nstat) -> String {
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
pub(crate) fn ip_in_delivers() -> Result<u64> {
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

pub(crate) fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_else(|_| "?".into())
}
