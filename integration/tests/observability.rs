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
    // With TLS (the harness's default) as an observer: health and
    // reflection are read-only.
    let addr = SocketAddrV4::new(cluster.node_cluster_addr("node1"), CONTROL_PORT);
    let tls = cluster.tls().map(|t| t.client("node1", Some("observer")));
    let seen = block_on_in(&cluster.netns_path("node2"), || async move {
        let endpoint = match tls {
            Some(tls) => Endpoint::from_shared(format!("https://{addr}"))
                .expect("a socket address makes a URI")
                .tls_config(tls)
                .expect("TLS client"),
            None => Endpoint::from_shared(format!("http://{addr}"))
                .expect("a socket address makes a URI"),
        };
        let channel = endpoint
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
        introspect(channel).await.expect("introspection over TCP")
    })
    .expect("node2's namespace");
    check("control over TCP", &seen);

    // The real grpcurl too (`cargo xtask setup` builds it: Debian has no
    // package of it), over the root-only Unix socket.
    let grpcurl = grpcurl();
    if ferry_testkit::skip(
        "reflection_and_health_answer_on_both_control_listeners (grpcurl)",
        grpcurl.is_none().then(|| {
            format!("no grpcurl at $FERRY_GRPCURL, on PATH or at {DEFAULT_GRPCURL} (cargo xtask setup builds it)")
        }),
    ) {
        return;
    }
    let grpcurl = grpcurl.expect("checked above");
    let socket = cluster.control_socket("node1");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(&grpcurl)
            .args(["-plaintext", "-unix"])
            .arg(socket)
            .args(args)
            .output()
            .expect("running grpcurl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "grpcurl {args:?}: {}\n{text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let list = run(&["list"]);
    assert!(
        list.lines().any(|l| l == "ferry.v1.Control")
            && list.lines().any(|l| l == "grpc.health.v1.Health"),
        "{list}"
    );
    let methods = run(&["describe", "ferry.v1.Control"]);
    assert!(methods.contains("rpc Migrate"), "{methods}");
    let health = run(&["grpc.health.v1.Health/Check"]);
    assert!(health.contains("SERVING"), "{health}");
    let nodes = run(&["ferry.v1.Control/ListNodes"]);
    assert!(nodes.contains("\"node2\""), "{nodes}");
}

/// Where `cargo xtask setup` builds grpcurl.
const DEFAULT_GRPCURL: &str = "/opt/ferry/grpcurl/bin/grpcurl";

/// grpcurl at `$FERRY_GRPCURL` (set by `cargo xtask test`), on PATH, or
/// where setup builds it.
fn grpcurl() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("FERRY_GRPCURL") {
        let p = std::path::PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("grpcurl"))
                .find(|p| p.is_file())
        })
        .or_else(|| {
            let p = std::path::PathBuf::from(DEFAULT_GRPCURL);
            p.is_file().then_some(p)
        })
}

/// Where the agents serve `/metrics` (every node, its own netns).
const METRICS_PORT: u16 = 9464;
const ECHO_PORT: u16 = 7000;

/// Debian's Prometheus scrapes both agents; after one migration its query
/// API gives the migration count and a freeze-time quantile that agrees
/// with the migration's own report.
#[test]
fn prometheus_scrapes_migration_count_and_freeze_quantile() {
    use ferry_integration::managed::{migrate, run, wait_for_process};
    use ferry_integration::prometheus::{PrometheusServer, Sample};
    use ferry_proto::v1::MigrationOutcome;

    if !ferry_integration::can_run("prometheus_scrapes_migration_count_and_freeze_quantile") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec {
        extra_config: format!("metrics.listen = \"0.0.0.0:{METRICS_PORT}\"\n"),
        ..ClusterSpec::new(2, 0)
    })
    .expect("cluster");
    let targets: Vec<SocketAddrV4> = ["node1", "node2"]
        .iter()
        .map(|n| SocketAddrV4::new(cluster.node_cluster_addr(n), METRICS_PORT))
        .collect();
    let prom = PrometheusServer::start(
        &cluster.netns_path("node2"),
        &targets,
        Duration::from_millis(500),
    )
    .expect("prometheus");
    let instance = targets[0].to_string();
    let of_node1 = |samples: &[Sample]| -> Vec<Sample> {
        samples
            .iter()
            .filter(|s| s.label("instance") == Some(instance.as_str()))
            .cloned()
            .collect()
    };

    // Both agents scraped, and the zero before the migration recorded (so
    // that increase() sees the step).
    prom.wait_for("up", Duration::from_secs(20), |s| {
        s.len() == 2 && s.iter().all(|s| s.value == "1")
    });
    prom.wait_for(
        r#"ferry_migrations_total{outcome="committed"}"#,
        Duration::from_secs(20),
        |s| of_node1(s).iter().any(|s| s.value == "0"),
    );

    let report = rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let pid = run(
            &mut node1,
            vec![
                env!("CARGO_BIN_EXE_ferry-echo-server").to_owned(),
                "--port".into(),
                ECHO_PORT.to_string(),
            ],
        )
        .await;
        wait_for_process(&mut node1, pid, |p| p.tcp_listening == 1).await;
        let (report, status) = migrate(&mut node1, pid, "node2")
            .await
            .expect("migration starts");
        assert!(
            status.is_none(),
            "migration failed: {status:?}\n{report:#?}"
        );
        report
    });
    assert_eq!(report.outcome, MigrationOutcome::Committed as i32);
    let freeze = report.freeze_time_us as f64 / 1e6;
    eprintln!("freeze in the report: {freeze} s");

    let count = prom.wait_for(
        r#"sum(ferry_migrations_total{outcome="committed"})"#,
        Duration::from_secs(20),
        |s| s.len() == 1 && s[0].number() == 1.0,
    );
    eprintln!("migration count: {count:?}");
    let quantile = prom.wait_for(
        "histogram_quantile(0.5, sum by (le) (increase(ferry_migration_freeze_seconds_bucket[5m])))",
        Duration::from_secs(20),
        |s| s.len() == 1 && s[0].number().is_finite(),
    );
    let median = quantile[0].number();
    eprintln!("median freeze from Prometheus: {median} s");
    // One observation: Prometheus interpolates inside its bucket, so the
    // answer lies in the bucket that holds the reported freeze.
    // The buckets as ferryd exports them.
    let mut buckets: Vec<f64> = prom
        .query(r#"ferry_migration_freeze_seconds_bucket{outcome="committed"}"#)
        .expect("query")
        .iter()
        .filter_map(|s| s.label("le")?.parse().ok())
        .collect();
    buckets.sort_by(f64::total_cmp);
    buckets.dedup();
    let upper = buckets
        .iter()
        .copied()
        .find(|b| freeze <= *b)
        .unwrap_or(f64::INFINITY);
    let lower = buckets
        .iter()
        .copied()
        .rev()
        .find(|b| *b < freeze)
        .unwrap_or(0.0);
    assert!(
        lower <= median && median <= upper,
        "median {median} s outside the bucket ({lower}, {upper}] of the reported freeze {freeze} s"
    );

    // The node's state is there too: the process moved, and with it the
    // managed-process gauges; the data plane's counters are exported.
    prom.wait_for("ferry_managed_processes", Duration::from_secs(20), |s| {
        let on = |node: &str| {
            s.iter()
                .find(|x| {
                    x.label("instance")
                        == Some(
                            SocketAddrV4::new(cluster.node_cluster_addr(node), METRICS_PORT)
                                .to_string()
                                .as_str(),
                        )
                })
                .map(|x| x.number())
        };
        on("node1") == Some(0.0) && on("node2") == Some(1.0)
    });
    let kinds = prom
        .query(r#"ferry_dataplane_packets_total{instance=~".*"}"#)
        .expect("query");
    for kind in [
        "passed",
        "dropped_not_owned",
        "captured",
        "replayed",
        "translated",
    ] {
        assert!(
            kinds.iter().any(|s| s.label("kind") == Some(kind)),
            "no data-plane counter {kind}: {kinds:?}"
        );
    }
    let info = prom.query("ferry_agent_info").expect("query");
    assert!(
        info.iter().any(|s| s.label("node") == Some("node1")),
        "{info:?}"
    );
}
