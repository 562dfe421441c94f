//! The `criu_image` target: the CRIU image files a destination reads from
//! what a peer sent.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::Path;

use super::Input;

/// `criu_image`: the image files the destination reads from what a peer
/// sent (`ferry_criu_image`): `files.img` and `inetsk.img` (the inet
/// sockets, listed, then every IPv4 one moved to another local address,
/// which must list as moved and leave nothing to move the second time),
/// and a pagemap with its pages file (the page runs, checked against the
/// file's size). The first byte says which files exist.
pub fn criu_image(data: &[u8]) {
    let mut input = Input(data);
    let present = input.byte();
    let files = input.field();
    let inetsk = input.field();
    let pagemap = input.field();
    let pages_len = u64::from(u16::from_le_bytes([input.byte(), input.byte()])) * 64;
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, bytes: &[u8]| std::fs::write(dir.path().join(name), bytes).unwrap();
    if present & 1 != 0 {
        write("files.img", files);
    }
    if present & 2 != 0 {
        write("inetsk.img", inetsk);
    }
    write("pagemap-1.img", pagemap);
    if present & 4 != 0 {
        // Whatever pages_id the head names: the first few.
        for id in 0..4 {
            let f = std::fs::File::create(dir.path().join(format!("pages-{id}.img"))).unwrap();
            f.set_len(pages_len).unwrap();
        }
    }
    images_sockets(dir.path());
    if let Ok(pm) = ferry_criu_image::pagemap::read_pagemap(dir.path(), 1) {
        let _ = pm.present_bytes();
        for vaddr in [0, 0x1000, 0x40_0000, 0x7fff_ffff_f000, u64::MAX] {
            let run = pm.run_containing(vaddr);
            let offset = pm.pages_file_offset_of(vaddr);
            if offset.is_some() {
                assert!(run.is_some_and(|r| r.is_present()));
            }
        }
        let _ = pm.check_pages_file(dir.path());
    }
}

fn images_sockets(dir: &Path) {
    let Ok(sockets) = ferry_criu_image::inet_sockets(dir) else {
        return;
    };
    let new_local = Ipv4Addr::new(198, 19, 0, 2);
    let rules: Vec<_> = sockets
        .iter()
        .filter_map(|s| {
            let local = s.local_v4()?;
            (*local.ip() != new_local).then(|| ferry_criu_image::LocalAddressRewrite {
                matches: ferry_criu_image::SocketMatch {
                    proto: s.proto as u8,
                    local: local.into(),
                    remote: s.remote_v4().map(Into::into),
                },
                new_local: new_local.into(),
            })
        })
        .filter(|r| u32::from(r.matches.proto) == sockets_proto(&sockets, r))
        .collect();
    let Ok(summary) = ferry_criu_image::rewrite_local_addresses(dir, &rules) else {
        return;
    };
    let after = ferry_criu_image::inet_sockets(dir).expect("rewritten images still read");
    assert_eq!(after.len(), sockets.len(), "a rewrite changed the sockets");
    for r in &summary.rewritten {
        assert_eq!(
            r.after.local_v4(),
            Some(SocketAddrV4::new(
                new_local,
                r.before.local_v4().unwrap().port()
            ))
        );
        assert!(
            after.contains(&r.after),
            "a rewritten socket is not in the images"
        );
    }
    let again = ferry_criu_image::rewrite_local_addresses(dir, &rules)
        .expect("rewritten images rewrite again");
    assert!(
        again.rewritten.is_empty(),
        "a second rewrite moved {again:?}"
    );
}

/// The protocol of the socket a rule was made from (rules take it as a
/// byte: protocols above 255 cannot be matched).
fn sockets_proto(
    sockets: &[ferry_criu_image::InetSocket],
    r: &ferry_criu_image::LocalAddressRewrite,
) -> u32 {
    sockets
        .iter()
        .find(|s| {
            s.local_v4().map(Into::into) == Some(r.matches.local)
                && s.remote_v4().map(Into::into) == r.matches.remote
        })
        .map_or(0, |s| s.proto)
}
