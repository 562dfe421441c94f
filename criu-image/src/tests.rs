//! Unit tests on hand-built images: a tiny protobuf encoder builds the
//! entries the way protobuf-c does, plus fields no schema here knows.

use std::fs;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::*;
use crate::image::{FILES, IMG_COMMON_MAGIC, INETSK};
use crate::socket::ipv4_word;

/// A protobuf message under construction.
#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn tag(mut self, field: u32, wire_type: u8) -> Self {
        wire::encode_varint(u64::from(field) << 3 | u64::from(wire_type), &mut self.0);
        self
    }
    fn varint(self, field: u32, v: u64) -> Self {
        let mut m = self.tag(field, 0);
        wire::encode_varint(v, &mut m.0);
        m
    }
    fn bytes(self, field: u32, b: &[u8]) -> Self {
        let mut m = self.tag(field, 2);
        wire::encode_len(b, &mut m.0);
        m
    }
    fn fixed32(self, field: u32, v: u32) -> Self {
        let mut m = self.tag(field, 5);
        m.0.extend(v.to_le_bytes());
        m
    }
    fn fixed64(self, field: u32, v: u64) -> Self {
        let mut m = self.tag(field, 1);
        m.0.extend(v.to_le_bytes());
        m
    }
    fn repeated(self, field: u32, values: &[u32], packed: bool) -> Self {
        if packed {
            let mut p = Vec::new();
            for &v in values {
                wire::encode_varint(u64::from(v), &mut p);
            }
            self.bytes(field, &p)
        } else {
            values
                .iter()
                .fold(self, |m, &v| m.varint(field, u64::from(v)))
        }
    }
}

/// An inet_sk_entry as CRIU writes it, with unknown fields added.
#[derive(Clone)]
struct Sock {
    id: u32,
    family: u32,
    proto: u32,
    state: u32,
    src: Vec<u32>,
    dst: Vec<u32>,
    sport: u16,
    dport: u16,
    packed: bool,
    /// `opts.so_rcvbuf`.
    rcvbuf: u32,
}

impl Sock {
    fn tcp4(id: u32, src: SocketAddrV4, dst: Option<SocketAddrV4>) -> Self {
        Self {
            id,
            family: 2,
            proto: 6,
            state: if dst.is_some() { 1 } else { 10 },
            src: vec![ipv4_word(*src.ip())],
            dst: vec![ipv4_word(dst.map_or(Ipv4Addr::UNSPECIFIED, |d| *d.ip()))],
            sport: src.port(),
            dport: dst.map_or(0, |d| d.port()),
            packed: false,
            rcvbuf: 131_072,
        }
    }

    /// An unconnected UDP socket (state 7, no peer).
    fn udp4(id: u32, src: SocketAddrV4, rcvbuf: u32) -> Self {
        Self {
            proto: 17,
            state: 7,
            rcvbuf,
            ..Self::tcp4(id, src, None)
        }
    }

    fn mapped6(id: u32, src: SocketAddrV4, dst: SocketAddrV4) -> Self {
        let words = |ip: Ipv4Addr| -> Vec<u32> {
            ip.to_ipv6_mapped()
                .octets()
                .chunks_exact(4)
                .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        Self {
            family: 10,
            src: words(*src.ip()),
            dst: words(*dst.ip()),
            ..Self::tcp4(id, src, Some(dst))
        }
    }

    fn encode(&self) -> Vec<u8> {
        let fown = Msg::default().varint(1, 0).varint(2, 0).varint(3, 0).0;
        let opts = Msg::default()
            .varint(1, 212_992)
            .varint(2, u64::from(self.rcvbuf))
            .varint(3, 0)
            .varint(4, 0)
            .0;
        let ip_opts = Msg::default().varint(1, 0).varint(6, 0).0;
        Msg::default()
            .varint(1, u64::from(self.id))
            .varint(2, u64::from(self.id) + 0x1000)
            .varint(3, u64::from(self.family))
            .varint(4, if self.proto == 17 { 2 } else { 1 })
            .varint(5, u64::from(self.proto))
            .varint(6, u64::from(self.state))
            .varint(7, u64::from(self.sport))
            .varint(8, u64::from(self.dport))
            .varint(9, 2)
            .varint(10, 0)
            .repeated(11, &self.src, self.packed)
            .repeated(12, &self.dst, self.packed)
            .bytes(13, &fown)
            .bytes(14, &opts)
            .bytes(16, &ip_opts)
            // Fields a future CRIU might add, of every wire type.
            .varint(99, u64::MAX)
            .bytes(100, b"future")
            .fixed32(101, 0xdead_beef)
            .fixed64(102, 0x0123_4567_89ab_cdef)
            .0
    }

    fn with_src_ip(&self, ip: Ipv4Addr) -> Self {
        let mut s = self.clone();
        let i = if s.family == 2 { 0 } else { 3 };
        s.src[i] = ipv4_word(ip);
        s
    }
}

fn file_entry(isk: &[u8], id: u32) -> Vec<u8> {
    Msg::default()
        .varint(1, 4)
        .varint(2, u64::from(id))
        .bytes(4, isk)
        .varint(250, 1)
        .0
}

fn reg_file_entry(id: u32) -> Vec<u8> {
    let reg = Msg::default()
        .varint(1, u64::from(id))
        .varint(2, 0o100000)
        .fixed64(3, 0)
        .bytes(5, b"/usr/bin/python3")
        .0;
    Msg::default()
        .varint(1, 1)
        .varint(2, u64::from(id))
        .bytes(3, &reg)
        .0
}

fn image_bytes(magic: u32, entries: &[Vec<u8>]) -> Vec<u8> {
    let mut b = IMG_COMMON_MAGIC.to_ne_bytes().to_vec();
    b.extend(magic.to_ne_bytes());
    for e in entries {
        b.extend((e.len() as u32).to_ne_bytes());
        b.extend(e);
    }
    b
}

fn sa(s: &str) -> SocketAddrV4 {
    s.parse().unwrap()
}

/// A rewrite: addresses as `a.b.c.d:p` or `[v6]:p`, the new one bare.
fn rule(proto: u8, local: &str, remote: Option<&str>, new: &str) -> LocalAddressRewrite {
    LocalAddressRewrite {
        matches: SocketMatch {
            proto,
            local: local.parse().unwrap(),
            remote: remote.map(|r| r.parse().unwrap()),
        },
        new_local: new.parse().unwrap(),
    }
}

struct Fixture {
    dir: tempfile::TempDir,
    entries: Vec<Vec<u8>>,
}

impl Fixture {
    fn files(entries: Vec<Vec<u8>>) -> Self {
        Self::with(&FILES, entries)
    }

    fn with(kind: &ImageKind, entries: Vec<Vec<u8>>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join(kind.file_name),
            image_bytes(kind.magic, &entries),
        )
        .unwrap();
        Self { dir, entries }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn read(&self, kind: &ImageKind) -> Vec<u8> {
        fs::read(self.dir.path().join(kind.file_name)).unwrap()
    }
}

const A: &str = "198.18.200.1";
const B: &str = "198.18.200.2";

fn tcp_conn() -> Sock {
    Sock::tcp4(7, sa("198.18.200.1:40000"), Some(sa("198.18.201.9:5432")))
}

#[test]
fn rewrites_only_the_matched_socket_and_keeps_the_rest_byte_for_byte() {
    let matched = tcp_conn();
    let other_peer = Sock::tcp4(8, sa("198.18.200.1:40001"), Some(sa("198.18.201.10:5432")));
    let other_port = Sock::tcp4(9, sa("198.18.200.1:40002"), Some(sa("198.18.201.9:5432")));
    let listener = Sock::tcp4(10, sa("198.18.200.1:8080"), None);
    let entries = vec![
        reg_file_entry(1),
        file_entry(&matched.encode(), 7),
        file_entry(&other_peer.encode(), 8),
        reg_file_entry(2),
        file_entry(&other_port.encode(), 9),
        file_entry(&listener.encode(), 10),
    ];
    let fx = Fixture::files(entries.clone());

    let rewrites = [
        rule(6, "198.18.200.1:40000", Some("198.18.201.9:5432"), B),
        rule(17, "198.18.200.1:40000", None, B),
    ];
    let summary = rewrite_local_addresses(fx.path(), &rewrites).unwrap();

    let expected = image_bytes(
        FILES.magic,
        &[
            entries[0].clone(),
            file_entry(&matched.with_src_ip(B.parse().unwrap()).encode(), 7),
            entries[2].clone(),
            entries[3].clone(),
            entries[4].clone(),
            entries[5].clone(),
        ],
    );
    assert_eq!(fx.read(&FILES), expected);
    assert_eq!(summary.unmatched, [1]);
    assert_eq!(summary.files_written, [fx.path().join("files.img")]);
    assert_eq!(summary.rewritten.len(), 1);
    let r = &summary.rewritten[0];
    assert_eq!(r.rule, 0);
    assert_eq!(r.before.local_v4(), Some(sa("198.18.200.1:40000")));
    assert_eq!(r.after.local_v4(), Some(sa("198.18.200.2:40000")));
    assert_eq!(
        r.after.remote,
        Some(SocketAddr::V4(sa("198.18.201.9:5432")))
    );
}

#[test]
fn raises_only_narrower_receive_buffers_of_the_protocol_asked() {
    const WIDE: u32 = 8 << 20;
    let narrow = Sock::udp4(3, sa("198.18.0.100:7000"), 212_992);
    let already_wide = Sock::udp4(4, sa("198.18.0.100:7001"), 16 << 20);
    let tcp = tcp_conn();
    let mut legacy = Sock::udp4(5, sa("198.18.0.100:7002"), 4_608);
    legacy.packed = true;
    let entries = vec![
        reg_file_entry(1),
        file_entry(&narrow.encode(), 3),
        file_entry(&already_wide.encode(), 4),
        file_entry(&tcp.encode(), 7),
    ];
    let fx = Fixture::files(entries.clone());
    let inetsk = Fixture::with(&INETSK, vec![legacy.encode()]);

    let raised = raise_receive_buffers(fx.path(), IPPROTO_UDP, WIDE).unwrap();

    // The varint grows from 3 to 4 bytes: opts, isk and the entry's size
    // are re-encoded; everything else is the same bytes.
    let widened = Sock {
        rcvbuf: WIDE,
        ..narrow.clone()
    };
    let expected = image_bytes(
        FILES.magic,
        &[
            entries[0].clone(),
            file_entry(&widened.encode(), 3),
            entries[2].clone(),
            entries[3].clone(),
        ],
    );
    assert_eq!(fx.read(&FILES), expected);
    assert_eq!(raised.len(), 1, "{raised:?}");
    assert_eq!(raised[0].before, 212_992);
    assert_eq!(raised[0].socket.local_v4(), Some(sa("198.18.0.100:7000")));
    assert_eq!(raised[0].socket.proto, 17);
    assert_eq!(
        socket::receive_buffer(&widened.encode()).unwrap(),
        WIDE,
        "the field CRIU restores from"
    );

    // A second pass finds nothing to do and writes nothing.
    let again = raise_receive_buffers(fx.path(), IPPROTO_UDP, WIDE).unwrap();
    assert!(again.is_empty(), "{again:?}");
    assert_eq!(fx.read(&FILES), expected);

    // The legacy inetsk.img form too.
    let raised = raise_receive_buffers(inetsk.path(), IPPROTO_UDP, WIDE).unwrap();
    assert_eq!(raised.len(), 1);
    assert_eq!(raised[0].before, 4_608);
    let widened = Sock {
        rcvbuf: WIDE,
        ..legacy
    };
    assert_eq!(
        inetsk.read(&INETSK),
        image_bytes(INETSK.magic, &[widened.encode()])
    );
}

#[test]
fn a_socket_without_its_receive_buffer_is_an_error_naming_the_field() {
    // opts without so_rcvbuf: CRIU's restore would reject it too.
    let opts = Msg::default().varint(1, 212_992).0;
    let bare = Msg::default()
        .varint(1, 3)
        .varint(2, 0x1003)
        .varint(3, 2)
        .varint(4, 2)
        .varint(5, 17)
        .varint(6, 7)
        .varint(7, 7000)
        .varint(8, 0)
        .repeated(11, &[ipv4_word(Ipv4Addr::new(198, 18, 0, 100))], false)
        .repeated(12, &[0], false)
        .bytes(14, &opts)
        .0;
    let fx = Fixture::files(vec![file_entry(&bare, 3)]);
    let before = fx.read(&FILES);
    let err = raise_receive_buffers(fx.path(), IPPROTO_UDP, 8 << 20).unwrap_err();
    assert!(err.to_string().contains("so_rcvbuf"), "{err}");
    assert_eq!(fx.read(&FILES), before, "nothing written");
}

#[test]
fn fixes_lengths_when_the_varint_grows_and_shrinks() {
    // 198.18.200.1 is a 4-byte varint, 198.18.200.200 a 5-byte one.
    for packed in [false, true] {
        let sock = Sock {
            packed,
            ..tcp_conn()
        };
        let fx = Fixture::files(vec![reg_file_entry(1), file_entry(&sock.encode(), 7)]);
        let far: Ipv4Addr = "198.18.200.200".parse().unwrap();
        let before_len = fx.read(&FILES).len();
        rewrite_local_addresses(
            fx.path(),
            &[rule(6, "198.18.200.1:40000", None, "198.18.200.200")],
        )
        .unwrap();
        let grown = fx.read(&FILES);
        assert_eq!(grown.len(), before_len + 1);
        assert_eq!(
            grown,
            image_bytes(
                FILES.magic,
                &[
                    reg_file_entry(1),
                    file_entry(&sock.with_src_ip(far).encode(), 7)
                ]
            ),
            "packed: {packed}"
        );
        let listed = inet_sockets(fx.path()).unwrap();
        assert_eq!(listed[0].local_v4(), Some(SocketAddrV4::new(far, 40000)));

        rewrite_local_addresses(fx.path(), &[rule(6, "198.18.200.200:40000", None, A)]).unwrap();
        assert_eq!(
            fx.read(&FILES),
            image_bytes(
                FILES.magic,
                &[reg_file_entry(1), file_entry(&sock.encode(), 7)]
            )
        );
    }
}

#[test]
fn packed_run_keeps_other_elements_verbatim() {
    // An AF_INET6 socket with a packed, IPv4-mapped source address whose
    // first word is encoded non-minimally (0x80 0x00 is a 2-byte zero).
    let sock = Sock::mapped6(3, sa("198.18.200.1:443"), sa("198.18.201.9:5555"));
    let mut packed = vec![0x80, 0x00];
    for &w in &sock.src[1..] {
        wire::encode_varint(u64::from(w), &mut packed);
    }
    let head = Msg::default()
        .varint(1, 3)
        .varint(2, 4)
        .varint(3, 10)
        .varint(4, 1)
        .varint(5, 6)
        .varint(6, 1)
        .varint(7, 443)
        .varint(8, 5555);
    let dst = Msg::default().repeated(12, &sock.dst, false).0;
    let msg = |src_packed: &[u8]| {
        let mut m = Msg(head.0.clone()).bytes(11, src_packed).0;
        m.extend(&dst);
        m
    };
    let fx = Fixture::files(vec![file_entry(&msg(&packed), 3)]);
    let s = rewrite_local_addresses(fx.path(), &[rule(6, "198.18.200.1:443", None, B)]).unwrap();
    assert_eq!(s.rewritten.len(), 1);
    assert_eq!(s.rewritten[0].after.family, Family::Inet6);
    assert_eq!(
        s.rewritten[0].after.local,
        SocketAddr::V6(SocketAddrV6::new(
            B.parse::<Ipv4Addr>().unwrap().to_ipv6_mapped(),
            443,
            0,
            0
        ))
    );
    let mut want = vec![0x80, 0x00];
    for &w in &sock.with_src_ip(B.parse().unwrap()).src[1..] {
        wire::encode_varint(u64::from(w), &mut want);
    }
    assert_eq!(
        fx.read(&FILES),
        image_bytes(FILES.magic, &[file_entry(&msg(&want), 3)])
    );
}

#[test]
fn unpacked_ipv4_mapped_and_criu_0_1_four_word_addresses() {
    let mapped = Sock::mapped6(3, sa("198.18.200.1:443"), sa("198.18.201.9:5555"));
    let mut old = tcp_conn();
    old.id = 4;
    old.src.extend([0, 0, 0]);
    old.dst.extend([0, 0, 0]);
    let native6 = Sock {
        id: 5,
        src: vec![0x20010db8u32.to_be(), 0, 0, 1u32.to_be()],
        dst: vec![0x20010db8u32.to_be(), 0, 0, 2u32.to_be()],
        ..mapped.clone()
    };
    let fx = Fixture::files(vec![
        file_entry(&mapped.encode(), 3),
        file_entry(&old.encode(), 4),
        file_entry(&native6.encode(), 5),
    ]);
    let listed = inet_sockets(fx.path()).unwrap();
    assert_eq!(listed.len(), 3);
    assert_eq!(listed[0].local_v4(), Some(sa("198.18.200.1:443")));
    assert_eq!(listed[1].remote_v4(), Some(sa("198.18.201.9:5432")));
    assert_eq!(
        listed[2].local,
        SocketAddr::V6(SocketAddrV6::new(
            "2001:db8::1".parse::<Ipv6Addr>().unwrap(),
            443,
            0,
            0
        ))
    );
    assert_eq!(listed[2].local_v4(), None);

    let s = rewrite_local_addresses(
        fx.path(),
        &[
            rule(6, "198.18.200.1:443", None, B),
            rule(6, "198.18.200.1:40000", None, B),
        ],
    )
    .unwrap();
    assert_eq!(s.rewritten.len(), 2);
    let mut old_b = old.clone();
    old_b.src[0] = ipv4_word(B.parse().unwrap());
    assert_eq!(
        fx.read(&FILES),
        image_bytes(
            FILES.magic,
            &[
                file_entry(&mapped.with_src_ip(B.parse().unwrap()).encode(), 3),
                file_entry(&old_b.encode(), 4),
                file_entry(&native6.encode(), 5),
            ]
        )
    );
}

/// An IPv6 socket's local address is rewritten whole (four words), by an
/// IPv6 rule only; an IPv4-mapped one is the IPv4 rules'.
#[test]
fn an_ipv6_socket_takes_an_ipv6_rewrite_and_a_mapped_one_does_not() {
    let mapped = Sock::mapped6(3, sa("198.18.200.1:443"), sa("198.18.201.9:5555"));
    let native6 = Sock {
        id: 5,
        src: vec![0x20010db8u32.to_be(), 0, 0, 1u32.to_be()],
        dst: vec![0x20010db8u32.to_be(), 0, 0, 2u32.to_be()],
        ..mapped.clone()
    };
    let fx = Fixture::files(vec![
        file_entry(&mapped.encode(), 3),
        file_entry(&native6.encode(), 5),
    ]);
    let s = rewrite_local_addresses(
        fx.path(),
        &[
            // An IPv6 rule for the mapped socket's IPv4 address: no match.
            rule(6, "[::ffff:198.18.200.2]:443", None, "2001:db8::7"),
            rule(
                6,
                "[2001:db8::1]:443",
                Some("[2001:db8::2]:5555"),
                "2001:db8::9",
            ),
        ],
    )
    .unwrap();
    assert_eq!(s.unmatched, [0]);
    assert_eq!(s.rewritten.len(), 1);
    let listed = inet_sockets(fx.path()).unwrap();
    assert_eq!(
        listed[0].local_v4(),
        Some(sa("198.18.200.1:443")),
        "untouched"
    );
    assert_eq!(
        listed[1].local,
        "[2001:db8::9]:443".parse::<SocketAddr>().unwrap()
    );
    assert_eq!(
        listed[1].remote,
        Some("[2001:db8::2]:5555".parse().unwrap())
    );
    // The mapped socket matches an IPv4 rule through its IPv4 address.
    let s = rewrite_local_addresses(fx.path(), &[rule(6, "198.18.200.1:443", None, B)]).unwrap();
    assert_eq!(s.rewritten.len(), 1);
    assert_eq!(
        s.rewritten[0].after.local_canonical(),
        format!("{B}:443").parse().unwrap()
    );
}

#[test]
fn lists_sockets_with_their_fields() {
    let udp = Sock {
        proto: 17,
        state: 7,
        ..Sock::tcp4(11, sa("0.0.0.0:53"), None)
    };
    let fx = Fixture::files(vec![
        reg_file_entry(1),
        file_entry(&tcp_conn().encode(), 7),
        file_entry(&udp.encode(), 11),
    ]);
    let listed = inet_sockets(fx.path()).unwrap();
    assert_eq!(
        listed,
        [
            InetSocket {
                id: 7,
                ino: 0x1007,
                family: Family::Inet,
                sock_type: 1,
                proto: 6,
                state: TCP_ESTABLISHED,
                local: "198.18.200.1:40000".parse().unwrap(),
                remote: Some("198.18.201.9:5432".parse().unwrap()),
            },
            InetSocket {
                id: 11,
                ino: 0x100b,
                family: Family::Inet,
                sock_type: 2,
                proto: 17,
                state: 7,
                local: "0.0.0.0:53".parse().unwrap(),
                remote: None,
            },
        ]
    );
}

#[test]
fn byte_order_matches_criu() {
    // CRIU memcpys the network-order bytes into a host u32.
    let w = ipv4_word("198.18.200.1".parse().unwrap());
    assert_eq!(w.to_ne_bytes(), [198, 18, 200, 1]);
    if cfg!(target_endian = "little") {
        assert_eq!(w, 0x01c8_12c6);
    }
}

#[test]
fn legacy_inetsk_image() {
    let conn = tcp_conn();
    let fx = Fixture::with(&INETSK, vec![conn.encode()]);
    assert_eq!(inet_sockets(fx.path()).unwrap().len(), 1);
    let s = rewrite_local_addresses(fx.path(), &[rule(6, "198.18.200.1:40000", None, B)]).unwrap();
    assert_eq!(s.files_written, [fx.path().join("inetsk.img")]);
    assert_eq!(
        fx.read(&INETSK),
        image_bytes(
            INETSK.magic,
            &[conn.with_src_ip(B.parse().unwrap()).encode()]
        )
    );
}

#[test]
fn nothing_matched_writes_nothing_and_same_address_is_a_no_op() {
    let fx = Fixture::files(vec![file_entry(&tcp_conn().encode(), 7)]);
    let file = fx.path().join("files.img");
    let before = fs::read(&file).unwrap();
    let s = rewrite_local_addresses(fx.path(), &[rule(6, "198.18.200.1:1", None, B)]).unwrap();
    assert_eq!(s.unmatched, [0]);
    assert!(s.files_written.is_empty());
    let s = rewrite_local_addresses(fx.path(), &[rule(6, "198.18.200.1:40000", None, A)]).unwrap();
    assert_eq!(s.rewritten.len(), 1);
    assert!(s.files_written.is_empty());
    assert_eq!(fs::read(&file).unwrap(), before);
    assert_eq!(fx.entries.len(), 1);
}

#[test]
fn keeps_permissions_and_leaves_no_temporary_file() {
    let fx = Fixture::files(vec![file_entry(&tcp_conn().encode(), 7)]);
    let file = fx.path().join("files.img");
    fs::set_permissions(&file, fs::Permissions::from_mode(0o640)).unwrap();
    rewrite_local_addresses(fx.path(), &[rule(6, "198.18.200.1:40000", None, B)]).unwrap();
    assert_eq!(
        fs::metadata(&file).unwrap().permissions().mode() & 0o7777,
        0o640
    );
    let names: Vec<_> = fs::read_dir(fx.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["files.img"]);
}

#[test]
fn missing_images_and_bad_magic() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        inet_sockets(dir.path()),
        Err(ImageError::NoSocketImage { .. })
    ));
    fs::write(dir.path().join("files.img"), image_bytes(INETSK.magic, &[])).unwrap();
    let e = inet_sockets(dir.path()).unwrap_err();
    assert!(
        matches!(e, ImageError::BadMagic { offset: 4, found, .. } if found == INETSK.magic),
        "{e}"
    );
}

#[test]
fn malformed_entries_give_precise_errors() {
    let good = tcp_conn().encode();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        // A group inside the socket.
        (file_entry(&Msg(good.clone()).tag(50, 3).0, 7), "groups"),
        // Wire type 7.
        (
            file_entry(&Msg(good.clone()).tag(50, 7).0, 7),
            "unknown wire type",
        ),
        // src_addr as fixed32.
        (
            file_entry(&Msg(good.clone()).fixed32(11, 1).0, 7),
            "expected a varint or packed varints",
        ),
        // A uint32 above u32::MAX.
        (
            file_entry(&Msg(good.clone()).varint(7, 1 << 40).0, 7),
            "expected a uint32",
        ),
        // Missing family.
        (
            file_entry(
                &Msg::default()
                    .varint(1, 1)
                    .varint(2, 1)
                    .varint(4, 1)
                    .varint(5, 6)
                    .varint(6, 1)
                    .varint(7, 1)
                    .varint(8, 1)
                    .0,
                7,
            ),
            "required field 3 (family)",
        ),
        // AF_INET6 with one word.
        (
            file_entry(
                &Sock {
                    family: 10,
                    ..tcp_conn()
                }
                .encode(),
                7,
            ),
            "family 10 with 1 src_addr",
        ),
        // Port out of range.
        (
            file_entry(&Msg(good.clone()).varint(8, 70000).0, 7),
            "dst_port 70000",
        ),
        // INETSK without isk.
        (
            Msg::default().varint(1, 4).varint(2, 7).0,
            "without its isk",
        ),
        // Two isk fields.
        (Msg(file_entry(&good, 7)).bytes(4, &good).0, "found several"),
    ];
    for (entry, want) in cases {
        let fx = Fixture::files(vec![reg_file_entry(1), entry]);
        let e = inet_sockets(fx.path()).unwrap_err();
        assert!(e.to_string().contains(want), "{e} should say {want}");
        let e = rewrite_local_addresses(fx.path(), &[rule(6, "198.18.200.1:40000", None, B)])
            .unwrap_err();
        assert!(e.to_string().contains(want), "{e} should say {want}");
    }
}

#[test]
fn error_offsets_point_into_the_file() {
    // Truncate the isk length so that it overruns the entry: the error is
    // at the isk's length prefix, counted from the start of the file.
    let reg = reg_file_entry(1);
    let isk = tcp_conn().encode();
    let mut entry = file_entry(&isk, 7);
    entry.truncate(entry.len() - 10);
    let fx = Fixture::files(vec![reg.clone(), entry]);
    let e = inet_sockets(fx.path()).unwrap_err();
    // header 8 + size 4 + reg + size 4 + type (2) + id (2) + isk tag (1)
    let want = (8 + 4 + reg.len() + 4 + 2 + 2 + 1) as u64;
    assert!(
        matches!(e, ImageError::Protobuf { offset, .. } if offset == want),
        "{e}, want offset {want}"
    );
}

/// Every prefix and many corruptions of a valid image give an error or a
/// result, never a panic, and a failed rewrite leaves the file alone.
#[test]
fn truncated_and_corrupted_images_never_panic() {
    let mapped = Sock {
        packed: true,
        ..Sock::mapped6(3, sa("198.18.200.1:443"), sa("198.18.201.9:5555"))
    };
    let valid = image_bytes(
        FILES.magic,
        &[
            reg_file_entry(1),
            file_entry(&tcp_conn().encode(), 7),
            file_entry(&mapped.encode(), 3),
            file_entry(&Sock::udp4(4, sa("198.18.0.100:7000"), 4_608).encode(), 4),
        ],
    );
    let rewrites = [
        rule(6, "198.18.200.1:40000", None, "198.18.200.250"),
        rule(6, "198.18.200.1:443", None, B),
    ];
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("files.img");
    let check = |bytes: &[u8]| {
        fs::write(&file, bytes).unwrap();
        let listed = inet_sockets(dir.path());
        let rewritten = rewrite_local_addresses(dir.path(), &rewrites);
        match rewritten {
            Ok(_) => assert!(listed.is_ok()),
            Err(_) => assert_eq!(fs::read(&file).unwrap(), bytes),
        }
        fs::write(&file, bytes).unwrap();
        if raise_receive_buffers(dir.path(), IPPROTO_UDP, 8 << 20).is_err() {
            assert_eq!(fs::read(&file).unwrap(), bytes);
        }
    };
    for len in 0..valid.len() {
        check(&valid[..len]);
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for i in 8..valid.len() {
        for v in [0x00, 0xff, 0x80, (next() & 0xff) as u8] {
            let mut b = valid.clone();
            b[i] = v;
            check(&b);
        }
    }
    for _ in 0..200 {
        let mut b = valid.clone();
        let n = (next() % 64) as usize;
        b.truncate(8);
        b.extend((0..n).map(|_| next() as u8));
        check(&b);
    }
}
