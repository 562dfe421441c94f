//! What the distributed servers' tests share with their server
//! (`ferry-group-server`): the bytes a download carries, so that a client
//! can check every byte of it whichever node sent it.

/// The bytes at `offset..offset + len` of a download: each 8-byte block
/// is a hash of its index, so a byte lost, repeated or moved anywhere
/// shows.
pub fn pattern(offset: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut i = offset;
    while out.len() < len {
        let block = splitmix(i / 8).to_le_bytes();
        out.push(block[(i % 8) as usize]);
        i += 1;
    }
    out
}

/// Raises this process's soft limit of open descriptors to its hard one:
/// thousands of connections in one process.
pub fn raise_nofile() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `l`; setrlimit reads it.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_slice_of_the_pattern_is_the_same_bytes() {
        let whole = pattern(0, 1000);
        assert_eq!(pattern(333, 100), whole[333..433]);
        assert_ne!(pattern(1, 100), whole[0..100]);
    }
}
