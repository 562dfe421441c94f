//! gRPC services: thin handlers that validate input and delegate to the
//! engine.

mod control;
mod peer;

pub use control::ControlService;
pub use peer::PeerService;
