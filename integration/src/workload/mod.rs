//! Test workloads: what runs on the nodes (`ferry-echo-server` and
//! `ferry-dve-server`, binaries of this crate) and what drives and checks it from the clients.

pub mod line;
pub mod pattern;
pub mod probe;
pub mod report;
pub mod seq_client;
pub mod udp_client;

pub use line::request_line;
pub use probe::ProbeConnection;
pub use report::{ConnReport, Gap, SeqReport, StreamError, StreamErrorKind};
pub use seq_client::{SeqClient, SeqError, SeqSnapshot};
pub use udp_client::{UdpClientReport, UdpClients, UdpReport};
