//! What operators and generic tools see of a running agent: gRPC health and
//! reflection on both Control listeners, without ferry's .proto files.
//! Root only; run by `cargo xtask test` (or `cargo xtask integration --
//! observability`).

use std::net::SocketAddrV4;
use std::time::Duration;

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::runtime;
use ferry_integration::peer::block_on_in;
use ferry_integration::reflection::{self, ReflectionError};
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::health_check_response::ServingStatus;

/// Where the agents also serve Control on TCP (every node, its own netns).
const CONTROL_PORT: u16 = 7200;

/// Everything a `grpcurl list` + `describe` + health check shows, through
/// one channel to an agent.
async fn introspect(channel: Channel) -> Result<Introspection, ReflectionError> {
    let services = reflection::list_services(channel.clone()).await?;
    let files = reflection::file_containing_symbol(channel.clone(), "ferry.v1.Control").await?;
    let control_methods = files
        .iter()
        .filter(|f| f.package() == "ferry.v1")
        .flat_map(|f| &f.service)
        .filter(|s| s.name() == "Control")
        .flat_map(|s| &s.method)
        .map(|m| m.name().to_owned())
        .collect();
    // The imports, fetched by name as grpcurl does, so that a client can
    // build every message.
    let mut imports = Vec::new();
    for f in &files {
        for dep in &f.dependency {
            let got = reflection::file_by_filename(channel.clone(), dep).await?;
            imports.extend(got.iter().map(|f| f.name().to_owned()));
        }
    }
    let files = files
        .iter()
        .map(|f| f.name().to_owned())
        .chain(imports)
        .collect();
    let server = reflection::health_check(channel.clone(), "").await?;
    let control = reflection::health_check(channel.clone(), "ferry.v1.Control").await?;
    let unknown = reflection::health_check(channel, "ferry.v1.Nope").await;
    Ok(Introspection {
        services,
        control_methods,
        files,
        health: (server, control),
        unknown_service: unknown.map_err(|e| match e {
            ReflectionError::Rpc { source, .. } => source.code(),
            other => panic!("health check of an unknown service: {other}"),
        }),
    })
}

#[derive(Debug)]
struct Introspection {
    services: Vec<String>,
    control_methods: Vec<String>,
    files: Vec<String>,
    health: (ServingStatus, ServingStatus),
    unknown_service: Result<ServingStatus, tonic::Code>,
}

fn check(what: &str, seen: &Introspection) {
    for service in [
        "ferry.v1.Control",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(
            seen.services.iter().any(|s| s == service),
            "{what}: {service} not listed: {seen:#?}"
        );
    }
    // Only what this listener serves: Peer and Balance are the peer port's.
    assert!(
        !seen
            .services
            .iter()
            .any(|s| s == "ferry.v1.Peer" || s == "ferry.v1.Balance"),
        "{what}: lists a service it does not serve: {seen:#?}"
    );
    for method in ["ListNodes", "Migrate", "GetMigration", "SetBalancer"] {
        assert!(
            seen.control_methods.iter().any(|m| m == method),
            "{what}: Control's descriptor lacks {method}: {seen:#?}"
        );
    }
    assert!(
        seen.files.iter().any(|f| f == "ferry/v1/common.proto"),
        "{what}: imports of control.proto not found by name: {seen:#?}"
    );
    assert_eq!(
        seen.health,
        (ServingStatus::Serving, ServingStatus::Serving),
        "{what}: {seen:#?}"
    );
    assert_eq!(
        seen.unknown_service,
        Err(tonic::Code::NotFound),
        "{what}: {seen:#?}"
    );
}

#[test]
fn reflection_and_health_answer_on_both_control_listeners() {
    if !ferry_integration::can_run("reflection_and_health_answer_on_both_control_listeners") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec {
        extra_config: format!("control_listen = \"0.0.0.0:{CONTROL_PORT}\"\n"),
        ..ClusterSpec::new(2, 0)
    })
    .expect("cluster");

    // The local door: the root-only Unix socket.
    let seen = rt.block_on(async {
        let channel = ferry_integration::control::channel(cluster.control_socket("node1"))
            .await
            .expect("control socket");
        introspect(channel).await.expect("introspection")
    });
    check("control socket", &seen);

    // A remote scheduler's door: TCP, from another node's namespace.
    let addr = SocketAddrV4::new(cluster.node_cluster_addr("node1"), CONTROL_PORT);
    let seen = block_on_in(&cluster.netns_path("node2"), || async move {
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .expect("a socket address makes a URI")
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
        introspect(channel).await.expect("introspection over TCP")
    })
    .expect("node2's namespace");
    check("control over TCP", &seen);
}
