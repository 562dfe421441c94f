//! The services served beside `Control` so that generic gRPC tools work
//! without ferry's `.proto` files: health checking (`grpc.health.v1`) for
//! load balancers and supervisors, and server reflection (`v1` and the
//! older `v1alpha` that some clients still ask for first) for `grpcurl`.
//!
//! ```text
//! grpcurl -plaintext 198.19.0.1:7200 list
//! grpcurl -plaintext 198.19.0.1:7200 grpc.health.v1.Health/Check
//! ```

use ferry_proto::v1::control_server::ControlServer;
use tonic::service::Routes;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use super::ControlService;

/// The fully qualified name of the Control service, as health checks and
/// reflection name it.
pub const CONTROL_SERVICE: &str = "ferry.v1.Control";

/// What reflection lists: exactly what the Control listener serves (the
/// descriptor set also holds Peer and Balance, which are served on the peer
/// port only).
pub const ADVERTISED_SERVICES: &[&str] = &[
    CONTROL_SERVICE,
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

#[derive(Debug, thiserror::Error)]
pub enum IntrospectionError {
    #[error("building the reflection service from the file descriptor sets: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

/// The health state of the Control listeners, shared by all of them.
#[derive(Debug, Clone)]
pub struct Health {
    reporter: HealthReporter,
}

impl Health {
    /// Marks `ferry.v1.Control` (and the server as a whole, the empty
    /// service name) as serving or not.
    pub async fn set_serving(&self, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.reporter
            .set_service_status(CONTROL_SERVICE, status)
            .await;
        self.reporter.set_service_status("", status).await;
    }
}

/// Control, health and reflection, ready to add to a server builder
/// (`Server::builder().add_routes(routes)`). The routes can be cloned for
/// each listener (Unix socket, TCP); they share one [`Health`].
pub fn control_routes(control: ControlService) -> Result<(Routes, Health), IntrospectionError> {
    let (reporter, health_service) = tonic_health::server::health_reporter();
    let routes = Routes::new(ControlServer::new(control))
        .add_service(health_service)
        .add_service(reflection().build_v1()?)
        .add_service(reflection().build_v1alpha()?);
    Ok((routes, Health { reporter }))
}

fn reflection() -> tonic_reflection::server::Builder<'static> {
    let mut builder = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ferry_proto::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        // Each version's builder adds its own descriptors; both are
        // registered so that either endpoint describes both names it lists.
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET);
    for name in ADVERTISED_SERVICES {
        builder = builder.with_service_name(*name);
    }
    builder
}
