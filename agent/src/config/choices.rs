//! The choices an operator makes in the configuration, and a request may
//! make again: how a migration moves memory and connections, and what a
//! Control token may do. They are defined here, beside the settings, so
//! that the configuration depends on nothing else of ferryd; the engine,
//! the socket code and the security layer use them from here.

use ferry_proto::v1 as pb;
use serde::{Deserialize, Serialize};

/// How a migration moves the process's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryStrategy {
    /// Everything in the freeze.
    #[default]
    TotalCopy,
    PreCopy,
    QueuedPreCopy,
    /// Nothing of the private memory in the freeze: the process resumes
    /// on the destination, its pages follow (CRIU lazy pages; see
    /// `crate::engine`).
    PostCopy,
    /// One full pre-copy pass while the process runs, then post-copy: the
    /// destination serves the pages of that pass that are still current
    /// itself, and only the rest comes from the source after the resume.
    AssistedPostCopy,
}

impl MemoryStrategy {
    pub fn to_pb(self) -> pb::Strategy {
        match self {
            MemoryStrategy::TotalCopy => pb::Strategy::TotalCopy,
            MemoryStrategy::PreCopy => pb::Strategy::PreCopy,
            MemoryStrategy::QueuedPreCopy => pb::Strategy::QueuedPreCopy,
            MemoryStrategy::PostCopy => pb::Strategy::PostCopy,
            MemoryStrategy::AssistedPostCopy => pb::Strategy::AssistedPostCopy,
        }
    }

    /// None for UNSPECIFIED (the agent's default).
    pub fn from_pb(s: pb::Strategy) -> Option<Self> {
        match s {
            pb::Strategy::Unspecified => None,
            pb::Strategy::TotalCopy => Some(MemoryStrategy::TotalCopy),
            pb::Strategy::PreCopy => Some(MemoryStrategy::PreCopy),
            pb::Strategy::QueuedPreCopy => Some(MemoryStrategy::QueuedPreCopy),
            pb::Strategy::PostCopy => Some(MemoryStrategy::PostCopy),
            pb::Strategy::AssistedPostCopy => Some(MemoryStrategy::AssistedPostCopy),
        }
    }

    /// Whether pages cross in rounds before the freeze (assisted post-copy
    /// has one).
    pub fn is_precopy(self) -> bool {
        matches!(
            self,
            MemoryStrategy::PreCopy
                | MemoryStrategy::QueuedPreCopy
                | MemoryStrategy::AssistedPostCopy
        )
    }

    /// Whether pages cross after the resume on the destination.
    pub fn is_postcopy(self) -> bool {
        matches!(
            self,
            MemoryStrategy::PostCopy | MemoryStrategy::AssistedPostCopy
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            MemoryStrategy::TotalCopy => "total-copy",
            MemoryStrategy::PreCopy => "pre-copy",
            MemoryStrategy::QueuedPreCopy => "queued-pre-copy",
            MemoryStrategy::PostCopy => "post-copy",
            MemoryStrategy::AssistedPostCopy => "assisted-post-copy",
        }
    }
}

/// Who moves a post-copy's pages after the resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PostCopyPages {
    /// ferryd: the dump leaves the pages in the stopped copy, the source's
    /// ferryd streams them after the resume (faulted ones first), the
    /// destination's page filler installs them with several threads
    /// (`engine::destination::pages_follow`). Needs ferry's CRIU and a
    /// destination speaking peer protocol 10; CRIU's otherwise.
    #[default]
    Ferryd,
    /// CRIU's page server and lazy-pages daemon (the dump moves every page
    /// into pipes inside the freeze).
    Criu,
}

/// How a migration moves the process's TCP connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SocketMigration {
    /// CRIU's own path: one connection at a time, one image file each.
    Iterative,
    /// ferryd's: all connections in one batch (`crate::sockstate`).
    Collective,
    /// Collective, with what does not move read before the freeze and
    /// read again only where a setsockopt call was seen (`crate::sockstate::preread`).
    Incremental,
}

impl SocketMigration {
    pub fn name(self) -> &'static str {
        match self {
            Self::Iterative => "iterative",
            Self::Collective => "collective",
            Self::Incremental => "incremental",
        }
    }

    pub fn to_pb(self) -> pb::SocketMigration {
        match self {
            Self::Iterative => pb::SocketMigration::Iterative,
            Self::Collective => pb::SocketMigration::Collective,
            Self::Incremental => pb::SocketMigration::Incremental,
        }
    }

    /// Whether ferryd moves the connections (collective, incremental or
    /// not).
    pub fn is_collective(self) -> bool {
        self != Self::Iterative
    }
}

/// What the Control API lets a client do. Ordered: an operator may do
/// everything an observer may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Read-only RPCs: nodes, processes, reports, data plane, balancer.
    Observer,
    /// Everything: migrate, run, change the balancer's policy.
    Operator,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Observer => "observer",
            Role::Operator => "operator",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "observer" => Some(Role::Observer),
            "operator" => Some(Role::Operator),
            _ => None,
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether the pages that cross the cluster link are compressed
/// (`[migration] compression`; `engine::compression`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Compression {
    /// As they are.
    #[default]
    Off,
    /// LZ4, where the destination takes it: for links slower than the
    /// source compresses (1 Gb/s and below here) and pages that compress.
    Lz4,
}
