//! `ferry-zone-server --port 30000 --cpu-per-player-us 40`: a zone server of
//! Gerofi et al. (DVE)'s virtual environment, as the live experiment's
//! workload (`cargo xtask dve`). One UDP port; players join and leave with a
//! datagram (the protocol is `ferry_integration::dve`); every 50 ms (20 Hz)
//! the server works for its players (CPU in proportion to their number: the
//! zone's simulation) and sends each of them an update.
//!
//! Built to be frozen and moved at any point: one thread, one socket, a
//! receive timeout (no epoll or timer descriptors), and a tick that resumes
//! where the clock is after a freeze instead of catching up.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use ferry_integration::dve::{Message, TICK, UPDATE_BYTES};

#[derive(Debug, Parser)]
#[command(
    name = "ferry-zone-server",
    about = "A DVE zone server: 20 Hz updates to its players over UDP, CPU per player"
)]
struct Args {
    /// UDP port to serve.
    #[arg(long)]
    port: u16,
    /// Address to bind.
    #[arg(long, default_value_t = Ipv4Addr::UNSPECIFIED)]
    bind: Ipv4Addr,
    /// CPU the zone spends per player per tick (µs): the zone's load grows
    /// with its players.
    #[arg(long, default_value_t = 40)]
    cpu_per_player_us: u64,
    /// The zone's number, sent in each update.
    #[arg(long, default_value_t = 0)]
    zone: u16,
}

/// A player that has said nothing this long is gone.
const PLAYER_TIMEOUT: Duration = Duration::from_secs(5);

fn main() -> ExitCode {
    let args = Args::parse();
    let addr = SocketAddrV4::new(args.bind, args.port);
    let socket = match UdpSocket::bind(addr) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferry-zone-server: binding {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    serve(&socket, &args)
}

fn serve(socket: &UdpSocket, args: &Args) -> ! {
    let mut players: HashMap<u32, (SocketAddr, Instant)> = HashMap::new();
    let mut buf = [0u8; 64];
    let mut seq: u64 = 0;
    let mut next_tick = Instant::now() + TICK;
    loop {
        // Take joins and leaves until the tick is due.
        loop {
            let now = Instant::now();
            let Some(wait) = next_tick
                .checked_duration_since(now)
                .filter(|w| !w.is_zero())
            else {
                break;
            };
            // A zero timeout would mean "block for ever".
            let _ = socket.set_read_timeout(Some(wait.max(Duration::from_micros(100))));
            // An error is a timeout or an interruption (a freeze, a
            // signal): look at the clock again.
            if let Ok((n, from)) = socket.recv_from(&mut buf) {
                match Message::decode(&buf[..n]) {
                    Some(Message::Join { player }) => {
                        players.insert(player, (from, Instant::now()));
                    }
                    Some(Message::Leave { player }) => {
                        players.remove(&player);
                    }
                    _ => {}
                }
            }
        }
        let now = Instant::now();
        players.retain(|_, (_, seen)| now.duration_since(*seen) < PLAYER_TIMEOUT);
        // The zone's simulation: CPU in proportion to its players.
        let work = Duration::from_micros(args.cpu_per_player_us * players.len() as u64);
        let until = Instant::now() + work;
        let mut spin: u64 = 0;
        while Instant::now() < until {
            spin = std::hint::black_box(spin.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        seq += 1;
        for (&player, (to, _)) in &players {
            let update = Message::Update {
                player,
                zone: args.zone,
                seq,
            };
            let _ = socket.send_to(&update.encode_padded(UPDATE_BYTES), to);
        }
        // After a freeze the next tick is one period from now: no burst of
        // missed ticks.
        next_tick += TICK;
        let now = Instant::now();
        if next_tick < now {
            next_tick = now + TICK;
        }
    }
}
