//! gRPC services: thin handlers that validate input and delegate to the
//! engine.

mod control;
pub mod follow;
pub mod forward;
mod groups;
pub mod introspection;
mod peer;
pub mod watch;

pub use control::{ControlService, apply_settings, drain_options, migrate_options};
pub use introspection::control_routes;
pub use peer::PeerService;
