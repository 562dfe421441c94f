//! Cluster security end to end (docs/api.md, "Security"): who may use the
//! Control API on TCP and with which role, who may speak on the Peer port,
//! who may join membership. The harness runs the cluster with TLS (its
//! certificates made by `ferry cert`'s code). Root only; run by
//! `cargo xtask integration -- security`.

use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use ferry_agent::security::Role;
use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{self, runtime};
use ferry_integration::peer::{self, block_on_in};
use ferry_integration::tls::ClusterTls;
use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{
    HelloRequest, ListNodesRequest, ListProcessesRequest, MigrateRequest, PrepareRequest,
    SetBalancerRequest, Strategy,
};
use tonic::Code;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

const CONTROL_PORT: u16 = 7200;
const ECHO_PORT: u16 = 7000;

fn echo_server_bin() -> String {
    env!("CARGO_BIN_EXE_ferry-echo-server").to_owned()
}

/// A request carrying `authorization: Bearer <token>` when given one.
fn req<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

/// A Control client of `addr` over TLS (`tls`); connecting can fail when
/// the handshake does.
async fn control_tcp(
    addr: SocketAddrV4,
    tls: ClientTlsConfig,
) -> Result<ControlClient<Channel>, String> {
    let channel = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(ControlClient::new(channel))
}

/// What a ListNodes call from node2 to node1's control_listen ended in:
/// Ok, a status code, or a connection failure.
fn list_nodes_as(
    cluster: &Cluster,
    tls: ClientTlsConfig,
    token: Option<String>,
) -> Result<Result<usize, (Code, String)>, String> {
    let addr = SocketAddrV4::new(cluster.node_cluster_addr("node1"), CONTROL_PORT);
    block_on_in(&cluster.netns_path("node2"), || async move {
        let mut c = control_tcp(addr, tls).await?;
        Ok(c.list_nodes(req(ListNodesRequest {}, token.as_deref()))
            .await
            .map(|r| r.into_inner().nodes.len())
            .map_err(|s| (s.code(), s.message().to_owned())))
    })
    .expect("node2's namespace")
}

/// A CA the cluster does not know, with a certificate for `node` and the
/// observer and operator clients.
fn rogue(cluster: &Cluster, node: &str) -> ClusterTls {
    let ip = cluster.node_cluster_addr(node);
    ClusterTls::generate(
        &cluster.dir().join("rogue"),
        &[(node.to_owned(), ip.into())],
    )
    .expect("rogue CA")
}

/// A rogue certificate's client configuration, trusting the real CA (so
/// the server is verified and only the client is foreign).
fn rogue_client(
    real: &ClusterTls,
    rogue: &ClusterTls,
    server: &str,
    stem: &str,
) -> ClientTlsConfig {
    let (cert, key) = rogue.files(stem);
    ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(
            std::fs::read(real.ca_cert()).unwrap(),
        ))
        .identity(tonic::transport::Identity::from_pem(
            std::fs::read(cert).unwrap(),
            std::fs::read(key).unwrap(),
        ))
        .domain_name(server)
}

#[test]
fn control_api_on_tcp_wants_credentials_and_roles_gate_what_they_allow() {
    if !ferry_integration::can_run(
        "control_api_on_tcp_wants_credentials_and_roles_gate_what_they_allow",
    ) {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec {
        extra_config: format!("control_listen = \"0.0.0.0:{CONTROL_PORT}\"\n"),
        ..ClusterSpec::new(2, 0)
    })
    .expect("cluster");
    let tls = cluster.tls().expect("the harness runs with TLS").clone();

    // The local CLI's door needs nothing: the Unix socket is operator.
    let pid = rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control socket");
        let pid = managed::run(
            &mut node1,
            vec![echo_server_bin(), "--port".into(), ECHO_PORT.to_string()],
        )
        .await;
        managed::wait_for_process(&mut node1, pid, |p| p.tcp_listening == 1).await;
        pid
    });

    // No certificate, no token: UNAUTHENTICATED, saying what is missing.
    let r = list_nodes_as(&cluster, tls.client("node1", None), None)
        .expect("TLS without a client certificate connects");
    match r {
        Err((Code::Unauthenticated, m)) => assert!(m.contains("no credentials"), "{m}"),
        other => panic!("no credentials: {other:?}"),
    }
    // A token nobody issued.
    let r = list_nodes_as(
        &cluster,
        tls.client("node1", None),
        Some("not-a-token".into()),
    )
    .expect("connects");
    assert!(matches!(r, Err((Code::Unauthenticated, _))), "{r:?}");
    // Plaintext on the TLS port: no gRPC at all.
    let addr = SocketAddrV4::new(cluster.node_cluster_addr("node1"), CONTROL_PORT);
    let plain = block_on_in(&cluster.netns_path("node2"), || async move {
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        ControlClient::new(channel)
            .list_nodes(ListNodesRequest {})
            .await
            .map(|_| ())
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
    })
    .unwrap();
    assert!(plain.is_err(), "plaintext answered: {plain:?}");
    // A certificate of another CA: the handshake fails (the server's alert
    // reaches the client as a transport error: no gRPC status at all).
    let other = rogue(&cluster, "node2");
    let r = list_nodes_as(
        &cluster,
        rogue_client(&tls, &other, "node1", "operator"),
        None,
    );
    assert!(
        matches!(
            &r,
            Err(_)
                | Ok(Err((
                    Code::Unavailable | Code::Unknown | Code::Cancelled,
                    _
                )))
        ),
        "a foreign CA's client certificate was accepted: {r:?}"
    );

    // Observer (certificate, then token): reads, cannot migrate or steer.
    let observers = [
        (tls.client("node1", Some("observer")), None),
        (
            tls.client("node1", None),
            Some(tls.token(Role::Observer).to_owned()),
        ),
    ];
    for (client, token) in observers {
        let what = if token.is_some() {
            "token"
        } else {
            "certificate"
        };
        let (nodes, procs, migrate, balancer) =
            block_on_in(&cluster.netns_path("node2"), || async move {
                let mut c = control_tcp(addr, client).await.expect("observer connects");
                let t = token.as_deref();
                let nodes = c.list_nodes(req(ListNodesRequest {}, t)).await;
                let procs = c
                    .list_processes(req(ListProcessesRequest::default(), t))
                    .await;
                let migrate = c
                    .migrate(req(
                        MigrateRequest {
                            pid,
                            destination_node: "node2".into(),
                            strategy: Strategy::TotalCopy as i32,
                            sockets: 0,
                            ..Default::default()
                        },
                        t,
                    ))
                    .await
                    .map(|_| ());
                let balancer = c
                    .set_balancer(req(
                        SetBalancerRequest {
                            enabled: Some(true),
                            ..Default::default()
                        },
                        t,
                    ))
                    .await
                    .map(|_| ());
                // The new operator calls, through forwarding too.
                let drain = c
                    .drain_node(req(
                        ferry_proto::v1::DrainNodeRequest {
                            node: "node1".into(),
                            ..Default::default()
                        },
                        t,
                    ))
                    .await
                    .map(|_| ());
                let cordon = c
                    .set_cordon(req(
                        ferry_proto::v1::SetCordonRequest {
                            node: "node1".into(),
                            cordoned: true,
                        },
                        t,
                    ))
                    .await
                    .map(|_| ());
                let cancel = c
                    .cancel_migration(req(
                        ferry_proto::v1::CancelMigrationRequest {
                            migration_id: "0123456789abcdef".into(),
                            ..Default::default()
                        },
                        t,
                    ))
                    .await
                    .map(|_| ());
                let cancel_drain = c
                    .cancel_drain(req(ferry_proto::v1::CancelDrainRequest::default(), t))
                    .await
                    .map(|_| ());
                let adopt = c
                    .adopt_process(req(
                        ferry_proto::v1::AdoptProcessRequest {
                            pid,
                            node: String::new(),
                        },
                        t,
                    ))
                    .await
                    .map(|_| ());
                let signal = c
                    .signal_process(req(
                        ferry_proto::v1::SignalProcessRequest {
                            pid,
                            signal: libc::SIGKILL,
                            node: String::new(),
                        },
                        t,
                    ))
                    .await
                    .map(|_| ());
                // Watching is reading.
                let watch = c
                    .watch_events(req(ferry_proto::v1::WatchEventsRequest::default(), t))
                    .await
                    .map(|_| ());
                let wait = c
                    .wait_process(req(
                        ferry_proto::v1::WaitProcessRequest {
                            pid,
                            node: String::new(),
                        },
                        t,
                    ))
                    .await
                    .map(|_| ());
                for (call, r) in [
                    ("drain", drain),
                    ("cordon", cordon),
                    ("cancel", cancel),
                    ("cancel drain", cancel_drain),
                    ("adopt", adopt),
                    ("signal", signal),
                ] {
                    let e = r.expect_err(call);
                    assert_eq!(e.code(), Code::PermissionDenied, "{call}: {e:?}");
                }
                watch.expect("an observer watches events");
                wait.expect("an observer waits for a process");
                (nodes, procs, migrate, balancer)
            })
            .unwrap();
        assert_eq!(
            nodes
                .expect("observer lists nodes")
                .into_inner()
                .nodes
                .len(),
            2,
            "{what}"
        );
        let procs = procs
            .expect("observer lists processes")
            .into_inner()
            .processes;
        assert!(procs.iter().any(|p| p.pid == pid), "{what}: {procs:?}");
        let e = migrate.expect_err("an observer migrated");
        assert_eq!(e.code(), Code::PermissionDenied, "{what}: {e:?}");
        assert!(e.message().contains("needs role operator"), "{what}: {e:?}");
        let e = balancer.expect_err("an observer changed the balancer");
        assert_eq!(e.code(), Code::PermissionDenied, "{what}: {e:?}");
    }
    assert_eq!(
        cluster.node_of_pid(pid).expect("where is it").as_deref(),
        Some("node1"),
        "refused migrations left the process alone"
    );

    // Operator (certificate): migrates.
    let client = tls.client("node1", Some("operator"));
    let (report, status) = block_on_in(&cluster.netns_path("node2"), || async move {
        let mut c = control_tcp(addr, client).await.expect("operator connects");
        managed::migrate(&mut c, pid, "node2").await
    })
    .unwrap()
    .expect("an operator may migrate");
    assert!(
        status.is_none(),
        "migration failed: {status:?} {report:#?}\n{}",
        cluster.log_tail("node1", 40)
    );
    let moved = report.destination_pid;
    assert_eq!(
        cluster.node_of_pid(moved).expect("where is it").as_deref(),
        Some("node2")
    );
    // The operator token works as well (a read here: the role covers it).
    let r = list_nodes_as(
        &cluster,
        tls.client("node1", None),
        Some(tls.token(Role::Operator).to_owned()),
    )
    .expect("connects");
    assert_eq!(r, Ok(2));

    // The CLI reaches the same listener from another node: an observer's
    // token reads, and is refused a migration; an operator's certificate
    // migrates the process back.
    let ferry = |creds: &[String], rest: &[&str]| {
        let out = std::process::Command::new("nsenter")
            .arg(format!("--net={}", cluster.netns_path("node2").display()))
            .arg(ferry_integration::bin_path("ferry"))
            .args([
                "--agent",
                &addr.to_string(),
                "--agent-name",
                "node1",
                "--ca",
            ])
            .arg(tls.ca_cert())
            .args(creds)
            .args(rest)
            .output()
            .expect("running ferry");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let observer = ["--token".to_owned(), tls.token(Role::Observer).to_owned()];
    let (ok, stdout, stderr) = ferry(&observer, &["--json", "nodes"]);
    assert!(ok, "ferry nodes as observer: {stderr}");
    assert!(
        stdout.contains("node1") && stdout.contains("node2"),
        "{stdout}"
    );
    let moved_s = moved.to_string();
    let (ok, _, stderr) = ferry(&observer, &["migrate", &moved_s, "--to", "node1"]);
    assert!(!ok && stderr.contains("PermissionDenied"), "{stderr}");
    let (cert, key) = tls.files("operator");
    let operator = [
        "--cert".to_owned(),
        cert.display().to_string(),
        "--key".to_owned(),
        key.display().to_string(),
    ];
    // node1's agent answers for its own processes: the moved one is on
    // node2 now, so node1 refuses it as not managed there, after
    // authenticating the operator.
    let (ok, _, stderr) = ferry(&operator, &["migrate", &moved_s, "--to", "node2"]);
    assert!(!ok && stderr.contains("not managed"), "{stderr}");
    // Without credentials the CLI says what it needs before connecting.
    let (ok, _, stderr) = ferry(&[], &["nodes"]);
    assert!(!ok && stderr.contains("--token"), "{stderr}");
}

#[test]
fn a_forged_peer_cannot_push_a_migration() {
    if !ferry_integration::can_run("a_forged_peer_cannot_push_a_migration") {
        return;
    }
    let cluster = Cluster::start(ClusterSpec::new(2, 0)).expect("cluster");
    let tls = cluster.tls().expect("the harness runs with TLS").clone();
    let addr = cluster.peer_addr("node1");
    let other = rogue(&cluster, "node2");

    // Hello then Prepare, as a source would, from node2's namespace.
    let push = |client: Option<ClientTlsConfig>| -> Result<(), String> {
        block_on_in(&cluster.netns_path("node2"), || async move {
            let mut p = peer::connect(addr, client)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            p.hello(HelloRequest {
                node: "node2".into(),
                protocol_versions: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
            })
            .await
            .map_err(|s| format!("Hello: {:?}: {}", s.code(), s.message()))?;
            p.prepare(PrepareRequest {
                migration_id: "forged".into(),
                source_node: "node2".into(),
                protocol_version: ferry_proto::PEER_PROTOCOL_VERSIONS[0],
                ..Default::default()
            })
            .await
            .map_err(|s| format!("Prepare: {:?}: {}", s.code(), s.message()))?;
            Ok(())
        })
        .expect("node2's namespace")
    };

    let attempts: Vec<(&str, Option<ClientTlsConfig>)> = vec![
        ("plaintext", None),
        ("no client certificate", Some(tls.client("node1", None))),
        (
            "a node certificate of another CA",
            Some(rogue_client(&tls, &other, "node1", "node2")),
        ),
        (
            "a control client's certificate of the cluster CA",
            Some(tls.client("node1", Some("operator"))),
        ),
    ];
    for (what, client) in attempts {
        let r = push(client);
        eprintln!("{what}: {r:?}");
        let e = r.expect_err(&format!("{what}: pushed a migration"));
        if what.starts_with("a control client") {
            // Past the handshake (same CA), stopped by the node check.
            assert!(
                e.contains("PermissionDenied") && e.contains("not a node certificate"),
                "{what}: {e}"
            );
        }
    }
    // A real node speaks only for itself: node2's own certificate, claiming
    // to be another node.
    let impersonation = block_on_in(&cluster.netns_path("node2"), || {
        let client = tls.client("node1", Some("node2"));
        async move {
            let mut p = peer::connect(addr, Some(client))
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let hello = p
                .hello(HelloRequest {
                    node: "node9".into(),
                    protocol_versions: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
                })
                .await
                .map(|_| ())
                .map_err(|s| (s.code(), s.message().to_owned()));
            let prepare = p
                .prepare(PrepareRequest {
                    migration_id: "impersonated".into(),
                    source_node: "node9".into(),
                    protocol_version: ferry_proto::PEER_PROTOCOL_VERSIONS[0],
                    ..Default::default()
                })
                .await
                .map(|_| ())
                .map_err(|s| (s.code(), s.message().to_owned()));
            Ok::<_, String>((hello, prepare))
        }
    })
    .expect("node2's namespace")
    .expect("connected with node2's certificate");
    for (what, r) in [("Hello", impersonation.0), ("Prepare", impersonation.1)] {
        let (code, message) = r.expect_err(&format!("{what} as node9 with node2's certificate"));
        assert_eq!(code, tonic::Code::PermissionDenied, "{what}: {message}");
        assert!(
            message.contains("node2") && message.contains("node9"),
            "{what}: {message}"
        );
    }
    assert!(cluster.incoming_dir_is_empty("node1"));
    // The slot is free: the real node2 can still reserve it.
    let mut r = cluster
        .reserve_destination("node2", "node1", "real")
        .expect("the real node2 reserves node1");
    // Another member (node1's own certificate here) cannot feed node2's
    // migration: not its pages, not its images, not its page tunnel.
    let intruder = block_on_in(&cluster.netns_path("node2"), || {
        let client = tls.client("node1", Some("node1"));
        async move {
            let mut p = peer::connect(addr, Some(client))
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let status = |r: Result<_, tonic::Status>| match r {
                Ok(_) => (Code::Ok, String::new()),
                Err(s) => (s.code(), s.message().to_owned()),
            };
            let pages = p
                .transfer_pages(tokio_stream::iter(vec![ferry_proto::v1::PageBatch {
                    migration_id: "real".into(),
                    ..Default::default()
                }]))
                .await;
            let images = p
                .transfer_images(tokio_stream::iter(vec![ferry_proto::v1::ImageChunk {
                    migration_id: "real".into(),
                    ..Default::default()
                }]))
                .await;
            let tunnel = p
                .page_tunnel(tokio_stream::iter(vec![ferry_proto::v1::TunnelBytes {
                    migration_id: "real".into(),
                    data: Vec::new(),
                }]))
                .await;
            Ok::<_, String>(vec![
                ("TransferPages", status(pages.map(|_| ()))),
                ("TransferImages", status(images.map(|_| ()))),
                ("PageTunnel", status(tunnel.map(|_| ()))),
            ])
        }
    })
    .expect("node2's namespace")
    .expect("connected with node1's certificate");
    for (what, (code, message)) in intruder {
        assert_eq!(code, Code::PermissionDenied, "{what}: {message}");
        assert!(
            message.contains("node2") && message.contains("node1"),
            "{what}: {message}"
        );
    }
    r.release().expect("released");
}

#[test]
fn a_node_without_the_cluster_key_never_joins() {
    if !ferry_integration::can_run("a_node_without_the_cluster_key_never_joins") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec {
        static_peers: false,
        tls_outsiders: vec!["node3".into()],
        extra_config:
            "\n[membership]\nenabled = true\nbeacon_interval_ms = 200\nprobe_period_ms = 200\n"
                .into(),
        ..ClusterSpec::new(3, 0)
    })
    .expect("cluster");

    let names = |node: &'static str| {
        let mut c = cluster.control_lazy(node);
        async move {
            c.list_nodes(ListNodesRequest {})
                .await
                .expect("ListNodes")
                .into_inner()
                .nodes
                .into_iter()
                .filter(|n| !n.is_self)
                .map(|n| (n.name, n.membership_state))
                .collect::<Vec<_>>()
        }
    };
    // node1 and node2 find each other (sealed beacons and SWIM work);
    // node3 hears them and they hear node3, but nobody accepts anyone
    // across the two keys. Watch for a while: node3 must never show up.
    let t0 = Instant::now();
    let mut joined = false;
    while t0.elapsed() < Duration::from_secs(6) {
        let (n1, n2, n3) = rt.block_on(async {
            (
                names("node1").await,
                names("node2").await,
                names("node3").await,
            )
        });
        assert!(
            !n1.iter().any(|(n, _)| n == "node3"),
            "node3 joined node1: {n1:?}"
        );
        assert!(
            !n2.iter().any(|(n, _)| n == "node3"),
            "node3 joined node2: {n2:?}"
        );
        assert!(n3.is_empty(), "node3 sees members: {n3:?}");
        joined |= n1.iter().any(|(n, s)| n == "node2" && s == "alive");
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(
        joined,
        "node1 and node2 never formed a membership\n{}",
        cluster.log_tail("node1", 30)
    );
    let log = std::fs::read_to_string(cluster.log_path("node1")).unwrap_or_default();
    assert!(
        log.contains("membership datagram rejected") && log.contains("no valid MAC"),
        "node1 did not log the rejected datagrams:\n{}",
        cluster.log_tail("node1", 30)
    );
}
