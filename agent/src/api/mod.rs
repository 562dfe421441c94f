//! gRPC services: thin handlers that validate input and delegate to the
//! engine.

mod control;
pub mod introspection;
mod peer;

pub use control::{ControlService, apply_settings};
pub use introspection::control_routes;
pub use peer::PeerService;
