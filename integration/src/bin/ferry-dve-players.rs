//! `ferry-dve-players --server 198.18.0.100 --players 500 --duration-s 240
//! --report players.json`: the players of Gerofi et al. (DVE)'s virtual
//! environment, live. Each player has its own UDP socket, joins the zone it
//! stands in (`ferry_integration::dve`: zone z on port 30000 + z), and walks
//! by the simulator's drift model (`ferry_policy::sim::dve::Clients`: most
//! stand still, some of the middle rows walk to the up-left and down-right
//! corners over the run, time scaled to `--duration-s`). It measures the
//! gap between two updates of the zone it is in; gaps over the threshold
//! are kept with the time they ended, so that the experiment can tell
//! which a migration caused.
//!
//! Prints a line every `--stats-every-s` and writes the report (JSON) at
//! the end.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use ferry_integration::dve::{BASE_PORT, Message, PlayerView, PlayersReport};
use ferry_policy::sim::dve::{Clients, Params};

#[derive(Debug, Parser)]
#[command(
    name = "ferry-dve-players",
    about = "DVE players: join zone servers over UDP, drift over the map, measure update gaps"
)]
struct Args {
    /// The cluster's public address.
    #[arg(long)]
    server: Ipv4Addr,
    #[arg(long, default_value_t = 500)]
    players: usize,
    /// The run's length; the drift is scaled to it.
    #[arg(long, default_value_t = 240)]
    duration_s: u64,
    /// Seeds the players' positions and walks.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Every player stays in this zone (no drift).
    #[arg(long)]
    fixed_zone: Option<usize>,
    /// Gaps longer than this are reported one by one.
    #[arg(long, default_value_t = 100)]
    gap_threshold_ms: u64,
    #[arg(long, default_value_t = 5)]
    stats_every_s: u64,
    /// Where the report goes (JSON).
    #[arg(long)]
    report: PathBuf,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// One socket per player needs more descriptors than the default 1024.
fn raise_nofile(need: usize) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && (lim.rlim_cur as usize) < need {
            lim.rlim_cur = lim.rlim_max.max(need as libc::rlim_t);
            lim.rlim_max = lim.rlim_max.max(lim.rlim_cur);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry-dve-players: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> std::io::Result<()> {
    raise_nofile(args.players + 64);
    let params = Params {
        clients: args.players,
        duration: Duration::from_secs(args.duration_s),
        ..Params::default()
    };
    let clients = Clients::generate(&params, args.seed);
    let zones_at = |secs: f64| -> Vec<usize> {
        match args.fixed_zone {
            Some(z) => vec![z; args.players],
            None => clients.zones(secs),
        }
    };
    let server = |zone: usize| SocketAddrV4::new(args.server, BASE_PORT + zone as u16);
    let mut sockets = Vec::with_capacity(args.players);
    for _ in 0..args.players {
        let s = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
        s.set_nonblocking(true)?;
        sockets.push(s);
    }
    let mut views: Vec<PlayerView> = zones_at(0.0)
        .into_iter()
        .enumerate()
        .map(|(i, z)| PlayerView::new(i as u32, z))
        .collect();
    let join = |i: usize, zone: usize, sockets: &[UdpSocket]| {
        let m = Message::Join { player: i as u32 }.encode();
        let _ = sockets[i].send_to(&m, server(zone));
    };
    for (i, v) in views.iter().enumerate() {
        join(i, v.zone, &sockets);
    }
    let threshold = Duration::from_millis(args.gap_threshold_ms);
    let started = Instant::now();
    let end = started + Duration::from_secs(args.duration_s);
    let mut fds: Vec<libc::pollfd> = sockets
        .iter()
        .map(|s| libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let mut gaps = Vec::new();
    let (mut switches, mut updates) = (0u64, 0u64);
    let mut next_walk = started;
    let mut next_keepalive = started + Duration::from_secs(1);
    let mut next_stats = started + Duration::from_secs(args.stats_every_s);
    let (mut interval_updates, mut interval_longest) = (0u64, Duration::ZERO);
    let mut buf = [0u8; 128];
    while Instant::now() < end {
        // SAFETY: fds is a valid array of fds.len() pollfd structs.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 10) };
        let now = Instant::now();
        if n > 0 {
            for (i, fd) in fds.iter_mut().enumerate() {
                if fd.revents == 0 {
                    continue;
                }
                fd.revents = 0;
                while let Ok((len, _)) = sockets[i].recv_from(&mut buf) {
                    let Some(Message::Update { player, zone, seq }) = Message::decode(&buf[..len])
                    else {
                        continue;
                    };
                    if player as usize != i {
                        continue;
                    }
                    updates += 1;
                    interval_updates += 1;
                    if let Some(gap) =
                        views[i].update(zone as usize, seq, now, unix_ms(), threshold)
                    {
                        gaps.push(gap);
                    }
                    interval_longest = interval_longest.max(views[i].longest_gap);
                }
            }
        }
        if now >= next_walk {
            next_walk = now + Duration::from_millis(100);
            let secs = now.duration_since(started).as_secs_f64();
            for (i, zone) in zones_at(secs).into_iter().enumerate() {
                if zone != views[i].zone {
                    let m = Message::Leave { player: i as u32 }.encode();
                    let _ = sockets[i].send_to(&m, server(views[i].zone));
                    views[i].switch(zone);
                    join(i, zone, &sockets);
                    switches += 1;
                }
            }
        }
        if now >= next_keepalive {
            next_keepalive = now + Duration::from_secs(1);
            for (i, v) in views.iter().enumerate() {
                join(i, v.zone, &sockets);
            }
        }
        if now >= next_stats {
            next_stats = now + Duration::from_secs(args.stats_every_s);
            println!(
                "t={:.0}s updates {interval_updates} ({:.1}/player/s) switches {switches} longest gap so far {:.1} ms, {} over {} ms",
                now.duration_since(started).as_secs_f64(),
                interval_updates as f64 / args.players.max(1) as f64 / args.stats_every_s as f64,
                interval_longest.as_secs_f64() * 1000.0,
                gaps.len(),
                args.gap_threshold_ms,
            );
            interval_updates = 0;
        }
    }
    for (i, v) in views.iter().enumerate() {
        let m = Message::Leave { player: i as u32 }.encode();
        let _ = sockets[i].send_to(&m, server(v.zone));
    }
    let report = PlayersReport {
        players: args.players,
        duration_secs: started.elapsed().as_secs_f64(),
        updates,
        gap_threshold_ms: args.gap_threshold_ms as f64,
        longest_gap_ms: views
            .iter()
            .map(|v| v.longest_gap.as_secs_f64() * 1000.0)
            .fold(0.0, f64::max),
        seq_regressions: views.iter().map(|v| v.seq_regressions).sum(),
        switches,
        gaps,
    };
    let text = serde_json::to_string_pretty(&report).map_err(std::io::Error::other)?;
    std::fs::write(&args.report, text)
}
