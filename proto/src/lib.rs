//! The `ferry.v1` gRPC API: `Control` for the CLI and external schedulers,
//! `Peer` between agents.

/// Generated types and services of package `ferry.v1`.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("ferry.v1");

    /// Encoded file descriptor set, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("ferry_v1_descriptor");
}

/// Peer protocol versions this build speaks, oldest first. A migration uses
/// the highest version both agents list in `Hello`. Version 1 (no `Arm`,
/// no capture) is no longer spoken: a v1 destination would drop the packets
/// that v2 promises to keep.
pub const PEER_PROTOCOL_VERSIONS: &[u32] = &[2, 3, 4, 5, 6, 7, 8, 9, 10, 11];

/// The newest peer protocol version this build speaks.
pub const PEER_PROTOCOL_VERSION: u32 = 11;

/// The first version whose Restore carries TCP connections migrated
/// collectively (`RestoreRequest.tcp_connections`).
pub const PEER_PROTOCOL_COLLECTIVE_SOCKETS: u32 = 4;

/// The first version with pre-copy (`TransferPages`, `StoredPages` in the
/// image stream).
pub const PEER_PROTOCOL_PRECOPY: u32 = 5;

/// The first version with post-copy (`RestoreRequest.lazy_pages_from`,
/// `PostCopyStatus`).
pub const PEER_PROTOCOL_POSTCOPY: u32 = 6;

/// The first version whose Arm names the connections to open ahead of the
/// freeze (`ArmRequest.connections`, `TransferSocketsResponse.staged`).
pub const PEER_PROTOCOL_STAGED_SOCKETS: u32 = 7;

/// The first version whose Commit carries the UDP datagrams left unread
/// (`CommitRequest.queued_datagrams`) rather than their keys.
pub const PEER_PROTOCOL_QUEUED_DATAGRAMS: u32 = 8;

/// The first version whose Arm carries each connection's fixed part
/// (`StagedConnection.fixed`) and whose TransferSockets may carry
/// connections as packed records (`TransferSocketsRequest.packed`).
pub const PEER_PROTOCOL_PACKED_STATES: u32 = 9;

/// The first version whose post-copy pages may follow by ferryd
/// (`RestoreRequest.pages_follow`, `PostCopyPages`).
pub const PEER_PROTOCOL_PAGES_FOLLOW: u32 = 10;

/// The first version whose destination remembers what it committed and
/// says so in `AbortResponse.committed`: the question a source asks when
/// it did not hear the Commit's answer, or comes back from a crash after
/// its Release.
pub const PEER_PROTOCOL_DECIDED: u32 = 11;

/// Picks the highest version both sides speak.
pub fn negotiate_peer_version(theirs: &[u32]) -> Option<u32> {
    PEER_PROTOCOL_VERSIONS
        .iter()
        .rev()
        .find(|v| theirs.contains(v))
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_picks_highest_common_version() {
        assert_eq!(negotiate_peer_version(&[2, 12]), Some(2));
        assert_eq!(negotiate_peer_version(&[2, 3]), Some(3));
        assert_eq!(negotiate_peer_version(&[3]), Some(3));
        assert_eq!(negotiate_peer_version(&[2, 3, 4]), Some(4));
        assert_eq!(negotiate_peer_version(&[3, 4, 5]), Some(5));
        assert_eq!(negotiate_peer_version(&[3, 4]), Some(4));
        assert_eq!(negotiate_peer_version(&[5, 6]), Some(6));
        assert_eq!(negotiate_peer_version(&[5, 6, 7]), Some(7));
        assert_eq!(negotiate_peer_version(&[5, 6, 7, 8]), Some(8));
        assert_eq!(negotiate_peer_version(&[5, 6, 7, 8, 9]), Some(9));
        assert_eq!(negotiate_peer_version(&[5, 6, 7, 8, 9, 10]), Some(10));
        assert_eq!(
            negotiate_peer_version(&[5, 6, 7, 8, 9, 10, 11, 12]),
            Some(11)
        );
        assert_eq!(negotiate_peer_version(&[1, 12]), None);
        assert_eq!(negotiate_peer_version(&[]), None);
    }
}
