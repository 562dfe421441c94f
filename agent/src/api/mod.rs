//! gRPC services: thin handlers that validate input and delegate to the
//! engine.

mod control;
pub mod follow;
pub mod forward;
mod groups;
pub mod introspection;
mod migrate_request;
mod peer;
pub mod watch;

pub use control::{ControlService, apply_settings};
pub use introspection::control_routes;
pub use migrate_request::{drain_options, migrate_options};
pub use peer::PeerService;
