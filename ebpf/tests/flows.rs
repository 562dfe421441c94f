//! Per-connection ownership of shared ports (a distributed server's port,
//! served by a group of nodes) in the real kernel: the contact node takes
//! new connections, a member only the connections listed as its own, and a
//! listed connection goes by its entry in both directions. Needs root;
//! skipped with a reason otherwise.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::time::Duration;

use ferry_ebpf::{CaptureKind, Flow, FlowState, PortState, Protocol};
use nix::sys::socket::{
    AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect, setsockopt, socket, sockopt,
};

#[macro_use]
mod common;
use common::*;

/// The client's address in `family`.
fn client_ip(family: Family) -> IpAddr {
    match family {
        Family::V4 => [198, 18, 1, 1].into(),
        Family::V6 => "2001:2:0:1::1".parse().unwrap(),
    }
}

/// A TCP connection from the client's `port` to the node's `to`, within
/// `timeout` (set as the socket's send timeout, which bounds connect).
fn connect_from(
    family: Family,
    port: u16,
    to: u16,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    let fd: OwnedFd = socket(
        match family {
            Family::V4 => AddressFamily::Inet,
            Family::V6 => AddressFamily::Inet6,
        },
        SockType::Stream,
        SockFlag::empty(),
        None,
    )?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    setsockopt(
        &fd,
        sockopt::SendTimeout,
        &nix::sys::time::TimeVal::new(timeout.as_secs() as i64, timeout.subsec_micros() as i64),
    )?;
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(SocketAddr::new(client_ip(family), port)),
    )?;
    match connect(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(family.addr(to)),
    ) {
        Ok(()) => Ok(TcpStream::from(fd)),
        Err(nix::errno::Errno::EINPROGRESS) => Err(ErrorKind::TimedOut.into()),
        Err(e) => Err(e.into()),
    }
}

fn flow(family: Family, client_port: u16, port: u16) -> Flow {
    Flow::new(SocketAddr::new(client_ip(family), client_port), port)
}

/// Sends `msg` and reads the echo back.
fn echo_once(s: &mut TcpStream, msg: &[u8]) {
    s.write_all(msg).unwrap();
    let mut back = vec![0; msg.len()];
    s.read_exact(&mut back).unwrap();
    assert_eq!(back, msg);
}

/// Echoes every connection `listener` accepts, on threads of its own.
fn serve_echo(listener: TcpListener) {
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { return };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 || c.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
}

#[test]
fn a_member_takes_only_the_connections_listed_as_its_own() {
    a_member_takes_only_the_connections_listed_as_its_own_in(Family::V4);
}

#[test]
fn a_member_takes_only_the_connections_listed_as_its_own_over_ipv6() {
    a_member_takes_only_the_connections_listed_as_its_own_in(Family::V6);
}

fn a_member_takes_only_the_connections_listed_as_its_own_in(family: Family) {
    require_root!();
    let net = Net::new();
    let mut filter = net.attach();
    let flow = move |client_port, port| flow(family, client_port, port);
    let connect_from = move |port, to, timeout| connect_from(family, port, to, timeout);
    let listener = net.node(move || TcpListener::bind(family.any(7010)).unwrap());
    serve_echo(listener);
    filter
        .set(Protocol::Tcp, 7010, PortState::SharedMember)
        .unwrap();
    assert_eq!(
        filter.ports().unwrap(),
        vec![(Protocol::Tcp, 7010, PortState::SharedMember)]
    );

    // Not listed: another node's (the contact's), not even a reset.
    let err = net
        .client(move || connect_from(41001, 7010, Duration::from_millis(1500)))
        .expect_err("a member must not take a new connection");
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");

    // Listed as owned here: the connection is this node's.
    filter
        .set_flow(flow(41002, 7010), FlowState::Owned)
        .unwrap();
    assert_eq!(
        filter.flows().unwrap(),
        vec![(flow(41002, 7010), FlowState::Owned)]
    );
    assert_eq!(
        filter.flow(flow(41002, 7010)).unwrap(),
        Some(FlowState::Owned)
    );
    net.client(move || {
        let mut s = connect_from(41002, 7010, Duration::from_secs(3)).expect("a listed connection");
        echo_once(&mut s, b"owned here");
    });
    filter.remove_flow(flow(41002, 7010)).unwrap();
    assert!(filter.flows().unwrap().is_empty());
    assert_eq!(filter.flow(flow(41002, 7010)).unwrap(), None);
    let c = filter.counters().unwrap();
    assert!(c.dropped_not_owned >= 2, "the unlisted SYNs dropped: {c:?}");
}

#[test]
fn the_contact_node_serves_new_connections_and_keeps_quiet_on_one_served_elsewhere() {
    the_contact_node_serves_new_connections_and_keeps_quiet_on_one_served_elsewhere_in(Family::V4);
}

#[test]
fn the_contact_node_serves_new_connections_and_keeps_quiet_on_one_served_elsewhere_over_ipv6() {
    the_contact_node_serves_new_connections_and_keeps_quiet_on_one_served_elsewhere_in(Family::V6);
}

fn the_contact_node_serves_new_connections_and_keeps_quiet_on_one_served_elsewhere_in(
    family: Family,
) {
    require_root!();
    let net = Net::new();
    let mut filter = net.attach();
    let flow = move |client_port, port| flow(family, client_port, port);
    let connect_from = move |port, to, timeout| connect_from(family, port, to, timeout);
    let listener = net.node(move || TcpListener::bind(family.any(7011)).unwrap());
    serve_echo(listener);
    filter
        .set(Protocol::Tcp, 7011, PortState::SharedContact)
        .unwrap();
    let mut a = net.client(move || {
        let mut a = connect_from(41011, 7011, Duration::from_secs(3)).expect("a new connection");
        echo_once(&mut a, b"before");
        a.set_read_timeout(Some(Duration::from_millis(700)))
            .unwrap();
        a
    });

    // Served elsewhere now: A's bytes reach no socket here and nothing
    // answers them, above all no reset; a new client is still served.
    filter
        .set_flow(flow(41011, 7011), FlowState::Elsewhere)
        .unwrap();
    a.write_all(b"while elsewhere").unwrap();
    let mut buf = [0u8; 64];
    assert_silent(|| a.read(&mut buf), "a connection served elsewhere");
    net.client(move || {
        let mut b = connect_from(41012, 7011, Duration::from_secs(3)).expect("another new one");
        echo_once(&mut b, b"new");
    });

    // Captured: kept in the ring, still not delivered.
    filter
        .set_flow(flow(41011, 7011), FlowState::Capturing)
        .unwrap();
    let mut captured = Vec::new();
    for _ in 0..50 {
        filter.drain_captured(|p| captured.push(p));
        if !captured.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let p = captured
        .first()
        .expect("A's retransmission captured within 5 s");
    assert_eq!(
        (p.kind, p.protocol, p.port),
        (CaptureKind::Captured, Protocol::Tcp, 7011)
    );
    let source = match family {
        Family::V4 => IpAddr::from(<[u8; 4]>::try_from(&p.data[12..16]).unwrap()),
        Family::V6 => IpAddr::from(<[u8; 16]>::try_from(&p.data[8..24]).unwrap()),
    };
    assert_eq!(source, client_ip(family), "the client's packet");

    // Owned again: the retransmission is delivered and answered, in order.
    filter.remove_flow(flow(41011, 7011)).unwrap();
    a.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut back = vec![0; b"while elsewhere".len()];
    a.read_exact(&mut back).unwrap();
    assert_eq!(back, b"while elsewhere");
    echo_once(&mut a, b"after");
}
