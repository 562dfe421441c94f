//! The tables and medians the bench prints and writes.

use super::*;

pub(crate) fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

pub(crate) fn tables(samples: &[Sample], hooks: &[HookRow], args: &Args) -> String {
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
